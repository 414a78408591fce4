// PyTorch's zip + pickle format as ptk writes and reads it: a round trip of the values a Megatron
// checkpoint holds (dicts, lists, tuples, numbers, strings, None, argparse.Namespace, torch globals,
// fp32/bf16/fp16 tensors and strided views), zip64 records, 64-byte aligned data, and damage refused
// naming the file: a truncated archive, a CRC mismatch, an unknown global, an unknown opcode.
#include "interop/torch_format.h"

#include <sys/wait.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace ptk::torchfmt {
namespace {

using ptk::testing::ReadFile;
using ptk::testing::TempDir;
using ptk::testing::WriteFile;

struct Sample {
  PyRef root;
  std::vector<StorageBlob> blobs;
};

Sample MakeSample() {
  Sample s;
  const std::vector<float> w = {1.5f, -2.25f, 3.0f, 0.1f, 1e-30f, -0.0f};
  s.blobs.push_back(MakeBlob("0", DType::kFloat32, w.data(), 6));
  s.blobs.push_back(MakeBlob("1", DType::kBFloat16, w.data(), 6));
  s.blobs.push_back(MakeBlob("2", DType::kFloat16, w.data(), 6));
  PyRef model = MakeDict();
  DictSet(model.get(), "a.weight", MakeTensor("0", DType::kFloat32, {2, 3}));
  DictSet(model.get(), "a.bias", MakeTensor("1", DType::kBFloat16, {6}));
  DictSet(model.get(), "a.half", MakeTensor("2", DType::kFloat16, {3, 2}));
  DictSet(model.get(), "a._extra_state", MakeNone());
  PyRef attrs = MakeDict();
  DictSet(attrs.get(), "num_layers", MakeInt(12));
  DictSet(attrs.get(), "big", MakeInt(int64_t{1} << 40));
  DictSet(attrs.get(), "negative", MakeInt(-7));
  DictSet(attrs.get(), "lr", MakeFloat(3e-4));
  DictSet(attrs.get(), "name", MakeStr("GPT2BPETokenizer \xc3\xa9"));
  DictSet(attrs.get(), "bf16", MakeBool(true));
  DictSet(attrs.get(), "params_dtype", MakeGlobal("torch.bfloat16"));
  DictSet(attrs.get(), "data_path", MakeList({MakeStr("1.0"), MakeStr("x_text_document")}));
  DictSet(attrs.get(), "betas", MakeTuple({MakeFloat(0.9), MakeFloat(0.95)}));
  s.root = MakeDict();
  DictSet(s.root.get(), "args", MakeNamespace(attrs));
  DictSet(s.root.get(), "model", model);
  PyRef state = MakeDict();
  DictSet(state.get(), MakeInt(3), MakeStr("three"));
  DictSet(s.root.get(), "state", state);
  return s;
}

void CheckSample(TorchArchiveReader& r) {
  const PyValue& root = r.root();
  ASSERT_EQ(root.kind, PyValue::Kind::kDict);
  const PyValue* args = root.Get("args");
  ASSERT_NE(args, nullptr);
  EXPECT_EQ(args->ClassName(), "argparse.Namespace");
  EXPECT_EQ(args->Get("num_layers")->i, 12);
  EXPECT_EQ(args->Get("big")->i, int64_t{1} << 40);
  EXPECT_EQ(args->Get("negative")->i, -7);
  EXPECT_EQ(args->Get("lr")->f, 3e-4);
  EXPECT_EQ(args->Get("name")->s, "GPT2BPETokenizer \xc3\xa9");
  EXPECT_TRUE(args->Get("bf16")->b);
  EXPECT_EQ(args->Get("params_dtype")->s, "torch.bfloat16");
  EXPECT_EQ(args->Get("data_path")->items.size(), 2u);
  EXPECT_EQ(args->Get("betas")->kind, PyValue::Kind::kTuple);
  const PyValue* model = root.Get("model");
  ASSERT_NE(model, nullptr);
  EXPECT_EQ(model->Get("a._extra_state")->kind, PyValue::Kind::kNone);
  const PyValue* w = model->Get("a.weight");
  ASSERT_EQ(w->kind, PyValue::Kind::kTensor);
  EXPECT_EQ(w->tensor.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(w->tensor.stride, (std::vector<int64_t>{3, 1}));
  auto f = r.ReadFloat(w->tensor, "a.weight");
  ASSERT_TRUE(f.ok()) << f.status();
  const std::vector<float> want = {1.5f, -2.25f, 3.0f, 0.1f, 1e-30f, -0.0f};
  EXPECT_EQ(std::memcmp(f->data(), want.data(), 24), 0);
  auto b = r.ReadFloat(model->Get("a.bias")->tensor, "a.bias");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)[0], 1.5f);
  EXPECT_EQ((*b)[3], Bf16ToFloat(FloatToBf16(0.1f)));
  auto h = r.ReadFloat(model->Get("a.half")->tensor, "a.half");
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ((*h)[1], -2.25f);
  EXPECT_EQ((*h)[3], HalfToFloat(FloatToHalf(0.1f)));
  EXPECT_EQ((*h)[4], 0.0f);  // below fp16's range
  const PyValue* state = root.Get("state");
  ASSERT_EQ(state->dict.size(), 1u);
  EXPECT_EQ(state->dict[0].first->i, 3);
}

