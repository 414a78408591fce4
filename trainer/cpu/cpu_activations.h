// The CPU model's activations, kept per layer for the backward pass (shared by cpu_gpt_model.cpp,
// cpu_gpt_model_pass.cpp and sequence_parallel_cpu.cpp; not part of the library's interface).
#pragma once

#include <cstdint>
#include <vector>

#include "trainer/cpu/cpu_gpt_model.h"
#include "trainer/cpu/mla_cpu.h"
#include "trainer/cpu/moe_cpu.h"
#include "trainer/cpu/ops_cpu.h"
#include "trainer/cpu/shared_experts_cpu.h"

namespace ptk {

struct CpuGPTModel::Activations {
  int64_t b = 0, t = 0;
  int chunk = -1;  // the model chunk whose layers' buffers are sized (GPTModel::SelectChunk)
  // Per layer (index l): resid[l] is the input of layer l; resid[L] the input of the final norm.
  // Under sequence parallelism the residual stream, the norms' outputs and their statistics hold
  // this rank's rows only (b x t/T).
  std::vector<std::vector<float>> resid, resid_mid, ln1, ln1_mean, ln1_rstd, qkv, probs, atty, ln2, ln2_mean, ln2_rstd,
      fc1, gelu;
  // --qk-layernorm: the QKV product before the query and key norms (qkv holds it normalised, then
  // rotated), and the norms' statistics per token and normalised head.
  std::vector<std::vector<float>> qkv_raw, qk_mean, qk_rstd;
  // --attention-output-gate: per layer the gate heads and the core attention's output before the gate (atty holds
  // it gated); the QKV product with its gate rows (forward), then its gradient (backward); the gate's gradient.
  // --qk-l2-norm: ones, the L2 norm's weights in QKNormForward's terms (head_dim of them).
  std::vector<std::vector<float>> gate, att_pre;
  std::vector<float> qkv_fused, dgate, l2_ones;
  std::vector<float> lnf, dact, rope_cos, rope_sin, lnf_mean, lnf_rstd, logits, losses, dloss, tmp, dresid, dtmp, dln,
      dff, dqkv, datt, xent_work;
  // Sequence parallelism: this rank's rows of a product's output, a permutation's buffer, a norm's
  // output gathered whole for the product that follows it (in backward again, for the weight's
  // gradient, as Megatron gathers it), the LayerNorm gradients.
  std::vector<float> sp_local, sp_buf, sp_whole, ln_grads;
  // Context parallelism: the context ranks' qkv rows as gathered (rank by rank), then in the whole
  // samples' order; this rank's queries' share of the keys' and values' gradients, whole samples.
  std::vector<float> cp_gather, cp_qkv, cp_dqkv;
  // Mixture-of-experts layers' routing and expert activations (empty for a dense layer).
  std::vector<cpu::MoeActivations<float>> moe;
  // Expert parallelism: each MoE layer's rows of the expert group's tokens routed to this rank's experts, and
  // the dispatch's gathered buffer.
  std::vector<cpu::MoeActivations<float>> moe_ep;
  std::vector<float> ep_buf;
  // Shared experts' activations (trainer/cpu/shared_experts_cpu.h), per layer (empty for a layer without them).
  std::vector<cpu::SharedExpertActivations<float>> shared;
  // Multi-latent attention layers' latents (trainer/cpu/mla_cpu.h), and MLA's rotary tables (t, pe / 2).
  std::vector<cpu::MlaActivations<float>> mla;
  std::vector<float> mla_cos, mla_sin;
  std::vector<int32_t> targets;
  std::vector<uint64_t> streams;
};

// The core attention's shape of a multi-latent attention layer (cpu_mla_layer.cpp).
AttentionShape MlaAttentionShape(const GPTConfig& cf, int64_t b, int64_t t, int64_t tensor = 1);

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

namespace cpu_model_detail {

// A tensor the configuration may leave out (offset -1): null then.
inline const float* At(const float* base, int64_t offset) { return offset >= 0 ? base + offset : nullptr; }
inline float* At(float* base, int64_t offset) { return offset >= 0 ? base + offset : nullptr; }

// The configuration's norm (LayerNorm or RMSNorm, which keeps no mean and has no bias) over n rows.
inline void NormForward(const GPTConfig& cf, float* out, float* mean, float* rstd, const float* inp, const float* P,
                        int64_t w, int64_t b, int64_t n, int64_t c) {
  if (cf.normalization == Normalization::kRMSNorm)
    cpu::RMSNormForward(out, rstd, inp, P + w, n, c, cf.layernorm_epsilon, cf.norm_weight_offset());
  else
    cpu::LayerNormForward(out, mean, rstd, inp, P + w, P + b, n, c, cf.layernorm_epsilon, cf.norm_weight_offset());
}
// Its backward: dinp accumulated, the weight's (and LayerNorm's bias's) gradients added at G + w (G + b).
inline void NormBackward(const GPTConfig& cf, float* dinp, float* G, const float* dout, const float* inp,
                         const float* P, int64_t w, int64_t b, const float* mean, const float* rstd, int64_t n,
                         int64_t c) {
  if (cf.normalization == Normalization::kRMSNorm)
    cpu::RMSNormBackward(dinp, G + w, dout, inp, P + w, rstd, n, c, cf.norm_weight_offset());
  else
    cpu::LayerNormBackward(dinp, G + w, G + b, dout, inp, P + w, mean, rstd, n, c, cf.norm_weight_offset());
}

// The MLP's activation of fc1's output (n tokens, f of this rank's ffn columns; SwiGLU's fc1 2f):
// SwiGLU, squared ReLU, exact GELU or (tanh) GELU.
inline void MlpActivationForward(const GPTConfig& cf, float* out, const float* fc1, int64_t n, int64_t f) {
  if (cf.swiglu)
    cpu::SwigluForward(out, fc1, n, f);
  else if (cf.squared_relu)
    cpu::SquaredReluForward(out, fc1, n * f);
  else if (cf.gelu_exact)
    cpu::GeluExactForward(out, fc1, n * f);
  else
    cpu::GeluForward(out, fc1, n * f);
}
// Its backward: dff (fc1's output gradient) from dact (the activation's output gradient; may be dff
// but under SwiGLU) is assigned.
inline void MlpActivationBackward(const GPTConfig& cf, float* dff, const float* fc1, const float* dact, int64_t n,
                                  int64_t f) {
  if (cf.swiglu)
    cpu::SwigluBackward(dff, fc1, dact, n, f);
  else if (cf.squared_relu)
    cpu::SquaredReluBackward(dff, fc1, dact, n * f);
  else if (cf.gelu_exact)
    cpu::GeluExactBackward(dff, fc1, dact, n * f);
  else
    cpu::GeluBackward(dff, fc1, dact, n * f);
}

// A MoE layer's shared experts' settings (GPTConfig::moe_shared_expert_intermediate_size): the experts' activation.
inline cpu::SharedExpertSettings SharedExpertSettingsOf(const GPTConfig& cf, int64_t tensor_size = 1) {
  cpu::SharedExpertSettings s;
  s.ffn = cf.moe_shared_expert_intermediate_size / tensor_size;  // a tensor rank's slice
  s.gate = cf.moe_shared_expert_gate;
  s.activation = cf.swiglu         ? cpu::MlpActivation::kSwiglu
                 : cf.squared_relu ? cpu::MlpActivation::kSquaredRelu
                 : cf.gelu_exact   ? cpu::MlpActivation::kGeluExact
                                   : cpu::MlpActivation::kGelu;
  return s;
}

// --qk-layernorm: where layer l's QKV product goes (qkv_raw, normalised into qkv by QKNormLayerForward),
// or qkv itself without it. (Templates: CpuGPTModel::Activations is private to the model.)
template <typename Acts>
float* QkvProductOut(Acts& a, int64_t l, const GPTConfig& cf) {
  return cf.qk_layernorm || cf.qk_l2_norm ? a.qkv_raw[l].data() : a.qkv[l].data();
}
// --attention-output-gate: the QKV product's output (the fused rows with the gate's, split by QkvGateSplit), its
// width; without the gate QkvProductOut's and the shape's.
template <typename Acts>
float* QkvMatmulOut(Acts& a, int64_t l, const GPTConfig& cf) {
  return cf.attention_output_gate ? a.qkv_fused.data() : QkvProductOut(a, l, cf);
}
inline int64_t QkvMatmulWidth(const GPTConfig& cf, const AttentionShape& shape) {
  return shape.qkv_width() + (cf.attention_output_gate ? shape.nh * shape.hd : 0);
}
template <typename Acts>
void QkvGateSplit(const GPTConfig& cf, Acts& a, int64_t l, const AttentionShape& shape) {
  if (cf.attention_output_gate)
    cpu::SplitGatedQkv(QkvProductOut(a, l, cf), a.gate[l].data(), a.qkv_fused.data(), shape);
}
// Where the core attention writes layer l's output: before the gate (att_pre), or atty without it.
template <typename Acts>
float* AttentionOut(Acts& a, int64_t l, const GPTConfig& cf) {
  return cf.attention_output_gate ? a.att_pre[l].data() : a.atty[l].data();
}
// atty[l] = att_pre[l] * sigmoid(gate[l]) (n tokens x ct of this rank's channels).
template <typename Acts>
void OutputGateLayerForward(const GPTConfig& cf, Acts& a, int64_t l, int64_t n, int64_t ct) {
  if (cf.attention_output_gate) cpu::OutputGateForward(a.atty[l].data(), a.att_pre[l].data(), a.gate[l].data(), n * ct);
}
// Backward: datt (atty's gradient) to att_pre's in place, the gate's into dgate.
template <typename Acts>
void OutputGateLayerBackward(const GPTConfig& cf, Acts& a, int64_t l, int64_t n, int64_t ct) {
  if (cf.attention_output_gate)
    cpu::OutputGateBackward(a.datt.data(), a.dgate.data(), a.att_pre[l].data(), a.gate[l].data(), n * ct);
}
// The QKV product's output gradient for its backward: dqkv, or with the gate dqkv and dgate merged into qkv_fused.
template <typename Acts>
float* QkvMatmulGrad(const GPTConfig& cf, Acts& a, const AttentionShape& shape) {
  if (!cf.attention_output_gate) return a.dqkv.data();
  cpu::MergeGatedQkv(a.qkv_fused.data(), a.dqkv.data(), a.dgate.data(), shape);
  return a.qkv_fused.data();
}
template <typename Acts>
void QKNormLayerForward(const GPTConfig& cf, Acts& a, int64_t l, const float* P, const LayerParams& lp,
                        const AttentionShape& shape) {
  if (cf.qk_l2_norm) {  // megatron-core's L2Norm: RMSNorm's arithmetic with unit weights
    const float* ones = a.l2_ones.data();
    cpu::QKNormForward(a.qkv[l].data(), static_cast<float*>(nullptr), a.qk_rstd[l].data(), a.qkv_raw[l].data(), ones,
                       static_cast<const float*>(nullptr), ones, static_cast<const float*>(nullptr), shape,
                       cf.layernorm_epsilon, 0.0f);
    return;
  }
  if (!cf.qk_layernorm) return;
  const bool ln = cf.normalization == Normalization::kLayerNorm;
  cpu::QKNormForward(a.qkv[l].data(), ln ? a.qk_mean[l].data() : nullptr, a.qk_rstd[l].data(), a.qkv_raw[l].data(),
                     P + lp.q_norm_w, At(P, lp.q_norm_b), P + lp.k_norm_w, At(P, lp.k_norm_b), shape,
                     cf.layernorm_epsilon, cf.norm_weight_offset());
}
// Its backward, in place on dqkv (after RoPE's): the gradient of the QKV product out.
template <typename Acts>
void QKNormLayerBackward(const GPTConfig& cf, Acts& a, int64_t l, const float* P, float* G, const LayerParams& lp,
                         const AttentionShape& shape) {
  if (cf.qk_l2_norm) {  // no weights: the raw product's gradient only
    const float* ones = a.l2_ones.data();
    float* none = nullptr;
    cpu::QKNormBackward(a.dqkv.data(), none, none, none, none, a.qkv_raw[l].data(), ones, ones,
                        static_cast<const float*>(nullptr), a.qk_rstd[l].data(), shape, 0.0f);
    return;
  }
  if (!cf.qk_layernorm) return;
  const bool ln = cf.normalization == Normalization::kLayerNorm;
  cpu::QKNormBackward(a.dqkv.data(), G + lp.q_norm_w, At(G, lp.q_norm_b), G + lp.k_norm_w, At(G, lp.k_norm_b),
                      a.qkv_raw[l].data(), P + lp.q_norm_w, P + lp.k_norm_w, ln ? a.qk_mean[l].data() : nullptr,
                      a.qk_rstd[l].data(), shape, cf.norm_weight_offset());
}

}  // namespace cpu_model_detail

}  // namespace ptk
