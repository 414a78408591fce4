// Multi-latent attention's rotary tables (mla_rope.h), compiled without contracted multiply-adds (as the CPU ops):
// the same bits whichever backend asks.
#include "trainer/mla_rope.h"

#include <algorithm>
#include <cmath>

#include "trainer/op_math.h"

namespace ptk {

double YarnGetMscale(double scale, double mscale) {
  if (scale <= 1) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

namespace {
// _yarn_find_correction_dim
double YarnCorrectionDim(double rotations, int64_t dim, double base, int64_t original) {
  return static_cast<double>(dim) * std::log(static_cast<double>(original) / (rotations * 2 * M_PI)) /
         (2 * std::log(base));
}
}  // namespace

void MlaRopeTables(float* cos, float* sin, int64_t t, int64_t pe, const MlaRope& r) {
  const int64_t half = pe / 2;
  float concentration = 1.0f;
  double low = 0, high = 0;
  if (r.yarn) {  // YarnRotaryEmbedding.get_emb (correction range rounded to integers)
    low = std::max(std::floor(YarnCorrectionDim(r.beta_fast, pe, r.base, r.original_max_position_embeddings)), 0.0);
    high = std::min(std::ceil(YarnCorrectionDim(r.beta_slow, pe, r.base, r.original_max_position_embeddings)),
                    static_cast<double>(pe - 1));
    if (low == high) high += 0.001;
    concentration = static_cast<float>(YarnGetMscale(r.factor, r.mscale) / YarnGetMscale(r.factor, r.mscale_all_dim));
  }
  for (int64_t i = 0; i < half; ++i) {
    float inv = RopeInverseFrequency(i, pe, r.base, 0);
    if (r.yarn) {
      const float exponent = static_cast<float>(2 * i) / static_cast<float>(pe);
      const float inter = 1.0f / (static_cast<float>(r.factor) * std::pow(static_cast<float>(r.base), exponent));
      const float ramp =
          std::clamp((static_cast<float>(i) - static_cast<float>(low)) / static_cast<float>(high - low), 0.0f, 1.0f);
      const float mask = 1.0f - ramp;
      inv = inter * (1.0f - mask) + inv * mask;
    }
    for (int64_t p = 0; p < t; ++p) {
      const float angle = static_cast<float>(p) * inv;
      cos[p * half + i] = static_cast<float>(std::cos(static_cast<double>(angle))) * concentration;
      sin[p * half + i] = static_cast<float>(std::sin(static_cast<double>(angle))) * concentration;
    }
  }
}

}  // namespace ptk
