// The NCCL communicator: rendezvous through rank 0's store, nonblocking initialisation, collectives
// on device memory (and host memory staged through the device), a watchdog that aborts on a NCCL
// error or a collective older than the timeout.
#include "trainer/cuda/comm_nccl.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/core.h>

#include "common/logging.h"
#include "common/status.h"
#include "trainer/cuda/local_rank_device.h"
#include "trainer/cuda/nccl_guard.h"
#include "trainer/cuda/real_nccl_calls.h"
#include "trainer/rendezvous.h"

namespace ptk::cuda {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kScratchBytes = size_t{64} << 20;  // host collectives go through this much device memory at a time
// A staged point-to-point chunk is half of it (the other half receives); the device sends cut the
// same chunks, so that the two ends of a message may each stage or not.
static_assert(Communicator::kSendRecvChunkBytes * 2 <= static_cast<int64_t>(kScratchBytes));

class NcclCommunicator : public Communicator {
 public:
  ~NcclCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    // Finalized (polled to completion) and destroyed, or aborted when its stream does not drain or
    // the finalize fails; nothing when it was aborted (ncclCommAbort freed it).
    if (guard_) {
      const bool drained = !stream_ || cudaStreamSynchronize(stream_) == cudaSuccess;
      if (!drained) (void)cudaGetLastError();
      if (absl::Status st = guard_->Close(drained); !st.ok())
        log::Warning("rank {} (cuda:{}): {}", options_.rank, device_, std::string(st.message()));
    }
    for (const Pending& p : pending_) cudaEventDestroy(p.done);
    for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
    if (scratch_) cudaFree(scratch_);
    if (batch_scratch_) cudaFree(batch_scratch_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  absl::Status Init(const NcclOptions& o) {
    options_ = o;
    timeout_ = o.timeout;
    world_rank_ = o.rank;
    int visible = 0;
    if (cudaGetDeviceCount(&visible) != cudaSuccess) {
      (void)cudaGetLastError();
      visible = 0;
    }
    PTK_ASSIGN_OR_RETURN(device_, LocalRankDevice("--distributed-backend nccl", o.local_rank, visible,
                                                  std::getenv("CUDA_VISIBLE_DEVICES")));
    PTK_RETURN_IF_ERROR(Cuda(cudaSetDevice(device_), "selecting the rank's GPU"));
    PTK_ASSIGN_OR_RETURN(store_, RendezvousStore::Connect(o.rank, o.world_size, o.master_addr, o.master_port, o.timeout,
                                                          o.run_id, o.torchrun_store_port, o.settings));
    // NCCL's unique id, from rank 0 through the store (fresh every run: a requeue meets no stale id).
    ncclUniqueId id;
    std::memset(&id, 0, sizeof id);
    // Every rank joins through the store before NCCL initialises: rank 0 waits there for each of the
    // others, so that a rank which failed its own checks (RendezvousStore::ReportEarlyFailure) ends
    // rank 0 at once, naming it, instead of leaving it in ncclCommInitRankConfig until the timeout.
    if (o.rank == 0) {
      PTK_RETURN_IF_ERROR(Nccl(ncclGetUniqueId(&id), "ncclGetUniqueId"));
      PTK_RETURN_IF_ERROR(store_->Set("ptk/nccl-unique-id", std::string(id.internal, sizeof id.internal)));
      for (int r = 1; r < o.world_size; ++r) {
        PTK_RETURN_IF_ERROR(store_->Get(fmt::format("ptk/nccl-joined/{}", r)).status());
      }
    } else {
      PTK_RETURN_IF_ERROR(store_->Set(fmt::format("ptk/nccl-joined/{}", o.rank), "1"));
      PTK_ASSIGN_OR_RETURN(std::string bytes, store_->Get("ptk/nccl-unique-id"));
      if (bytes.size() != sizeof id.internal) return absl::InternalError("rank 0 published a malformed NCCL id");
      std::memcpy(id.internal, bytes.data(), sizeof id.internal);
    }
    PTK_RETURN_IF_ERROR(Cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "creating NCCL's stream"));
    // Nonblocking, so that a rank that never comes cannot hold initialisation forever: it is
    // polled up to the timeout and aborted.
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&comm_, o.world_size, id, o.rank, &config);
    PTK_RETURN_IF_ERROR(Start(r, "NCCL initialisation"));
    // A rank's own failure reported through the store (ReportRankFailure) reaches the watchdogs (Watch).
    if (o.world_size > 1) failure_watch_ = std::make_unique<ReportedFailureWatch>(store_, std::chrono::seconds(1));
    return absl::OkStatus();
  }

