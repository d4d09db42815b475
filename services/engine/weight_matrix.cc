// WeightMatrix: projections in their stored format (f32 / f16 panels,
// quantized blocks in place) and the kernels that multiply by them.
#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/float16.h"
#include "common/large_buffer.h"
#include "common/status_macros.h"
#include "common/thread_pool.h"
#include "engine/int8_dot.h"
#include "engine/matmul.h"
#include "engine/panel_kernel.h"

namespace pdserve::engine {

using model::TensorFormat;

struct WeightMatrix::Segment {
  TensorFormat format = TensorFormat::kF32;  // kF32, kF16 or quantized
  int64_t rows = 0, cols = 0;
  int64_t row_offset = 0;  // first output row of the matrix
  PackedMatrix f32;        // kF32
  // kF16: panels of kPanelRows halves per k step, like PackedMatrix (and,
  // like it, on huge pages).
  LargeBuffer f16;
  // Quantized: row r at data + r * row_bytes, read in place.
  const uint8_t* data = nullptr;
  int64_t row_bytes = 0;
  int interleaved_head_dim = 0;
  std::shared_ptr<const void> owner;

  int64_t panels() const { return (rows + kPanelRows - 1) / kPanelRows; }
  const uint16_t* f16_panel(int64_t p) const {
    return static_cast<const uint16_t*>(f16.data()) + p * cols * kPanelRows;
  }
};

namespace {

using internal::kBlockCols;
using internal::PanelLoop;

// Within one head of `head_dim` rows, HF rotate-half row p·d/2 + j is
// stored as interleaved row 2j + p.
int64_t StoredRowOf(int64_t hf_row, int64_t head_dim) {
  if (head_dim == 0) return hf_row;
  const int64_t half = head_dim / 2;
  const int64_t head = hf_row / head_dim;
  const int64_t within = hf_row % head_dim;
  return head * head_dim + 2 * (within % half) + within / half;
}

// ---------------------------------------------------------------------------
// Dequantization into f32, vectorized; the same float operations as
// model::DequantizeRow (products of a scale and an integer are exact, so a
// fused multiply-subtract rounds as the separate ops do): bit-identical.
// ---------------------------------------------------------------------------

inline float LoadF16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return F16ToFloat(bits);
}

#ifdef PDSERVE_MATMUL_AVX2
// Eight bytes at p, zero-extended to eight int32 lanes.
inline __m256i Bytes8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
#endif

void DequantizeQ8_0Blocks(const uint8_t* src, int64_t blocks, float* out) {
  for (int64_t b = 0; b < blocks; ++b, src += model::kQ8_0Bytes, out += 32) {
    const float d = LoadF16(src);
    const int8_t* q = reinterpret_cast<const int8_t*>(src + 2);
#ifdef PDSERVE_MATMUL_AVX2
    const __m256 dv = _mm256_set1_ps(d);
    for (int i = 0; i < 32; i += 8) {
      const __m256i v = _mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i)));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(v)));
    }
#else
    for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>(q[i]);
#endif
  }
}

void DequantizeQ4_KBlocks(const uint8_t* src, int64_t blocks, float* out) {
  for (int64_t b = 0; b < blocks; ++b, src += model::kQ4_KBytes, out += 256) {
    const float d = LoadF16(src);
    const float dmin = LoadF16(src + 2);
    const uint8_t* scales = src + 4;
    const uint8_t* qs = src + 16;
    for (int c = 0; c < 4; ++c) {
      uint8_t sc, m;
      model::Q4KScaleMin(scales, 2 * c, &sc, &m);
      const float d1 = d * sc, m1 = dmin * m;
      model::Q4KScaleMin(scales, 2 * c + 1, &sc, &m);
      const float d2 = d * sc, m2 = dmin * m;
      const uint8_t* q = qs + 32 * c;
      float* o = out + 64 * c;
#ifdef PDSERVE_MATMUL_AVX2
      const __m256 d1v = _mm256_set1_ps(d1), m1v = _mm256_set1_ps(m1);
      const __m256 d2v = _mm256_set1_ps(d2), m2v = _mm256_set1_ps(m2);
      const __m256i low_mask = _mm256_set1_epi32(0xF);
      for (int l = 0; l < 32; l += 8) {
        const __m256i v = Bytes8(q + l);
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, low_mask));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
        _mm256_storeu_ps(o + l, _mm256_fmsub_ps(d1v, lo, m1v));
        _mm256_storeu_ps(o + 32 + l, _mm256_fmsub_ps(d2v, hi, m2v));
      }
#else
      for (int l = 0; l < 32; ++l) o[l] = d1 * (q[l] & 0xF) - m1;
      for (int l = 0; l < 32; ++l) o[32 + l] = d2 * (q[l] >> 4) - m2;
#endif
    }
  }
}

