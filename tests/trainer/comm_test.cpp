// The communicators' collectives at 2 and 3 gloo ranks (threads on loopback): ReduceScatterSum adds
// each element in rank order, whatever the pieces (empty ones, pieces of several rounds), and leaves
// the other pieces alone; AllGather; AllReduceSum over a whole buffer, over its buckets and as
// reduce-scatter + all-gather gives every element the same bits; the local communicator.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/status.h"
#include "tests/trainer/gloo_ranks.h"
#include "trainer/comm.h"
#include "trainer/distributed.h"
#include "trainer/rendezvous.h"
#include "trainer/rendezvous_server.h"

namespace ptk {
namespace {

using testing::RunRanks;

// Rank r's values: wide-ranging floats whose sums round differently in different orders.
std::vector<float> Values(int rank, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  uint64_t h = 0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(rank + 1);
  for (int64_t i = 0; i < n; ++i) {
    h = h * 6364136223846793005ULL + 1442695040888963407ULL;
    const double mant = static_cast<double>(h >> 40) / static_cast<double>(1 << 24) - 0.5;
    v[static_cast<size_t>(i)] = static_cast<float>(mant * std::ldexp(1.0, static_cast<int>((h >> 20) % 24) - 12));
  }
  return v;
}

// ((x0 + x1) + x2) + ... in float, element by element.
std::vector<float> RankOrderSums(int world, int64_t n) {
  std::vector<std::vector<float>> v;
  for (int r = 0; r < world; ++r) v.push_back(Values(r, n));
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    float acc = v[0][static_cast<size_t>(i)];
    for (int r = 1; r < world; ++r) acc += v[static_cast<size_t>(r)][static_cast<size_t>(i)];
    out[static_cast<size_t>(i)] = acc;
  }
  return out;
}

bool SameBits(const float* a, const float* b, int64_t n) { return std::memcmp(a, b, static_cast<size_t>(n) * 4) == 0; }

TEST(Communicator, RankOrderIsNotCommutativeForTheseValues) {
  // The test values are chosen so that the order of addition shows in the bits at 3 ranks.
  const int64_t n = 4096;
  auto a = Values(0, n), b = Values(1, n), c = Values(2, n);
  int differ = 0;
  for (int64_t i = 0; i < n; ++i) differ += ((a[i] + b[i]) + c[i]) != ((b[i] + c[i]) + a[i]);
  EXPECT_GT(differ, 100);
}

class Collectives : public ::testing::TestWithParam<int> {};

TEST_P(Collectives, ReduceScatterAddsInRankOrderAndLeavesOtherPieces) {
  const int world = GetParam();
  // Unequal pieces: one empty, one of several 2^18-float rounds, one of a few floats.
  std::vector<int64_t> counts = {600000, 0, 7};
  counts.resize(static_cast<size_t>(world));
  if (world == 2) counts = {5, 700001};
  const int64_t n = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  const std::vector<float> want = RankOrderSums(world, n);
  std::mutex mu;
  RunRanks(world, [&](Communicator* comm, int rank) {
    std::vector<float> data = Values(rank, n);
    const std::vector<float> before = data;
    absl::Status st = comm->ReduceScatterSum(data.data(), counts);
    std::lock_guard<std::mutex> lock(mu);
    ASSERT_TRUE(st.ok()) << st;
    int64_t at = 0;
    for (int r = 0; r < world; ++r) {
      const int64_t c = counts[static_cast<size_t>(r)];
      if (r == rank)
        EXPECT_TRUE(SameBits(data.data() + at, want.data() + at, c)) << "rank " << rank << ": its piece";
      else
        EXPECT_TRUE(SameBits(data.data() + at, before.data() + at, c)) << "rank " << rank << " changed piece " << r;
      at += c;
    }
  });
}

TEST_P(Collectives, AllGatherUnequalPieces) {
  const int world = GetParam();
  std::vector<int64_t> bytes = {3, 0, 1 << 20};
  bytes.resize(static_cast<size_t>(world));
  const int64_t total = std::accumulate(bytes.begin(), bytes.end(), int64_t{0});
  std::mutex mu;
  RunRanks(world, [&](Communicator* comm, int rank) {
    std::vector<uint8_t> data(static_cast<size_t>(total), 0xEE);
    int64_t at = 0;
    for (int r = 0; r < rank; ++r) at += bytes[static_cast<size_t>(r)];
    for (int64_t i = 0; i < bytes[static_cast<size_t>(rank)]; ++i)
      data[static_cast<size_t>(at + i)] = static_cast<uint8_t>(rank * 31 + i);
    absl::Status st = comm->AllGather(data.data(), bytes);
    std::lock_guard<std::mutex> lock(mu);
    ASSERT_TRUE(st.ok()) << st;
    int64_t pos = 0;
    for (int r = 0; r < world; ++r)
      for (int64_t i = 0; i < bytes[static_cast<size_t>(r)]; ++i, ++pos)
        ASSERT_EQ(data[static_cast<size_t>(pos)], static_cast<uint8_t>(r * 31 + i))
            << "rank " << rank << " byte " << pos;
  });
}

TEST_P(Collectives, AllReduceHasTheSameBitsWholeInBucketsOrScattered) {
  const int world = GetParam();
  const int64_t n = 300007;
  const std::vector<float> want = RankOrderSums(world, n);
  std::mutex mu;
  RunRanks(world, [&](Communicator* comm, int rank) {
    std::vector<float> whole = Values(rank, n), buckets = whole, scattered = whole;
    absl::Status st = comm->AllReduceSum(whole.data(), n);
    // Buckets of odd sizes, last to first (as backward produces them).
    const std::vector<int64_t> cuts = {0, 1, 4097, 100000, 262145, n};
    for (size_t b = cuts.size() - 1; b > 0 && st.ok(); --b)
      st = comm->AllReduceSum(buckets.data() + cuts[b - 1], cuts[b] - cuts[b - 1]);
    std::vector<int64_t> counts(static_cast<size_t>(world), n / world), bytes(counts.size());
    counts.back() += n % world;
    for (size_t r = 0; r < counts.size(); ++r) bytes[r] = counts[r] * 4;
    if (st.ok()) st = comm->ReduceScatterSum(scattered.data(), counts);
    if (st.ok()) st = comm->AllGather(scattered.data(), bytes);
    std::lock_guard<std::mutex> lock(mu);
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_TRUE(SameBits(whole.data(), want.data(), n)) << "rank " << rank << ": whole";
    EXPECT_TRUE(SameBits(buckets.data(), want.data(), n)) << "rank " << rank << ": in buckets";
    EXPECT_TRUE(SameBits(scattered.data(), want.data(), n)) << "rank " << rank << ": reduce-scatter + all-gather";
  });
}

TEST_P(Collectives, PiecesMustBeOnePerRank) {
  const int world = GetParam();
  RunRanks(world, [&](Communicator* comm, int) {
    float x[4] = {};
    const std::vector<int64_t> wrong(static_cast<size_t>(world + 1), 1);
    EXPECT_TRUE(absl::IsInvalidArgument(comm->ReduceScatterSum(x, wrong)));
    EXPECT_TRUE(absl::IsInvalidArgument(comm->AllGather(x, wrong)));
    EXPECT_TRUE(absl::IsUnimplemented(comm->AllReduceSumDevice(x, 4, nullptr)));
    EXPECT_FALSE(comm->device_collectives());
    EXPECT_EQ(comm->backend(), "gloo");
    EXPECT_TRUE(comm->Barrier().ok());
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, Collectives, ::testing::Values(2, 3));

TEST(Communicator, LocalIsTheIdentity) {
  auto comm = MakeLocalCommunicator();
  std::vector<float> x = Values(0, 10), before = x;
  const std::vector<int64_t> counts = {10};
  ASSERT_TRUE(comm->ReduceScatterSum(x.data(), counts).ok());
  ASSERT_TRUE(comm->AllGather(x.data(), std::vector<int64_t>{40}).ok());
  EXPECT_EQ(x, before);
  EXPECT_TRUE(absl::IsInvalidArgument(comm->ReduceScatterSum(x.data(), std::vector<int64_t>{5, 5})));
}

}  // namespace
}  // namespace ptk

namespace ptk {
namespace {

// Ranks 0 to n-1 of a job of `world` ranks meeting at `port` on this host, connected in turn (rank 0 serves the
// others' stores) and appended to `stores`.
template <typename StorePtr>
void ConnectStores(int n, int world, int port, std::chrono::milliseconds timeout, std::vector<StorePtr>* stores) {
  for (int r = 0; r < n; ++r) {
    auto s = RendezvousStore::Connect(r, world, "127.0.0.1", port, timeout);
    ASSERT_TRUE(s.ok()) << s.status();
    stores->push_back(*std::move(s));
  }
}

// A rank whose communicator goes away (its process exited) fails the others' next collective at
// once, and their error names it with its host; they learn it from rank 0's rendezvous store.
TEST(Communicator, ARankThatLeavesIsNamed) {
  std::mutex mu;
  std::vector<std::string> errors(3);
  std::vector<double> seconds(3, 0);
  testing::RunRanks(3, [&](Communicator* comm, int rank) {
    std::vector<float> x(1000, 1.0f);
    ASSERT_TRUE(comm->AllReduceSum(x.data(), 1000).ok());
    if (rank == 2) return;  // RunRanks destroys this rank's communicator when its body returns
    const auto start = std::chrono::steady_clock::now();
    absl::Status st = absl::OkStatus();
    for (int i = 0; i < 100 && st.ok(); ++i) st = comm->AllReduceSum(x.data(), 1000);
    std::lock_guard<std::mutex> lock(mu);
    errors[static_cast<size_t>(rank)] = std::string(st.message());
    seconds[static_cast<size_t>(rank)] =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  });
  for (int r : {0, 1}) {
    EXPECT_NE(errors[static_cast<size_t>(r)].find("failed (a rank died or the network failed)"), std::string::npos)
        << errors[static_cast<size_t>(r)];
    EXPECT_NE(errors[static_cast<size_t>(r)].find("rank 2 (host " + HostName() + ") exited"), std::string::npos)
        << errors[static_cast<size_t>(r)];
    EXPECT_LT(seconds[static_cast<size_t>(r)], 4.0) << errors[static_cast<size_t>(r)];
  }
}

// A rank restarted in place (a PyTorchJob pod) while rank 0 still runs the job's earlier start must
// not join that rank 0's store, whose addresses are the old run's (it would wait on them for the
// whole timeout, and the fresh rank 0 for it): the old store refuses it, and it retries until a
// fresh rank 0 serves. With no fresh rank 0, its error says why it waited.
TEST(Rendezvous, ARestartedRankWaitsForAFreshRankZero) {
  using std::chrono::milliseconds;
  const int port = testing::NextPort();
  auto old0 = RendezvousStore::Connect(0, 2, "127.0.0.1", port, milliseconds(10000));
  ASSERT_TRUE(old0.ok()) << old0.status();
  {
    auto old1 = RendezvousStore::Connect(1, 2, "127.0.0.1", port, milliseconds(10000));
    ASSERT_TRUE(old1.ok()) << old1.status();
    ASSERT_TRUE((*old1)->Set("1", "address of the old rank 1").ok());
  }  // rank 1 killed

  auto refused = RendezvousStore::Connect(1, 2, "127.0.0.1", port, milliseconds(1000));
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("still runs an earlier start of this job, which rank 1 already joined"),
            std::string::npos)
      << refused.status();

