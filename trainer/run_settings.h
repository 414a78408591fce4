// The run's settings, each under its Megatron flag name: what every data-parallel rank must agree
// on (compared at start-up, before any collective whose size depends on them) and what a
// checkpoint records of its run, so that a resume can say what changed.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "trainer/checkpoint.h"
#include "trainer/comm.h"
#include "trainer/train_options.h"

namespace ptk {

// A run's settings, each under its flag name, e.g. {"--seed", "1234"}.
using Settings = std::vector<std::pair<std::string, std::string>>;

// The settings of a run of `options` with global batch size `gbs` (as used), in a fixed order.
Settings RunSettings(const TrainOptions& options, int64_t gbs);

// A mixture-of-experts model's settings among them (what an imported checkpoint records of its experts).
Settings MoeRunSettings(const GPTConfig& m);
// A multi-latent attention model's settings among them (what an imported MLA checkpoint records).
Settings MlaRunSettings(const GPTConfig& m);

// The settings every rank must share (those CheckRanksAgree compares: the data paths as given, not
// resolved), one "flag\tvalue" line each in `all`'s order: what a rank's rendezvous hello carries
// (RendezvousStore::Connect's `settings`).
std::string AgreedSettingsText(const Settings& all);

// Start-up handshake between data-parallel ranks, before any collective whose size depends on the
// flags (gloo aborts the process when ranks all-reduce different sizes): every rank compares its
// settings with rank 0's, and all of them fail alike with one line naming the first differing
// rank and setting and both values (a usage error).
absl::Status CheckRanksAgree(Communicator* comm, const Settings& mine);

// Megatron resumes with another data order or batch size without a word (its
// check_checkpoint_args compares only the model's shape, which LoadCheckpoint refuses): ptk says
// what changed since the checkpoint was saved and what it means for the run.
void ReportResumeChanges(const Settings& saved, const Settings& now, const TrainState& loaded, bool no_load_rng);

// The schedule a run resumed from `loaded` goes on with (Megatron's OptimizerParamScheduler.load_state_dict,
// ResolveResumedScheduler): `here` (the command line's) where the checkpoint records none (an earlier ptk: a
// warning from `lead` under --use-checkpoint-opt_param-scheduler); the notes from `lead`.
absl::StatusOr<SchedulerConfig> ResumedSchedule(const TrainState& loaded, const SchedulerConfig& here,
                                                SchedulerOnLoad mode, int64_t samples_per_iteration, bool lead);

}  // namespace ptk
