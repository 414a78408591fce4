// What the tests of context parallelism with pipeline stages (context_pipeline_test on the CPU model,
// cuda_context_pipeline_test on the CUDA one) take from a split of T x C x P ranks (one data rank), each
// a thread of the test: the last stage's loss and evaluation sums and the whole model's gradients.
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

#include <gtest/gtest.h>

#include "trainer/gpt_model.h"
#include "trainer/parallel_layout.h"
#include "trainer/param_layout.h"

namespace ptk::testing {

// The last stage's loss and evaluation sums and tokens (tensor rank 0's) added in context-rank order,
// and the whole model's gradients: each stage's, summed over its context group, its tensor ranks'
// slices put back together.
struct SplitRun {
  double loss = 0, tokens = 0, eval = 0;
  std::vector<float> grads;
};

// Gathers a SplitRun from the ranks' threads of a split with C context ranks and P stages, of a model
// of `whole_params` parameters.
class SplitGather {
 public:
  SplitGather(int C, int P, int64_t whole_params)
      : P_(P), losses_(static_cast<size_t>(C)), tokens_(losses_.size()), evals_(losses_.size()) {
    grads_.assign(static_cast<size_t>(whole_params), 0.0f);
  }

  // World rank r, at `at`, after its step: its gradients `grads` (over its model's `layout`, summed over
  // its context group), its step's `loss` and its evaluation pass's `eval`. Only the last stage computes
  // the loss: another stage's tokens are 0.
  void Add(int r, const RankCoords& at, const ParamLayout& layout, const std::vector<float>& grads, const LossSum& loss,
           const LossSum& eval) {
    std::lock_guard<std::mutex> lock(mu_);
    if (at.context == 0) CopyFromShard(layout, grads, grads_);
    if (at.pipeline == P_ - 1 && at.tensor == 0) {
      losses_[static_cast<size_t>(at.context)] = loss.loss_sum;
      tokens_[static_cast<size_t>(at.context)] = loss.tokens;
      evals_[static_cast<size_t>(at.context)] = eval.loss_sum;
    } else if (at.pipeline != P_ - 1) {
      EXPECT_EQ(loss.tokens, 0.0) << "rank " << r;  // only the last stage computes the loss
    }
  }

  // The split's sums, once every rank is added.
  SplitRun Sum() const {
    SplitRun out;
    out.grads = grads_;
    for (size_t q = 0; q < losses_.size(); ++q) {
      out.loss += losses_[q];
      out.tokens += tokens_[q];
      out.eval += evals_[q];
    }
    return out;
  }

 private:
  const int P_;
  std::vector<double> losses_, tokens_, evals_;
  std::vector<float> grads_;
  std::mutex mu_;
};

}  // namespace ptk::testing
