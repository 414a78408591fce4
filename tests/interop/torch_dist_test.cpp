// PyTorch's distributed checkpoint as interop/torch_dist.h reads it: a .metadata pickle (written here
// with the same classes and layout torch.distributed.checkpoint pickles: Metadata, TensorStorageMetadata
// with TensorProperties' tuple state and torch.Size, MetadataIndex -> _StorageInfo) and chunks stored as
// whole torch.save archives at their offsets in a .distcp file. A 2-D bf16 tensor in a 2 x 2 grid of
// chunks is assembled in place; a hole, an overlap, a chunk outside the tensor, a chunk of the wrong
// shape, a file too short are refused naming the key (and the file and byte offset).
#include "interop/torch_dist.h"

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace ptk::torchdist {
namespace {

using testing::TempDir;
using torchfmt::DType;
using torchfmt::MakeDict;
using torchfmt::MakeGlobal;
using torchfmt::MakeInt;
using torchfmt::MakeList;
using torchfmt::MakeNone;
using torchfmt::MakeStr;
using torchfmt::MakeTuple;
using torchfmt::PyRef;
using torchfmt::PyValue;

constexpr char kMeta[] = "torch.distributed.checkpoint.metadata.";

// A dataclass instance as pickle records it: the class called with no arguments, then BUILD(state).
PyRef Object(const std::string& cls, PyRef state) {
  auto v = std::make_shared<PyValue>();
  v->kind = PyValue::Kind::kObject;
  v->callable = MakeGlobal(cls);
  v->state = std::move(state);
  return v;
}
PyRef Size(const std::vector<int64_t>& dims) {
  std::vector<PyRef> items;
  for (int64_t d : dims) items.push_back(MakeInt(d));
  auto v = std::make_shared<PyValue>();
  v->kind = PyValue::Kind::kObject;
  v->callable = MakeGlobal("torch.Size");
  v->items = {MakeTuple(items)};
  return v;
}

struct ChunkSpec {
  std::vector<int64_t> offsets, sizes;
  std::vector<int64_t> stored_sizes;  // the archive's tensor shape (default: sizes)
};

// Writes DIR/.metadata and DIR/__0_0.distcp for one tensor "w" of `shape` (bf16) whose element at
// (i, j) is i * 100 + j, cut into `chunks`; returns the .distcp's size.
size_t WriteCheckpoint(const TempDir& dir, const std::vector<int64_t>& shape, const std::vector<ChunkSpec>& chunks) {
  std::string distcp;
  PyRef storage = MakeDict();
  PyRef chunk_list = MakeList();
  int n = 0;
  for (const ChunkSpec& c : chunks) {
    const std::vector<int64_t> stored = c.stored_sizes.empty() ? c.sizes : c.stored_sizes;
    std::vector<float> v;
    for (int64_t i = 0; i < stored[0]; ++i)
      for (int64_t j = 0; j < stored[1]; ++j)
        v.push_back(static_cast<float>((c.offsets[0] + i) * 100 + c.offsets[1] + j));
    const std::string f = dir / ("chunk" + std::to_string(n++));
    EXPECT_TRUE(
        torchfmt::WriteTorchFile(f, *torchfmt::MakeTensor("0", DType::kBFloat16, stored),
                                 {torchfmt::MakeBlob("0", DType::kBFloat16, v.data(), static_cast<int64_t>(v.size()))})
            .ok());
    const std::string bytes = testing::ReadFile(f);
    PyRef index = MakeDict();
    torchfmt::DictSet(index.get(), "fqn", MakeStr("w"));
    torchfmt::DictSet(index.get(), "offset", Size(c.offsets));
    torchfmt::DictSet(index.get(), "index", MakeInt(n - 1));
    PyRef info = MakeDict();
    torchfmt::DictSet(info.get(), "relative_path", MakeStr("__0_0.distcp"));
    torchfmt::DictSet(info.get(), "offset", MakeInt(static_cast<int64_t>(distcp.size())));
    torchfmt::DictSet(info.get(), "length", MakeInt(static_cast<int64_t>(bytes.size())));
    torchfmt::DictSet(storage.get(), Object(std::string(kMeta) + "MetadataIndex", index),
                      Object("torch.distributed.checkpoint.filesystem._StorageInfo", info));
    distcp += bytes;
    PyRef chunk = MakeDict();
    torchfmt::DictSet(chunk.get(), "offsets", Size(c.offsets));
    torchfmt::DictSet(chunk.get(), "sizes", Size(c.sizes));
    chunk_list->items.push_back(Object(std::string(kMeta) + "ChunkStorageMetadata", chunk));
  }
  PyRef props = Object(std::string(kMeta) + "TensorProperties",
                       MakeTuple({MakeGlobal("torch.bfloat16"), MakeNone(), torchfmt::MakeBool(false), MakeNone(),
                                  torchfmt::MakeBool(false)}));
  PyRef tsm = MakeDict();
  torchfmt::DictSet(tsm.get(), "properties", props);
  torchfmt::DictSet(tsm.get(), "size", Size(shape));
  torchfmt::DictSet(tsm.get(), "chunks", chunk_list);
  PyRef sdm = MakeDict();
  torchfmt::DictSet(sdm.get(), "w", Object(std::string(kMeta) + "TensorStorageMetadata", tsm));
  torchfmt::DictSet(sdm.get(), "extra/shard_0_1", Object(std::string(kMeta) + "BytesStorageMetadata", MakeDict()));
  PyRef md = MakeDict();
  torchfmt::DictSet(md.get(), "state_dict_metadata", sdm);
  torchfmt::DictSet(md.get(), "planner_data", MakeNone());
  torchfmt::DictSet(md.get(), "storage_data", storage);
  testing::WriteFile(dir / ".metadata", torchfmt::WritePickle(*Object(std::string(kMeta) + "Metadata", md)));
  testing::WriteFile(dir / "__0_0.distcp", distcp);
  return distcp.size();
}

std::string ReadError(const TempDir& dir) {
  auto ck = DistCheckpoint::Open(dir.path());
  if (!ck.ok()) return std::string(ck.status().message());
  auto v = (*ck)->ReadFloat("w");
  return v.ok() ? "" : std::string(v.status().message());
}

const std::vector<ChunkSpec> kGrid = {
    {{0, 0}, {2, 3}, {}}, {{0, 3}, {2, 2}, {}}, {{2, 0}, {1, 3}, {}}, {{2, 3}, {1, 2}, {}}};

TEST(TorchDist, AssemblesChunksInPlace) {
  TempDir dir;
  WriteCheckpoint(dir, {3, 5}, kGrid);
  auto ck = DistCheckpoint::Open(dir.path());
  ASSERT_TRUE(ck.ok()) << ck.status();
  ASSERT_EQ((*ck)->tensors().size(), 1u);
  const TensorEntry& e = (*ck)->tensors().at("w");
  EXPECT_EQ(e.dtype, DType::kBFloat16);
  EXPECT_EQ(e.shape, (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(e.chunks.size(), 4u);
  EXPECT_EQ((*ck)->byte_items(), std::vector<std::string>{"extra/shard_0_1"});
  auto v = (*ck)->ReadFloat("w");
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_EQ(v->size(), 15u);
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 5; ++j) EXPECT_EQ((*v)[i * 5 + j], static_cast<float>(i * 100 + j)) << i << "," << j;
}

TEST(TorchDist, RefusesChunksThatDoNotTileTheTensor) {
  {
    TempDir dir;  // a hole: the last chunk left out
    WriteCheckpoint(dir, {3, 5}, {kGrid[0], kGrid[1], kGrid[2]});
    EXPECT_NE(ReadError(dir).find("tensor w: its chunks cover 13 of its 15 elements"), std::string::npos)
        << ReadError(dir);
  }
  {
    TempDir dir;  // two chunks overlap (and the sizes still sum up)
    WriteCheckpoint(dir, {3, 5},
                    {{{0, 0}, {2, 3}, {}}, {{0, 2}, {2, 3}, {}}, {{2, 0}, {1, 3}, {}}, {{2, 3}, {1, 2}, {}}});
    EXPECT_NE(ReadError(dir).find("chunks at [0, 0] and [0, 2] overlap"), std::string::npos) << ReadError(dir);
  }
  {
    TempDir dir;  // a chunk beyond the tensor's rows
    WriteCheckpoint(dir, {3, 5}, {kGrid[0], kGrid[1], kGrid[2], {{2, 3}, {2, 2}, {}}});
    EXPECT_NE(ReadError(dir).find("chunk at [2, 3] of sizes [2, 2] lies outside its shape [3, 5]"), std::string::npos)
        << ReadError(dir);
  }
  {
    TempDir dir;  // the archive stored for a chunk holds another shape
    WriteCheckpoint(dir, {3, 5}, {kGrid[0], kGrid[1], kGrid[2], {{2, 3}, {1, 2}, {2, 1}}});
    const std::string e = ReadError(dir);
    EXPECT_NE(e.find("__0_0.distcp: byte "), std::string::npos) << e;
    EXPECT_NE(e.find("(w chunk at [2, 3]): a tensor of shape [2, 1] where the chunk has [1, 2]"), std::string::npos)
        << e;
  }
}

TEST(TorchDist, RefusesAShortOrMissingDataFile) {
  TempDir dir;
  const size_t size = WriteCheckpoint(dir, {3, 5}, kGrid);
  const std::string full = testing::ReadFile(dir / "__0_0.distcp");
  testing::WriteFile(dir / "__0_0.distcp", full.substr(0, size - 10));
  std::string e = ReadError(dir);
  EXPECT_NE(e.find("__0_0.distcp: byte "), std::string::npos) << e;
  EXPECT_NE(e.find("(w chunk at [2, 3]): "), std::string::npos) << e;
  EXPECT_NE(e.find("the file ends after " + std::to_string(size - 10) + " (truncated)"), std::string::npos) << e;
  std::filesystem::remove(dir / "__0_0.distcp");
  e = ReadError(dir);
  EXPECT_NE(e.find("__0_0.distcp: missing: "), std::string::npos) << e;
  std::filesystem::remove(dir / ".metadata");
  EXPECT_NE(ReadError(dir).find(".metadata: missing: not a torch.distributed.checkpoint directory"), std::string::npos);
}

TEST(TorchDist, RefusesAMetadataOfAnotherClass) {
  TempDir dir;
  testing::WriteFile(dir / ".metadata", torchfmt::WritePickle(*MakeDict()));
  EXPECT_NE(ReadError(dir).find("not a torch.distributed.checkpoint Metadata"), std::string::npos) << ReadError(dir);
}

}  // namespace
}  // namespace ptk::torchdist
