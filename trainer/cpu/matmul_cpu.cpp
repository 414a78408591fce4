// Matrix products through OpenBLAS's cblas (no hand-written GEMM), forward and backward.
#include <cblas.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "trainer/cpu/flush_denormals.h"
#include "trainer/cpu/ops_cpu.h"

namespace ptk::cpu {

namespace {
// GEMM tiles of C: fixed sizes, so how C is cut never depends on the thread count. OpenBLAS picks
// its kernel (and so the rounding) by the problem's shape and by its own thread count; ptk-train
// runs OpenBLAS single-threaded and spreads these tiles over oneTBB's threads instead, so the
// same product gives the same bits with 1 or 32 threads.
constexpr int64_t kTileRows = 256, kTileCols = 1024;
}  // namespace

template <typename T>
void GemmTiles(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
               int64_t ldb, T beta, T* c, int64_t ldc, const GemmTileFilter& needed) {
  constexpr auto gemm = [] {
    if constexpr (std::is_same_v<T, float>)
      return &cblas_sgemm;
    else
      return &cblas_dgemm;
  }();
  const int64_t row_tiles = (m + kTileRows - 1) / kTileRows, col_tiles = (n + kTileCols - 1) / kTileCols;
  tbb::parallel_for(int64_t{0}, row_tiles * col_tiles, [&](int64_t tile) {
    const int64_t i0 = tile / col_tiles * kTileRows, j0 = tile % col_tiles * kTileCols;
    const int64_t mi = std::min(kTileRows, m - i0), nj = std::min(kTileCols, n - j0);
    if (needed && !needed(i0, mi, j0, nj)) return;
    // Row i of op(A) and column j of op(B) in row-major storage.
    const T* ai = ta ? a + i0 : a + i0 * lda;
    const T* bj = tb ? b + j0 * ldb : b + j0;
    const ScopedFlushDenormals flush;  // on this thread, for this tile only (flush_denormals.h)
    gemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, static_cast<int>(mi),
         static_cast<int>(nj), static_cast<int>(k), alpha, ai, static_cast<int>(lda), bj, static_cast<int>(ldb), beta,
         c + i0 * ldc + j0, static_cast<int>(ldc));
  });
}

template <typename T>
void Gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b, int64_t ldb,
          T beta, T* c, int64_t ldc) {
  GemmTiles<T>(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, nullptr);
}

template <typename T>
void MatmulForward(T* out, const T* inp, const T* w, const T* bias, int64_t n, int64_t ic, int64_t oc) {
  if (bias) {
    for (int64_t i = 0; i < n; ++i) {
      T* row = out + i * oc;
      for (int64_t j = 0; j < oc; ++j) row[j] = bias[j];
    }
  }
  Gemm<T>(false, true, n, oc, ic, T(1), inp, ic, w, ic, bias ? T(1) : T(0), out, oc);
}

template <typename T>
void MatmulBackward(T* dinp, T* dw, T* dbias, const T* dout, const T* inp, const T* w, int64_t n, int64_t ic,
                    int64_t oc) {
  if (dinp) Gemm<T>(false, false, n, ic, oc, T(1), dout, oc, w, ic, T(1), dinp, ic);
  Gemm<T>(true, false, oc, ic, n, T(1), dout, oc, inp, ic, T(1), dw, ic);
  if (dbias) {
    // Column sums in a fixed order, accumulated in double per column.
    std::vector<double> acc(static_cast<size_t>(oc), 0.0);
    for (int64_t i = 0; i < n; ++i) {
      const T* row = dout + i * oc;
      for (int64_t j = 0; j < oc; ++j) acc[j] += row[j];
    }
    for (int64_t j = 0; j < oc; ++j) dbias[j] += static_cast<T>(acc[j]);
  }
}

#define PTK_INSTANTIATE(T)                                                                                          \
  template void Gemm<T>(bool, bool, int64_t, int64_t, int64_t, T, const T*, int64_t, const T*, int64_t, T, T*,      \
                        int64_t);                                                                                   \
  template void GemmTiles<T>(bool, bool, int64_t, int64_t, int64_t, T, const T*, int64_t, const T*, int64_t, T, T*, \
                             int64_t, const GemmTileFilter&);                                                       \
  template void MatmulForward<T>(T*, const T*, const T*, const T*, int64_t, int64_t, int64_t);                      \
  template void MatmulBackward<T>(T*, T*, T*, const T*, const T*, const T*, int64_t, int64_t, int64_t);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(double)
#undef PTK_INSTANTIATE

}  // namespace ptk::cpu
