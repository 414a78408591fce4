// The CUDA backend's multi-latent attention, its host side (plain C++, checked on the CPU): one layer's shape on one
// rank from the configuration, and its device buffers (what its forward keeps for backward, the pass's scratch) laid
// out from it. The layer (cuda_mla_layer.cpp) runs trainer/cpu/mla_cpu.cpp's MlaQkvForward / MlaQkvBackward op for
// op over them: the products, the latent norms, and mla_ops_cuda.h's assembly.
#pragma once

#include <cstdint>

#include "trainer/cuda/mla_ops_cuda.h"
#include "trainer/op_types.h"
#include "trainer/param_layout.h"

namespace ptk::cuda {

// One layer on one tensor rank (its heads): cpu::MlaSettings' widths, n tokens of width c (hidden), act_bytes the
// activation type's size (4 fp32, 2 bf16/fp16).
struct MlaShape {
  int64_t n = 0, t = 0, c = 0, heads = 0;
  int64_t q_lora = 0;  // 0: linear_q_proj
  int64_t kv_lora = 0, qk = 0, pe = 0, v = 0;
  bool norms = false;  // the latent norms (--qk-layernorm)
  bool rms = false;    // RMSNorm (rstd alone), or LayerNorm (mean and rstd)
  int64_t act_bytes = 4;
  int64_t dq() const { return qk + pe; }
  int64_t q_rows() const { return heads * dq(); }
  int64_t kv_down_rows() const { return kv_lora + pe; }
  int64_t kv_up_rows() const { return heads * (qk + v); }
  // The core attention's shape over b samples of t: per head a query and key of dq channels, a value of v.
  AttentionShape attention(int64_t b, double scale) const { return AttentionShape{b, t, heads, dq(), heads, v, scale}; }
  MlaDims dims() const { return MlaDims{n, t, heads, qk, pe, v, kv_lora}; }
};
// The configuration's layer over b samples of t positions at tensor size `tensor`.
MlaShape MlaShapeOf(const GPTConfig& config, int64_t b, int64_t t, int64_t tensor, int64_t act_bytes);

// Byte offsets (each MemoryPlan-aligned, 256) into two regions: `saved`, one per layer, what backward reads, and
// `scratch`, one for the pass. T the activation type; the statistics fp32 (LayerNorm's mean, then rstd, n each;
// RMSNorm's rstd alone).
struct MlaBuffers {
  // saved: with q_lora, qd (n, q_lora) linear_q_down_proj's output and qn (n, q_lora) its norm's (qd itself without
  // the norms), q_stats; kvd (n, kv_lora + pe) linear_kv_down_proj's output, kvc (n, kv_lora) its latent columns,
  // kvn (n, kv_lora) their norm's (kvc itself without the norms), kv_stats. -1: none.
  int64_t qd = -1, qn = -1, q_stats = -1, kvd = 0, kvc = 0, kvn = 0, kv_stats = -1, saved_bytes = 0;
  // scratch: q (n, q_rows) the query heads before their rotation (backward: their gradient), kvu (n, kv_up_rows)
  // linear_kv_up_proj's output (its gradient), dkvd (n, kv_down_rows), dkvn and dkvc (n, kv_lora), with q_lora dqn
  // and dqd (n, q_lora) (-1 otherwise); dkvc and dqd alias dkvn and dqn without the norms.
  int64_t q = 0, kvu = 0, dkvd = 0, dkvn = 0, dkvc = 0, dqn = -1, dqd = -1, scratch_bytes = 0;
  // The elements of T and the fp32 statistics a layer keeps (cpu::MlaActivationFloats counts both, and the norms'
  // outputs as copies even without the norms).
  int64_t saved_values = 0, saved_stats = 0;
};
MlaBuffers PlanMlaBuffers(const MlaShape& s);

// The widest latent a norm's backward runs over (its scratch): q_lora and kv_lora under the norms, else 0.
int64_t MlaWidestNorm(const GPTConfig& config);

}  // namespace ptk::cuda
