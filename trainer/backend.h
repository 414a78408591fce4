// Choosing and creating the model's backend: --device cpu|cuda and Megatron's precision flags.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "trainer/gpt_model.h"

namespace ptk {

struct BackendOptions {
  Device device = Device::kCpu;
  Precision precision = Precision::kFp32;
  int device_index = 0;          // the CUDA device (the local rank; CUDA_VISIBLE_DEVICES applies)
  bool deterministic = false;    // --deterministic-mode: only bitwise-reproducible kernels
  int64_t micro_batch_size = 1;  // the CUDA backend plans its activations for it
  bool profile = false;          // --ptk-profile-ops: time every op (CUDA events)
  bool sync_ops = false;         // CUDA: synchronise after every op, name the one that fails (PTK_CUDA_SYNC_OPS=1)
};

// Whether this build has the CUDA backend, and how many CUDA devices are visible (0 without CUDA,
// without a driver or without a device).
bool CudaBuilt();
int CudaDeviceCount();
// ptk-train's default --device: cuda where the build has CUDA and a device is visible, else cpu.
Device DefaultDevice();

// The model on the chosen backend. Never falls back to another backend: --device cuda in a build
// without CUDA, with no device visible, or --bf16 on a GPU before sm_80 is an error that says so.
absl::StatusOr<std::unique_ptr<GPTModel>> CreateModel(const GPTConfig& config, const BackendOptions& backend);

}  // namespace ptk
