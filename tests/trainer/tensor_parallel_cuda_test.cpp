// The CUDA model's tensor-parallel ops (tensor_parallel_cuda.cu, the embedding backward's vocabulary
// slice) against their CPU twins (trainer/cpu/tensor_parallel_cpu.h) at T = 2 and 4 in one process
// on one GPU: each rank's slice runs on the device, and the collectives between the passes (which
// NCCL runs between processes) are done here on the host: an all-gather is the slices side by side,
// an all-reduce their sum. The vocabulary-parallel cross-entropy must give the whole-vocabulary
// op's losses and, slice by slice, its gradient. gpu-labelled: exit 77 without a device.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/trainer/ops_cuda_test_util.cuh"
#include "trainer/cpu/ops_cpu.h"
#include "trainer/cuda/ops_cuda.h"

// The CPU twins this file calls, as trainer/cpu/tensor_parallel_cpu.h declares them (that header
// names the Communicator, whose std::span the CUDA files' C++17 lacks).
namespace ptk::cpu {
void VocabSliceEmbeddingForward(float* out, const int32_t* tokens, const float* wte, int64_t v0, int64_t rows,
                                int64_t n, int64_t c);
void VocabSliceEmbeddingBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                                 const int32_t* positions, int64_t v0, int64_t rows, int64_t n, int64_t c);
}  // namespace ptk::cpu

