// Internal to services/engine: the register-tiled micro-kernel behind every
// projection (PackedMatMul over f32 panels, WeightMatrix over f16 panels and
// dequantized panels of block-quantized rows) and the loop that walks panels
// and activation blocks. See matmul.h for the layout.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "engine/matmul.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_MATMUL_AVX2 1
#endif
#if defined(PDSERVE_MATMUL_AVX2) && defined(__F16C__)
#define PDSERVE_MATMUL_F16C 1
#endif

namespace pdserve::engine::internal {

// Activation rows per micro-kernel call: 6 rows x 2 vectors = 12 accumulators,
// plus 2 weight vectors and 1 broadcast: 15 of AVX2's 16 registers.
inline constexpr int kTileRows = 6;
// Cache blocking for wide inputs (prefill): a k-slice of a panel (16 x 384
// floats, 24 KiB) stays in L1 while every row tile of an activation block
// (192 rows x 384 floats, 288 KiB) streams from L2 into it. Measured on a
// Zen 3 VM (32 KiB L1d, 512 KiB L2) among 256/384/768 x 48/96/192.
inline constexpr int64_t kBlockCols = 384;
inline constexpr int64_t kBlockRows = 192;
// Inputs up to this size (all rows' activations, well inside L2) are
// multiplied panel by panel; larger ones are blocked by rows first.
inline constexpr int64_t kPanelMajorActivationBytes = 256 << 10;

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

// 16 panel weights of one k step as two f32 vectors: f32 panels load them,
// f16 panels (uint16_t) widen them in registers.
inline void LoadPanelStep(const float* p, __m256* lo, __m256* hi) {
  *lo = _mm256_load_ps(p);
  *hi = _mm256_load_ps(p + 8);
}
#ifdef PDSERVE_MATMUL_F16C
inline void LoadPanelStep(const uint16_t* p, __m256* lo, __m256* hi) {
  const __m256i halves = _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
  *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
  *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));
}
#endif

// y[R, cols] (+)= x[R, kc] · panel[kc, 16] for R <= kTileRows rows, where
// x[r, k] is at x + r * row_stride + k * k_stride (row-major activations, or
// a packed [k][kTileRows] tile) and y's rows are ldy apart; `cols` < 16 only
// for the last panel. Every loop over R is unrolled so the accumulators stay
// in registers (a rolled epilogue made GCC spill all twelve on every k step:
// 3x slower).
#ifdef __AVX512F__
// 16 panel weights of one k step as one 512-bit vector.
inline __m512 LoadPanelStep512(const float* p) { return _mm512_load_ps(p); }
inline __m512 LoadPanelStep512(const uint16_t* p) {
  return _mm512_cvtph_ps(
      _mm256_load_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

template <int R, typename W>
void MicroKernel(const float* __restrict x, int64_t row_stride,
                 int64_t k_stride, const W* __restrict panel, int64_t kc,
                 float* __restrict y, int64_t ldy, int64_t cols,
                 bool accumulate) {
#ifdef __AVX512F__
  // One 512-bit vector per row: half the FMAs of the 256-bit pair below,
  // the same products summed in the same order per output (measured 1.6x
  // on 512-row prefill products, Zen 5).
  if constexpr (std::is_same_v<W, float> || std::is_same_v<W, uint16_t>) {
    __m512 acc[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kc; ++k) {
      const __m512 w = LoadPanelStep512(panel + k * kPanelRows);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm512_fmadd_ps(
            _mm512_set1_ps(x[r * row_stride + k * k_stride]), w, acc[r]);
      }
    }
    const __mmask16 mask = cols == kPanelRows
                               ? __mmask16{0xFFFF}
                               : static_cast<__mmask16>((1u << cols) - 1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      float* out = y + r * ldy;
      if (accumulate) {
        acc[r] = _mm512_add_ps(acc[r], _mm512_maskz_loadu_ps(mask, out));
      }
      _mm512_mask_storeu_ps(out, mask, acc[r]);
    }
    return;
  }
#endif
  __m256 lo[R], hi[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    lo[r] = _mm256_setzero_ps();
    hi[r] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < kc; ++k) {
    __m256 w_lo, w_hi;
    LoadPanelStep(panel + k * kPanelRows, &w_lo, &w_hi);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * row_stride + k * k_stride);
      lo[r] = _mm256_fmadd_ps(a, w_lo, lo[r]);
      hi[r] = _mm256_fmadd_ps(a, w_hi, hi[r]);
    }
  }
  if (cols == kPanelRows) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      float* out = y + r * ldy;
      if (accumulate) {
        lo[r] = _mm256_add_ps(lo[r], _mm256_loadu_ps(out));
        hi[r] = _mm256_add_ps(hi[r], _mm256_loadu_ps(out + 8));
      }
      _mm256_storeu_ps(out, lo[r]);
      _mm256_storeu_ps(out + 8, hi[r]);
    }
    return;
  }
  alignas(32) float tile[R][kPanelRows];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(tile[r], lo[r]);
    _mm256_store_ps(tile[r] + 8, hi[r]);
  }
  for (int r = 0; r < R; ++r) {
    float* out = y + r * ldy;
    for (int64_t c = 0; c < cols; ++c)
      out[c] = accumulate ? out[c] + tile[r][c] : tile[r][c];
  }
}
#endif

float PanelWeight(float w);
float PanelWeight(uint16_t w);  // f16 bits

