#include "engine/matmul.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/float16.h"
#include "common/thread_pool.h"
#include "engine/panel_kernel.h"

namespace pdserve::engine {
namespace {

using internal::kBlockCols;
using internal::PanelLoop;
#ifdef PDSERVE_MATMUL_AVX2
using internal::HorizontalSum;
#endif

// Panels [first, last) of y = x · w^T.
void PackedPanels(const float* x, int64_t n, const PackedMatrix& w, float* y,
                  int64_t first, int64_t last) {
  PanelLoop(x, n, w.cols(), w.rows(), y, w.rows(), first, last, kBlockCols,
            [&](int64_t p, int64_t k0, int64_t) {
              return w.panel(p) + k0 * kPanelRows;
            });
}

}  // namespace

absl::StatusOr<PackedMatrix> PackedMatrix::Pack(const float* w, int64_t rows,
                                                int64_t cols) {
  PackedMatrix packed;
  if (rows <= 0 || cols <= 0) return packed;
  const int64_t panels = (rows + kPanelRows - 1) / kPanelRows;
  // Bytes beyond any machine (and past int64 overflow) are refused before
  // the allocator sees them.
  constexpr int64_t kMaxBytes = int64_t{1} << 48;
  if (panels > kMaxBytes / (cols * kPanelRows * int64_t{sizeof(float)})) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "a packed ", rows, "x", cols, " matrix exceeds 2^48 bytes"));
  }
  packed.rows_ = rows;
  packed.cols_ = cols;
  const int64_t floats = panels * cols * kPanelRows;
  auto buffer =
      LargeBuffer::Allocate(static_cast<size_t>(floats) * sizeof(float));
  if (!buffer.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "a packed ", rows, "x", cols, " matrix: ", buffer.status().message()));
  }
  packed.data_ = *std::move(buffer);
  float* data = static_cast<float*>(packed.data_.data());
  for (int64_t p = 0; p < packed.panels(); ++p) {
    float* panel = data + p * cols * kPanelRows;
    const int64_t first_row = p * kPanelRows;
    const int64_t panel_rows = std::min(kPanelRows, rows - first_row);
    if (panel_rows < kPanelRows) {
      std::fill(panel, panel + cols * kPanelRows, 0.0f);
    }
    for (int64_t r = 0; r < panel_rows; ++r) {
      const float* row = w + (first_row + r) * cols;
      for (int64_t k = 0; k < cols; ++k) panel[k * kPanelRows + r] = row[k];
    }
  }
  return packed;
}

float PackedMatrix::At(int64_t row, int64_t col) const {
  return panel(row / kPanelRows)[col * kPanelRows + row % kPanelRows];
}

void PackedMatMul(const float* x, int64_t n, const PackedMatrix& w, float* y,
                  ThreadPool& pool) {
  if (n <= 0 || w.rows() == 0) return;
  if (w.cols() == 0) {
    std::fill(y, y + n * w.rows(), 0.0f);
    return;
  }
  // Contiguous runs of panels, two per thread: long runs let a cache block of
  // activations serve many panels (prefill), two per thread evens out a
  // thread that started late on a shared machine.
  pool.ParallelRanges(
      w.panels(),
      [&](int64_t first, int64_t last) {
        PackedPanels(x, n, w, y, first, last);
      },
      /*chunks_per_thread=*/2);
}

void BlasMatMul(const float* x, int64_t n, int64_t in, const float* w,
                int64_t out, float* y, ThreadPool& pool) {
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

namespace {
#ifdef PDSERVE_MATMUL_AVX2
// e^x for 8 floats: x = n·ln2 + r with |r| <= ln2/2, e^r by the degree-6
// polynomial of Cephes' expf (relative error < 2e-7, i.e. within 1-2 ulp of
// libm), times 2^n built in the exponent bits. Inputs are clamped to
// [-87.3, 88.0], so e^x never becomes inf or a denormal (e^-87.3 ≈ 1e-38
// stands in for 0: nothing here sums more than 2^30 terms).
inline __m256 Exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)),
                    _mm256_set1_ps(88.0f));
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n·ln2 in two steps (ln2 split into an exact high part and the
  // rest) so r keeps its low bits.
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r),
                      _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
}

