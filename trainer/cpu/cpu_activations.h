// The CPU model's activations, kept per layer for the backward pass (shared by cpu_gpt_model.cpp
// and sequence_parallel_cpu.cpp; not part of the library's interface).
#pragma once

#include <cstdint>
#include <vector>

#include "trainer/cpu/cpu_gpt_model.h"

namespace ptk {

struct CpuGPTModel::Activations {
  int64_t b = 0, t = 0;
  // Per layer (index l): resid[l] is the input of layer l; resid[L] the input of the final norm.
  std::vector<std::vector<float>> resid, resid_mid, ln1, ln1_mean, ln1_rstd, qkv, probs, atty, ln2, ln2_mean, ln2_rstd,
      fc1, gelu;
  std::vector<float> lnf, dact, rope_cos, rope_sin, lnf_mean, lnf_rstd, logits, losses, dloss, tmp, dresid, dtmp, dln,
      dff, dqkv, datt, scratch, xent_work, sp_local, sp_buf,
      ln_grads;  // sequence parallelism: this rank's rows, a permutation's buffer, LayerNorm grads
  std::vector<int32_t> targets;
  std::vector<uint64_t> streams;
};

// The masked loss sum and token count of a pass's per-token losses.
inline LossSum SumLosses(const std::vector<float>& losses, const float* mask, int64_t n) {
  LossSum s;
  for (int64_t i = 0; i < n; ++i) {
    if (mask[i] == 0.0f) continue;
    s.loss_sum += static_cast<double>(losses[i]) * mask[i];
    s.tokens += mask[i];
  }
  return s;
}

}  // namespace ptk
