// Data-parallel collectives between CPU ranks through gloo (Debian's libgloo-dev), over TCP. The
// ranks meet at MASTER_ADDR:MASTER_PORT, where rank 0 serves a small key-value store for gloo's
// rendezvous: nothing from an earlier run can be read there (a requeued job reuses its job id, so
// a file-based rendezvous could find stale addresses). A rank that dies closes its sockets; the
// others' collectives fail at once, even one in the middle of a message to or from it (a peer watch
// wakes the waits gloo forgets: gloo_peer_watch.h); a rank that hangs fails them at the collective
// timeout.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "trainer/comm.h"

namespace ptk {

struct GlooOptions {
  int rank = 0, world_size = 1;
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
  std::string iface;  // network interface for the gloo transport (GLOO_SOCKET_IFNAME); empty: by hostname
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // rendezvous and each collective
};

absl::StatusOr<std::unique_ptr<Communicator>> MakeGlooCommunicator(const GlooOptions& options);

// ReportRankFailure's gloo half (distributed.h): through `world`'s rendezvous store; rank 0 returns
// its serving of the store until the others heard. Anything but a gloo communicator: nothing.
std::function<void()> ReportGlooFailure(Communicator* world, const absl::Status& failure);

// Called by every step of a gloo collective once its messages are posted, before it waits for them
// (a test's moment to kill a peer); empty: none. Set while no collective runs.
void SetGlooWaitHookForTesting(std::function<void()> hook);

}  // namespace ptk
