// The small argument types the ops of both backends take (C++17, so that CUDA sources, which nvcc
// compiles as C++17 here, can include them).
#pragma once

#include <cstdint>

namespace ptk {

// Causal self-attention's shape: batch, sequence, heads, head dimension.
struct AttentionShape {
  int64_t b, t, nh, hd;
};

// torch.optim.AdamW (decoupled weight decay, bias-corrected moments), as Megatron's fused Adam in
// AdamW mode.
struct AdamWParams {
  double lr, beta1, beta2, eps, weight_decay;
  int64_t step;  // 1-based
};

}  // namespace ptk
