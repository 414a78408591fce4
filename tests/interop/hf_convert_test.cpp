// ptk-convert's mapping, without transformers (hf_transformers_test.py runs the exported model in
// it): the HF tensors hold Megatron's weights where GPT-2 has them (c_attn's [q | k | v] columns,
// Conv1D's transposed weights, the padded rows dropped), import undoes it (padded rows copies of the
// last one), export -> import -> export is byte-identical, and a mismatched or damaged HF directory
// is refused naming the tensor.
#include "interop/hf_gpt2.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/py_format.h"
#include "common/status.h"
#include "interop/megatron.h"
#include "interop/safetensors.h"
#include "tests/interop/hf_convert_fixture.h"
#include "tests/test_util.h"
#include "tests/trainer/small_gpt.h"
#include "trainer/checkpoint.h"

namespace ptk {
namespace {

using ptk::testing::ReadFile;
using ptk::testing::RunCmd;
using ptk::testing::ShellQuote;
using ptk::testing::TempDir;
using ptk::testing::WriteFile;

class HfConvert : public ptk::testing::HfConvertFixture {
 protected:
  // A ptk checkpoint of a small GPT-3-style model at iteration 7.
  void Save(bool untie, const std::string& dir, bool record_vocab = true) {
    c_.num_layers = 2;
    c_.hidden_size = 8;
    c_.num_attention_heads = 2;
    c_.ffn_hidden_size = 24;
    c_.seq_length = 16;
    c_.max_position_embeddings = 16;
    c_.vocab_size = 50257;
    c_.padded_vocab_size = 50304;
    c_.layernorm_epsilon = 1e-6;
    c_.untie_embeddings_and_output_weights = untie;
    std::vector<std::pair<std::string, std::string>> settings = {
        {"--layernorm-epsilon", "1e-06"}, {"--hidden-dropout", "0"}, {"--attention-dropout", "0.05"}};
    if (record_vocab) settings.push_back({"--vocab-size", "50257"});
    SaveModel(c_, dir, 7, std::move(settings));
  }

  GPTConfig c_;
};

TEST_F(HfConvert, ExportPutsMegatronsWeightsWhereGpt2HasThem) {
  Save(false, dir_ / "ck");
  auto s = ExportToHf(Opts("ptk", "hf", dir_ / "ck", dir_ / "hf"));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->iteration, 7);
  const int64_t C = 8, hd = 4, F = 24;
  std::vector<int64_t> shape;
  // wte: the real rows only.
  std::vector<float> wte = Tensor(dir_ / "hf", "transformer.wte.weight", &shape);
  EXPECT_EQ(shape, (std::vector<int64_t>{50257, C}));
  EXPECT_EQ(wte[50256 * C + 3], P(layout_.wte + 50256 * C + 3));
  // c_attn: HF column w*C + n*hd + d of input i is Megatron's row (n*3 + w)*hd + d.
  const auto& lp = layout_.layers[1];
  std::vector<float> qkv = Tensor(dir_ / "hf", "transformer.h.1.attn.c_attn.weight", &shape);
  EXPECT_EQ(shape, (std::vector<int64_t>{C, 3 * C}));
  for (int64_t n = 0; n < 2; ++n)
    for (int64_t w = 0; w < 3; ++w)
      for (int64_t d = 0; d < hd; ++d)
        for (int64_t i = 0; i < C; ++i)
          ASSERT_EQ(qkv[i * 3 * C + w * C + n * hd + d], P(lp.qkv_w + ((n * 3 + w) * hd + d) * C + i));
  std::vector<float> qkv_b = Tensor(dir_ / "hf", "transformer.h.1.attn.c_attn.bias");
  EXPECT_EQ(qkv_b[2 * C + 1 * hd + 3], P(lp.qkv_b + (1 * 3 + 2) * hd + 3));  // v of head 1, d 3
  // Conv1D weights are (in, out): Megatron's (out, in) transposed.
  std::vector<float> fc = Tensor(dir_ / "hf", "transformer.h.1.mlp.c_fc.weight", &shape);
  EXPECT_EQ(shape, (std::vector<int64_t>{C, F}));
  EXPECT_EQ(fc[5 * F + 17], P(lp.fc1_w + 17 * C + 5));
  std::vector<float> proj = Tensor(dir_ / "hf", "transformer.h.1.mlp.c_proj.weight", &shape);
  EXPECT_EQ(shape, (std::vector<int64_t>{F, C}));
  EXPECT_EQ(proj[17 * C + 5], P(lp.fc2_w + 5 * F + 17));
  // Tied: no lm_head in the file; config.json says how it was computed.
  auto f = SafetensorsFile::Open(dir_ / "hf/model.safetensors");
  EXPECT_EQ((*f)->Find("lm_head.weight"), nullptr);
  EXPECT_EQ((*f)->tensors().size(), 2u + 2u * 12u + 2u);
  EXPECT_EQ((*f)->metadata().at("format"), "pt");
  const std::string config = ReadFile(dir_ / "hf/config.json");
  for (const char* want :
       {"\"activation_function\": \"gelu_new\"", "\"layer_norm_epsilon\": 1e-06", "\"n_positions\": 16",
        "\"vocab_size\": 50257", "\"tie_word_embeddings\": true", "\"n_inner\": 24", "\"resid_pdrop\": 0.0",
        "\"attn_pdrop\": 0.05", "\"model_type\": \"gpt2\""})
    EXPECT_NE(config.find(want), std::string::npos) << want << "\n" << config;
  EXPECT_EQ(ReadFile(dir_ / "hf/vocab.json"), ReadFile(ptk::testing::SourceDir() + "/tokenizer/data/gpt2-vocab.json"));
  EXPECT_EQ(ReadFile(dir_ / "hf/merges.txt"), ReadFile(ptk::testing::SourceDir() + "/tokenizer/data/gpt2-merges.txt"));
  EXPECT_EQ(ptk::testing::Leftovers(dir_.path()), "");
}

// --squared-relu is GPT-2's relu2 (and read back as it); --apply-layernorm-1p's zero-centred norm
// weights go out as 1 + gamma (what the trained model multiplies by), with a note; the import reads
// plain norms (the same model without the flag).
TEST_F(HfConvert, SquaredReluIsRelu2AndLayerNorm1pIsFoldedIntoTheWeights) {
  c_.squared_relu = true;
  c_.apply_layernorm_1p = true;
  Save(false, dir_ / "ck");
  auto s = ExportToHf(Opts("ptk", "hf", dir_ / "ck", dir_ / "hf"));
  ASSERT_TRUE(s.ok()) << s.status();
  const std::string config = ReadFile(dir_ / "hf/config.json");
  EXPECT_NE(config.find("\"activation_function\": \"relu2\""), std::string::npos) << config;
  bool noted = false;
  for (const std::string& n : s->notes) noted |= n.find("--apply-layernorm-1p: each norm's weight") == 0;
  EXPECT_TRUE(noted);
  const auto& lp = layout_.layers[1];
  const std::vector<float> ln1 = Tensor(dir_ / "hf", "transformer.h.1.ln_1.weight"),
                           ln1_b = Tensor(dir_ / "hf", "transformer.h.1.ln_1.bias"),
                           lnf = Tensor(dir_ / "hf", "transformer.ln_f.weight");
  for (int64_t j = 0; j < 8; ++j) {
    EXPECT_EQ(ln1[j], 1.0f + P(lp.ln1_w + j)) << j;
    EXPECT_EQ(ln1_b[j], P(lp.ln1_b + j)) << j;  // biases as they are
    EXPECT_EQ(lnf[j], 1.0f + P(layout_.lnf_w + j)) << j;
  }
  auto imp = ImportFromHf(Opts("hf", "ptk", dir_ / "hf", dir_ / "back"));
  ASSERT_TRUE(imp.ok()) << imp.status();
  EXPECT_TRUE(imp->config.squared_relu);
  EXPECT_FALSE(imp->config.apply_layernorm_1p);
  EXPECT_NE(imp->train_flags.find(" --squared-relu"), std::string::npos) << imp->train_flags;
}

// An import whose save fails (a full disk: injected at the checkpoint file's write) leaves no --save-dir it
// made, and one that was there as it was (a full disk left the empty directory, and its parents).
TEST_F(HfConvert, AnImportThatFailsOnAFullDiskLeavesNoSaveDirItMade) {
  Save(false, dir_ / "ck");
  ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "ck", dir_ / "hf")).ok());
  std::filesystem::create_directories(dir_ / "there");
  for (const std::string& save : {dir_ / "new/imported", dir_ / "there"}) {
    SetSaveStepHookForTesting([](std::string_view step) {
      return step == "write checkpoint file" ? absl::ResourceExhaustedError("No space left on device (injected)")
                                             : absl::OkStatus();
    });
    auto r = ImportFromHf(Opts("hf", "ptk", dir_ / "hf", save));
    SetSaveStepHookForTesting(nullptr);
    ASSERT_FALSE(r.ok());
    EXPECT_TRUE(absl::IsResourceExhausted(r.status())) << r.status();
  }
  EXPECT_FALSE(std::filesystem::exists(dir_ / "new"));
  EXPECT_TRUE(std::filesystem::is_empty(dir_ / "there"));
  ASSERT_TRUE(ImportFromHf(Opts("hf", "ptk", dir_ / "hf", dir_ / "new/imported")).ok());
  EXPECT_EQ(*LatestCheckpointIteration(dir_ / "new/imported"), 0);
}

