// SHA-256 / MD5 / SHA-1 digests (OpenSSL). XXH3 is in xxh3.cpp: tools that need only it do not load
// libcrypto (about a millisecond of every process start).
#include "common/hash.h"

// MD5 names index caches (not a security use). The one-shot MD5() skips the EVP provider set-up,
// about a millisecond and a half on the first EVP call, which the GPTDataset index build would pay.
#define OPENSSL_SUPPRESS_DEPRECATED
#include <openssl/evp.h>
#include <openssl/md5.h>

#include "common/status.h"

namespace ptk {
namespace {
std::string Digest(const EVP_MD* md, std::string_view data) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned n = 0;
  PTK_CHECK(EVP_Digest(data.data(), data.size(), out, &n, md, nullptr) == 1);
  return LowerHex(out, n);
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
  return LowerHex(out, n);
}

std::string Sha256Hex(std::string_view data) { return Digest(EVP_sha256(), data); }
std::string Md5Hex(std::string_view data) {
  unsigned char out[MD5_DIGEST_LENGTH];
  MD5(reinterpret_cast<const unsigned char*>(data.data()), data.size(), out);
  return LowerHex(out, MD5_DIGEST_LENGTH);
}
std::string Sha1Hex(std::string_view data) { return Digest(EVP_sha1(), data); }

}  // namespace ptk
