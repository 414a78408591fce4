// ptk-train's optimizer flags after parsing: fp16's loss scaling and Megatron's parameter groups, with a note for
// each flag that changes nothing without another and one line for a value Megatron refuses.
#include <string>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "common/py_format.h"
#include "common/status.h"
#include "tools/train_flag_parts.h"
#include "tools/train_flags.h"

namespace ptk::train_flags {

// Megatron's loss scaling, fp16's only. A flag of it that changes nothing says so: without --fp16 any of them
// (only --loss-scale did; --initial-loss-scale, --min-loss-scale, --loss-scale-window and --hysteresis were
// taken without a word), and beside --loss-scale's constant scale those of the dynamic scaling.
void ResolveLossScale(const TrainFlags& f, TrainOptions* out, std::vector<std::string>* notes) {
  std::string dynamic;  // the dynamic scaling's flags given
  for (const auto& [name, given] : {std::pair{"--initial-loss-scale", f.initial_loss_scale.has_value()},
                                    std::pair{"--min-loss-scale", f.min_loss_scale.has_value()},
                                    std::pair{"--loss-scale-window", f.loss_scale_window.has_value()},
                                    std::pair{"--hysteresis", f.hysteresis.has_value()}})
    if (given) dynamic += (dynamic.empty() ? "" : ", ") + std::string(name);
  if (!f.fp16) {
    const std::string all = f.loss_scale ? "--loss-scale" + (dynamic.empty() ? "" : ", " + dynamic) : dynamic;
    if (!all.empty()) notes->push_back(all + ": accepted, loss scaling applies to --fp16 only");
    return;
  }
  LossScaleConfig& ls = out->loss_scale;
  ls.dynamic = !f.loss_scale.has_value();
  ls.scale = f.loss_scale.value_or(f.initial_loss_scale.value_or(4294967296.0));
  ls.min_scale = f.min_loss_scale.value_or(1.0);
  ls.window = static_cast<int64_t>(f.loss_scale_window.value_or(1000));
  ls.hysteresis = f.hysteresis.value_or(2);
  if (f.loss_scale && !dynamic.empty())
    notes->push_back(
        fmt::format("{}: accepted, --loss-scale {} is a constant scale: dynamic scaling's settings are "
                    "not used (as in Megatron)",
                    dynamic, py::FloatRepr(*f.loss_scale)));
}

// Megatron's parameter-group flags (megatron-core 0.16.1's get_standard_config_overrides): the deprecated
// --no-weight-decay-cond-type as Megatron's validate_args turns it into --apply-wd-to-qk-layernorm, and the
// flags that change nothing without another (Megatron takes them as silently).
absl::Status ResolveParamGroups(const TrainFlags& f, TrainOptions* out, std::vector<std::string>* notes) {
  TrainOptions& o = *out;
  if (!f.no_weight_decay_cond_type.empty()) {
    if (f.no_weight_decay_cond_type != "apply_wd_to_qk_layernorm")
      return UsageError(
          fmt::format("--no-weight-decay-cond-type {}: the one choice is apply_wd_to_qk_layernorm (as "
                      "Megatron's)",
                      f.no_weight_decay_cond_type));
    o.optimizer.apply_wd_to_qk_layernorm = true;
    notes->push_back(
        "--no-weight-decay-cond-type apply_wd_to_qk_layernorm: deprecated in Megatron, taken as "
        "--apply-wd-to-qk-layernorm");
  }
  if (o.optimizer.apply_wd_to_qk_layernorm && !o.model.qk_layernorm)
    notes->push_back("--apply-wd-to-qk-layernorm: accepted, no effect without --qk-layernorm (as Megatron)");
  if (o.schedule.decoupled_min_lr && !o.schedule.decoupled_lr) {
    notes->push_back("--decoupled-min-lr: accepted, no effect without --decoupled-lr (as Megatron)");
    o.schedule.decoupled_min_lr.reset();
  }
  return absl::OkStatus();
}

}  // namespace ptk::train_flags
