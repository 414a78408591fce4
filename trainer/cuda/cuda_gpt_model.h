// The CUDA backend of GPTModel: the model of trainer/cpu/cpu_gpt_model.cpp on one GPU, fp32 (compared
// tightly with the CPU), bf16 or fp16 (fp32 master weights, gradients, moments, LayerNorm statistics,
// softmax and loss). Device memory is planned once (memory_plan.h); the step and checkpoints see host
// copies only.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "trainer/gpt_model.h"

namespace ptk::cuda {

// Visible CUDA devices; 0 without a driver or a device.
int VisibleDeviceCount();

// The model on device `device_index` (CUDA_VISIBLE_DEVICES applies). micro_batch_size plans the
// activations for (micro_batch_size, seq_length); a larger batch later re-plans. profile times every
// op with CUDA events (ProfileReport).
absl::StatusOr<std::unique_ptr<GPTModel>> CreateCudaGPTModel(const GPTConfig& config, Precision precision,
                                                             int device_index, bool deterministic,
                                                             int64_t micro_batch_size, bool profile = false);

}  // namespace ptk::cuda
