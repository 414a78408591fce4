// ptk-convert's Megatron distributed-optimizer files (--target-use-distributed-optimizer): what the
// export writes (distrib_optim.pt as DistributedOptimizer.save_parameter_state writes it at
// data-parallel size 1, one grad buffer per model chunk; model_optim_rng.pt's optimizer as its
// state_dict leaves it), and ptk -> megatron (distributed optimizer) -> ptk bit for bit, moments and
// Adam's step included, with and without model chunks, in fp32, bf16 and fp16.
// (tests/support/check_distopt_export_with_megatron_core.py loads the same export in megatron-core
// itself, by hand: CI's PyTorch cannot run it.)
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <fmt/core.h>
#include <gtest/gtest.h>

#include "common/status.h"
#include "interop/hf_gpt2.h"
#include "interop/megatron.h"
#include "interop/megatron_common.h"
#include "interop/megatron_optim.h"
#include "interop/torch_format.h"
#include "tests/interop/convert_opts.h"
#include "tests/test_util.h"
#include "tests/trainer/small_gpt.h"
#include "trainer/checkpoint.h"

namespace ptk {
namespace {

using torchfmt::PyValue;

GPTConfig Gpt(bool tied) {
  GPTConfig c = testing::SmallGpt(4, 16, 4, 16, 100, 128);
  c.untie_embeddings_and_output_weights = !tied;
  return c;
}

class MegatronDistopt : public ::testing::Test {
 protected:
  // A checkpoint of `c` at iteration 7 after 3 AdamW steps in `precision`: distinct weights and moments.
  void Save(const GPTConfig& c, const std::string& dir, const std::string& precision) {
    auto layout = ParamLayout::Create(c);
    ASSERT_TRUE(layout.ok()) << layout.status();
    layout_ = *layout;
    params_.resize(static_cast<size_t>(layout_.num_params));
    layout_.InitWeights(5, params_);
    m1_.resize(params_.size());
    m2_.resize(params_.size());
    for (size_t i = 0; i < params_.size(); ++i) {
      params_[i] += 1e-3f * static_cast<float>(i % 97);
      m1_[i] = 1e-4f * static_cast<float>(static_cast<int64_t>(i % 89) - 44);
      m2_[i] = 1e-6f * static_cast<float>(i % 83 + 1);
    }
    TrainState st;
    st.iteration = 7;
    st.adam_step = 3;
    st.settings = {{"--vocab-size", "100"}, {"--bf16/--fp16", precision}};
    if (precision == "fp16") st.loss_scale = LossScaleState{};
    ASSERT_TRUE(SaveCheckpoint(dir, layout_, params_, m1_, m2_, st, "[]").ok());
  }
  ConvertOptions Opts(const std::string& loader, const std::string& saver, const std::string& from,
                      const std::string& to) {
    return testing::ConvertOpts(loader, saver, from, to);
  }
  // Gpt(tied) saved in bf16 at dir_/ck, exported to dir_/meg with the distributed optimizer (the local
  // transformer implementation) at tensor size tp and pipeline size pp, layers_per_chunk layers per
  // virtual stage (0: none).
  void ExportTiedBf16(int64_t tp, int64_t pp, int64_t layers_per_chunk) {
    ASSERT_NO_FATAL_FAILURE(Save(Gpt(true), dir_ / "ck", "bf16"));
    ConvertOptions o = Opts("ptk", "megatron", dir_ / "ck", dir_ / "meg");
    o.target_tensor_parallel_size = tp;
    o.target_pipeline_parallel_size = pp;
    o.target_num_layers_per_virtual_pipeline_stage = layers_per_chunk;
    o.saver_transformer_impl = "local";
    o.target_use_distributed_optimizer = true;
    auto s = ExportToMegatron(o);
    ASSERT_TRUE(s.ok()) << s.status();
  }

