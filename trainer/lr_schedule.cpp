// Megatron's OptimizerParamScheduler (megatron/core/optimizer_param_scheduler.py), same formulas.
#include "trainer/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include <fmt/core.h>

#include "common/status.h"

namespace ptk {

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
  if (decoupled_lr) {
    if (*decoupled_lr < 0 || decoupled_min() < 0)
      return bad("--decoupled-lr and --decoupled-min-lr must not be negative");
    if (decoupled_max() < decoupled_min())
      return bad(
          fmt::format("--decoupled-lr ({}) must be at least {} ({}): the embedding and output layer's rate "
                      "would rise as it decays",
                      decoupled_max(), decoupled_min_lr ? "--decoupled-min-lr" : "--min-lr", decoupled_min()));
  }
  return absl::OkStatus();
}

namespace {

std::string Length(int64_t samples, int64_t per_iteration) {
  if (per_iteration > 0 && samples % per_iteration == 0)
    return fmt::format("{} iterations ({} samples)", samples / per_iteration, samples);
  return fmt::format("{} samples", samples);
}
// A warm-up: whole samples as above, a fraction's product ("23.2 samples") as it is.
std::string Length(double samples, int64_t per_iteration) {
  if (samples == std::floor(samples) && std::abs(samples) < 9e15)
    return Length(static_cast<int64_t>(samples), per_iteration);
  return fmt::format("{} samples", samples);
}
std::string Rate(double v) { return fmt::format("{}", v); }
std::string Rate(const std::optional<double>& v, const char* unset) { return v ? Rate(*v) : std::string(unset); }

}  // namespace

std::vector<SchedulerDifference> CompareSchedulers(const SchedulerConfig& here, const SchedulerConfig& saved,
                                                   int64_t samples_per_iteration) {
  std::vector<SchedulerDifference> out;
  auto len = [&](auto v) { return Length(v, samples_per_iteration); };
  auto add = [&](bool differ, const char* what, const char* flags, std::string a, std::string b, const char* megatron) {
    if (differ) out.push_back({what, flags, std::move(a), std::move(b), megatron});
  };
  // Megatron's state_dict, in its load_state_dict's order: each compared whatever the styles.
  add(here.max_lr != saved.max_lr, "peak learning rate", "--lr", Rate(here.max_lr), Rate(saved.max_lr),
      "learning rate");
  add(here.min_lr != saved.min_lr, "minimum learning rate", "--min-lr", Rate(here.min_lr), Rate(saved.min_lr),
      "minimum learning rate");
  add(here.warmup_steps != saved.warmup_steps, "warm-up length",
      "--lr-warmup-iters, --lr-warmup-samples or --lr-warmup-fraction", len(here.warmup_steps), len(saved.warmup_steps),
      "warmup iterations");
  add(here.decay_steps != saved.decay_steps, "decay length",
      "--lr-decay-iters or --lr-decay-samples, by default --train-iters or --train-samples", len(here.decay_steps),
      len(saved.decay_steps), "total number of iterations");
  add(here.decay_style != saved.decay_style, "decay style", "--lr-decay-style", here.decay_style, saved.decay_style,
      "learning rate decay style");
  add(here.start_wd != saved.start_wd, "start weight decay", "--start-weight-decay, by default --weight-decay",
      Rate(here.start_wd), Rate(saved.start_wd), "start weight decay");
  add(here.end_wd != saved.end_wd, "end weight decay", "--end-weight-decay, by default --weight-decay",
      Rate(here.end_wd), Rate(saved.end_wd), "end weight decay");
  add(here.wd_incr_steps != saved.wd_incr_steps, "weight-decay increment length",
      "--train-iters or --train-samples (Megatron's increment spans the whole run, even under a constant "
      "weight decay)",
      len(here.wd_incr_steps), len(saved.wd_incr_steps), "total number of weight decay iterations");
  add(here.wd_incr_style != saved.wd_incr_style, "weight-decay increment style", "--weight-decay-incr-style",
      here.wd_incr_style, saved.wd_incr_style, "weight decay incr style");
  // Not in the scheduler's state_dict but in its optimizer's: megatron-core keeps each parameter group's
  // max_lr and min_lr in the optimizer's param_groups, saved with it, and a resume loads them back. Checked
  // (and resolved by the two flags) as the scheduler's own values; the minimum only where a rate is decoupled.
  add(here.decoupled_lr != saved.decoupled_lr, "decoupled learning rate (embedding and output layer)", "--decoupled-lr",
      Rate(here.decoupled_lr, "none (--lr's)"), Rate(saved.decoupled_lr, "none (--lr's)"), "param group max_lr");
  add((here.decoupled_lr || saved.decoupled_lr) && here.decoupled_min_lr != saved.decoupled_min_lr,
      "decoupled minimum learning rate", "--decoupled-min-lr", Rate(here.decoupled_min_lr, "none (--min-lr's)"),
      Rate(saved.decoupled_min_lr, "none (--min-lr's)"), "param group min_lr");
  // ptk's own, where a style in use reads them.
  auto any = [&](auto pred) { return pred(here) || pred(saved); };
  const bool warms = any([](const SchedulerConfig& c) { return c.warmup_steps > 0; });
  const bool wsd = any([](const SchedulerConfig& c) { return c.decay_style == "WSD"; });
  add(warms && here.init_lr != saved.init_lr, "warm-up start", "--lr-warmup-init", Rate(here.init_lr),
      Rate(saved.init_lr), "");
  add(wsd && here.wsd_decay_steps != saved.wsd_decay_steps, "WSD anneal length",
      "--lr-wsd-decay-iters or --lr-wsd-decay-samples", len(here.wsd_decay_steps), len(saved.wsd_decay_steps), "");
  add(wsd && here.wsd_decay_style != saved.wsd_decay_style, "WSD anneal style", "--lr-wsd-decay-style",
      here.wsd_decay_style, saved.wsd_decay_style, "");
  return out;
}

