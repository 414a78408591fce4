// .npy files byte-identical to numpy.save.
#include "indexed_dataset/npy.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <regex>

#include <fmt/core.h>

#include "common/atomic_file.h"
#include "common/status.h"

namespace ptk {

const char* NpyDescr(NpyType t) {
  switch (t) {
    case NpyType::kInt16: return "<i2";
    case NpyType::kInt32: return "<i4";
    case NpyType::kInt64: return "<i8";
    case NpyType::kUInt32: return "<u4";
  }
  return "?";
}

size_t NpySize(NpyType t) {
  switch (t) {
    case NpyType::kInt16: return 2;
    case NpyType::kInt32: return 4;
    case NpyType::kUInt32: return 4;
    case NpyType::kInt64: return 8;
  }
  return 0;
}

void IndexArray::Free::operator()(uint8_t* p) const { std::free(p); }

IndexArray IndexArray::Owned(NpyType t, std::vector<int64_t> shape) {
  IndexArray a;
  a.type_ = t;
  a.shape_ = std::move(shape);
  const size_t bytes = std::max<size_t>(1, static_cast<size_t>(a.size()) * NpySize(t));
  constexpr size_t kHuge = 2u << 20;
  void* p;
  if (bytes >= kHuge) {
    const size_t alloc = (bytes + kHuge - 1) / kHuge * kHuge;
    p = std::aligned_alloc(kHuge, alloc);
    if (p) ::madvise(p, alloc, MADV_HUGEPAGE);
  } else {
    p = std::malloc(bytes);
  }
  PTK_CHECK(p != nullptr);
  a.owned_ = std::shared_ptr<uint8_t>(static_cast<uint8_t*>(p), Free());
  return a;
}

int64_t IndexArray::size() const {
  int64_t n = 1;
  for (int64_t d : shape_) n *= d;
  return n;
}

// numpy.lib.format (1.24): "{'descr': '<i4', 'fortran_order': False, 'shape': (N,), }", then 21 -
// len(repr(shape[0])) spaces of growth room, then spaces so that the 10-byte prefix plus the header
// plus '\n' is a multiple of 64, then '\n'.
std::string IndexArray::HeaderBytes() const {
  std::string shape = "(";
  for (size_t i = 0; i < shape_.size(); ++i) shape += (i ? ", " : "") + std::to_string(shape_[i]);
  shape += shape_.size() == 1 ? ",)" : ")";
  std::string h = fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}", NpyDescr(type_), shape);
  if (!shape_.empty())
    h += std::string(static_cast<size_t>(std::max<int>(0, 21 - static_cast<int>(std::to_string(shape_[0]).size()))),
                     ' ');
  size_t hlen = h.size() + 1;
  size_t pad = 64 - ((hlen + 10) % 64);
  if (pad == 64) pad = 0;
  h += std::string(pad, ' ');
  h += '\n';
  std::string out = "\x93NUMPY";
  out += static_cast<char>(1);
  out += static_cast<char>(0);
  out += static_cast<char>(h.size() & 0xFF);
  out += static_cast<char>((h.size() >> 8) & 0xFF);
  out += h;
  return out;
}

absl::Status IndexArray::Save(const std::string& path) const {
  PTK_ASSIGN_OR_RETURN(auto w, AtomicFileWriter::Create(path));
  PTK_RETURN_IF_ERROR(w->Write(HeaderBytes()));
  PTK_RETURN_IF_ERROR(w->Write(data(), static_cast<size_t>(size()) * NpySize(type_)));
  return w->Commit(/*durable=*/false);  // a cache: validated on load, rebuilt if damaged
}

absl::StatusOr<IndexArray> IndexArray::Load(const std::string& path) {
  PTK_ASSIGN_OR_RETURN(auto file, MappedFile::Open(path, MappedFile::Advice::kRandom));
  auto bad = [&](const std::string& why) { return absl::DataLossError(fmt::format("{}: {}", path, why)); };
  const uint8_t* p = file->data();
  if (file->size() < 10 || std::memcmp(p, "\x93NUMPY", 6) != 0) return bad("not a .npy file");
  if (p[6] != 1 || p[7] != 0) return bad(fmt::format("unsupported .npy version {}.{}", p[6], p[7]));
  size_t hlen = p[8] | (static_cast<size_t>(p[9]) << 8);
  if (10 + hlen > file->size()) return bad("truncated header");
  std::string h(reinterpret_cast<const char*>(p) + 10, hlen);
  static const std::regex re(
      R"(\{'descr': '([<|][iu][248])', 'fortran_order': False, 'shape': \((\d+),(?: (\d+))?\), \})");
  std::smatch m;
  if (!std::regex_search(h, m, re)) return bad("unexpected .npy header " + h);
  IndexArray a;
  std::string d = m[1];
  if (d == "<i2")
    a.type_ = NpyType::kInt16;
  else if (d == "<i4")
    a.type_ = NpyType::kInt32;
  else if (d == "<i8")
    a.type_ = NpyType::kInt64;
  else if (d == "<u4")
    a.type_ = NpyType::kUInt32;
  else
    return bad("unsupported dtype " + d);
  a.shape_.push_back(std::stoll(m[2]));
  if (m[3].matched) a.shape_.push_back(std::stoll(m[3]));
  const uint64_t need = 10 + hlen + static_cast<uint64_t>(a.size()) * NpySize(a.type_);
  if (file->size() != need) return bad(fmt::format("is {} bytes but its header describes {}", file->size(), need));
  a.offset_ = 10 + hlen;
  a.mapped_ = std::move(file);
  return a;
}

}  // namespace ptk
