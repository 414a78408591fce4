// What every communicator shares: the piece arithmetic of the gather/scatter collectives, a group's
// member checks, and the answers of a backend without device-memory collectives or groups.
#include "trainer/comm.h"

#include <vector>

#include <fmt/core.h>

#include "common/status.h"

namespace ptk {

absl::Status Communicator::AllReduceSumDevice(float*, int64_t, void*) {
  return absl::UnimplementedError(fmt::format("the {} communicator has no device-memory collectives", backend()));
}
absl::Status Communicator::ReduceScatterSumDevice(float*, std::span<const int64_t>, void*) {
  return absl::UnimplementedError(fmt::format("the {} communicator has no device-memory collectives", backend()));
}
absl::Status Communicator::AllGatherDevice(void*, std::span<const int64_t>, void*) {
  return absl::UnimplementedError(fmt::format("the {} communicator has no device-memory collectives", backend()));
}

absl::Status Communicator::SendRecvDevice(const void*, int64_t, int dst, void*, int64_t, int src, void*) {
  if (dst < 0 && src < 0) return absl::OkStatus();
  return absl::UnimplementedError(fmt::format(
      "the {} communicator sends no device memory (to {}, from {}); its pipeline stages exchange through the host",
      backend(), dst, src));
}

absl::Status Communicator::CheckPeers(int dst, int src) const {
  for (int peer : {dst, src})
    if (peer < -1 || peer >= size() || peer == rank())
      return absl::InvalidArgumentError(
          fmt::format("rank {} of {}: no point-to-point message to or from rank {}", rank(), size(), peer));
  return absl::OkStatus();
}

absl::Status Communicator::SendRecv(const void*, int64_t, int dst, void*, int64_t, int src) {
  if (dst < 0 && src < 0) return absl::OkStatus();
  return absl::UnimplementedError(
      fmt::format("the {} communicator of {} rank(s) has no point-to-point sends (to {}, "
                  "from {})",
                  backend(), size(), dst, src));
}

absl::Status Communicator::BatchSendRecv(std::span<const P2pMessage> messages) {
  for (const P2pMessage& m : messages)
    if (m.peer >= 0)
      return absl::UnimplementedError(
          fmt::format("the {} communicator of {} rank(s) has no batched point-to-point messages (to or from {})",
                      backend(), size(), m.peer));
  return absl::OkStatus();
}

absl::Status Communicator::BatchSendRecvDevice(std::span<const P2pMessage> messages, void*) {
  for (const P2pMessage& m : messages)
    if (m.peer >= 0)
      return absl::UnimplementedError(fmt::format(
          "the {} communicator sends no device memory (to or from {}); its pipeline stages exchange through the host",
          backend(), m.peer));
  return absl::OkStatus();
}

namespace {

// This rank's index among `members`, when they are ascending ranks below world_size and `rank` is
// one of them.
absl::StatusOr<int> MemberIndex(std::span<const int> members, int rank, int world_size) {
  int me = -1;
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i] < 0 || members[i] >= world_size || (i > 0 && members[i] <= members[i - 1]))
      return absl::InvalidArgumentError(fmt::format(
          "a group's members must be ascending ranks below {}; member {} is {}", world_size, i, members[i]));
    if (members[i] == rank) me = static_cast<int>(i);
  }
  if (me < 0) return absl::InvalidArgumentError(fmt::format("rank {} is not a member of the group it makes", rank));
  return me;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> Communicator::Subgroup(std::span<const int> members,
                                                                     const std::string& name) {
  PTK_ASSIGN_OR_RETURN(const int me, MemberIndex(members, rank(), size()));
  if (members.size() == 1) return MakeLocalCommunicator();
  return MakeGroup(members, me, name);
}

absl::StatusOr<std::unique_ptr<Communicator>> Communicator::MakeGroup(std::span<const int> members, int,
                                                                      const std::string&) {
  return absl::UnimplementedError(
      fmt::format("the {} communicator makes no groups of several ranks ({} asked for)", backend(), members.size()));
}

absl::StatusOr<std::vector<int64_t>> PieceOffsets(std::span<const int64_t> sizes, int world_size) {
  if (static_cast<int64_t>(sizes.size()) != world_size)
    return absl::InvalidArgumentError(
        fmt::format("a collective over {} pieces on {} ranks: one piece per rank", sizes.size(), world_size));
  std::vector<int64_t> offsets(sizes.size() + 1, 0);
  for (size_t r = 0; r < sizes.size(); ++r) {
    if (sizes[r] < 0) return absl::InvalidArgumentError(fmt::format("piece {} has a negative size", r));
    offsets[r + 1] = offsets[r] + sizes[r];
  }
  return offsets;
}

absl::Status SumInRankOrder(double* data, int64_t n, Communicator* comm) {
  const int T = comm->size();
  if (T == 1 || n == 0) return absl::OkStatus();
  std::vector<double> all(static_cast<size_t>(T * n));
  std::copy(data, data + n, all.begin() + comm->rank() * n);
  std::vector<int64_t> bytes(static_cast<size_t>(T), n * static_cast<int64_t>(sizeof(double)));
  PTK_RETURN_IF_ERROR(comm->AllGather(all.data(), bytes));
  for (int64_t i = 0; i < n; ++i) {
    double s = all[static_cast<size_t>(i)];
    for (int r = 1; r < T; ++r) s += all[static_cast<size_t>(r * n + i)];
    data[i] = s;
  }
  return absl::OkStatus();
}

}  // namespace ptk