#if !defined(PDSERVE_MATMUL_AVX2) || !defined(PDSERVE_MATMUL_F16C)
// Portable kernel (and the f16 one where F16C is missing).
template <int R, typename W>
void PortableMicroKernel(const float* x, int64_t row_stride, int64_t k_stride,
                         const W* panel, int64_t kc, float* y, int64_t ldy,
                         int64_t cols, bool accumulate) {
  for (int r = 0; r < R; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      float sum = 0;
      for (int64_t k = 0; k < kc; ++k)
        sum += x[r * row_stride + k * k_stride] *
               PanelWeight(panel[k * kPanelRows + c]);
      y[r * ldy + c] = accumulate ? y[r * ldy + c] + sum : sum;
    }
  }
}
#endif

template <int R, typename W>
inline void RunMicroKernel(const float* x, int64_t row_stride, int64_t k_stride,
                           const W* panel, int64_t kc, float* y, int64_t ldy,
                           int64_t cols, bool accumulate) {
#if defined(PDSERVE_MATMUL_AVX2)
#if !defined(PDSERVE_MATMUL_F16C)
  if constexpr (!std::is_same_v<W, float>) {
    PortableMicroKernel<R, W>(x, row_stride, k_stride, panel, kc, y, ldy, cols,
                              accumulate);
    return;
  } else
#endif
    MicroKernel<R, W>(x, row_stride, k_stride, panel, kc, y, ldy, cols,
                      accumulate);
#else
  PortableMicroKernel<R, W>(x, row_stride, k_stride, panel, kc, y, ldy, cols,
                            accumulate);
#endif
}

template <typename W>
void MicroKernelRows(int rows, const float* x, int64_t row_stride,
                     int64_t k_stride, const W* panel, int64_t kc, float* y,
                     int64_t ldy, int64_t cols, bool accumulate) {
  switch (rows) {
    case 1:
      return RunMicroKernel<1, W>(x, row_stride, k_stride, panel, kc, y, ldy,
                                  cols, accumulate);
    case 2:
      return RunMicroKernel<2, W>(x, row_stride, k_stride, panel, kc, y, ldy,
                                  cols, accumulate);
    case 3:
      return RunMicroKernel<3, W>(x, row_stride, k_stride, panel, kc, y, ldy,
                                  cols, accumulate);
    case 4:
      return RunMicroKernel<4, W>(x, row_stride, k_stride, panel, kc, y, ldy,
                                  cols, accumulate);
    case 5:
      return RunMicroKernel<5, W>(x, row_stride, k_stride, panel, kc, y, ldy,
                                  cols, accumulate);
    default:
      return RunMicroKernel<6, W>(x, row_stride, k_stride, panel, kc, y, ldy,
                                  cols, accumulate);
  }
}

// Panels [first, last) of y[n, out] = x[n, in] · w^T, y's rows ldy apart.
// `panel_slice(p, k0, kc)` returns k-steps [k0, k0 + kc) of panel p as
// kc x kPanelRows weights (of type W); `block_cols` (a multiple of any
// block the slices are cut from) is the k-slice width.
template <typename PanelSlice>
void PanelLoop(const float* x, int64_t n, int64_t in, int64_t out, float* y,
               int64_t ldy, int64_t first, int64_t last, int64_t block_cols,
               const PanelSlice& panel_slice) {
  if (n * in * static_cast<int64_t>(sizeof(float)) <=
      kPanelMajorActivationBytes) {
    // Decode batches: one panel at a time, so the weights stream from memory
    // in order and exactly once; a k-slice of the panel stays in L1 while
    // every row tile reads its activations straight from x.
    for (int64_t p = first; p < last; ++p) {
      const int64_t cols = std::min(kPanelRows, out - p * kPanelRows);
      for (int64_t k0 = 0; k0 < in; k0 += block_cols) {
        const int64_t kc = std::min(block_cols, in - k0);
        const auto* panel = panel_slice(p, k0, kc);
        for (int64_t m = 0; m < n; m += kTileRows) {
          const int rows =
              static_cast<int>(std::min<int64_t>(kTileRows, n - m));
          MicroKernelRows(rows, x + m * in + k0, in, 1, panel, kc,
                          y + m * ldy + p * kPanelRows, ldy, cols, k0 > 0);
        }
      }
    }
    return;
  }
  // Prefill: a block of activations, copied into row tiles laid out
  // [k][kTileRows] (the six broadcasts of a k step read one cache line, not
  // six), stays in L2 while it meets every panel of this run.
  thread_local std::vector<float> tiles;
  tiles.resize(kBlockRows * block_cols);
  for (int64_t m0 = 0; m0 < n; m0 += kBlockRows) {
    const int64_t m_end = std::min(n, m0 + kBlockRows);
    for (int64_t k0 = 0; k0 < in; k0 += block_cols) {
      const int64_t kc = std::min(block_cols, in - k0);
      for (int64_t m = m0; m < m_end; m += kTileRows) {
        float* tile = tiles.data() + (m - m0) * kc;
        const int64_t rows = std::min<int64_t>(kTileRows, m_end - m);
        for (int64_t r = 0; r < rows; ++r) {
          const float* row = x + (m + r) * in + k0;
          for (int64_t k = 0; k < kc; ++k) tile[k * kTileRows + r] = row[k];
        }
      }
      for (int64_t p = first; p < last; ++p) {
        const auto* panel = panel_slice(p, k0, kc);
        const int64_t cols = std::min(kPanelRows, out - p * kPanelRows);
        for (int64_t m = m0; m < m_end; m += kTileRows) {
          const int rows =
              static_cast<int>(std::min<int64_t>(kTileRows, m_end - m));
          MicroKernelRows(rows, tiles.data() + (m - m0) * kc, 1, kTileRows,
                          panel, kc, y + m * ldy + p * kPanelRows, ldy, cols,
                          k0 > 0);
        }
      }
    }
  }
}

}  // namespace pdserve::engine::internal
