// torch.distributed.checkpoint directories: the .metadata pickle, the chunks in the .distcp files.
#include "interop/torch_dist.h"

#include <algorithm>
#include <cstring>

#include <fmt/core.h>

#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/progress.h"
#include "common/status.h"

namespace ptk::torchdist {
namespace {

using torchfmt::DType;
using torchfmt::PyValue;

std::string Dims(const std::vector<int64_t>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}

// A dataclass instance's field (its BUILD state is a dict).
const PyValue* Field(const PyValue* obj, const char* name) { return obj ? obj->Get(name) : nullptr; }

// torch.Size((...)) as REDUCE records it, or a plain tuple/list of ints.
bool ReadSize(const PyValue* v, std::vector<int64_t>* out) {
  if (!v) return false;
  if (v->kind == PyValue::Kind::kObject && v->ClassName() == "torch.Size" && v->items.size() == 1)
    v = v->items[0].get();
  if (v->kind != PyValue::Kind::kTuple && v->kind != PyValue::Kind::kList) return false;
  out->clear();
  for (const auto& d : v->items) {
    if (!d->IsInt() || d->i < 0) return false;
    out->push_back(d->i);
  }
  return true;
}

bool ReadDType(const PyValue* props, DType* out) {
  // TensorProperties pickles its state as a tuple (dtype, layout, requires_grad, memory_format,
  // pin_memory); older versions as a dict.
  const PyValue* dt = nullptr;
  if (props && props->kind == PyValue::Kind::kObject && props->state) {
    if (props->state->kind == PyValue::Kind::kTuple && !props->state->items.empty()) {
      dt = props->state->items[0].get();
    } else {
      dt = props->Get("dtype");
    }
  }
  if (!dt || dt->kind != PyValue::Kind::kGlobal) return false;
  static const std::map<std::string, DType> kTypes = {
      {"torch.float32", DType::kFloat32}, {"torch.float", DType::kFloat32}, {"torch.bfloat16", DType::kBFloat16},
      {"torch.float16", DType::kFloat16}, {"torch.half", DType::kFloat16},  {"torch.float64", DType::kFloat64},
      {"torch.uint8", DType::kUInt8},     {"torch.int8", DType::kInt8},     {"torch.int32", DType::kInt32},
      {"torch.int64", DType::kInt64},     {"torch.bool", DType::kBool},
  };
  auto it = kTypes.find(dt->s);
  if (it == kTypes.end()) return false;
  *out = it->second;
  return true;
}

}  // namespace

int64_t TensorEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<std::unique_ptr<DistCheckpoint>> DistCheckpoint::Open(const std::string& dir) {
  auto ck = std::unique_ptr<DistCheckpoint>(new DistCheckpoint());
  ck->dir_ = dir;
  const std::string path = JoinPath(dir, ".metadata");
  if (!PathExists(path))
    return absl::NotFoundError(fmt::format("{}: missing: not a torch.distributed.checkpoint directory", path));
  PTK_ASSIGN_OR_RETURN(std::string data, ReadFileToString(path));
  PTK_ASSIGN_OR_RETURN(torchfmt::PyRef root, torchfmt::ParsePickle(data, path));
  auto bad = [&](const std::string& why) { return absl::DataLossError(fmt::format("{}: {}", path, why)); };
  if (root->kind != PyValue::Kind::kObject || root->ClassName() != "torch.distributed.checkpoint.metadata.Metadata")
    return bad(fmt::format("holds {}, not a torch.distributed.checkpoint Metadata",
                           root->kind == PyValue::Kind::kObject ? root->ClassName() : "a plain value"));
  const PyValue* sdm = Field(root.get(), "state_dict_metadata");
  const PyValue* storage = Field(root.get(), "storage_data");
  if (!sdm || sdm->kind != PyValue::Kind::kDict) return bad("no state_dict_metadata dict");
  if (!storage || storage->kind != PyValue::Kind::kDict) return bad("no storage_data dict");

  // (key, chunk offsets) -> where its bytes are.
  std::map<std::pair<std::string, std::vector<int64_t>>, Chunk> where;
  std::map<std::string, Chunk> byte_where;
  for (const auto& [k, v] : storage->dict) {
    const PyValue* fqn = Field(k.get(), "fqn");
    if (!fqn || fqn->kind != PyValue::Kind::kStr) return bad("a storage_data key without its fqn");
    std::vector<int64_t> offsets;
    const PyValue* off = Field(k.get(), "offset");
    if (off && off->kind != PyValue::Kind::kNone && !ReadSize(off, &offsets))
      return bad(fmt::format("{}: a storage offset that is not a torch.Size", fqn->s));
    const PyValue* rel = Field(v.get(), "relative_path");
    const PyValue* o = Field(v.get(), "offset");
    const PyValue* len = Field(v.get(), "length");
    if (!rel || rel->kind != PyValue::Kind::kStr || !o || !o->IsInt() || !len || !len->IsInt() || o->i < 0 ||
        len->i < 0)
      return bad(fmt::format("{}: its storage entry is not (relative_path, offset, length)", fqn->s));
    if (rel->s.empty() || rel->s.find('/') != std::string::npos || rel->s == "." || rel->s == "..")
      return bad(fmt::format("{}: storage file {:?} is not a file of this directory", fqn->s, rel->s));
    if (const PyValue* tr = Field(v.get(), "transform_descriptors");
        tr && tr->kind != PyValue::Kind::kNone && !tr->items.empty())
      return bad(fmt::format("{}: stored through transforms (compression?), which ptk does not undo", fqn->s));
    Chunk c;
    c.file = rel->s;
    c.offset = static_cast<uint64_t>(o->i);
    c.length = static_cast<uint64_t>(len->i);
    if (off && off->kind != PyValue::Kind::kNone) {
      where[{fqn->s, offsets}] = c;
    } else {
      byte_where[fqn->s] = c;
    }
  }
  for (const auto& [k, v] : sdm->dict) {
    if (k->kind != PyValue::Kind::kStr) return bad("a state_dict_metadata key that is not a string");
    const std::string cls = v->kind == PyValue::Kind::kObject ? v->ClassName() : "";
    if (cls == "torch.distributed.checkpoint.metadata.BytesStorageMetadata") {
      ck->byte_items_.push_back(k->s);
      if (auto it = byte_where.find(k->s); it != byte_where.end()) ck->byte_chunks_[k->s] = it->second;
      continue;
    }
    if (cls != "torch.distributed.checkpoint.metadata.TensorStorageMetadata")
      return bad(fmt::format("{}: metadata of class {:?}, not a tensor's or bytes'", k->s, cls));
    TensorEntry e;
    e.key = k->s;
    if (!ReadDType(Field(v.get(), "properties"), &e.dtype))
      return bad(fmt::format("{}: a dtype ptk does not read", k->s));
    if (!ReadSize(Field(v.get(), "size"), &e.shape)) return bad(fmt::format("{}: no size", k->s));
    const PyValue* chunks = Field(v.get(), "chunks");
    if (!chunks || chunks->kind != PyValue::Kind::kList) return bad(fmt::format("{}: no chunk list", k->s));
    for (const auto& cv : chunks->items) {
      Chunk c;
      if (!ReadSize(Field(cv.get(), "offsets"), &c.offsets) || !ReadSize(Field(cv.get(), "sizes"), &c.sizes) ||
          c.offsets.size() != e.shape.size() || c.sizes.size() != e.shape.size())
        return bad(
            fmt::format("{}: a chunk without offsets and sizes of the tensor's {} dimensions", k->s, e.shape.size()));
      auto it = where.find({k->s, c.offsets});
      if (it == where.end()) return bad(fmt::format("{}: chunk at {} has no storage entry", k->s, Dims(c.offsets)));
      c.file = it->second.file;
      c.offset = it->second.offset;
      c.length = it->second.length;
      e.chunks.push_back(std::move(c));
    }
    ck->tensors_.emplace(e.key, std::move(e));
  }
  return ck;
}

absl::StatusOr<const MappedFile*> DistCheckpoint::File(const std::string& relative, const std::string& key) {
  auto it = files_.find(relative);
  if (it != files_.end()) return it->second.get();
  const std::string path = JoinPath(dir_, relative);
  if (!PathExists(path))
    return absl::NotFoundError(
        fmt::format("{}: missing: {}/.metadata stores {} there (an incomplete copy?)", path, dir_, key));
  PTK_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> f, MappedFile::Open(path));
  const MappedFile* raw = f.get();
  files_[relative] = std::move(f);
  return raw;
}

