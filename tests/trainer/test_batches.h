// Deterministic micro-batches for the model tests (tensor_parallel_test, pipeline_parallel_test,
// context_parallel_test, context_pipeline_test): k of them, each of 2 samples of t tokens from a
// vocabulary of 97, a loss mask with holes, and the samples' dropout keys, as model batches or as a
// loader's micro-batches; and the pipeline tests' overlapped-reduction run (StepOverlapped).
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

#include <gtest/gtest.h>

#include "trainer/cpu/cpu_gpt_model.h"
#include "trainer/gpt_model.h"
#include "trainer/train_step.h"
#include "trainer/training_data.h"

namespace ptk::testing {

struct Batches {
  int64_t t;
  std::vector<std::vector<int32_t>> tokens, labels, positions;
  std::vector<std::vector<float>> mask;
  std::vector<std::vector<int64_t>> keys;
  Batches(int count, int64_t seq) : t(seq) {
    for (int k = 0; k < count; ++k) {
      std::vector<int32_t> tk, l, p;
      std::vector<float> m;
      for (int64_t i = 0; i < 2 * t; ++i) {
        tk.push_back(static_cast<int32_t>((i * 37 + 5 + 13 * k) % 97));
        l.push_back(static_cast<int32_t>((i * 11 + 3 + 7 * k) % 97));
        p.push_back(static_cast<int32_t>(i % t));
        m.push_back(i % 7 == 6 ? 0.0f : 1.0f);
      }
      tokens.push_back(tk);
      labels.push_back(l);
      positions.push_back(p);
      mask.push_back(m);
      keys.push_back({2 * k, 2 * k + 1});
    }
  }
  ModelBatch Get(size_t k) const {
    return ModelBatch{2, t, tokens[k].data(), labels[k].data(), positions[k].data(), mask[k].data(), keys[k].data()};
  }
  // Micro-batch k as a loader hands it (a MicroBatch: what KeepContextRows cuts and View reads).
  MicroBatch Loaded(size_t k) const {
    MicroBatch mb;
    mb.micro_batch_size = 2;
    mb.seq_length = t;
    mb.indices = keys[k];
    mb.tokens = tokens[k];
    mb.labels = labels[k];
    mb.position_ids = positions[k];
    mb.loss_mask = mask[k];
    return mb;
  }
  std::vector<ModelBatch> All() const {
    std::vector<ModelBatch> v;
    for (size_t k = 0; k < tokens.size(); ++k) v.push_back(Get(k));
    return v;
  }
};

// One rank's loss and gradients over the micro-batches, as TrainStep would scale them.
struct Reference {
  LossSum loss, eval;
  std::vector<float> grads;
};
inline Reference OneRank(const GPTConfig& c, const std::vector<ModelBatch>& mbs, const std::vector<double>& scales) {
  Reference ref;
  auto m = CpuGPTModel::Create(c);
  EXPECT_TRUE(m.ok());
  EXPECT_TRUE((*m)->InitWeights(11).ok());
  EXPECT_TRUE((*m)->ZeroGrads().ok());
  for (size_t k = 0; k < mbs.size(); ++k) {
    auto l = (*m)->ForwardBackward(mbs[k], scales[k], true, 99);
    EXPECT_TRUE(l.ok()) << l.status();
    ref.loss.loss_sum += l->loss_sum;
    ref.loss.tokens += l->tokens;
  }
  ref.grads.resize(static_cast<size_t>((*m)->num_params()));
  EXPECT_TRUE((*m)->ReadGrads(ref.grads).ok());
  auto e = (*m)->Forward(mbs[0]);
  EXPECT_TRUE(e.ok());
  ref.eval = *e;
  return ref;
}

// What a 4-rank pipeline run of the overlapped-reduction tests (pipeline_parallel_test,
// pipeline_interleaved_test) leaves: each rank's parameters, and the buckets its last step's backwards
// launched (-1: the rank did not finish).
struct OverlapRun {
  std::vector<std::vector<float>> params = std::vector<std::vector<float>>(4);
  std::vector<int> launched = std::vector<int>(4, -1);
};

// 3 TrainSteps of `m` (max lr 3e-3, decay over 24 steps), data rank `d` of 2 in `dp` taking its 4 of each
// step's 8 micro-batches of `all` (global batch 16), over the pipeline group `pipe` and embedding group
// `emb`, --overlap-grad-reduce with buckets of `bucket` elements (0: none); then world rank `rank`'s
// parameters and launched buckets into `out`, under `mu`.
inline void StepOverlapped(CpuGPTModel& m, const std::vector<ModelBatch>& all, int64_t bucket, Communicator* dp,
                           Communicator* pipe, Communicator* emb, int d, int rank, OverlapRun* out, std::mutex* mu) {
  OptimizerConfig oc;
  oc.overlap_grad_reduce = bucket > 0;
  oc.ddp_bucket_size = bucket;
  SchedulerConfig sc;
  sc.max_lr = 3e-3;
  sc.decay_steps = 24;
  TrainStep step(&m, oc, sc, dp);
  step.set_pipeline(pipe, emb);
  for (int it = 0; it < 3; ++it) {
    std::vector<ModelBatch> mine(all.begin() + 8 * it + 4 * d, all.begin() + 8 * it + 4 * d + 4);
    auto r = step.Step(mine, 16, 99);
    ASSERT_TRUE(r.ok()) << r.status();
  }
  std::lock_guard<std::mutex> lock(*mu);
  out->params[static_cast<size_t>(rank)].assign(m.params(), m.params() + m.num_params());
  out->launched[static_cast<size_t>(rank)] = step.pipeline_stats().buckets_launched_in_backward;
}

}  // namespace ptk::testing
