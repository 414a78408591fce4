// ptk-train's multi-token prediction flags (Megatron's --mtp-num-layers, --mtp-loss-scaling-factor,
// --mtp-standalone): declared, resolved into GPTConfig (trainer/cpu/mtp_cpu.cpp runs them), and what ptk's
// multi-token prediction does not run with refused in one line each.
#include <string>
#include <vector>

#include <fmt/core.h>

#include "common/status.h"
#include "tools/train_flag_parts.h"

namespace ptk {

using train_flags::IntIn;

void AddMtpFlags(CLI::App* app, TrainFlags* f) {
  TrainFlags::Mtp& m = f->mtp;
  app->add_option("--mtp-num-layers", m.num_layers,
                  "Multi-token prediction (DeepSeek-V3, megatron-core's MultiTokenPredictionBlock): this many depths "
                  "after the decoder, depth k predicting the token k + 1 further, its layer the decoder's last "
                  "layer's kind (MoE, MLA); logged as mtp_K loss (default none; CPU only)")
      ->check(IntIn(0, 64));
  app->add_option("--mtp-loss-scaling-factor", m.loss_scaling_factor,
                  "Multi-token prediction: the weight of the depths' mean loss in the gradient (default 0.1)")
      ->check(cli::RealIn(0, true, 1e6, true));
  app->add_flag("--mtp-standalone", m.standalone,
                "Megatron's multi-token prediction on a pipeline stage of its own: refused (ptk runs one stage)");
}

absl::Status ResolveMtpFlags(const TrainFlags& f, GPTConfig* model, std::vector<std::string>* notes) {
  const TrainFlags::Mtp& m = f.mtp;
  if (m.standalone)
    return UsageError(
        "--mtp-standalone: multi-token prediction on a pipeline stage of its own is not implemented (ptk runs "
        "multi-token prediction without pipeline parallelism)");
  if (m.num_layers.value_or(0) == 0) {
    if (m.loss_scaling_factor != TrainFlags::Mtp{}.loss_scaling_factor)
      notes->push_back("--mtp-loss-scaling-factor: accepted, no effect without --mtp-num-layers (as Megatron)");
    return absl::OkStatus();
  }
  model->mtp_num_layers = *m.num_layers;
  model->mtp_loss_scaling_factor = m.loss_scaling_factor;
  return absl::OkStatus();
}

absl::Status RefuseMtpCombinations(const TrainFlags& f, Device device) {
  if (f.mtp.num_layers.value_or(0) == 0) return absl::OkStatus();
  auto refuse = [](const std::string& what) {
    return UsageError(fmt::format(
        "--mtp-num-layers with {}: ptk's multi-token prediction runs on the CPU with data parallelism only for now",
        what));
  };
  if (f.tensor_model_parallel_size > 1)
    return refuse(fmt::format("--tensor-model-parallel-size {}", f.tensor_model_parallel_size));
  if (f.pipeline_model_parallel_size > 1)
    return refuse(fmt::format("--pipeline-model-parallel-size {}", f.pipeline_model_parallel_size));
  if (f.context_parallel_size > 1) return refuse(fmt::format("--context-parallel-size {}", f.context_parallel_size));
  // --num-experts and --multi-latent-attention run: a depth's layer is the decoder's last layer's kind.
  if (f.moe.expert_parallel > 1) return refuse(fmt::format("--expert-model-parallel-size {}", f.moe.expert_parallel));
  if (f.options.optimizer.overlap_grad_reduce) return refuse("--overlap-grad-reduce");
  if (device != Device::kCpu) return refuse("--device cuda (or --bf16 / --fp16: the CUDA backend's)");
  return absl::OkStatus();
}

}  // namespace ptk
