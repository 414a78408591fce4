// SHA-256 (streaming) and MD5 digests as lowercase hex (OpenSSL underneath).
#pragma once

#include <memory>
#include <string>
#include <string_view>

namespace ptk {

// Streaming digest (SHA-256 by default; SHA-1 for git blob ids).
class Sha256 {
 public:
  enum class Algorithm { kSha256, kSha1 };
  explicit Sha256(Algorithm algo = Algorithm::kSha256);
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void Update(const void* data, size_t size);
  void Update(std::string_view s) { Update(s.data(), s.size()); }
  std::string HexDigest();  // finishes; the object is reset afterwards
  void Reset();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

std::string Sha256Hex(std::string_view data);
std::string Md5Hex(std::string_view data);
std::string Sha1Hex(std::string_view data);

}  // namespace ptk
