// Megatron's token dtype codes (megatron/core/datasets/indexed_dataset.py, class DType).
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace ptk {

enum class DType : uint8_t {
  kUInt8 = 1,
  kInt8 = 2,
  kInt16 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kFloat64 = 6,
  kFloat32 = 7,
  kUInt16 = 8,
};

inline std::optional<DType> DTypeFromCode(uint8_t code) {
  if (code >= 1 && code <= 8) return static_cast<DType>(code);
  return std::nullopt;
}

inline size_t DTypeSize(DType t) {
  switch (t) {
    case DType::kUInt8:
    case DType::kInt8: return 1;
    case DType::kInt16:
    case DType::kUInt16: return 2;
    case DType::kInt32:
    case DType::kFloat32: return 4;
    case DType::kInt64:
    case DType::kFloat64: return 8;
  }
  return 0;
}

inline std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kUInt8: return "uint8";
    case DType::kInt8: return "int8";
    case DType::kInt16: return "int16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kFloat64: return "float64";
    case DType::kFloat32: return "float32";
    case DType::kUInt16: return "uint16";
  }
  return "?";
}

// DType.optimal_dtype: uint16 when the vocabulary has fewer than 65500 entries, else int32.
inline DType OptimalDType(int64_t vocab_size) { return vocab_size < 65500 ? DType::kUInt16 : DType::kInt32; }

// Element i of a little-endian array of T (unaligned), as int64 (floats are truncated).
template <typename T>
inline int64_t LoadAs(const uint8_t* base, int64_t i) {
  T v;
  std::memcpy(&v, base + sizeof(T) * static_cast<size_t>(i), sizeof(T));
  return static_cast<int64_t>(v);
}

// Reads element i of a little-endian array of `t` as int64 (floats are truncated).
inline int64_t LoadToken(const uint8_t* base, int64_t i, DType t) {
  switch (t) {
    case DType::kUInt8: return LoadAs<uint8_t>(base, i);
    case DType::kInt8: return LoadAs<int8_t>(base, i);
    case DType::kInt16: return LoadAs<int16_t>(base, i);
    case DType::kUInt16: return LoadAs<uint16_t>(base, i);
    case DType::kInt32: return LoadAs<int32_t>(base, i);
    case DType::kInt64: return LoadAs<int64_t>(base, i);
    case DType::kFloat32: return LoadAs<float>(base, i);
    case DType::kFloat64: return LoadAs<double>(base, i);
  }
  return 0;
}

}  // namespace ptk
