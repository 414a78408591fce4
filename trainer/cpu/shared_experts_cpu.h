// Megatron-core's shared experts (SharedExpertMLP, --moe-shared-expert-intermediate-size) on the CPU, fp32 for
// training and double for the finite-difference checks: a dense MLP without biases (the routed experts'
// activation) on every token of a MoE layer, its output added to the routed experts'; with the gate
// (--moe-shared-expert-gate) its output scaled per token by sigmoid(x . gate_weight), gate_weight (1, c).
#pragma once

#include <cstdint>
#include <vector>

#include "trainer/cpu/moe_cpu.h"

namespace ptk::cpu {

struct SharedExpertSettings {
  int64_t ffn = 0;  // the shared experts' width; fc1 has 2 x ffn rows under SwiGLU
  bool gate = false;
  MlpActivation activation = MlpActivation::kGelu;
  int64_t fc1_rows() const { return (activation == MlpActivation::kSwiglu ? 2 : 1) * ffn; }
};

// One layer's pass over n tokens: what the backward reads, and its scratch.
template <typename T>
struct SharedExpertActivations {
  std::vector<T> fc1, act;   // (n, fc1_rows) fc1's output, (n, ffn) the activation's
  std::vector<T> out, gate;  // with the gate: (n, c) fc2's output before it, (n) its sigmoid; empty without
  std::vector<T> dout, dact, dfc1, dgate;  // scratch: (n, c), (n, ffn), (n, fc1_rows), (n)
  int64_t Floats() const {
    int64_t f = 0;
    for (const auto* v : {&fc1, &act, &out, &gate, &dout, &dact, &dfc1, &dgate}) f += static_cast<int64_t>(v->size());
    return f;
  }
};
// The floats SharedExpertActivations holds after a pass over n tokens of width c (its Floats()).
int64_t SharedExpertActivationFloats(const SharedExpertSettings& s, int64_t n, int64_t c);

// out (n, c) += the shared experts' output on x (n, c): w_fc1 (fc1_rows, c), w_fc2 (c, ffn), w_gate (1, c) or null
// without the gate.
template <typename T>
void SharedExpertForward(T* out, SharedExpertActivations<T>* a, const T* x, const T* w_fc1, const T* w_fc2,
                         const T* w_gate, int64_t n, int64_t c, const SharedExpertSettings& s);
// From dout (n, c), the gradient of the layer's output: dx (n, c), dw_fc1, dw_fc2 and dw_gate accumulated.
template <typename T>
void SharedExpertBackward(T* dx, T* dw_fc1, T* dw_fc2, T* dw_gate, const T* dout, SharedExpertActivations<T>* a,
                          const T* x, const T* w_fc1, const T* w_fc2, const T* w_gate, int64_t n, int64_t c,
                          const SharedExpertSettings& s);

}  // namespace ptk::cpu
