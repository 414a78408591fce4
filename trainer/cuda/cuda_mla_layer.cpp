// The CUDA model's multi-latent attention layers (the CPU model's trainer/cpu/cpu_mla_layer.cpp over
// trainer/cpu/mla_cpu.cpp, op for op; one tensor rank): the query from linear_q_proj, or linear_q_down_proj, its
// latent norm and linear_q_up_proj; linear_kv_down_proj, whose latent columns go through kv_layernorm and
// linear_kv_up_proj; MLA's rotary embedding on each head's last qk_pos_emb_head_dim query channels and on the shared
// rotary key; all assembled into the fused buffer qkv[l] the core attention reads (mla_ops_cuda.h). The latents are
// kept per layer in mla_saved (mla_plan.h), the pass's intermediates in mla_scratch.
#include <cuda_runtime.h>

#include <vector>

#include <fmt/core.h>

#include "common/status.h"
#include "trainer/cuda/cuda_gpt_model_impl.h"
#include "trainer/cuda/mla_ops_cuda.h"
#include "trainer/cuda/mla_plan.h"
#include "trainer/mla_rope.h"

namespace ptk::cuda::model_detail {

template <typename T>
MlaShape CudaGPTModelImpl<T>::MlaShapeNow() const {
  return MlaShapeOf(config(), b_, t_, tensor_size(), plan_.act_bytes);
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::UploadMlaRope() {
  const GPTConfig& cf = config();
  const int64_t half = cf.qk_pos_emb_head_dim / 2, t = plan_.t;
  std::vector<float> tables(static_cast<size_t>(2 * t * half));  // cos, then sin (a longer t: the same first rows)
  MlaRope r;
  r.base = cf.rotary_base;
  r.yarn = cf.mla_yarn;
  r.factor = cf.rotary_scaling_factor;
  r.mscale = cf.mscale;
  r.mscale_all_dim = cf.mscale_all_dim;
  MlaRopeTables(tables.data(), tables.data() + t * half, t, cf.qk_pos_emb_head_dim, r);
  PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(Buf<float>(plan_.mla_rope), tables.data(), tables.size() * sizeof(float),
                                           cudaMemcpyHostToDevice, ctx_.stream),
                           "copying multi-latent attention's rotary tables to the device");
  return absl::OkStatus();
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::MlaNormForward(T* out, float* stats, const T* inp, int64_t w, int64_t bias, int64_t c,
                                                 const char* name) {
  const double eps = config().layernorm_epsilon;
  if (Rms()) return Op("rmsnorm", name, RMSNormForward<T>(out, stats, inp, LnW(w), n_, c, eps, ctx_));
  return Op("layernorm", name, LayerNormForward<T>(out, stats, stats + n_, inp, LnW(w), Ln(bias), n_, c, eps, ctx_));
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::MlaNormBackward(T* dinp, const T* dout, const T* inp, const float* stats, int64_t w,
                                                  int64_t bias, int64_t c, const char* name) {
  PTK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dinp, 0, static_cast<size_t>(n_ * c) * sizeof(T), ctx_.stream),
                           "zeroing a latent norm's input gradient");
  const float* mean = Rms() ? nullptr : stats;
  const float* rstd = Rms() ? stats : stats + n_;
  return Op(
      Rms() ? "rmsnorm" : "layernorm", name,
      LnBackward(dinp, Grad(w), Grad(bias), dout, inp, LnW(w), mean, rstd, n_, c, Buf<float>(plan_.ln_scratch), ctx_));
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::MlaQkvForward(int64_t l) {
  const GPTConfig& cf = config();
  const LayerParams& lp = layout().layers[static_cast<size_t>(l)];
  if (plan_.mla_saved < 0 || plan_.mla_scratch < 0 || tensor_size() > 1 || sequence_parallel_ || cp())
    return absl::FailedPreconditionError(fmt::format(
        "multi-latent attention layer {}: the CUDA backend runs it on one tensor and context rank, its buffers planned",
        l));
  const MlaShape s = MlaShapeNow();
  const MlaBuffers m = PlanMlaBuffers(s);
  const int64_t n = n_, c = cf.hidden_size, kvl = s.kv_lora, kvw = s.kv_down_rows();
  char* saved = Buf<char>(plan_.mla_saved) + SlotLayer(l) * plan_.mla_saved_bytes;
  char* scratch = Buf<char>(plan_.mla_scratch);
  auto at = [](char* base, int64_t offset) { return reinterpret_cast<T*>(base + offset); };
  const T* x = Act(plan_.ln1, l, n * c);
  T *q = at(scratch, m.q), *kvu = at(scratch, m.kvu);
  if (s.q_lora > 0) {
    T *qd = at(saved, m.qd), *qn = at(saved, m.qn);
    PTK_RETURN_IF_ERROR(
        Op("matmul", "mla q down", MatmulForward<T>(qd, x, Compute(lp.mla_q_down), nullptr, n, c, s.q_lora, ctx_)));
    if (s.norms)
      PTK_RETURN_IF_ERROR(MlaNormForward(qn, reinterpret_cast<float*>(saved + m.q_stats), qd, lp.mla_q_norm_w,
                                         lp.mla_q_norm_b, s.q_lora, "mla q norm"));
    PTK_RETURN_IF_ERROR(Op("matmul", "mla q up",
                           MatmulForward<T>(q, qn, Compute(lp.mla_q_up), nullptr, n, s.q_lora, s.q_rows(), ctx_)));
  } else {
    PTK_RETURN_IF_ERROR(
        Op("matmul", "mla q proj", MatmulForward<T>(q, x, Compute(lp.mla_q_proj), nullptr, n, c, s.q_rows(), ctx_)));
  }
  T *kvd = at(saved, m.kvd), *kvc = at(saved, m.kvc), *kvn = at(saved, m.kvn);
  PTK_RETURN_IF_ERROR(
      Op("matmul", "mla kv down", MatmulForward<T>(kvd, x, Compute(lp.mla_kv_down), nullptr, n, c, kvw, ctx_)));
  PTK_RETURN_IF_ERROR(Op("mla", "mla kv latent", CopyColumns<T>(kvc, kvl, kvd, kvw, n, kvl, ctx_)));
  if (s.norms)
    PTK_RETURN_IF_ERROR(MlaNormForward(kvn, reinterpret_cast<float*>(saved + m.kv_stats), kvc, lp.mla_kv_norm_w,
                                       lp.mla_kv_norm_b, kvl, "mla kv norm"));
  PTK_RETURN_IF_ERROR(Op("matmul", "mla kv up",
                         MatmulForward<T>(kvu, kvn, Compute(lp.mla_kv_up), nullptr, n, kvl, s.kv_up_rows(), ctx_)));
  const float* cos = Buf<float>(plan_.mla_rope);
  return Op("mla", "mla assemble qkv",
            MlaAssembleQkv<T>(Act(plan_.qkv, l, n * Shape().qkv_width()), q, kvu, kvd, cos, cos + plan_.t * (s.pe / 2),
                              s.dims(), ctx_));
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::MlaQkvBackward(int64_t l, const T* dqkv) {
  const GPTConfig& cf = config();
  const LayerParams& lp = layout().layers[static_cast<size_t>(l)];
  const MlaShape s = MlaShapeNow();
  const MlaBuffers m = PlanMlaBuffers(s);
  const int64_t n = n_, c = cf.hidden_size, kvl = s.kv_lora, kvw = s.kv_down_rows();
  char* saved = Buf<char>(plan_.mla_saved) + SlotLayer(l) * plan_.mla_saved_bytes;
  char* scratch = Buf<char>(plan_.mla_scratch);
  auto at = [](char* base, int64_t offset) { return reinterpret_cast<T*>(base + offset); };
  const T* x = Act(plan_.ln1, l, n * c);
  T *dq = at(scratch, m.q), *dkvu = at(scratch, m.kvu), *dkvd = at(scratch, m.dkvd);
  T *dkvn = at(scratch, m.dkvn), *dkvc = at(scratch, m.dkvc), *dln = Buf<T>(plan_.dln);
  const float* cos = Buf<float>(plan_.mla_rope);
  PTK_RETURN_IF_ERROR(Op("mla", "mla split qkv gradient",
                         MlaSplitQkvGrad<T>(dq, dkvu, dkvd, dqkv, cos, cos + plan_.t * (s.pe / 2), s.dims(), ctx_)));
  PTK_RETURN_IF_ERROR(Op("matmul", "mla kv up backward",
                         MatmulBackward<T>(dkvn, Grad(lp.mla_kv_up), nullptr, dkvu, at(saved, m.kvn),
                                           Compute(lp.mla_kv_up), n, kvl, s.kv_up_rows(), ctx_)));
  if (s.norms)
    PTK_RETURN_IF_ERROR(MlaNormBackward(dkvc, dkvn, at(saved, m.kvc), reinterpret_cast<float*>(saved + m.kv_stats),
                                        lp.mla_kv_norm_w, lp.mla_kv_norm_b, kvl, "mla kv norm backward"));
  PTK_RETURN_IF_ERROR(Op("mla", "mla kv latent gradient", CopyColumns<T>(dkvd, kvw, dkvc, kvl, n, kvl, ctx_)));
  if (s.q_lora > 0) {
    T *dqn = at(scratch, m.dqn), *dqd = at(scratch, m.dqd);
    PTK_RETURN_IF_ERROR(Op("matmul", "mla q up backward",
                           MatmulBackward<T>(dqn, Grad(lp.mla_q_up), nullptr, dq, at(saved, m.qn), Compute(lp.mla_q_up),
                                             n, s.q_lora, s.q_rows(), ctx_)));
    if (s.norms)
      PTK_RETURN_IF_ERROR(MlaNormBackward(dqd, dqn, at(saved, m.qd), reinterpret_cast<float*>(saved + m.q_stats),
                                          lp.mla_q_norm_w, lp.mla_q_norm_b, s.q_lora, "mla q norm backward"));
    PTK_RETURN_IF_ERROR(
        Op("matmul", "mla q down backward",
           MatmulBackward<T>(dln, Grad(lp.mla_q_down), nullptr, dqd, x, Compute(lp.mla_q_down), n, c, s.q_lora, ctx_)));
  } else {
    PTK_RETURN_IF_ERROR(Op(
        "matmul", "mla q proj backward",
        MatmulBackward<T>(dln, Grad(lp.mla_q_proj), nullptr, dq, x, Compute(lp.mla_q_proj), n, c, s.q_rows(), ctx_)));
  }
  // The input's gradient: the query's part assigned above, the key and value's added (the CPU's order).
  return Op("matmul", "mla kv down backward",
            MatmulBackward<T>(dln, Grad(lp.mla_kv_down), nullptr, dkvd, x, Compute(lp.mla_kv_down), n, c, kvw, ctx_,
                              /*accumulate_dinp=*/true));
}

#define PTK_INSTANTIATE(T)                                                                                           \
  template MlaShape CudaGPTModelImpl<T>::MlaShapeNow() const;                                                        \
  template absl::Status CudaGPTModelImpl<T>::UploadMlaRope();                                                        \
  template absl::Status CudaGPTModelImpl<T>::MlaNormForward(T*, float*, const T*, int64_t, int64_t, int64_t,         \
                                                            const char*);                                            \
  template absl::Status CudaGPTModelImpl<T>::MlaNormBackward(T*, const T*, const T*, const float*, int64_t, int64_t, \
                                                             int64_t, const char*);                                  \
  template absl::Status CudaGPTModelImpl<T>::MlaQkvForward(int64_t l);                                               \
  template absl::Status CudaGPTModelImpl<T>::MlaQkvBackward(int64_t l, const T* dqkv);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda::model_detail