// The exact GELU (Megatron's GELU MLP without its fused bias-GELU kernel) is transformers' "gelu"
// (GELUActivation, F.gelu), read back as it, with --no-bias-gelu-fusion in the flags; the tanh GELU stays
// "gelu_new" (the test above).
TEST_F(HfConvert, ExactGeluIsGeluAndTanhGeluIsGeluNew) {
  c_.gelu_exact = true;
  Save(false, dir_ / "ck");
  ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "ck", dir_ / "hf")).ok());
  const std::string config = ReadFile(dir_ / "hf/config.json");
  EXPECT_NE(config.find("\"activation_function\": \"gelu\","), std::string::npos) << config;
  auto imp = ImportFromHf(Opts("hf", "ptk", dir_ / "hf", dir_ / "back"));
  ASSERT_TRUE(imp.ok()) << imp.status();
  EXPECT_TRUE(imp->config.gelu_exact);
  EXPECT_FALSE(imp->config.squared_relu);
  EXPECT_NE(imp->train_flags.find(" --no-bias-gelu-fusion"), std::string::npos) << imp->train_flags;
  ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "back", dir_ / "hf2")).ok());
  EXPECT_EQ(ReadFile(dir_ / "hf2/config.json"), config);
}

TEST_F(HfConvert, ExportImportExportIsByteIdenticalTiedAndUntied) {
  for (bool untie : {false, true}) {
    const std::string tag = untie ? "u" : "t";
    Save(untie, dir_ / ("ck" + tag));
    ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / ("ck" + tag), dir_ / ("hf" + tag))).ok());
    auto imp = ImportFromHf(Opts("hf", "ptk", dir_ / ("hf" + tag), dir_ / ("back" + tag)));
    ASSERT_TRUE(imp.ok()) << imp.status();
    EXPECT_EQ(imp->destination, CheckpointFile(dir_ / ("back" + tag), 0));
    ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / ("back" + tag), dir_ / ("hf2" + tag))).ok());
    for (const char* f : {"model.safetensors", "config.json", "generation_config.json", "tokenizer_config.json",
                          "vocab.json", "merges.txt"})
      EXPECT_EQ(ReadFile(dir_ / ("hf" + tag + "/" + f)), ReadFile(dir_ / ("hf2" + tag + "/" + f))) << tag << " " << f;
    // The imported checkpoint: the same weights, padded rows copies of the last real row, moments zero.
    std::vector<float> params, m, v;
    TrainState st;
    ASSERT_TRUE(LoadCheckpoint(dir_ / ("back" + tag), 0, layout_, &params, &m, &v, &st).ok());
    const int64_t C = 8;
    for (int64_t i = 0; i < layout_.num_params; ++i) {
      const bool padded_wte = i >= layout_.wte + 50257 * C && i < layout_.wte + 50304 * C;
      const bool padded_out = untie && i >= layout_.out_w + 50257 * C && i < layout_.out_w + 50304 * C;
      if (padded_wte || padded_out) {
        const int64_t base = padded_wte ? layout_.wte : layout_.out_w;
        ASSERT_EQ(params[i], P(base + 50256 * C + (i - base) % C)) << i;
      } else {
        ASSERT_EQ(params[i], P(i)) << i;
      }
    }
    EXPECT_EQ(m, std::vector<float>(m.size(), 0.0f));
    EXPECT_EQ(st.iteration, 0);
    if (untie) {
      EXPECT_NE(ReadFile(dir_ / "hfu/config.json").find("\"tie_word_embeddings\": false"), std::string::npos);
      EXPECT_EQ(Tensor(dir_ / "hfu", "lm_head.weight")[3], P(layout_.out_w + 3));
    }
  }
}

// Rewrites `dir`/model.safetensors through `edit` (name -> tensor; erase, add or reshape).
void EditWeights(
    const std::string& dir,
    const std::function<void(std::map<std::string, std::pair<std::vector<int64_t>, std::vector<float>>>*)>& edit) {
  auto f = SafetensorsFile::Open(dir + "/model.safetensors");
  ASSERT_TRUE(f.ok()) << f.status();
  std::map<std::string, std::pair<std::vector<int64_t>, std::vector<float>>> t;
  for (const SafetensorsTensor& x : (*f)->tensors()) t[x.name] = {x.shape, *(*f)->ReadFloat(x)};
  f->reset();
  edit(&t);
  std::vector<SafetensorsEntry> entries;
  for (const auto& [name, v] : t) entries.push_back({name, v.first, v.second});
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", entries, {{"format", "pt"}}).ok());
}

TEST_F(HfConvert, MismatchedOrDamagedDirectoriesAreRefusedNamingTheTensor) {
  Save(false, dir_ / "ck");
  auto fresh = [&](const std::string& name) {
    const std::string d = dir_ / name;
    EXPECT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "ck", d)).ok());
    return d;
  };
  int n = 0;
  auto import_error = [&](const std::string& d) {
    auto r = ImportFromHf(Opts("hf", "ptk", d, dir_ / ("out" + std::to_string(n++))));
    EXPECT_FALSE(r.ok());
    return r.ok() ? std::string() : std::string(r.status().message());
  };
  std::string d = fresh("missing");
  EditWeights(d, [](auto* t) { t->erase("transformer.h.1.mlp.c_fc.bias"); });
  EXPECT_NE(import_error(d).find("tensor transformer.h.1.mlp.c_fc.bias: missing (config.json asks for shape [24])"),
            std::string::npos);
  d = fresh("extra");
  EditWeights(d, [](auto* t) { (*t)["transformer.h.2.ln_1.weight"] = {{8}, std::vector<float>(8, 1.0f)}; });
  EXPECT_NE(import_error(d).find("tensor transformer.h.2.ln_1.weight: not a weight of the GPT-2 model"),
            std::string::npos);
  d = fresh("shape");
  WriteFile(d + "/config.json",
            std::regex_replace(ReadFile(d + "/config.json"), std::regex("\"n_inner\": 24"), "\"n_inner\": 32"));
  EXPECT_NE(import_error(d).find("tensor transformer.h.0.mlp.c_fc.weight: shape [8, 24], config.json asks for [8, 32]"),
            std::string::npos);
  d = fresh("nan");
  EditWeights(d, [](auto* t) { (*t)["transformer.ln_f.bias"].second[2] = std::nanf(""); });
  EXPECT_NE(import_error(d).find("tensor transformer.ln_f.bias: holds a NaN"), std::string::npos);
  d = fresh("lmhead");
  EditWeights(d, [](auto* t) {
    auto wte = (*t)["transformer.wte.weight"];
    wte.second[11] += 1.0f;
    (*t)["lm_head.weight"] = wte;
  });
  EXPECT_NE(import_error(d).find("tensor lm_head.weight: differs from transformer.wte.weight, but config.json ties"),
            std::string::npos);
  // An lm_head equal to the embedding (as some files carry it) is fine.
  d = fresh("lmhead-same");
  EditWeights(d, [](auto* t) { (*t)["lm_head.weight"] = (*t)["transformer.wte.weight"]; });
  EXPECT_TRUE(ImportFromHf(Opts("hf", "ptk", d, dir_ / "ok-lmhead")).ok());
  d = fresh("truncated");
  const std::string w = ReadFile(d + "/model.safetensors");
  WriteFile(d + "/model.safetensors", w.substr(0, w.size() - 4));
  EXPECT_NE(import_error(d).find("not a valid safetensors file"), std::string::npos);
  d = fresh("act");
  WriteFile(d + "/config.json", std::regex_replace(ReadFile(d + "/config.json"), std::regex("gelu_new"), "quick_gelu"));
  EXPECT_NE(import_error(d).find("activation_function \"quick_gelu\": ptk computes the tanh GELU"), std::string::npos);
  d = fresh("type");
  WriteFile(d + "/config.json",
            std::regex_replace(ReadFile(d + "/config.json"), std::regex("\"layer_norm_epsilon\": 1e-06"),
                               "\"layer_norm_epsilon\": \"small\""));
  EXPECT_NE(import_error(d).find("layer_norm_epsilon is not a number"), std::string::npos);
  d = fresh("bin");
  std::remove((d + "/model.safetensors").c_str());
  WriteFile(d + "/pytorch_model.bin", "x");
  EXPECT_NE(import_error(d).find("a PyTorch pickle (pytorch_model.bin)"), std::string::npos);
}