void DequantizeQ6_KBlocks(const uint8_t* src, int64_t blocks, float* out) {
  for (int64_t b = 0; b < blocks; ++b, src += model::kQ6_KBytes, out += 256) {
#ifdef PDSERVE_MATMUL_AVX2
    const uint8_t* ql = src;
    const uint8_t* qh = src + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(src + 192);
    const float d = LoadF16(src + 208);
    const __m256i m4 = _mm256_set1_epi32(0xF), m2 = _mm256_set1_epi32(3);
    const __m256i offset = _mm256_set1_epi32(32);
    for (int h = 0; h < 2; ++h) {
      for (int l = 0; l < 32; l += 8) {
        const __m256i a = Bytes8(ql + 64 * h + l);
        const __m256i c = Bytes8(ql + 64 * h + 32 + l);
        const __m256i hb = Bytes8(qh + 32 * h + l);
        __m256i q[4];
        q[0] = _mm256_or_si256(_mm256_and_si256(a, m4),
                               _mm256_slli_epi32(_mm256_and_si256(hb, m2), 4));
        q[1] = _mm256_or_si256(
            _mm256_and_si256(c, m4),
            _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hb, 2), m2),
                              4));
        q[2] = _mm256_or_si256(
            _mm256_srli_epi32(a, 4),
            _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hb, 4), m2),
                              4));
        q[3] = _mm256_or_si256(_mm256_srli_epi32(c, 4),
                               _mm256_slli_epi32(_mm256_srli_epi32(hb, 6), 4));
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
          const int i = 128 * h + 32 * k + l;
          const __m256 scale =
              _mm256_set1_ps(d * static_cast<float>(scales[i / 16]));
          _mm256_storeu_ps(
              out + i, _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_sub_epi32(
                                                q[k], offset))));
        }
      }
    }
#else
    model::DequantizeRow(TensorFormat::kQ6_K, src, 256, out);
#endif
  }
}

// out[0, count) = values [0, count) of a row stored at `src` in `format`;
// count a multiple of the block.
void DequantizeFast(TensorFormat format, const uint8_t* src, int64_t count,
                    float* out) {
  switch (format) {
    case TensorFormat::kQ8_0:
      return DequantizeQ8_0Blocks(src, count / model::kQ8_0Elements, out);
    case TensorFormat::kQ4_K:
      return DequantizeQ4_KBlocks(src, count / model::kQKElements, out);
    case TensorFormat::kQ6_K:
      return DequantizeQ6_KBlocks(src, count / model::kQKElements, out);
    default:
      return model::DequantizeRow(format, src, count, out);
  }
}

// ---------------------------------------------------------------------------
// Kernels over quantized rows.
// ---------------------------------------------------------------------------

// Decode steps of up to this many activation rows multiply each weight row
// as it is dequantized (the row stays in L1 for every activation row);
// wider inputs go through dequantized panel slices and the register tile.
constexpr int64_t kRowDotMaxRows = 4;
// k-slice width of dequantized panels: whole Q4_K/Q6_K and Q8_0 blocks.
constexpr int64_t kQuantBlockCols = 512;

#ifdef PDSERVE_MATMUL_AVX2
// Σ over one row of R activation rows against a quantized row, the weights
// dequantized in registers (the same values model::DequantizeRow gives:
// scale products are exact) and never stored. Two accumulators per
// activation row keep two FMA chains in flight.
template <int R>
struct RowAccumulators {
  __m256 a[R], b[R];
  RowAccumulators() {
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t) a[t] = b[t] = _mm256_setzero_ps();
  }
  // acc += w · x_t[k .. k+8) for every row t (x rows `ldx` apart).
  inline void AddA(__m256 w, const float* x, int64_t ldx, int64_t k) {
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t)
      a[t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + t * ldx + k), a[t]);
  }
  inline void AddB(__m256 w, const float* x, int64_t ldx, int64_t k) {
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t)
      b[t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + t * ldx + k), b[t]);
  }
  inline void Store(float* y, int64_t ldy) const {
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t)
      y[t * ldy] = internal::HorizontalSum(_mm256_add_ps(a[t], b[t]));
  }
};

