// Multi-latent attention's projections and rotary embedding on the CPU, forward and backward (mla_cpu.h).
#include "trainer/cpu/mla_cpu.h"

#include <algorithm>
#include <cmath>

#include "trainer/cpu/ops_cpu.h"
#include "trainer/op_math.h"

namespace ptk::cpu {

int64_t MlaActivationFloats(const MlaSettings& s) {
  const int64_t n = s.n(), stats = s.norms ? (s.rms ? n : 2 * n) : 0;  // rstd, and LayerNorm's mean
  const int64_t q = s.q_lora > 0 ? 2 * n * s.q_lora + stats : 0;
  return q + n * s.kv_down_rows() + 2 * n * s.kv_lora + stats;
}

namespace {
// MLA's rotation of one pe-wide vector (channels (2j, 2j + 1) to (j, j + pe/2)), and its transpose.
template <typename T>
void RotateForward(T* out, const T* x, const float* cs, const float* sn, int64_t half) {
  for (int64_t j = 0; j < half; ++j) {
    const T x1 = x[2 * j], x2 = x[2 * j + 1], c = static_cast<T>(cs[j]), s = static_cast<T>(sn[j]);
    out[j] = x1 * c - x2 * s;
    out[half + j] = x2 * c + x1 * s;
  }
}
template <typename T>
void RotateBackward(T* dx, const T* dout, const float* cs, const float* sn, int64_t half, bool add) {
  for (int64_t j = 0; j < half; ++j) {
    const T d1 = dout[j], d2 = dout[half + j], c = static_cast<T>(cs[j]), s = static_cast<T>(sn[j]);
    const T g1 = d1 * c + d2 * s, g2 = d2 * c - d1 * s;
    dx[2 * j] = add ? dx[2 * j] + g1 : g1;
    dx[2 * j + 1] = add ? dx[2 * j + 1] + g2 : g2;
  }
}

template <typename T>
void NormRows(const MlaSettings& s, T* out, std::vector<T>* mean, std::vector<T>* rstd, const T* inp, const T* w,
              const T* b, int64_t n, int64_t c) {
  rstd->assign(static_cast<size_t>(n), T(0));
  if (s.rms) {
    RMSNormForward(out, rstd->data(), inp, w, n, c, s.eps, static_cast<T>(s.weight_offset));
    return;
  }
  mean->assign(static_cast<size_t>(n), T(0));
  LayerNormForward(out, mean->data(), rstd->data(), inp, w, b, n, c, s.eps, static_cast<T>(s.weight_offset));
}
template <typename T>
void NormRowsBackward(const MlaSettings& s, T* dinp, T* dw, T* db, const T* dout, const T* inp, const T* w,
                      const std::vector<T>& mean, const std::vector<T>& rstd, int64_t n, int64_t c) {
  if (s.rms)
    RMSNormBackward(dinp, dw, dout, inp, w, rstd.data(), n, c, static_cast<T>(s.weight_offset));
  else
    LayerNormBackward(dinp, dw, db, dout, inp, w, mean.data(), rstd.data(), n, c, static_cast<T>(s.weight_offset));
}
}  // namespace

template <typename T>
void MlaQkvForward(T* qkv, MlaActivations<T>* a, const T* x, const MlaWeights<T>& w, const MlaSettings& s,
                   const float* cos, const float* sin) {
  const int64_t n = s.n(), c = s.hidden, dq = s.dq(), half = s.pe / 2, kvl = s.kv_lora, kvw = s.kv_down_rows();
  std::vector<T> q(static_cast<size_t>(n * s.q_rows())), kvu(static_cast<size_t>(n * s.kv_up_rows()));
  if (s.q_lora > 0) {
    a->qd.assign(static_cast<size_t>(n * s.q_lora), T(0));
    MatmulForward(a->qd.data(), x, w.q_down, static_cast<const T*>(nullptr), n, c, s.q_lora);
    a->qn = a->qd;
    if (s.norms) NormRows(s, a->qn.data(), &a->q_mean, &a->q_rstd, a->qd.data(), w.q_norm_w, w.q_norm_b, n, s.q_lora);
    MatmulForward(q.data(), a->qn.data(), w.q_up, static_cast<const T*>(nullptr), n, s.q_lora, s.q_rows());
  } else {
    MatmulForward(q.data(), x, w.q_proj, static_cast<const T*>(nullptr), n, c, s.q_rows());
  }
  a->kvd.assign(static_cast<size_t>(n * kvw), T(0));
  MatmulForward(a->kvd.data(), x, w.kv_down, static_cast<const T*>(nullptr), n, c, kvw);
  a->kvc.assign(static_cast<size_t>(n * kvl), T(0));
  for (int64_t i = 0; i < n; ++i) std::copy_n(a->kvd.data() + i * kvw, kvl, a->kvc.data() + i * kvl);
  a->kvn = a->kvc;
  if (s.norms) NormRows(s, a->kvn.data(), &a->kv_mean, &a->kv_rstd, a->kvc.data(), w.kv_norm_w, w.kv_norm_b, n, kvl);
  MatmulForward(kvu.data(), a->kvn.data(), w.kv_up, static_cast<const T*>(nullptr), n, kvl, s.kv_up_rows());
  const int64_t width = s.shape().qkv_width(), head = 2 * dq + s.v, kvh = s.qk + s.v;
  std::vector<T> k_pe(static_cast<size_t>(s.pe));  // a token's rotary key, shared by the heads
  for (int64_t i = 0; i < n; ++i) {
    const float* cs = cos + (i % s.t) * half;
    const float* sn = sin + (i % s.t) * half;
    RotateForward(k_pe.data(), a->kvd.data() + i * kvw + kvl, cs, sn, half);
    for (int64_t h = 0; h < s.heads; ++h) {
      T* row = qkv + i * width + h * head;
      const T* qh = q.data() + i * s.q_rows() + h * dq;
      const T* kvh_row = kvu.data() + i * s.kv_up_rows() + h * kvh;
      std::copy_n(qh, s.qk, row);
      RotateForward(row + s.qk, qh + s.qk, cs, sn, half);
      std::copy_n(kvh_row, s.qk, row + dq);
      std::copy_n(k_pe.data(), s.pe, row + dq + s.qk);
      std::copy_n(kvh_row + s.qk, s.v, row + 2 * dq);
    }
  }
}

template <typename T>
void MlaQkvBackward(T* dx, const MlaGrads<T>& g, const T* dqkv, const MlaActivations<T>& a, const T* x,
                    const MlaWeights<T>& w, const MlaSettings& s, const float* cos, const float* sin) {
  const int64_t n = s.n(), c = s.hidden, dq = s.dq(), half = s.pe / 2, kvl = s.kv_lora, kvw = s.kv_down_rows();
  const int64_t width = s.shape().qkv_width(), head = 2 * dq + s.v, kvh = s.qk + s.v;
  std::vector<T> dqr(static_cast<size_t>(n * s.q_rows())), dkvu(static_cast<size_t>(n * s.kv_up_rows())),
      dkvd(static_cast<size_t>(n * kvw), T(0));
  for (int64_t i = 0; i < n; ++i) {
    const float* cs = cos + (i % s.t) * half;
    const float* sn = sin + (i % s.t) * half;
    for (int64_t h = 0; h < s.heads; ++h) {
      const T* row = dqkv + i * width + h * head;
      T* dqh = dqr.data() + i * s.q_rows() + h * dq;
      T* dkvh = dkvu.data() + i * s.kv_up_rows() + h * kvh;
      std::copy_n(row, s.qk, dqh);
      RotateBackward(dqh + s.qk, row + s.qk, cs, sn, half, false);
      std::copy_n(row + dq, s.qk, dkvh);
      RotateBackward(dkvd.data() + i * kvw + kvl, row + dq + s.qk, cs, sn, half, true);  // summed over the heads
      std::copy_n(row + 2 * dq, s.v, dkvh + s.qk);
    }
  }
  std::vector<T> dkvn(static_cast<size_t>(n * kvl), T(0));
  MatmulBackward(dkvn.data(), g.kv_up, static_cast<T*>(nullptr), dkvu.data(), a.kvn.data(), w.kv_up, n, kvl,
                 s.kv_up_rows());
  std::vector<T> dkvc = dkvn;
  if (s.norms) {
    std::fill(dkvc.begin(), dkvc.end(), T(0));
    NormRowsBackward(s, dkvc.data(), g.kv_norm_w, g.kv_norm_b, dkvn.data(), a.kvc.data(), w.kv_norm_w, a.kv_mean,
                     a.kv_rstd, n, kvl);
  }
  for (int64_t i = 0; i < n; ++i) std::copy_n(dkvc.data() + i * kvl, kvl, dkvd.data() + i * kvw);
  std::fill(dx, dx + n * c, T(0));
  if (s.q_lora > 0) {
    std::vector<T> dqn(static_cast<size_t>(n * s.q_lora), T(0));
    MatmulBackward(dqn.data(), g.q_up, static_cast<T*>(nullptr), dqr.data(), a.qn.data(), w.q_up, n, s.q_lora,
                   s.q_rows());
    std::vector<T> dqd = dqn;
    if (s.norms) {
      std::fill(dqd.begin(), dqd.end(), T(0));
      NormRowsBackward(s, dqd.data(), g.q_norm_w, g.q_norm_b, dqn.data(), a.qd.data(), w.q_norm_w, a.q_mean, a.q_rstd,
                       n, s.q_lora);
    }
    MatmulBackward(dx, g.q_down, static_cast<T*>(nullptr), dqd.data(), x, w.q_down, n, c, s.q_lora);
  } else {
    MatmulBackward(dx, g.q_proj, static_cast<T*>(nullptr), dqr.data(), x, w.q_proj, n, c, s.q_rows());
  }
  MatmulBackward(dx, g.kv_down, static_cast<T*>(nullptr), dkvd.data(), x, w.kv_down, n, c, kvw);
}

#define PTK_INSTANTIATE(T)                                                                                   \
  template void MlaQkvForward<T>(T*, MlaActivations<T>*, const T*, const MlaWeights<T>&, const MlaSettings&, \
                                 const float*, const float*);                                                \
  template void MlaQkvBackward<T>(T*, const MlaGrads<T>&, const T*, const MlaActivations<T>&, const T*,      \
                                  const MlaWeights<T>&, const MlaSettings&, const float*, const float*);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(double)
#undef PTK_INSTANTIATE

}  // namespace ptk::cpu