  // A group of this communicator's ranks (the tensor, data, pipeline or embedding group): a
  // communicator of its own (ncclCommInitRankConfig over a unique id the group's first member
  // publishes in the store), which only the group's members make. Not ncclCommSplit of this one: a
  // split is collective over all of this communicator's ranks, and the groups of a kind need not
  // cover them (a middle pipeline stage is in no embedding group and makes none: the first and last
  // stages' split would wait for it until the timeout).
  absl::StatusOr<std::unique_ptr<Communicator>> MakeGroup(std::span<const int> members, int me,
                                                          const std::string& name) override {
    auto sub = std::make_unique<NcclCommunicator>();
    sub->options_ = options_;
    sub->options_.rank = me;
    sub->options_.world_size = static_cast<int>(members.size());
    sub->timeout_ = timeout_;
    sub->device_ = device_;
    sub->store_ = store_;
    sub->group_ = name;
    sub->world_rank_ = world_rank_;
    std::string key = "ptk/nccl-unique-id/" + name;  // the group's members name it: one per group of a kind
    for (int m : members) key += fmt::format("/{}", m);
    ncclUniqueId id;
    std::memset(&id, 0, sizeof id);
    if (me == 0) {
      PTK_RETURN_IF_ERROR(Nccl(ncclGetUniqueId(&id), fmt::format("ncclGetUniqueId for the {} group", name)));
      PTK_RETURN_IF_ERROR(store_->Set(key, std::string(id.internal, sizeof id.internal)));
    } else {
      PTK_ASSIGN_OR_RETURN(std::string bytes, store_->Get(key));
      if (bytes.size() != sizeof id.internal)
        return absl::InternalError(fmt::format("the {} group's first rank published a malformed NCCL id", name));
      std::memcpy(id.internal, bytes.data(), sizeof id.internal);
    }
    PTK_RETURN_IF_ERROR(Cuda(cudaSetDevice(device_), "selecting the rank's GPU"));
    PTK_RETURN_IF_ERROR(
        sub->Cuda(cudaStreamCreateWithFlags(&sub->stream_, cudaStreamNonBlocking), "creating NCCL's stream"));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t r = ncclCommInitRankConfig(&sub->comm_, static_cast<int>(members.size()), id, me, &config);
    PTK_RETURN_IF_ERROR(sub->Start(r, fmt::format("making the {} group", name)));
    return std::unique_ptr<Communicator>(std::move(sub));
  }

  int rank() const override { return options_.rank; }
  int size() const override { return options_.world_size; }
  std::string_view backend() const override { return "nccl"; }
  std::shared_ptr<RendezvousStore> failure_store() const override { return store_; }
  bool device_collectives() const override { return true; }

