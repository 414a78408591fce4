// NCCL with a world of one on one GPU (gpu-labelled: exits 77 without a device; a one-GPU machine
// cannot host two NCCL ranks), and gloo ranks sharing that GPU for ZeRO-1's sharded master. The communicator's
// device-memory collectives (equal and unequal pieces, in place) and host-memory ones (staged through the device); then
// the CUDA model trained through it: the plain all-reduce, the reduction overlapped with backward on its own stream
// (--overlap-grad-reduce), ZeRO-1 with one rank (--use-distributed-optimizer), and both, give the
// local communicator's bits (fp32 and bf16); and ptk-train --distributed-backend nccl with both flags
// prints the loss lines of the plain run.
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/trainer/gloo_ranks.h"
#include "trainer/cuda/comm_nccl.h"
#include "trainer/cuda/cuda_gpt_model.h"
#include "trainer/distributed.h"
#include "trainer/param_shard.h"
#include "trainer/rendezvous.h"
#include "trainer/train_step.h"

namespace ptk {
namespace {

std::unique_ptr<Communicator> NcclOfOne() {
  cuda::NcclOptions o;
  o.master_port = 0;  // any free port: one rank
  o.timeout = std::chrono::seconds(60);
  auto comm = cuda::MakeNcclCommunicator(o);
  EXPECT_TRUE(comm.ok()) << comm.status();
  return comm.ok() ? std::move(*comm) : nullptr;
}

TEST(NcclOfOne, CollectivesOnDeviceAndHostMemory) {
  auto comm = NcclOfOne();
  ASSERT_TRUE(comm);
  EXPECT_EQ(comm->backend(), "nccl");
  EXPECT_TRUE(comm->device_collectives());
  EXPECT_EQ(comm->size(), 1);
  const int64_t n = 100003;
  std::vector<float> host(static_cast<size_t>(n)), back(host.size());
  for (int64_t i = 0; i < n; ++i) host[static_cast<size_t>(i)] = static_cast<float>(i) * 0.37f - 11.0f;
  float* dev = nullptr;
  ASSERT_EQ(cudaMalloc(&dev, n * sizeof(float)), cudaSuccess);
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dev, host.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_TRUE(comm->AllReduceSumDevice(dev, n, s).ok());
  ASSERT_TRUE(comm->ReduceScatterSumDevice(dev, std::vector<int64_t>{n}, s).ok());
  ASSERT_TRUE(comm->AllGatherDevice(dev, std::vector<int64_t>{n * 4}, s).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(comm->AllGatherDevice(dev, std::vector<int64_t>{4, 4}, s)));
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(back.data(), dev, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(std::memcmp(back.data(), host.data(), n * sizeof(float)), 0) << "a sum over one rank changes nothing";
  // Host memory, larger than the staging buffer's 64 MiB in one of them.
  std::vector<double> d = {1.5, -2.25};
  ASSERT_TRUE(comm->AllReduceSum(d.data(), 2).ok());
  EXPECT_EQ(d, (std::vector<double>{1.5, -2.25}));
  std::vector<float> big(static_cast<size_t>(20) << 20, 3.0f);
  ASSERT_TRUE(comm->AllReduceSum(big.data(), static_cast<int64_t>(big.size())).ok());
  EXPECT_EQ(big.front(), 3.0f);
  EXPECT_EQ(big.back(), 3.0f);
  ASSERT_TRUE(comm->ReduceScatterSum(host.data(), std::vector<int64_t>{n}).ok());
  ASSERT_TRUE(comm->AllGather(host.data(), std::vector<int64_t>{n * 4}).ok());
  char text[6] = "hello";
  ASSERT_TRUE(comm->Broadcast(text, 6, 0).ok());
  EXPECT_STREQ(text, "hello");
  ASSERT_TRUE(comm->Barrier().ok());
  cudaFree(dev);
  cudaStreamDestroy(s);
}

GPTConfig Config() {
  GPTConfig c;
  c.num_layers = 3;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.ffn_hidden_size = 256;
  c.seq_length = c.max_position_embeddings = 64;
  c.vocab_size = 1000;
  c.padded_vocab_size = 1024;
  c.hidden_dropout = c.attention_dropout = 0.1;
  return c;
}

struct Batch {
  std::vector<int32_t> tokens, labels, positions;
  std::vector<float> mask;
  std::vector<int64_t> keys;
  Batch(int step, int m) {
    for (int64_t i = 0; i < 4 * 64; ++i) {
      const int64_t x = i * 37 + step * 13 + m * 7;
      tokens.push_back(static_cast<int32_t>(x % 997));
      labels.push_back(static_cast<int32_t>((x * 11 + 3) % 997));
      positions.push_back(static_cast<int32_t>(i % 64));
      mask.push_back(x % 7 == 6 ? 0.0f : 1.0f);
    }
    keys = {8 * step + 4 * m, 8 * step + 4 * m + 1, 8 * step + 4 * m + 2, 8 * step + 4 * m + 3};
  }
  ModelBatch View() const { return {4, 64, tokens.data(), labels.data(), positions.data(), mask.data(), keys.data()}; }
};

struct Trace {
  std::vector<double> losses, norms;
  std::vector<float> params, m, v;
};

// One rank's run: micro-batches of its own, ZeRO-1 over comm's ranks with `zero`. Under ZeRO-1 the
// weights and moments come from every rank's range, gathered as a checkpoint gathers them (a
// rank's ReadParams of the whole model is refused while its master is a shard of several).
Trace Train(Precision precision, Communicator* comm, bool zero, bool overlap, double clip_grad = 1.0) {
  Trace t;
  auto model = cuda::CreateCudaGPTModel(Config(), precision, 0, /*deterministic=*/true, 4);
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return t;
  const int64_t n = (*model)->num_params();
  if (zero) {
    EXPECT_TRUE((*model)->ShardOptimizerState(*ParamShard::Create(n, comm->size(), comm->rank())).ok());
  }
  EXPECT_TRUE((*model)->InitWeights(5).ok());
  OptimizerConfig oc;
  oc.clip_grad = clip_grad;
  oc.overlap_grad_reduce = overlap;
  oc.ddp_bucket_size = 60000;  // several buckets
  SchedulerConfig sc;
  sc.max_lr = 3e-3;
  sc.min_lr = 3e-4;
  sc.decay_style = "cosine";
  sc.decay_steps = 100;
  sc.start_wd = sc.end_wd = 0.1;
  sc.wd_incr_steps = 100;
  TrainStep opt(model->get(), oc, sc, comm);
  if (overlap) {
    EXPECT_GT(opt.buckets().size(), 2u);
  }
  for (int step = 0; step < 5; ++step) {
    Batch a(step, 2 * comm->rank()), b(step, 2 * comm->rank() + 1);
    auto r = opt.Step({a.View(), b.View()}, 8 * comm->size(), 77);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return t;
    t.losses.push_back(r->lm_loss());
    t.norms.push_back(r->grad_norm);
  }
  t.params.assign(static_cast<size_t>(n), 0.0f);
  t.m.assign(static_cast<size_t>(n), 0.0f);
  t.v.assign(static_cast<size_t>(n), 0.0f);
  if (!zero) {
    EXPECT_TRUE((*model)->ReadParams(t.params).ok());
    EXPECT_TRUE((*model)->ReadMoments(t.m, t.v).ok());
    return t;
  }
  if (precision != Precision::kFp32 && comm->size() > 1) {
    std::vector<float> whole(static_cast<size_t>(n));
    EXPECT_TRUE(absl::IsFailedPrecondition((*model)->ReadParams(whole))) << "the master is a shard";
  }
  const int64_t begin = (*model)->moments_begin(), size = (*model)->moments_size();
  EXPECT_TRUE((*model)->ReadOwnedParams(std::span<float>(t.params).subspan(begin, size)).ok());
  EXPECT_TRUE((*model)
                  ->ReadMoments(std::span<float>(t.m).subspan(begin, size), std::span<float>(t.v).subspan(begin, size))
                  .ok());
  std::vector<int64_t> bytes = (*model)->shard()->Counts();
  for (int64_t& x : bytes) x *= 4;
  for (std::vector<float>* buf : {&t.params, &t.m, &t.v}) EXPECT_TRUE(comm->AllGather(buf->data(), bytes).ok());
  return t;
}

void ExpectSame(const Trace& a, const Trace& b, const std::string& what) {
  EXPECT_EQ(a.losses, b.losses) << what;
  EXPECT_EQ(a.norms, b.norms) << what;
  ASSERT_EQ(a.params.size(), b.params.size()) << what;
  EXPECT_EQ(std::memcmp(a.params.data(), b.params.data(), a.params.size() * 4), 0) << what << ": weights";
  EXPECT_EQ(std::memcmp(a.m.data(), b.m.data(), a.m.size() * 4), 0) << what << ": exp_avg";
  EXPECT_EQ(std::memcmp(a.v.data(), b.v.data(), a.v.size() * 4), 0) << what << ": exp_avg_sq";
}

// Point to point (pipeline stages): a world of one has no peer, so a message to or from itself or a
// rank outside is refused naming it; a call with neither a send nor a receive does nothing. (Two ranks
// exchanging need two GPUs: cuda_train_cli_test's TwoPipelineStagesOnTwoGpusFollowOneGpu.)
TEST(NcclOfOne, PointToPointRefusesRanksThatAreNotPeers) {
  auto comm = NcclOfOne();
  ASSERT_TRUE(comm);
  std::vector<float> x(8, 1.0f), y(8, 0.0f);
  const int64_t bytes = static_cast<int64_t>(x.size() * sizeof(float));
  for (int peer : {0, 1}) {
    const absl::Status send = comm->SendRecv(x.data(), bytes, peer, nullptr, 0, -1);
    EXPECT_TRUE(absl::IsInvalidArgument(send)) << send;
    EXPECT_NE(send.message().find("to or from rank " + std::to_string(peer)), std::string_view::npos) << send;
    EXPECT_TRUE(absl::IsInvalidArgument(comm->SendRecv(nullptr, 0, -1, y.data(), bytes, peer)));
  }
  EXPECT_TRUE(comm->SendRecv(nullptr, 0, -1, nullptr, 0, -1).ok());
  EXPECT_EQ(y, std::vector<float>(8, 0.0f));
  // The device-memory twin (the stages' direct exchange) refuses alike, and asks for a stream.
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, static_cast<size_t>(bytes)), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  for (int peer : {0, 1}) {
    const absl::Status send = comm->SendRecvDevice(d, bytes, peer, nullptr, 0, -1, stream);
    EXPECT_TRUE(absl::IsInvalidArgument(send)) << send;
    EXPECT_NE(send.message().find("to or from rank " + std::to_string(peer)), std::string_view::npos) << send;
    EXPECT_TRUE(absl::IsInvalidArgument(comm->SendRecvDevice(nullptr, 0, -1, d, bytes, peer, stream)));
  }
  EXPECT_TRUE(comm->SendRecvDevice(nullptr, 0, -1, nullptr, 0, -1, stream).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(comm->SendRecvDevice(nullptr, 0, -1, nullptr, 0, -1, nullptr)));
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaStreamDestroy(stream);
  cudaFree(d);
}

TEST(NcclOfOne, OverlapAndDistributedOptimizerEqualThePlainStep) {
  for (Precision p : {Precision::kFp32, Precision::kBf16}) {
    const std::string name(PrecisionName(p));
    auto local = MakeLocalCommunicator();
    auto nccl = NcclOfOne();
    ASSERT_TRUE(nccl);
    const Trace plain = Train(p, local.get(), false, false);
    ExpectSame(plain, Train(p, nccl.get(), false, false), name + ": NCCL all-reduce");
    ExpectSame(plain, Train(p, nccl.get(), false, true), name + ": NCCL, overlapped");
    ExpectSame(plain, Train(p, nccl.get(), true, false), name + ": NCCL, distributed optimizer");
    ExpectSame(plain, Train(p, nccl.get(), true, true), name + ": NCCL, distributed optimizer overlapped");
  }
}

// Several ranks on one GPU: gloo ranks as threads, each with its own CUDA model (gradients through
// the host). Under ZeRO-1 in bf16 each rank keeps the fp32 master of its shard only and the
// LayerNorms' fp32 copy whole; with clipping off (the norm's partials are summed in another order
// on CUDA) the sharded run has the plain all-reduce's bits: losses, weights (gathered from every
// rank's ReadOwnedParams, as a checkpoint gathers them) and moments, also with the reduction
// overlapped in buckets.
TEST(GlooRanksOnOneGpu, ShardedMasterEqualsThePlainAllReduce) {
  for (Precision p : {Precision::kBf16, Precision::kFp32}) {
    for (int world : {2, 3}) {
      const std::string name = std::string(PrecisionName(p)) + ", " + std::to_string(world) + " ranks";
      const size_t w = static_cast<size_t>(world);
      std::vector<Trace> plain(w), zero(w), zero_overlap(w);
      auto run = [&](std::vector<Trace>* out, bool z, bool overlap) {
        testing::RunRanks(world, [&](Communicator* comm, int rank) {
          (*out)[static_cast<size_t>(rank)] = Train(p, comm, z, overlap, /*clip_grad=*/0);
        });
      };
      run(&plain, false, false);
      run(&zero, true, false);
      run(&zero_overlap, true, true);
      for (size_t r = 0; r < w; ++r) {
        const std::string who = name + ", rank " + std::to_string(r);
        for (const Trace* t : {&zero[r], &zero_overlap[r]}) {
          const std::string what = who + (t == &zero[r] ? "" : ", overlapped");
          EXPECT_EQ(plain[r].losses, t->losses) << what;
          ASSERT_EQ(plain[r].norms.size(), t->norms.size()) << what;
          for (size_t i = 0; i < t->norms.size(); ++i) EXPECT_NEAR(plain[r].norms[i], t->norms[i], 1e-9 * t->norms[i]);
          ASSERT_EQ(plain[r].params.size(), t->params.size()) << what;
          EXPECT_EQ(std::memcmp(plain[r].params.data(), t->params.data(), t->params.size() * 4), 0)
              << what << ": weights";
          EXPECT_EQ(std::memcmp(plain[r].m.data(), t->m.data(), t->m.size() * 4), 0) << what << ": exp_avg";
          EXPECT_EQ(std::memcmp(plain[r].v.data(), t->v.data(), t->v.size() * 4), 0) << what << ": exp_avg_sq";
        }
      }
      // The ranks trained one model: every rank's weights are rank 0's.
      for (size_t r = 1; r < w; ++r)
        EXPECT_EQ(std::memcmp(plain[0].params.data(), plain[r].params.data(), plain[0].params.size() * 4), 0) << name;
    }
  }
}

// ptk-train, found as cuda_train_cli_test finds it (PTK_TRAIN or PATH).
std::string PtkTrain() {
  if (const char* env = std::getenv("PTK_TRAIN")) return env;
  const char* path = std::getenv("PATH");
  std::string p = path ? path : "";
  for (size_t start = 0; start <= p.size();) {
    size_t end = p.find(':', start);
    if (end == std::string::npos) end = p.size();
    const std::string c = p.substr(start, end - start) + "/ptk-train";
    if (::access(c.c_str(), X_OK) == 0) return c;
    start = end + 1;
  }
  return "";
}

std::string Shell(const std::string& cmd, int* rc) {
  std::string out;
  FILE* f = ::popen((cmd + " 2>&1").c_str(), "r");
  char buf[4096];
  size_t got;
  while (f && (got = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, got);
  const int status = f ? ::pclose(f) : -1;
  *rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

std::vector<std::string> LossFields(const std::string& out) {
  std::vector<std::string> v;
  static const std::regex re(R"(iteration +\d+/ *\d+ \|.*?( lm loss: \S+ \|).*?( grad norm: \S+ \|))");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator(); ++it)
    v.push_back((*it)[1].str() + (*it)[2].str());
  return v;
}

TEST(NcclOfOne, PtkTrainWithNcclMatchesThePlainRun) {
  const std::string bin = PtkTrain();
  if (bin.empty()) GTEST_SKIP() << "no ptk-train (set PTK_TRAIN or PATH)";
  const std::string base = bin +
                           " --device cuda --bf16 --num-layers 2 --hidden-size 128 --num-attention-heads 4"
                           " --seq-length 128 --micro-batch-size 4 --global-batch-size 16 --train-iters 10"
                           " --lr 1e-3 --mock-data --eval-iters 0 --log-interval 1 --deterministic-mode";
  int rc = -1;
  const std::string plain = Shell(base, &rc);
  ASSERT_EQ(rc, 0) << plain;
  const std::string nccl = Shell(base +
                                     " --distributed-backend nccl --use-distributed-optimizer --overlap-grad-reduce"
                                     " --ddp-bucket-size 100000",
                                 &rc);
  ASSERT_EQ(rc, 0) << nccl;
  EXPECT_NE(nccl.find("gradient bucket(s)"), std::string::npos) << nccl;
  ASSERT_EQ(LossFields(plain).size(), 10u) << plain;
  EXPECT_EQ(LossFields(plain), LossFields(nccl)) << nccl;
}

// Two NCCL ranks (threads, a GPU each; skipped with fewer than two GPUs): rank 1 reports its own
// failure (ReportRankFailure) after the data group {0, 1} is made, and never calls it; rank 0's
// all-reduce over that group ends through its watchdog, which hears the failure through the store,
// and fails naming rank 0, the data group, the call, rank 1 and its reason (it said "rank 0 (host H,
// cuda:0): NCCL aborted: ...", without the group or the call), well within the 60 s timeout.
TEST(NcclOfTwo, AReportedFailureEndsAPeersCollectiveNamingItsGroupAndCall) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 2) GTEST_SKIP() << "needs two GPUs; " << gpus << " visible";
  const int port = testing::NextPort();
  std::atomic<bool> done{false};
  auto make = [port](int rank) {
    cuda::NcclOptions o;
    o.rank = o.local_rank = rank;
    o.world_size = 2;
    o.master_port = port;
    o.timeout = std::chrono::seconds(60);
    return cuda::MakeNcclCommunicator(o);
  };
  std::thread rank1([&] {
    auto world = make(1);
    ASSERT_TRUE(world.ok()) << world.status();
    auto data = (*world)->Subgroup(std::vector<int>{0, 1}, "data");
    ASSERT_TRUE(data.ok()) << data.status();
    ReportRankFailure(world->get(), absl::DataLossError("iter_0000004: checksum mismatch"));
    while (!done) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  });
  auto world = make(0);
  ASSERT_TRUE(world.ok()) << world.status();
  auto data = (*world)->Subgroup(std::vector<int>{0, 1}, "data");
  ASSERT_TRUE(data.ok()) << data.status();
  const auto t0 = std::chrono::steady_clock::now();
  float x[4] = {1, 2, 3, 4};
  const absl::Status st = (*data)->AllReduceSum(x, 4);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  done = true;
  rank1.join();
  EXPECT_EQ(st.message(), "rank 0 of the data group (world rank 0) (host " + HostName() +
                              ", cuda:0): all-reduce failed: rank 1 (host " + HostName() +
                              ") stopped: iter_0000004: checksum mismatch")
      << st;
  EXPECT_LT(seconds, 30) << st;
}

}  // namespace
}  // namespace ptk
