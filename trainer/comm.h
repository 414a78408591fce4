// The collective operations data-parallel training needs, behind one interface: a single-process
// communicator, gloo over TCP for CPU ranks, and (with the CUDA backend) NCCL.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace ptk::trainer {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In-place sums over all ranks; every rank ends with the same bits.
  virtual absl::Status AllReduceSum(float* data, int64_t n) = 0;
  virtual absl::Status AllReduceSum(double* data, int64_t n) = 0;
  // Rank `root`'s bytes to every rank.
  virtual absl::Status Broadcast(void* data, int64_t bytes, int root) = 0;
  virtual absl::Status Barrier() = 0;
};

// One process: every collective is the identity.
std::unique_ptr<Communicator> MakeLocalCommunicator();

}  // namespace ptk::trainer
