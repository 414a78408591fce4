// .npy files (format 1.0) byte-identical to numpy.save, and zero-copy reading of them.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/mmap_file.h"

namespace ptk {

enum class NpyType { kInt16, kInt32, kInt64, kUInt32 };
const char* NpyDescr(NpyType t);  // "<i2", "<i4", "<i8", "<u4"
size_t NpySize(NpyType t);

// An array kept in memory or mapped from a .npy file; elements read as int64.
class IndexArray {
 public:
  IndexArray() = default;
  static IndexArray Owned(NpyType t, std::vector<int64_t> shape);
  static absl::StatusOr<IndexArray> Load(const std::string& path);  // validates the header

  NpyType type() const { return type_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t size() const;  // number of elements
  const uint8_t* data() const { return mapped_ ? mapped_->data() + offset_ : owned_.get(); }
  // A loaded array's read-ahead hint (MappedFile::Advise); nothing for an owned one.
  void Advise(MappedFile::Advice advice) const {
    if (mapped_) mapped_->Advise(advice);
  }
  uint8_t* mutable_data() { return owned_.get(); }
  template <typename T>
  T* As() {
    return reinterpret_cast<T*>(owned_.get());
  }
  int64_t at(int64_t i) const {
    const uint8_t* p = data() + static_cast<size_t>(i) * NpySize(type_);
    switch (type_) {
      case NpyType::kInt16: {
        int16_t v;
        std::memcpy(&v, p, 2);
        return v;
      }
      case NpyType::kInt32: {
        int32_t v;
        std::memcpy(&v, p, 4);
        return v;
      }
      case NpyType::kUInt32: {
        uint32_t v;
        std::memcpy(&v, p, 4);
        return v;
      }
      case NpyType::kInt64: {
        int64_t v;
        std::memcpy(&v, p, 8);
        return v;
      }
    }
    return 0;
  }
  // numpy.save's exact bytes.
  std::string HeaderBytes() const;
  absl::Status Save(const std::string& path) const;  // atomic (temporary name + rename)

 private:
  NpyType type_ = NpyType::kInt32;
  std::vector<int64_t> shape_;
  // Uninitialised (every element is written by the builder), on transparent huge pages when large:
  // zero-filling and 4 KiB page faults were a fifth of the index build time.
  struct Free {
    void operator()(uint8_t* p) const;
  };
  std::shared_ptr<uint8_t> owned_;
  std::shared_ptr<MappedFile> mapped_;
  size_t offset_ = 0;
};

}  // namespace ptk