absl::StatusOr<std::string_view> DistCheckpoint::ItemBytes(const Chunk& c, const std::string& what,
                                                           std::string* where) {
  PTK_ASSIGN_OR_RETURN(const MappedFile* f, File(c.file, what));
  *where = fmt::format("{}: byte {} ({})", f->path(), c.offset, what);
  if (c.offset > f->size() || c.length > f->size() - c.offset)
    return absl::DataLossError(
        fmt::format("{}: {} bytes stored there, the file ends after {} (truncated)", *where, c.length, f->size()));
  return std::string_view(reinterpret_cast<const char*>(f->data() + c.offset), c.length);
}

absl::StatusOr<std::unique_ptr<torchfmt::TorchArchiveReader>> DistCheckpoint::OpenItem(const std::string& key) {
  auto it = byte_chunks_.find(key);
  if (it == byte_chunks_.end())
    return absl::DataLossError(fmt::format("{}/.metadata: byte item {}: no storage entry", dir_, key));
  std::string where;
  PTK_ASSIGN_OR_RETURN(std::string_view bytes, ItemBytes(it->second, key, &where));
  return torchfmt::TorchArchiveReader::OpenBytes(where, bytes);
}

namespace {

// Which slices of `e`'s leading axis its (non-overlapping) chunks cover, each wholly or not at all.
template <typename Bad>
absl::Status LeadingSlices(const TensorEntry& e, const Bad& bad, std::vector<bool>* present) {
  const int64_t slice = e.numel() / e.shape[0];
  std::vector<int64_t> per(static_cast<size_t>(e.shape[0]), 0);
  for (const Chunk& c : e.chunks) {
    int64_t vol = 1;
    for (size_t d = 1; d < c.sizes.size(); ++d) vol *= c.sizes[d];
    for (int64_t i = c.offsets[0]; i < c.offsets[0] + c.sizes[0]; ++i) per[static_cast<size_t>(i)] += vol;
  }
  present->assign(per.size(), false);
  for (size_t i = 0; i < per.size(); ++i) {
    if (per[i] != 0 && per[i] != slice)
      return bad(
          fmt::format("its chunks cover {} of the {} elements of slice {} of its leading axis (a part of the "
                      "tensor was not saved)",
                      per[i], slice, i));
    (*present)[i] = per[i] == slice;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<float>> DistCheckpoint::ReadFloat(const std::string& key) { return ReadFloat(key, nullptr); }

absl::StatusOr<std::vector<float>> DistCheckpoint::ReadFloat(const std::string& key, std::vector<bool>* present) {
  auto it = tensors_.find(key);
  if (it == tensors_.end()) return absl::NotFoundError(fmt::format("{}/.metadata: no tensor {}", dir_, key));
  const TensorEntry& e = it->second;
  const size_t nd = e.shape.size();
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(fmt::format("{}/.metadata: tensor {}: {}", dir_, key, why));
  };
  // The chunks tile the tensor: inside it, no two overlapping, their volumes summing to its size.
  int64_t covered = 0;
  for (size_t i = 0; i < e.chunks.size(); ++i) {
    const Chunk& c = e.chunks[i];
    int64_t vol = 1;
    for (size_t d = 0; d < nd; ++d) {
      if (c.offsets[d] + c.sizes[d] > e.shape[d])
        return bad(fmt::format("chunk at {} of sizes {} lies outside its shape {}", Dims(c.offsets), Dims(c.sizes),
                               Dims(e.shape)));
      vol *= c.sizes[d];
    }
    covered += vol;
    for (size_t j = 0; j < i; ++j) {
      const Chunk& o = e.chunks[j];
      bool overlap = vol > 0;
      for (size_t d = 0; d < nd && overlap; ++d)
        overlap = c.offsets[d] < o.offsets[d] + o.sizes[d] && o.offsets[d] < c.offsets[d] + c.sizes[d];
      if (overlap) return bad(fmt::format("chunks at {} and {} overlap", Dims(o.offsets), Dims(c.offsets)));
    }
  }
  if (present != nullptr && nd > 0 && e.shape[0] > 0) {
    PTK_RETURN_IF_ERROR(LeadingSlices(e, bad, present));
  } else if (covered != e.numel()) {
    return bad(
        fmt::format("its chunks cover {} of its {} elements (a part of the tensor was not saved)", covered, e.numel()));
  }
  std::vector<float> out(static_cast<size_t>(e.numel()));
  // Row-major strides of the global tensor.
  std::vector<int64_t> stride(nd, 1);
  for (size_t d = nd; d-- > 1;) stride[d - 1] = stride[d] * e.shape[d];
  for (const Chunk& c : e.chunks) {
    std::string where;
    PTK_ASSIGN_OR_RETURN(std::string_view bytes,
                         ItemBytes(c, fmt::format("{} chunk at {}", key, Dims(c.offsets)), &where));
    PTK_ASSIGN_OR_RETURN(auto archive, torchfmt::TorchArchiveReader::OpenBytes(where, bytes));
    const PyValue& t = archive->root();
    if (t.kind != PyValue::Kind::kTensor)
      return absl::DataLossError(fmt::format("{}: the stored item is not a tensor", where));
    if (t.tensor.shape != c.sizes)
      return absl::DataLossError(
          fmt::format("{}: a tensor of shape {} where the chunk has {}", where, Dims(t.tensor.shape), Dims(c.sizes)));
    PTK_ASSIGN_OR_RETURN(std::vector<float> v, archive->ReadFloat(t.tensor, key));
    if (v.empty()) continue;
    // Scatter: each innermost row of the chunk to its place in the whole tensor.
    const int64_t inner = nd ? c.sizes[nd - 1] : 1;
    std::vector<int64_t> idx(nd > 0 ? nd - 1 : 0, 0);
    for (int64_t src = 0; src < static_cast<int64_t>(v.size()); src += inner) {
      int64_t dst = nd ? c.offsets[nd - 1] : 0;
      for (size_t d = 0; d + 1 < nd; ++d) dst += (c.offsets[d] + idx[d]) * stride[d];
      std::copy(v.begin() + src, v.begin() + src + inner, out.begin() + dst);
      for (size_t d = idx.size(); d-- > 0;) {
        if (++idx[d] < c.sizes[d]) break;
        idx[d] = 0;
      }
    }
  }
  if (progress_ != nullptr) {
    progress_->AddItems(1);
    for (const Chunk& c : e.chunks) progress_->AddBytes(c.length);
    progress_->Refresh();  // on a terminal the line says each tensor as it is read
  }
  return out;
}

uint64_t DistCheckpoint::TensorBytes() const {
  uint64_t bytes = 0;
  for (const auto& [key, e] : tensors_)
    for (const Chunk& c : e.chunks) bytes += c.length;
  return bytes;
}

}  // namespace ptk::torchdist
