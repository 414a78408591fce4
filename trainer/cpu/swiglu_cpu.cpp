// SwiGLU (Llama's gated MLP activation) over fc1's [gate; up] rows, forward and backward.
#include <tbb/parallel_for.h>

#include "trainer/cpu/ops_cpu.h"
#include "trainer/op_math.h"

namespace ptk::cpu {

template <typename T>
void SwigluForward(T* out, const T* inp, int64_t n, int64_t f) {
  tbb::parallel_for(int64_t{0}, n, [&](int64_t i) {
    const T* gate = inp + i * 2 * f;
    const T* up = gate + f;
    T* y = out + i * f;
    for (int64_t j = 0; j < f; ++j) y[j] = SiluValue(gate[j]) * up[j];
  });
}

template <typename T>
void SwigluBackward(T* dinp, const T* inp, const T* dout, int64_t n, int64_t f) {
  tbb::parallel_for(int64_t{0}, n, [&](int64_t i) {
    const T* gate = inp + i * 2 * f;
    const T* up = gate + f;
    const T* dy = dout + i * f;
    T* dgate = dinp + i * 2 * f;
    T* dup = dgate + f;
    for (int64_t j = 0; j < f; ++j) {
      dgate[j] = dy[j] * up[j] * SiluDerivative(gate[j]);
      dup[j] = dy[j] * SiluValue(gate[j]);
    }
  });
}

#define PTK_INSTANTIATE(T)                                        \
  template void SwigluForward<T>(T*, const T*, int64_t, int64_t); \
  template void SwigluBackward<T>(T*, const T*, const T*, int64_t, int64_t);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(double)
#undef PTK_INSTANTIATE

}  // namespace ptk::cpu