template <int R>
void Q8_0RowDot(const uint8_t* row, int64_t cols, const float* x, int64_t ldx,
                float* y, int64_t ldy) {
  RowAccumulators<R> acc;
  for (int64_t k = 0; k < cols; k += 32, row += model::kQ8_0Bytes) {
    const __m256 d = _mm256_set1_ps(LoadF16(row));
    const __m128i q =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2));
    const __m128i q_hi =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 18));
    const __m256 w0 =
        _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    const __m256 w1 = _mm256_mul_ps(
        d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))));
    const __m256 w2 =
        _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q_hi)));
    const __m256 w3 = _mm256_mul_ps(
        d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q_hi, 8))));
    acc.AddA(w0, x, ldx, k);
    acc.AddB(w1, x, ldx, k + 8);
    acc.AddA(w2, x, ldx, k + 16);
    acc.AddB(w3, x, ldx, k + 24);
  }
  acc.Store(y, ldy);
}

template <int R>
void Q4_KRowDot(const uint8_t* row, int64_t cols, const float* x, int64_t ldx,
                float* y, int64_t ldy) {
  RowAccumulators<R> acc;
  const __m256i low_mask = _mm256_set1_epi32(0xF);
  for (int64_t k0 = 0; k0 < cols; k0 += 256, row += model::kQ4_KBytes) {
    const float d = LoadF16(row);
    const float dmin = LoadF16(row + 2);
    const uint8_t* scales = row + 4;
    const uint8_t* qs = row + 16;
    for (int c = 0; c < 4; ++c) {
      uint8_t sc, m;
      model::Q4KScaleMin(scales, 2 * c, &sc, &m);
      const __m256 d1 = _mm256_set1_ps(d * sc), m1 = _mm256_set1_ps(dmin * m);
      model::Q4KScaleMin(scales, 2 * c + 1, &sc, &m);
      const __m256 d2 = _mm256_set1_ps(d * sc), m2 = _mm256_set1_ps(dmin * m);
      const uint8_t* q = qs + 32 * c;
      const int64_t k = k0 + 64 * c;
#pragma GCC unroll 4
      for (int l = 0; l < 32; l += 8) {
        const __m256i v = Bytes8(q + l);
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, low_mask));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
        acc.AddA(_mm256_fmsub_ps(d1, lo, m1), x, ldx, k + l);
        acc.AddB(_mm256_fmsub_ps(d2, hi, m2), x, ldx, k + 32 + l);
      }
    }
  }
  acc.Store(y, ldy);
}

template <int R>
void Q6_KRowDot(const uint8_t* row, int64_t cols, const float* x, int64_t ldx,
                float* y, int64_t ldy) {
  RowAccumulators<R> acc;
  const __m256i m4 = _mm256_set1_epi32(0xF), m2 = _mm256_set1_epi32(3);
  for (int64_t k0 = 0; k0 < cols; k0 += 256, row += model::kQ6_KBytes) {
    const uint8_t* ql = row;
    const uint8_t* qh = row + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(row + 192);
    const float d = LoadF16(row + 208);
    for (int h = 0; h < 2; ++h) {
      // w = s·(q - 32) as one fused s·q - 32·s: rounded once from the
      // exact value, as the reference's s·(q - 32) is.
      __m256 scale[8], offset[8];
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        const float sg = d * static_cast<float>(scales[8 * h + g]);
        scale[g] = _mm256_set1_ps(sg);
        offset[g] = _mm256_set1_ps(32.0f * sg);
      }
#pragma GCC unroll 4
      for (int l = 0; l < 32; l += 8) {
        const __m256i a = Bytes8(ql + 64 * h + l);
        const __m256i c = Bytes8(ql + 64 * h + 32 + l);
        const __m256i hb = Bytes8(qh + 32 * h + l);
        const __m256i q0 =
            _mm256_or_si256(_mm256_and_si256(a, m4),
                            _mm256_slli_epi32(_mm256_and_si256(hb, m2), 4));
        const __m256i q1 = _mm256_or_si256(
            _mm256_and_si256(c, m4),
            _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hb, 2), m2),
                              4));
        const __m256i q2 = _mm256_or_si256(
            _mm256_srli_epi32(a, 4),
            _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hb, 4), m2),
                              4));
        const __m256i q3 =
            _mm256_or_si256(_mm256_srli_epi32(c, 4),
                            _mm256_slli_epi32(_mm256_srli_epi32(hb, 6), 4));
        const int64_t k = k0 + 128 * h + l;
        const int g = l / 16;  // scale group within each 32-value row
        auto weights = [&](__m256i q, int group) {
          return _mm256_fmsub_ps(scale[group], _mm256_cvtepi32_ps(q),
                                 offset[group]);
        };
        acc.AddA(weights(q0, g), x, ldx, k);
        acc.AddB(weights(q1, 2 + g), x, ldx, k + 32);
        acc.AddA(weights(q2, 4 + g), x, ldx, k + 64);
        acc.AddB(weights(q3, 6 + g), x, ldx, k + 96);
      }
    }
  }
  acc.Store(y, ldy);
}

