// Vector lanes for the CPU ops' element-wise loops: 16 floats as one GCC vector, and the exponential
// and tanh written once for a float and for the lanes (not part of the library's interface).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

// The lanes' arithmetic is written out, so that it is vector code at any optimisation level (-O2's
// vectoriser leaves an exponential's loop scalar), with each lane the same operations, and so the same
// bits, as one float: an op's vector loop and its scalar tail agree, and (the target compiled with
// -ffp-contract=off, so that no instruction set fuses a multiply and an add) so do the functions'
// clones for each instruction set (target_clones: runtime dispatch, portable builds).
// Functions taking and returning Lanes are always inlined (PTK_LANES_INLINE), at -O0 too: GCC's note
// that a 64-byte vector's calling convention differs with AVX-512 does not concern them. Left as calls
// (a Debug build), an avx512f clone would take a default-target Load's result in a register where that
// Load returns it in memory (the ASan build once read a null pointer so).
#define PTK_LANES_INLINE inline __attribute__((always_inline))
#pragma GCC diagnostic ignored "-Wpsabi"

namespace ptk::cpu::lanes {

constexpr int kLanes = 16;
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t IntLanes __attribute__((vector_size(kLanes * sizeof(float))));

PTK_LANES_INLINE Lanes Load(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
PTK_LANES_INLINE void Store(float* p, Lanes v) { std::memcpy(p, &v, sizeof v); }
// static_cast for one value, lane by lane for lanes.
template <typename To, typename From>
PTK_LANES_INLINE To ConvertTo(From x) {
  if constexpr (std::is_arithmetic_v<From>)
    return static_cast<To>(x);
  else
    return __builtin_convertvector(x, To);
}

// exp(x) for x <= 0: Cephes' expf, 2^n * p(r) with |r| <= ln2/2, within 2 ulp; branch-free. V is
// float (I int32_t) or Lanes (I IntLanes).
template <typename V, typename I>
PTK_LANES_INLINE V ExpNonPositive(V x) {
  x = x < -87.3f ? V{} - 87.3f : x;
  const V n = ConvertTo<V>(ConvertTo<I>(x * 1.44269504088896341f - 0.5f));
  const V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const I bits = (ConvertTo<I>(n) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// tanh(x), within 3 ulp of the exact value; branch-free. |x| < 0.625: Cephes' tanhf polynomial,
// x + x^3 P(x^2); beyond: (1 - e) / (1 + e) with e = exp(-2|x|) (no cancellation there: e < 0.29).
template <typename V, typename I>
PTK_LANES_INLINE V Tanh(V x) {
  const V a = x < 0.0f ? -x : x;
  const V e = ExpNonPositive<V, I>(a * -2.0f);
  const V far = (1.0f - e) / (1.0f + e);
  const V z = a * a;
  V p = V{} - 5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  p = p * z * a + a;
  const V t = a < 0.625f ? p : far;
  return x < 0.0f ? -t : t;
}

// The tanh above as a functor for op_math.h's formulas (GeluValueWith): one float, or the lanes.
struct FastTanh {
  PTK_LANES_INLINE float operator()(float x) const { return Tanh<float, int32_t>(x); }
  PTK_LANES_INLINE Lanes operator()(Lanes x) const { return Tanh<Lanes, IntLanes>(x); }
};

}  // namespace ptk::cpu::lanes