TEST(TorchFormat, RoundTripsTheValuesACheckpointHolds) {
  TempDir dir;
  Sample s = MakeSample();
  for (bool zip64 : {false, true}) {
    const std::string path = dir / (zip64 ? "z64.pt" : "plain.pt");
    ASSERT_TRUE(WriteTorchFile(path, *s.root, s.blobs, zip64).ok());
    auto r = TorchArchiveReader::Open(path);
    ASSERT_TRUE(r.ok()) << r.status();
    CheckSample(**r);
    // Every entry's data starts on a 64-byte boundary, as torch.save aligns it.
    const std::string bytes = ReadFile(path);
    size_t at = 0;
    int entries = 0;
    while ((at = bytes.find("PK\x03\x04", at)) != std::string::npos) {
      const size_t name_len = static_cast<uint8_t>(bytes[at + 26]) | static_cast<uint8_t>(bytes[at + 27]) << 8;
      const size_t extra_len = static_cast<uint8_t>(bytes[at + 28]) | static_cast<uint8_t>(bytes[at + 29]) << 8;
      EXPECT_EQ((at + 30 + name_len + extra_len) % 64, 0u) << bytes.substr(at + 30, name_len);
      ++entries;
      at += 4;
    }
    EXPECT_EQ(entries, 6);  // data.pkl, byteorder, three storages, version
    EXPECT_EQ(bytes.find("PK\x06\x06") != std::string::npos, zip64);
  }
}

// PyTorch's own torch.load reads what ptk writes, zip64 records included (Debian's python3-torch).
TEST(TorchFormat, TorchLoadReadsTheFiles) {
  TempDir dir;
  Sample s = MakeSample();
  for (bool zip64 : {false, true})
    ASSERT_TRUE(WriteTorchFile(dir / (zip64 ? "z64.pt" : "plain.pt"), *s.root, s.blobs, zip64).ok());
  {
    const std::string script =
        "import sys, zipfile\n"
        "try:\n"
        "  import torch\n"
        "except ImportError:\n"
        "  sys.exit(77)\n"
        "for path in sys.argv[1:]:\n"
        "  sd = torch.load(path)\n"
        "  assert zipfile.ZipFile(path).testzip() is None\n"
        "  a = sd['args']\n"
        "  assert (a.num_layers, a.big, a.negative, a.lr, a.bf16) == (12, 1 << 40, -7, 3e-4, True), a\n"
        "  assert a.params_dtype == torch.bfloat16 and a.betas == (0.9, 0.95) and a.name.endswith('\\xe9')\n"
        "  w = sd['model']['a.weight']\n"
        "  assert w.dtype == torch.float32 and w.shape == (2, 3) and w[0, 1].item() == -2.25, w\n"
        "  assert sd['model']['a.bias'].dtype == torch.bfloat16 and sd['model']['a.half'].dtype == torch.float16\n"
        "  assert sd['model']['a._extra_state'] is None and sd['state'] == {3: 'three'}\n";
    ptk::testing::WriteFile(dir / "check.py", script);
    const int rc = std::system(
        ("/usr/bin/python3 " + (dir / "check.py") + " " + (dir / "plain.pt") + " " + (dir / "z64.pt")).c_str());
    if (WIFEXITED(rc) && WEXITSTATUS(rc) == 77) GTEST_SKIP() << "no python3-torch";
    EXPECT_EQ(rc, 0);
  }
}

TEST(TorchFormat, ReadsStridedViews) {
  TempDir dir;
  const std::vector<float> data = {0, 1, 2, 3, 4, 5};
  std::vector<StorageBlob> blobs = {MakeBlob("0", DType::kFloat32, data.data(), 6)};
  PyRef t = MakeTensor("0", DType::kFloat32, {3, 2});
  t->tensor.storage_numel = 6;
  t->tensor.stride = {1, 3};  // the transpose of a (2, 3) tensor
  PyRef root = MakeDict();
  DictSet(root.get(), "t", t);
  ASSERT_TRUE(WriteTorchFile(dir / "v.pt", *root, blobs).ok());
  auto r = TorchArchiveReader::Open(dir / "v.pt");
  ASSERT_TRUE(r.ok()) << r.status();
  auto f = (*r)->ReadFloat((*r)->root().Get("t")->tensor, "t");
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(*f, (std::vector<float>{0, 3, 1, 4, 2, 5}));
  // A view past its storage is refused naming the tensor.
  t->tensor.offset = 2;
  ASSERT_TRUE(WriteTorchFile(dir / "w.pt", *root, blobs).ok());
  auto r2 = TorchArchiveReader::Open(dir / "w.pt");
  ASSERT_TRUE(r2.ok());
  auto bad = (*r2)->ReadFloat((*r2)->root().Get("t")->tensor, "t");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("tensor t"), std::string::npos) << bad.status();
}

