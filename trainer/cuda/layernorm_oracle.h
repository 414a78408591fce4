// LayerNorm's backward as it ran before the warp-per-row kernel (a block's rows in series, one
// set of dw/db partials per block): the oracle that kernel is tested against
// (CudaModelOptions::unfused.layernorm_rows_in_series), and what LayerNormBackward falls back to
// where four sets of partials (8c floats) do not fit in shared memory. Arguments as
// LayerNormBackward's (ops_cuda.h).
#pragma once

#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda {

template <typename T>
absl::Status LayerNormBackwardRowsInSeries(T* dinp, float* dw, float* db, const T* dout, const T* inp, const float* w,
                                           const float* mean, const float* rstd, int64_t n, int64_t c, float* scratch,
                                           const CudaContext& ctx, T* dbranch = nullptr, const LnDropout& drop = {});

}  // namespace ptk::cuda
