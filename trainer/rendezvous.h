// Where data-parallel ranks meet: rank 0 serves a small key-value store over TCP at
// MASTER_ADDR:MASTER_PORT (gloo's addresses, NCCL's unique id go through it), and every rank keeps
// its connection to it for the whole run. Nothing from an earlier run can be read there (a requeued
// job reuses its job id, so a file-based rendezvous could find stale addresses). The store also
// tells a rank whose collective failed what became of the others: a rank whose connection closed
// has exited (killed, crashed); a rank that neither exited nor reported its own failure hangs. No
// rank of another job (another WORLD_SIZE or run id on the same MASTER_ADDR:MASTER_PORT; without run
// ids, other settings) ever joins: it is refused at once, naming both jobs (rendezvous_server.h has
// rank 0's side).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"

namespace ptk {

class RendezvousServer;

class RendezvousStore {
 public:
  ~RendezvousStore();
  RendezvousStore(const RendezvousStore&) = delete;
  RendezvousStore& operator=(const RendezvousStore&) = delete;

  // Rank 0 starts the server on `port` (all interfaces; 0: any free port, for a rank alone) and
  // connects to it; the others connect to master_addr:port, retrying until `timeout`. Each rank
  // registers its rank, host name and pid, with its job's WORLD_SIZE and `run_id` (the launch's
  // identity, the same on every rank: TrainingRanks::run_id). Refused at once (kFailedPrecondition,
  // one line naming the address and both jobs, nothing joined): a rank whose WORLD_SIZE or run id is
  // not rank 0's (another job on this MASTER_PORT); a rank whose number is connected now (another job
  // launched alike, or a rank started twice); a listener that is not ptk's rendezvous (its answer, or
  // none within 30 s or the timeout, or closing three times); a rank 0 whose port another process holds (named: a
  // ptk rank 0 and its job, or not ptk). A store that a rank of this number joined and left refuses
  // it too (a restarted rank finding a rank 0 still in the job's earlier start): it retries until a
  // fresh rank 0 serves, or the timeout. Every message names the port as RendezvousPortWords does
  // (`torchrun_store_port`: TrainingRanks's, MASTER_PORT under torchrun, `port` being beside it; 0 otherwise).
  // `settings`: what every rank of the job must share, one "flag\tvalue" line each (ptk-train's
  // AgreedSettingsText); empty: none compared. Where neither this rank nor rank 0 has a run id (ranks
  // started by hand), a rank whose settings are not rank 0's is refused at once too (another job
  // started alike at the same moment, or a rank of this one started with other flags), its line
  // naming the first setting that differs with both values, and rank 0 warns and waits on for its own
  // rank; with a run id the ranks are one launch, and meet (ptk-train's CheckRanksAgree stops them all).
  static absl::StatusOr<std::unique_ptr<RendezvousStore>> Connect(
      int rank, int world_size, const std::string& master_addr, int port, std::chrono::milliseconds timeout,
      const std::string& run_id = "", int torchrun_store_port = 0, const std::string& settings = "");

  // For a rank about to exit with `failure` found before the ranks met (its own flag checks): tells
  // the others through rank 0's store, so that every rank's rendezvous (each get, waiting or to
  // come) ends at once with "rank N (host H) stopped before the ranks met: <failure>" (a usage
  // error when `failure` is one) instead of waiting for the timeout. Rank 0 then serves its store
  // until every rank has come and gone. Each waits at most a minute (or `timeout`); never fails.
  static void ReportEarlyFailure(int rank, int world_size, const std::string& master_addr, int port,
                                 std::chrono::milliseconds timeout, const absl::Status& failure,
                                 const std::string& run_id = "");

  // Rank 0 after another rank's early failure reached it, or after its own ReportFailure: serves the
  // store until every rank has registered and gone (they hear the failure there), at most
  // `at_most`. Others: nothing.
  void ServeUntilAllHeard(std::chrono::milliseconds at_most);

  // After the ranks met, for a rank about to stop on `failure`, its own (a check, a file, the
  // memory, a checkpoint: not a peer's, which this rank heard or diagnosed, and then nothing is
  // reported): tells the others through rank 0's store, which answers every get, waiting or to
  // come, with "rank N (host H) stopped: <failure>" and gives it to every rank whose collective then
  // fails (DiagnosePeers), so that the others end at once naming this rank and why, whatever phase
  // they are in. The first rank's report is the one they hear. Returns whether it was reported
  // (rank 0 then serves its store until the others heard: ServeUntilAllHeard, once its
  // communicators are closed). Never fails.
  bool ReportFailure(const absl::Status& failure);
  // What a peer reported (ReportFailure, ReportEarlyFailure) once this rank heard it (a get answered
  // with it, or DiagnosePeers), with `context` before it: a usage error when the peer's was one,
  // else kAborted. OK while none was heard.
  absl::Status HeardFailure(const std::string& context);
  // Without waiting (one request rank 0 answers at once): whether a rank reported its own failure
  // (ReportFailure) to rank 0's store; from then on it is HeardFailure's. For ranks whose
  // collectives would otherwise wait for their timeout (NCCL's: ReportedFailureWatch). False when
  // none was, or rank 0 does not answer; never fails.
  bool PollReportedFailure();
  // A rank whose run ended well (ptk-train's main, before its communicators close) says so to rank 0's
  // store, so that its leaving is not taken for a death (PollExitedRank). Never fails.
  void MarkFinished();
  // Without waiting (one request): "rank N (host H) exited (its connection to the rendezvous closed:
  // killed, crashed or stopped early)" for a rank whose connection to rank 0's store closed while it
  // had neither finished (MarkFinished) nor reported a failure ("rank N (host H) was disconnected by
  // the rendezvous store: it stopped reading its answers (stopped or hung)" for one rank 0's store
  // dropped, its unsent answers past kMaxUnsentReplies); "rank 0 (which serves the rendezvous)
  // exited (...)" when this rank's own connection to it closed; "" when none did, or rank 0 does not
  // answer in time. For a rank busy with its own work (LocalPhaseWatch). Never fails.
  std::string PollExitedRank();