  absl::StatusOr<std::unique_ptr<RendezvousStore>> new1 = absl::UnknownError("not yet");
  std::thread restarted([&] { new1 = RendezvousStore::Connect(1, 2, "127.0.0.1", port, milliseconds(20000)); });
  std::this_thread::sleep_for(milliseconds(700));
  old0->reset();  // the old rank 0 notices and exits; its pod restarts
  auto new0 = RendezvousStore::Connect(0, 2, "127.0.0.1", port, milliseconds(10000));
  ASSERT_TRUE(new0.ok()) << new0.status();
  restarted.join();
  ASSERT_TRUE(new1.ok()) << new1.status();
  ASSERT_TRUE((*new1)->Set("1", "address of the new rank 1").ok());
  auto got = (*new0)->Get("1");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "address of the new rank 1");
}

// A rank's own failure after the ranks met (ReportFailure): a get another rank waits on (a group's
// rendezvous) is answered at once with it, as a usage error when it was one (it waited for the whole
// timeout, 60 s here, then said "key 'never' did not join"); a rank whose collective failed learns it from
// DiagnosePeers; a rank that heard a peer's failure reports none of its own (it is not the cause).
TEST(Rendezvous, ARanksOwnFailureEndsTheOthersWaitsNamingIt) {
  using std::chrono::milliseconds;
  const int port = testing::NextPort();
  std::vector<std::unique_ptr<RendezvousStore>> stores;
  ASSERT_NO_FATAL_FAILURE(ConnectStores(3, 3, port, milliseconds(60000), &stores));
  absl::StatusOr<std::string> waited = std::string("not yet");
  std::thread waiter([&] { waited = stores[2]->Get("never"); });
  std::this_thread::sleep_for(milliseconds(200));
  EXPECT_TRUE(stores[1]->ReportFailure(UsageError("--train-samples 14: the data would run out")));
  waiter.join();
  const std::string named = "rank 1 (host " + HostName() + ") stopped: --train-samples 14: the data would run out";
  ASSERT_FALSE(waited.ok());
  EXPECT_TRUE(IsUsageError(waited.status())) << waited.status();
  EXPECT_EQ(waited.status().message(), named);
  const absl::Status heard = stores[2]->HeardFailure("rank 2: making the data group failed: ");
  EXPECT_TRUE(IsUsageError(heard)) << heard;
  EXPECT_EQ(heard.message(), "rank 2: making the data group failed: " + named);
  EXPECT_FALSE(stores[2]->ReportFailure(absl::DataLossError("rank 2's own")));  // rank 1's failure is the cause
  EXPECT_TRUE(stores[0]->HeardFailure("").ok());
  EXPECT_EQ(stores[0]->DiagnosePeers("barrier: connection closed"), named);
  EXPECT_EQ(stores[0]->HeardFailure("rank 0: barrier failed: ").message(), "rank 0: barrier failed: " + named);
  EXPECT_FALSE(stores[0]->ReportFailure(absl::DataLossError("rank 0's own")));  // it diagnosed a peer's failure
  for (int r = 2; r >= 0; --r) stores[static_cast<size_t>(r)].reset();          // rank 0, which serves them, last
}

// NCCL's ranks wait inside NCCL's kernels, not on the store, so a rank's reported failure reached them
// only at their watchdog's timeout. ReportedFailureWatch polls rank 0's store for it (PollReportedFailure):
// once a rank reported, HeardFailure names it and its reason on every watching rank (the NCCL watchdogs
// read it and abort their communicators), with no get to answer.
TEST(Rendezvous, AReportedFailureReachesTheRanksThatWatchForIt) {
  using std::chrono::milliseconds;
  const int port = testing::NextPort();
  std::vector<std::shared_ptr<RendezvousStore>> stores;
  ASSERT_NO_FATAL_FAILURE(ConnectStores(3, 3, port, milliseconds(60000), &stores));
  EXPECT_FALSE(stores[2]->PollReportedFailure());
  {
    ReportedFailureWatch watch0(stores[0], milliseconds(10)), watch2(stores[2], milliseconds(10));
    EXPECT_TRUE(stores[1]->ReportFailure(absl::DataLossError("iter_0000004: checksum mismatch")));
    // Each watch's thread ends once it heard (bounded: the 60 s timeout would be the old behaviour).
    for (int i = 0; i < 6000 && (stores[0]->HeardFailure("").ok() || stores[2]->HeardFailure("").ok()); ++i)
      std::this_thread::sleep_for(milliseconds(10));
  }
  const std::string named = "rank 1 (host " + HostName() + ") stopped: iter_0000004: checksum mismatch";
  for (int r : {0, 2}) {
    const absl::Status heard = stores[static_cast<size_t>(r)]->HeardFailure("the communicator was aborted: ");
    EXPECT_TRUE(absl::IsAborted(heard)) << r << ": " << heard;
    EXPECT_EQ(heard.message(), "the communicator was aborted: " + named) << r;
    EXPECT_FALSE(stores[static_cast<size_t>(r)]->ReportFailure(absl::DataLossError("its own")));  // not the cause
  }
  EXPECT_TRUE(stores[2]->PollReportedFailure());
  for (int r = 2; r >= 0; --r) stores[static_cast<size_t>(r)].reset();  // rank 0, which serves them, last
}

// After a failed collective rank 0 serves its store a few seconds for the ranks that will come to ask what
// happened: not for a rank its diagnosis found silent (hung, its connection open), which never asks and held
// rank 0's exit the whole 5 s; a rank that reported a failure is still waited for.
TEST(Rendezvous, RankZeroDoesNotWaitForARankItFoundSilent) {
  using std::chrono::milliseconds;
  const int port = testing::NextPort();
  std::vector<std::unique_ptr<RendezvousStore>> stores;
  ASSERT_NO_FATAL_FAILURE(ConnectStores(3, 3, port, milliseconds(1000), &stores));
  EXPECT_EQ(stores[0]->PeersToServe(), 2);
  EXPECT_EQ(stores[1]->PeersToServe(), 0);                                 // only rank 0 serves
  (void)stores[2]->DiagnosePeers("all-reduce: Connection reset by peer");  // rank 2 failed and will ask
  EXPECT_EQ(stores[0]->DiagnosePeers("all-reduce: timed out"),
            "rank 1 (host " + HostName() + ") did not report a failure: it hangs (or is cut off from the others)");
  EXPECT_EQ(stores[0]->PeersToServe(), 1);  // rank 2, not the silent rank 1 (still connected)
  stores[2].reset();
  stores[0].reset();  // waits for rank 2's connection to close only
  stores[1].reset();
}

// Ranks that never come: every rank's error names all of them, not the first one waited for (gloo's
// full-mesh rendezvous waits for rank 2's address, NCCL's rank 0 for key 'ptk/nccl-joined/2': both
// said only that one, though rank 3 never came either).
TEST(Rendezvous, TheTimeoutNamesEveryRankThatNeverJoined) {
  using std::chrono::milliseconds;
  const int port = testing::NextPort();
  std::vector<std::unique_ptr<RendezvousStore>> stores;
  ASSERT_NO_FATAL_FAILURE(ConnectStores(2, 4, port, milliseconds(1000), &stores));
  for (const char* key : {"2", "ptk/nccl-joined/2"}) {
    const absl::StatusOr<std::string> got = stores[1]->Get(key);
    ASSERT_FALSE(got.ok());
    EXPECT_TRUE(absl::IsDeadlineExceeded(got.status())) << got.status();
    EXPECT_EQ(got.status().message().substr(0, 37), "ranks 2, 3 did not join within 1 s (-") << got.status();
    EXPECT_NE(got.status().message().find("start all 4 ranks (WORLD_SIZE)"), std::string::npos) << got.status();
  }
  for (int r = 1; r >= 0; --r) stores[static_cast<size_t>(r)].reset();
}

// Rank 0 killed (its store's connections closed): the others' diagnosis says it exited, as it says
// of any other rank, instead of "does not answer: it exited or hangs" (what a rank 0 that hangs,
// its connections open, still gets).
TEST(Rendezvous, ARankZeroThatExitedIsSaidToHaveExited) {
  using std::chrono::milliseconds;
  const int port = testing::NextPort();
  std::vector<std::unique_ptr<RendezvousStore>> stores;
  ASSERT_NO_FATAL_FAILURE(ConnectStores(2, 2, port, milliseconds(10000), &stores));
  stores[0].reset();
  EXPECT_EQ(stores[1]->DiagnosePeers("all-gather: Connection reset by peer"),
            "rank 0 (which serves the rendezvous) exited (its connection closed: killed, crashed or stopped early)");
}

// Two jobs on one MASTER_PORT: rendezvous_jobs_test.cpp.

// A rank's connection made by hand, closed first when the test ends (the stores' server may wait on it).
struct HandRank {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ~HandRank() { ::close(fd); }
};
// Ranks 0 and 1 of a job of 3 ranks through RendezvousStore, and rank 2 by hand.
void JoinTwoAndOneByHand(int port, std::vector<std::unique_ptr<RendezvousStore>>* stores, const HandRank& hand) {
  namespace wire = rendezvous_detail;
  ASSERT_NO_FATAL_FAILURE(ConnectStores(2, 3, port, std::chrono::milliseconds(10000), stores));
  ASSERT_GE(hand.fd, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(hand.fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  char ack = 0;  // its hello answered: the store serves its connection
  ASSERT_TRUE(wire::SendAll(hand.fd, &wire::kHello, 1) && wire::SendBlob(hand.fd, "2") &&
              wire::SendBlob(hand.fd, wire::HelloValue("rank-two", 3, "", ::getpid())) &&
              wire::RecvAll(hand.fd, &ack, 1));
  ASSERT_EQ(ack, wire::kJoined);
}

// Rank 1 killed in a job of 4: rank 0 met the death first, and ended while ranks 2 and 3 were still to ask its store
// which rank went. Its diagnosis took them (alive beside the gone rank 1) for silent ranks that never ask, and its
// store closed at once: their diagnosis said "rank 0 (which serves the rendezvous) exited" instead of naming rank 1
// (tp_train_cli_test's killed tensor rank, seen once in CI). Rank 0 now serves them, its own connection closed,
// until they have asked and gone.
TEST(Rendezvous, RankZeroEndingOnADeathStillTellsTheLaterRanksWhoWentFirst) {
  using std::chrono::milliseconds;
  namespace wire = rendezvous_detail;
  const int port = testing::NextPort();
  std::vector<std::unique_ptr<RendezvousStore>> stores;
  ASSERT_NO_FATAL_FAILURE(ConnectStores(4, 4, port, milliseconds(10000), &stores));
  const std::string named = "rank 1 (host " + HostName() +
                            ") exited (its connection to the rendezvous closed: killed, crashed or stopped "
                            "early)";
  stores[1].reset();  // killed
  EXPECT_EQ(stores[0]->DiagnosePeers("all-reduce: Connection reset by peer"), named);
  EXPECT_EQ(stores[0]->PeersToServe(), 2);  // ranks 2 and 3 have yet to meet the death: not silent
  // Rank 0 ends: its destructor closes its own connection first, then serves while the others are connected.
  HandRank asker;  // not a rank: asks the store (kInfo about rank 0) whether rank 0's own connection closed
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(asker.fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  std::thread ending([&] { stores[0].reset(); });
  bool rank0_ending = false;
  for (int i = 0; i < 1000 && !rank0_ending; ++i) {
    std::string info;
    wire::ServerInfo parsed;
    if (!(wire::SendAll(asker.fd, &wire::kInfo, 1) && wire::SendBlob(asker.fd, "0") &&
          wire::RecvBlob(asker.fd, &info) && wire::ParseServerInfo(info, &parsed)))
      break;  // the store closed: rank 0 ended without serving the others
    rank0_ending = parsed.rank_host.empty();
    if (!rank0_ending) std::this_thread::sleep_for(milliseconds(5));
  }
  EXPECT_TRUE(rank0_ending) << "rank 0's store closed (or its end never began) before ranks 2 and 3 asked";
  // Only now do ranks 2 and 3 meet the death (their collectives fail) and ask.
  for (int r : {2, 3}) {
    EXPECT_EQ(stores[static_cast<size_t>(r)]->DiagnosePeers("all-reduce: Connection reset by peer"), named) << r;
    stores[static_cast<size_t>(r)].reset();
  }
  ending.join();
}

// A rank stopped, or slowed down, half-way through a request to rank 0's store held every other rank's:
// the store read each request whole, waiting on its sender's connection, so one byte of a set from
// rank 2 left rank 1's set and rank 0's get waiting until their timeout ("no answer within 10 s"), and
// a rank that hangs there turned the others' diagnosis into "rank 0 ... does not answer". A request's
// bytes are now taken as they come and it is served once whole.
TEST(Rendezvous, ARankStoppedHalfWayThroughARequestHoldsNoOtherRank) {
  namespace wire = rendezvous_detail;
  const int port = testing::NextPort();
  std::vector<std::unique_ptr<RendezvousStore>> stores;
  HandRank two;
  ASSERT_NO_FATAL_FAILURE(JoinTwoAndOneByHand(port, &stores, two));
  char ack = 0;
  ASSERT_TRUE(wire::SendAll(two.fd, &wire::kSet, 1));  // the first byte of a set, and no more for now
  ASSERT_TRUE(stores[1]->Set("1", "address of rank 1").ok());
  absl::StatusOr<std::string> got = stores[0]->Get("1");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "address of rank 1");
  // Rank 2 goes on: its set is served once whole.
  ASSERT_TRUE(wire::SendBlob(two.fd, "2") && wire::SendBlob(two.fd, "address of rank 2") &&
              wire::RecvAll(two.fd, &ack, 1));
  EXPECT_EQ(ack, 'k');
  got = stores[1]->Get("2");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "address of rank 2");
}

// A rank that sends requests and reads none of their answers (stopped, hung) held every other rank's:
// rank 0's store sent each answer with blocking sends, so once that rank's socket buffers were full it
// waited in send, and rank 0's get failed after its timeout ('rank 1 did not join within 10 s', test
// 20.5 s). Answers are now queued per client and sent as its socket takes them (test 0.1 s); past
// kMaxUnsentReplies the client is dropped, named.
TEST(Rendezvous, ARankThatReadsNoAnswerHoldsNoOtherRank) {
  namespace wire = rendezvous_detail;
  const int port = testing::NextPort();
  std::vector<std::unique_ptr<RendezvousStore>> stores;
  HandRank two;
  ASSERT_NO_FATAL_FAILURE(JoinTwoAndOneByHand(port, &stores, two));
  char ack = 0;
  const std::string big(1 << 20, 'x');
  ASSERT_TRUE(wire::SendAll(two.fd, &wire::kSet, 1) && wire::SendBlob(two.fd, "big") && wire::SendBlob(two.fd, big) &&
              wire::RecvAll(two.fd, &ack, 1));
  ASSERT_EQ(ack, 'k');
  // 80 gets of it, never read: 80 MiB of answers, more than its socket buffers and kMaxUnsentReplies.
  const int gets = 80;
  static_assert(gets * ((1 << 20) + 4) > wire::kMaxUnsentReplies);
  std::string requests;  // sent at once: the store takes them all in one read
  for (int i = 0; i < gets; ++i) requests += std::string(1, wire::kGet) + std::string("\3\0\0\0big", 7);
  ::testing::internal::CaptureStderr();  // before the store can drop rank 2
  ASSERT_TRUE(wire::SendAll(two.fd, requests.data(), requests.size()));
  ASSERT_TRUE(stores[1]->Set("1", "address of rank 1").ok());
  absl::StatusOr<std::string> got = stores[0]->Get("1");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "address of rank 1");
  // Rank 2 was dropped: its connection ends after what its socket took, less than its answers.
  size_t came = 0;
  char buf[1 << 16];
  const timeval guard{10, 0};  // were it never dropped: every answer, then no more
  ASSERT_EQ(::setsockopt(two.fd, SOL_SOCKET, SO_RCVTIMEO, &guard, sizeof guard), 0);
  for (ssize_t n; (n = ::recv(two.fd, buf, sizeof buf, 0)) > 0;) came += static_cast<size_t>(n);
  EXPECT_LT(came, static_cast<size_t>(gets) * (big.size() + 4));
  const std::string warned = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(warned.find("rank 0's rendezvous store dropped rank 2 (host rank-two, pid "), std::string::npos) << warned;
  EXPECT_NE(warned.find("read none of their answers"), std::string::npos) << warned;
  // Said as what it is, not as a rank that exited (it was said to have "exited (its connection to the
  // rendezvous closed: killed, crashed or stopped early)", which it did not).
  const std::string dropped =
      "rank 2 (host rank-two) was disconnected by the rendezvous store: it stopped reading its answers (stopped or "
      "hung)";
  EXPECT_EQ(stores[0]->PollExitedRank(), dropped);
  EXPECT_EQ(stores[1]->DiagnosePeers("all-reduce: Connection reset by peer"), dropped);
}

// HeardFailure is an NCCL watchdog's check, every 100 ms under its communicator's lock (which the
// training thread takes to enqueue each collective): it must not wait for another thread's request on
// the store's one connection. It took the connection's lock, so a get waiting for its key (a group's
// rendezvous), or a poll whose answer is slow, held every watchdog of the rank (and through them its
// collectives) until that request ended: here the get's timeout, as the key comes only after.
TEST(Rendezvous, HeardFailureDoesNotWaitForAnotherThreadsRequest) {
  using std::chrono::milliseconds;
  const int port = testing::NextPort();
  std::vector<std::shared_ptr<RendezvousStore>> stores;
  ASSERT_NO_FATAL_FAILURE(ConnectStores(2, 2, port, milliseconds(5000), &stores));
  std::atomic<bool> got{false};
  absl::StatusOr<std::string> value = std::string("not yet");
  std::thread waiter([&] {
    value = stores[1]->Get("published later");
    got = true;
  });
  std::this_thread::sleep_for(milliseconds(200));  // the get is waiting on the connection by now
  EXPECT_TRUE(stores[1]->HeardFailure("").ok());
  EXPECT_FALSE(got.load()) << "HeardFailure returned only once the get had ended";
  ASSERT_TRUE(stores[0]->Set("published later", "v").ok());
  waiter.join();
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(*value, "v");
  for (int r = 1; r >= 0; --r) stores[static_cast<size_t>(r)].reset();
}

}  // namespace
}  // namespace ptk

