// gloo communicator (its rendezvous: trainer/rendezvous.h).
#include "trainer/comm_gloo.h"

#include <unistd.h>

#include <algorithm>
#include <functional>
#include <utility>
#include <vector>

#include <fmt/core.h>
#include <gloo/barrier.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include "common/slurm_env.h"
#include "common/status.h"
#include "trainer/gloo_peer_watch.h"
#include "trainer/rendezvous.h"

namespace ptk {
namespace {

std::string Suffix(const std::string& s) { return s.empty() ? "" : "; " + s; }

// gloo's Store interface over the rendezvous store. gloo catches nothing: failures throw, turned
// into a Status by the communicator.
class GlooStore : public gloo::rendezvous::Store {
 public:
  explicit GlooStore(RendezvousStore* store) : store_(store) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    absl::Status st = store_->Set(key, std::string(data.begin(), data.end()));
    if (!st.ok()) throw std::runtime_error(std::string(StatusMessage(st)));
  }
  std::vector<char> get(const std::string& key) override {
    absl::StatusOr<std::string> v = store_->Get(key);
    if (!v.ok()) {
      if (absl::IsAborted(v.status()) || IsUsageError(v.status())) early_failure_ = v.status();
      throw std::runtime_error(std::string(StatusMessage(v.status())));
    }
    return {v->begin(), v->end()};
  }
  // Another rank's failure before the ranks met (RendezvousStore::ReportEarlyFailure), if one came.
  const absl::Status& early_failure() const { return early_failure_; }
  void wait(const std::vector<std::string>& keys) override {
    for (const std::string& k : keys) get(k);  // get blocks until the key exists
  }

 private:
  RendezvousStore* store_;
  absl::Status early_failure_;
};

// Returns once every rank's side of every pair is connected. connectFullMesh returns when this
// rank's side is; a rank that then closed its communicator at once (a failed check, the end of a
// short run) would cut a peer still finishing its handshake ("Connection closed by peer").
void ConnectedEverywhere(const std::shared_ptr<gloo::rendezvous::Context>& context) {
  gloo::BarrierOptions o(context);
  gloo::barrier(o);
}

std::function<void()>& WaitHook() {
  static std::function<void()> hook;
  return hook;
}

// One step of a collective: its sends and receives, each on a buffer of its own whose wait the peer
// watch ends when that peer's pair fails, posted, then waited for (the receives first). gloo's own
// algorithms (allreduce, broadcast, barrier) wait on buffers the watch cannot reach, so every
// collective is made of these steps.
class Exchange {
 public:
  Exchange(gloo_detail::PeerWatch* watch, std::chrono::milliseconds timeout) : watch_(watch), timeout_(timeout) {}
  void Send(int peer, uint64_t slot, const void* data, int64_t bytes) {
    Add(peer, slot, const_cast<void*>(data), bytes, true);
  }
  void Recv(int peer, uint64_t slot, void* data, int64_t bytes) { Add(peer, slot, data, bytes, false); }
  // Throws gloo's error (a failed pair, the timeout).
  void Wait() {
    if (WaitHook()) WaitHook()();
    for (const auto& op : ops_)
      if (op.recv) op.buffer->Wait(timeout_);
    for (const auto& op : ops_)
      if (!op.recv) op.buffer->Wait(timeout_);
    ops_.clear();
  }

 private:
  struct Op {
    std::unique_ptr<gloo_detail::PeerWatch::Buffer> buffer;
    bool recv;
  };
  void Add(int peer, uint64_t slot, void* data, int64_t bytes, bool send) {
    if (bytes <= 0) return;
    auto& op = ops_.emplace_back(Op{
        std::make_unique<gloo_detail::PeerWatch::Buffer>(watch_, peer, data, static_cast<size_t>(bytes), send), !send});
    op.buffer->Post(slot);
  }
  gloo_detail::PeerWatch* watch_;
  std::chrono::milliseconds timeout_;
  std::vector<Op> ops_;
};

class GlooCommunicator : public Communicator {
 public:
  int rank() const override { return context_->rank; }
  int size() const override { return context_->size; }
  std::string_view backend() const override { return "gloo"; }
  std::shared_ptr<RendezvousStore> failure_store() const override { return store_; }
  // Floats: a reduce-scatter in rank order over near-equal pieces, then an all-gather (gloo's own
  // ring would add each element in an order that depends on where it lies in the buffer).
  absl::Status AllReduceSum(float* data, int64_t n) override {
    if (n <= 0 || size() == 1) return absl::OkStatus();
    std::vector<int64_t> counts(static_cast<size_t>(size())), bytes(counts.size());
    for (int r = 0; r < size(); ++r) {
      counts[static_cast<size_t>(r)] = n / size() + (r < n % size() ? 1 : 0);
      bytes[static_cast<size_t>(r)] = counts[static_cast<size_t>(r)] * static_cast<int64_t>(sizeof(float));
    }
    PTK_RETURN_IF_ERROR(ReduceScatterSum(data, counts));
    return AllGather(data, bytes);
  }
  // Doubles (losses, norms, counts: a few values) in rank order too, through an all-gather.
  absl::Status AllReduceSum(double* data, int64_t n) override { return SumInRankOrder(data, n, this); }

