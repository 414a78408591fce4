// Expert parallelism's gradients (megatron-core's DDP and get_grad_norm_fp32 with experts): the expert
// weights reduced over the expert-data-parallel group, every other gradient over the data-parallel group,
// and the sums of a whole model (norms, zero counts) that add each expert rank's experts once.
#pragma once

#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "trainer/comm.h"
#include "trainer/gpt_model.h"
#include "trainer/grad_buckets.h"
#include "trainer/param_layout.h"

namespace ptk {

// The buffer's runs of expert weights (ParamInfo::expert) and of the rest, in buffer order.
void ExpertGradRanges(const ParamLayout& layout, std::vector<GradRange>* experts, std::vector<GradRange>* rest);

// Sums the model's gradients: the experts' over model->expert_data_comm() (nothing at one rank), the rest over
// `data`. The loss scale already divides by the data ranks: each expert's gradient then holds the tokens of
// the whole expert group, and their sum over the expert-data group is the data-parallel mean of Megatron's
// (its expert_gradient_scaling_factor, 1 / data ranks).
absl::Status ReduceExpertParallelGrads(GPTModel* model, Communicator* data);

// Σ over `values` (a layout's buffer) of v² (squares) or of v == 0, the expert weights' part summed over
// `expert` in rank order (each expert rank holds other experts), the rest counted once. Under tensor ranks this
// tensor rank's part (its slices; the tensors every tensor rank holds whole on tensor rank 0), for the caller to sum
// over the tensor group.
absl::StatusOr<double> ExpertParallelSum(const ParamLayout& layout, std::span<const float> values, bool squares,
                                         Communicator* expert);

}  // namespace ptk
