// The CPU model's multi-latent attention layers (Megatron's MLASelfAttention of the local spec): the
// projections around the core attention (trainer/cpu/mla_cpu.h) over the input norm's output, into the
// fused buffer the core attention reads. With tensor ranks each runs its heads (its rows of the column-parallel up
// projections) and the whole down projections and latent norms, whose gradients and its input's are then its heads'
// share, summed over the tensor group (the input's by the caller, the weights' by NonTensorParallelGradRanges).
#include <algorithm>
#include <vector>

#include "common/status.h"
#include "trainer/cpu/cpu_activations.h"
#include "trainer/cpu/cpu_gpt_model.h"
#include "trainer/cpu/mla_cpu.h"

namespace ptk {
namespace {
using cpu_model_detail::At;

cpu::MlaSettings MlaSettingsOf(const GPTConfig& cf, int64_t b, int64_t t, int64_t tensor) {
  cpu::MlaSettings s;
  s.b = b;
  s.t = t;
  s.hidden = cf.hidden_size;
  s.heads = cf.num_attention_heads / tensor;  // this rank's
  s.q_lora = cf.q_lora_rank;
  s.kv_lora = cf.kv_lora_rank;
  s.qk = cf.qk_head_dim;
  s.pe = cf.qk_pos_emb_head_dim;
  s.v = cf.v_head_dim;
  s.norms = cf.qk_layernorm;
  s.rms = cf.normalization == Normalization::kRMSNorm;
  s.eps = cf.layernorm_epsilon;
  s.weight_offset = cf.norm_weight_offset();
  s.scale = cf.MlaSoftmaxScale();
  return s;
}
template <typename W, typename T>
W MlaTensors(const LayerParams& lp, T* base) {
  return {At(base, lp.mla_q_proj),    At(base, lp.mla_q_down),    At(base, lp.mla_q_norm_w),
          At(base, lp.mla_q_norm_b),  At(base, lp.mla_q_up),      At(base, lp.mla_kv_down),
          At(base, lp.mla_kv_norm_w), At(base, lp.mla_kv_norm_b), At(base, lp.mla_kv_up)};
}
}  // namespace

AttentionShape MlaAttentionShape(const GPTConfig& cf, int64_t b, int64_t t, int64_t tensor) {
  return MlaSettingsOf(cf, b, t, tensor).shape();
}

void CpuGPTModel::PrepareMla(int64_t t) {
  const GPTConfig& cf = config();
  Activations& a = *act_;
  const int64_t half = cf.qk_pos_emb_head_dim / 2, C = cp() ? context_comm_->size() : 1;
  // A context rank's rows are its positions of the whole sample (context_positions_): the tables of the whole
  // sample's t x C positions, then each row's own.
  std::vector<float> cos(static_cast<size_t>(t * C * half)), sin(cos.size());
  cpu::MlaRope r;
  r.base = cf.rotary_base;
  r.yarn = cf.mla_yarn;
  r.factor = cf.rotary_scaling_factor;
  r.mscale = cf.mscale;
  r.mscale_all_dim = cf.mscale_all_dim;
  cpu::MlaRopeTables(cos.data(), sin.data(), t * C, cf.qk_pos_emb_head_dim, r);
  a.mla_cos.assign(static_cast<size_t>(t * half), 0.0f);
  a.mla_sin.assign(a.mla_cos.size(), 0.0f);
  for (int64_t i = 0; i < t; ++i) {
    const int64_t at = (cp() ? context_positions_[static_cast<size_t>(i)] : i) * half;
    std::copy(cos.begin() + at, cos.begin() + at + half, a.mla_cos.begin() + i * half);
    std::copy(sin.begin() + at, sin.begin() + at + half, a.mla_sin.begin() + i * half);
  }
}

void CpuGPTModel::MlaQkvForward(int64_t l, const LayerParams& lp, const float* x) {
  Activations& a = *act_;
  const cpu::MlaSettings s = MlaSettingsOf(config(), a.b, a.t, tensor_size());
  if (a.mla.size() != act_->qkv.size()) a.mla.resize(act_->qkv.size());
  cpu::MlaQkvForward(a.qkv[l].data(), &a.mla[static_cast<size_t>(l)], x,
                     MlaTensors<cpu::MlaWeights<float>>(lp, params_.data()), s, a.mla_cos.data(), a.mla_sin.data());
}

void CpuGPTModel::MlaQkvBackward(int64_t l, const LayerParams& lp, const float* x) {
  Activations& a = *act_;
  const cpu::MlaSettings s = MlaSettingsOf(config(), a.b, a.t, tensor_size());
  cpu::MlaQkvBackward(a.dln.data(), MlaTensors<cpu::MlaGrads<float>>(lp, grads_.data()), a.dqkv.data(),
                      a.mla[static_cast<size_t>(l)], x,
                      MlaTensors<cpu::MlaWeights<float>>(lp, static_cast<const float*>(params_.data())), s,
                      a.mla_cos.data(), a.mla_sin.data());
}

}  // namespace ptk
