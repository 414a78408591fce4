// PyTorch's zip archives (torch.save's container) and the numbers in them; the pickle is torch_pickle.cpp.
#include "interop/torch_format.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <set>

#include <fmt/core.h>

#include "common/atomic_file.h"
#include "common/status.h"

namespace ptk::torchfmt {

// ---- numbers ---------------------------------------------------------------------------------

uint32_t Crc32(const void* data, size_t size, uint32_t crc) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

uint16_t FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFF) > 0x7F800000) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}
float Bf16ToFloat(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(man), -24);
  } else if (exp == 31) {
    v = man ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    v = std::ldexp(static_cast<float>(man | 0x400), static_cast<int>(exp) - 25);
  }
  return sign ? -v : v;
}
uint16_t FloatToHalf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000;
  const uint32_t a = u & 0x7FFFFFFF;
  if (a > 0x7F800000) return static_cast<uint16_t>(sign | 0x7E00);
  if (a >= 0x477FF000) return static_cast<uint16_t>(sign | 0x7C00);  // rounds to infinity
  if (a < 0x38800000) {                                              // subnormal half (or zero)
    const float af = std::fabs(f);
    const float scaled = af * 16777216.0f;  // 2^24: units of the smallest subnormal
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(scaled)));
  }
  uint32_t r = a - 0x38000000;  // rebias the exponent
  r += 0xFFF + ((r >> 13) & 1);
  return static_cast<uint16_t>(sign | (r >> 13));
}

std::string_view DTypeName(DType d) {
  switch (d) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat64: return "float64";
    case DType::kUInt8: return "uint8";
    case DType::kInt8: return "int8";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kBool: return "bool";
  }
  return "?";
}
int DTypeSize(DType d) {
  switch (d) {
    case DType::kFloat32:
    case DType::kInt32: return 4;
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kFloat64:
    case DType::kInt64: return 8;
    default: return 1;
  }
}

namespace {
// torch.<Name>Storage, the storage types persistent ids name.
struct StorageName {
  const char* name;
  DType dtype;
};
constexpr StorageName kStorages[] = {
    {"FloatStorage", DType::kFloat32},  {"HalfStorage", DType::kFloat16}, {"BFloat16Storage", DType::kBFloat16},
    {"DoubleStorage", DType::kFloat64}, {"ByteStorage", DType::kUInt8},   {"CharStorage", DType::kInt8},
    {"IntStorage", DType::kInt32},      {"LongStorage", DType::kInt64},   {"BoolStorage", DType::kBool},
};
}  // namespace
std::string_view StorageTypeName(DType d) {
  for (const auto& s : kStorages)
    if (s.dtype == d) return s.name;
  return "FloatStorage";
}
bool DTypeOfStorageType(std::string_view name, DType* out) {
  for (const auto& s : kStorages)
    if (name == s.name) {
      *out = s.dtype;
      return true;
    }
  return false;
}

