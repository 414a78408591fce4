// Page-locked host memory for the CUDA model's transfers (the micro-batch inputs in, the losses out):
// a buffer that grows on demand and is freed with its owner.
#pragma once

#include <cuda_runtime.h>
#include <fmt/core.h>

#include <cstddef>

#include "absl/status/status.h"
#include "trainer/cuda/cuda_common.h"
#include "trainer/cuda/memory_plan.h"  // FormatBytes

namespace ptk::cuda::model_detail {

// Page-locked host memory: the micro-batch inputs and the losses travel through it, so the copies
// are asynchronous and run at full PCIe speed.
class Pinned {
 public:
  Pinned() = default;
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
  ~Pinned() {
    if (p_) cudaFreeHost(p_);
  }
  absl::Status Reserve(size_t bytes) {
    if (bytes <= bytes_) return absl::OkStatus();
    if (p_) cudaFreeHost(p_);
    p_ = nullptr;
    bytes_ = 0;
    PTK_CUDA_RETURN_IF_ERROR(cudaMallocHost(&p_, bytes), fmt::format("pinned host buffer of {}", FormatBytes(bytes)));
    bytes_ = bytes;
    return absl::OkStatus();
  }
  template <typename U>
  U* at(size_t offset) {
    return reinterpret_cast<U*>(static_cast<char*>(p_) + offset);
  }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace ptk::cuda::model_detail
