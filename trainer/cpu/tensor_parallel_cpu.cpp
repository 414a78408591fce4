// Vocabulary-parallel embedding and cross-entropy on the CPU, over the tensor group.
#include "trainer/cpu/tensor_parallel_cpu.h"

#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/status.h"

namespace ptk::cpu {
namespace {
constexpr int64_t kChannelBlock = 64;
bool InSlice(int32_t token, int64_t v0, int64_t rows) { return token >= v0 && token < v0 + rows; }
}  // namespace

void VocabSliceEmbeddingForward(float* out, const int32_t* tokens, const float* wte, int64_t v0, int64_t rows,
                                int64_t n, int64_t c) {
  tbb::parallel_for(int64_t{0}, n, [&](int64_t i) {
    float* y = out + i * c;
    if (!InSlice(tokens[i], v0, rows)) {
      std::fill(y, y + c, 0.0f);
      return;
    }
    const float* a = wte + (tokens[i] - v0) * c;
    std::copy(a, a + c, y);
  });
}

void VocabSliceEmbeddingBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                                 const int32_t* positions, int64_t v0, int64_t rows, int64_t n, int64_t c) {
  const int64_t blocks = (c + kChannelBlock - 1) / kChannelBlock;
  tbb::parallel_for(int64_t{0}, blocks, [&](int64_t blk) {
    const int64_t j0 = blk * kChannelBlock, j1 = std::min(c, j0 + kChannelBlock);
    for (int64_t i = 0; i < n; ++i) {
      const float* dy = dout + i * c;
      if (dwpe) {
        float* p = dwpe + static_cast<int64_t>(positions[i]) * c;
        for (int64_t j = j0; j < j1; ++j) p[j] += dy[j];
      }
      if (!InSlice(tokens[i], v0, rows)) continue;
      float* a = dwte + (tokens[i] - v0) * c;
      for (int64_t j = j0; j < j1; ++j) a[j] += dy[j];
    }
  });
}

absl::Status VocabParallelCrossEntropy(float* logits, float* losses, const int32_t* targets, const float* dlosses,
                                       int64_t n, int64_t vt, int64_t v0, Communicator* tensor,
                                       std::vector<float>* work) {
  const int T = tensor->size(), me = tensor->rank();
  // work: [T][n] row maxima (all-gathered), then [n] sums of exponentials and [n] target logits.
  work->assign(static_cast<size_t>((T + 2) * n), 0.0f);
  float* maxima = work->data();
  float* sums = maxima + T * n;
  float* target = sums + n;
  tbb::parallel_for(int64_t{0}, n, [&](int64_t i) {
    const float* row = logits + i * vt;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < vt; ++j) m = std::max(m, row[j]);
    maxima[me * n + i] = m;
    target[i] = InSlice(targets[i], v0, vt) ? row[targets[i] - v0] : 0.0f;
  });
  std::vector<int64_t> bytes(static_cast<size_t>(T), n * static_cast<int64_t>(sizeof(float)));
  PTK_RETURN_IF_ERROR(tensor->AllGather(maxima, bytes));
  std::vector<double> sum_exp(static_cast<size_t>(n));
  tbb::parallel_for(int64_t{0}, n, [&](int64_t i) {
    float m = maxima[i];
    for (int r = 1; r < T; ++r) m = std::max(m, maxima[r * n + i]);
    maxima[i] = m;
    float* row = logits + i * vt;
    double s = 0;
    for (int64_t j = 0; j < vt; ++j) {
      row[j] = std::exp(row[j] - m);
      s += row[j];
    }
    sum_exp[static_cast<size_t>(i)] = s;
  });
  PTK_RETURN_IF_ERROR(SumInRankOrder(sum_exp.data(), n, tensor));
  PTK_RETURN_IF_ERROR(tensor->AllReduceSum(target, n));  // one rank holds each target's logit; the others add 0
  tbb::parallel_for(int64_t{0}, n, [&](int64_t i) {
    const double s = sum_exp[static_cast<size_t>(i)];
    losses[i] = static_cast<float>(std::log(s) + static_cast<double>(maxima[i]) - static_cast<double>(target[i]));
    if (!dlosses) return;
    float* row = logits + i * vt;
    const float d = dlosses[i], scale = static_cast<float>(static_cast<double>(d) / s);
    for (int64_t j = 0; j < vt; ++j) row[j] *= scale;
    if (InSlice(targets[i], v0, vt)) row[targets[i] - v0] -= d;
  });
  return absl::OkStatus();
}

absl::Status GatherVocabParallelLogits(const float* slice, int64_t n, int64_t vt, Communicator* tensor,
                                       std::vector<float>* whole) {
  const int T = tensor->size();
  std::vector<float> all(static_cast<size_t>(T * n * vt));
  std::copy(slice, slice + n * vt, all.begin() + tensor->rank() * n * vt);
  std::vector<int64_t> bytes(static_cast<size_t>(T), n * vt * static_cast<int64_t>(sizeof(float)));
  PTK_RETURN_IF_ERROR(tensor->AllGather(all.data(), bytes));
  whole->assign(static_cast<size_t>(n * vt * T), 0.0f);
  for (int r = 0; r < T; ++r)
    for (int64_t i = 0; i < n; ++i)
      std::copy(all.begin() + (r * n + i) * vt, all.begin() + (r * n + i + 1) * vt,
                whole->begin() + i * vt * T + r * vt);
  return absl::OkStatus();
}

}  // namespace ptk::cpu