// ---- the zip archive -------------------------------------------------------------------------
namespace {

uint64_t Le(const uint8_t* p, int n) {
  uint64_t u = 0;
  for (int i = 0; i < n; ++i) u |= static_cast<uint64_t>(p[i]) << (8 * i);
  return u;
}
void PutLe(std::string* out, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
constexpr uint32_t kLocalSig = 0x04034b50, kCentralSig = 0x02014b50, kEndSig = 0x06054b50;
constexpr uint32_t kEnd64Sig = 0x06064b50, kLocator64Sig = 0x07064b50;
constexpr uint64_t kAlign = 64;

}  // namespace

absl::StatusOr<std::unique_ptr<TorchArchiveReader>> TorchArchiveReader::Open(const std::string& path) {
  auto r = std::unique_ptr<TorchArchiveReader>(new TorchArchiveReader());
  r->path_ = path;
  PTK_ASSIGN_OR_RETURN(r->file_, MappedFile::Open(path));
  r->base_ = r->file_->data();
  r->size_ = r->file_->size();
  PTK_RETURN_IF_ERROR(r->Init());
  return r;
}

absl::StatusOr<std::unique_ptr<TorchArchiveReader>> TorchArchiveReader::OpenBytes(const std::string& where,
                                                                                  std::string_view bytes) {
  auto r = std::unique_ptr<TorchArchiveReader>(new TorchArchiveReader());
  r->path_ = where;
  r->base_ = reinterpret_cast<const uint8_t*>(bytes.data());
  r->size_ = bytes.size();
  PTK_RETURN_IF_ERROR(r->Init());
  return r;
}

absl::Status TorchArchiveReader::Init() {
  TorchArchiveReader* r = this;
  const std::string& path = path_;
  const uint8_t* d = base_;
  const uint64_t size = size_;
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(fmt::format("{}: not a readable PyTorch file: {}", path, why));
  };
  // The end-of-central-directory record: the last 22 bytes, or before a comment of up to 64 KiB.
  if (size < 22) return bad(fmt::format("{} bytes, too short for a zip archive (truncated?)", size));
  int64_t eocd = -1;
  for (int64_t p = static_cast<int64_t>(size) - 22; p >= 0 && p >= static_cast<int64_t>(size) - 22 - 65535; --p)
    if (Le(d + p, 4) == kEndSig) {
      eocd = p;
      break;
    }
  if (eocd < 0 && size >= 8 && std::memcmp(d, "PTKCKPT1", 8) == 0)
    return bad("it is a ptk checkpoint (ptk-train's format, PTKCKPT1), not a torch.save file: --loader ptk reads it");
  if (eocd < 0) return bad("no zip end-of-central-directory record (truncated or not a torch.save file)");
  uint64_t count = Le(d + eocd + 10, 2), cd_size = Le(d + eocd + 12, 4), cd_off = Le(d + eocd + 16, 4);
  if (eocd >= 20 && Le(d + eocd - 20, 4) == kLocator64Sig) {
    const uint64_t z = Le(d + eocd - 20 + 8, 8);
    if (z + 56 > size || Le(d + z, 4) != kEnd64Sig) return bad("damaged zip64 end record");
    count = Le(d + z + 32, 8);
    cd_size = Le(d + z + 40, 8);
    cd_off = Le(d + z + 48, 8);
  }
  if (cd_off > size || cd_size > size - cd_off) return bad("the central directory lies past the end (truncated)");
  uint64_t p = cd_off;
  for (uint64_t i = 0; i < count; ++i) {
    if (p + 46 > cd_off + cd_size || Le(d + p, 4) != kCentralSig) return bad("damaged central directory");
    const uint64_t method = Le(d + p + 10, 2), crc = Le(d + p + 16, 4);
    uint64_t csize = Le(d + p + 20, 4), usize = Le(d + p + 24, 4);
    const uint64_t nlen = Le(d + p + 28, 2), xlen = Le(d + p + 30, 2), clen = Le(d + p + 32, 2);
    uint64_t local = Le(d + p + 42, 4);
    if (p + 46 + nlen + xlen + clen > cd_off + cd_size) return bad("damaged central directory");
    std::string name(reinterpret_cast<const char*>(d + p + 46), nlen);
    // zip64 extra: the 64-bit values of the fields that read 0xFFFFFFFF, in this order.
    for (uint64_t x = p + 46 + nlen; x + 4 <= p + 46 + nlen + xlen;) {
      const uint64_t id = Le(d + x, 2), len = Le(d + x + 2, 2);
      if (id == 1) {
        uint64_t q = x + 4;
        if (usize == 0xFFFFFFFF && q + 8 <= x + 4 + len) usize = Le(d + q, 8), q += 8;
        if (csize == 0xFFFFFFFF && q + 8 <= x + 4 + len) csize = Le(d + q, 8), q += 8;
        if (local == 0xFFFFFFFF && q + 8 <= x + 4 + len) local = Le(d + q, 8);
      }
      x += 4 + len;
    }
    if (method != 0)
      return bad(fmt::format("entry {} is compressed (method {}); torch.save stores entries", name, method));
    if (local + 30 > size || Le(d + local, 4) != kLocalSig)
      return bad(fmt::format("entry {}: damaged local header", name));
    const uint64_t data = local + 30 + Le(d + local + 26, 2) + Le(d + local + 28, 2);
    if (data > size || usize > size - data)
      return bad(fmt::format("entry {} runs past the end of the file ({} bytes; truncated)", name, size));
    r->entries_[name] = Entry{data, usize, static_cast<uint32_t>(crc), false};
    p += 46 + nlen + xlen + clen;
  }
  for (const auto& [name, e] : r->entries_) {
    const size_t at = name.rfind("/data.pkl");
    if (at != std::string::npos && at + 9 == name.size() && name.find('/') == at) {
      r->prefix_ = name.substr(0, at + 1);
      break;
    }
  }
  if (r->prefix_.empty()) {
    if (r->entries_.count("data.pkl") == 0) return bad("no data.pkl in the archive");
  }
  PTK_ASSIGN_OR_RETURN(std::string_view pkl, r->EntryData("data.pkl"));
  PTK_ASSIGN_OR_RETURN(r->root_, ParsePickle(pkl, fmt::format("{}: {}data.pkl", path, r->prefix_)));
  return absl::OkStatus();
}