  // Round k moves chunk k (kChunk floats) of every piece to its owner, which adds the copies in
  // rank order: memory beside the buffer is (ranks - 1) chunks.
  absl::Status ReduceScatterSum(float* data, std::span<const int64_t> counts) override {
    PTK_ASSIGN_OR_RETURN(const std::vector<int64_t> off, PieceOffsets(counts, size()));
    const int world = size(), me = rank();
    if (world == 1) return absl::OkStatus();
    int64_t rounds = 0;
    for (int64_t c : counts) rounds = std::max(rounds, (c + kChunk - 1) / kChunk);
    if (rounds == 0) return absl::OkStatus();
    const int64_t mine = counts[static_cast<size_t>(me)], cap = std::min(kChunk, mine);
    scratch_.resize(static_cast<size_t>((world - 1) * cap));
    return Guard("reduce-scatter", [&] {
      // Rank q's copy of this rank's chunk lands in scratch slot q (q < me) or q - 1.
      auto from = [&](int q) { return scratch_.data() + (q < me ? q : q - 1) * cap; };
      for (int64_t k = 0; k < rounds; ++k) {
        const uint64_t slot = gloo::Slot::build(kSlotPrefix, tag_++);
        const int64_t at = k * kChunk, len = std::clamp<int64_t>(mine - at, 0, kChunk);
        Exchange x = Step();
        for (int q = 0; q < world; ++q) {
          if (q == me) continue;
          x.Recv(q, slot, from(q), len * static_cast<int64_t>(sizeof(float)));
          const int64_t lq = std::clamp<int64_t>(counts[static_cast<size_t>(q)] - at, 0, kChunk);
          x.Send(q, slot, data + off[static_cast<size_t>(q)] + at, lq * static_cast<int64_t>(sizeof(float)));
        }
        x.Wait();
        // ((x0 + x1) + x2) + ...: accumulated in rank 0's copy (this rank's own values when it is
        // rank 0), element by element.
        float* own = data + off[static_cast<size_t>(me)] + at;
        float* acc = me == 0 ? own : from(0);
        for (int q = 1; q < world; ++q) {
          const float* v = q == me ? own : from(q);
          for (int64_t i = 0; i < len; ++i) acc[i] += v[i];
        }
        if (acc != own) std::copy(acc, acc + len, own);
      }
    });
  }

  absl::Status AllGather(void* data, std::span<const int64_t> bytes) override {
    PTK_ASSIGN_OR_RETURN(const std::vector<int64_t> off, PieceOffsets(bytes, size()));
    const int world = size(), me = rank();
    if (world == 1 || off.back() == 0) return absl::OkStatus();
    char* d = static_cast<char*>(data);
    return Guard("all-gather", [&] {
      const uint64_t slot = gloo::Slot::build(kSlotPrefix, tag_++);
      Exchange x = Step();
      for (int q = 0; q < world; ++q) {
        if (q == me) continue;
        x.Recv(q, slot, d + off[static_cast<size_t>(q)], bytes[static_cast<size_t>(q)]);
        x.Send(q, slot, d + off[static_cast<size_t>(me)], bytes[static_cast<size_t>(me)]);
      }
      x.Wait();
    });
  }
  absl::Status Broadcast(void* data, int64_t bytes, int root) override {
    if (root < 0 || root >= size())
      return absl::InvalidArgumentError(fmt::format("broadcast from rank {} of {}", root, size()));
    return Guard("broadcast", [&] {
      const uint64_t slot = gloo::Slot::build(kSlotPrefix, tag_++);
      Exchange x = Step();
      for (int q = 0; q < size(); ++q) {
        if (rank() == root && q != root) x.Send(q, slot, data, bytes);
        if (rank() != root && q == root) x.Recv(q, slot, data, bytes);
      }
      x.Wait();
    });
  }
  // Dissemination: in round k each rank tells rank + 2^k and hears from rank - 2^k; after
  // ceil(log2(size)) rounds every rank has heard, through some chain, from every other.
  absl::Status Barrier() override {
    return Guard("barrier", [&] {
      for (int k = 1; k < size(); k *= 2) {
        const uint64_t slot = gloo::Slot::build(kSlotPrefix, tag_++);
        char out = 1, in = 0;
        Exchange x = Step();
        x.Recv((rank() - k + size()) % size(), slot, &in, 1);
        x.Send((rank() + k) % size(), slot, &out, 1);
        x.Wait();
      }
    });
  }

