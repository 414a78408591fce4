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
                "Megatron's multi-token prediction on a pipeline stage of its own: refused (ptk runs the depths on "
                "the last stage)");
}

absl::Status ResolveMtpFlags(const TrainFlags& f, GPTConfig* model, std::vector<std::string>* notes) {
  const TrainFlags::Mtp& m = f.mtp;
  if (m.standalone)
    return UsageError(
        "--mtp-standalone: multi-token prediction on a pipeline stage of its own is not implemented (ptk runs the "
        "depths on the last pipeline stage)");
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
  auto refuse = [](const std::string& what, const std::string& why) {
    return UsageError(fmt::format("--mtp-num-layers with {}: {}", what, why));
  };
  // Tensor parallelism (eh_proj column-parallel, the depth's layer a tensor-parallel layer; with sequence
  // parallelism the depths' positions split over the tensor ranks as the decoder's) and pipeline parallelism (the
  // depths on the last stage beside a copy of the word embeddings; with the interleaved schedule after its last model
  // chunk) run, and so does --overlap-grad-reduce (the depths' tensors in the decoder's first bucket).
  if (f.pipeline_model_parallel_size > 1 && f.position_embedding_type == "learned_absolute")
    return refuse(fmt::format("--pipeline-model-parallel-size {} and learned absolute position embeddings",
                              f.pipeline_model_parallel_size),
                  "Megatron's last stage then gives the depths position embeddings of their own, neither initialised "
                  "nor reduced with the first stage's; use --position-embedding-type rope or none");
  if (f.context_parallel_size > 1)
    return refuse(fmt::format("--context-parallel-size {}", f.context_parallel_size),
                  "ptk does not yet roll the depths' tokens across context ranks (megatron-core's roll_tensor "
                  "exchange)");
  // --num-experts and --multi-latent-attention run: a depth's layer is the decoder's last layer's kind; with
  // --expert-model-parallel-size its MoE layer holds this rank's experts and exchanges tokens as the decoder's.
  if (device != Device::kCpu)
    return refuse("--device cuda (or --bf16 / --fp16: the CUDA backend's)",
                  "ptk's multi-token prediction runs on the CPU without it for now");
  return absl::OkStatus();
}

}  // namespace ptk
