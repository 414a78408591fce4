// The shared experts' forward and backward (shared_experts_cpu.h).
#include "trainer/cpu/shared_experts_cpu.h"

#include <algorithm>
#include <cmath>

#include "common/status.h"
#include "trainer/cpu/ops_cpu.h"

namespace ptk::cpu {

int64_t SharedExpertActivationFloats(const SharedExpertSettings& s, int64_t n, int64_t c) {
  const int64_t gated = s.gate ? 2 * (n * c + n) : 0;  // out, gate, dout, dgate
  return 2 * n * s.fc1_rows() + 2 * n * s.ffn + gated;
}

template <typename T>
void SharedExpertForward(T* out, SharedExpertActivations<T>* a, const T* x, const T* w_fc1, const T* w_fc2,
                         const T* w_gate, int64_t n, int64_t c, const SharedExpertSettings& s) {
  PTK_CHECK(s.ffn > 0 && (w_gate != nullptr) == s.gate);
  const int64_t f1 = s.fc1_rows(), f = s.ffn;
  a->fc1.resize(static_cast<size_t>(n * f1));
  a->act.resize(static_cast<size_t>(n * f));
  MatmulForward(a->fc1.data(), x, w_fc1, static_cast<const T*>(nullptr), n, c, f1);
  MlpActivationForward(s.activation, a->act.data(), a->fc1.data(), n, f);
  if (!s.gate) {
    a->out.clear();
    a->gate.clear();
    a->dout.clear();
    a->dgate.clear();
    std::vector<T> y(static_cast<size_t>(n * c));
    MatmulForward(y.data(), a->act.data(), w_fc2, static_cast<const T*>(nullptr), n, f, c);
    for (int64_t i = 0; i < n * c; ++i) out[i] += y[static_cast<size_t>(i)];
    return;
  }
  a->out.resize(static_cast<size_t>(n * c));
  a->gate.resize(static_cast<size_t>(n));
  MatmulForward(a->out.data(), a->act.data(), w_fc2, static_cast<const T*>(nullptr), n, f, c);
  MatmulForward(a->gate.data(), x, w_gate, static_cast<const T*>(nullptr), n, c, int64_t{1});
  for (T& g : a->gate) g = T(1) / (T(1) + std::exp(-g));  // torch.sigmoid
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < c; ++j) out[i * c + j] += a->out[i * c + j] * a->gate[i];
}

template <typename T>
void SharedExpertBackward(T* dx, T* dw_fc1, T* dw_fc2, T* dw_gate, const T* dout, SharedExpertActivations<T>* a,
                          const T* x, const T* w_fc1, const T* w_fc2, const T* w_gate, int64_t n, int64_t c,
                          const SharedExpertSettings& s) {
  const int64_t f1 = s.fc1_rows(), f = s.ffn;
  const T* dy = dout;  // the gradient of fc2's output
  if (s.gate) {
    a->dout.resize(static_cast<size_t>(n * c));
    a->dgate.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      const T g = a->gate[i];
      T dg = 0;
      for (int64_t j = 0; j < c; ++j) {
        dg += dout[i * c + j] * a->out[i * c + j];
        a->dout[i * c + j] = dout[i * c + j] * g;
      }
      a->dgate[i] = dg * g * (T(1) - g);  // through the sigmoid: the gate's logit's gradient
    }
    MatmulBackward(dx, dw_gate, static_cast<T*>(nullptr), a->dgate.data(), x, w_gate, n, c, int64_t{1});
    dy = a->dout.data();
  }
  a->dact.assign(static_cast<size_t>(n * f), T{0});
  a->dfc1.resize(static_cast<size_t>(n * f1));
  MatmulBackward(a->dact.data(), dw_fc2, static_cast<T*>(nullptr), dy, a->act.data(), w_fc2, n, f, c);
  MlpActivationBackward(s.activation, a->dfc1.data(), a->fc1.data(), a->dact.data(), n, f);
  MatmulBackward(dx, dw_fc1, static_cast<T*>(nullptr), a->dfc1.data(), x, w_fc1, n, c, f1);
}

#define PTK_INSTANTIATE(T)                                                                                         \
  template void SharedExpertForward<T>(T*, SharedExpertActivations<T>*, const T*, const T*, const T*, const T*,    \
                                       int64_t, int64_t, const SharedExpertSettings&);                             \
  template void SharedExpertBackward<T>(T*, T*, T*, T*, const T*, SharedExpertActivations<T>*, const T*, const T*, \
                                        const T*, const T*, int64_t, int64_t, const SharedExpertSettings&);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(double)
#undef PTK_INSTANTIATE

}  // namespace ptk::cpu