// config.json is read as transformers reads it (Python's json.load): a key given twice takes its
// last value, whichever comes first; python3 itself says which values those are. Every value is
// range-checked, naming the key.
TEST_F(HfConvert, ConfigJsonIsReadAsPythonsJsonReadsItAndRangeChecked) {
  Save(false, dir_ / "ck");
  const std::string hf = dir_ / "hf";
  ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "ck", hf)).ok());
  const std::string config = ReadFile(hf + "/config.json");
  ASSERT_EQ(config.rfind("{", 0), 0u) << config;
  // The object with `first` inserted after its "{" and `last` before its final "}".
  auto with = [&](const std::string& first, const std::string& last) {
    const size_t close = config.rfind('}');
    return "{" + first + config.substr(1, close - 1) + last + "}";
  };
  // What Python's json makes of config.json: n_head, activation_function, layer_norm_epsilon and
  // tie_word_embeddings, one per line.
  auto python = [&](const std::string& dir) {
    auto r =
        RunCmd("python3 -c " +
               ShellQuote("import json,sys; c=json.load(open(sys.argv[1])); "
                          "print(c['n_head']); print(c['activation_function']); "
                          "print(repr(float(c['layer_norm_epsilon']))); print(c.get('tie_word_embeddings', True))") +
               " " + ShellQuote(dir + "/config.json"));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return r.output;
  };
  auto ptk = [](const GPTConfig& c) {
    return fmt::format("{}\ngelu_new\n{}\n{}\n", c.num_attention_heads, py::FloatRepr(c.layernorm_epsilon),
                       c.untie_embeddings_and_output_weights ? "False" : "True");
  };
  int n = 0;
  struct Case {
    std::string first, last;
  };
  const Case cases[] = {
      // The hostile values first (what simdjson's lookup finds), the exported ones last.
      {"\"n_head\": 4, \"activation_function\": \"relu\", \"layer_norm_epsilon\": 0.5, \"tie_word_embeddings\": "
       "false, ",
       ""},
      // Other values last: transformers loads them, so ptk must.
      {"", ", \"n_head\": 4, \"layer_norm_epsilon\": 0.001, \"layer_norm_epsilon\": 0.0001"},
  };
  for (const Case& c : cases) {
    const std::string d = dir_ / ("dup" + std::to_string(n++));
    ASSERT_EQ(RunCmd("cp -r " + ShellQuote(hf) + " " + ShellQuote(d)).exit_code, 0);
    WriteFile(d + "/config.json", with(c.first, c.last));
    const std::string py_read = python(d);
    auto r = ImportFromHf(Opts("hf", "ptk", d, dir_ / ("dup-out" + std::to_string(n))));
    ASSERT_TRUE(r.ok()) << r.status() << "\n" << ReadFile(d + "/config.json");
    EXPECT_EQ(ptk(r->config), py_read) << ReadFile(d + "/config.json");
  }
  // Values out of range, each refused naming the key.
  const std::pair<std::string, std::string> bad[] = {
      {"\"layer_norm_epsilon\": 1e300", "layer_norm_epsilon 1e+300 is outside (0.0, 1.0]"},
      {"\"layer_norm_epsilon\": 0", "layer_norm_epsilon 0.0 is outside (0.0, 1.0]"},
      {"\"layer_norm_epsilon\": -1e-5", "layer_norm_epsilon -1e-05 is outside (0.0, 1.0]"},
      {"\"resid_pdrop\": 1.5", "resid_pdrop 1.5 is outside [0.0, 1.0)"},
      {"\"attn_pdrop\": -0.1", "attn_pdrop -0.1 is outside [0.0, 1.0)"},
      {"\"embd_pdrop\": 1", "embd_pdrop 1.0 is outside [0.0, 1.0)"},
      {"\"initializer_range\": 0", "initializer_range 0.0 is outside (0.0, 1.0]"},
      {"\"initializer_range\": 1e9", "initializer_range 1000000000.0 is outside (0.0, 1.0]"},
      {"\"n_head\": 4294967298", "n_head is not a positive integer of at most 2147483647"},
      {"\"n_layer\": 1e300", "n_layer is not a positive integer"},
      {"\"n_layer\": 1000000, \"n_embd\": 1000000",
       "n_layer 1000000, n_embd 1000000, n_inner 24, vocab_size 50257 and n_positions 16 make 4e+18 parameters: more "
       "than ptk can hold"},
      {"\"vocab_size\": -3", "vocab_size is not a positive integer"},
  };
  for (const auto& [value, expected] : bad) {
    SCOPED_TRACE(value);
    const std::string d = dir_ / ("bad" + std::to_string(n++));
    ASSERT_EQ(RunCmd("cp -r " + ShellQuote(hf) + " " + ShellQuote(d)).exit_code, 0);
    WriteFile(d + "/config.json", with("", ", " + value));
    auto r = ImportFromHf(Opts("hf", "ptk", d, dir_ / ("bad-out" + std::to_string(n))));
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find(d + "/config.json: " + expected), absl::string_view::npos) << r.status();
  }
}

// A FIFO (or another file that is not a regular file) where ptk-convert reads a file is refused
// with one line naming it; before, open(2) waited for a writer forever.
TEST_F(HfConvert, AFifoInPlaceOfAFileIsRefusedNotWaitedOn) {
  Save(false, dir_ / "ck");
  const std::string hf = dir_ / "hf";
  ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "ck", hf)).ok());
  const std::string tool = ptk::testing::Tool("ptk-convert");
  int n = 0;
  for (const char* name : {"config.json", "model.safetensors"}) {
    SCOPED_TRACE(name);
    const std::string d = dir_ / ("fifo" + std::to_string(n++));
    ASSERT_EQ(RunCmd("cp -r " + ShellQuote(hf) + " " + ShellQuote(d) + " && rm " + ShellQuote(d + "/" + name) +
                     " && mkfifo " + ShellQuote(d + "/" + name))
                  .exit_code,
              0);
    // timeout: without the check, the import never ends.
    auto r = RunCmd("timeout 60 " + tool + " --loader hf --saver ptk --load-dir " + ShellQuote(d) + " --save-dir " +
                    ShellQuote(dir_ / ("fifo-out" + std::to_string(n))));
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find(d + "/" + name + " is a FIFO, not a regular file"), std::string::npos) << r.output;
  }
  // The ptk checkpoint ptk-convert exports from, as a FIFO.
  const std::string ck = dir_ / "ck-fifo";
  ASSERT_EQ(RunCmd("cp -r " + ShellQuote(dir_ / "ck") + " " + ShellQuote(ck)).exit_code, 0);
  auto latest = LatestCheckpointIteration(ck);
  ASSERT_TRUE(latest.ok()) << latest.status();
  const std::string file = CheckpointFile(ck, *latest);
  ASSERT_EQ(RunCmd("rm " + ShellQuote(file) + " && mkfifo " + ShellQuote(file)).exit_code, 0);
  auto r = RunCmd("timeout 60 " + tool + " --loader ptk --saver hf --load-dir " + ShellQuote(ck) + " --save-dir " +
                  ShellQuote(dir_ / "ck-fifo-out"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find(file + " is a FIFO, not a regular file"), std::string::npos) << r.output;
}

TEST_F(HfConvert, ExportNeedsTheVocabularySize) {
  Save(false, dir_ / "ck", /*record_vocab=*/false);
  auto r = ExportToHf(Opts("ptk", "hf", dir_ / "ck", dir_ / "hf"));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("give --true-vocab-size"), absl::string_view::npos) << r.status();
  ConvertOptions o = Opts("ptk", "hf", dir_ / "ck", dir_ / "hf");
  o.true_vocab_size = 50257;
  EXPECT_TRUE(ExportToHf(o).ok());
  o.true_vocab_size = 50000;  // the built-in GPT-2 files have 50257 entries
  r = ExportToHf(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("the model's vocabulary has 50000 entries, the tokenizer's 50257"),
            absl::string_view::npos)
      << r.status();
}