template <int R>
void RowDot(TensorFormat format, const uint8_t* row, int64_t cols,
            const float* x, int64_t ldx, float* y, int64_t ldy) {
  switch (format) {
    case TensorFormat::kQ8_0:
      return Q8_0RowDot<R>(row, cols, x, ldx, y, ldy);
    case TensorFormat::kQ4_K:
      return Q4_KRowDot<R>(row, cols, x, ldx, y, ldy);
    default:
      return Q6_KRowDot<R>(row, cols, x, ldx, y, ldy);
  }
}
#endif

// Output rows [r0, r1) of the segment for n <= kRowDotMaxRows activation rows.
void QuantRowDot(const WeightMatrix::Segment& s, const float* x, int64_t n,
                 float* y, int64_t ldy, int64_t r0, int64_t r1) {
#ifdef PDSERVE_MATMUL_AVX2
  using Kernel = void (*)(TensorFormat, const uint8_t*, int64_t, const float*,
                          int64_t, float*, int64_t);
  constexpr Kernel kKernels[kRowDotMaxRows + 1] = {
      nullptr, &RowDot<1>, &RowDot<2>, &RowDot<3>, &RowDot<4>};
  const Kernel kernel = kKernels[n];
  for (int64_t r = r0; r < r1; ++r) {
    kernel(s.format, s.data + r * s.row_bytes, s.cols, x, s.cols, y + r, ldy);
  }
#else
  thread_local std::vector<float> row;
  row.resize(s.cols);
  for (int64_t r = r0; r < r1; ++r) {
    DequantizeFast(s.format, s.data + r * s.row_bytes, s.cols, row.data());
    for (int64_t t = 0; t < n; ++t) {
      y[t * ldy + r] = DotProduct(row.data(), x + t * s.cols, s.cols);
    }
  }
#endif
}

