// Megatron's OptimizerParamScheduler (megatron/core/optimizer_param_scheduler.py), same formulas.
#include "trainer/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include <fmt/core.h>

namespace ptk::trainer {

absl::Status SchedulerConfig::Validate() const {
  auto bad = [](const std::string& m) { return absl::InvalidArgumentError(m); };
  if (min_lr < 0) return bad("--min-lr must not be negative");
  if (max_lr < min_lr) return bad(fmt::format("--lr ({}) must be at least --min-lr ({})", max_lr, min_lr));
  if (decay_steps <= 0) return bad("the learning-rate decay length must be positive (--lr-decay-iters/-samples)");
  if (warmup_steps >= decay_steps)
    return bad(
        fmt::format("the warm-up ({} samples) must be shorter than the decay ({} samples)", warmup_steps, decay_steps));
  static const char* kStyles[] = {"constant", "linear", "cosine", "inverse-square-root", "WSD"};
  if (std::find(std::begin(kStyles), std::end(kStyles), decay_style) == std::end(kStyles))
    return bad("--lr-decay-style must be constant, linear, cosine, inverse-square-root or WSD, not " + decay_style);
  if (decay_style == "WSD") {
    static const char* kWsd[] = {"linear", "cosine", "exponential", "minus_sqrt"};
    if (std::find(std::begin(kWsd), std::end(kWsd), wsd_decay_style) == std::end(kWsd))
      return bad("--lr-wsd-decay-style must be linear, cosine, exponential or minus_sqrt");
    if (wsd_decay_steps <= 0) return bad("WSD needs --lr-wsd-decay-iters or --lr-wsd-decay-samples");
  }
  if (start_wd < 0 || end_wd < start_wd)
    return bad("weight decay: need 0 <= --start-weight-decay <= --end-weight-decay");
  return absl::OkStatus();
}

double OptimizerParamScheduler::lr() const {
  const SchedulerConfig& c = config_;
  const double n = static_cast<double>(num_steps_);
  if (c.warmup_steps > 0 && num_steps_ <= c.warmup_steps)
    return c.init_lr + (c.max_lr - c.init_lr) * n / static_cast<double>(c.warmup_steps);
  if (c.decay_style == "constant") return c.max_lr;
  if (num_steps_ > c.decay_steps) return c.min_lr;
  if (c.decay_style == "inverse-square-root") {
    double warmup = std::max<double>(static_cast<double>(c.warmup_steps), 1.0);
    double steps = std::max(n, 1.0);
    return std::max(c.min_lr, c.max_lr * std::sqrt(warmup) / std::sqrt(steps));
  }
  const double decay_ratio =
      (n - static_cast<double>(c.warmup_steps)) / static_cast<double>(c.decay_steps - c.warmup_steps);
  const double delta = c.max_lr - c.min_lr;
  double coeff = 0;
  if (c.decay_style == "linear") {
    coeff = 1.0 - decay_ratio;
  } else if (c.decay_style == "cosine") {
    coeff = 0.5 * (std::cos(M_PI * decay_ratio) + 1.0);
  } else {  // WSD
    const double anneal_start = static_cast<double>(c.decay_steps - c.wsd_decay_steps);
    if (n <= anneal_start) {
      coeff = 1.0;
    } else {
      const double r = (n - anneal_start) / static_cast<double>(c.wsd_decay_steps);
      if (c.wsd_decay_style == "linear")
        coeff = 1.0 - r;
      else if (c.wsd_decay_style == "cosine")
        coeff = 0.5 * (std::cos(M_PI * r) + 1.0);
      else if (c.wsd_decay_style == "exponential")
        coeff = 2.0 * std::pow(0.5, r) - 1.0;
      else
        coeff = 1.0 - std::sqrt(r);  // minus_sqrt
    }
  }
  return c.min_lr + coeff * delta;
}

double OptimizerParamScheduler::weight_decay() const {
  const SchedulerConfig& c = config_;
  if (num_steps_ > c.wd_incr_steps || c.wd_incr_style == "constant") return c.end_wd;
  const double ratio = static_cast<double>(num_steps_) / static_cast<double>(c.wd_incr_steps);
  const double delta = c.end_wd - c.start_wd;
  double coeff = c.wd_incr_style == "linear" ? ratio : 0.5 * (std::cos(M_PI * (1 - ratio)) + 1.0);
  return c.start_wd + coeff * delta;
}

}  // namespace ptk::trainer