inline float HorizontalMax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
#endif
}  // namespace

float MaxOf(const float* x, int64_t n) {
  int64_t i = 0;
  float max_value = -INFINITY;
#ifdef PDSERVE_MATMUL_AVX2
  if (n >= 8) {
    __m256 max8 = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= n; i += 8)
      max8 = _mm256_max_ps(max8, _mm256_loadu_ps(x + i));
    max_value = HorizontalMax(max8);
  }
#endif
  for (; i < n; ++i) max_value = std::max(max_value, x[i]);
  return max_value;
}

void SoftmaxInPlace(float* p, int64_t n) {
  if (n <= 0) return;
  const float max_value = MaxOf(p, n);
  float sum = 0;
  int64_t i = 0;
#ifdef PDSERVE_MATMUL_AVX2
  const __m256 max8 = _mm256_set1_ps(max_value);
  __m256 sum8 = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i), max8));
    _mm256_storeu_ps(p + i, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  sum = HorizontalSum(sum8);
#endif
  for (; i < n; ++i) {
    p[i] = std::exp(p[i] - max_value);
    sum += p[i];
  }
  const float inv_sum = 1.0f / sum;
  i = 0;
#ifdef PDSERVE_MATMUL_AVX2
  const __m256 inv8 = _mm256_set1_ps(inv_sum);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(p + i, _mm256_mul_ps(_mm256_loadu_ps(p + i), inv8));
#endif
  for (; i < n; ++i) p[i] *= inv_sum;
}

int64_t FirstAbove(const float* x, int64_t n, float threshold, bool or_equal) {
  int64_t i = 0;
#ifdef PDSERVE_MATMUL_AVX2
  const __m256 t8 = _mm256_set1_ps(threshold);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const int mask =
        _mm256_movemask_ps(or_equal ? _mm256_cmp_ps(v, t8, _CMP_GE_OQ)
                                    : _mm256_cmp_ps(v, t8, _CMP_GT_OQ));
    if (mask != 0) return i + __builtin_ctz(static_cast<unsigned>(mask));
  }
#endif
  for (; i < n; ++i) {
    if (or_equal ? x[i] >= threshold : x[i] > threshold) return i;
  }
  return n;
}

double LogSumExp(const float* x, int64_t n) {
  if (n <= 0) return -INFINITY;
  const float max_value = MaxOf(x, n);
  // Every term is in (0, 1]: float lanes lose nothing that matters over a
  // few thousand adds, and moving them into the double every kFlush vectors
  // keeps a 256k-entry vocabulary as exact as a short one.
  double sum = 0;
  int64_t i = 0;
#ifdef PDSERVE_MATMUL_AVX2
  constexpr int64_t kFlush = 8 * 256;
  const __m256 max8 = _mm256_set1_ps(max_value);
  while (i + 8 <= n) {
    __m256 sum_a = _mm256_setzero_ps(), sum_b = _mm256_setzero_ps();
    const int64_t end = std::min(n, i + kFlush);
    for (; i + 16 <= end; i += 16) {
      sum_a = _mm256_add_ps(sum_a,
                            Exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), max8)));
      sum_b = _mm256_add_ps(
          sum_b, Exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), max8)));
    }
    for (; i + 8 <= end; i += 8) {
      sum_a = _mm256_add_ps(sum_a,
                            Exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), max8)));
    }
    sum += HorizontalSum(_mm256_add_ps(sum_a, sum_b));
  }
#endif
  for (; i < n; ++i) sum += std::exp(double{x[i]} - max_value);
  return max_value + std::log(sum);
}