namespace ptk::cuda {
namespace {

using namespace ops_test;  // NOLINT

template <typename T>
class TensorParallelCuda : public CudaOps {};
TYPED_TEST_SUITE(TensorParallelCuda, ActivationTypes, TypeNames);

// Each rank's slice gives the CPU twin's bits (a copy or zeros); their sum over the ranks, finished
// with the position embeddings, is the whole embedding's row in every mode (one nonzero term).
TYPED_TEST(TensorParallelCuda, VocabSliceEmbeddingSumsToTheWholeEmbedding) {
  using T = TypeParam;
  const int64_t n = 37, c = 70, vocab = 64, positions_rows = 16;
  std::mt19937 gen(3);
  std::vector<int32_t> tokens(n), positions(n);
  for (int64_t i = 0; i < n; ++i) {
    tokens[i] = static_cast<int32_t>(gen() % vocab);
    positions[i] = static_cast<int32_t>(i % positions_rows);
  }
  const auto wte = RoundTrip<T>(Normal(vocab * c, 4)), wpe = RoundTrip<T>(Normal(positions_rows * c, 5));
  std::vector<float> whole(n * c);
  cpu::EmbeddingForward(whole.data(), tokens.data(), positions.data(), wte.data(), wpe.data(), n, c);
  DeviceArray<int32_t> dtok(tokens), dpos(positions);
  DeviceArray<T> dwpe(ToT<T>(wpe));
  for (int ranks : {2, 4}) {
    const int64_t rows = vocab / ranks;
    std::vector<float> sum(n * c, 0.0f);
    for (int r = 0; r < ranks; ++r) {
      const std::vector<float> slice(wte.begin() + r * rows * c, wte.begin() + (r + 1) * rows * c);
      std::vector<float> want(n * c);
      cpu::VocabSliceEmbeddingForward(want.data(), tokens.data(), slice.data(), r * rows, rows, n, c);
      DeviceArray<T> dslice(ToT<T>(slice));
      DeviceArray<float> dout(n * c);
      ASSERT_OK(VocabSliceEmbeddingForward<T>(dout.get(), dtok.get(), dslice.get(), r * rows, rows, n, c, this->ctx_));
      const auto got = dout.Download();
      ExpectBitwise(got, want, "rank " + std::to_string(r) + " of " + std::to_string(ranks));
      for (size_t k = 0; k < sum.size(); ++k) sum[k] += got[k];
    }
    DeviceArray<float> dsum(sum);
    DeviceArray<T> dres(n * c);
    ASSERT_OK(TensorSumFinish<T>(dres.get(), dsum.get(), static_cast<const T*>(nullptr), dpos.get(), dwpe.get(), n, c,
                                 this->ctx_));
    ExpectBitwise(dres.Download(), ToT<T>(whole), "summed over " + std::to_string(ranks) + " ranks");
  }
}

// A row-parallel product's finish: the fp32 sum plus the bias, rounded once to T.
TYPED_TEST(TensorParallelCuda, TensorSumFinishAddsTheBiasOnce) {
  using T = TypeParam;
  const int64_t n = 9, c = 33;
  const auto sum = Normal(n * c, 6), bias = RoundTrip<T>(Normal(c, 7));
  std::vector<float> want(n * c);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < c; ++j) want[i * c + j] = sum[i * c + j] + bias[j];
  DeviceArray<float> dsum(sum);
  DeviceArray<T> dbias(ToT<T>(bias)), dout(n * c);
  ASSERT_OK(TensorSumFinish<T>(dout.get(), dsum.get(), dbias.get(), nullptr, static_cast<const T*>(nullptr), n, c,
                               this->ctx_));
  ExpectBitwise(dout.Download(), ToT<T>(want), "bias");
}

// The embedding backward over a vocabulary slice: tokens outside it add to the position gradient
// only, in the CPU twin's order of additions (its bits).
TYPED_TEST(TensorParallelCuda, EmbeddingBackwardOverASliceMatchesCpu) {
  using T = TypeParam;
  const int64_t n = 45, c = 24, vocab = 40, positions_rows = 12, ranks = 2, rows = vocab / ranks;
  std::mt19937 gen(8);
  std::vector<int32_t> tokens(n), positions(n);
  for (int64_t i = 0; i < n; ++i) {
    tokens[i] = i % 4 == 0 ? 3 : static_cast<int32_t>(gen() % vocab);
    positions[i] = static_cast<int32_t>(i % positions_rows);
  }
  const auto dy = RoundTrip<T>(Normal(n * c, 9));
  DeviceArray<int32_t> dtok(tokens), dpos(positions);
  DeviceArray<T> ddy(ToT<T>(dy));
  EmbeddingBackwardPlan plan;
  ASSERT_OK(plan.Reserve(n));
  for (int64_t r = 0; r < ranks; ++r) {
    const auto gte0 = Normal(rows * c, 10 + r), gpe0 = Normal(positions_rows * c, 12);
    std::vector<float> gte = gte0, gpe = gpe0;
    cpu::VocabSliceEmbeddingBackward(gte.data(), gpe.data(), dy.data(), tokens.data(), positions.data(), r * rows, rows,
                                     n, c);
    DeviceArray<float> dgte(gte0), dgpe(gpe0);
    ASSERT_OK(EmbeddingBackward<T>(dgte.get(), dgpe.get(), ddy.get(), dtok.get(), dpos.get(), tokens.data(),
                                   positions.data(), n, c, rows, positions_rows, &plan, this->ctx_, r * rows));
    ExpectBitwise(dgte.Download(), gte, "dwte slice " + std::to_string(r));
    ExpectBitwise(dgpe.Download(), gpe, "dwpe slice " + std::to_string(r));
  }
}

// The three passes with the host doing the collectives: the losses of the whole-vocabulary op
// within 1e-5, and each slice's gradient the whole gradient's columns within its tolerance.
TYPED_TEST(TensorParallelCuda, VocabParallelCrossEntropyMatchesTheWholeVocabulary) {
  using T = TypeParam;
  const int64_t n = 19, vp = 512;
  auto raw = Normal(n * vp, 30, 0.0f, 3.0f);
  for (int64_t i = 0; i < n; ++i) raw[i * vp + (i * 37) % vp] = 25.0f;  // a dominant column in one slice or another
  const auto logits = RoundTrip<T>(raw);
  std::vector<int32_t> targets(n);
  std::vector<float> dl(n);
  std::mt19937 gen(31);
  for (int64_t i = 0; i < n; ++i) {
    targets[i] = static_cast<int32_t>(gen() % vp);
    dl[i] = i % 5 == 4 ? 0.0f : 0.25f + static_cast<float>(gen() % 1000) / 1000.0f;
  }
  std::vector<float> losses(n), grad = logits;
  cpu::SoftmaxCrossEntropyFused(grad.data(), losses.data(), targets.data(), dl.data(), n, vp);
  DeviceArray<int32_t> dtargets(targets);
  DeviceArray<float> ddl(dl);
  for (int ranks : {2, 4}) {
    const int64_t vt = vp / ranks;
    std::vector<std::unique_ptr<DeviceArray<T>>> slices;
    std::vector<float> maxima(ranks * n), sums(n, 0.0f), target(n, 0.0f);
    for (int r = 0; r < ranks; ++r) {  // pass 1 on every rank, then the all-gather and the target's all-reduce
      std::vector<float> slice(n * vt);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < vt; ++j) slice[i * vt + j] = logits[i * vp + r * vt + j];
      slices.push_back(std::make_unique<DeviceArray<T>>(ToT<T>(slice)));
      DeviceArray<float> dmax(n), dtarget(n);
      ASSERT_OK(VocabParallelXentLocal<T>(dmax.get(), dtarget.get(), slices.back()->get(), dtargets.get(), n, vt,
                                          r * vt, this->ctx_));
      const auto m = dmax.Download(), t = dtarget.Download();
      for (int64_t i = 0; i < n; ++i) {
        maxima[r * n + i] = m[i];
        target[i] += t[i];
      }
    }
    std::vector<float> global;
    for (int r = 0; r < ranks; ++r) {  // pass 2, then the sums' all-reduce
      DeviceArray<float> dmaxima(maxima), dglobal(n), dsums(n);
      ASSERT_OK(VocabParallelXentSums<T>(dglobal.get(), dsums.get(), dmaxima.get(), ranks, slices[r]->get(), n, vt,
                                         this->ctx_));
      const auto s = dsums.Download();
      for (int64_t i = 0; i < n; ++i) sums[i] += s[i];
      global = dglobal.Download();
    }
    for (int r = 0; r < ranks; ++r) {  // pass 3
      DeviceArray<float> dglobal(global), dsums(sums), dtarget(target), dlosses(n);
      ASSERT_OK(VocabParallelXentFinish<T>(slices[r]->get(), dlosses.get(), dglobal.get(), dsums.get(), dtarget.get(),
                                           dtargets.get(), ddl.get(), n, vt, r * vt, this->ctx_));
      const std::string what = "rank " + std::to_string(r) + " of " + std::to_string(ranks);
      ExpectClose(dlosses.Download(), losses, 1e-5, 1e-5, "losses, " + what);
      const auto got = ToF(slices[r]->Download());
      int64_t bad = 0;
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < vt; ++j) {
          const double want = grad[i * vp + r * vt + j];
          const double abs = r * vt + j == targets[i] ? 1e-6 * std::fabs(dl[i]) : 1e-12;
          const double tol = (1e-5 + Prec<T>::ulp) * std::fabs(want) + abs + Prec<T>::floor;
          if (!(std::fabs(got[i * vt + j] - want) <= tol)) ++bad;
        }
      EXPECT_EQ(bad, 0) << "dlogits, " << what;
    }
  }
}

}  // namespace
}  // namespace ptk::cuda
