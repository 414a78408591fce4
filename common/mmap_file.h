// Read-only memory-mapped file. Empty files map to an empty span (no mmap call).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace ptk {

class MappedFile {
 public:
  enum class Advice { kNormal, kSequential, kRandom, kWillNeed };
  static absl::StatusOr<std::unique_ptr<MappedFile>> Open(const std::string& path, Advice advice = Advice::kNormal);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }
  // The kernel's read-ahead hint for the whole mapping from now on (e.g. sequential for one scan of a
  // file mapped for random reads, then random again).
  void Advise(Advice advice) const;

 private:
  MappedFile(std::string path, const uint8_t* data, size_t size) : path_(std::move(path)), data_(data), size_(size) {}
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace ptk