absl::StatusOr<std::string_view> TorchArchiveReader::EntryData(const std::string& name) {
  auto it = entries_.find(prefix_ + name);
  if (it == entries_.end())
    return absl::DataLossError(fmt::format("{}: the archive has no {}{}", path_, prefix_, name));
  Entry& e = it->second;
  std::string_view data(reinterpret_cast<const char*>(base_ + e.data_offset), e.size);
  if (!e.crc_checked) {
    if (Crc32(data.data(), data.size()) != e.crc)
      return absl::DataLossError(fmt::format("{}: {}{}: CRC-32 mismatch (a damaged file)", path_, prefix_, name));
    e.crc_checked = true;
  }
  return data;
}

absl::StatusOr<std::vector<float>> TorchArchiveReader::ReadFloat(const TensorRef& t, const std::string& name) {
  PTK_ASSIGN_OR_RETURN(std::string_view data, EntryData("data/" + t.storage_key));
  const int64_t n = t.numel(), es = DTypeSize(t.dtype);
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(fmt::format("{}: tensor {}: {}", path_, name, why));
  };
  if (t.dtype != DType::kFloat32 && t.dtype != DType::kBFloat16 && t.dtype != DType::kFloat16 &&
      t.dtype != DType::kFloat64)
    return bad(fmt::format("dtype {}, not a floating-point tensor", DTypeName(t.dtype)));
  int64_t last = t.offset;  // the furthest element the view reaches
  for (size_t i = 0; i < t.shape.size(); ++i)
    if (t.shape[i] > 0) last += (t.shape[i] - 1) * t.stride[i];
  if (n > 0 && (t.offset < 0 || (last + 1) * es > static_cast<int64_t>(data.size())))
    return bad(fmt::format("its view reaches element {} of a storage of {} bytes", last, data.size()));
  std::vector<float> out(static_cast<size_t>(n));
  std::vector<int64_t> idx(t.shape.size(), 0);
  int64_t src = t.offset;
  for (int64_t k = 0; k < n; ++k) {
    const char* p = data.data() + src * es;
    switch (t.dtype) {
      case DType::kFloat32: std::memcpy(&out[k], p, 4); break;
      case DType::kFloat64: {
        double v;
        std::memcpy(&v, p, 8);
        out[k] = static_cast<float>(v);
        break;
      }
      default: {
        uint16_t h;
        std::memcpy(&h, p, 2);
        out[k] = t.dtype == DType::kBFloat16 ? Bf16ToFloat(h) : HalfToFloat(h);
      }
    }
    for (size_t i = idx.size(); i-- > 0;) {  // the next index, row-major
      src += t.stride[i];
      if (++idx[i] < t.shape[i]) break;
      src -= t.stride[i] * t.shape[i];
      idx[i] = 0;
    }
  }
  return out;
}

