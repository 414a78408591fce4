// Per-element math that the CPU ops and the CUDA kernels share (PTK_HD): GELU (Megatron's tanh
// approximation) and its derivative, one AdamW element, the dropout scale. The CPU tests run these
// very functions, so a kernel differs from its CPU op only in reduction order and in the device's
// tanh/exp, never in the formula.
#pragma once

#include <cmath>
#include <cstdint>

#include "trainer/host_device.h"

namespace ptk {

// gelu(x) = x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))
template <typename T>
PTK_HD T GeluValue(T x) {
  const T k = static_cast<T>(0.79788456080286535588);  // sqrt(2/pi)
  T u = k * x * (T(1) + T(0.044715) * x * x);
  return T(0.5) * x * (T(1) + std::tanh(u));
}
template <typename T>
PTK_HD T GeluDerivative(T x) {
  const T k = static_cast<T>(0.79788456080286535588);
  T u = k * x * (T(1) + T(0.044715) * x * x);
  T th = std::tanh(u);
  T du = k * (T(1) + T(3) * T(0.044715) * x * x);
  return T(0.5) * (T(1) + th) + T(0.5) * x * (T(1) - th * th) * du;
}

// The scalars of one AdamW update, computed once on the host (torch.optim.AdamW's bias
// corrections in double, then rounded to T as the CPU op always did).
template <typename T>
struct AdamWCoefficients {
  T decay;  // 1 - lr * weight_decay
  T beta1, beta2;
  T step_size;  // lr / (1 - beta1^step)
  T bc2_sqrt;   // sqrt(1 - beta2^step)
  T eps;
};
template <typename T>
inline AdamWCoefficients<T> MakeAdamWCoefficients(double lr, double beta1, double beta2, double eps,
                                                  double weight_decay, int64_t step) {
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  return {
      static_cast<T>(1.0 - lr * weight_decay), static_cast<T>(beta1), static_cast<T>(beta2), static_cast<T>(lr / bc1),
      static_cast<T>(std::sqrt(bc2)),          static_cast<T>(eps)};
}
// One element: p -= lr*wd*p; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2;
// p -= step_size * m / (sqrt(v)/sqrt(bc2) + eps).
template <typename T>
PTK_HD void AdamWElement(T& p, T g, T& m, T& v, const AdamWCoefficients<T>& c) {
  p *= c.decay;
  m = c.beta1 * m + (T(1) - c.beta1) * g;
  v = c.beta2 * v + (T(1) - c.beta2) * g * g;
  T denom = std::sqrt(v) / c.bc2_sqrt + c.eps;
  p -= c.step_size * m / denom;
}

}  // namespace ptk
