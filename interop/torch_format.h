// PyTorch's serialization format (what torch.save writes and torch.load reads), read and written
// without Python: a zip archive (entries stored, not compressed; each entry's data aligned to 64
// bytes as torch aligns it) holding `<prefix>/data.pkl` (a pickle, protocol 2, whose tensors are
// calls of torch._utils._rebuild_tensor_v2 on persistent-id storages), `<prefix>/data/<key>` (each
// storage's raw little-endian bytes), `<prefix>/version` and `<prefix>/byteorder`.
//
// The pickle reader never executes anything: it builds a tree of values. Globals are kept as
// names (a call of one becomes an Object node with its arguments and state); only a fixed list of
// modules is accepted (torch, collections.OrderedDict, argparse.Namespace, numpy, megatron, ...),
// and any other global, or an opcode outside the protocol-2..4 subset torch.save writes, is refused
// naming it and its byte offset.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/mmap_file.h"

namespace ptk::torchfmt {

// ---- pickled values ------------------------------------------------------------------------
struct PyValue;
using PyRef = std::shared_ptr<PyValue>;

enum class DType { kFloat32, kFloat16, kBFloat16, kFloat64, kUInt8, kInt8, kInt32, kInt64, kBool };
std::string_view DTypeName(DType d);  // "float32", ...
int DTypeSize(DType d);

// A tensor as _rebuild_tensor_v2 describes it: a view (offset, shape, stride in elements) of a
// storage (its archive key, dtype, element count).
struct TensorRef {
  std::string storage_key;
  DType dtype = DType::kFloat32;
  int64_t storage_numel = 0;
  int64_t offset = 0;
  std::vector<int64_t> shape, stride;
  int64_t numel() const;
};

struct PyValue {
  enum class Kind { kNone, kBool, kInt, kFloat, kStr, kBytes, kList, kTuple, kDict, kTensor, kGlobal, kObject };
  Kind kind = Kind::kNone;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;                              // str, bytes, or a global's "module.name"
  std::vector<PyRef> items;                   // list, tuple; an object's call arguments
  std::vector<std::pair<PyRef, PyRef>> dict;  // dict entries in order; an object's state when a dict
  PyRef callable;                             // an object: the global called
  PyRef state;                                // an object: what BUILD set (argparse.Namespace: a dict)
  TensorRef tensor;

  // A dict's (or a Namespace's) entry under a string key; null when absent.
  const PyValue* Get(std::string_view key) const;
  bool IsInt() const { return kind == Kind::kInt; }
  bool IsNumber() const { return kind == Kind::kInt || kind == Kind::kFloat || kind == Kind::kBool; }
  double Number() const {
    return kind == Kind::kFloat ? f : kind == Kind::kBool ? (b ? 1 : 0) : static_cast<double>(i);
  }
  std::string ClassName() const;  // an object's callable, "module.name"
};

PyRef MakeNone();
PyRef MakeBool(bool b);
PyRef MakeInt(int64_t i);
PyRef MakeFloat(double f);
PyRef MakeStr(std::string s);
PyRef MakeList(std::vector<PyRef> items = {});
PyRef MakeTuple(std::vector<PyRef> items = {});
PyRef MakeDict();
PyRef MakeGlobal(std::string module_dot_name);
// argparse.Namespace(**attrs): NEWOBJ then BUILD with the attribute dict.
PyRef MakeNamespace(PyRef attrs);
void DictSet(PyValue* dict, PyRef key, PyRef value);
void DictSet(PyValue* dict, std::string key, PyRef value);

// Parses a pickle (`where` names it in errors, e.g. "x.pt: archive/data.pkl").
absl::StatusOr<PyRef> ParsePickle(std::string_view data, const std::string& where);
// Writes `root` as a protocol-2 pickle; tensors reference storages by their key.
std::string WritePickle(const PyValue& root);

// ---- the zip archive ------------------------------------------------------------------------
class TorchArchiveReader {
 public:
  // Maps the file and reads its central directory (zip64 too); a truncated or damaged archive is
  // refused naming the file.
  static absl::StatusOr<std::unique_ptr<TorchArchiveReader>> Open(const std::string& path);
  // An archive held in memory that outlives the reader (an item of a torch.distributed.checkpoint
  // .distcp file: each tensor there is a whole torch.save archive); `where` names it in errors.
  static absl::StatusOr<std::unique_ptr<TorchArchiveReader>> OpenBytes(const std::string& where,
                                                                       std::string_view bytes);
  // The parsed data.pkl.
  const PyValue& root() const { return *root_; }
  const std::string& path() const { return path_; }
  // The tensor's elements as fp32 (float32 copied; bf16/fp16/float64 converted), its storage's
  // CRC checked once; `name` is the tensor's name in errors.
  absl::StatusOr<std::vector<float>> ReadFloat(const TensorRef& t, const std::string& name);

 private:
  struct Entry {
    uint64_t data_offset = 0, size = 0;
    uint32_t crc = 0;
    bool crc_checked = false;
  };
  absl::StatusOr<std::string_view> EntryData(const std::string& name);
  std::string path_, prefix_;
  absl::Status Init();
  std::unique_ptr<MappedFile> file_;  // null for OpenBytes
  const uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  std::map<std::string, Entry> entries_;
  PyRef root_;
};

// One storage to write: the bytes a tensor (or several) views.
struct StorageBlob {
  std::string key;
  DType dtype = DType::kFloat32;
  std::string bytes;
};

// Writes `root` (whose tensors name the blobs' keys) as a torch.save file at `path`, atomically
// (temporary, fsync, rename). `force_zip64` writes zip64 records even for a small file (tests).
absl::Status WriteTorchFile(const std::string& path, const PyValue& root, const std::vector<StorageBlob>& storages,
                            bool force_zip64 = false);

// A float32 (or bf16, fp16) tensor of `shape` over a whole new storage: the PyValue and its blob.
PyRef MakeTensor(const std::string& key, DType dtype, std::vector<int64_t> shape);
StorageBlob MakeBlob(const std::string& key, DType dtype, const float* data, int64_t n);

// torch.<Name>Storage: the storage type a persistent id names for a dtype ("FloatStorage", ...), and
// back (false for a type ptk does not read).
std::string_view StorageTypeName(DType d);
bool DTypeOfStorageType(std::string_view name, DType* out);

uint32_t Crc32(const void* data, size_t size, uint32_t crc = 0);
uint16_t FloatToBf16(float f);  // round to nearest even
uint16_t FloatToHalf(float f);
float Bf16ToFloat(uint16_t h);
float HalfToFloat(uint16_t h);

}  // namespace ptk::torchfmt