// An import padded with --make-vocab-size-divisible-by 16 recorded the padded vocabulary (1008 rows for
// 1000 tokens) but not the divisor, so ptk-train --use-checkpoint-args (default divisor 128) read the
// padding as a multiple of 128 x T, which 1008 is not, and refused the checkpoint. It records the
// divisor, as Megatron's args hold make_vocab_size_divisible_by, and resumes at the same 1008 rows.
TEST_F(HfConvert, ImportRecordsTheDivisorAndResumesWithCheckpointArgsAtTheSamePadding) {
  GPTConfig c;
  c.num_layers = 2;
  c.hidden_size = 8;
  c.num_attention_heads = 2;
  c.ffn_hidden_size = 24;
  c.seq_length = c.max_position_embeddings = 16;
  c.vocab_size = 1000;
  c.padded_vocab_size = 1008;
  SaveModel(c, dir_ / "ck", 7, {{"--vocab-size", "1000"}, {"--make-vocab-size-divisible-by", "16"}});
  ConvertOptions x = Opts("ptk", "hf", dir_ / "ck", dir_ / "hf");
  x.vocab_file = ptk::testing::SourceDir() + "/tests/data/trainer/gpt2-1000-vocab.json";  // GPT-2's first 1000
  x.merge_file = ptk::testing::SourceDir() + "/tests/data/trainer/gpt2-1000-merges.txt";
  auto exported = ExportToHf(x);
  ASSERT_TRUE(exported.ok()) << exported.status();
  ConvertOptions o = Opts("hf", "ptk", dir_ / "hf", dir_ / "imported");
  o.make_vocab_size_divisible_by = 16;
  auto r = ImportFromHf(o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->config.padded_vocab_size, 1008);
  auto settings = ReadCheckpointSettings(dir_ / "imported", 0);
  ASSERT_TRUE(settings.ok()) << settings.status();
  std::map<std::string, std::string> recorded(settings->begin(), settings->end());
  EXPECT_EQ(recorded["--make-vocab-size-divisible-by (padded vocabulary)"], "1008");
  EXPECT_EQ(recorded["--make-vocab-size-divisible-by"], "16");
  auto run = RunCmd(ptk::testing::Tool("ptk-train") + " --use-checkpoint-args --finetune --load " +
                    ShellQuote(dir_ / "imported") + " --save " + ShellQuote(dir_ / "run") +
                    " --seq-length 8 --micro-batch-size 1 --global-batch-size 2 --train-iters 1 --lr 1e-4 "
                    "--mock-data --eval-iters 0 --log-interval 1 --threads 1");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("padded vocabulary 1008"), std::string::npos) << run.output;
  auto resumed = ReadCheckpointSettings(dir_ / "run", 1);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  std::map<std::string, std::string> trained(resumed->begin(), resumed->end());
  EXPECT_EQ(trained["--make-vocab-size-divisible-by (padded vocabulary)"], "1008");
  // The resumed run records the divisor that padded its vocabulary, the checkpoint's (it recorded the command
  // line's 128 beside 1008, and the next --use-checkpoint-args resume was refused).
  EXPECT_EQ(trained["--make-vocab-size-divisible-by"], "16");
  auto again = RunCmd(ptk::testing::Tool("ptk-train") + " --use-checkpoint-args --load " + ShellQuote(dir_ / "run") +
                      " --save " + ShellQuote(dir_ / "run") +
                      " --seq-length 8 --micro-batch-size 1 --global-batch-size 2 --train-iters 2 --lr 1e-4 "
                      "--use-checkpoint-opt_param-scheduler --mock-data --eval-iters 0 --log-interval 1 --threads 1");
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find("padded vocabulary 1008"), std::string::npos) << again.output;
}

TEST_F(HfConvert, TheToolsFlagsAndExitCodes) {
  Save(false, dir_ / "ck");
  const std::string tool = ptk::testing::Tool("ptk-convert");
  // convert.py's --megatron-path and --no-checking, in the lines users copy, were unknown flags.
  auto ok = RunCmd(tool + " --model-type GPT --loader ptk --saver hf --load-dir " + ShellQuote(dir_ / "ck") +
                   " --save-dir " + ShellQuote(dir_ / "hf") + " --megatron-path /opt/Megatron-LM --no-checking");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_NE(ok.output.find("(iteration 7)"), std::string::npos) << ok.output;
  auto back = RunCmd(tool + " --loader hf --saver ptk --load-dir " + ShellQuote(dir_ / "hf") + " --save-dir " +
                     ShellQuote(dir_ / "back"));
  EXPECT_EQ(back.exit_code, 0) << back.output;
  EXPECT_NE(back.output.find("continue training with: ptk-train --num-layers 2 --hidden-size 8 --num-attention-heads 2 "
                             "--ffn-hidden-size 24 --max-position-embeddings 16 --layernorm-epsilon 1e-06"),
            std::string::npos)
      << back.output;
  auto same = RunCmd(tool + " --loader ptk --saver ptk --load-dir a --save-dir b");
  EXPECT_EQ(same.exit_code, 2) << same.output;
  auto tp = RunCmd(tool + " --loader ptk --saver hf --load-dir a --save-dir b --target-tensor-parallel-size 2");
  EXPECT_EQ(tp.exit_code, 2) << tp.output;
  // A flag of another direction was ignored, exit 0: --vocab-file naming no file, --force, a layer-name
  // choice no saver but Megatron's reads.
  for (const char* given :
       {"--vocab-file /nonexistent/vocab.json", "--merge-file m.txt", "--force", "--saver-transformer-impl local"}) {
    const std::string flag = given;
    auto other = RunCmd(tool + " --loader hf --saver ptk --load-dir " + ShellQuote(dir_ / "hf") + " --save-dir " +
                        ShellQuote(dir_ / "other") + " " + flag);
    EXPECT_EQ(other.exit_code, 2) << flag << "\n" << other.output;
    EXPECT_NE(other.output.find(flag.substr(0, flag.find(' ')) + ": only --"), std::string::npos) << other.output;
    EXPECT_NE(other.output.find("this is --loader hf --saver ptk"), std::string::npos) << other.output;
  }
  EXPECT_FALSE(std::filesystem::exists(dir_ / "other"));
  // An empty directory name was the current directory (--saver megatron wrote iter_0000007/ there).
  for (const std::string& dirs : {"--load-dir '' --save-dir " + ShellQuote(dir_ / "e"),
                                  "--load-dir " + ShellQuote(dir_ / "ck") + " --save-dir ''"}) {
    auto empty = RunCmd("cd " + ShellQuote(dir_.path()) + " && " + tool + " --loader ptk --saver megatron " + dirs);
    EXPECT_EQ(empty.exit_code, 2) << empty.output;
    EXPECT_NE(empty.output.find(" is empty: give a directory"), std::string::npos) << empty.output;
    EXPECT_FALSE(std::filesystem::exists(dir_ / "iter_0000007"));
  }
  auto impl = RunCmd(tool + " --loader ptk --saver hf --load-dir a --save-dir b --saver-transformer-impl local");
  EXPECT_EQ(impl.exit_code, 2) << impl.output;
  auto none = RunCmd(tool + " --loader ptk --saver hf --load-dir " + ShellQuote(dir_ / "nothing") + " --save-dir b");
  EXPECT_EQ(none.exit_code, 1) << none.output;
  EXPECT_NE(none.output.find(": no such directory; give the --save directory"), std::string::npos) << none.output;
  // A full disk (a file-size limit: EFBIG, as ENOSPC) is exit 3 naming the file.
  auto full = RunCmd("ulimit -f 64; " + tool + " --loader ptk --saver hf --load-dir " + ShellQuote(dir_ / "ck") +
                     " --save-dir " + ShellQuote(dir_ / "full"));
  EXPECT_EQ(full.exit_code, 3) << full.output;
  EXPECT_NE(full.output.find("model.safetensors"), std::string::npos) << full.output;
  EXPECT_FALSE(std::filesystem::exists(dir_ / "full")) << "a partial export";
  EXPECT_EQ(ptk::testing::Leftovers(dir_.path()), "");
  for (const auto& e : std::filesystem::directory_iterator(dir_.path()))
    EXPECT_EQ(e.path().filename().string().find("full."), std::string::npos) << e.path();
}

