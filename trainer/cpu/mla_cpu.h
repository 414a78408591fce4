// Megatron-core's multi-latent attention (MLASelfAttention, DeepSeek-V2/V3) on the CPU, its projections
// around the core attention (fp32 for training, double for the finite-difference checks): the query from
// linear_q_proj, or with a q_lora_rank from linear_q_down_proj, q_layernorm and linear_q_up_proj; the
// key and value from linear_kv_down_proj, whose last qk_pos_emb_head_dim columns (the shared rotary key)
// are split off before kv_layernorm and linear_kv_up_proj; rotary embedding on each head's last
// qk_pos_emb_head_dim query channels and on the shared key part, as megatron-core's
// _apply_rotary_pos_emb_bshd with multi_latent_attention (channels (2i, 2i + 1) gathered to (i, i + d/2),
// then rotated as non-interleaved RoPE). The result is the fused qkv buffer the core attention reads
// (AttentionShape with nh groups: per head its query, key (qk + pe) and value (v) channels).
// The local spec builds q_layernorm and kv_layernorm only with --qk-layernorm (IdentityOp otherwise).
#pragma once

#include <cstdint>
#include <vector>

#include "trainer/mla_rope.h"
#include "trainer/op_types.h"

namespace ptk::cpu {

struct MlaSettings {
  int64_t b = 0, t = 0;  // n = b * t tokens, row i at position i % t
  int64_t hidden = 0, heads = 0;
  int64_t q_lora = 0;  // 0: linear_q_proj (Megatron's q_lora_rank None)
  int64_t kv_lora = 0, qk = 0, pe = 0, v = 0;
  bool norms = false;  // q_layernorm (with q_lora) and kv_layernorm
  bool rms = false;    // RMSNorm (weights only), or LayerNorm (weights and biases)
  double eps = 1e-5;
  float weight_offset = 0;  // --apply-layernorm-1p
  double scale = 0;         // the core attention's softmax scale
  int64_t n() const { return b * t; }
  int64_t dq() const { return qk + pe; }  // a query's (and key's) channels per head
  int64_t q_rows() const { return heads * dq(); }
  int64_t kv_down_rows() const { return kv_lora + pe; }
  int64_t kv_up_rows() const { return heads * (qk + v); }
  AttentionShape shape() const { return AttentionShape{b, t, heads, dq(), heads, v, scale}; }
};

// The layer's weights (null where the settings have none), as Megatron's (out, in) matrices.
template <typename T>
struct MlaWeights {
  const T *q_proj = nullptr, *q_down = nullptr, *q_norm_w = nullptr, *q_norm_b = nullptr, *q_up = nullptr;
  const T *kv_down = nullptr, *kv_norm_w = nullptr, *kv_norm_b = nullptr, *kv_up = nullptr;
};
template <typename T>
struct MlaGrads {
  T *q_proj = nullptr, *q_down = nullptr, *q_norm_w = nullptr, *q_norm_b = nullptr, *q_up = nullptr;
  T *kv_down = nullptr, *kv_norm_w = nullptr, *kv_norm_b = nullptr, *kv_up = nullptr;
};

// What the backward reads of one layer's pass.
template <typename T>
struct MlaActivations {
  std::vector<T> qd, qn, q_mean, q_rstd;      // the compressed query (n, q_lora), normalised, statistics
  std::vector<T> kvd;                         // linear_kv_down_proj's output (n, kv_lora + pe)
  std::vector<T> kvc, kvn, kv_mean, kv_rstd;  // its latent part (n, kv_lora), normalised, statistics
};
// The floats MlaActivations holds after a pass.
int64_t MlaActivationFloats(const MlaSettings& s);

// MLA's rotary tables (trainer/mla_rope.h, shared with the CUDA model).
using ::ptk::MlaRope;
using ::ptk::MlaRopeTables;
using ::ptk::YarnGetMscale;

// qkv (n, shape().qkv_width()) from x (n, hidden); `a` sized and filled.
template <typename T>
void MlaQkvForward(T* qkv, MlaActivations<T>* a, const T* x, const MlaWeights<T>& w, const MlaSettings& s,
                   const float* cos, const float* sin);
// dx (n, hidden) is assigned from dqkv (the core attention's input gradient); the weights' gradients added.
template <typename T>
void MlaQkvBackward(T* dx, const MlaGrads<T>& g, const T* dqkv, const MlaActivations<T>& a, const T* x,
                    const MlaWeights<T>& w, const MlaSettings& s, const float* cos, const float* sin);

}  // namespace ptk::cpu
