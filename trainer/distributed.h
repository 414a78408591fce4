// The data-parallel communicator of a run: --distributed-backend gloo (CPU ranks; GPUs through host
// memory) or nccl (one process per GPU, the CUDA backend's builds), from the ranks a launcher gave
// (common/slurm_env.h). One process with no backend asked for is the local communicator.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "trainer/comm.h"

namespace ptk {

struct DistributedOptions {
  std::string backend = "gloo";  // "gloo" or "nccl"
  bool backend_given = false;    // --distributed-backend on the command line (one process then uses nccl too)
  int rank = 0, world_size = 1, local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string gloo_iface;  // GLOO_SOCKET_IFNAME
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // NCCL: called from its watchdog when an aborted collective does not let the process end
  // (NcclOptions::on_stuck); ptk-train's main exits there.
  std::function<void(const absl::Status&)> on_stuck;
};

// Whether this build can make the backend ("nccl" needs the CUDA backend's build).
bool DistributedBackendBuilt(const std::string& backend);

absl::StatusOr<std::unique_ptr<Communicator>> CreateCommunicator(const DistributedOptions& options);

}  // namespace ptk
