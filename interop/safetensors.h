// The safetensors format (Hugging Face's model.safetensors), written and read by ptk itself: u64
// little-endian header length N, N bytes of JSON ({"__metadata__": {str: str}, NAME: {"dtype",
// "shape", "data_offsets": [begin, end]}}, padded with spaces so the data starts 8-byte aligned),
// then the tensors' raw little-endian bytes, offsets relative to the data's start.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/mmap_file.h"

namespace ptk {

class ProgressReporter;

// A tensor to write: fp32, row-major.
struct SafetensorsEntry {
  std::string name;
  std::vector<int64_t> shape;
  std::span<const float> data;
};

// Writes `entries` (in this order, data and header alike) under a temporary name, fsyncs and
// renames onto `path`. The header's tensors follow "__metadata__". `progress`, when given, counts each
// tensor and its bytes as they are written (and redraws its line on a terminal).
absl::Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                              const std::map<std::string, std::string>& metadata, ProgressReporter* progress = nullptr);

struct SafetensorsTensor {
  std::string name;
  std::string dtype;  // "F32", "F16", "BF16", ...
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range within the data section
  int64_t num_elements() const;
};

// A safetensors file, mapped read-only and checked as the reference implementation checks it:
// the header (length within the file, JSON, every entry's dtype, shape and offsets, no name twice)
// and the data section (each tensor's bytes = elements x dtype size; the tensors tile the data
// section exactly, without a hole or an overlap). A violation is kDataLoss naming the file and the
// tensor.
class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);

  const std::string& path() const { return path_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // In the order of their data.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const SafetensorsTensor* Find(std::string_view name) const;
  std::span<const uint8_t> Bytes(const SafetensorsTensor& t) const;
  // The tensor's values as fp32 (F32 copied; F16 and BF16 widened exactly); other dtypes refused.
  absl::StatusOr<std::vector<float>> ReadFloat(const SafetensorsTensor& t) const;

 private:
  std::string path_;
  std::unique_ptr<MappedFile> file_;
  uint64_t data_start_ = 0;
  std::map<std::string, std::string> metadata_;
  std::vector<SafetensorsTensor> tensors_;
};

// Bytes per element of a safetensors dtype; 0 for an unknown one.
int DtypeSize(std::string_view dtype);

}  // namespace ptk