// Panel p's k-steps [k0, k0 + kc) of a quantized segment, dequantized into
// the panel layout (kc x kPanelRows, rows past the segment zero).
const float* DequantizedPanelSlice(const WeightMatrix::Segment& s, int64_t p,
                                   int64_t k0, int64_t kc) {
  // Heap buffers, one pair per thread: 64 KiB of static thread_local arrays
  // would sit in every thread's static TLS block, and threads that libraries
  // create with small fixed stacks then fail to start.
  struct AlignedBuffer {
    float* data = nullptr;
    ~AlignedBuffer() { std::free(data); }
    float* Get(size_t floats) {
      if (data == nullptr) {
        data = static_cast<float*>(std::aligned_alloc(64, floats * 4));
      }
      return data;
    }
  };
  thread_local AlignedBuffer panel_buffer, rows_buffer;
  float* panel = panel_buffer.Get(kQuantBlockCols * kPanelRows);
  float* row_data = rows_buffer.Get(kQuantBlockCols * kPanelRows);
  auto rows = [&](int64_t r) { return row_data + r * kQuantBlockCols; };
  const int64_t first = p * kPanelRows;
  const int64_t count = std::min(kPanelRows, s.rows - first);
  const int64_t start = model::RowBytes(s.format, k0);
  for (int64_t r = 0; r < count; ++r) {
    DequantizeFast(s.format, s.data + (first + r) * s.row_bytes + start, kc,
                   rows(r));
  }
  for (int64_t r = count; r < kPanelRows; ++r) {
    std::fill(rows(r), rows(r) + kc, 0.0f);
  }
#ifdef PDSERVE_MATMUL_AVX2
  // 8 x 8 transposes: rows[r0..r0+8)[k..k+8) -> panel[k..k+8][r0..r0+8).
  for (int64_t k = 0; k + 8 <= kc; k += 8) {
    for (int r0 = 0; r0 < kPanelRows; r0 += 8) {
      __m256 v[8];
      for (int i = 0; i < 8; ++i) v[i] = _mm256_load_ps(rows(r0 + i) + k);
      const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]);
      const __m256 t1 = _mm256_unpackhi_ps(v[0], v[1]);
      const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]);
      const __m256 t3 = _mm256_unpackhi_ps(v[2], v[3]);
      const __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]);
      const __m256 t5 = _mm256_unpackhi_ps(v[4], v[5]);
      const __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]);
      const __m256 t7 = _mm256_unpackhi_ps(v[6], v[7]);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44);
      const __m256 u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44);
      const __m256 u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44);
      const __m256 u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44);
      const __m256 u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      float* o = panel + k * kPanelRows + r0;
      _mm256_store_ps(o + 0 * kPanelRows, _mm256_permute2f128_ps(u0, u4, 0x20));
      _mm256_store_ps(o + 1 * kPanelRows, _mm256_permute2f128_ps(u1, u5, 0x20));
      _mm256_store_ps(o + 2 * kPanelRows, _mm256_permute2f128_ps(u2, u6, 0x20));
      _mm256_store_ps(o + 3 * kPanelRows, _mm256_permute2f128_ps(u3, u7, 0x20));
      _mm256_store_ps(o + 4 * kPanelRows, _mm256_permute2f128_ps(u0, u4, 0x31));
      _mm256_store_ps(o + 5 * kPanelRows, _mm256_permute2f128_ps(u1, u5, 0x31));
      _mm256_store_ps(o + 6 * kPanelRows, _mm256_permute2f128_ps(u2, u6, 0x31));
      _mm256_store_ps(o + 7 * kPanelRows, _mm256_permute2f128_ps(u3, u7, 0x31));
    }
  }
#else
  for (int64_t k = 0; k < kc; ++k) {
    for (int64_t r = 0; r < kPanelRows; ++r)
      panel[k * kPanelRows + r] = rows(r)[k];
  }
#endif
  return panel;
}

// Panels [first, last) of one segment, written into y (ldy apart) at the
// segment's own columns.
void SegmentPanels(const WeightMatrix::Segment& s, const float* x, int64_t n,
                   float* y, int64_t ldy, int64_t first, int64_t last) {
  float* out = y + s.row_offset;
  switch (s.format) {
    case TensorFormat::kF32:
      PanelLoop(x, n, s.cols, s.rows, out, ldy, first, last, kBlockCols,
                [&](int64_t p, int64_t k0, int64_t) {
                  return s.f32.panel(p) + k0 * kPanelRows;
                });
      return;
    case TensorFormat::kF16:
      PanelLoop(x, n, s.cols, s.rows, out, ldy, first, last, kBlockCols,
                [&](int64_t p, int64_t k0, int64_t) {
                  return s.f16_panel(p) + k0 * kPanelRows;
                });
      return;
    default:
      if (n <= kRowDotMaxRows) {
        QuantRowDot(s, x, n, out, ldy, first * kPanelRows,
                    std::min(s.rows, last * kPanelRows));
        return;
      }
      PanelLoop(x, n, s.cols, s.rows, out, ldy, first, last, kQuantBlockCols,
                [&](int64_t p, int64_t k0, int64_t kc) {
                  return DequantizedPanelSlice(s, p, k0, kc);
                });
      return;
  }
}

// Output rows [r0, r1) of a quantized segment against every activation row,
// the activations already rounded to int8.
void SegmentInt8Dots(const WeightMatrix::Segment& s,
                     const internal::Int8Activations& x, float* y, int64_t ldy,
                     int64_t r0, int64_t r1) {
  internal::Int8RowDots(s.format, s.data + r0 * s.row_bytes, s.row_bytes,
                        r1 - r0, s.cols, x, y + s.row_offset + r0, ldy);
}

