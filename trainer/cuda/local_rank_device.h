// The GPU a rank takes, chosen as torchrun and Megatron choose it: the device numbered by its local
// rank among those the process sees (Megatron: torch.cuda.set_device(args.local_rank), its local rank
// from LOCAL_RANK; the CUDA runtime numbers the devices CUDA_VISIBLE_DEVICES leaves from 0). No
// modulo: ranks folded onto fewer GPUs would share one without a word. A local rank without a device
// is refused in one line that names CUDA_VISIBLE_DEVICES, where the CUDA runtime would fail with
// "invalid device ordinal". Pure host code: checked without a GPU (local_rank_device_test).
#pragma once

#include <string>
#include <string_view>

#include <absl/status/statusor.h>
#include <fmt/core.h>

#include "common/status.h"

namespace ptk::cuda {

// `who`: what asks ("--device cuda", "--distributed-backend nccl"); `visible`: the devices the CUDA
// runtime counts; `cuda_visible_devices`: the variable's value (nullptr where it is unset).
inline absl::StatusOr<int> LocalRankDevice(std::string_view who, int local_rank, int visible,
                                           const char* cuda_visible_devices) {
  const std::string mask = cuda_visible_devices ? fmt::format("CUDA_VISIBLE_DEVICES={}", cuda_visible_devices)
                                                : "CUDA_VISIBLE_DEVICES unset";
  if (visible <= 0)
    return absl::FailedPreconditionError(
        fmt::format("{}: no CUDA device is visible (no GPU, no driver, or CUDA_VISIBLE_DEVICES hides them all; {}); "
                    "train with --device cpu{}, or run on a GPU node",
                    who, mask, who == "--device cuda" ? "" : " (gloo)"));
  if (local_rank < 0 || local_rank >= visible)
    return UsageError(fmt::format(
        "{}: local rank {} has no GPU: {} device(s) visible to this process ({}); each rank takes the GPU of its "
        "local rank (LOCAL_RANK, or SLURM_LOCALID under srun) among the visible ones, as torchrun and Megatron do: "
        "start at most one process per visible GPU (srun --ntasks-per-node at most --gpus-per-node, without "
        "--gpus-per-task or a --gpu-bind that leaves each task fewer GPUs than the node's ranks)",
        who, local_rank, visible, mask));
  return local_rank;
}

}  // namespace ptk::cuda