  // One slot for every point-to-point message: gloo matches a pair's messages of one slot in the
  // order they were sent, and the two ranks of a pair need not count their sends alike.
  absl::Status SendRecv(const void* send, int64_t send_bytes, int dst, void* recv, int64_t recv_bytes,
                        int src) override {
    PTK_RETURN_IF_ERROR(CheckPeers(dst, src));
    std::string what = dst >= 0 ? "send to " + Peer(dst) : "";
    if (src >= 0) what += (what.empty() ? "receive from " : " / receive from ") + Peer(src);
    return Guard(what.c_str(), [&] {
      const uint64_t slot = gloo::Slot::build(kP2pSlotPrefix, 0);
      Exchange x = Step();
      if (dst >= 0) x.Send(dst, slot, send, send_bytes);
      if (src >= 0) x.Recv(src, slot, recv, recv_bytes);
      x.Wait();
    });
  }

  absl::Status BatchSendRecv(std::span<const P2pMessage> messages) override {
    std::string what;
    for (const P2pMessage& m : messages) {
      if (m.peer < 0) continue;
      PTK_RETURN_IF_ERROR(CheckPeers(m.peer, -1));
      if (m.channel < 0 || m.channel > 7 || (m.send == nullptr) == (m.recv == nullptr))
        return absl::InvalidArgumentError("BatchSendRecv: each message is one send or one receive on channel 0..7");
      what += fmt::format("{}{} {}", what.empty() ? "" : " / ", m.send ? "send to" : "receive from", Peer(m.peer));
    }
    if (what.empty()) return absl::OkStatus();
    return Guard(what.c_str(), [&] {
      Exchange x = Step();
      for (const P2pMessage& m : messages) {
        if (m.peer < 0) continue;
        const uint64_t slot = gloo::Slot::build(kP2pSlotPrefix, static_cast<uint32_t>(1 + m.channel));
        if (m.send)
          x.Send(m.peer, slot, m.send, m.bytes);
        else
          x.Recv(m.peer, slot, m.recv, m.bytes);
      }
      x.Wait();
    });
  }

  // A group of this communicator's ranks: a gloo context of its own over the same store (its keys
  // under "group/<name>/") and the same transport device.
  absl::StatusOr<std::unique_ptr<Communicator>> MakeGroup(std::span<const int> members, int me,
                                                          const std::string& name) override {
    auto sub = std::make_unique<GlooCommunicator>();
    sub->group_ = name;
    sub->store_ = store_;
    sub->gloo_store_ = gloo_store_;
    sub->device_ = device_;
    for (int m : members) sub->world_ranks_.push_back(WorldRank(m));
    std::string members_text;
    for (int m : members) {
      if (!members_text.empty()) members_text += ',';
      members_text += std::to_string(m);
    }
    try {
      sub->prefix_store_ =
          std::make_unique<gloo::rendezvous::PrefixStore>("group/" + name + "/" + members_text, *gloo_store_);
      sub->context_ = std::make_shared<gloo::rendezvous::Context>(me, static_cast<int>(members.size()));
      sub->context_->setTimeout(context_->getTimeout());
      sub->context_->connectFullMesh(*sub->prefix_store_, sub->device_);
      ConnectedEverywhere(sub->context_);
      sub->Watch();
    } catch (const std::exception& e) {
      const std::string what = fmt::format("{}: making the {} group of ranks {} failed", Who(""), name, members_text);
      // Another rank's failure came through the rendezvous (its own, ReportFailure): named with its reason.
      PTK_RETURN_IF_ERROR(store_->HeardFailure(what + ": "));
      return absl::UnavailableError(fmt::format("{}: {}", what, e.what()));
    }
    return std::unique_ptr<Communicator>(std::move(sub));
  }

  std::shared_ptr<RendezvousStore> store_;
  std::shared_ptr<GlooStore> gloo_store_;
  std::unique_ptr<gloo::rendezvous::PrefixStore> prefix_store_;  // a group's
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::rendezvous::Context> context_;
  std::unique_ptr<gloo_detail::PeerWatch> watch_;  // after context_: stopped before the pairs close

  // Once every pair is connected.
  void Watch() { watch_ = std::make_unique<gloo_detail::PeerWatch>(context_, gloo::Slot::build(kWatchSlotPrefix, 0)); }