  testing::TempDir dir_;
  ParamLayout layout_;
  std::vector<float> params_, m1_, m2_;
};

struct Layout {
  int64_t tp, pp, layers_per_chunk;
  bool te, tied;
  std::string precision;
  int64_t bucket = 0;  // --target-ddp-bucket-size
};

TEST_F(MegatronDistopt, PtkToMegatronsDistributedOptimizerAndBackIsBitForBit) {
  const Layout layouts[] = {
      {2, 2, 1, true, true, "fp32"},    // 2 chunks a rank, the tied embedding's copy in the last
      {1, 2, 0, false, false, "bf16"},  // no chunks, --bf16: the fp32 params are distrib_optim.pt's
      {2, 1, 0, true, true, "fp16"},     {1, 2, 1, false, true, "bf16"},
      {1, 2, 1, true, true, "fp32", 40},  // stage 0's chunk 0 in buckets of 40 elements
  };
  int n = 0;
  for (const Layout& l : layouts) {
    SCOPED_TRACE(n);
    const std::string ck = dir_ / ("ck" + std::to_string(n)), meg = dir_ / ("meg" + std::to_string(n)),
                      back = dir_ / ("back" + std::to_string(n));
    ++n;
    Save(Gpt(l.tied), ck, l.precision);
    ConvertOptions o = Opts("ptk", "megatron", ck, meg);
    o.target_tensor_parallel_size = l.tp;
    o.target_pipeline_parallel_size = l.pp;
    o.target_num_layers_per_virtual_pipeline_stage = l.layers_per_chunk;
    o.saver_transformer_impl = l.te ? "transformer_engine" : "local";
    o.target_use_distributed_optimizer = true;
    o.target_ddp_bucket_size = l.bucket;
    auto s = ExportToMegatron(o);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_NE(s->notes.back().find("--use-distributed-optimizer"), std::string::npos) << s->notes.back();
    for (int64_t t = 0; t < l.tp; ++t)
      for (int64_t p = 0; p < l.pp; ++p)
        EXPECT_TRUE(
            std::filesystem::exists(meg + "/iter_0000007/" + megatron::RankDir(t, p, l.pp) + "/distrib_optim.pt"));
    auto r = ImportFromMegatron(Opts("megatron", "ptk", meg, back));
    ASSERT_TRUE(r.ok()) << r.status();
    bool from_distrib = false;
    for (const std::string& note : r->notes) from_distrib |= note.find("distrib_optim.pt") != std::string::npos;
    EXPECT_TRUE(from_distrib);
    std::vector<float> p, m, v;
    TrainState st;
    ASSERT_TRUE(LoadCheckpoint(back, 7, layout_, &p, &m, &v, &st).ok());
    EXPECT_EQ(p, params_);
    EXPECT_EQ(m, m1_);
    EXPECT_EQ(v, m2_);
    EXPECT_EQ(st.adam_step, 3);
  }
}

// The files as megatron-core's DistributedOptimizer writes them: distrib_optim.pt {"buckets_coalesced":
// True, v: {(param dtype, grad dtype): {param, exp_avg, exp_avg_sq, numel_unpadded}}} per chunk v, at the
// layout the grad buffers have; model_optim_rng.pt's optimizer {"optimizer": {"param_groups": the groups
// without their params, Adam's step in each}}.
TEST_F(MegatronDistopt, FilesAreWhatDistributedOptimizerSavesAtDataParallelSizeOne) {
  ASSERT_NO_FATAL_FAILURE(ExportTiedBf16(1, 2, 1));
  auto mparams = megatron::MegParams(layout_, 4);
  ASSERT_TRUE(mparams.ok());
  for (int64_t p = 0; p < 2; ++p) {
    const std::string rank = dir_ / ("meg/iter_0000007/" + megatron::RankDir(0, p, 2));
    auto model = torchfmt::TorchArchiveReader::Open(rank + "/model_optim_rng.pt");
    ASSERT_TRUE(model.ok()) << model.status();
    const PyValue* args = (*model)->root().Get("args");
    EXPECT_TRUE(megatron::BoolAttr(args, "use_distributed_optimizer", false));
    EXPECT_TRUE(megatron::BoolAttr(args, "accumulate_allreduce_grads_in_fp32", false));
    const PyValue* opt = (*model)->root().Get("optimizer");
    ASSERT_NE(opt, nullptr);
    ASSERT_EQ(opt->dict.size(), 1u);  // no fp32_from_fp16_params, no grad_scaler under bf16
    const PyValue* inner = opt->Get("optimizer");
    ASSERT_NE(inner, nullptr);
    ASSERT_EQ(inner->dict.size(), 1u);  // param_groups alone: no per-parameter state
    const PyValue* groups = inner->Get("param_groups");
    ASSERT_NE(groups, nullptr);
    ASSERT_EQ(groups->items.size(), 2u);
    for (const auto& g : groups->items) {
      EXPECT_EQ(g->Get("params"), nullptr);
      EXPECT_EQ(megatron::NumAttr(g.get(), "step"), 3.0);
    }
    auto distrib = torchfmt::TorchArchiveReader::Open(rank + "/distrib_optim.pt");
    ASSERT_TRUE(distrib.ok()) << distrib.status();
    const PyValue& root = (*distrib)->root();
    ASSERT_EQ(root.kind, PyValue::Kind::kDict);
    ASSERT_EQ(root.dict.size(), 3u);  // buckets_coalesced, 0, 1
    EXPECT_EQ(root.Get("buckets_coalesced")->kind, PyValue::Kind::kBool);
    EXPECT_TRUE(root.Get("buckets_coalesced")->b);
    const std::vector<megatron::DistribBuffer> buffers =
        megatron::RankDistribBuffers(*mparams, p, 2, 2, false, true, 128, 1, 16, args);
    for (int64_t v = 0; v < 2; ++v) {
      SCOPED_TRACE(v);
      const PyValue* buffer = megatron::IntKey(&root, v);
      ASSERT_NE(buffer, nullptr);
      ASSERT_EQ(buffer->dict.size(), 1u);
      const PyValue& key = *buffer->dict[0].first;
      ASSERT_EQ(key.kind, PyValue::Kind::kTuple);
      ASSERT_EQ(key.items.size(), 2u);
      EXPECT_EQ(key.items[0]->s, "torch.bfloat16");
      EXPECT_EQ(key.items[1]->s, "torch.float32");  // Megatron-LM reduces --bf16 gradients in fp32
      const PyValue& st = *buffer->dict[0].second;
      std::map<std::string, int64_t> offset;
      const int64_t total = megatron::DistribLayout(buffers[static_cast<size_t>(v)].params, std::nullopt, &offset);
      ASSERT_NE(st.Get("numel_unpadded"), nullptr);
      EXPECT_EQ(st.Get("numel_unpadded")->i, total);
      for (const char* k : {"param", "exp_avg", "exp_avg_sq"}) {
        const PyValue* t = st.Get(k);
        ASSERT_NE(t, nullptr) << k;
        EXPECT_EQ(t->tensor.dtype, torchfmt::DType::kFloat32) << k;
        EXPECT_EQ(t->tensor.shape, std::vector<int64_t>{total}) << k;
      }
      // The final LayerNorm's weight (last chunk of the last rank) where the grad buffer puts it.
      if (p == 1 && v == 1) {
        auto w = (*distrib)->ReadFloat(st.Get("param")->tensor, "param");
        ASSERT_TRUE(w.ok());
        const ParamInfo* ln = layout_.Find("decoder.final_layernorm.weight");
        ASSERT_NE(ln, nullptr);
        const int64_t at = offset.at("model1.decoder.final_layernorm.weight");
        EXPECT_EQ(std::vector<float>(w->begin() + at, w->begin() + at + 16),
                  std::vector<float>(params_.begin() + ln->offset, params_.begin() + ln->offset + 16));
      }
    }
  }
}

// Rewrites the one-buffer distrib_optim.pt at `path` with `edit` applied to its `what` tensor (param,
// exp_avg or exp_avg_sq), as an edited or damaged checkpoint would hold it.
void EditDistrib(const std::string& path, const std::string& what,
                 const std::function<void(std::vector<float>&)>& edit) {
  auto reader = torchfmt::TorchArchiveReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  const PyValue& root = (*reader)->root();
  const PyValue* st = megatron::IntKey(&root, 0)->dict[0].second.get();
  std::vector<torchfmt::StorageBlob> blobs;
  for (const char* k : {"param", "exp_avg", "exp_avg_sq"}) {
    const torchfmt::TensorRef& t = st->Get(k)->tensor;
    auto v = (*reader)->ReadFloat(t, k);
    ASSERT_TRUE(v.ok()) << v.status();
    if (k == what) edit(*v);
    blobs.push_back(
        torchfmt::MakeBlob(t.storage_key, torchfmt::DType::kFloat32, v->data(), static_cast<int64_t>(v->size())));
  }
  ASSERT_TRUE(torchfmt::WriteTorchFile(path, root, blobs).ok());
}

// A tied embedding over pipeline stages: the last stage's grad buffer holds its own fp32 param and
// moments of output_layer.weight, which Megatron keeps equal to stage 0's embedding's (their gradients
// are summed). The export writes them equal; an import where they differ was silent (ptk takes stage
// 0's): warned as the model-weight copy is, naming both files and the element of the whole table.
TEST_F(MegatronDistopt, TiedCopyOfTheLastStageIsWrittenEqualAndWarnedWhenItDiffers) {
  ASSERT_NO_FATAL_FAILURE(ExportTiedBf16(2, 2, 0));
  auto mparams = megatron::MegParams(layout_, 2);
  ASSERT_TRUE(mparams.ok());
  const std::string iter = dir_ / "meg/iter_0000007/";
  auto model = torchfmt::TorchArchiveReader::Open(iter + megatron::RankDir(1, 1, 2) + "/model_optim_rng.pt");
  ASSERT_TRUE(model.ok()) << model.status();
  const PyValue* args = (*model)->root().Get("args");
  const auto vocab_rows = static_cast<int64_t>(megatron::NumAttr(args, "padded_vocab_size").value_or(0));
  const int64_t rows = vocab_rows / 2, n = rows * 16;
  // Each tensor rank's shard of the copy, in each of the three tensors, is stage 0's.
  int64_t out_at = 0;
  for (int64_t t = 0; t < 2; ++t) {
    megatron::DistribState state[2];
    for (int64_t p = 0; p < 2; ++p) {
      const auto buffers = megatron::RankDistribBuffers(*mparams, p, 2, 1, false, true, vocab_rows, 2, 16, args);
      auto d = megatron::ReadDistribOptimChunks(iter + megatron::RankDir(t, p, 2) + "/distrib_optim.pt", buffers);
      ASSERT_TRUE(d.ok()) << d.status();
      state[p] = std::move(*d);
    }
    const int64_t e = state[0].offset.at("embedding.word_embeddings.weight");
    out_at = state[1].offset.at("output_layer.weight");
    for (auto [a, b] : {std::pair{&state[0].param, &state[1].param},
                        {&state[0].exp_avg, &state[1].exp_avg},
                        {&state[0].exp_avg_sq, &state[1].exp_avg_sq}})
      EXPECT_EQ(std::vector<float>(a->begin() + e, a->begin() + e + n),
                std::vector<float>(b->begin() + out_at, b->begin() + out_at + n));
  }
  ::testing::internal::CaptureStderr();
  ASSERT_TRUE(ImportFromMegatron(Opts("megatron", "ptk", dir_ / "meg", dir_ / "back")).ok());
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.find("copy of the tied embedding"), std::string::npos) << err;