// An import writes iteration 0: into a training run's --save it would move `latest` back, so it is
// refused there (an earlier import, iteration 0 alone, is replaced: reruns are idempotent).
TEST_F(HfConvert, ImportRefusesATrainingRunsSaveDirectory) {
  Save(false, dir_ / "ck");
  ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "ck", dir_ / "hf")).ok());
  const std::string run = dir_ / "run";
  std::vector<float> zeros(params_.size(), 0.0f);
  for (int64_t it : {4, 8}) {
    TrainState st;
    st.iteration = it;
    ASSERT_TRUE(SaveCheckpoint(run, layout_, params_, zeros, zeros, st, "[]").ok());
  }
  auto r = ImportFromHf(Opts("hf", "ptk", dir_ / "hf", run));
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(IsUsageError(r.status())) << r.status();
  EXPECT_NE(r.status().message().find("holds a training run's checkpoints (its latest checkpoint is iteration 8)"),
            absl::string_view::npos)
      << r.status();
  EXPECT_EQ(*LatestCheckpointIteration(run), 8);
  EXPECT_FALSE(std::filesystem::exists(CheckpointDir(run, 0)));
  // The tool: exit 2, latest still 8.
  const std::string tool = ptk::testing::Tool("ptk-convert");
  auto cli = RunCmd(tool + " --loader hf --saver ptk --load-dir " + ShellQuote(dir_ / "hf") + " --save-dir " +
                    ShellQuote(run));
  EXPECT_EQ(cli.exit_code, 2) << cli.output;
  EXPECT_EQ(ReadFile(run + "/latest_checkpointed_iteration.txt"), "8");
  // Iterations without a tracker (a run killed before its tracker moved) are a run's too.
  std::filesystem::remove(run + "/latest_checkpointed_iteration.txt");
  EXPECT_FALSE(ImportFromHf(Opts("hf", "ptk", dir_ / "hf", run)).ok());
  EXPECT_FALSE(std::filesystem::exists(CheckpointDir(run, 0)));
  // A new directory, and the same import again into it.
  for (int i = 0; i < 2; ++i) {
    auto again = ImportFromHf(Opts("hf", "ptk", dir_ / "hf", dir_ / "imported"));
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(*LatestCheckpointIteration(dir_ / "imported"), 0);
  }
}

// A Megatron checkpoint carries its own iteration and AdamW's moments: imported into a training run's
// --save it moved `latest` back (8 -> 7) or replaced the run's own checkpoint of that iteration, exit
// 0. Refused there as a Hugging Face import is; a rerun of the same import still replaces it.
TEST_F(HfConvert, MegatronImportRefusesATrainingRunsSaveDirectory) {
  Save(false, dir_ / "ck");  // iteration 7
  ASSERT_TRUE(ExportToMegatron(Opts("ptk", "megatron", dir_ / "ck", dir_ / "meg")).ok());
  auto import_into = [&](const std::string& to) {
    ConvertOptions o = Opts("megatron", "ptk", dir_ / "meg", to);
    o.args_json = "[\"--loader\", \"megatron\", \"--saver\", \"ptk\"]";
    return ImportFromMegatron(o);
  };
  const std::string run = dir_ / "run";
  std::vector<float> zeros(params_.size(), 0.0f);
  for (int64_t it : {4, 8}) {
    TrainState st;
    st.iteration = it;
    ASSERT_TRUE(SaveCheckpoint(run, layout_, params_, zeros, zeros, st, "[\"--save\", \"run\"]").ok());
  }
  auto r = import_into(run);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(IsUsageError(r.status())) << r.status();
  EXPECT_NE(r.status().message().find("holds a training run's checkpoints (its latest checkpoint is iteration 8)"),
            absl::string_view::npos)
      << r.status();
  EXPECT_EQ(*LatestCheckpointIteration(run), 8);
  EXPECT_FALSE(std::filesystem::exists(CheckpointDir(run, 7)));
  const std::string tool = ptk::testing::Tool("ptk-convert");
  auto cli = RunCmd(tool + " --loader megatron --saver ptk --load-dir " + ShellQuote(dir_ / "meg") + " --save-dir " +
                    ShellQuote(run));
  EXPECT_EQ(cli.exit_code, 2) << cli.output;
  EXPECT_EQ(ReadFile(run + "/latest_checkpointed_iteration.txt"), "8");
  // The run's own checkpoint of the imported iteration, alone: kept.
  const std::string own = dir_ / "own";
  TrainState st;
  st.iteration = 7;
  ASSERT_TRUE(SaveCheckpoint(own, layout_, params_, zeros, zeros, st, "[\"--save\", \"own\"]").ok());
  const std::string before = ReadFile(CheckpointFile(own, 7));
  r = import_into(own);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("its iteration 7 was saved by a training run, not by an import"),
            absl::string_view::npos)
      << r.status();
  EXPECT_EQ(ReadFile(CheckpointFile(own, 7)), before);
  // A new directory, and the same import again into it (the tool's command line, then the library's).
  auto first = RunCmd(tool + " --loader megatron --saver ptk --load-dir " + ShellQuote(dir_ / "meg") + " --save-dir " +
                      ShellQuote(dir_ / "imported"));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  auto again = import_into(dir_ / "imported");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*LatestCheckpointIteration(dir_ / "imported"), 7);
}

// --iteration N places an import where a run stood (its consumed samples, the schedule's step;
// the moments zero, Adam's step 0, and a note saying so), and still never moves a run's `latest` nor
// replaces a run's own checkpoint; a rerun of the same import replaces it.
TEST_F(HfConvert, ImportAtAnIterationResumesThereAndKeepsRunsIntact) {
  Save(false, dir_ / "ck");
  ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "ck", dir_ / "hf")).ok());
  auto at = [&](int64_t it, int64_t gbs, int64_t samples, const std::string& to) {
    ConvertOptions o = Opts("hf", "ptk", dir_ / "hf", to);
    o.iteration = it;
    o.global_batch_size = gbs;
    o.consumed_train_samples = samples;
    return ImportFromHf(o);
  };
  for (int i = 0; i < 2; ++i) {
    auto r = at(6, 4, -1, dir_ / "placed");
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->iteration, 6);
    bool noted = false, seed = false;
    for (const std::string& n : r->notes) {
      noted |= n.find("a Hugging Face directory holds no optimizer state: AdamW's moments start at zero") == 0;
      seed |= n.find("the seed recorded is 1234") == 0 && n.find("--no-load-rng") != std::string::npos;
    }
    EXPECT_TRUE(noted);
    EXPECT_TRUE(seed);
  }
  EXPECT_EQ(*LatestCheckpointIteration(dir_ / "placed"), 6);
  std::vector<float> p, m, v;
  TrainState st;
  ASSERT_TRUE(LoadCheckpoint(dir_ / "placed", 6, layout_, &p, &m, &v, &st).ok());
  EXPECT_EQ(st.iteration, 6);
  EXPECT_EQ(st.consumed_train_samples, 24);
  EXPECT_EQ(st.scheduler_num_steps, 24);
  EXPECT_EQ(st.adam_step, 0);
  EXPECT_EQ(m, std::vector<float>(m.size(), 0.0f));
  // With batch ramp-up: the samples as given.
  ASSERT_TRUE(at(6, 0, 17, dir_ / "ramped").ok());
  ASSERT_TRUE(LoadCheckpoint(dir_ / "ramped", 6, layout_, &p, &m, &v, &st).ok());
  EXPECT_EQ(st.consumed_train_samples, 17);
  // Another iteration into the first import's directory, or any into a run's: refused, `latest` kept.
  EXPECT_TRUE(IsUsageError(at(7, 4, -1, dir_ / "placed").status()));
  EXPECT_EQ(*LatestCheckpointIteration(dir_ / "placed"), 6);
  const std::string run = dir_ / "run";
  std::vector<float> ones(params_.size(), 1.0f);
  TrainState trained;
  trained.iteration = 6;
  trained.adam_step = 6;
  ASSERT_TRUE(SaveCheckpoint(run, layout_, params_, ones, ones, trained, "[]").ok());
  for (int64_t it : {2, 6, 9}) {
    auto r = at(it, 4, -1, run);
    ASSERT_FALSE(r.ok()) << it;
    EXPECT_TRUE(IsUsageError(r.status())) << r.status();
    EXPECT_NE(r.status().message().find("holds a training run's checkpoints"), absl::string_view::npos) << r.status();
    EXPECT_EQ(*LatestCheckpointIteration(run), 6);
  }
  ASSERT_TRUE(LoadCheckpoint(run, 6, layout_, &p, &m, &v, &st).ok());
  EXPECT_EQ(st.adam_step, 6);  // the run's own checkpoint, moments and all
  EXPECT_EQ(m, ones);
  // Flags that place nothing, or a place without its samples: usage errors, nothing written.
  EXPECT_TRUE(IsUsageError(at(6, 0, -1, dir_ / "bad").status()));
  EXPECT_TRUE(IsUsageError(at(6, 4, 24, dir_ / "bad").status()));
  EXPECT_TRUE(IsUsageError(at(0, 4, -1, dir_ / "bad").status()));
  EXPECT_FALSE(std::filesystem::exists(dir_ / "bad"));
  auto cli = RunCmd(ptk::testing::Tool("ptk-convert") + " --loader ptk --saver hf --load-dir " +
                    ShellQuote(dir_ / "ck") + " --save-dir " + ShellQuote(dir_ / "hf3") + " --iteration 5");
  EXPECT_EQ(cli.exit_code, 2) << cli.output;
}

