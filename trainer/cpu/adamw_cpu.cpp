// AdamW (torch.optim.AdamW semantics), the global squared norm and scaling of gradients.
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "trainer/cpu/cpu_lanes.h"
#include "trainer/cpu/ops_cpu.h"
#include "trainer/op_math.h"
#include "trainer/param_shard.h"

namespace ptk::cpu {
namespace {
constexpr int64_t kBlock = 16384;
// ZeRO-1's gradient norm adds the ranks' per-block partials (CpuGPTModel::GradSumSquaresPartials):
// its ranges must start on these blocks for the norm to have the whole buffer's bits.
static_assert(kBlock == ParamShard::kAlignment);

// n elements of AdamW (Scale): in fp32 whole lanes of 16 with a fixed count, which g++ -O2 turns into
// vector code for each clone (vsqrtps, vdivps: the target is built with -fno-math-errno and
// -ffp-contract=off, so every element has the scalar AdamWElement's bits), then the tail.
__attribute__((target_clones("avx512f", "avx2", "default"))) void AdamWRun(
    float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v, int64_t n,
    const AdamWCoefficients<float>& coefficients) {
  const AdamWCoefficients<float> c = coefficients;  // a copy: the stores cannot change it
  int64_t i = 0;
  for (; i + lanes::kLanes <= n; i += lanes::kLanes)
    for (int l = 0; l < lanes::kLanes; ++l) AdamWElement(p[i + l], g[i + l], m[i + l], v[i + l], c);
  for (; i < n; ++i) AdamWElement(p[i], g[i], m[i], v[i], c);
}
__attribute__((target_clones("avx512f", "avx2", "default"))) void ScaleRun(float* x, int64_t n, float s) {
  int64_t i = 0;
  for (; i + lanes::kLanes <= n; i += lanes::kLanes)
    for (int l = 0; l < lanes::kLanes; ++l) x[i + l] *= s;
  for (; i < n; ++i) x[i] *= s;
}
void AdamWRun(double* p, const double* g, double* m, double* v, int64_t n, const AdamWCoefficients<double>& c) {
  for (int64_t i = 0; i < n; ++i) AdamWElement(p[i], g[i], m[i], v[i], c);
}
void ScaleRun(double* x, int64_t n, double s) {
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}
}  // namespace

template <typename T>
void AdamW(T* p, const T* g, T* m, T* v, int64_t n, const AdamWParams& a) {
  const AdamWCoefficients<T> c = MakeAdamWCoefficients<T>(a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.step);
  tbb::parallel_for(int64_t{0}, (n + kBlock - 1) / kBlock, [&](int64_t blk) {
    const int64_t begin = blk * kBlock;
    AdamWRun(p + begin, g + begin, m + begin, v + begin, std::min(n, begin + kBlock) - begin, c);
  });
}

template <typename T>
double SumSquares(const T* x, int64_t n) {
  int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<double> part(static_cast<size_t>(blocks), 0.0);
  tbb::parallel_for(int64_t{0}, blocks, [&](int64_t blk) {
    int64_t end = std::min(n, (blk + 1) * kBlock);
    double s = 0;
    for (int64_t i = blk * kBlock; i < end; ++i) s += static_cast<double>(x[i]) * x[i];
    part[blk] = s;
  });
  double s = 0;
  for (double v : part) s += v;
  return s;
}

template <typename T>
void Scale(T* x, int64_t n, T s) {
  tbb::parallel_for(int64_t{0}, (n + kBlock - 1) / kBlock, [&](int64_t blk) {
    const int64_t begin = blk * kBlock;
    ScaleRun(x + begin, std::min(n, begin + kBlock) - begin, s);
  });
}

template void AdamW<float>(float*, const float*, float*, float*, int64_t, const AdamWParams&);
template void AdamW<double>(double*, const double*, double*, double*, int64_t, const AdamWParams&);
template double SumSquares<float>(const float*, int64_t);
template double SumSquares<double>(const double*, int64_t);
template void Scale<float>(float*, int64_t, float);
template void Scale<double>(double*, int64_t, double);

}  // namespace ptk::cpu