namespace ptk {
namespace {

// A group's point-to-point failure names the peer by its rank in the run (what the logs, the
// rendezvous's diagnosis and the launcher call it), not by its index in the group: rank 0's exchange
// with world rank 2 in the group {0, 2} (two pipeline stages of T = 2 x P = 2) said "send to rank 1 /
// receive from rank 1", a rank that was alive, beside "rank 2 ... exited".
TEST(Communicator, AGroupsFailedExchangeNamesThePeersWorldRank) {
  std::string error;
  std::atomic<bool> done{false};
  testing::RunRanks(4, [&](Communicator* world, int rank) {
    const std::vector<int> stages = {rank % 2, rank % 2 + 2};
    auto pp = world->Subgroup(stages, "pipeline");
    ASSERT_TRUE(pp.ok()) << pp.status();
    double one = 1;
    ASSERT_TRUE(world->AllReduceSum(&one, 1).ok());
    if (rank == 2) return;  // RunRanks destroys its communicators when its body returns
    if (rank != 0) {        // ranks 1 and 3 stay until rank 0 has seen the failure
      while (!done) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      return;
    }
    float out[4] = {1, 2, 3, 4}, in[4] = {};
    absl::Status st = absl::OkStatus();
    for (int i = 0; i < 100 && st.ok(); ++i) st = (*pp)->SendRecv(out, sizeof out, 1, in, sizeof in, 1);
    error = std::string(st.message());
    done = true;
  });
  EXPECT_NE(error.find("send to rank 2 / receive from rank 2 failed"), std::string::npos) << error;
  EXPECT_EQ(error.find("rank 1"), std::string::npos) << error;
}

// A rank's own failure reported (ReportRankFailure) while a peer waits on it in a group's collective:
// the peer's line names itself in that group, the call, the failed rank and its reason, as NCCL's
// does (it said "rank 2 (host H): barrier failed: ...", without the group).
TEST(Communicator, AReportedFailureNamesTheGroupAndCallOfEveryRank) {
  std::string error;
  std::atomic<bool> done{false};
  testing::RunRanks(4, [&](Communicator* world, int rank) {
    auto tp = world->Subgroup(std::vector<int>{rank / 2 * 2, rank / 2 * 2 + 1}, "tensor");
    ASSERT_TRUE(tp.ok()) << tp.status();
    ASSERT_TRUE(world->Barrier().ok());
    if (rank == 3) {
      ReportRankFailure(world, absl::DataLossError("iter_0000004: checksum mismatch"));
      return;  // RunRanks destroys its communicators when its body returns
    }
    if (rank != 2) {  // ranks 0 and 1 (rank 0 serves the store) stay until rank 2 has seen the failure
      while (!done) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      return;
    }
    absl::Status st = absl::OkStatus();
    for (int i = 0; i < 1000 && st.ok(); ++i) st = (*tp)->Barrier();
    error = std::string(st.message());
    done = true;
  });
  EXPECT_EQ(error, "rank 0 of the tensor group (world rank 2) (host " + HostName() +
                       "): barrier failed: rank 3 (host " + HostName() + ") stopped: iter_0000004: checksum mismatch");
}

// Four ranks as two tensor groups {0,1} {2,3} and two data groups {0,2} {1,3} (Megatron's order:
// tensor ranks adjacent): each group's collectives sum over its members only, in their order, and
// a group's rank is the member's index; the world communicator still works beside them.
TEST(Communicator, SubgroupsSumOverTheirMembersOnly) {
  std::mutex mu;
  std::vector<std::vector<float>> tensor_sums(4), data_sums(4);
  std::vector<int> tensor_ranks(4, -1), data_ranks(4, -1);
  testing::RunRanks(4, [&](Communicator* world, int rank) {
    const std::vector<int> tensor = {rank / 2 * 2, rank / 2 * 2 + 1}, data = {rank % 2, rank % 2 + 2};
    auto tp = world->Subgroup(tensor, "tensor");
    ASSERT_TRUE(tp.ok()) << tp.status();
    auto dp = world->Subgroup(data, "data");
    ASSERT_TRUE(dp.ok()) << dp.status();
    EXPECT_EQ((*tp)->size(), 2);
    EXPECT_EQ((*dp)->size(), 2);
    std::vector<float> x = Values(rank, 5000), y = x;
    ASSERT_TRUE((*tp)->AllReduceSum(x.data(), 5000).ok());
    ASSERT_TRUE((*dp)->AllReduceSum(y.data(), 5000).ok());
    double one = 1;
    ASSERT_TRUE(world->AllReduceSum(&one, 1).ok());
    EXPECT_EQ(one, 4.0);
    std::lock_guard<std::mutex> lock(mu);
    tensor_sums[static_cast<size_t>(rank)] = x;
    data_sums[static_cast<size_t>(rank)] = y;
    tensor_ranks[static_cast<size_t>(rank)] = (*tp)->rank();
    data_ranks[static_cast<size_t>(rank)] = (*dp)->rank();
  });
  for (int r = 0; r < 4; ++r) {
    const auto vt = Values(r / 2 * 2, 5000), vt1 = Values(r / 2 * 2 + 1, 5000);
    const auto vd = Values(r % 2, 5000), vd1 = Values(r % 2 + 2, 5000);
    std::vector<float> want_t(5000), want_d(5000);
    for (size_t i = 0; i < 5000; ++i) {
      want_t[i] = vt[i] + vt1[i];
      want_d[i] = vd[i] + vd1[i];
    }
    EXPECT_TRUE(SameBits(tensor_sums[static_cast<size_t>(r)].data(), want_t.data(), 5000)) << "rank " << r;
    EXPECT_TRUE(SameBits(data_sums[static_cast<size_t>(r)].data(), want_d.data(), 5000)) << "rank " << r;
    EXPECT_EQ(tensor_ranks[static_cast<size_t>(r)], r % 2);
    EXPECT_EQ(data_ranks[static_cast<size_t>(r)], r / 2);
  }
}

TEST(Communicator, SubgroupMembersAreChecked) {
  auto comm = MakeLocalCommunicator();
  auto one = comm->Subgroup(std::vector<int>{0}, "tensor");
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ((*one)->size(), 1);
  EXPECT_TRUE(absl::IsInvalidArgument(comm->Subgroup(std::vector<int>{1}, "tensor").status()));
  testing::RunRanks(2, [&](Communicator* world, int rank) {
    EXPECT_TRUE(absl::IsInvalidArgument(world->Subgroup(std::vector<int>{1, 0}, "x").status()));
    EXPECT_TRUE(absl::IsInvalidArgument(world->Subgroup(std::vector<int>{1 - rank}, "x").status()));
  });
}

// A rank that leaves as soon as its communicator (or a group's) is made, as one whose own check
// fails does, must not cut a peer still finishing its side of the connection: every rank's
// communicator starts ("Connection closed by peer" on a rank of SubgroupMembersAreChecked, once in
// a few runs, before the communicator waited for every rank's pairs).
TEST(Communicator, ARankThatLeavesAtOnceCutsNoPeerStillConnecting) {
  for (int i = 0; i < 15; ++i) {
    testing::RunRanks(3, [](Communicator*, int) {});
    testing::RunRanks(3, [](Communicator* world, int rank) {
      auto group = world->Subgroup(std::vector<int>{0, 1, 2}, "all");
      ASSERT_TRUE(group.ok()) << "rank " << rank << ": " << group.status();
    });
  }
}

}  // namespace
}  // namespace ptk
