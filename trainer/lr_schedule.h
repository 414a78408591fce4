// Megatron's OptimizerParamScheduler: learning rate (warm-up, then constant, linear, cosine,
// inverse-square-root or WSD decay) and weight decay, both in units of samples.
#pragma once

#include <cstdint>
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

  absl::Status Validate() const;
};

// What a resume does with the scheduler settings a checkpoint recorded when they differ from the
// command line's (Megatron's OptimizerParamScheduler.load_state_dict / _check_and_set).
enum class SchedulerOnLoad {
  kCheck,          // stop, naming what differs (Megatron's default)
  kOverride,       // --override-opt_param-scheduler: the command line's settings
  kUseCheckpoint,  // --use-checkpoint-opt_param-scheduler: the checkpoint's settings
};

// One setting that differs: its name, the flags that set it, and both values as shown to a user.
struct SchedulerDifference {
  std::string what, flags, here, saved;
};

// The settings of `saved` that differ from `here` and change some learning rate or weight decay:
// Megatron's (peak and minimum rate, warm-up and decay lengths, decay style, start and end weight
// decay, its increment length and style) and ptk's others (warm-up start, WSD anneal length and
// style). A setting the style in use ignores is not compared (the increment length under constant
// weight decay, WSD's under another style). `samples_per_iteration` > 0 also shows lengths in
// iterations (a --train-iters run); 0 shows samples only.
std::vector<SchedulerDifference> CompareSchedulers(const SchedulerConfig& here, const SchedulerConfig& saved,
                                                   int64_t samples_per_iteration);

// The settings a resumed run goes on with: `here` when nothing differs or with kOverride, `saved`
// with kUseCheckpoint; with kCheck a difference is a usage error naming each setting, both values
// and the two flags that resolve it. `notes` gets what was kept or replaced when something differs.
absl::StatusOr<SchedulerConfig> ResolveResumedScheduler(const SchedulerConfig& here, const SchedulerConfig& saved,
                                                        SchedulerOnLoad mode, int64_t checkpoint_iteration,
                                                        int64_t samples_per_iteration, std::vector<std::string>* notes);

class OptimizerParamScheduler {
 public:
  explicit OptimizerParamScheduler(const SchedulerConfig& config) : config_(config) {}
  // Advances by `increment` samples (Megatron steps by the global batch size after each update).
  void Step(int64_t increment) { num_steps_ += increment; }
  double lr() const;
  double weight_decay() const;
  int64_t num_steps() const { return num_steps_; }
  void set_num_steps(int64_t n) { num_steps_ = n; }
  const SchedulerConfig& config() const { return config_; }
  void set_config(const SchedulerConfig& config) { config_ = config; }

 private:
  SchedulerConfig config_;
  int64_t num_steps_ = 0;
};

}  // namespace ptk
