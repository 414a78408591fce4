// SHA-256 / MD5 / SHA-1 digests.
#include "common/hash.h"

// MD5 names index caches (not a security use). The one-shot MD5() skips the EVP provider set-up,
// about a millisecond and a half on the first EVP call, which the GPTDataset index build would pay.
#define OPENSSL_SUPPRESS_DEPRECATED
#include <openssl/evp.h>
#include <openssl/md5.h>
#include <xxhash.h>

#include "common/file_util.h"

#include "common/status.h"

namespace ptk {
namespace {
std::string ToHex(const unsigned char* d, unsigned n) {
  static const char* kHex = "0123456789abcdef";
  std::string s(2 * n, '0');
  for (unsigned i = 0; i < n; ++i) {
    s[2 * i] = kHex[d[i] >> 4];
    s[2 * i + 1] = kHex[d[i] & 15];
  }
  return s;
}
std::string Digest(const EVP_MD* md, std::string_view data) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned n = 0;
  PTK_CHECK(EVP_Digest(data.data(), data.size(), out, &n, md, nullptr) == 1);
  return ToHex(out, n);
}
}  // namespace

struct Sha256::Impl {
  EVP_MD_CTX* ctx = nullptr;
  const EVP_MD* md = nullptr;
};

Sha256::Sha256(Algorithm algo) : impl_(new Impl) {
  impl_->md = algo == Algorithm::kSha1 ? EVP_sha1() : EVP_sha256();
  impl_->ctx = EVP_MD_CTX_new();
  PTK_CHECK(impl_->ctx != nullptr);
  Reset();
}
Sha256::~Sha256() { EVP_MD_CTX_free(impl_->ctx); }
void Sha256::Reset() { PTK_CHECK(EVP_DigestInit_ex(impl_->ctx, impl_->md, nullptr) == 1); }
void Sha256::Update(const void* data, size_t size) { PTK_CHECK(EVP_DigestUpdate(impl_->ctx, data, size) == 1); }
std::string Sha256::HexDigest() {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned n = 0;
  PTK_CHECK(EVP_DigestFinal_ex(impl_->ctx, out, &n) == 1);
  Reset();
  return ToHex(out, n);
}

std::string Sha256Hex(std::string_view data) { return Digest(EVP_sha256(), data); }
std::string Md5Hex(std::string_view data) {
  unsigned char out[MD5_DIGEST_LENGTH];
  MD5(reinterpret_cast<const unsigned char*>(data.data()), data.size(), out);
  return ToHex(out, MD5_DIGEST_LENGTH);
}
std::string Sha1Hex(std::string_view data) { return Digest(EVP_sha1(), data); }

Xxh3::Xxh3() : state_(XXH3_createState()) { XXH3_128bits_reset(static_cast<XXH3_state_t*>(state_)); }
Xxh3::~Xxh3() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }
void Xxh3::Update(const void* data, size_t size) {
  XXH3_128bits_update(static_cast<XXH3_state_t*>(state_), data, size);
}
std::string Xxh3::HexDigest() const {
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, XXH3_128bits_digest(static_cast<XXH3_state_t*>(state_)));
  return ToHex(c.digest, sizeof(c.digest));
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