  // Tensor rank 1's copy on the last stage: exp_avg's element [3, 5] of its shard changed.
  const std::string last = iter + megatron::RankDir(1, 1, 2) + "/distrib_optim.pt";
  EditDistrib(last, "exp_avg", [&](std::vector<float>& v) { v[static_cast<size_t>(out_at + 3 * 16 + 5)] += 1.0f; });
  ::testing::internal::CaptureStderr();
  ASSERT_TRUE(ImportFromMegatron(Opts("megatron", "ptk", dir_ / "meg", dir_ / "edited")).ok());
  err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find(fmt::format("{}: the distributed optimizer's exp_avg of output_layer.weight (the last stage's "
                                 "copy of the tied embedding) differs from embedding.word_embeddings.weight's in {} "
                                 "at [{}, 5]",
                                 last, iter + megatron::RankDir(1, 0, 2) + "/distrib_optim.pt", rows + 3)),
            std::string::npos)
      << err;
  // Stage 0's state is taken, whole.
  std::vector<float> p, m, v;
  TrainState st;
  ASSERT_TRUE(LoadCheckpoint(dir_ / "edited", 7, layout_, &p, &m, &v, &st).ok());
  EXPECT_EQ(p, params_);
  EXPECT_EQ(m, m1_);
  EXPECT_EQ(v, m2_);
}