// Outputs of a segment whose rows are stored in interleaved RoPE order come
// out in that order: move them into HF rotate-half order.
void UninterleaveOutputs(const WeightMatrix::Segment& s, float* y, int64_t n,
                         int64_t ldy) {
  const int64_t hd = s.interleaved_head_dim;
  const int64_t half = hd / 2;
  std::vector<float> head(hd);
  for (int64_t t = 0; t < n; ++t) {
    float* out = y + t * ldy + s.row_offset;
    for (int64_t h0 = 0; h0 < s.rows; h0 += hd) {
      std::copy(out + h0, out + h0 + hd, head.begin());
      for (int64_t j = 0; j < half; ++j) {
        out[h0 + j] = head[2 * j];
        out[h0 + half + j] = head[2 * j + 1];
      }
    }
  }
}

}  // namespace

absl::Status WeightMatrix::CheckCols(int64_t cols) {
  if (cols_ != 0 && cols != cols_) {
    return absl::InternalError(absl::StrCat(
        "rows of ", cols, " columns appended to a matrix of ", cols_));
  }
  cols_ = cols;
  return absl::OkStatus();
}

absl::Status WeightMatrix::AppendF32(const float* w, int64_t rows,
                                     int64_t cols) {
  PDS_RETURN_IF_ERROR(CheckCols(cols));
  auto segment = std::make_shared<Segment>();
  segment->format = TensorFormat::kF32;
  segment->rows = rows;
  segment->cols = cols;
  segment->row_offset = rows_;
  absl::StatusOr<PackedMatrix> packed = PackedMatrix::Pack(w, rows, cols);
  if (!packed.ok()) return packed.status();
  segment->f32 = std::move(*packed);
  rows_ += rows;
  segments_.push_back(std::move(segment));
  return absl::OkStatus();
}

absl::Status WeightMatrix::AppendStored(TensorFormat format,
                                        const uint8_t* data, int64_t row_bytes,
                                        int64_t rows, int64_t cols,
                                        int interleaved_head_dim,
                                        std::shared_ptr<const void> owner) {
  if (rows == 0) return absl::OkStatus();
  if (interleaved_head_dim != 0 &&
      (interleaved_head_dim % 2 != 0 || rows % interleaved_head_dim != 0)) {
    return absl::InternalError(absl::StrCat(
        rows, " rows are not whole heads of ", interleaved_head_dim));
  }
  if (format == TensorFormat::kF32 || format == TensorFormat::kBF16) {
    std::vector<float> values(rows * cols);
    for (int64_t r = 0; r < rows; ++r) {
      model::DequantizeRow(
          format, data + StoredRowOf(r, interleaved_head_dim) * row_bytes, cols,
          values.data() + r * cols);
    }
    return AppendF32(values.data(), rows, cols);
  }
  PDS_RETURN_IF_ERROR(CheckCols(cols));
  auto segment = std::make_shared<Segment>();
  segment->format = format;
  segment->rows = rows;
  segment->cols = cols;
  segment->row_offset = rows_;
  if (format == TensorFormat::kF16) {
    const int64_t halves = segment->panels() * cols * kPanelRows;
    auto buffer = LargeBuffer::Allocate(static_cast<size_t>(halves) * 2);
    if (!buffer.ok()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("f16 panels: ", buffer.status().message()));
    }
    segment->f16 = *std::move(buffer);
    // Zeroed by the mapping: the last panel's missing rows stay 0.
    uint16_t* panels = static_cast<uint16_t*>(segment->f16.data());
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* row =
          data + StoredRowOf(r, interleaved_head_dim) * row_bytes;
      uint16_t* panel = panels + (r / kPanelRows) * cols * kPanelRows;
      for (int64_t k = 0; k < cols; ++k) {
        std::memcpy(panel + k * kPanelRows + r % kPanelRows, row + 2 * k, 2);
      }
    }
  } else {
    if (cols % model::BlockElements(format) != 0) {
      return absl::InternalError(absl::StrCat(
          "rows of ", cols, " values are not whole ",
          std::string(model::TensorFormatName(format)), " blocks"));
    }
    segment->data = data;
    segment->row_bytes = row_bytes;
    segment->interleaved_head_dim = interleaved_head_dim;
    segment->owner = std::move(owner);
  }
  rows_ += rows;
  segments_.push_back(std::move(segment));
  return absl::OkStatus();
}

