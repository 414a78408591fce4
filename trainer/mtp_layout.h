// GPTConfig's multi-token prediction checks, which GPTConfig::Validate runs (mtp_num_layers at least 0, the loss
// scaling factor finite and at least 0). A depth's transformer layer is the decoder's last layer's kind
// (megatron-core's get_gpt_mtp_block_spec): a mixture-of-experts layer when that one is, multi-latent attention with
// the model's.
#pragma once

#include "absl/status/status.h"
#include "trainer/param_layout.h"

namespace ptk {

absl::Status ValidateMtpConfig(const GPTConfig& c);

}  // namespace ptk
