// XXH3-128 (libxxhash), apart from hash.cpp's OpenSSL digests: tools that use only XXH3 (ptk-tokenize's
// sidecars and resume records) do not load libcrypto.
#include <xxhash.h>

#include "common/file_io.h"
#include "common/hash.h"
#include "common/status.h"

namespace ptk {

std::string LowerHex(const unsigned char* d, size_t n) {
  static const char* kHex = "0123456789abcdef";
  std::string s(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    s[2 * i] = kHex[d[i] >> 4];
    s[2 * i + 1] = kHex[d[i] & 15];
  }
  return s;
}

Xxh3::Xxh3() : state_(XXH3_createState()) { XXH3_128bits_reset(static_cast<XXH3_state_t*>(state_)); }
Xxh3::~Xxh3() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }
void Xxh3::Update(const void* data, size_t size) {
  XXH3_128bits_update(static_cast<XXH3_state_t*>(state_), data, size);
}
std::string Xxh3::HexDigest() const {
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, XXH3_128bits_digest(static_cast<XXH3_state_t*>(state_)));
  return LowerHex(c.digest, sizeof(c.digest));
}

std::string Xxh3Hex(std::string_view data) {
  Xxh3 h;
  h.Update(data.data(), data.size());
  return h.HexDigest();
}

absl::StatusOr<std::string> Xxh3FileHex(const std::string& path) {
  Xxh3 h;
  PTK_RETURN_IF_ERROR(ReadFileChunks(path, 1 << 20, [&](const char* p, size_t n) { h.Update(p, n); }));
  return h.HexDigest();
}

}  // namespace ptk
