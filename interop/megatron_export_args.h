// What ExportToMegatron writes beside the tensors: the `args` Namespace, the scheduler's state and
// the optimizer's parameter groups, from the settings a ptk run recorded. Internal to ptk::interop.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "interop/hf_gpt2.h"
#include "interop/torch_format.h"
#include "trainer/checkpoint.h"

namespace ptk::megatron_export {

// A setting the ptk run recorded (TrainState::settings), as a number or as text; fallback when absent.
double SettingNum(const TrainState& st, const std::string& flag, double fallback);
std::string SettingStr(const TrainState& st, const std::string& flag, const std::string& fallback);

// The optimizer's hyperparameters, as the ptk run recorded them.
struct Hyper {
  double lr = 0, min_lr = 0, wd = 0.01, b1 = 0.9, b2 = 0.999, eps = 1e-8;
};
Hyper HyperOf(const TrainState& state);

// The args Namespace: what Megatron's load checks (check_checkpoint_args) and its converter reads.
// vm: the padded vocabulary; vp: model chunks per pipeline stage (1: not interleaved).
torchfmt::PyRef MegatronArgs(const ConvertOptions& o, const GPTConfig& c, const TrainState& state, const Hyper& h,
                             int64_t vm, const std::string& precision, int64_t vp);

// opt_param_scheduler's state_dict.
torchfmt::PyRef SchedulerState(const TrainState& state, const Hyper& h);

// One AdamW parameter group as Megatron's optimizer saves it (params: the ids list).
torchfmt::PyRef AdamGroup(std::vector<torchfmt::PyRef> ids_list, double wd_mult, const Hyper& h);

}  // namespace ptk::megatron_export