void SiluMul(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
#ifdef PDSERVE_MATMUL_AVX2
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 zero = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 denominator = _mm256_add_ps(one, Exp8(_mm256_sub_ps(zero, g)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, denominator),
                                            _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
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

namespace {

// Element loads for the attention kernels, which read K/V rows either as
// f32 or as bf16 (widened in registers: a bf16 pool's bytes are read once,
// with no f32 copy written and read back).
inline float LoadElement(const float* p) { return *p; }
inline float LoadElement(const uint16_t* p) { return Bf16ToFloat(*p); }
#ifdef PDSERVE_MATMUL_AVX2
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#endif

// q · row for the keys past the last group of eight: f32 rows are what
// DotProduct does; bf16 rows are widened on the way.
float DotWithRow(const float* q, const float* row, int64_t dim) {
  return DotProduct(q, row, dim);
}

float DotWithRow(const float* q, const uint16_t* row, int64_t dim) {
  int64_t d = 0;
  float sum = 0;
#ifdef PDSERVE_MATMUL_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; d + 8 <= dim; d += 8) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), Load8(row + d), acc);
  }
  sum = HorizontalSum(acc);
#endif
  for (; d < dim; ++d) sum += q[d] * LoadElement(row + d);
  return sum;
}

template <typename Element>
void ScoreKeysImpl(const float* q, const Element* keys, int64_t count,
                   int64_t dim, float scale, float* scores) {
  int64_t j = 0;
#ifdef PDSERVE_MATMUL_AVX2
  if (dim % 8 == 0) {
    const __m256 scale8 = _mm256_set1_ps(scale);
    for (; j + 8 <= count; j += 8) {
      const Element* k = keys + j * dim;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0,
             a5 = a0, a6 = a0, a7 = a0;
      for (int64_t d = 0; d < dim; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, Load8(k + d), a0);
        a1 = _mm256_fmadd_ps(qv, Load8(k + dim + d), a1);
        a2 = _mm256_fmadd_ps(qv, Load8(k + 2 * dim + d), a2);
        a3 = _mm256_fmadd_ps(qv, Load8(k + 3 * dim + d), a3);
        a4 = _mm256_fmadd_ps(qv, Load8(k + 4 * dim + d), a4);
        a5 = _mm256_fmadd_ps(qv, Load8(k + 5 * dim + d), a5);
        a6 = _mm256_fmadd_ps(qv, Load8(k + 6 * dim + d), a6);
        a7 = _mm256_fmadd_ps(qv, Load8(k + 7 * dim + d), a7);
      }
      // Three rounds of pairwise adds leave key i's sum in lane i (halves
      // summed across the two 128-bit lanes at the end).
      const __m256 h01 = _mm256_hadd_ps(a0, a1);
      const __m256 h23 = _mm256_hadd_ps(a2, a3);
      const __m256 h45 = _mm256_hadd_ps(a4, a5);
      const __m256 h67 = _mm256_hadd_ps(a6, a7);
      const __m256 h0123 = _mm256_hadd_ps(h01, h23);
      const __m256 h4567 = _mm256_hadd_ps(h45, h67);
      const __m256 sums =
          _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                        _mm256_permute2f128_ps(h0123, h4567, 0x31));
      _mm256_storeu_ps(scores + j, _mm256_mul_ps(sums, scale8));
    }
  }
#endif
  for (; j < count; ++j) scores[j] = DotWithRow(q, keys + j * dim, dim) * scale;
}

