// Rank 0's side of the rendezvous (trainer/rendezvous.h): the TCP key-value store it serves, its
// wire format, and what it answers a rank's hello (a rank of this job, another job's, one already
// connected). Named only by rendezvous.cpp, rendezvous_server.cpp and their tests.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"

namespace ptk {

namespace rendezvous_detail {

// ---- wire: [u8 op][u32 key][key]([u32 value][value]) ; replies [u32 value][value] or one byte.
bool SendAll(int fd, const void* p, size_t n);
bool RecvAll(int fd, void* p, size_t n);
bool SendBlob(int fd, const std::string& s);
bool RecvBlob(int fd, std::string* s);

inline constexpr char kSet = 'S', kGet = 'G', kHello = 'H', kPeers = 'P';
inline constexpr char kAbortQuery = 'A';  // kAbortKey's value, empty while none: a poll (the peer list is larger)
// Who serves this store (RendezvousServer::Info): asked by a rank its hello refused, and by a rank 0
// that found MASTER_PORT taken; any client may ask, before or without a hello.
inline constexpr char kInfo = 'I';
inline constexpr const char* kInfoMagic = "ptk-rendezvous";  // the first field of Info's answer
// The job's settings this store compares (RendezvousServer::Start's `settings`): asked by a rank its
// hello refused for its own (kOtherSettings), to name the first that differs.
inline constexpr char kSettingsQuery = 'C';
inline constexpr const char* kFailedPrefix = "ptk/failed/";
inline constexpr const char* kFinishedPrefix = "ptk/finished/";  // MarkFinished's: a rank that left when its run ended
// Set by a rank that failed before it joined (RendezvousStore::ReportEarlyFailure): "u\t" (a usage
// error) or "f\t", then the message. Every get waiting or to come is answered with it, marked by a
// length of kAbortMarker, so that no rank waits for one that will never join.
inline constexpr const char* kAbortKey = "ptk/abort";
inline constexpr uint32_t kAbortMarker = 0xFFFFFFFFu;
inline constexpr uint32_t kMaxBlob = 64u << 20;  // a key's or value's largest length
// A client's replies not yet taken by its socket beyond which rank 0 drops it: a rank waits for each
// answer before it asks again, so one whose unsent replies pass the largest answer reads none of them.
inline constexpr size_t kMaxUnsentReplies = size_t{kMaxBlob} + (1u << 16);

// A hello's one-byte answers. 'k': joined. 'j': another job's rank (its WORLD_SIZE or run id is not
// this store's): it stops. 'd': a rank of this number is connected now (another job of the same
// WORLD_SIZE and run id, or the rank started twice): it stops. 'r': a rank of this number joined and
// left (a restarted rank finding a rank 0 still in the job's earlier start): it retries. 's': no run
// id on either side and its settings are not rank 0's (another job started by hand, or a rank of
// this one started with other flags): it stops.
inline constexpr char kJoined = 'k', kOtherJob = 'j', kDuplicate = 'd', kRejoin = 'r', kOtherSettings = 's';

// A hello's value: "host\tWORLD_SIZE\trun id\tpid" (tabs and newlines of the run id made spaces),
// then, when `settings` is not empty, "\n" and `settings` (RendezvousStore::Connect's).
std::string HelloValue(const std::string& host, int world_size, const std::string& run_id, int64_t pid,
                       const std::string& settings = "");

// The first of rank 0's settings (`rank0`, "flag\tvalue" lines) that `other` (rank `rank`'s) does not
// share: "--num-layers differs: rank 0 has 12, rank 3 has 24", and how many more differ; "" when none.
std::string SettingsDifference(const std::string& rank0, const std::string& other, int rank);

// A peer's state in the peer list: "alive", "failed" (it reported a failed collective), "finished"
// (MarkFinished), "left" (its connection closed) or kDroppedState (rank 0's store closed it: its
// unsent answers passed kMaxUnsentReplies).
inline constexpr const char* kDroppedState = "dropped";

// One "rank\thost\tstate" line of the peer list (RendezvousServer::Peers).
struct PeerLine {
  int rank = 0;
  std::string host, state;
};
// The peer list's rank lines, in its order (its "!\t" line, kAbortKey's value, and its "?\t" lines left out).
std::vector<PeerLine> PeerLines(const std::string& text);
// The peer list's "?\trank\twords" lines: for each rank number, the last hello refused for its settings
// (RendezvousServer::RefuseSettings), "a rank 1 (host H, pid P) with other settings: --num-layers differs: ...".
std::map<int, std::string> RefusedLines(const std::string& text);

// What Info answers, parsed: who serves a store, and, when asked about a rank, who holds that rank.
struct ServerInfo {
  int world_size = 0;
  std::string run_id, host;
  int64_t pid = 0;
  std::string rank_host;  // the asked rank's connected process, when one is
  int64_t rank_pid = 0;
};
// Info's answer parsed; false when `text` is not one (what answered is not ptk's rendezvous).
bool ParseServerInfo(const std::string& text, ServerInfo* info);
// "WORLD_SIZE 2, run id SLURM_JOB_ID=12 SLURM_STEP_ID=0" ("no run id" when empty).
std::string JobWords(int world_size, const std::string& run_id);

// One request as the server reads it off a client's connection.
struct Request {
  char op = 0;
  std::string key, value;  // value: a set's and a hello's only
};
// The first whole request at the front of `in`, taken out of it; false while `in` holds only part of
// one (the rest is still on its way). *bad for bytes that are no request (an unknown op, a blob over
// 64 MiB).
bool TakeRequest(std::string* in, Request* request, bool* bad);

}  // namespace rendezvous_detail

// Rank 0's store: one thread, poll(2) over the listening socket and the clients. A registered
// client whose connection closes is a rank that exited. A client's bytes are taken as they come and
// a request served once whole: a rank stopped (or slowed down) half-way through sending one holds no
// other rank's request. Replies are queued per client and sent as its socket takes them: a rank that
// reads none (stopped, hung) holds no other rank either, and is dropped (named in a warning) once its
// unsent replies pass kMaxUnsentReplies.
class RendezvousServer {
 public:
  ~RendezvousServer();
  // Listens on `port` (0: any free one) of every interface, for the ranks of a job of `world_size`
  // ranks launched as `run_id` with `settings` (RendezvousStore::Connect). A port another process
  // holds: kUnavailable, and bind_errno() is EADDRINUSE. Errors name the port as RendezvousPortWords
  // does (`torchrun_store_port`).
  absl::Status Start(int port, int world_size, const std::string& run_id, int torchrun_store_port = 0,
                     const std::string& settings = "");