int64_t WeightMatrix::bytes() const {
  int64_t total = 0;
  for (const auto& s : segments_) {
    switch (s->format) {
      case TensorFormat::kF32:
        total += s->rows * s->cols * 4;
        break;
      case TensorFormat::kF16:
        total += s->rows * s->cols * 2;
        break;
      default:
        total += s->rows * model::RowBytes(s->format, s->cols);
    }
  }
  return total;
}

std::string WeightMatrix::FormatSummary() const {
  std::string text;
  for (const auto& s : segments_) {
    absl::StrAppend(&text, text.empty() ? "" : " + ",
                    std::string(model::TensorFormatName(s->format)), " ",
                    s->rows);
  }
  return absl::StrCat(text, " rows");
}

float WeightMatrix::At(int64_t row, int64_t col) const {
  for (const auto& s : segments_) {
    if (row < s->row_offset || row >= s->row_offset + s->rows) continue;
    const int64_t r = row - s->row_offset;
    switch (s->format) {
      case TensorFormat::kF32:
        return s->f32.At(r, col);
      case TensorFormat::kF16:
        return F16ToFloat(
            s->f16_panel(r / kPanelRows)[col * kPanelRows + r % kPanelRows]);
      default: {
        std::vector<float> values(s->cols);
        model::DequantizeRow(
            s->format,
            s->data + StoredRowOf(r, s->interleaved_head_dim) * s->row_bytes,
            s->cols, values.data());
        return values[col];
      }
    }
  }
  return 0.0f;
}

bool WeightMatrix::int8_activations() const {
  if (!int8_activations_ || !internal::Int8ActivationKernelsAvailable()) {
    return false;
  }
  for (const auto& s : segments_) {
    if (model::IsQuantized(s->format)) return true;
  }
  return false;
}

void MatMul(const float* x, int64_t n, const WeightMatrix& w, float* y,
            ThreadPool& pool) {
  if (n <= 0 || w.rows() == 0) return;
  if (w.cols() == 0) {
    std::fill(y, y + n * w.rows(), 0.0f);
    return;
  }
  // Panels of all segments in one index space, so one parallel pass covers
  // a fused projection whatever its formats.
  const auto& segments = w.segments_;
  std::vector<int64_t> first_panel(segments.size() + 1, 0);
  for (size_t i = 0; i < segments.size(); ++i) {
    first_panel[i + 1] = first_panel[i] + segments[i]->panels();
  }
  // Activations rounded once per product, before the threads split rows.
  const bool int8 = w.int8_activations();
  // The buffer is the calling thread's; the pool's threads read it through
  // this reference (a thread_local named in the lambda would be their own).
  thread_local internal::Int8Activations calling_thread_rounded;
  internal::Int8Activations& rounded = calling_thread_rounded;
  if (int8) {
    bool q8_0 = false, k_quants = false;
    for (const auto& s : segments) {
      q8_0 |= s->format == TensorFormat::kQ8_0;
      k_quants |=
          s->format == TensorFormat::kQ4_K || s->format == TensorFormat::kQ6_K;
    }
    rounded.Resize(n, w.cols(), q8_0, k_quants);
    if (n >= 16) {  // a prefill chunk: its rounding spread over the threads
      pool.ParallelRanges(
          n, [&](int64_t t0, int64_t t1) { rounded.QuantizeRows(x, t0, t1); });
    } else {
      rounded.QuantizeRows(x, 0, n);
    }
  }
  pool.ParallelRanges(
      first_panel.back(),
      [&](int64_t first, int64_t last) {
        for (size_t i = 0; i < segments.size(); ++i) {
          const int64_t a = std::max(first, first_panel[i]);
          const int64_t b = std::min(last, first_panel[i + 1]);
          if (a >= b) continue;
          const WeightMatrix::Segment& s = *segments[i];
          if (int8 && model::IsQuantized(s.format)) {
            SegmentInt8Dots(
                s, rounded, y, w.rows(), (a - first_panel[i]) * kPanelRows,
                std::min(s.rows, (b - first_panel[i]) * kPanelRows));
            continue;
          }
          SegmentPanels(s, x, n, y, w.rows(), a - first_panel[i],
                        b - first_panel[i]);
        }
      },
      /*chunks_per_thread=*/2);
  for (const auto& s : segments) {
    if (s->interleaved_head_dim != 0) {
      UninterleaveOutputs(*s, y, n, w.rows());
    }
  }
}

}  // namespace pdserve::engine