  // ---- device memory, on the caller's stream
  absl::Status AllReduceSumDevice(float* data, int64_t n, void* stream) override {
    if (n <= 0) return absl::OkStatus();
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    return Run("all-reduce", s,
               [&] { return ncclAllReduce(data, data, static_cast<size_t>(n), ncclFloat, ncclSum, comm_, s); });
  }
  absl::Status ReduceScatterSumDevice(float* data, std::span<const int64_t> counts, void* stream) override {
    PTK_ASSIGN_OR_RETURN(const std::vector<int64_t> off, PieceOffsets(counts, size()));
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const size_t me = static_cast<size_t>(rank());
    if (off.back() == 0) return absl::OkStatus();
    if (std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == counts[0]; }))
      return Run("reduce-scatter", s, [&] {
        return ncclReduceScatter(data, data + off[me], static_cast<size_t>(counts[0]), ncclFloat, ncclSum, comm_, s);
      });
    // Pieces of different sizes (a bucket's): one reduce to each piece's owner.
    return Run("reduce-scatter", s, [&] {
      ncclResult_t r = ncclGroupStart();
      for (size_t q = 0; q < counts.size() && r == ncclSuccess; ++q)
        if (counts[q] > 0)
          r = ncclReduce(data + off[q], data + off[q], static_cast<size_t>(counts[q]), ncclFloat, ncclSum,
                         static_cast<int>(q), comm_, s);
      const ncclResult_t end = ncclGroupEnd();
      return r != ncclSuccess ? r : end;
    });
  }
  absl::Status AllGatherDevice(void* data, std::span<const int64_t> bytes, void* stream) override {
    PTK_ASSIGN_OR_RETURN(const std::vector<int64_t> off, PieceOffsets(bytes, size()));
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    char* d = static_cast<char*>(data);
    const size_t me = static_cast<size_t>(rank());
    if (off.back() == 0) return absl::OkStatus();
    if (std::all_of(bytes.begin(), bytes.end(), [&](int64_t b) { return b == bytes[0]; }))
      return Run("all-gather", s,
                 [&] { return ncclAllGather(d + off[me], d, static_cast<size_t>(bytes[0]), ncclUint8, comm_, s); });
    return Run("all-gather", s, [&] {
      ncclResult_t r = ncclGroupStart();
      for (size_t q = 0; q < bytes.size() && r == ncclSuccess; ++q)
        if (bytes[q] > 0)
          r = ncclBroadcast(d + off[q], d + off[q], static_cast<size_t>(bytes[q]), ncclUint8, static_cast<int>(q),
                            comm_, s);
      const ncclResult_t end = ncclGroupEnd();
      return r != ncclSuccess ? r : end;
    });
  }

  // ---- host memory, staged through the scratch buffer on this communicator's stream
  absl::Status AllReduceSum(float* data, int64_t n) override { return StagedAllReduce(data, n, ncclFloat); }
  absl::Status AllReduceSum(double* data, int64_t n) override { return StagedAllReduce(data, n, ncclDouble); }
  absl::Status ReduceScatterSum(float* data, std::span<const int64_t> counts) override {
    PTK_ASSIGN_OR_RETURN(const std::vector<int64_t> off, PieceOffsets(counts, size()));
    PTK_RETURN_IF_ERROR(EnsureScratch());
    const size_t chunk = kScratchBytes / sizeof(float);
    for (int q = 0; q < size(); ++q) {
      for (int64_t at = 0; at < counts[static_cast<size_t>(q)]; at += static_cast<int64_t>(chunk)) {
        const size_t c = std::min<size_t>(chunk, static_cast<size_t>(counts[static_cast<size_t>(q)] - at));
        float* host = data + off[static_cast<size_t>(q)] + at;
        PTK_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(scratch_, host, c * sizeof(float), cudaMemcpyHostToDevice, stream_),
                                 "staging a reduce-scatter"));
        PTK_RETURN_IF_ERROR(Run("reduce-scatter", stream_, [&] {
          return ncclReduce(scratch_, scratch_, c, ncclFloat, ncclSum, q, comm_, stream_);
        }));
        if (q == rank())
          PTK_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(host, scratch_, c * sizeof(float), cudaMemcpyDeviceToHost, stream_),
                                   "staging a reduce-scatter"));
        PTK_RETURN_IF_ERROR(WaitStream("reduce-scatter"));
      }
    }
    return absl::OkStatus();
  }
  absl::Status AllGather(void* data, std::span<const int64_t> bytes) override {
    PTK_ASSIGN_OR_RETURN(const std::vector<int64_t> off, PieceOffsets(bytes, size()));
    for (int q = 0; q < size(); ++q)
      PTK_RETURN_IF_ERROR(StagedBroadcast(static_cast<char*>(data) + off[static_cast<size_t>(q)],
                                          bytes[static_cast<size_t>(q)], q, "all-gather"));
    return absl::OkStatus();
  }
  absl::Status Broadcast(void* data, int64_t bytes, int root) override {
    return StagedBroadcast(static_cast<char*>(data), bytes, root, "broadcast");
  }
  absl::Status Barrier() override {
    float one = 1.0f;
    return StagedAllReduce(&one, 1, ncclFloat);
  }
  // Point-to-point (pipeline stages' activations and their gradients): ncclSend and ncclRecv in one
  // group per chunk of kSendRecvChunkBytes; both ranks of a pair cut a message into the same chunks,
  // which NCCL matches in order. Host memory is staged through the scratch buffer (its first half
  // sends, its second receives) on this communicator's stream, the host waiting for each chunk;
  // device memory goes as it is on the caller's stream, nothing waited for (the watchdog ages each
  // chunk: a peer that never comes aborts the communicator after the timeout, and the next call
  // fails naming it).
  absl::Status SendRecv(const void* send, int64_t send_bytes, int dst, void* recv, int64_t recv_bytes,
                        int src) override {
    return PointToPoint(send, send_bytes, dst, recv, recv_bytes, src, nullptr);
  }
  absl::Status SendRecvDevice(const void* send, int64_t send_bytes, int dst, void* recv, int64_t recv_bytes, int src,
                              void* stream) override {
    if (!stream) return absl::InvalidArgumentError("SendRecvDevice: no stream");
    return PointToPoint(send, send_bytes, dst, recv, recv_bytes, src, static_cast<cudaStream_t>(stream));
  }
  absl::Status BatchSendRecv(std::span<const P2pMessage> messages) override {
    return BatchPointToPoint(messages, nullptr);
  }
  absl::Status BatchSendRecvDevice(std::span<const P2pMessage> messages, void* stream) override {
    if (!stream) return absl::InvalidArgumentError("BatchSendRecvDevice: no stream");
    return BatchPointToPoint(messages, static_cast<cudaStream_t>(stream));
  }

 private:
  struct Pending {
    cudaEvent_t done;
    Clock::time_point since;
    std::string what;
  };

  // The communicator comm_ (or the result r of making it) settled, guarded and watched.
  absl::Status Start(ncclResult_t r, const std::string& what) {
    if (r != ncclSuccess && r != ncclInProgress) {
      comm_ = nullptr;
      return Failed(what, ncclGetErrorString(r));
    }
    guard_ =
        std::make_unique<NcclGuard>(std::make_unique<RealNcclCalls>(comm_), timeout_,
                                    [this](const std::string& w, const std::string& why) { return Failed(w, why); });
    PTK_RETURN_IF_ERROR(guard_->Settle(r, what));
    watchdog_ = std::thread([this] { Watch(); });
    return absl::OkStatus();
  }

  absl::Status Cuda(cudaError_t e, std::string_view what) {
    if (e == cudaSuccess) return absl::OkStatus();
    (void)cudaGetLastError();
    return absl::InternalError(
        fmt::format("rank {} (cuda:{}): {}: {}", options_.rank, device_, what, cudaGetErrorString(e)));
  }
  absl::Status Nccl(ncclResult_t r, std::string_view what) {
    if (r == ncclSuccess) return absl::OkStatus();
    return absl::InternalError(fmt::format("{}: {}", what, ncclGetErrorString(r)));
  }
  // This rank, its group and `call` for an error line (FailedCallPrefix's words, as gloo's).
  FailedCall At(const std::string& call) const {
    return {.rank = options_.rank,
            .group = group_,
            .world_rank = world_rank_,
            .host = HostName(),
            .device = device_,
            .call = call};
  }
  // An error naming this rank and host, what failed, and what the store knows of the others.
  absl::Status Failed(const std::string& what, const std::string& why) {
    const std::string peers = store_ ? store_->DiagnosePeers(what + ": " + why) : "";
    return absl::UnavailableError(fmt::format("{}: {} failed (a rank died or the network failed): {}{}",
                                              FailedCallWho(At(what)), what, why, peers.empty() ? "" : "; " + peers));
  }
  bool aborted() const { return guard_->aborted(); }
  // `what`: the call that finds the communicator aborted; it names it where the watchdog aborted it
  // with no collective in flight on another rank's reported failure.
  absl::Status AbortedStatus(const char* what = nullptr) const {
    if (what && heard_idle_) return store_->HeardFailure(FailedCallPrefix(At(what)));
    return guard_->abort_status();
  }

  // Enqueues one collective (or group) on `s` and hands its completion to the watchdog. A stream
  // other than the previous collective's first waits for it: every rank's collectives run in the
  // order they were issued, whichever streams carry them. The enqueue runs under the guard's lock
  // (never after an abort); a nonblocking ncclInProgress is settled by polling.
  template <typename F>
  absl::Status Run(const char* what, cudaStream_t s, F&& enqueue) {
    if (aborted()) return AbortedStatus(what);
    if (last_event_ && s != last_stream_)
      PTK_RETURN_IF_ERROR(Cuda(cudaStreamWaitEvent(s, last_event_, 0), "ordering collectives across streams"));
    PTK_RETURN_IF_ERROR(guard_->Call(what, [&] { return static_cast<int>(enqueue()); }));
    cudaEvent_t e = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_events_.empty()) {
        e = free_events_.back();
        free_events_.pop_back();
      }
    }
    if (!e) PTK_RETURN_IF_ERROR(Cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "creating an event"));
    PTK_RETURN_IF_ERROR(Cuda(cudaEventRecord(e, s), "recording a collective's event"));
    last_event_ = e;
    last_stream_ = s;
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_.push_back({e, Clock::now(), what});
    }
    cv_.notify_all();
    return absl::OkStatus();
  }

  // The host side of a staged collective waits for its stream, never longer than the watchdog
  // lets it (an abort ends the wait).
  absl::Status WaitStream(const char* what) {
    for (int spins = 0;; ++spins) {
      const cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) return absl::OkStatus();
      if (e != cudaErrorNotReady) return Cuda(e, what);
      if (aborted()) return AbortedStatus(what);
      std::this_thread::sleep_for(std::chrono::microseconds(spins < 100 ? 20 : 500));
    }
  }

  // SendRecv (device_stream null: host memory, staged) and SendRecvDevice.
  absl::Status PointToPoint(const void* send, int64_t send_bytes, int dst, void* recv, int64_t recv_bytes, int src,
                            cudaStream_t device_stream) {
    PTK_RETURN_IF_ERROR(CheckPeers(dst, src));
    const int64_t out = dst >= 0 ? std::max<int64_t>(send_bytes, 0) : 0;
    const int64_t in = src >= 0 ? std::max<int64_t>(recv_bytes, 0) : 0;
    if (out == 0 && in == 0) return absl::OkStatus();
    if ((out > 0 && !send) || (in > 0 && !recv))
      return absl::InvalidArgumentError(
          fmt::format("rank {}: point-to-point message of {} / {} bytes without a buffer", options_.rank, out, in));
    const bool staged = device_stream == nullptr;
    if (staged) PTK_RETURN_IF_ERROR(EnsureScratch());
    const int64_t chunk = kSendRecvChunkBytes;
    const cudaStream_t s = staged ? stream_ : device_stream;
    const std::string what = fmt::format("{}send of {} bytes to rank {} / receive of {} bytes from rank {}",
                                         staged ? "" : "device ", out, dst, in, src);
    char* const stage_send = staged ? static_cast<char*>(scratch_) : nullptr;
    char* const stage_recv = staged ? stage_send + chunk : nullptr;
    for (int64_t at = 0; at < std::max(out, in); at += chunk) {
      const size_t cs = static_cast<size_t>(std::clamp<int64_t>(out - at, 0, chunk));
      const size_t cr = static_cast<size_t>(std::clamp<int64_t>(in - at, 0, chunk));
      const char* from = cs == 0 ? nullptr : staged ? stage_send : static_cast<const char*>(send) + at;
      char* into = cr == 0 ? nullptr : staged ? stage_recv : static_cast<char*>(recv) + at;
      if (staged && cs > 0)
        PTK_RETURN_IF_ERROR(
            Cuda(cudaMemcpyAsync(stage_send, static_cast<const char*>(send) + at, cs, cudaMemcpyHostToDevice, s),
                 "staging a send"));
      PTK_RETURN_IF_ERROR(Run(what.c_str(), s, [&] {
        ncclResult_t r = ncclGroupStart();
        if (r == ncclSuccess && cs > 0) r = ncclSend(from, cs, ncclUint8, dst, comm_, s);
        if (r == ncclSuccess && cr > 0) r = ncclRecv(into, cr, ncclUint8, src, comm_, s);
        const ncclResult_t end = ncclGroupEnd();
        return r != ncclSuccess ? r : end;
      }));
      if (!staged) continue;
      if (cr > 0)
        PTK_RETURN_IF_ERROR(
            Cuda(cudaMemcpyAsync(static_cast<char*>(recv) + at, into, cr, cudaMemcpyDeviceToHost, s), what.c_str()));
      PTK_RETURN_IF_ERROR(WaitStream(what.c_str()));
    }
    return absl::OkStatus();
  }

  // A batch of messages (Megatron's batch_isend_irecv): chunk k (kSendRecvChunkBytes) of every
  // message in one group, posted in the batch's order; NCCL matches a pair's messages in the order
  // each end posts them (no channels: P2pMessage::channel is not sent). Host memory is staged
  // through a device buffer of a chunk per message, the host waiting for each group; device
  // memory goes as it is on the caller's stream, nothing waited for.
  absl::Status BatchPointToPoint(std::span<const P2pMessage> messages, cudaStream_t device_stream) {
    const bool staged = device_stream == nullptr;
    std::vector<P2pMessage> live;
    int64_t longest = 0;
    std::string what;
    for (const P2pMessage& m : messages) {
      if (m.peer < 0 || m.bytes <= 0) continue;
      PTK_RETURN_IF_ERROR(CheckPeers(m.peer, -1));
      if ((m.send == nullptr) == (m.recv == nullptr))
        return absl::InvalidArgumentError("BatchSendRecv: each message is one send or one receive");
      live.push_back(m);
      longest = std::max(longest, m.bytes);
      what += fmt::format("{}{}{} of {} bytes {} rank {}", what.empty() ? "" : " / ", staged ? "" : "device ",
                          m.send ? "send" : "receive", m.bytes, m.send ? "to" : "from", m.peer);
    }
    if (live.empty()) return absl::OkStatus();
    const int64_t chunk = std::min(kSendRecvChunkBytes, longest);
    const cudaStream_t s = staged ? stream_ : device_stream;
    if (staged && batch_scratch_bytes_ < static_cast<int64_t>(live.size()) * chunk) {
      if (batch_scratch_) PTK_RETURN_IF_ERROR(Cuda(cudaFree(batch_scratch_), "freeing NCCL's batch staging buffer"));
      batch_scratch_ = nullptr;
      batch_scratch_bytes_ = 0;
      PTK_RETURN_IF_ERROR(Cuda(cudaMalloc(&batch_scratch_, static_cast<size_t>(live.size()) * chunk),
                               "allocating NCCL's batch staging buffer"));
      batch_scratch_bytes_ = static_cast<int64_t>(live.size()) * chunk;
    }
    for (int64_t at = 0; at < longest; at += chunk) {
      auto part = [&](size_t i) { return static_cast<size_t>(std::clamp<int64_t>(live[i].bytes - at, 0, chunk)); };
      auto device = [&](size_t i) -> char* {
        if (staged) return static_cast<char*>(batch_scratch_) + static_cast<int64_t>(i) * chunk;
        return (live[i].send ? static_cast<char*>(const_cast<void*>(live[i].send)) : static_cast<char*>(live[i].recv)) +
               at;
      };
      for (size_t i = 0; staged && i < live.size(); ++i)
        if (live[i].send && part(i) > 0)
          PTK_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(device(i), static_cast<const char*>(live[i].send) + at, part(i),
                                                   cudaMemcpyHostToDevice, s),
                                   "staging a send"));
      PTK_RETURN_IF_ERROR(Run(what.c_str(), s, [&] {
        ncclResult_t r = ncclGroupStart();
        for (size_t i = 0; r == ncclSuccess && i < live.size(); ++i) {
          if (part(i) == 0) continue;
          r = live[i].send ? ncclSend(device(i), part(i), ncclUint8, live[i].peer, comm_, s)
                           : ncclRecv(device(i), part(i), ncclUint8, live[i].peer, comm_, s);
        }
        const ncclResult_t end = ncclGroupEnd();
        return r != ncclSuccess ? r : end;
      }));
      if (!staged) continue;
      for (size_t i = 0; i < live.size(); ++i)
        if (live[i].recv && part(i) > 0)
          PTK_RETURN_IF_ERROR(Cuda(
              cudaMemcpyAsync(static_cast<char*>(live[i].recv) + at, device(i), part(i), cudaMemcpyDeviceToHost, s),
              what));
      PTK_RETURN_IF_ERROR(WaitStream(what.c_str()));
    }
    return absl::OkStatus();
  }

  absl::Status EnsureScratch() {
    if (scratch_) return absl::OkStatus();
    return Cuda(cudaMalloc(&scratch_, kScratchBytes), "allocating NCCL's staging buffer");
  }

  template <typename T>
  absl::Status StagedAllReduce(T* data, int64_t n, ncclDataType_t type) {
    if (n <= 0) return absl::OkStatus();
    PTK_RETURN_IF_ERROR(EnsureScratch());
    const size_t chunk = kScratchBytes / sizeof(T);
    for (int64_t at = 0; at < n; at += static_cast<int64_t>(chunk)) {
      const size_t c = std::min<size_t>(chunk, static_cast<size_t>(n - at));
      PTK_RETURN_IF_ERROR(
          Cuda(cudaMemcpyAsync(scratch_, data + at, c * sizeof(T), cudaMemcpyHostToDevice, stream_), "staging"));
      PTK_RETURN_IF_ERROR(Run("all-reduce", stream_,
                              [&] { return ncclAllReduce(scratch_, scratch_, c, type, ncclSum, comm_, stream_); }));
      PTK_RETURN_IF_ERROR(
          Cuda(cudaMemcpyAsync(data + at, scratch_, c * sizeof(T), cudaMemcpyDeviceToHost, stream_), "staging"));
      PTK_RETURN_IF_ERROR(WaitStream("all-reduce"));
    }
    return absl::OkStatus();
  }

  absl::Status StagedBroadcast(char* data, int64_t bytes, int root, const char* what) {
    if (bytes <= 0) return absl::OkStatus();
    PTK_RETURN_IF_ERROR(EnsureScratch());
    for (int64_t at = 0; at < bytes; at += static_cast<int64_t>(kScratchBytes)) {
      const size_t c = std::min<size_t>(kScratchBytes, static_cast<size_t>(bytes - at));
      if (rank() == root)
        PTK_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(scratch_, data + at, c, cudaMemcpyHostToDevice, stream_), what));
      PTK_RETURN_IF_ERROR(
          Run(what, stream_, [&] { return ncclBroadcast(scratch_, scratch_, c, ncclUint8, root, comm_, stream_); }));
      if (rank() != root)
        PTK_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(data + at, scratch_, c, cudaMemcpyDeviceToHost, stream_), what));
      PTK_RETURN_IF_ERROR(WaitStream(what));
    }
    return absl::OkStatus();
  }

  // ncclCommAbort (once) ends the kernels of the collectives in flight; the guard sets its flag
  // under its lock first, so no call reaches the freed communicator.
  void Abort(const absl::Status& why) {
    if (guard_->Abort(why)) cv_.notify_all();
  }

  // Every 100 ms: NCCL's asynchronous error, the oldest collective's age; after an abort, whether
  // the training thread came back.
  void Watch() {
    cudaSetDevice(device_);
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      cv_.wait_for(lock, std::chrono::milliseconds(100));
      if (stop_) break;
      if (aborted()) {
        // The training thread has not ended (and destroyed this communicator) since the abort.
        if (!stuck_reported_ && Clock::now() - guard_->aborted_at() > options_.stuck_grace && options_.on_stuck) {
          stuck_reported_ = true;
          const absl::Status st = AbortedStatus();
          lock.unlock();
          options_.on_stuck(st);
          lock.lock();
        }
        continue;
      }
      while (!pending_.empty() && cudaEventQuery(pending_.front().done) == cudaSuccess) {
        free_events_.push_back(pending_.front().done);
        pending_.pop_front();
      }
      (void)cudaGetLastError();
      // Another rank's own failure, reported through the store (ReportRankFailure): ends the collectives
      // now, this rank's line naming that rank, its reason, this group and the call in flight here.
      const bool heard = !store_->HeardFailure("").ok();
      const std::string problem = guard_->AsyncProblem();  // under the guard's lock (this one is taken before it)
      const bool none = pending_.empty();
      const WatchVerdict v =
          DecideWatch(problem, none ? nullptr : &pending_.front().what,
                      none ? Clock::duration{} : Clock::now() - pending_.front().since, timeout_, heard);
      if (!v.abort) continue;
      heard_idle_ = v.heard && v.call.empty();
      lock.unlock();
      Abort(v.heard ? store_->HeardFailure(FailedCallPrefix(At(v.call))) : Failed(v.call, v.problem));
      lock.lock();
    }
  }

  NcclOptions options_;
  std::chrono::milliseconds timeout_{0};
  int device_ = 0;
  std::shared_ptr<RendezvousStore> store_;  // shared with the groups made from this communicator
  std::string group_;                       // a subgroup's name ("tensor", ...) for messages; empty for the world
  int world_rank_ = 0;                      // this rank's in the run
  std::atomic<bool> heard_idle_{false};     // aborted on a heard failure with no collective in flight
  ncclComm_t comm_ = nullptr;               // called only through guard_ (under its lock, never after an abort)
  std::unique_ptr<NcclGuard> guard_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t last_event_ = nullptr;  // the last collective's, on last_stream_
  cudaStream_t last_stream_ = nullptr;
  void* scratch_ = nullptr;
  void* batch_scratch_ = nullptr;  // BatchPointToPoint's staging of host messages
  int64_t batch_scratch_bytes_ = 0;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> pending_;
  std::vector<cudaEvent_t> free_events_;
  bool stop_ = false, stuck_reported_ = false;
  std::thread watchdog_;
  std::unique_ptr<ReportedFailureWatch> failure_watch_;  // the world's: polls the store for a reported failure
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> MakeNcclCommunicator(const NcclOptions& o) {
  if (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size)
    return absl::InvalidArgumentError(fmt::format("rank {} of {}: not a valid rank", o.rank, o.world_size));
  auto comm = std::make_unique<NcclCommunicator>();
  PTK_RETURN_IF_ERROR(comm->Init(o));
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace ptk::cuda
