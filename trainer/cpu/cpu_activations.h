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
  // Under sequence parallelism the residual stream, the norms' outputs and their statistics hold
  // this rank's rows only (b x t/T).
  std::vector<std::vector<float>> resid, resid_mid, ln1, ln1_mean, ln1_rstd, qkv, probs, atty, ln2, ln2_mean, ln2_rstd,
      fc1, gelu;
  std::vector<float> lnf, dact, rope_cos, rope_sin, lnf_mean, lnf_rstd, logits, losses, dloss, tmp, dresid, dtmp, dln,
      dff, dqkv, datt, scratch, xent_work;
  // Sequence parallelism: this rank's rows of a product's output, a permutation's buffer, a norm's
  // output gathered whole for the product that follows it (in backward again, for the weight's
  // gradient, as Megatron gathers it), the LayerNorm gradients.
  std::vector<float> sp_local, sp_buf, sp_whole, ln_grads;
  std::vector<int32_t> targets;
  std::vector<uint64_t> streams;
};

}  // namespace ptk
