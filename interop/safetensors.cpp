// safetensors: writer (fp32) and a checked, memory-mapped reader.
#include "interop/safetensors.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <set>

#include <fmt/core.h>
#include <simdjson.h>

#include "common/atomic_file.h"
#include "common/json_keys.h"
#include "common/json_writer.h"
#include "common/progress.h"
#include "common/status.h"

namespace ptk {
namespace {

constexpr uint64_t kMaxHeader = 100'000'000;  // the reference implementation's limit

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while ((mant & 0x400) == 0) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace

int DtypeSize(std::string_view d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "I8" || d == "U8" || d == "BOOL" || d == "F8_E4M3" || d == "F8_E5M2") return 1;
  return 0;
}

int64_t SafetensorsTensor::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                              const std::map<std::string, std::string>& metadata, ProgressReporter* progress) {
  std::string header = "{\"__metadata__\":{";
  bool first = true;
  for (const auto& [k, v] : metadata) {
    header += fmt::format("{}\"{}\":\"{}\"", first ? "" : ",", JsonEscape(k), JsonEscape(v));
    first = false;
  }
  header += "}";
  uint64_t offset = 0;
  std::set<std::string> names;
  for (const SafetensorsEntry& e : entries) {
    int64_t n = 1;
    std::string shape;
    for (int64_t d : e.shape) {
      n *= d;
      if (!shape.empty()) shape += ',';
      shape += std::to_string(d);
    }
    if (n != static_cast<int64_t>(e.data.size()) || !names.insert(e.name).second)
      return absl::InternalError(fmt::format("{}: tensor {} has {} values for shape [{}] or is given twice", path,
                                             e.name, e.data.size(), shape));
    const uint64_t bytes = e.data.size_bytes();
    header += fmt::format(",\"{}\":{{\"dtype\":\"F32\",\"shape\":[{}],\"data_offsets\":[{},{}]}}", JsonEscape(e.name),
                          shape, offset, offset + bytes);
    offset += bytes;
  }
  header += "}";
  // The data starts 8-byte aligned, as the reference writer pads it.
  header.append((8 - header.size() % 8) % 8, ' ');
  PTK_ASSIGN_OR_RETURN(auto w, AtomicFileWriter::Create(path));
  const uint64_t len = header.size();
  char le[8];
  for (int i = 0; i < 8; ++i) le[i] = static_cast<char>((len >> (8 * i)) & 0xff);
  PTK_RETURN_IF_ERROR(w->Write(le, 8));
  PTK_RETURN_IF_ERROR(w->Write(header));
  static_assert(std::endian::native == std::endian::little, "safetensors is little-endian");
  for (const SafetensorsEntry& e : entries) {
    PTK_RETURN_IF_ERROR(w->Write(e.data.data(), e.data.size_bytes()));
    if (progress != nullptr) {
      progress->AddItems(1);
      progress->AddBytes(e.data.size_bytes());
      progress->Refresh();  // on a terminal the line says each tensor as it is written
    }
  }
  return w->Commit();
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  auto f = std::make_unique<SafetensorsFile>();
  f->path_ = path;
  PTK_ASSIGN_OR_RETURN(f->file_, MappedFile::Open(path));
  const uint8_t* p = f->file_->data();
  const uint64_t size = f->file_->size();
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(fmt::format("{}: not a valid safetensors file: {}", path, why));
  };
  if (size < 8) return bad(fmt::format("{} bytes, shorter than the 8-byte header length", size));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | p[i];
  if (n > kMaxHeader || n > size - 8)
    return bad(fmt::format("the header length {} runs past the end of the file ({} bytes)", n, size));
  f->data_start_ = 8 + n;
  const uint64_t data_size = size - f->data_start_;
  simdjson::dom::parser parser;
  simdjson::dom::object header;
  const std::string text(reinterpret_cast<const char*>(p + 8), n);
  if (parser.parse(text).get(header)) return bad("the header is not a JSON object");
  std::set<std::string> seen;
  for (auto [key, value] : header) {
    const std::string name(key);
    if (!seen.insert(name).second) return bad(fmt::format("tensor {} is named twice in the header", name));
    if (name == "__metadata__") {
      simdjson::dom::object meta;
      if (value.get(meta)) return bad("__metadata__ is not an object");
      for (auto [mk, mv] : meta) {
        std::string_view s;
        if (mv.get(s)) return bad(fmt::format("__metadata__ {} is not a string", std::string(mk)));
        f->metadata_[std::string(mk)] = std::string(s);
      }
      continue;
    }
    // The reference reads an entry into a struct (serde), which refuses a field given twice;
    // simdjson's lookup would take the first.
    if (auto dup = FirstDuplicateJsonKey(value))
      return bad(fmt::format("tensor {}: its entry gives {} twice", name, *dup));
    SafetensorsTensor t;
    t.name = name;
    std::string_view dtype;
    simdjson::dom::array shape, offsets;
    if (value["dtype"].get(dtype) || value["shape"].get(shape) || value["data_offsets"].get(offsets) ||
        offsets.size() != 2)
      return bad(fmt::format("tensor {}: its entry needs dtype, shape and data_offsets [begin, end]", name));
    t.dtype = std::string(dtype);
    const int elem = DtypeSize(dtype);
    if (elem == 0) return bad(fmt::format("tensor {}: unknown dtype {}", name, t.dtype));
    uint64_t elements = 1;
    for (simdjson::dom::element d : shape) {
      uint64_t v = 0;
      if (d.get(v) || v > (uint64_t{1} << 40) || (v != 0 && elements > std::numeric_limits<uint64_t>::max() / v))
        return bad(fmt::format("tensor {}: the shape holds something other than a dimension", name));
      t.shape.push_back(static_cast<int64_t>(v));
      elements *= v;
    }
    if (offsets.at(0).get(t.begin) || offsets.at(1).get(t.end) || t.begin > t.end || t.end > data_size)
      return bad(fmt::format("tensor {}: data_offsets outside the data section of {} bytes", name, data_size));
    if (elements > data_size / static_cast<uint64_t>(elem) || t.end - t.begin != elements * elem)
      return bad(fmt::format("tensor {}: {} bytes for {} elements of {}", name, t.end - t.begin, elements, t.dtype));
    f->tensors_.push_back(std::move(t));
  }
  std::sort(f->tensors_.begin(), f->tensors_.end(), [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t at = 0;
  for (const SafetensorsTensor& t : f->tensors_) {
    if (t.begin != at)
      return bad(fmt::format("tensor {} starts at byte {} of the data, where {}", t.name, t.begin,
                             t.begin < at ? "the previous tensor's bytes still are (an overlap)"
                                          : fmt::format("{} is expected (a hole)", at)));
    at = t.end;
  }
  if (at != data_size)
    return bad(fmt::format("the tensors cover {} of the {} data bytes (a truncated or padded file)", at, data_size));
  return f;
}

const SafetensorsTensor* SafetensorsFile::Find(std::string_view name) const {
  for (const SafetensorsTensor& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

std::span<const uint8_t> SafetensorsFile::Bytes(const SafetensorsTensor& t) const {
  return {file_->data() + data_start_ + t.begin, static_cast<size_t>(t.end - t.begin)};
}

absl::StatusOr<std::vector<float>> SafetensorsFile::ReadFloat(const SafetensorsTensor& t) const {
  const std::span<const uint8_t> b = Bytes(t);
  const size_t n = static_cast<size_t>(t.num_elements());
  std::vector<float> out(n);
  if (t.dtype == "F32") {
    std::memcpy(out.data(), b.data(), n * 4);
  } else if (t.dtype == "F16" || t.dtype == "BF16") {
    for (size_t i = 0; i < n; ++i) {
      const uint16_t h = static_cast<uint16_t>(b[2 * i] | (b[2 * i + 1] << 8));
      if (t.dtype == "F16") {
        out[i] = HalfToFloat(h);
      } else {
        const uint32_t bits = static_cast<uint32_t>(h) << 16;
        std::memcpy(&out[i], &bits, 4);
      }
    }
  } else {
    return absl::InvalidArgumentError(
        fmt::format("{}: tensor {} is {}; ptk reads F32, F16 and BF16 weights", path_, t.name, t.dtype));
  }
  return out;
}

}  // namespace ptk
