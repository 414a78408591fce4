// Megatron's OptimizerParamScheduler: learning rate (warm-up, then constant, linear, cosine,
// inverse-square-root or WSD decay) and weight decay, both in units of samples.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ptk {

struct SchedulerConfig {
  double init_lr = 0.0;  // --lr-warmup-init
  double max_lr = 0.0;   // --lr
  double min_lr = 0.0;   // --min-lr
  // Samples; a float as Megatron's: --lr-warmup-fraction times the decay need not be whole.
  double warmup_steps = 0;
  int64_t decay_steps = 0;                      // samples
  std::string decay_style = "linear";           // constant|linear|cosine|inverse-square-root|WSD
  int64_t wsd_decay_steps = 0;                  // samples (WSD only)
  std::string wsd_decay_style = "exponential";  // linear|cosine|exponential|minus_sqrt
  double start_wd = 0.01, end_wd = 0.01;
  int64_t wd_incr_steps = 0;
  std::string wd_incr_style = "constant";  // constant|linear|cosine
  // --decoupled-lr / --decoupled-min-lr: the peak and final rates of the embedding and output layer's
  // parameter group (megatron-core's standard override of that group's max_lr, and of its min_lr when
  // given: --min-lr otherwise); warm-up, decay and weight decay as every group's. Unset: --lr's schedule.
  std::optional<double> decoupled_lr, decoupled_min_lr;

  double decoupled_max() const { return decoupled_lr.value_or(max_lr); }
  double decoupled_min() const { return decoupled_lr ? decoupled_min_lr.value_or(min_lr) : min_lr; }
  absl::Status Validate() const;
};

// What a resume does with the scheduler settings a checkpoint recorded when they differ from the
// command line's (Megatron's OptimizerParamScheduler.load_state_dict / _check_and_set).
enum class SchedulerOnLoad {
  kCheck,          // stop, naming what differs (Megatron's default)
  kOverride,       // --override-opt_param-scheduler: the command line's settings
  kUseCheckpoint,  // --use-checkpoint-opt_param-scheduler: the checkpoint's settings
};

// One setting that differs: its name, the flags that set it, both values as shown to a user, and the name
// Megatron's OptimizerParamScheduler._check_and_set gives it ("" for a setting its state_dict does not hold).
struct SchedulerDifference {
  std::string what, flags, here, saved, megatron;
};

// The settings of `saved` that differ from `here`: first every value Megatron's state_dict holds and its
// load_state_dict checks, whatever the styles in use (peak and minimum rate, warm-up and decay lengths,
// decay style, start and end weight decay, the increment's length, which is Megatron's --train-iters or
// --train-samples, and its style); then ptk's others that Megatron does not record (warm-up start, WSD's
// anneal length and style), each only where a style in use reads it. `samples_per_iteration` > 0 also
// shows lengths in iterations (a --train-iters run); 0 shows samples only.
std::vector<SchedulerDifference> CompareSchedulers(const SchedulerConfig& here, const SchedulerConfig& saved,
                                                   int64_t samples_per_iteration);

// The settings a resumed run goes on with, as megatron-core 0.16.1's load_state_dict leaves its scheduler:
// with kCheck a difference in a value its state_dict holds is a usage error naming each such setting, both
// values and the two flags that resolve it (Megatron's AssertionError); kOverride keeps `here`;
// kUseCheckpoint takes those values from `saved`. The warm-up start and WSD's anneal are `here`'s in
// every mode (Megatron's state_dict does not hold them). `notes` gets what was kept or replaced.
absl::StatusOr<SchedulerConfig> ResolveResumedScheduler(const SchedulerConfig& here, const SchedulerConfig& saved,
                                                        SchedulerOnLoad mode, int64_t checkpoint_iteration,
                                                        int64_t samples_per_iteration, std::vector<std::string>* notes);

class OptimizerParamScheduler {
 public:
  explicit OptimizerParamScheduler(const SchedulerConfig& config) : config_(config) {}
  // Advances by `increment` samples (Megatron steps by the global batch size after each update).
  void Step(int64_t increment) { num_steps_ += increment; }
  // The rate of the default parameter group (--lr's schedule: Megatron's logged learning rate) and of the
  // embedding and output layer's (--decoupled-lr's: the same warm-up start, warm-up and decay).
  double lr() const { return GroupLr(config_.max_lr, config_.min_lr); }
  double decoupled_lr() const { return GroupLr(config_.decoupled_max(), config_.decoupled_min()); }
  double weight_decay() const;
  int64_t num_steps() const { return num_steps_; }
  void set_num_steps(int64_t n) { num_steps_ = n; }
  const SchedulerConfig& config() const { return config_; }
  void set_config(const SchedulerConfig& config) { config_ = config; }

 private:
  // Megatron's get_lr for a group of peak `max_lr` and final `min_lr`.
  double GroupLr(double max_lr, double min_lr) const;
  SchedulerConfig config_;
  int64_t num_steps_ = 0;
};

}  // namespace ptk
