// PyTorch's distributed checkpoint (torch.distributed.checkpoint, what Megatron's --ckpt-format
// torch_dist writes), read without Python: a directory holding `.metadata` (a pickled
// torch.distributed.checkpoint.metadata.Metadata: `state_dict_metadata` maps each key to a
// TensorStorageMetadata (dtype, global size, chunks of (offsets, sizes)) or a BytesStorageMetadata;
// `storage_data` maps each MetadataIndex (key, chunk offsets) to a _StorageInfo (relative_path,
// offset, length)) and the data files (`__R_T.distcp`) those name. Each tensor chunk is stored as a
// whole torch.save archive at its (offset, length) in its file (read by interop/torch_format.h);
// byte items (pickled objects) are raw bytes. Nothing is executed; the pickle's globals are only
// names (torch's, pathlib's).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/mmap_file.h"
#include "interop/torch_format.h"

namespace ptk {
class ProgressReporter;
}

namespace ptk::torchdist {

struct Chunk {
  std::vector<int64_t> offsets, sizes;  // in elements, per dimension of the global tensor
  std::string file;                     // relative to the directory
  uint64_t offset = 0, length = 0;      // the item's bytes in `file`
};

struct TensorEntry {
  std::string key;
  torchfmt::DType dtype = torchfmt::DType::kFloat32;
  std::vector<int64_t> shape;  // the global tensor
  std::vector<Chunk> chunks;
  int64_t numel() const;
};

class DistCheckpoint {
 public:
  // Parses `dir`/.metadata; every chunk must have its storage entry (the data files are opened on
  // first read). A missing or damaged .metadata is refused naming it.
  static absl::StatusOr<std::unique_ptr<DistCheckpoint>> Open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  const std::map<std::string, TensorEntry>& tensors() const { return tensors_; }
  // The keys of byte items (Megatron's ShardedObjects: extra states, RNG states, ...).
  const std::vector<std::string>& byte_items() const { return byte_items_; }
  // A byte item that holds a torch.save archive (a ShardedObject: the pickled list of its objects),
  // opened; one missing, truncated or not an archive is refused naming the file, the byte offset and
  // the key.
  absl::StatusOr<std::unique_ptr<torchfmt::TorchArchiveReader>> OpenItem(const std::string& key);

  // The whole tensor as fp32 (float32, bf16, fp16, float64 read), its chunks assembled; chunks that
  // leave a hole, overlap or lie outside the tensor, a data file that is missing or too short, and a
  // chunk whose archive does not hold a tensor of the chunk's shape are refused naming the file, the
  // byte offset and the key.
  absl::StatusOr<std::vector<float>> ReadFloat(const std::string& key);
  // The same, for a tensor stacked on its leading axis whose slices may be absent as whole ones (megatron-core's
  // stacked layers when only some layers have the key: a MoE model's experts, its dense layers' MLP): `present`
  // gets, per index of the leading axis, whether its slice was saved (an absent one reads as zeros); a slice
  // saved in part is refused as a hole.
  absl::StatusOr<std::vector<float>> ReadFloat(const std::string& key, std::vector<bool>* present);
  // Counts each tensor ReadFloat reads and its stored bytes (its chunks' items); nullptr: none.
  void SetProgress(ProgressReporter* progress) { progress_ = progress; }
  // The stored bytes of every tensor (their chunks' items): a progress's total.
  uint64_t TensorBytes() const;

 private:
  absl::StatusOr<const MappedFile*> File(const std::string& relative, const std::string& key);
  // The stored item's bytes, and where they are for errors ("file: byte N (what)").
  absl::StatusOr<std::string_view> ItemBytes(const Chunk& c, const std::string& what, std::string* where);
  std::string dir_;
  std::map<std::string, TensorEntry> tensors_;
  std::vector<std::string> byte_items_;
  std::map<std::string, Chunk> byte_chunks_;
  std::map<std::string, std::unique_ptr<MappedFile>> files_;
  ProgressReporter* progress_ = nullptr;
};

}  // namespace ptk::torchdist
