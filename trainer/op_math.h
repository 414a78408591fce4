// Per-element math that the CPU ops and the CUDA kernels share (PTK_HD): GELU (Megatron's tanh
// approximation, and torch's exact erf GELU) and their derivatives, SiLU and its derivative (SwiGLU),
// squared ReLU and its derivative, RoPE's inverse frequencies,
// one AdamW element, the dropout scale. The CPU tests run these
// very functions, so a kernel differs from its CPU op only in reduction order and in the tanh/exp
// (the device's; the CPU's fp32 GELU runs trainer/cpu/cpu_lanes.h's), never in the formula.
#pragma once

#include <cmath>
#include <cstdint>

#include "trainer/host_device.h"
#include "trainer/op_types.h"

namespace ptk {

// gelu(x) = x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))), over any tanh: V is S (a float or a
// double) or, on the CPU, a vector of S (trainer/cpu/cpu_lanes.h's lanes and its own tanh).
template <typename S, typename V, typename Tanh>
PTK_HD V GeluValueWith(V x, Tanh tanh_of) {
  const S k = static_cast<S>(0.79788456080286535588);  // sqrt(2/pi)
  V u = k * x * (S(1) + S(0.044715) * x * x);
  return S(0.5) * x * (S(1) + tanh_of(u));
}
template <typename S, typename V, typename Tanh>
PTK_HD V GeluDerivativeWith(V x, Tanh tanh_of) {
  const S k = static_cast<S>(0.79788456080286535588);
  V u = k * x * (S(1) + S(0.044715) * x * x);
  V th = tanh_of(u);
  V du = k * (S(1) + S(3) * S(0.044715) * x * x);
  return S(0.5) * (S(1) + th) + S(0.5) * x * (S(1) - th * th) * du;
}
// The C library's (the device's) tanh.
struct StdTanh {
  template <typename T>
  PTK_HD T operator()(T u) const {
    return std::tanh(u);
  }
};
template <typename T>
PTK_HD T GeluValue(T x) {
  return GeluValueWith<T>(x, StdTanh{});
}
template <typename T>
PTK_HD T GeluDerivative(T x) {
  return GeluDerivativeWith<T>(x, StdTanh{});
}

// torch's exact GELU (F.gelu, approximate='none'), Megatron's GELU MLP without the fused bias-GELU
// kernel: gelu(x) = x Phi(x) = x/2 (1 + erf(x / sqrt 2)), and its derivative Phi(x) + x phi(x),
// phi(x) = exp(-x^2 / 2) / sqrt(2 pi).
template <typename T>
PTK_HD T GeluExactValue(T x) {
  const T r = static_cast<T>(0.70710678118654752440);  // 1/sqrt(2)
  return T(0.5) * x * (T(1) + std::erf(x * r));
}
template <typename T>
PTK_HD T GeluExactDerivative(T x) {
  const T r = static_cast<T>(0.70710678118654752440);
  const T k = static_cast<T>(0.39894228040143267794);  // 1/sqrt(2 pi)
  return T(0.5) * (T(1) + std::erf(x * r)) + x * k * std::exp(T(-0.5) * x * x);
}

// SwiGLU's activation: silu(x) = x * sigmoid(x), and its derivative sigmoid(x) (1 + x (1 - sigmoid(x))).
template <typename T>
PTK_HD T SiluValue(T x) {
  return x / (T(1) + std::exp(-x));
}
template <typename T>
PTK_HD T SiluDerivative(T x) {
  const T s = T(1) / (T(1) + std::exp(-x));
  return s * (T(1) + x * (T(1) - s));
}

// Megatron's --squared-relu (megatron.core.activations.squared_relu): relu(x)^2, and its derivative
// 2 relu(x) (0 at x = 0, as autograd gives torch.pow(F.relu(x), 2)).
template <typename T>
PTK_HD T SquaredReluValue(T x) {
  return x > T(0) ? x * x : T(0);
}
template <typename T>
PTK_HD T SquaredReluDerivative(T x) {
  return x > T(0) ? T(2) * x : T(0);
}

// Rotary embedding's inverse frequency of channel pair i of rd rotated channels, as Megatron's
// RotaryEmbedding computes it in fp32: 1 / base^(2i / rd); with a `llama3_factor` (> 0), Llama 3.x's
// rescaling by that factor (low_freq_factor 1, high_freq_factor 4, original context 8192, which
// Megatron-core's _apply_scaling keeps at their defaults; transformers' _compute_llama3_parameters).
inline float RopeInverseFrequency(int64_t i, int64_t rd, double base, double llama3_factor) {
  const float exponent = static_cast<float>(2 * i) / static_cast<float>(rd);
  const float inv = 1.0f / std::pow(static_cast<float>(base), exponent);
  if (!(llama3_factor > 0)) return inv;
  const double factor = llama3_factor, low = 1.0, high = 4.0, original = 8192.0;
  const double low_wavelen = original / low, high_wavelen = original / high;
  const double wavelen = 2.0 * 3.14159265358979323846 / static_cast<double>(inv);
  if (wavelen < high_wavelen) return inv;                                                   // high frequencies: kept
  if (wavelen > low_wavelen) return static_cast<float>(static_cast<double>(inv) / factor);  // low: scaled
  const double smooth = (original / wavelen - low) / (high - low);
  return static_cast<float>((1.0 - smooth) * static_cast<double>(inv) / factor + smooth * static_cast<double>(inv));
}

// RoPE's fp32 tables cos, sin (t, rd / 2): the angle position * RopeInverseFrequency(i) in fp32 (as
// torch.outer of fp32 tensors), its cosine and sine in double rounded to fp32. With linear position
// interpolation the position is first scaled in fp32 by fp32(1 / factor), as Megatron's
// get_freqs_non_repeated does (seq *= 1 / factor). Host code: the CPU op and the CUDA model (which
// uploads them) compute the same tables.
inline void RopeAngleTables(float* cos, float* sin, int64_t t, int64_t rd, const RopeSettings& r) {
  const int64_t half = rd / 2;
  const float scale = r.interpolation > 0 ? static_cast<float>(1.0 / r.interpolation) : 1.0f;
  for (int64_t i = 0; i < half; ++i) {
    const float inv = RopeInverseFrequency(i, rd, r.base, r.llama3_factor);
    for (int64_t p = 0; p < t; ++p) {
      const float pos = r.interpolation > 0 ? static_cast<float>(p) * scale : static_cast<float>(p);
      const float angle = pos * inv;
      cos[p * half + i] = static_cast<float>(std::cos(static_cast<double>(angle)));
      sin[p * half + i] = static_cast<float>(std::sin(static_cast<double>(angle)));
    }
  }
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
