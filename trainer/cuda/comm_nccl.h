// Data-parallel collectives between GPUs through NCCL, one process per GPU: the ranks meet at
// MASTER_ADDR:MASTER_PORT through the rendezvous store gloo uses (trainer/rendezvous.h), where rank 0
// publishes NCCL's unique id; each rank's device is its local rank (CUDA_VISIBLE_DEVICES applies).
// Device-memory collectives run on the caller's stream; the host-memory ones stage through a device
// buffer on the communicator's own stream. A watchdog thread checks NCCL's asynchronous errors and
// the age of every collective in flight: past --distributed-timeout-minutes, or on an error, it
// aborts the communicator (ncclCommAbort), and every later call fails with a message naming this
// rank and host and what the store knows of the others (the rank that exited, or the one that
// hangs). It aborts too once another rank's own failure, reported through the store
// (ReportRankFailure), is heard: the world's communicator polls the store for it every second
// (ReportedFailureWatch), and every call then fails naming that rank and its reason.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "trainer/comm.h"

namespace ptk::cuda {

struct NcclOptions {
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
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // rendezvous, initialisation, each collective
  // Called once, on the watchdog thread, when the communicator was aborted and the training thread
  // has not come back from the device within `stuck_grace` (a kernel that the abort did not end):
  // the caller decides what to do (ptk-train's main prints the error and exits 1). The library never
  // ends the process itself.
  std::function<void(const absl::Status&)> on_stuck;
  std::chrono::milliseconds stuck_grace{std::chrono::seconds(60)};
};

absl::StatusOr<std::unique_ptr<Communicator>> MakeNcclCommunicator(const NcclOptions& options);

}  // namespace ptk::cuda