absl::StatusOr<SchedulerConfig> ResolveResumedScheduler(const SchedulerConfig& here, const SchedulerConfig& saved,
                                                        SchedulerOnLoad mode, int64_t checkpoint_iteration,
                                                        int64_t samples_per_iteration,
                                                        std::vector<std::string>* notes) {
  const std::vector<SchedulerDifference> diffs = CompareSchedulers(here, saved, samples_per_iteration);
  std::string checked, own;  // Megatron's state_dict's differences; ptk's others (always this command line's)
  for (const SchedulerDifference& d : diffs) {
    std::string& list = d.megatron.empty() ? own : checked;
    if (!list.empty()) list += "; ";
    if (mode == SchedulerOnLoad::kCheck)
      list += fmt::format("{} ({}): {} here, {} in the checkpoint", d.what, d.flags, d.here, d.saved);
    else if (mode == SchedulerOnLoad::kUseCheckpoint && !d.megatron.empty())
      list += fmt::format("{} {} (this command line: {})", d.what, d.saved, d.here);
    else
      list += fmt::format("{} {} (the checkpoint's: {})", d.what, d.here, d.saved);
  }
  if (!checked.empty() && mode == SchedulerOnLoad::kCheck)
    return UsageError(fmt::format(
        "the learning-rate schedule differs from the one the checkpoint of iteration {} was saved with: {}. "
        "As in Megatron, a resume stops here: add --use-checkpoint-opt_param-scheduler to go on with the "
        "checkpoint's schedule, or --override-opt_param-scheduler to take this command line's",
        checkpoint_iteration, checked));
  SchedulerConfig out = here;
  if (!checked.empty() && mode == SchedulerOnLoad::kUseCheckpoint) {
    out.max_lr = saved.max_lr;
    out.min_lr = saved.min_lr;
    out.warmup_steps = saved.warmup_steps;
    out.decay_steps = saved.decay_steps;
    out.decay_style = saved.decay_style;
    out.start_wd = saved.start_wd;
    out.end_wd = saved.end_wd;
    out.wd_incr_steps = saved.wd_incr_steps;
    out.wd_incr_style = saved.wd_incr_style;
    out.decoupled_lr = saved.decoupled_lr;
    out.decoupled_min_lr = saved.decoupled_min_lr;
    notes->push_back("--use-checkpoint-opt_param-scheduler: going on with the checkpoint's schedule: " + checked);
  } else if (!checked.empty()) {
    notes->push_back("--override-opt_param-scheduler: this command line's schedule replaces the checkpoint's: " +
                     checked);
  }
  if (!own.empty())
    notes->push_back("this command line's " + own +
                     ": Megatron's checkpoint does not record these, and its resume takes them from the command line");
  return out;
}

double OptimizerParamScheduler::GroupLr(double max_lr, double min_lr) const {
  const SchedulerConfig& c = config_;
  const double n = static_cast<double>(num_steps_);
  if (c.warmup_steps > 0 && n <= c.warmup_steps) return c.init_lr + (max_lr - c.init_lr) * n / c.warmup_steps;
  if (c.decay_style == "constant") return max_lr;
  if (num_steps_ > c.decay_steps) return min_lr;
  if (c.decay_style == "inverse-square-root") {
    double warmup = std::max(c.warmup_steps, 1.0);
    double steps = std::max(n, 1.0);
    return std::max(min_lr, max_lr * std::sqrt(warmup) / std::sqrt(steps));
  }
  const double decay_ratio = (n - c.warmup_steps) / (static_cast<double>(c.decay_steps) - c.warmup_steps);
  const double delta = max_lr - min_lr;
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
  return min_lr + coeff * delta;
}

double OptimizerParamScheduler::weight_decay() const {
  const SchedulerConfig& c = config_;
  if (num_steps_ > c.wd_incr_steps || c.wd_incr_style == "constant") return c.end_wd;
  const double ratio = static_cast<double>(num_steps_) / static_cast<double>(c.wd_incr_steps);
  const double delta = c.end_wd - c.start_wd;
  double coeff = c.wd_incr_style == "linear" ? ratio : 0.5 * (std::cos(M_PI * (1 - ratio)) + 1.0);
  return c.start_wd + coeff * delta;
}

}  // namespace ptk
