// The collective operations data-parallel training needs, behind one interface: a single-process
// communicator, gloo over TCP for CPU ranks, and (with the CUDA backend) NCCL.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace ptk {

class RendezvousStore;

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // The backend's name for the log: "local", "gloo", "nccl".
  virtual std::string_view backend() const = 0;
  // NCCL's: the store its ranks met through, where ReportRankFailure reports this rank's own failure
  // (distributed.h). None elsewhere (gloo reports through its own: ReportGlooFailure).
  virtual std::shared_ptr<RendezvousStore> failure_store() const { return nullptr; }

  // ---- Host memory, on every backend (NCCL stages through device memory).
  // In-place sums over all ranks; every rank ends with the same bits. gloo adds in rank
  // order, ((x0 + x1) + x2) + ..., element by element, whatever the length: a sum over a whole
  // buffer, over its buckets, or ReduceScatterSum's pieces give each element the same bits.
  virtual absl::Status AllReduceSum(float* data, int64_t n) = 0;
  virtual absl::Status AllReduceSum(double* data, int64_t n) = 0;
  // In place: `data` holds size() consecutive pieces, counts[r] floats for rank r (any may be 0);
  // this rank's piece ends as the sum over the ranks of their copies of it, in AllReduceSum's order
  // (the same bits AllReduceSum gives those elements); the other pieces keep their values.
  virtual absl::Status ReduceScatterSum(float* data, std::span<const int64_t> counts) = 0;
  // In place: rank r's piece (bytes[r] bytes, after the pieces of ranks below r) to every rank.
  virtual absl::Status AllGather(void* data, std::span<const int64_t> bytes) = 0;
  // Rank `root`'s bytes to every rank.
  virtual absl::Status Broadcast(void* data, int64_t bytes, int root) = 0;
  virtual absl::Status Barrier() = 0;

  // A communicator over `members` (ranks of this one, ascending, this rank among them): the
  // tensor- and data-parallel groups of a run. Every member calls it with the same members and
  // `name`, a name no other group of the run uses; the new communicator's ranks are the members'
  // indices. The parent must outlive it. Members not so are InvalidArgument; a group of one rank is
  // the local communicator; a larger one is the backend's MakeGroup.
  absl::StatusOr<std::unique_ptr<Communicator>> Subgroup(std::span<const int> members, const std::string& name);

  // ---- Point to point (pipeline parallelism's activations and their gradients). Sends send_bytes
  // from `send` to rank `dst` and receives recv_bytes into `recv` from rank `src`, both in flight
  // at once, so that two ranks sending to each other never wait on each other (Megatron's batched
  // isend/irecv); dst or src -1 leaves that half out. Messages from one rank to another arrive in
  // the order sent. This default, a communicator of one rank, has no peer to name.
  virtual absl::Status SendRecv(const void* send, int64_t send_bytes, int dst, void* recv, int64_t recv_bytes, int src);
  // Several point-to-point messages in flight at once (Megatron's batch_isend_irecv of the
  // interleaved schedule, up to two sends and two receives), waited for together. Messages of one
  // `channel` from one rank to another arrive in the order sent; channels are independent of each
  // other and of SendRecv's. A message whose peer is -1 is left out. This default (a communicator
  // of one rank) refuses any message with a peer; gloo sends them, NCCL stages them through the
  // device (BatchSendRecvDevice's order rule).
  struct P2pMessage {
    const void* send = nullptr;  // a send of `bytes` from here, or
    void* recv = nullptr;        // a receive of `bytes` into here
    int64_t bytes = 0;
    int peer = -1;
    int channel = 0;  // 0..7
  };
  virtual absl::Status BatchSendRecv(std::span<const P2pMessage> messages);

  // ---- Device memory (the current CUDA device's), where device_collectives() says so (NCCL):
  // enqueued on `stream` (a cudaStream_t) and complete when the stream reaches them. The pieces
  // are as above.
  virtual bool device_collectives() const { return false; }
  virtual absl::Status AllReduceSumDevice(float* data, int64_t n, void* stream);
  virtual absl::Status ReduceScatterSumDevice(float* data, std::span<const int64_t> counts, void* stream);
  virtual absl::Status AllGatherDevice(void* data, std::span<const int64_t> bytes, void* stream);
  // SendRecv on device memory, enqueued on `stream`: the host does not wait for the messages (a
  // later op on the stream sees the received bytes; the sent buffer may be overwritten by one). A
  // message is cut into SendRecv's chunks (kSendRecvChunkBytes), so that either end may send or
  // receive it through the host instead.
  virtual absl::Status SendRecvDevice(const void* send, int64_t send_bytes, int dst, void* recv, int64_t recv_bytes,
                                      int src, void* stream);
  // BatchSendRecv on device memory, enqueued on `stream` as SendRecvDevice (each message cut into
  // the same chunks, chunk k of every message in one group). NCCL has no channels: it matches the
  // messages between two ranks in the order each posts them, so a caller posts them in an order
  // both ends share (the interleaved schedule's, pipeline_interleaved_test checks it). This default
  // refuses any message with a peer.
  virtual absl::Status BatchSendRecvDevice(std::span<const P2pMessage> messages, void* stream);
  // The chunks a communicator that stages point-to-point messages cuts them into (NCCL: its
  // staging buffer's halves); every point-to-point message is cut the same way.
  static constexpr int64_t kSendRecvChunkBytes = int64_t{32} << 20;

 protected:
  // SendRecv's peers: each -1 (none) or another rank of this communicator.
  absl::Status CheckPeers(int dst, int src) const;
  // Subgroup's group of two or more ranks, `members` checked, `me` this rank's index among them.
  // This default refuses; gloo and NCCL make them.
  virtual absl::StatusOr<std::unique_ptr<Communicator>> MakeGroup(std::span<const int> members, int me,
                                                                  const std::string& name);
};

// Offsets of consecutive pieces of the given sizes (size + 1 entries, the last one the total);
// InvalidArgument when `sizes` is not one per rank or a size is negative.
absl::StatusOr<std::vector<int64_t>> PieceOffsets(std::span<const int64_t> sizes, int world_size);

// data(n) summed over the ranks in rank order, ((x0 + x1) + x2) + ..., through an all-gather: the
// same bits on every rank.
absl::Status SumInRankOrder(double* data, int64_t n, Communicator* comm);

// One process: every collective is the identity.
std::unique_ptr<Communicator> MakeLocalCommunicator();

}  // namespace ptk
