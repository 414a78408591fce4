// Megatron's OptimizerParamScheduler: learning rate (warm-up, then constant, linear, cosine,
// inverse-square-root or WSD decay) and weight decay, both in units of samples.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace ptk::trainer {

struct SchedulerConfig {
  double init_lr = 0.0;                         // --lr-warmup-init
  double max_lr = 0.0;                          // --lr
  double min_lr = 0.0;                          // --min-lr
  int64_t warmup_steps = 0;                     // samples
  int64_t decay_steps = 0;                      // samples
  std::string decay_style = "linear";           // constant|linear|cosine|inverse-square-root|WSD
  int64_t wsd_decay_steps = 0;                  // samples (WSD only)
  std::string wsd_decay_style = "exponential";  // linear|cosine|exponential|minus_sqrt
  double start_wd = 0.01, end_wd = 0.01;
  int64_t wd_incr_steps = 0;
  std::string wd_incr_style = "constant";  // constant|linear|cosine

  absl::Status Validate() const;
};

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

 private:
  SchedulerConfig config_;
  int64_t num_steps_ = 0;
};

}  // namespace ptk::trainer