  // Connected ranks (for rank 0's exit after a failure: the others may still ask what happened).
  int live() const { return live_; }
  // The connected ranks' numbers, ascending (any thread).
  std::vector<int> LiveRanks() const;
  // Distinct ranks that have registered since the start.
  int ever() const { return ever_; }
  int port() const { return port_; }  // the one bound (any free one for port 0)
  int bind_errno() const { return bind_errno_; }

 private:
  struct Client {
    int rank = 0;
    std::string host;
    int64_t pid = 0;
  };
  using Waiting = std::map<int, std::vector<std::string>>;  // fd -> keys it waits for
  // Closes client `fd`, a warning naming it when its unsent replies were past kMaxUnsentReplies.
  void Drop(int fd, Waiting* waiting);
  // Each rank's "rank\thost\tstate" line, after a "!\t" line with kAbortKey's value once a rank set it,
  // then a "?\trank\twords" line for each rank number whose hello was refused for its settings (the last one).
  std::string Peers() const;
  // kInfo's answer: "ptk-rendezvous\tWORLD_SIZE\tpid\thost\trun id", then, when `rank` is a connected
  // rank's number, "\n" and its "host\tpid".
  std::string Info(const std::string& rank) const;
  // A hello's one-byte answer (kJoined...), registering the rank when it joins.
  char Hello(int fd, const std::string& rank, const std::string& value);
  // kOtherSettings for a hello (its fields, `settings`) of rank `rank`, a warning naming it and the
  // first setting that differs.
  char RefuseSettings(int rank, const std::vector<std::string>& hello, const std::string& settings);
  // Takes what client `fd` has sent, without waiting; false once its connection closed or failed.
  bool Receive(int fd);
  // One whole request of client `fd`; false when its connection is to be dropped.
  bool Serve(int fd, const rendezvous_detail::Request& request, Waiting* waiting);
  // Queues a reply to client `fd` and sends what its socket takes without waiting; false once its
  // connection failed or its unsent replies passed kMaxUnsentReplies.
  bool Reply(int fd, const void* p, size_t n);
  bool ReplyBlob(int fd, const std::string& s);
  // Sends what client `fd`'s socket takes of its queued replies, without waiting; false once it failed.
  bool Flush(int fd);
  // Answers the gets whose key has come (or every get, once kAbortKey is set).
  void Answer(Waiting* waiting);
  void Loop();

  int listen_fd_ = -1;
  std::vector<int> clients_;
  std::map<int, std::string> received_;  // fd -> its bytes not yet taken as a whole request
  std::map<int, std::string> sending_;   // fd -> its replies its socket has not taken yet
  std::map<std::string, std::string> kv_;
  std::map<int, Client> registered_;  // fd -> the rank it registered as
  std::map<int, std::string> left_;   // rank -> host
  std::set<int> dropped_;             // ranks of left_ that Drop closed for their unread answers
  std::set<int> ever_ranks_;          // every rank that registered
  std::string abort_;                 // kAbortKey's value, once set
  std::string run_id_, host_;
  std::string settings_;                // Start's: what a rank's hello must carry when neither has a run id
  std::map<int, std::string> refused_;  // rank -> its last hello refused for its settings, in words
  std::atomic<bool> stop_{false};
  std::atomic<int> live_{0}, ever_{0};
  mutable std::mutex live_mu_;
  std::vector<int> live_ranks_;  // registered_'s ranks, under live_mu_ (SetLive)
  void SetLive();                // live_ and live_ranks_ from registered_
  int port_ = 0, world_size_ = 0, bind_errno_ = 0;
  std::thread thread_;
};

}  // namespace ptk