// Non-finite weights are refused at export, naming the tensor, as the import refuses them.
TEST_F(HfConvert, ExportRefusesNanAndInfinityNamingTheTensor) {
  Save(false, dir_ / "ck");
  params_[static_cast<size_t>(layout_.layers[1].ln1_b + 2)] = std::nanf("");
  std::vector<float> zeros(params_.size(), 0.0f);
  TrainState st;
  st.iteration = 9;
  st.settings = {{"--vocab-size", "50257"}};
  ASSERT_TRUE(SaveCheckpoint(dir_ / "ck", layout_, params_, zeros, zeros, st, "[]").ok());
  auto r = ExportToHf(Opts("ptk", "hf", dir_ / "ck", dir_ / "hf"));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("tensor transformer.h.1.ln_1.bias (element 2) holds a NaN"),
            absl::string_view::npos)
      << r.status();
  EXPECT_FALSE(std::filesystem::exists(dir_ / "hf"));
  params_[static_cast<size_t>(layout_.layers[1].ln1_b + 2)] = 0.5f;
  params_[static_cast<size_t>(layout_.wpe + 8 * 3 + 1)] = -INFINITY;
  st.iteration = 10;
  ASSERT_TRUE(SaveCheckpoint(dir_ / "ck", layout_, params_, zeros, zeros, st, "[]").ok());
  const std::string tool = ptk::testing::Tool("ptk-convert");
  auto cli = RunCmd(tool + " --loader ptk --saver hf --load-dir " + ShellQuote(dir_ / "ck") + " --save-dir " +
                    ShellQuote(dir_ / "hf"));
  EXPECT_EQ(cli.exit_code, 1) << cli.output;
  EXPECT_NE(cli.output.find("tensor transformer.wpe.weight (element 25) holds an infinity"), std::string::npos)
      << cli.output;
  EXPECT_FALSE(std::filesystem::exists(dir_ / "hf"));
}

// The names of a directory's entries, sorted, and what lies beside it (NAME.*: copies, locks).
std::string Entries(const std::string& dir) {
  std::set<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) names.insert(e.path().filename().string());
  std::string out;
  for (const std::string& n : names) out += n + " ";
  return out;
}
std::string Beside(const std::string& target) {
  std::string out;
  const std::filesystem::path t(target);
  for (const auto& e : std::filesystem::directory_iterator(t.parent_path())) {
    const std::string n = e.path().filename().string();
    if (n.rfind(t.filename().string() + ".", 0) == 0) out += n + " ";
  }
  return out;
}

constexpr const char* kSixFiles[] = {"config.json", "generation_config.json", "tokenizer_config.json", "vocab.json",
                                     "merges.txt",  "model.safetensors"};

// A target that holds another model's files (tokenizer.json, pytorch_model.bin and its index) is
// refused, untouched; --force replaces it whole; an earlier export is replaced without it.
TEST_F(HfConvert, ExportIntoAForeignDirectoryIsRefusedUnlessForced) {
  Save(false, dir_ / "ck");
  const std::string hf = dir_ / "hf";
  std::filesystem::create_directories(hf + "/sub");
  for (const char* f : {"tokenizer.json", "pytorch_model.bin", "pytorch_model.bin.index.json", "config.json"})
    WriteFile(hf + "/" + f, f);
  auto r = ExportToHf(Opts("ptk", "hf", dir_ / "ck", hf));
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(IsUsageError(r.status())) << r.status();
  EXPECT_NE(r.status().message().find(
                "holds 4 entries that a ptk export does not write (pytorch_model.bin, pytorch_model.bin.index.json, "
                "sub, tokenizer.json)"),
            absl::string_view::npos)
      << r.status();
  EXPECT_EQ(Entries(hf), "config.json pytorch_model.bin pytorch_model.bin.index.json sub tokenizer.json ");
  EXPECT_EQ(ReadFile(hf + "/config.json"), "config.json");
  const std::string tool = ptk::testing::Tool("ptk-convert");
  const std::string cmd =
      tool + " --loader ptk --saver hf --load-dir " + ShellQuote(dir_ / "ck") + " --save-dir " + ShellQuote(hf);
  auto refused = RunCmd(cmd);
  EXPECT_EQ(refused.exit_code, 2) << refused.output;
  EXPECT_NE(refused.output.find("--force"), std::string::npos) << refused.output;
  auto forced = RunCmd(cmd + " --force");
  EXPECT_EQ(forced.exit_code, 0) << forced.output;
  EXPECT_EQ(Entries(hf),
            "config.json generation_config.json merges.txt model.safetensors tokenizer_config.json vocab.json ");
  WriteFile(hf + "/model.safetensors.ptk-tmp-123-abc", "a killed older ptk-convert's temporary");
  auto again = RunCmd(cmd);  // an export over an export
  EXPECT_EQ(again.exit_code, 0) << again.output;
  EXPECT_EQ(Entries(hf),
            "config.json generation_config.json merges.txt model.safetensors tokenizer_config.json vocab.json ");
  EXPECT_EQ(Beside(hf), "");
  // Never the directory that holds what the export reads, or the current directory, even with --force.
  auto around = RunCmd(tool + " --loader ptk --saver hf --load-dir " + ShellQuote(dir_ / "ck") + " --save-dir " +
                       ShellQuote(dir_.path()) + " --force");
  EXPECT_EQ(around.exit_code, 2) << around.output;
  EXPECT_NE(around.output.find("holds --load-dir"), std::string::npos) << around.output;
  EXPECT_TRUE(LatestCheckpointIteration(dir_ / "ck").ok());
  auto here = RunCmd("cd " + ShellQuote(hf) + " && " + tool + " --loader ptk --saver hf --load-dir " +
                     ShellQuote(dir_ / "ck") + " --save-dir . --force");
  EXPECT_EQ(here.exit_code, 2) << here.output;
  EXPECT_NE(here.output.find("holds the current directory"), std::string::npos) << here.output;
  // A file, or a symbolic link, as the target.
  WriteFile(dir_ / "file", "x");
  EXPECT_TRUE(IsUsageError(ExportToHf(Opts("ptk", "hf", dir_ / "ck", dir_ / "file")).status()));
  std::filesystem::create_directory_symlink(hf, dir_ / "link");
  EXPECT_TRUE(IsUsageError(ExportToHf(Opts("ptk", "hf", dir_ / "ck", dir_ / "link")).status()));
}

