// Megatron's tensor-parallel pieces of the CPU model that are not plain products: the
// vocabulary-parallel embedding (each tensor rank its slice of the padded vocabulary's rows) and
// cross-entropy (max and sum of exponentials over the tensor group: no rank holds whole logits),
// and the gather of the logits' slices for the callers that want them whole (text samples).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "trainer/comm.h"

namespace ptk::cpu {

// out(n, c) = wte[tokens[i] - v0] for tokens in [v0, v0 + rows), zeros for the others (the sum over
// the tensor group, all-reduced by the caller, is the whole embedding's row).
void VocabSliceEmbeddingForward(float* out, const int32_t* tokens, const float* wte, int64_t v0, int64_t rows,
                                int64_t n, int64_t c);
// dwte[tokens[i] - v0] += dout[i] for the tokens of the slice, in row order per channel block (the
// same order as EmbeddingBackward); dwpe[positions[i]] += dout[i] for every token.
void VocabSliceEmbeddingBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                                 const int32_t* positions, int64_t v0, int64_t rows, int64_t n, int64_t c);

// The cross-entropy of logits whose columns are split over `tensor` (this rank's `logits`(n, vt):
// columns v0.. of the padded vocabulary): losses(n) on every rank. With `dlosses`, the slice is
// overwritten with its gradient (softmax - onehot) * dlosses[i]. `work`: scratch.
absl::Status VocabParallelCrossEntropy(float* logits, float* losses, const int32_t* targets, const float* dlosses,
                                       int64_t n, int64_t vt, int64_t v0, Communicator* tensor,
                                       std::vector<float>* work);

// The (n, vt * ranks) logits from every rank's (n, vt) slice.
absl::Status GatherVocabParallelLogits(const float* slice, int64_t n, int64_t vt, Communicator* tensor,
                                       std::vector<float>* whole);

}  // namespace ptk::cpu
