// The small argument types the ops of both backends take (C++17, so that CUDA sources, which nvcc
// compiles as C++17 here, can include them).
#pragma once

#include <cstdint>

namespace ptk {

// Causal self-attention's shape: batch, sequence, query heads, head dimension, and the key/value
// heads (query groups; 0: one per query head). Each group's query heads share its key and value.
struct AttentionShape {
  int64_t b, t, nh, hd;
  int64_t ng = 0;
  // Multi-latent attention (CPU ops only): the value heads' width (0: hd, the query and key heads') and
  // the scores' scale (0: 1 / sqrt(hd); MLA's is mscale^2 / sqrt(hd)).
  int64_t vd = 0;
  double scale = 0;
  // Megatron's sliding window attention (--window-size W,0 on this layer, CPU ops only): the row at
  // position i attends keys max(0, i - window)..i; -1: keys 0..i (no window).
  int64_t window = -1;
  // Megatron's softmax offset (--softmax-type, CPU ops only): null, the vanilla softmax; else per head
  // (this rank's) a logit beside each row's scores in its softmax, dropped after it (Megatron's
  // SoftmaxOne: off-by-one's zeros, learnable's softmax_offset parameter). dsink: where backward adds the
  // offset's gradient (null: none wanted).
  const float* sink = nullptr;
  float* dsink = nullptr;
  int64_t groups() const { return ng > 0 ? ng : nh; }
  int64_t v_dim() const { return vd > 0 ? vd : hd; }
  // Width of one token's row of the fused QKV: per group its query heads, then its key and value.
  int64_t qkv_width() const { return nh * hd + groups() * (hd + v_dim()); }
};

// Rotary embedding's settings beside the rotated channels (Megatron's RotaryEmbedding arguments).
struct RopeSettings {
  double base = 10000.0;     // rotary_base
  double llama3_factor = 0;  // Llama 3.x frequency scaling's factor (rope_scaling_factor); 0: no scaling
  double interpolation = 0;  // linear position interpolation (seq_len_interpolation_factor); 0: none
  bool interleaved = false;  // rotary_interleaved: pairs (2i, 2i + 1), not (i, i + rd/2)
};

// torch.optim.AdamW (decoupled weight decay, bias-corrected moments), as Megatron's fused Adam in
// AdamW mode.
struct AdamWParams {
  double lr, beta1, beta2, eps, weight_decay;
  int64_t step;  // 1-based
};

// Megatron's optimizer parameter groups (megatron-core 0.16.1's _get_param_groups with its standard
// overrides): no weight decay on 1-D tensors and biases (--apply-wd-to-qk-layernorm: except the query and
// key norms'), and the embedding and output layer ("is_embedding_or_output_parameter") on --decoupled-lr's
// schedule. One AdamWParams per group; a tensor's group from its three marks (ParamInfo, ParamPiece).
struct AdamWGroups {
  static constexpr int kCount = 4;
  // [0] decayed, [1] not decayed, [2] decoupled decayed, [3] decoupled not decayed.
  AdamWParams group[kCount];
  bool apply_wd_to_qk_layernorm = false;

  // Every tensor on one rate: `decay` for weights, `no_decay` for the tensors without weight decay.
  static AdamWGroups Uniform(const AdamWParams& decay, const AdamWParams& no_decay) {
    return AdamWGroups{{decay, no_decay, decay, no_decay}, false};
  }
  int IndexOf(bool no_weight_decay, bool qk_layernorm, bool decoupled_lr) const {
    const bool no_decay = no_weight_decay && !(apply_wd_to_qk_layernorm && qk_layernorm);
    return (decoupled_lr ? 2 : 0) + (no_decay ? 1 : 0);
  }
  template <typename Tensor>  // ParamInfo or ParamPiece
  const AdamWParams& Of(const Tensor& t) const {
    return group[IndexOf(t.no_weight_decay, t.qk_layernorm, t.decoupled_lr)];
  }
};

}  // namespace ptk
