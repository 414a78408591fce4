// SHA-256 (streaming) and MD5 digests as lowercase hex (OpenSSL underneath); XXH3-128 (libxxhash)
// as the fast content checksum in ptk's sidecars.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

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

// Streaming XXH3-128; HexDigest is 32 lowercase hex digits (the big-endian canonical form, as
// `xxhsum -H2` prints it).
class Xxh3 {
 public:
  Xxh3();
  ~Xxh3();
  Xxh3(const Xxh3&) = delete;
  Xxh3& operator=(const Xxh3&) = delete;
  void Update(const void* data, size_t size);
  std::string HexDigest() const;

 private:
  void* state_;
};
std::string Xxh3Hex(std::string_view data);
// XXH3-128 of a whole file, read in 4 MiB pieces.
absl::StatusOr<std::string> Xxh3FileHex(const std::string& path);

std::string Sha256Hex(std::string_view data);
// n bytes as 2n lowercase hex digits.
std::string LowerHex(const unsigned char* d, size_t n);
std::string Md5Hex(std::string_view data);
std::string Sha1Hex(std::string_view data);

}  // namespace ptk
