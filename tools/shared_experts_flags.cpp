// ptk-train's shared-experts flags (Megatron's --moe-shared-expert-*): declared and resolved into GPTConfig; called
// from moe_flags.cpp's AddMoeFlags and ResolveMoeFlags.
#include <string>
#include <vector>

#include <fmt/core.h>

#include "common/status.h"
#include "tools/train_flag_parts.h"

namespace ptk {

using train_flags::IntIn;
using train_flags::kMaxSize;

void AddSharedExpertFlags(CLI::App* app, TrainFlags* f) {
  TrainFlags::Moe& m = f->moe;
  app->add_option("--moe-shared-expert-intermediate-size", m.shared_expert_size,
                  "Shared experts' total ffn width: in each MoE layer a dense MLP of this width (the experts' "
                  "activation, no biases) on every token, its output added to the routed experts' (default none)")
      ->check(IntIn(1, kMaxSize));
  app->add_flag("--moe-shared-expert-gate", m.shared_expert_gate,
                "The shared experts' output scaled per token by sigmoid(x . gate_weight), gate_weight of shape [1, "
                "hidden]");
  app->add_flag("--moe-shared-expert-overlap", m.shared_expert_overlap,
                "Accepted with --moe-token-dispatcher-type alltoall (as Megatron): it overlaps communication only, "
                "the same math");
}

absl::Status ResolveSharedExpertFlags(const TrainFlags& f, GPTConfig* model, std::vector<std::string>* notes) {
  const TrainFlags::Moe& m = f.moe;
  if (!m.shared_expert_size) {
    for (const auto& [flag, on] : {std::pair{"--moe-shared-expert-gate", m.shared_expert_gate},
                                   {"--moe-shared-expert-overlap", m.shared_expert_overlap}})
      if (on)
        notes->push_back(
            fmt::format("{}: accepted, no effect without --moe-shared-expert-intermediate-size (as Megatron)", flag));
    return absl::OkStatus();
  }
  if (m.shared_expert_overlap && m.dispatcher != "alltoall")
    return UsageError(fmt::format(
        "--moe-shared-expert-overlap with --moe-token-dispatcher-type {}: Megatron's overlap works only with the "
        "alltoall dispatcher (give --moe-token-dispatcher-type alltoall)",
        m.dispatcher.empty() ? "allgather (the default)" : m.dispatcher));
  if (m.shared_expert_overlap)
    notes->push_back(
        "--moe-shared-expert-overlap: accepted, it overlaps the shared experts with the dispatch's communication "
        "(same math; ptk computes them one after the other)");
  model->moe_shared_expert_intermediate_size = *m.shared_expert_size;
  model->moe_shared_expert_gate = m.shared_expert_gate;
  return absl::OkStatus();
}

}  // namespace ptk