TEST(TorchFormat, RefusesDamage) {
  TempDir dir;
  Sample s = MakeSample();
  const std::string path = dir / "x.pt";
  ASSERT_TRUE(WriteTorchFile(path, *s.root, s.blobs).ok());
  const std::string bytes = ReadFile(path);
  // Truncated anywhere: no end record, or entries past the end.
  for (size_t cut : {size_t{10}, bytes.size() / 2, bytes.size() - 5}) {
    WriteFile(dir / "cut.pt", bytes.substr(0, cut));
    auto r = TorchArchiveReader::Open(dir / "cut.pt");
    ASSERT_FALSE(r.ok()) << cut;
    EXPECT_NE(r.status().message().find(dir / "cut.pt"), std::string::npos) << r.status();
  }
  // ptk's own checkpoint under Megatron's name: named as such, with the loader that reads it.
  WriteFile(dir / "ptk.pt", std::string("PTKCKPT1") + std::string(100, '\0'));
  auto ptk = TorchArchiveReader::Open(dir / "ptk.pt");
  ASSERT_FALSE(ptk.ok());
  EXPECT_NE(ptk.status().message().find("it is a ptk checkpoint (ptk-train's format, PTKCKPT1), not a torch.save file: "
                                        "--loader ptk reads it"),
            std::string::npos)
      << ptk.status();
  // A flipped byte in a storage: the CRC names the entry.
  std::string flipped = bytes;
  const size_t payload = bytes.find(std::string(reinterpret_cast<const char*>(s.blobs[0].bytes.data()), 24));
  ASSERT_NE(payload, std::string::npos);
  flipped[payload + 1] ^= 0x40;
  WriteFile(dir / "flip.pt", flipped);
  auto f = TorchArchiveReader::Open(dir / "flip.pt");
  ASSERT_TRUE(f.ok()) << f.status();
  auto read = (*f)->ReadFloat((*f)->root().Get("model")->Get("a.weight")->tensor, "a.weight");
  ASSERT_FALSE(read.ok());
  EXPECT_NE(read.status().message().find("CRC"), std::string::npos) << read.status();
}

TEST(TorchFormat, RefusesUnknownGlobalsAndOpcodes) {
  // os.system, as a malicious pickle would call it: refused by name, never called.
  const std::string evil = std::string("\x80\x02") + "cos\nsystem\nX\x04\x00\x00\x00echo\x85R.";
  auto r = ParsePickle(evil, "evil.pkl");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("evil.pkl"), std::string::npos);
  EXPECT_NE(r.status().message().find("os.system"), std::string::npos) << r.status();
  auto op = ParsePickle(std::string("\x80\x02") + "I12\n.", "text.pkl");
  ASSERT_FALSE(op.ok());
  EXPECT_NE(op.status().message().find("opcode 0x49"), std::string::npos) << op.status();
  auto cut = ParsePickle(std::string("\x80\x02}X\x05\x00\x00\x00ab"), "cut.pkl");
  ASSERT_FALSE(cut.ok());
  EXPECT_NE(cut.status().message().find("truncated"), std::string::npos) << cut.status();
}

// Python 3.11 pickles an enum member as getattr(cls, name) (a torch_dist .metadata's TensorProperties
// memory format, PyTorch 2.6 on Python 3.11): read as the member's name; getattr of anything else refused.
TEST(TorchFormat, ReadsEnumMembersPickledByName) {
  // pickle.dumps(_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT, protocol=2) on Python 3.11.
  const std::string member = std::string("\x80\x02") + "c__builtin__\ngetattr\n" +
                             "ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n" +
                             std::string("X\x17\x00\x00\x00TORCH_CONTIGUOUS_FORMAT\x86R.", 31);
  auto r = ParsePickle(member, "enum.pkl");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->kind, PyValue::Kind::kGlobal);
  EXPECT_EQ((*r)->s, "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT");
  // getattr(os.system, ...) never gets as far: os is refused; getattr of a non-global, or of two names, refused.
  auto of_str = ParsePickle(std::string("\x80\x02"
                                        "c__builtin__\ngetattr\nX\x01\x00\x00\x00"
                                        "aX\x01\x00\x00\x00"
                                        "b\x86R.",
                                        38),
                            "getattr.pkl");
  ASSERT_FALSE(of_str.ok());
  EXPECT_NE(of_str.status().message().find("getattr of something other than (a global, a name)"), std::string::npos)
      << of_str.status();
}

TEST(TorchFormat, HalfAndBf16Conversions) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3F80);
  EXPECT_EQ(FloatToBf16(1.00390625f), 0x3F80);  // a tie rounds to even
  EXPECT_EQ(FloatToBf16(1.01171875f), 0x3F82);  // a tie rounds to even (up)
  EXPECT_EQ(FloatToHalf(1.0f), 0x3C00);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7BFF);
  EXPECT_EQ(FloatToHalf(1e6f), 0x7C00);
  EXPECT_EQ(HalfToFloat(0x0001), 5.960464477539063e-08f);
  EXPECT_EQ(HalfToFloat(FloatToHalf(-3.5f)), -3.5f);
  EXPECT_EQ(Crc32("123456789", 9), 0xCBF43926u);
}

}  // namespace
}  // namespace ptk::torchfmt
