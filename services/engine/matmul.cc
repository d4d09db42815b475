#include "engine/matmul.h"

#include <cblas.h>

#include <algorithm>

#include "common/thread_pool.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_MATMUL_AVX2 1
#endif

namespace pdserve::engine {
namespace {

// Output rows handled per task: big enough to amortize dispatch, small enough
// that both threads get work on narrow matrices.
constexpr int64_t kRowsPerTask = 64;

#ifdef PDSERVE_MATMUL_AVX2
inline float HorizontalSum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 shuf = _mm_movehdup_ps(lo);
  __m128 sums = _mm_add_ps(lo, shuf);
  shuf = _mm_movehl_ps(shuf, sums);
  sums = _mm_add_ss(sums, shuf);
  return _mm_cvtss_f32(sums);
}

// Rows [o, o + R) of w times rows [m, m + M) of x, R, M <= 4.
template <int R, int M>
inline void Tile(const float* x, int64_t in, const float* w, int64_t out,
                 float* y, int64_t m, int64_t o) {
  __m256 acc[R][M];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < M; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  const int64_t vec_end = in & ~int64_t{7};
  for (int64_t k = 0; k < vec_end; k += 8) {
    __m256 xv[M];
    for (int c = 0; c < M; ++c) xv[c] = _mm256_loadu_ps(x + (m + c) * in + k);
    for (int r = 0; r < R; ++r) {
      __m256 wv = _mm256_loadu_ps(w + (o + r) * in + k);
      for (int c = 0; c < M; ++c)
        acc[r][c] = _mm256_fmadd_ps(wv, xv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < M; ++c) {
      float sum = HorizontalSum(acc[r][c]);
      for (int64_t k = vec_end; k < in; ++k)
        sum += w[(o + r) * in + k] * x[(m + c) * in + k];
      y[(m + c) * out + o + r] = sum;
    }
  }
}
#else
template <int R, int M>
inline void Tile(const float* x, int64_t in, const float* w, int64_t out,
                 float* y, int64_t m, int64_t o) {
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < M; ++c) {
      float sum = 0;
      for (int64_t k = 0; k < in; ++k)
        sum += w[(o + r) * in + k] * x[(m + c) * in + k];
      y[(m + c) * out + o + r] = sum;
    }
  }
}
#endif

#ifndef PDSERVE_SKINNY_ACTIVATION_TILE
// Tiles of 4 weight rows x 3 activation rows: 12 accumulators + 3 activation
// vectors + 1 weight vector fill AVX2's 16 registers exactly (4 x 4 spills),
// and 7 loads feed 12 FMAs.
#define PDSERVE_SKINNY_ACTIVATION_TILE 3
#endif

template <int R>
inline void RowGroup(const float* x, int64_t n, int64_t in, const float* w,
                     int64_t out, float* y, int64_t o) {
  constexpr int kTile = PDSERVE_SKINNY_ACTIVATION_TILE;
  int64_t m = 0;
  for (; m + kTile <= n; m += kTile) Tile<R, kTile>(x, in, w, out, y, m, o);
  switch (n - m) {
    case 3:
      Tile<R, 3>(x, in, w, out, y, m, o);
      break;
    case 2:
      Tile<R, 2>(x, in, w, out, y, m, o);
      break;
    case 1:
      Tile<R, 1>(x, in, w, out, y, m, o);
      break;
    default:
      break;
  }
}

}  // namespace

void SkinnyMatMul(const float* x, int64_t n, int64_t in, const float* w,
                  int64_t out, float* y, ThreadPool& pool) {
  const int64_t tasks = (out + kRowsPerTask - 1) / kRowsPerTask;
  pool.ParallelFor(tasks, [&](int64_t task) {
    const int64_t begin = task * kRowsPerTask;
    const int64_t end = std::min(out, begin + kRowsPerTask);
    int64_t o = begin;
    for (; o + 4 <= end; o += 4) RowGroup<4>(x, n, in, w, out, y, o);
    for (; o < end; ++o) RowGroup<1>(x, n, in, w, out, y, o);
  });
}

void MatMulTransposedWeights(const float* x, int64_t n, int64_t in,
                             const float* w, int64_t out, float* y,
                             ThreadPool& pool) {
  if (n <= kSkinnyMatMulMaxRows) {
    SkinnyMatMul(x, n, in, w, out, y, pool);
    return;
  }
  // Wide inputs: single-threaded OpenBLAS sgemm per slice of output columns,
  // the slices spread over our pool. All parallelism stays in one pool, so
  // OpenBLAS's spinning workers never compete with ours for the cores.
  const int64_t slices = std::min<int64_t>(pool.num_threads(), (out + 15) / 16);
  pool.ParallelFor(slices, [&](int64_t slice) {
    const int64_t begin = (out * slice / slices) & ~int64_t{15};
    const int64_t end =
        slice + 1 == slices ? out : (out * (slice + 1) / slices) & ~int64_t{15};
    if (begin >= end) return;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(n),
                static_cast<int>(end - begin), static_cast<int>(in), 1.0f, x,
                static_cast<int>(in), w + begin * in, static_cast<int>(in),
                0.0f, y + begin, static_cast<int>(out));
  });
}

float DotProduct(const float* a, const float* b, int64_t n) {
#ifdef PDSERVE_MATMUL_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 =
        _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8),
                           _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) {
    acc0 =
        _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  }
  float sum = HorizontalSum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
#else
  float sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
#endif
}

void GemmRowMajor(bool transpose_b, int64_t m, int64_t n, int64_t k,
                  float alpha, const float* a, int64_t lda, const float* b,
                  int64_t ldb, float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans,
              transpose_b ? CblasTrans : CblasNoTrans, static_cast<int>(m),
              static_cast<int>(n), static_cast<int>(k), alpha, a,
              static_cast<int>(lda), b, static_cast<int>(ldb), 0.0f, c,
              static_cast<int>(ldc));
}

void Axpy(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

void UseSingleThreadedBlas() { openblas_set_num_threads(1); }

}  // namespace pdserve::engine
