// GPTConfig's multi-token prediction checks, which GPTConfig::Validate runs (mtp_num_layers at least 0, the loss
// scaling factor finite and at least 0). A depth's transformer layer is the decoder's last layer's kind
// (megatron-core's get_gpt_mtp_block_spec): a mixture-of-experts layer when that one is, multi-latent attention with
// the model's.
#pragma once

#include "absl/status/status.h"
#include "trainer/param_layout.h"

namespace ptk {

absl::Status ValidateMtpConfig(const GPTConfig& c);
// The model parallelism multi-token prediction runs with: tensor ranks (eh_proj column-parallel, its rows split;
// hidden_size a multiple of them) and pipeline stages (the depths on the last, megatron-core's default placement;
// with the interleaved schedule's model chunks after the last stage's last chunk), not learned absolute positions
// over stages (`virtual_size` any).
absl::Status ValidateMtpParallelism(const GPTConfig& c, int tensor_size, int pipeline_size, int virtual_size);

}  // namespace ptk
