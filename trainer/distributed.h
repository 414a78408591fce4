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
  // MASTER_PORT under torchrun (TrainingRanks::torchrun_store_port), master_port being beside it; 0 otherwise:
  // how messages name the port (RendezvousPortWords).
  int torchrun_store_port = 0;
  // The launch's identity, the same on every rank (TrainingRanks::run_id): rank 0's store refuses a
  // rank of another (RendezvousStore::Connect).
  std::string run_id;
  // What every rank must share, "flag\tvalue" lines (AgreedSettingsText): without run ids, rank 0's
  // store refuses a rank whose settings differ (RendezvousStore::Connect). Empty: not compared.
  std::string settings;
  std::string gloo_iface;  // GLOO_SOCKET_IFNAME
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // NCCL: called from its watchdog when an aborted collective does not let the process end
  // (NcclOptions::on_stuck); ptk-train's main exits there.
  std::function<void(const absl::Status&)> on_stuck;
};

// Whether this build can make the backend ("nccl" needs the CUDA backend's build).
bool DistributedBackendBuilt(const std::string& backend);

absl::StatusOr<std::unique_ptr<Communicator>> CreateCommunicator(const DistributedOptions& options);

// This rank stops on `failure`, its own (a check, a file, its datasets, a checkpoint, the memory,
// anything after the ranks met that is not a peer's failure reaching it, which then is not
// reported): tells the other ranks of `world` (CreateCommunicator's), so that their collectives
// and rendezvous waits, in whatever phase they are, end at once naming this rank and `failure`
// (RendezvousStore::ReportFailure) instead of a bare "connection closed" or, where nothing would
// close, the timeout. The caller then closes its communicators (the others' collectives with it
// fail now) and calls what this returns, if anything (gloo's rank 0: its rendezvous serves the
// others until they heard, a bounded time; NCCL's rank 0 too). Never fails. One process: nothing.
// NCCL's ranks hear it through the store (ReportedFailureWatch), their watchdogs aborting their
// communicators (ncclCommAbort) with it, instead of waiting for the timeout.
std::function<void()> ReportRankFailure(Communicator* world, const absl::Status& failure);

}  // namespace ptk
