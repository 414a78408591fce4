// GPTConfig's multi-token prediction checks (mtp_layout.h; the layout's mtp.layers.K tensors are
// ParamLayout::Create's).
#include <cmath>
#include <string>

#include <fmt/core.h>

#include "trainer/mtp_layout.h"

namespace ptk {

absl::Status ValidateMtpConfig(const GPTConfig& c) {
  auto bad = [](const std::string& m) { return absl::InvalidArgumentError(m); };
  if (c.mtp_num_layers < 0) return bad(fmt::format("mtp_num_layers {}: must be at least 0", c.mtp_num_layers));
  if (c.mtp_num_layers == 0) return absl::OkStatus();
  if (!(c.mtp_loss_scaling_factor >= 0 && std::isfinite(c.mtp_loss_scaling_factor)))
    return bad(fmt::format("mtp_loss_scaling_factor {}: must be at least 0", c.mtp_loss_scaling_factor));
  return absl::OkStatus();
}

absl::Status ValidateMtpParallelism(const GPTConfig& c, int tensor_size, int pipeline_size, int virtual_size) {
  if (c.mtp_num_layers == 0) return absl::OkStatus();
  auto bad = [](const std::string& m) { return absl::InvalidArgumentError(m); };
  if (pipeline_size > 1 && c.position_embedding == PositionEmbedding::kLearnedAbsolute)
    return bad(
        "mtp_num_layers over pipeline stages with learned absolute position embeddings: Megatron's last stage then "
        "keeps position embeddings of its own for the depths (neither initialised nor reduced with the first "
        "stage's); use --position-embedding-type rope or none");
  if (c.hidden_size % tensor_size != 0)
    return bad(
        fmt::format("mtp_num_layers: --hidden-size {} must be a multiple of --tensor-model-parallel-size {} "
                    "(eh_proj is column-parallel)",
                    c.hidden_size, tensor_size));
  return absl::OkStatus();
}

}  // namespace ptk