// --target-ddp-bucket-size places the distributed optimizer's state: alone it is a usage error, and with
// it the buckets move the file's offsets (what the run's --overlap-grad-reduce --ddp-bucket-size does).
TEST_F(MegatronDistopt, BucketSizeMovesTheOffsetsAndNeedsTheDistributedOptimizer) {
  Save(Gpt(false), dir_ / "ck", "fp32");
  ConvertOptions o = Opts("ptk", "megatron", dir_ / "ck", dir_ / "meg");
  o.target_ddp_bucket_size = 40;
  auto r = ExportToMegatron(o);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(IsUsageError(r.status())) << r.status();
  EXPECT_NE(r.status().message().find("--target-use-distributed-optimizer"), std::string::npos) << r.status();
  EXPECT_FALSE(std::filesystem::exists(dir_ / "meg/latest_checkpointed_iteration.txt"));
  std::vector<float> bucketed, whole;
  for (int64_t bucket : {int64_t{40}, int64_t{0}}) {
    const std::string out = dir_ / ("meg" + std::to_string(bucket));
    o.save_dir = out;
    o.target_use_distributed_optimizer = true;
    o.target_ddp_bucket_size = bucket;
    ASSERT_TRUE(ExportToMegatron(o).ok());
    auto distrib = torchfmt::TorchArchiveReader::Open(out + "/iter_0000007/mp_rank_00/distrib_optim.pt");
    ASSERT_TRUE(distrib.ok()) << distrib.status();
    const PyValue* st = megatron::IntKey(&(*distrib)->root(), 0)->dict[0].second.get();
    auto w = (*distrib)->ReadFloat(st->Get("param")->tensor, "param");
    ASSERT_TRUE(w.ok());
    (bucket ? bucketed : whole) = *w;
    auto model = torchfmt::TorchArchiveReader::Open(out + "/iter_0000007/mp_rank_00/model_optim_rng.pt");
    ASSERT_TRUE(model.ok());
    const PyValue* args = (*model)->root().Get("args");
    EXPECT_EQ(megatron::BoolAttr(args, "overlap_grad_reduce", false), bucket > 0);
    if (bucket) {
      EXPECT_EQ(megatron::NumAttr(args, "ddp_bucket_size"), 40.0);
    }
  }
  // Buckets closing after the 16-element biases leave out their end padding: fewer elements, moved.
  EXPECT_LT(bucketed.size(), whole.size());
}

}  // namespace
}  // namespace ptk