 private:
  // A member's rank in the run (a group's index is not what the logs, the diagnosis and the launcher call it).
  int WorldRank(int r) const { return world_ranks_.empty() ? r : world_ranks_[static_cast<size_t>(r)]; }
  std::string Peer(int r) const { return "rank " + std::to_string(WorldRank(r)); }
  // This rank, its group and `call` for an error line (FailedCallPrefix's words, as NCCL's).
  FailedCall At(const std::string& call) const {
    return {.rank = group_.empty() ? store_->rank() : rank(),
            .group = group_,
            .world_rank = store_->rank(),
            .host = store_->host(),
            .call = call};
  }
  std::string Who(const std::string& call) const { return FailedCallWho(At(call)); }
  Exchange Step() { return Exchange(watch_.get(), context_->getTimeout()); }
  template <typename F>
  absl::Status Guard(const char* what, F&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      const std::string why = e.what();
      const std::string peers = store_->DiagnosePeers(what + std::string(": ") + why);
      // A rank that stopped on its own failure reported it: that is the cause, named with its reason.
      PTK_RETURN_IF_ERROR(store_->HeardFailure(FailedCallPrefix(At(what))));
      return absl::UnavailableError(
          fmt::format("{}: {} failed (a rank died or the network failed): {}{}", Who(""), what, why, Suffix(peers)));
    }
    return absl::OkStatus();
  }
  static constexpr int64_t kChunk = int64_t{1} << 18;  // floats per reduce-scatter round and rank (1 MiB)
  static constexpr uint8_t kSlotPrefix = 0x50;         // ptk's own collectives (gloo's use 0x01-0x08)
  static constexpr uint8_t kP2pSlotPrefix = 0x51;      // SendRecv's
  static constexpr uint8_t kWatchSlotPrefix = 0x52;    // the peer watch's (nothing is ever sent on it)
  uint32_t tag_ = 1;
  std::vector<float> scratch_;
  std::vector<int> world_ranks_;  // a group's members' ranks in the run; empty for the run's own communicator
  std::string group_;             // a group's name ("tensor", "data", ...); empty for the run's own communicator
};

bool IsLoopback(const std::string& host) { return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1"; }

}  // namespace

void SetGlooWaitHookForTesting(std::function<void()> hook) { WaitHook() = std::move(hook); }

std::function<void()> ReportGlooFailure(Communicator* world, const absl::Status& failure) {
  auto* gloo = dynamic_cast<GlooCommunicator*>(world);
  if (gloo == nullptr || !gloo->store_->ReportFailure(failure) || gloo->store_->rank() != 0) return {};
  // Rank 0 serves the rendezvous until the others heard, at most min(timeout, 30 s).
  const auto at_most = std::min<std::chrono::milliseconds>(gloo->store_->timeout(), std::chrono::seconds(30));
  return [store = gloo->store_, at_most] { store->ServeUntilAllHeard(at_most); };
}

absl::StatusOr<std::unique_ptr<Communicator>> MakeGlooCommunicator(const GlooOptions& o) {
  if (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size)
    return absl::InvalidArgumentError(fmt::format("rank {} of {}: not a valid rank", o.rank, o.world_size));
  auto comm = std::make_unique<GlooCommunicator>();
  PTK_ASSIGN_OR_RETURN(comm->store_, RendezvousStore::Connect(o.rank, o.world_size, o.master_addr, o.master_port,
                                                              o.timeout, o.run_id, o.torchrun_store_port, o.settings));
  comm->gloo_store_ = std::make_shared<GlooStore>(comm->store_.get());
  try {
    gloo::transport::tcp::attr attr;
    if (!o.iface.empty()) {
      attr.iface = o.iface;
    } else if (IsLoopback(o.master_addr)) {
      attr.hostname = "127.0.0.1";
    } else {
      char host[256] = {};
      ::gethostname(host, sizeof host - 1);
      attr.hostname = host;
    }
    comm->device_ = gloo::transport::tcp::CreateDevice(attr);
    comm->context_ = std::make_shared<gloo::rendezvous::Context>(o.rank, o.world_size);
    comm->context_->setTimeout(o.timeout);
    comm->context_->connectFullMesh(*comm->gloo_store_, comm->device_);
    ConnectedEverywhere(comm->context_);
    comm->Watch();
  } catch (const std::exception& e) {
    if (!comm->gloo_store_->early_failure().ok()) {
      comm->store_->ServeUntilAllHeard(std::min<std::chrono::milliseconds>(o.timeout, std::chrono::minutes(1)));
      return comm->gloo_store_->early_failure();
    }
    return absl::UnavailableError(
        fmt::format("rank {} of {}: rendezvous at {} failed: {}", o.rank, o.world_size,
                    RendezvousAddressWords(o.master_addr, o.master_port, o.torchrun_store_port), e.what()));
  }
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace ptk