  absl::Status Set(const std::string& key, const std::string& value);
  // Waits up to the timeout for the key. A key that never comes while ranks never joined the store
  // names them all ("ranks 2, 3 did not join within T s"); else a key that is a rank number (gloo's
  // full-mesh rendezvous waits for each rank's address under it) is "rank N did not join within T s".
  absl::StatusOr<std::string> Get(const std::string& key);

  // After a collective failed on this rank: records that, gives the others a few seconds to report
  // theirs, and says what rank 0's store knows: a rank's own failure that it reported
  // (ReportFailure: "rank 1 (host node-b) stopped: <why>", also HeardFailure's from then on), else
  // "rank 1 (host node-b) exited", "rank 1 (host node-b) was disconnected by the rendezvous store: it
  // stopped reading its answers", "rank 2 (host node-c) did not report a failure: it hangs or is cut
  // off", or that rank 0 itself does not answer. Never fails; the text is for the error message.
  std::string DiagnosePeers(const std::string& what_failed);

  // Rank 0: the other ranks still connected to its store that its diagnosis (DiagnosePeers) did not judge silent
  // (hung or cut off: they will not come to ask what happened). A diagnosis that found a rank gone judges none
  // silent: the ranks still alive beside it have yet to meet that death, and come to ask who went first. Its
  // destructor, after a diagnosis, serves the store while there are any, a few seconds at most (a clean run,
  // never diagnosed, ends at once). Others: 0.
  int PeersToServe() const;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const std::string& host() const { return host_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

 private:
  RendezvousStore() = default;
  // `ack_out`: the one-byte answer to a request without a reply ('k'; 'r' for a refused hello).
  absl::Status Request(char op, const std::string& key, const std::string* value, std::string* reply,
                       char* ack_out = nullptr);

  // Connect's hello on fd_: OK once joined; kFailedPrecondition to stop (RefusedByRankZero's, or not
  // ptk); else kUnavailable to retry (*last: why; *closed counts connections closed unanswered).
  absl::Status Hello(const std::string& addr, int port, std::string* last, int* closed);
  // The line for a hello refused with `ack` (another job's rank, a rank connected already, other
  // settings): who serves `where` (its Info) and this rank's job.
  absl::Status RefusedByRankZero(const std::string& where, int port, char ack);

  // The ranks that never registered with rank 0's store (its peer list), ascending; empty when it
  // does not answer. *refused: the hellos of those ranks it refused for their settings, in words
  // (RefusedLines).
  std::vector<int> NeverJoined(std::vector<std::string>* refused);

  std::unique_ptr<RendezvousServer> server_;  // rank 0
  int fd_ = -1;
  int rank_ = 0, world_size_ = 1;
  std::string host_, run_id_;
  std::string settings_;         // Connect's: sent in the hello
  int torchrun_store_port_ = 0;  // Connect's: how messages name the port (RendezvousPortWords)
  std::chrono::milliseconds timeout_{0};
  std::mutex mu_;                       // one request at a time on the connection (held through the round trip)
  std::atomic<bool> diagnosed_{false};  // DiagnosePeers ran (on a watchdog's thread, perhaps)
  mutable std::mutex silent_mu_;
  std::vector<int> silent_;  // the ranks DiagnosePeers judged silent (hung), under silent_mu_
  // A peer's reported failure ("u\t" or "f\t", then its text), once heard. Its own mutex, never held
  // across a request: HeardFailure (an NCCL watchdog's check, every 100 ms, under its communicator's
  // lock) must not wait for another thread's request (a poll's round trip, a get that waits for a key).
  mutable std::mutex heard_mu_;
  std::string heard_;  // under heard_mu_
};

// Polls `store` (PollReportedFailure) every `interval` on a thread of its own until a rank's
// reported failure is heard, so that HeardFailure says it while this rank's collectives wait (the
// NCCL communicators' watchdogs read it and abort them: gloo's ranks hear it through their
// connections). The destructor ends the thread.
class ReportedFailureWatch {
 public:
  ReportedFailureWatch(std::shared_ptr<RendezvousStore> store, std::chrono::milliseconds interval);
  ~ReportedFailureWatch();
  ReportedFailureWatch(const ReportedFailureWatch&) = delete;
  ReportedFailureWatch& operator=(const ReportedFailureWatch&) = delete;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

// This machine's host name.
std::string HostName();

// Where a rank's call stood when it failed, for the first words of its error line, alike on gloo
// and NCCL: every rank's line names itself, its group and the call in flight before the cause.
struct FailedCall {
  int rank = 0;        // in the communicator that failed
  std::string group;   // its name ("tensor", "data", "pipeline", "context", "embedding"); empty: the world's
  int world_rank = 0;  // a group's rank in the run
  std::string host;    // HostName()
  int device = -1;     // NCCL's GPU (cuda:N); -1: none
  std::string call;    // the call in flight ("all-reduce", "send to rank 2"); empty: none was
};
// "rank 1 of the tensor group (world rank 3) (host H, cuda:1)"; "rank 3 (host H)" for the world's.
std::string FailedCallWho(const FailedCall& at);
// FailedCallWho's, then ": all-reduce failed: " (": no collective was in flight: " when none was),
// for a cause (HeardFailure's) to follow.
std::string FailedCallPrefix(const FailedCall& at);

}  // namespace ptk