// --save-dir inside the checkpoint it reads (ckpt/iter_0000007, with --force) replaced that
// checkpoint by the export, exit 0; a Megatron export into a directory of ptk checkpoints (--load-dir
// itself, or another run's --save) replaced the ptk checkpoint of that iteration, exit 0; a Megatron
// import into the Megatron checkpoint it reads replaced it by ptk's file, exit 0. Each is refused,
// exit 2, with nothing touched.
TEST_F(HfConvert, NoConversionWritesOverTheCheckpointItReadsOrAnotherToolsCheckpoint) {
  Save(false, dir_ / "ck");  // iteration 7
  const std::string ck = dir_ / "ck", file = CheckpointFile(ck, 7), before = ReadFile(file);
  const std::string tool = ptk::testing::Tool("ptk-convert");
  auto convert = [&](const std::string& loader, const std::string& saver, const std::string& from,
                     const std::string& to, const std::string& more = "") {
    return RunCmd(tool + " --loader " + loader + " --saver " + saver + " --load-dir " + ShellQuote(from) +
                  " --save-dir " + ShellQuote(to) + more);
  };
  for (const std::string& inside : {CheckpointDir(ck, 7), CheckpointDir(ck, 7) + "/mp_rank_00"}) {
    auto r = convert("ptk", "hf", ck, inside, " --force");
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("holds the checkpoint read (" + file + ")"), std::string::npos) << r.output;
    EXPECT_EQ(ReadFile(file), before);
  }
  auto itself = convert("ptk", "megatron", ck, ck);
  EXPECT_EQ(itself.exit_code, 2) << itself.output;
  EXPECT_NE(itself.output.find("holds ptk checkpoints (iter_0000007/mp_rank_00/model_optim_rng.ptk)"),
            std::string::npos)
      << itself.output;
  EXPECT_EQ(ReadFile(file), before);
  EXPECT_EQ(Entries(CheckpointDir(ck, 7) + "/mp_rank_00"), "model_optim_rng.ptk ");
  Save(false, dir_ / "run");
  EXPECT_EQ(convert("ptk", "megatron", ck, dir_ / "run").exit_code, 2);
  EXPECT_EQ(Entries(CheckpointDir(dir_ / "run", 7) + "/mp_rank_00"), "model_optim_rng.ptk ");
  // The Megatron checkpoint read, as the import's --save-dir: refused, its file kept.
  const std::string meg = dir_ / "meg";
  auto exported = convert("ptk", "megatron", ck, meg);
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  const std::string meg_file = meg + "/iter_0000007/mp_rank_00/model_optim_rng.pt", meg_bytes = ReadFile(meg_file);
  auto back = convert("megatron", "ptk", meg, meg);
  EXPECT_EQ(back.exit_code, 2) << back.output;
  EXPECT_NE(back.output.find("its iteration 7 holds iter_0000007/mp_rank_00/model_optim_rng.pt, which is not a "
                             "ptk checkpoint's file"),
            std::string::npos)
      << back.output;
  EXPECT_EQ(ReadFile(meg_file), meg_bytes);
  EXPECT_EQ(Entries(meg + "/iter_0000007/mp_rank_00"), "model_optim_rng.pt ");
  // Into directories of their own, all three run.
  EXPECT_EQ(convert("ptk", "hf", ck, dir_ / "hf").exit_code, 0);
  // The Hugging Face directory read, as the import's --save-dir (or a folder inside it): iter_0000000/ and
  // latest_checkpointed_iteration.txt were written into it, exit 0.
  const std::string hf = dir_ / "hf", hf_entries = Entries(hf);
  for (const std::string& to : {hf, hf + "/.", hf + "/ptk"}) {
    auto into = convert("hf", "ptk", hf, to);
    EXPECT_EQ(into.exit_code, 2) << into.output;
    EXPECT_NE(into.output.find("usage error: --save-dir " + to + " is " + (to == hf + "/ptk" ? "inside " : "") +
                               "--load-dir " + hf + ": the import would write iter_N/"),
              std::string::npos)
        << into.output;
    EXPECT_EQ(Entries(hf), hf_entries);
  }
  auto imported = convert("megatron", "ptk", meg, dir_ / "imported");
  EXPECT_EQ(imported.exit_code, 0) << imported.output;
}

// A --loader that does not read --load-dir said only what it missed ("model_optim_rng.pt: missing: ...
// this one is absent" for a ptk checkpoint given to --loader megatron; "cannot open
// .../model_optim_rng.ptk" for Megatron's given to --loader ptk): the message now names what is there.
TEST_F(HfConvert, AWrongLoaderSaysWhatTheDirectoryHolds) {
  Save(false, dir_ / "ck");
  ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "ck", dir_ / "hf")).ok());
  ASSERT_TRUE(RunConvert(Opts("ptk", "megatron", dir_ / "ck", dir_ / "meg")).ok());
  const struct {
    const char *loader, *saver, *dir, *holds;
  } cases[] = {{"megatron", "ptk", "ck", "a ptk checkpoint: --loader ptk reads it"},
               {"hf", "ptk", "ck", "a ptk checkpoint: --loader ptk reads it"},
               {"ptk", "hf", "meg", "a Megatron checkpoint: --loader megatron reads it"},
               {"hf", "ptk", "meg", "a Megatron checkpoint: --loader megatron reads it"},
               {"ptk", "megatron", "hf", "a Hugging Face directory: --loader hf reads it"},
               {"megatron", "ptk", "hf", "a Hugging Face directory: --loader hf reads it"}};
  for (const auto& c : cases) {
    auto r = RunConvert(Opts(c.loader, c.saver, dir_ / c.dir, dir_ / "out"));
    ASSERT_FALSE(r.ok()) << c.loader << " " << c.dir;
    EXPECT_NE(r.status().message().find(fmt::format("(--load-dir {} holds {})", dir_ / c.dir, c.holds)),
              absl::string_view::npos)
        << r.status();
  }
  EXPECT_FALSE(std::filesystem::exists(dir_ / "out"));
  // Nothing to tell: no hint.
  auto none = RunConvert(Opts("ptk", "hf", dir_ / "nothing", dir_ / "out"));
  EXPECT_EQ(none.status().message().find("holds"), absl::string_view::npos) << none.status();
}

// The --load-dir a newcomer gets wrong first: a typo, a file, one iter_N of the --save directory. Each said
// only that a file in it was missing ("ckp: no checkpoint (no latest_checkpointed_iteration.txt)",
// "my.jsonl/model.safetensors: missing"); now what to give.
TEST_F(HfConvert, ALoadDirThatIsNoCheckpointDirectorySaysWhatToGive) {
  Save(false, dir_ / "ck");
  WriteFile(dir_ / "my.jsonl", "{}\n");
  const struct {
    const char *loader, *saver;
    std::string dir, says;
  } cases[] = {
      {"ptk", "hf", dir_ / "ckp",
       "--load-dir " + dir_ / "ckp" +
           ": no such directory; give the --save directory (with latest_checkpointed_iteration.txt in it)"},
      {"megatron", "ptk", dir_ / "my.jsonl", "--load-dir " + dir_ / "my.jsonl" + ": a file, not a directory; give"},
      {"hf", "ptk", dir_ / "my.jsonl",
       ": a file, not a directory; give the Hugging Face model's directory (config.json and its weights)"},
      {"ptk", "megatron", dir_ / "ck/iter_0000007",
       "--load-dir " + dir_ / "ck/iter_0000007" + ": one iteration of a checkpoint; give its --save directory, " +
           dir_ / "ck" + " (its latest"},
      {"ptk", "hf", dir_ / "ck/iter_0000007/",
       ": one iteration of a checkpoint; give its --save directory, " + dir_ / "ck"}};
  for (const auto& c : cases) {
    auto r = RunConvert(Opts(c.loader, c.saver, c.dir, dir_ / "out"));
    ASSERT_FALSE(r.ok()) << c.loader << " " << c.dir;
    EXPECT_NE(r.status().message().find(c.says), absl::string_view::npos) << r.status();
  }
  EXPECT_FALSE(std::filesystem::exists(dir_ / "out"));
  EXPECT_TRUE(RunConvert(Opts("ptk", "hf", dir_ / "ck", dir_ / "out")).ok());
}

// --loader ptk on a directory whose tracker names an iteration that is not there says so, as ptk-train's --load
// ("cannot open .../model_optim_rng.ptk: No such file or directory" before).
TEST_F(HfConvert, ATrackerNamingAMissingIterationSaysSo) {
  Save(false, dir_ / "ck");
  ptk::testing::WriteFile(dir_ / "ck/latest_checkpointed_iteration.txt", "5");
  for (const char* saver : {"hf", "megatron"}) {
    auto r = RunConvert(Opts("ptk", saver, dir_ / "ck", dir_ / "out"));
    ASSERT_FALSE(r.ok()) << saver;
    EXPECT_TRUE(absl::IsNotFound(r.status())) << r.status();
    EXPECT_EQ(
        r.status().message().rfind(CheckpointDir(dir_ / "ck", 5) + ": missing (the tracker names iteration 5)", 0), 0u)
        << r.status();
  }
  EXPECT_FALSE(std::filesystem::exists(dir_ / "out"));
}

// Regression: a checkpoint file cut short in its first bytes was "not a ptk checkpoint (bad magic)" (10 bytes
// of one) or "the header length runs past the end of the file" (100 bytes); it says so, with its size and
// the one it needs, as ptk-train's load says it.
TEST_F(HfConvert, ACheckpointCutShortInItsHeaderSaysSo) {
  Save(false, dir_ / "ck");
  const std::string file = CheckpointFile(dir_ / "ck", 7);
  const std::string whole = ReadFile(file);
  for (const auto& [keep, says] : std::vector<std::pair<size_t, std::string>>{
           {10, "cut short: 10 bytes, fewer than the 16 that open every checkpoint"},
           {100, "cut short: 100 bytes, fewer than its "}}) {
    WriteFile(file, whole.substr(0, keep));
    for (const char* saver : {"hf", "megatron"}) {
      auto r = RunConvert(Opts("ptk", saver, dir_ / "ck", dir_ / "out"));
      ASSERT_FALSE(r.ok()) << saver;
      EXPECT_TRUE(absl::IsDataLoss(r.status())) << r.status();
      EXPECT_NE(r.status().message().find(file + ": corrupt checkpoint: " + says), std::string::npos) << r.status();
    }
  }
  EXPECT_FALSE(std::filesystem::exists(dir_ / "out"));
}

