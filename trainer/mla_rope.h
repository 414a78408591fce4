// Multi-latent attention's rotary tables (megatron-core's RotaryEmbedding, or YarnRotaryEmbedding under rope_type
// yarn), host code shared by the CPU model (trainer/cpu/mla_cpu.h) and the CUDA model, which uploads them: both
// backends rotate by the same fp32 tables.
#pragma once

#include <cstdint>

namespace ptk {

struct MlaRope {
  double base = 10000;
  bool yarn = false;
  double factor = 1, mscale = 1, mscale_all_dim = 0;
  int64_t original_max_position_embeddings = 4096;
  double beta_fast = 32, beta_slow = 1;
};
// Rotary tables cos, sin (t, pe / 2) of MLA's RotaryEmbedding (rope) or YarnRotaryEmbedding (yarn, its
// concentration factor folded into cos and sin as megatron-core's apply does with mscale). Row p is position p's
// whatever t is.
void MlaRopeTables(float* cos, float* sin, int64_t t, int64_t pe, const MlaRope& r);
// megatron-core's _yarn_get_mscale: 1 at scale <= 1, else 0.1 * mscale * ln(scale) + 1.
double YarnGetMscale(double scale, double mscale);

}  // namespace ptk