absl::Status WriteTorchFile(const std::string& path, const PyValue& root, const std::vector<StorageBlob>& storages,
                            bool force_zip64) {
  // The archive's name inside: "archive", as torch.save names it for a file object.
  const std::string prefix = "archive/";
  std::vector<std::pair<std::string, std::string_view>> files;
  const std::string pkl = WritePickle(root);
  files.emplace_back(prefix + "data.pkl", pkl);
  files.emplace_back(prefix + "byteorder", "little");
  for (const StorageBlob& b : storages) files.emplace_back(prefix + "data/" + b.key, b.bytes);
  files.emplace_back(prefix + "version", "3\n");
  PTK_ASSIGN_OR_RETURN(auto w, AtomicFileWriter::Create(path));
  uint64_t pos = 0;
  std::string central;
  for (const auto& [name, data] : files) {
    const uint32_t crc = Crc32(data.data(), data.size());
    const bool z64 = force_zip64 || data.size() >= 0xFFFFFFFFull || pos >= 0xFFFFFFFFull;
    std::string h;
    PutLe(&h, kLocalSig, 4);
    PutLe(&h, z64 ? 45 : 20, 2);  // version needed
    PutLe(&h, 0, 2);              // flags
    PutLe(&h, 0, 2);              // stored
    PutLe(&h, 0, 2);              // time
    PutLe(&h, 0x21, 2);           // date: 1980-01-01
    PutLe(&h, crc, 4);
    PutLe(&h, z64 ? 0xFFFFFFFF : data.size(), 4);
    PutLe(&h, z64 ? 0xFFFFFFFF : data.size(), 4);
    PutLe(&h, name.size(), 2);
    const uint64_t z64_len = z64 ? 20 : 0;
    const uint64_t before_pad = pos + 30 + name.size() + z64_len + 4;
    const uint64_t pad = (kAlign - before_pad % kAlign) % kAlign;
    PutLe(&h, z64_len + 4 + pad, 2);
    h += name;
    if (z64) {
      PutLe(&h, 1, 2);
      PutLe(&h, 16, 2);
      PutLe(&h, data.size(), 8);
      PutLe(&h, data.size(), 8);
    }
    PutLe(&h, 0x4246, 2);  // "FB": torch's padding to a 64-byte boundary
    PutLe(&h, pad, 2);
    h.append(pad, 'Z');
    // The central directory's entry.
    PutLe(&central, kCentralSig, 4);
    PutLe(&central, z64 ? 45 : 20, 2);
    PutLe(&central, z64 ? 45 : 20, 2);
    PutLe(&central, 0, 2);
    PutLe(&central, 0, 2);
    PutLe(&central, 0, 2);
    PutLe(&central, 0x21, 2);
    PutLe(&central, crc, 4);
    PutLe(&central, z64 ? 0xFFFFFFFF : data.size(), 4);
    PutLe(&central, z64 ? 0xFFFFFFFF : data.size(), 4);
    PutLe(&central, name.size(), 2);
    PutLe(&central, z64 ? 28 : 0, 2);
    PutLe(&central, 0, 2);  // comment
    PutLe(&central, 0, 2);  // disk
    PutLe(&central, 0, 2);  // internal attributes
    PutLe(&central, 0, 4);  // external attributes
    PutLe(&central, z64 ? 0xFFFFFFFF : pos, 4);
    central += name;
    if (z64) {
      PutLe(&central, 1, 2);
      PutLe(&central, 24, 2);
      PutLe(&central, data.size(), 8);
      PutLe(&central, data.size(), 8);
      PutLe(&central, pos, 8);
    }
    PTK_RETURN_IF_ERROR(w->Write(h));
    PTK_RETURN_IF_ERROR(w->Write(data.data(), data.size()));
    pos += h.size() + data.size();
  }
  const uint64_t cd_off = pos, cd_size = central.size(), n = files.size();
  const bool z64 = force_zip64 || cd_off >= 0xFFFFFFFFull;
  std::string tail = central;
  if (z64) {
    const uint64_t end64 = cd_off + cd_size;
    PutLe(&tail, kEnd64Sig, 4);
    PutLe(&tail, 44, 8);
    PutLe(&tail, 45, 2);
    PutLe(&tail, 45, 2);
    PutLe(&tail, 0, 4);
    PutLe(&tail, 0, 4);
    PutLe(&tail, n, 8);
    PutLe(&tail, n, 8);
    PutLe(&tail, cd_size, 8);
    PutLe(&tail, cd_off, 8);
    PutLe(&tail, kLocator64Sig, 4);
    PutLe(&tail, 0, 4);
    PutLe(&tail, end64, 8);
    PutLe(&tail, 1, 4);
  }
  PutLe(&tail, kEndSig, 4);
  PutLe(&tail, 0, 2);
  PutLe(&tail, 0, 2);
  PutLe(&tail, n, 2);
  PutLe(&tail, n, 2);
  PutLe(&tail, cd_size, 4);
  PutLe(&tail, z64 ? 0xFFFFFFFF : cd_off, 4);
  PutLe(&tail, 0, 2);
  PTK_RETURN_IF_ERROR(w->Write(tail));
  return w->Commit();
}

}  // namespace ptk::torchfmt
