// Expert parallelism's dispatch and combine on the CPU (megatron-core's allgather token dispatcher): each
// expert rank routes its own tokens, the expert group all-gathers them with their routing, each rank runs its
// local experts on the rows routed to them, and the outputs (backward: the input and probability gradients)
// are reduce-scattered back to the ranks that own the tokens.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "trainer/comm.h"
#include "trainer/cpu/moe_cpu.h"

namespace ptk::cpu {

// out (n, c) assigned: the layer's MLP output for this rank's n tokens (`mine`, routed by MoeRouterForward over
// all E experts, x its input), its experts' share computed here on the group's tokens (`rows`: the gathered
// tokens routed to this rank's E / size local experts, w_local their weights, expert rank `expert->rank()`).
// `buf`: scratch kept for backward.
absl::Status ExpertParallelForward(float* out, MoeActivations<float>* mine, MoeActivations<float>* rows, const float* x,
                                   const float* w_local, int64_t c, const MoeSettings& s, Communicator* expert,
                                   std::vector<float>* buf);
// Its backward from dout (n, c): the local experts' weight gradients accumulated into dw_local, then as
// MoeRouterBackward (dx accumulated, dw_router) on this rank's tokens.
absl::Status ExpertParallelBackward(float* dx, float* dw_router, float* dw_local, const float* dout,
                                    MoeActivations<float>* mine, MoeActivations<float>* rows, const float* x,
                                    const float* w_router, const float* w_local, int64_t c, const MoeSettings& s,
                                    double aux_grad, double z_grad, Communicator* expert, std::vector<float>* buf);

// ExpertParallelBackward without the router's backward: the local experts' weight gradients into dw_local, this
// rank's tokens' input gradients from the experts added to dx and their probability gradients in mine->dprob. Under
// tensor ranks (each holding its slice of every local expert, `c` wide tokens of its tensor group gathered, Megatron's
// allgather dispatcher over the tensor x expert ranks) dx and mine->dprob are this slice's parts, for the caller to
// sum over the tensor group before the router's backward.
absl::Status ExpertParallelExpertsBackward(float* dx, float* dw_local, const float* dout, MoeActivations<float>* mine,
                                           MoeActivations<float>* rows, const float* w_local, int64_t c,
                                           const MoeSettings& s, Communicator* expert, std::vector<float>* buf);

}  // namespace ptk::cpu