template <typename Element>
void AccumulateWeightedRowsImpl(const float* weights, const Element* rows,
                                int64_t count, int64_t dim, float* out) {
  int64_t d = 0;
#ifdef PDSERVE_MATMUL_AVX2
  // 64 dims (8 accumulators: independent FMA chains enough to hide the
  // latency) at a time, then 8.
  for (; d + 64 <= dim; d += 64) {
    // Fully unrolled, or GCC keeps the accumulators on the stack.
    __m256 acc[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_loadu_ps(out + d + 8 * i);
    for (int64_t j = 0; j < count; ++j) {
      const __m256 w = _mm256_broadcast_ss(weights + j);
      const Element* row = rows + j * dim + d;
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        acc[i] = _mm256_fmadd_ps(w, Load8(row + 8 * i), acc[i]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(out + d + 8 * i, acc[i]);
  }
  for (; d + 8 <= dim; d += 8) {
    __m256 acc = _mm256_loadu_ps(out + d);
    for (int64_t j = 0; j < count; ++j) {
      acc = _mm256_fmadd_ps(_mm256_broadcast_ss(weights + j),
                            Load8(rows + j * dim + d), acc);
    }
    _mm256_storeu_ps(out + d, acc);
  }
#endif
  for (; d < dim; ++d) {
    float sum = out[d];
    for (int64_t j = 0; j < count; ++j) {
      sum += weights[j] * LoadElement(rows + j * dim + d);
    }
    out[d] = sum;
  }
}

}  // namespace

void ScoreKeys(const float* q, const float* keys, int64_t count, int64_t dim,
               float scale, float* scores) {
  ScoreKeysImpl(q, keys, count, dim, scale, scores);
}

void ScoreKeys(const float* q, const uint16_t* keys, int64_t count, int64_t dim,
               float scale, float* scores) {
  ScoreKeysImpl(q, keys, count, dim, scale, scores);
}

void AccumulateWeightedRows(const float* weights, const float* rows,
                            int64_t count, int64_t dim, float* out) {
  AccumulateWeightedRowsImpl(weights, rows, count, dim, out);
}

void AccumulateWeightedRows(const float* weights, const uint16_t* rows,
                            int64_t count, int64_t dim, float* out) {
  AccumulateWeightedRowsImpl(weights, rows, count, dim, out);
}

void Bf16RowToFloat(const uint16_t* in, float* out, int64_t n) {
  int64_t i = 0;
#ifdef PDSERVE_MATMUL_AVX2
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, Load8(in + i));
  }
#endif
  for (; i < n; ++i) out[i] = Bf16ToFloat(in[i]);
}

void FloatRowToBf16(const float* in, uint16_t* out, int64_t n) {
  int64_t i = 0;
#ifdef PDSERVE_MATMUL_AVX2
  // Round to nearest even: add 0x7fff + (bit 16), keep the high half. NaNs
  // (|x| above the infinity pattern) keep their high half with the quiet
  // bit set instead, as the scalar FloatToBf16 does.
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i round_base = _mm256_set1_epi32(0x7fff);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i infinity = _mm256_set1_epi32(0x7f800000);
  const __m256i quiet = _mm256_set1_epi32(0x00400000);
  for (; i + 8 <= n; i += 8) {
    const __m256i word = _mm256_castps_si256(_mm256_loadu_ps(in + i));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(word, 16), one);
    const __m256i rounded =
        _mm256_add_epi32(word, _mm256_add_epi32(round_base, lsb));
    const __m256i is_nan =
        _mm256_cmpgt_epi32(_mm256_and_si256(word, abs_mask), infinity);
    const __m256i chosen =
        _mm256_blendv_epi8(rounded, _mm256_or_si256(word, quiet), is_nan);
    const __m256i high = _mm256_srli_epi32(chosen, 16);
    // Pack 8 x 32-bit (each < 2^16) into 8 x 16-bit; packus works per
    // 128-bit lane, so fix the lane order afterwards.
    const __m256i packed =
        _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_castsi256_si128(packed));
  }
#endif
  for (; i < n; ++i) out[i] = FloatToBf16(in[i]);
}

void UseSingleThreadedBlas() { openblas_set_num_threads(1); }

namespace internal {
float PanelWeight(float w) { return w; }
float PanelWeight(uint16_t w) { return F16ToFloat(w); }
}  // namespace internal

}  // namespace pdserve::engine
