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

}  // namespace ptk