// A real full disk part-way (a file-size limit, 800 KB in sh's 512-byte blocks, that the narrow
// model's model.safetensors (400 KB) fits under but vocab.json does not: EFBIG, as ENOSPC) is exit 3
// and leaves no partial export, and over an earlier export leaves that one whole.
TEST_F(HfConvert, AFullDiskPartWayLeavesNoPartialExport) {
  const GPTConfig c = testing::SmallGpt(1, 2, 1, 8, 50257, 50304);
  auto layout = ParamLayout::Create(c);
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::vector<float> p(static_cast<size_t>(layout->num_params), 0.125f);
  TrainState st;
  st.iteration = 2;
  st.settings = {{"--vocab-size", "50257"}};
  ASSERT_TRUE(SaveCheckpoint(dir_ / "narrow", *layout, p, p, p, st, "[]").ok());
  const std::string tool = ptk::testing::Tool("ptk-convert");
  const std::string cmd =
      "ulimit -f 1600; " + tool + " --loader ptk --saver hf --load-dir " + ShellQuote(dir_ / "narrow") + " --save-dir ";
  auto full = RunCmd(cmd + ShellQuote(dir_ / "hf"));
  EXPECT_EQ(full.exit_code, 3) << full.output;
  EXPECT_NE(full.output.find("vocab.json"), std::string::npos) << full.output;  // past model.safetensors
  EXPECT_FALSE(std::filesystem::exists(dir_ / "hf")) << Entries(dir_ / "hf");
  EXPECT_EQ(Beside(dir_ / "hf"), "");
  // Over an earlier export (of the other model): that one stays, whole.
  Save(false, dir_ / "ck");
  ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "ck", dir_ / "hf")).ok());
  const std::string before = ReadFile(dir_ / "hf/model.safetensors") + ReadFile(dir_ / "hf/config.json");
  full = RunCmd(cmd + ShellQuote(dir_ / "hf"));
  EXPECT_EQ(full.exit_code, 3) << full.output;
  EXPECT_TRUE(ReadFile(dir_ / "hf/model.safetensors") + ReadFile(dir_ / "hf/config.json") == before)
      << "the earlier export is not whole: " << Entries(dir_ / "hf");
  EXPECT_EQ(Beside(dir_ / "hf"), "");
}

// An export killed at any step over an older export leaves the old export whole or the new one
// whole (with RENAME_EXCHANGE; without it, between the two renames, no directory, which the next
// export puts back); a failure at any step (a full disk) leaves the old one. Model A and model B
// differ in every file but the tokenizer's.
TEST_F(HfConvert, AKilledOrFailedExportLeavesTheOldOrTheNewExportWhole) {
  Save(false, dir_ / "a");
  for (float& p : params_) p *= 0.5f;
  {
    c_.max_position_embeddings = 12;  // B: another model (config.json differs too)
    c_.seq_length = 12;
    auto layout = ParamLayout::Create(c_);
    ASSERT_TRUE(layout.ok());
    std::vector<float> p(static_cast<size_t>(layout->num_params), 0.25f);
    TrainState st;
    st.iteration = 3;
    st.settings = {{"--vocab-size", "50257"}};
    ASSERT_TRUE(SaveCheckpoint(dir_ / "b", *layout, p, p, p, st, "[]").ok());
  }
  ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "a", dir_ / "ref-a")).ok());
  ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "b", dir_ / "ref-b")).ok());
  auto files_of = [&](const std::string& d) {
    std::map<std::string, std::string> m;
    for (const char* f : kSixFiles) m[f] = ReadFile(d + "/" + f);
    return m;
  };
  const auto a = files_of(dir_ / "ref-a"), b = files_of(dir_ / "ref-b");
  ASSERT_NE(a.at("config.json"), b.at("config.json"));
  ASSERT_NE(a.at("model.safetensors"), b.at("model.safetensors"));
  const std::string six =
      "config.json generation_config.json merges.txt model.safetensors tokenizer_config.json vocab.json ";
  const std::string hf = dir_ / "hf";
  // Which export `hf` holds whole: "a", "b", "none" (no directory) or "mixed".
  auto state = [&]() -> std::string {
    if (!std::filesystem::exists(hf)) return "none";
    if (Entries(hf) != six) return "mixed: " + Entries(hf);
    const auto now = files_of(hf);
    return now == a ? "a" : now == b ? "b" : "mixed";
  };
  const std::vector<std::string> steps = {
      "write model.safetensors", "write config.json",      "write merges.txt",
      "fsync new export",        "exchange directories",   "rename old export aside",
      "rename new export in",    "fsync parent directory", "remove old export"};
  int kills = 0;
  for (bool exchange : {true, false}) {
    for (const std::string& at : steps) {
      if (exchange && (at == "rename old export aside" || at == "rename new export in")) continue;
      SCOPED_TRACE((exchange ? "exchange, killed at " : "two renames, killed at ") + at);
      ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "a", hf)).ok());
      ASSERT_EQ(state(), "a");
      const pid_t pid = ::fork();
      ASSERT_GE(pid, 0);
      if (pid == 0) {
        SetExportStepHookForTesting([&](std::string_view step) -> absl::Status {
          if (step == at) ::_exit(9);
          if (!exchange && step == "exchange directories") return absl::UnimplementedError("no RENAME_EXCHANGE");
          return absl::OkStatus();
        });
        ::_exit(ExportToHf(Opts("ptk", "hf", dir_ / "b", hf)).ok() ? 0 : 1);
      }
      int status = 0;
      ASSERT_EQ(::waitpid(pid, &status, 0), pid);
      ASSERT_TRUE(WIFEXITED(status));
      EXPECT_EQ(WEXITSTATUS(status), 9);
      ++kills;
      const std::string after = state();
      const bool before_swap = at.rfind("write", 0) == 0 || at == "fsync new export" || at == "exchange directories" ||
                               at == "rename old export aside";
      if (!exchange && at == "rename new export in") {
        EXPECT_EQ(after, "none");  // the one window of the two-rename path
      } else {
        EXPECT_EQ(after, before_swap ? "a" : "b");
      }
      // The next export puts right what the kill left: here one that fails at its first write (a
      // full disk) leaves A's or B's export whole, and nothing beside it but what it found there.
      SetExportStepHookForTesting([](std::string_view step) -> absl::Status {
        if (step == "write model.safetensors") return absl::ResourceExhaustedError("No space left on device");
        return absl::OkStatus();
      });
      auto failed = ExportToHf(Opts("ptk", "hf", dir_ / "b", hf));
      SetExportStepHookForTesting(nullptr);
      ASSERT_FALSE(failed.ok());
      EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted);
      EXPECT_EQ(state(), after == "none" ? "a" : after);
      EXPECT_EQ(Beside(hf), "");
    }
  }
  EXPECT_EQ(kills, 16);
  // A failure at any step before the swap (a full disk at the third file, an error at the
  // exchange or the first rename) leaves A's export as it was, and nothing beside it.
  for (bool exchange : {true, false})
    for (const std::string& at : {std::string("write vocab.json"), std::string("fsync new export"),
                                  std::string("exchange directories"), std::string("rename old export aside")}) {
      SCOPED_TRACE("failed at " + at);
      ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "a", hf)).ok());
      SetExportStepHookForTesting([&](std::string_view step) -> absl::Status {
        if (step == at) return absl::ResourceExhaustedError("No space left on device");
        if (!exchange && step == "exchange directories") return absl::UnimplementedError("no RENAME_EXCHANGE");
        return absl::OkStatus();
      });
      auto r = ExportToHf(Opts("ptk", "hf", dir_ / "b", hf));
      SetExportStepHookForTesting(nullptr);
      const bool reached = exchange ? at != "rename old export aside" : true;
      if (reached) {
        ASSERT_FALSE(r.ok());
        EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
      }
      EXPECT_EQ(state(), reached ? "a" : "b");
      EXPECT_EQ(Beside(hf), "");
    }
  // Without a hook: B over A in one piece, nothing beside.
  ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "b", hf)).ok());
  EXPECT_EQ(state(), "b");
  EXPECT_EQ(Beside(hf), "");
}

}  // namespace
}  // namespace ptk
