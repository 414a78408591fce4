// Multi-token prediction in Megatron's `torch` checkpoints (megatron-core 0.16.1's MultiTokenPredictionBlock, built
// when args.mtp_num_layers is set): the args that describe it, written and read, what the export does not write, and
// ptk-train's settings and flags for it. The tensors' names (mtp.layers.K.enorm, hnorm, eh_proj, transformer_layer.*,
// final_layernorm) and splits are MegParams' (interop/megatron_common.cpp).
#include <string>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "common/status.h"
#include "interop/megatron_common.h"

namespace ptk::megatron {

void SetMtpArgs(const GPTConfig& c, PyValue* a) {
  // Megatron-LM's --mtp-num-layers (None: no MTP block) and --mtp-loss-scaling-factor (0.1).
  torchfmt::DictSet(a, "mtp_num_layers",
                    c.mtp_num_layers > 0 ? torchfmt::MakeInt(c.mtp_num_layers) : torchfmt::MakeNone());
  torchfmt::DictSet(a, "mtp_loss_scaling_factor", torchfmt::MakeFloat(c.mtp_loss_scaling_factor));
}

absl::Status ReadMtpArgs(const PyValue* args, GPTConfig* c) {
  const auto n = NumAttr(args, "mtp_num_layers");
  if (!n || *n <= 0) return absl::OkStatus();
  c->mtp_num_layers = static_cast<int64_t>(*n);
  c->mtp_loss_scaling_factor = NumAttr(args, "mtp_loss_scaling_factor").value_or(0.1);
  return absl::OkStatus();
}

absl::Status CheckMtpExport(const ConvertOptions& o, const GPTConfig& c, const std::string& file) {
  if (c.mtp_num_layers <= 0) return absl::OkStatus();
  if (o.target_use_distributed_optimizer)
    return absl::FailedPreconditionError(
        fmt::format("{}: a multi-token prediction model (--mtp-num-layers {}) with --target-use-distributed-optimizer: "
                    "not written for MTP yet (leave the flag out: the plain optimizer's state is)",
                    file, c.mtp_num_layers));
  return absl::OkStatus();
}

void AddMtpSettings(const GPTConfig& c, std::vector<std::pair<std::string, std::string>>* settings) {
  if (c.mtp_num_layers <= 0) return;  // as ptk-train records them (trainer/run_settings.cpp), so a resume compares
  settings->emplace_back("--mtp-num-layers", std::to_string(c.mtp_num_layers));
  settings->emplace_back("--mtp-loss-scaling-factor", fmt::format("{}", c.mtp_loss_scaling_factor));
}

std::string MtpTrainFlags(const GPTConfig& c) {
  if (c.mtp_num_layers <= 0) return "";
  return fmt::format(" --mtp-num-layers {} --mtp-loss-scaling-factor {}", c.mtp_num_layers, c.mtp_loss_scaling_factor);
}

}  // namespace ptk::megatron
