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

// Reads element i of a little-endian array of `t` as int64 (floats are truncated).
inline int64_t LoadToken(const uint8_t* base, int64_t i, DType t) {
  switch (t) {
    case DType::kUInt8: return base[i];
    case DType::kInt8: return static_cast<int8_t>(base[i]);
    case DType::kInt16: {
      int16_t v;
      std::memcpy(&v, base + 2 * i, 2);
      return v;
    }
    case DType::kUInt16: {
      uint16_t v;
      std::memcpy(&v, base + 2 * i, 2);
      return v;
    }
    case DType::kInt32: {
      int32_t v;
      std::memcpy(&v, base + 4 * i, 4);
      return v;
    }
    case DType::kInt64: {
      int64_t v;
      std::memcpy(&v, base + 8 * i, 8);
      return v;
    }
    case DType::kFloat32: {
      float v;
      std::memcpy(&v, base + 4 * i, 4);
      return static_cast<int64_t>(v);
    }
    case DType::kFloat64: {
      double v;
      std::memcpy(&v, base + 8 * i, 8);
      return static_cast<int64_t>(v);
    }
  }
  return 0;
}

}  // namespace ptk
