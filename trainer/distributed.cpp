// Choosing and creating the data-parallel communicator.
#include "trainer/distributed.h"

#include <algorithm>
#include <chrono>

#include <fmt/core.h>

#include "common/status.h"
#include "trainer/backend.h"
#include "trainer/comm_gloo.h"
#include "trainer/cuda/backend_module.h"
#include "trainer/rendezvous.h"

namespace ptk {

bool DistributedBackendBuilt(const std::string& backend) {
  return backend == "gloo" || (backend == "nccl" && CudaBuilt());
}

absl::StatusOr<std::unique_ptr<Communicator>> CreateCommunicator(const DistributedOptions& o) {
  if (o.backend != "gloo" && o.backend != "nccl")
    return UsageError(fmt::format("--distributed-backend {}: ptk has gloo and nccl", o.backend));
  if (!DistributedBackendBuilt(o.backend))
    return UsageError("--distributed-backend nccl: this ptk-train was built without CUDA (and NCCL); use gloo");
  // One process: no communication, unless NCCL was asked for by name (as Megatron, which always
  // starts its process group); then its rendezvous takes any free port, nobody else comes.
  if (o.world_size == 1 && !(o.backend_given && o.backend == "nccl")) return MakeLocalCommunicator();
  if (o.backend == "nccl") {
    // NCCL lives in the CUDA backend's module: loaded here, and only here on this path.
    auto cuda = LoadCudaBackend();
    if (!cuda.ok())
      return absl::FailedPreconditionError(fmt::format("--distributed-backend nccl: {}", StatusMessage(cuda.status())));
    cuda::NcclOptions n;
    n.rank = o.rank;
    n.world_size = o.world_size;
    n.local_rank = o.local_rank;
    n.master_addr = o.master_addr;
    n.master_port = o.world_size == 1 ? 0 : o.master_port;
    n.torchrun_store_port = o.torchrun_store_port;
    n.run_id = o.run_id;
    n.settings = o.settings;
    n.timeout = o.timeout;
    n.on_stuck = o.on_stuck;
    return (*cuda)->CreateNcclCommunicator(n);
  }
  GlooOptions g;
  g.rank = o.rank;
  g.world_size = o.world_size;
  g.master_addr = o.master_addr;
  g.master_port = o.master_port;
  g.torchrun_store_port = o.torchrun_store_port;
  g.run_id = o.run_id;
  g.settings = o.settings;
  g.iface = o.gloo_iface;
  g.timeout = o.timeout;
  return MakeGlooCommunicator(g);
}

std::function<void()> ReportRankFailure(Communicator* world, const absl::Status& failure) {
  if (world != nullptr && world->backend() == "gloo") return ReportGlooFailure(world, failure);
  // NCCL: the others' watchdogs hear it through the store (ReportedFailureWatch) and abort their communicators.
  std::shared_ptr<RendezvousStore> store = world != nullptr ? world->failure_store() : nullptr;
  if (!store || !store->ReportFailure(failure) || store->rank() != 0) return {};
  // Rank 0 serves the rendezvous until the others heard, at most min(timeout, 30 s), as gloo's.
  const auto at_most = std::min<std::chrono::milliseconds>(store->timeout(), std::chrono::seconds(30));
  return [store, at_most] { store->ServeUntilAllHeard(at_most); };
}

}  // namespace ptk
