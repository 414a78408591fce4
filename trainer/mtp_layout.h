// GPTConfig's multi-token prediction checks, which GPTConfig::Validate runs (mtp_num_layers at least 0, the loss
// scaling factor finite and at least 0, neither experts nor multi-latent attention with depths).
#pragma once

#include "absl/status/status.h"
#include "trainer/param_layout.h"

namespace ptk {

absl::Status ValidateMtpConfig(const GPTConfig& c);

}  // namespace ptk
