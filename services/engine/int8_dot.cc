#include "engine/int8_dot.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/float16.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_INT8_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define PDSERVE_INT8_AVX512 1
#endif
#endif

namespace pdserve::engine::internal {

using model::TensorFormat;

namespace {

// Rounds count values (a multiple of 32) at x to int8 with one scale
// max|x|/127: q = round-to-nearest-even(x·127/max).
float QuantizeBlock(const float* x, int64_t count, int8_t* q) {
#ifdef PDSERVE_INT8_AVX2
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps();
  for (int64_t i = 0; i < count; i += 8) {
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  }
  __m128 m4 =
      _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float max = _mm_cvtss_f32(m4);
  const __m256 inverse = _mm256_set1_ps(max > 0.0f ? 127.0f / max : 0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < count; i += 32) {
    // cvtps rounds to nearest even under the default MXCSR, as nearbyint.
    const __m256i a =
        _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), inverse));
    const __m256i b =
        _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), inverse));
    const __m256i c =
        _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 16), inverse));
    const __m256i d =
        _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 24), inverse));
    // The packs interleave 128-bit lanes; the permute puts 4-byte groups
    // back in order.
    const __m256i packed =
        _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i),
                        _mm256_permutevar8x32_epi32(packed, order));
  }
#else
  float max = 0.0f;
  for (int64_t i = 0; i < count; ++i) max = std::max(max, std::fabs(x[i]));
  const float inverse = max > 0.0f ? 127.0f / max : 0.0f;
  for (int64_t i = 0; i < count; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(x[i] * inverse));
  }
#endif
  return max / 127.0f;
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
#define PDSERVE_INT8_VNNI 1
#endif

// The packed Q8_0 kernel multiplies q + 128 (unsigned) by the weights'
// signed bytes, which only VNNI's dot product takes without saturating; the
// weights are repacked per product, which pays from about 16 rows.
bool PackedQ8_0Worthwhile(int64_t rows) {
#if defined(PDSERVE_INT8_AVX2) && defined(PDSERVE_INT8_VNNI)
  return rows >= 16;
#else
  (void)rows;
  return false;
#endif
}

// The packed K-quant kernel is 512-bit; its weights are repacked per
// product, which pays from about 16 rows.
bool PackedKQuantsWorthwhile(int64_t rows) {
#if defined(PDSERVE_INT8_AVX512)
  return rows >= 16;
#else
  (void)rows;
  return false;
#endif
}

#ifdef PDSERVE_INT8_AVX2
// Transposes 8 rows of 8 32-bit elements: v[j] lane l becomes v[l] lane j.
inline void Transpose8x8(__m256i v[8]) {
  __m256i t[8], u[8];
#pragma GCC unroll 4
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
  }
#pragma GCC unroll 2
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
    v[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
  }
}
#endif

// Sub-blocks of a K-quant block in packed lane order: the even ones, then
// the odd ones (the lanes a 128-bit vphaddd tree sums separately).
constexpr int kPackedSubBlock[8] = {0, 2, 4, 6, 1, 3, 5, 7};

void PackKQuantActivations(const int8_t* q, int64_t blocks, int8_t* out) {
#ifdef PDSERVE_INT8_AVX2
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i v[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      v[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
          q + 256 * b + 32 * kPackedSubBlock[i]));
    }
    Transpose8x8(v);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 256 * b + 32 * j),
                          v[j]);
    }
  }
#else
  (void)q, (void)blocks, (void)out;
#endif
}

// Bytes 4j..4j+3 of block l of each group of 8 go to chunk j, lane l; an
// int8 q becomes q + 128 as an unsigned byte (its top bit flipped).
void PackQ8_0Activations(const int8_t* q, int64_t blocks, uint8_t* out) {
  const int64_t groups = (blocks + kQ8_0GroupBlocks - 1) / kQ8_0GroupBlocks;
  for (int64_t g = 0; g < groups; ++g) {
    for (int j = 0; j < 8; ++j) {
      for (int l = 0; l < kQ8_0GroupBlocks; ++l) {
        const int64_t b = g * kQ8_0GroupBlocks + l;
        uint32_t four = 0;
        if (b < blocks) std::memcpy(&four, q + 32 * b + 4 * j, 4);
        four ^= 0x80808080u;
        std::memcpy(out + 256 * g + 32 * j + 4 * l, &four, 4);
      }
    }
  }
}

}  // namespace

void Int8Activations::Quantize(const float* x, int64_t n, int64_t cols,
                               bool for_q8_0, bool for_k_quants) {
  Resize(n, cols, for_q8_0, for_k_quants);
  QuantizeRows(x, 0, n);
}

void Int8Activations::Resize(int64_t n, int64_t cols, bool for_q8_0,
                             bool for_k_quants) {
  n_ = n;
  cols_ = cols;
  for_q8_0_ = for_q8_0;
  for_k_quants_ = for_k_quants;
  q8_0_padded_blocks_ =
      (cols / 32 + kQ8_0GroupBlocks - 1) / kQ8_0GroupBlocks * kQ8_0GroupBlocks;
  // The packed forms keep their storage between products (resizing from
  // empty would zero-fill every product's buffer before it is written).
  has_packed_q8_0_ = for_q8_0 && PackedQ8_0Worthwhile(n);
  if (for_q8_0) {
    q32_.resize(n * cols);
    d32_.resize(n * q8_0_padded_blocks_);
    if (has_packed_q8_0_) packed_q8_0_.resize(n * q8_0_padded_blocks_ * 32);
  }
  k_padded_blocks_ = (cols / 256 + kKQuantGroupBlocks - 1) /
                     kKQuantGroupBlocks * kKQuantGroupBlocks;
  has_packed_k_ = for_k_quants && PackedKQuantsWorthwhile(n);
  if (for_k_quants) {
    q256_.resize(n * cols);
    d256_.resize(n * k_padded_blocks_);
    if (has_packed_k_) packed_k_.resize(n * cols);
    sums16_.resize(n * (cols / 16));
    scaled_sums16_.resize(n * (cols / 16));
    scaled_sums32_.resize(n * (cols / 32));
  }
}

void Int8Activations::QuantizeRows(const float* x, int64_t t0, int64_t t1) {
  const int64_t cols = cols_;
  for (int64_t t = t0; t < t1; ++t) {
    const float* row = x + t * cols;
    if (for_q8_0_) {
      const int64_t blocks = cols / 32;
      float* d = d32_.data() + t * q8_0_padded_blocks_;
      int8_t* q = q32_.data() + t * cols;
      for (int64_t b = 0; b < blocks; ++b) {
        d[b] = QuantizeBlock(row + 32 * b, 32, q + 32 * b);
      }
      std::fill(d + blocks, d + q8_0_padded_blocks_, 0.0f);
      if (has_packed_q8_0()) {
        PackQ8_0Activations(q, blocks,
                            packed_q8_0_.data() + t * q8_0_padded_blocks_ * 32);
      }
    }
    if (!for_k_quants_) continue;
    int8_t* q = q256_.data() + t * cols;
    float* d = d256_.data() + t * k_padded_blocks_;
    for (int64_t b = 0; b < cols / 256; ++b) {
      d[b] = QuantizeBlock(row + 256 * b, 256, q + 256 * b);
    }
    std::fill(d + cols / 256, d + k_padded_blocks_, 0.0f);
    if (has_packed_k()) {
      PackKQuantActivations(q, cols / 256, packed_k_.data() + t * cols);
    }
    int16_t* sums = sums16_.data() + t * (cols / 16);
    float* scaled16 = scaled_sums16_.data() + t * (cols / 16);
    float* scaled32 = scaled_sums32_.data() + t * (cols / 32);
    for (int64_t g = 0; g < cols / 16; ++g) {
      int sum = 0;
      for (int i = 0; i < 16; ++i) sum += q[16 * g + i];
      sums[g] = static_cast<int16_t>(sum);
      scaled16[g] = d[g / 16] * static_cast<float>(sum);
    }
    for (int64_t j = 0; j < cols / 32; ++j) {
      scaled32[j] =
          d[j / 8] * static_cast<float>(sums[2 * j] + sums[2 * j + 1]);
    }
  }
}

float Int8Activations::Value(TensorFormat format, int64_t t, int64_t k) const {
  if (format == TensorFormat::kQ8_0) {
    return d32(t)[k / 32] * static_cast<float>(q32(t)[k]);
  }
  return d256(t)[k / 256] * static_cast<float>(q256(t)[k]);
}

#ifdef PDSERVE_INT8_AVX2
namespace {

inline float LoadF16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(h);  // exact, as F16ToFloat, in one instruction
#else
  return F16ToFloat(h);
#endif
}

inline __m256i Load32(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}

// acc + Σ of each 4 adjacent u8·s8 products (vpdpbusd). `u` holds values
// <= 128 here, so the AVX2 emulation's 16-bit pair sums cannot saturate.
inline __m256i DotBytes(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(
      acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// acc + Σ of each 2 adjacent int16 products (vpdpwssd).
inline __m256i DotPairs(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

// Float accumulators of R activation rows x C weight rows.
template <int R, int C>
struct FloatLanes {
  __m256 acc[R][C];
  FloatLanes() {
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t) {
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[t][c] = _mm256_setzero_ps();
    }
  }
  // y[t·ldy + c] = Σ of lanes.
  void Store(float* y, int64_t ldy) const {
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t) {
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) y[t * ldy + c] = HorizontalSum(acc[t][c]);
    }
  }
  static float HorizontalSum(__m256 v) {
    __m128 lo =
        _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
  }
};

// Pointers to the rounding of R activation rows from t0.
template <int R>
struct ActivationRows {
  const int8_t* q[R];
  const float* d[R];         // one scale per block (32 or 256 values)
  const int16_t* sums[R];    // K-quant rounding: Σ q per 16 values
  const float* scaled16[R];  // ... times d
  const float* scaled32[R];  // ... per 32 values, times d
  ActivationRows(const Int8Activations& x, int64_t t0, bool k_quants) {
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t) {
      q[t] = k_quants ? x.q256(t0 + t) : x.q32(t0 + t);
      d[t] = k_quants ? x.d256(t0 + t) : x.d32(t0 + t);
      sums[t] = k_quants ? x.sums16(t0 + t) : nullptr;
      scaled16[t] = k_quants ? x.scaled_sums16(t0 + t) : nullptr;
      scaled32[t] = k_quants ? x.scaled_sums32(t0 + t) : nullptr;
    }
  }
};

// The kernels below take C weight rows `row_bytes` apart and R activation
// rows from t0, and write y[t·ldy + c]. Each (t, c) pair runs the same
// operations in the same order for every R and C.

// Q8_0: per block of 32, Σ w·x = (d_w·d_x)·Σ q_w·q_x. Both kernels below
// bring the integer sums of a group of 8 blocks into lane l = block 8g + l
// of one vector, then take one float step per group,
//   acc = fma(float(sums), d_w · d_x, acc),
// the same operations in both, so a row's result does not depend on which
// kernel its batch size picked.
inline __m256 Q8_0FloatStep(__m256i sums, __m256 dw, __m256 dx, __m256 acc) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(dw, dx), acc);
}

// The f16 scales of the 8 Q8_0 blocks from `first` as floats; with kTail,
// zero from block `count` on.
template <bool kTail>
inline __m256 Q8_0GroupScales(const uint8_t* first, int64_t count) {
  auto scale = [&](int l) -> int16_t {
    if (kTail && l >= count) return 0;
    int16_t h;
    std::memcpy(&h, first + l * model::kQ8_0Bytes, 2);
    return h;
  };
  const __m128i halves = _mm_setr_epi16(scale(0), scale(1), scale(2), scale(3),
                                        scale(4), scale(5), scale(6), scale(7));
#ifdef __F16C__
  return _mm256_cvtph_ps(halves);
#else
  alignas(16) uint16_t h[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(h), halves);
  return _mm256_setr_ps(F16ToFloat(h[0]), F16ToFloat(h[1]), F16ToFloat(h[2]),
                        F16ToFloat(h[3]), F16ToFloat(h[4]), F16ToFloat(h[5]),
                        F16ToFloat(h[6]), F16ToFloat(h[7]));
#endif
}

// Weight rows read in place (decode, verify): per block, vpdpbusd of |q_w|
// (unsigned) by q_x carrying q_w's sign gives 8 partial sums; vphaddd pairs
// and one 128-bit lane exchange bring 8 blocks' sums into one vector. One
// group of blocks [g0, g0 + 8), of which the first `count` are real when
// kTail.
template <int R, int C, bool kTail>
inline void Q8_0Group(const uint8_t* rows, int64_t row_bytes,
                      const ActivationRows<R>& a, int64_t g0, int64_t count,
                      FloatLanes<R, C>& lanes) {
  const __m256i zero = _mm256_setzero_si256();
  // Per pair, the sums of blocks g0..g0+3 and g0+4..g0+7 as
  // [b0 b1 b2 b3 | b0 b1 b2 b3] (low and high halves of each block's lanes).
  __m256i quads[2][R][C];
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    __m256i pairs[2][R][C];
#pragma GCC unroll 2
    for (int p = 0; p < 2; ++p) {
      __m256i dots[2][R][C];
#pragma GCC unroll 2
      for (int i = 0; i < 2; ++i) {
        const int l = 4 * h + 2 * p + i;
        const int64_t b = g0 + l;
        if (kTail && l >= count) {
#pragma GCC unroll 4
          for (int t = 0; t < R; ++t) {
#pragma GCC unroll 4
            for (int c = 0; c < C; ++c) dots[i][t][c] = zero;
          }
          continue;
        }
        __m256i w[C], w_abs[C];
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
          w[c] = Load32(rows + c * row_bytes + b * model::kQ8_0Bytes + 2);
          w_abs[c] = _mm256_sign_epi8(w[c], w[c]);
        }
#pragma GCC unroll 4
        for (int t = 0; t < R; ++t) {
          const __m256i xq = Load32(a.q[t] + 32 * b);
#pragma GCC unroll 4
          for (int c = 0; c < C; ++c) {
            dots[i][t][c] =
                DotBytes(zero, w_abs[c], _mm256_sign_epi8(xq, w[c]));
          }
        }
      }
#pragma GCC unroll 4
      for (int t = 0; t < R; ++t) {
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
          pairs[p][t][c] = _mm256_hadd_epi32(dots[0][t][c], dots[1][t][c]);
        }
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t) {
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        quads[h][t][c] = _mm256_hadd_epi32(pairs[0][t][c], pairs[1][t][c]);
      }
    }
  }
  __m256 dw[C];
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    dw[c] = Q8_0GroupScales<kTail>(
        rows + c * row_bytes + g0 * model::kQ8_0Bytes, count);
  }
#pragma GCC unroll 4
  for (int t = 0; t < R; ++t) {
    const __m256 dx = _mm256_loadu_ps(a.d[t] + g0);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m256i sums = _mm256_add_epi32(
          _mm256_permute2x128_si256(quads[0][t][c], quads[1][t][c], 0x20),
          _mm256_permute2x128_si256(quads[0][t][c], quads[1][t][c], 0x31));
      lanes.acc[t][c] = Q8_0FloatStep(sums, dw[c], dx, lanes.acc[t][c]);
    }
  }
}

template <int R, int C>
void Q8_0Dots(const uint8_t* rows, int64_t row_bytes, int64_t cols,
              const Int8Activations& x, int64_t t0, float* y, int64_t ldy) {
  FloatLanes<R, C> lanes;
  const ActivationRows<R> a(x, t0, /*k_quants=*/false);
  const int64_t blocks = cols / 32;
  int64_t g0 = 0;
  for (; g0 + kQ8_0GroupBlocks <= blocks; g0 += kQ8_0GroupBlocks) {
    Q8_0Group<R, C, false>(rows, row_bytes, a, g0, kQ8_0GroupBlocks, lanes);
  }
  if (g0 < blocks) {
    Q8_0Group<R, C, true>(rows, row_bytes, a, g0, blocks - g0, lanes);
  }
  lanes.Store(y, ldy);
}

#ifdef PDSERVE_INT8_VNNI
// Q8_0 weight rows repacked for the prefill kernel, in tiles of
// kPackedQ8_0TileRows rows (two where a 512-bit vector holds a chunk of each;
// a missing last row is zeros). Per group of 8 blocks a tile holds its 8
// chunks of 32 bytes per row in the activations' packed order (chunk j of
// every row together), the rows' 8 block scales as floats, then
// -128·Σ q_w per block (the unsigned activations carry +128 per value;
// starting each sum there cancels it).
#ifdef PDSERVE_INT8_AVX512
constexpr int kPackedQ8_0TileRows = 2;
#else
constexpr int kPackedQ8_0TileRows = 1;
#endif
constexpr int64_t kPackedQ8_0GroupBytes = kPackedQ8_0TileRows * (256 + 32 + 32);

// Packs weight rows [0, row_count) into tiles at out.
void PackQ8_0Weights(const uint8_t* rows, int64_t row_bytes, int64_t row_count,
                     int64_t blocks, uint8_t* out) {
  constexpr int kTile = kPackedQ8_0TileRows;
  const int64_t groups = (blocks + kQ8_0GroupBlocks - 1) / kQ8_0GroupBlocks;
  const __m256i ones = _mm256_set1_epi8(1);
  for (int64_t r = 0; r < row_count; ++r) {
    const uint8_t* row = rows + r * row_bytes;
    uint8_t* tile = out + r / kTile * groups * kPackedQ8_0GroupBytes;
    const int i = r % kTile;  // the row's place in its tile
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* group = tile + g * kPackedQ8_0GroupBytes;
      alignas(32) float scales[kQ8_0GroupBlocks];
      __m256i v[kQ8_0GroupBlocks];
#pragma GCC unroll 8
      for (int l = 0; l < kQ8_0GroupBlocks; ++l) {
        const int64_t b = g * kQ8_0GroupBlocks + l;
        const uint8_t* block = row + b * model::kQ8_0Bytes;
        const bool real = b < blocks;
        scales[l] = real ? LoadF16(block) : 0.0f;
        v[l] = real ? Load32(block + 2) : _mm256_setzero_si256();
      }
      Transpose8x8(v);
      __m256i sums = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        _mm256_storeu_si256(
            reinterpret_cast<__m256i*>(group + 32 * (kTile * j + i)), v[j]);
        sums = DotBytes(sums, ones, v[j]);
      }
      std::memcpy(group + 256 * kTile + 32 * i, scales, sizeof(scales));
      _mm256_storeu_si256(
          reinterpret_cast<__m256i*>(group + 288 * kTile + 32 * i),
          _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sums, 7)));
    }
  }
  // A missing last row of a tile: zero weights, scales and offsets.
  if (row_count % kTile != 0) {
    uint8_t* tile = out + row_count / kTile * groups * kPackedQ8_0GroupBytes;
    for (int i = row_count % kTile; i < kTile; ++i) {
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* group = tile + g * kPackedQ8_0GroupBytes;
        for (int j = 0; j < 8; ++j) {
          std::memset(group + 32 * (kTile * j + i), 0, 32);
        }
        std::memset(group + 256 * kTile + 32 * i, 0, 32);
        std::memset(group + 288 * kTile + 32 * i, 0, 32);
      }
    }
  }
}

#ifndef PDSERVE_INT8_AVX512
// R packed activation rows from t0 by C packed weight rows (tiles of one
// row): each of a group's 8 chunks is one vpdpbusd per pair (4 bytes of each
// of 8 blocks), so a group costs a pair 8 integer ops and one float step.
template <int R, int C>
void PackedQ8_0Dots(const uint8_t* tiles, int64_t groups,
                    const Int8Activations& x, int64_t t0, float* y, int64_t ldy,
                    int64_t rows_left) {
  FloatLanes<R, C> lanes;
  const uint8_t* xq[R];
  const float* dx[R];
#pragma GCC unroll 4
  for (int t = 0; t < R; ++t) {
    xq[t] = x.packed_q8_0(t0 + t);
    dx[t] = x.d32(t0 + t);
  }
  const int64_t tile_stride = groups * kPackedQ8_0GroupBytes;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* w = tiles + g * kPackedQ8_0GroupBytes;
    __m256i sums[R][C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m256i offset = Load32(w + c * tile_stride + 288);
#pragma GCC unroll 4
      for (int t = 0; t < R; ++t) sums[t][c] = offset;
    }
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m256i wj[C];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) wj[c] = Load32(w + c * tile_stride + 32 * j);
#pragma GCC unroll 4
      for (int t = 0; t < R; ++t) {
        const __m256i xj = Load32(xq[t] + 256 * g + 32 * j);
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c)
          sums[t][c] = DotBytes(sums[t][c], xj, wj[c]);
      }
    }
    __m256 dw[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      dw[c] = _mm256_loadu_ps(
          reinterpret_cast<const float*>(w + c * tile_stride + 256));
    }
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t) {
      const __m256 dxg = _mm256_loadu_ps(dx[t] + kQ8_0GroupBlocks * g);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        lanes.acc[t][c] =
            Q8_0FloatStep(sums[t][c], dw[c], dxg, lanes.acc[t][c]);
      }
    }
  }
  (void)rows_left;  // tiles of one row: every row is real
  lanes.Store(y, ldy);
}
#else
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// A packed group's 8 chunks for R activation rows x C tiles of two rows:
// sums[t][c] += vpdpbusd of each chunk of tile c (a row in each 256-bit
// half) and activation row t's chunk (in both halves), x[t] + offset being
// the group's first chunk. kUnsignedWeights: the weights are the unsigned
// operand (Q4_K values), else the activations are (Q8_0's, stored +128).
template <bool kUnsignedWeights, int R, int C, typename X>
inline void PackedGroupDots(const uint8_t* w, int64_t tile_stride,
                            const X* const (&x)[R], int64_t offset,
                            __m512i (&sums)[R][C]) {
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    __m512i wj[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      wj[c] = _mm512_loadu_si512(w + c * tile_stride + 64 * j);
    }
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t) {
      const __m512i xj = _mm512_broadcast_i64x4(Load32(x[t] + offset + 32 * j));
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        sums[t][c] = kUnsignedWeights
                         ? _mm512_dpbusd_epi32(sums[t][c], wj[c], xj)
                         : _mm512_dpbusd_epi32(sums[t][c], xj, wj[c]);
      }
    }
  }
}

// y[t·ldy + 2c + i] = the sum of half i of acc[t][c] (a tile's rows), for
// the rows_left of the 2C rows that exist.
template <int R, int C>
inline void StoreTileHalves(const __m512 (&acc)[R][C], float* y, int64_t ldy,
                            int64_t rows_left) {
#pragma GCC unroll 4
  for (int t = 0; t < R; ++t) {
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      y[t * ldy + 2 * c] =
          FloatLanes<1, 1>::HorizontalSum(_mm512_castps512_ps256(acc[t][c]));
      if (2 * c + 1 < rows_left) {
        y[t * ldy + 2 * c + 1] = FloatLanes<1, 1>::HorizontalSum(
            _mm512_extractf32x8_ps(acc[t][c], 1));
      }
    }
  }
}

// The same with tiles of two rows: one 512-bit vpdpbusd per chunk multiplies
// a chunk of each row of a tile (its halves) by the activation chunk in both
// halves, and the float step runs on both rows' 8 lanes at once, lane for
// lane the 256-bit step. C tiles, 2C weight rows, rows_left of them real.
template <int R, int C>
void PackedQ8_0Dots(const uint8_t* tiles, int64_t groups,
                    const Int8Activations& x, int64_t t0, float* y, int64_t ldy,
                    int64_t rows_left) {
  __m512 acc[R][C];
  const uint8_t* xq[R];
  const float* dx[R];
#pragma GCC unroll 4
  for (int t = 0; t < R; ++t) {
    xq[t] = x.packed_q8_0(t0 + t);
    dx[t] = x.d32(t0 + t);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[t][c] = _mm512_setzero_ps();
  }
  const int64_t tile_stride = groups * kPackedQ8_0GroupBytes;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* w = tiles + g * kPackedQ8_0GroupBytes;
    __m512i sums[R][C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m512i offset = _mm512_loadu_si512(w + c * tile_stride + 576);
#pragma GCC unroll 4
      for (int t = 0; t < R; ++t) sums[t][c] = offset;
    }
    PackedGroupDots</*kUnsignedWeights=*/false>(w, tile_stride, xq, 256 * g,
                                                sums);
    __m512 dw[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      dw[c] = _mm512_loadu_ps(w + c * tile_stride + 512);
    }
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t) {
      const __m512 dxg =
          _mm512_broadcast_f32x8(_mm256_loadu_ps(dx[t] + kQ8_0GroupBlocks * g));
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        acc[t][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[t][c]),
                                    _mm512_mul_ps(dw[c], dxg), acc[t][c]);
      }
    }
  }
  StoreTileHalves(acc, y, ldy, rows_left);
}
#pragma GCC diagnostic pop
#endif  // PDSERVE_INT8_AVX512

// Activation rows [t0, t1) in groups of 4 against C tiles of packed weight
// rows from tile i: dots.operator()<R, C>(i, t) multiplies R rows from t.
template <int C, typename Dots>
void PackedRowGroups(const Dots& dots, int64_t i, int64_t t0, int64_t t1) {
  int64_t t = t0;
  for (; t + 4 <= t1; t += 4) dots.template operator()<4, C>(i, t);
  switch (t1 - t) {
    case 3:
      return dots.template operator()<3, C>(i, t);
    case 2:
      return dots.template operator()<2, C>(i, t);
    case 1:
      return dots.template operator()<1, C>(i, t);
    default:
      return;
  }
}

// Every activation row of x against `tiles` tiles of packed weight rows of
// tile_bytes each. Weight rows are packed a span at a time, `pack(i0, i1)`
// writing tiles [i0, i1) to the start of the buffer, and the span stays in
// L2 while blocks of activation rows pass over it; kernels take up to
// kMaxTiles tiles at a time (as many as the vector registers hold).
template <int kMaxTiles, typename Pack, typename Dots>
void ForEachPackedTile(const Int8Activations& x, int64_t cols, int64_t tiles,
                       int64_t tile_bytes, const Pack& pack, const Dots& dots) {
  const int64_t span =
      std::max<int64_t>(kMaxTiles, (256 << 10) / tile_bytes / 6 * 6);
  const int64_t block_rows = std::max<int64_t>(4, (64 << 10) / cols / 4 * 4);
  for (int64_t i0 = 0; i0 < tiles; i0 += span) {
    const int64_t i1 = std::min(tiles, i0 + span);
    pack(i0, i1);
    for (int64_t t0 = 0; t0 < x.rows(); t0 += block_rows) {
      const int64_t t1 = std::min(x.rows(), t0 + block_rows);
      int64_t i = i0;
      if constexpr (kMaxTiles >= 3) {
        for (; i + 3 <= i1; i += 3) PackedRowGroups<3>(dots, i, t0, t1);
      }
      for (; i + 2 <= i1; i += 2) PackedRowGroups<2>(dots, i, t0, t1);
      for (; i < i1; ++i) PackedRowGroups<1>(dots, i, t0, t1);
    }
  }
}

// The packing buffer of each thread (a span of tiles).
CacheAlignedVector<uint8_t>& PackedWeightBuffer() {
  thread_local CacheAlignedVector<uint8_t> packed;
  return packed;
}

void PackedQ8_0RowDots(const uint8_t* rows, int64_t row_bytes,
                       int64_t row_count, int64_t cols,
                       const Int8Activations& x, float* y, int64_t ldy) {
  constexpr int kTile = kPackedQ8_0TileRows;
  const int64_t blocks = cols / 32;
  const int64_t groups = (blocks + kQ8_0GroupBlocks - 1) / kQ8_0GroupBlocks;
  const int64_t tile_stride = groups * kPackedQ8_0GroupBytes;
  const int64_t tiles = (row_count + kTile - 1) / kTile;
  CacheAlignedVector<uint8_t>& packed = PackedWeightBuffer();
  int64_t first = 0;  // the first tile in the buffer
  // 512-bit: 32 vector registers hold 3 tiles x 4 rows.
  constexpr int kMaxTiles = kTile == 2 ? 3 : 2;
  ForEachPackedTile<kMaxTiles>(
      x, cols, tiles, tile_stride,
      [&](int64_t i0, int64_t i1) {
        first = i0;
        const int64_t r1 = std::min(row_count, i1 * kTile);
        packed.resize((i1 - i0) * tile_stride);
        PackQ8_0Weights(rows + i0 * kTile * row_bytes, row_bytes,
                        r1 - i0 * kTile, blocks, packed.data());
      },
      [&]<int R, int C>(int64_t i, int64_t t) {
        PackedQ8_0Dots<R, C>(packed.data() + (i - first) * tile_stride, groups,
                             x, t, y + t * ldy + i * kTile, ldy,
                             row_count - i * kTile);
      });
}
#endif  // PDSERVE_INT8_VNNI

// The 8 six-bit scales and 8 mins of a Q4_K block as bytes 0-7 and 8-15
// (model::Q4KScaleMin's unpacking, four at a time).
inline __m128i Q4KScalesAndMins(const uint8_t* packed) {
  uint32_t u[3];
  std::memcpy(u, packed, 12);
  const uint32_t low6 = 0x3F3F3F3F, low4 = 0x0F0F0F0F, low2 = 0x03030303;
  const uint32_t scales_0_3 = u[0] & low6;
  const uint32_t mins_0_3 = u[1] & low6;
  const uint32_t scales_4_7 = (u[2] & low4) | (((u[0] >> 6) & low2) << 4);
  const uint32_t mins_4_7 = ((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4);
  return _mm_setr_epi32(static_cast<int>(scales_0_3),
                        static_cast<int>(scales_4_7),
                        static_cast<int>(mins_0_3), static_cast<int>(mins_4_7));
}

// Shuffle masks: byte j zero-extended into every 16-bit lane; and the mins
// (bytes 8-15) each in two adjacent lanes, one per 16 activation values.
inline __m256i BroadcastByteMask(int j) {
  return _mm256_set1_epi16(static_cast<int16_t>(0x8000 | j));
}
inline __m256i MinPairsMask() {
  return _mm256_setr_epi8(8, -1, 8, -1, 9, -1, 9, -1, 10, -1, 10, -1, 11, -1,
                          11, -1, 12, -1, 12, -1, 13, -1, 13, -1, 14, -1, 14,
                          -1, 15, -1, 15, -1);
}

// Q4_K: per super-block, Σ w·x = d_x·(d·Σ_j scale_j·Σ q·q_x
// − dmin·Σ_j min_j·Σ q_x), j over the 8 sub-blocks of 32. The nibbles are
// the unsigned operand of vpmaddubsw (pairs <= 2·15·127, no saturation);
// vpdpwssd multiplies the pairs by scale_j into int32 lanes.
template <int R, int C>
void Q4_KDots(const uint8_t* rows, int64_t row_bytes, int64_t cols,
              const Int8Activations& x, int64_t t0, float* y, int64_t ldy) {
  FloatLanes<R, C> lanes;
  const ActivationRows<R> a(x, t0, /*k_quants=*/true);
  const auto& q = a.q;
  const auto& d = a.d;
  const auto& sums = a.sums;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < cols / 256; ++b) {
    const uint8_t* block[C];
    __m256i packed_scales[C];
    __m256i isum[R][C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      block[c] = rows + c * row_bytes + b * model::kQ4_KBytes;
      packed_scales[c] =
          _mm256_broadcastsi128_si256(Q4KScalesAndMins(block[c] + 4));
#pragma GCC unroll 4
      for (int t = 0; t < R; ++t) isum[t][c] = _mm256_setzero_si256();
    }
#pragma GCC unroll 4
    for (int chunk = 0; chunk < 4; ++chunk) {
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const __m256i v = Load32(block[c] + 16 + 32 * chunk);
        const __m256i lo = _mm256_and_si256(v, nibble);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        const __m256i scale_lo =
            _mm256_shuffle_epi8(packed_scales[c], BroadcastByteMask(2 * chunk));
        const __m256i scale_hi = _mm256_shuffle_epi8(
            packed_scales[c], BroadcastByteMask(2 * chunk + 1));
#pragma GCC unroll 4
        for (int t = 0; t < R; ++t) {
          const int8_t* xq = q[t] + 256 * b + 64 * chunk;
          isum[t][c] = DotPairs(isum[t][c],
                                _mm256_maddubs_epi16(lo, Load32(xq)), scale_lo);
          isum[t][c] = DotPairs(
              isum[t][c], _mm256_maddubs_epi16(hi, Load32(xq + 32)), scale_hi);
        }
      }
    }
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const float d_super = LoadF16(block[c]);
      const float dmin = LoadF16(block[c] + 2);
      const __m256i min_pairs =
          _mm256_shuffle_epi8(packed_scales[c], MinPairsMask());
#pragma GCC unroll 4
      for (int t = 0; t < R; ++t) {
        const __m256i msum =
            _mm256_madd_epi16(Load32(sums[t] + 16 * b), min_pairs);
        const float dx = d[t][b];
        lanes.acc[t][c] =
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t][c]),
                            _mm256_set1_ps(d_super * dx), lanes.acc[t][c]);
        lanes.acc[t][c] =
            _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum),
                             _mm256_set1_ps(dmin * dx), lanes.acc[t][c]);
      }
    }
  }
  lanes.Store(y, ldy);
}

// Bytes 0-7 = g, 8-15 = g + 1: after sign extension, group g's scale in the
// low 128-bit half of 16-bit lanes and group g+1's in the high half.
inline __m128i GroupPairMask(int g) {
  return _mm_setr_epi8(g, g, g, g, g, g, g, g, g + 1, g + 1, g + 1, g + 1,
                       g + 1, g + 1, g + 1, g + 1);
}

// Q6_K: per super-block, Σ w·x = d·d_x·Σ_g scale_g·(Σ q·q_x − 32·Σ q_x), g
// over the 16 groups of 16. The 6-bit q is vpmaddubsw's unsigned operand
// (pairs <= 2·63·127); the signed 8-bit scales go in by vpdpwssd, the low
// 128-bit half of a 32-value vector taking group 2i's scale, the high half
// group 2i+1's.
template <int R, int C>
void Q6_KDots(const uint8_t* rows, int64_t row_bytes, int64_t cols,
              const Int8Activations& x, int64_t t0, float* y, int64_t ldy) {
  FloatLanes<R, C> lanes;
  const ActivationRows<R> a(x, t0, /*k_quants=*/true);
  const auto& q = a.q;
  const auto& d = a.d;
  const auto& sums = a.sums;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i low2 = _mm256_set1_epi8(0x03);
  for (int64_t b = 0; b < cols / 256; ++b) {
    const uint8_t* block[C];
    __m128i scales8[C];
    __m256i isum[R][C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      block[c] = rows + c * row_bytes + b * model::kQ6_KBytes;
      scales8[c] =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(block[c] + 192));
#pragma GCC unroll 4
      for (int t = 0; t < R; ++t) isum[t][c] = _mm256_setzero_si256();
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const uint8_t* ql = block[c] + 64 * h;
        const __m256i a = Load32(ql);
        const __m256i e = Load32(ql + 32);
        const __m256i hb = Load32(block[c] + 128 + 32 * h);
        auto high_bits = [&](int shift) {
          return _mm256_slli_epi16(
              _mm256_and_si256(_mm256_srli_epi16(hb, shift), low2), 4);
        };
        const __m256i q6[4] = {
            _mm256_or_si256(_mm256_and_si256(a, low4), high_bits(0)),
            _mm256_or_si256(_mm256_and_si256(e, low4), high_bits(2)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low4),
                            high_bits(4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(e, 4), low4),
                            high_bits(6))};
        __m256i scales[4];
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
          scales[i] = _mm256_cvtepi8_epi16(
              _mm_shuffle_epi8(scales8[c], GroupPairMask(8 * h + 2 * i)));
        }
#pragma GCC unroll 4
        for (int t = 0; t < R; ++t) {
          const int8_t* xq = q[t] + 256 * b + 128 * h;
#pragma GCC unroll 4
          for (int i = 0; i < 4; ++i) {
            isum[t][c] = DotPairs(
                isum[t][c], _mm256_maddubs_epi16(q6[i], Load32(xq + 32 * i)),
                scales[i]);
          }
        }
      }
    }
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const float d_super = LoadF16(block[c] + 208);
      const __m256i group_scales = _mm256_cvtepi8_epi16(scales8[c]);
#pragma GCC unroll 4
      for (int t = 0; t < R; ++t) {
        const __m256i offset =
            _mm256_madd_epi16(Load32(sums[t] + 16 * b), group_scales);
        const float dd = d_super * d[t][b];
        lanes.acc[t][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t][c]),
                                          _mm256_set1_ps(dd), lanes.acc[t][c]);
        lanes.acc[t][c] =
            _mm256_fnmadd_ps(_mm256_cvtepi32_ps(offset),
                             _mm256_set1_ps(32.0f * dd), lanes.acc[t][c]);
      }
    }
  }
  lanes.Store(y, ldy);
}

#ifdef PDSERVE_INT8_AVX512
// GCC 12's AVX-512 headers pass _mm512_undefined_*() results as the unused
// merge operand of insert/extract builtins, which -Wuninitialized reports
// at every use.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// AVX-512 (BW, VL, VNNI): 64 values per multiply instruction, and the scale
// and min/offset terms folded into fewer float ops per pair. The same
// integers per block as the 256-bit kernels above (which builds without
// AVX-512 use); floats summed in 16 lanes instead of 8.

template <int R, int C>
struct WideLanes {
  __m512 acc[R][C];    // Σ over blocks of scale · integer products
  __m512 terms[R][C];  // the min/offset terms
  WideLanes() {
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t) {
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        acc[t][c] = _mm512_setzero_ps();
        terms[t][c] = _mm512_setzero_ps();
      }
    }
  }
  void Store(float* y, int64_t ldy) const {
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t) {
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        y[t * ldy + c] =
            _mm512_reduce_add_ps(acc[t][c]) + _mm512_reduce_add_ps(terms[t][c]);
      }
    }
  }
};

inline __m512i Load64(const void* p) { return _mm512_loadu_si512(p); }

// 16-bit lane shifts: 0 in the low 256 bits, `high` in the upper.
inline __m512i HalfShifts(int low, int high) {
  return _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(low)),
                            _mm256_set1_epi16(static_cast<int16_t>(high)), 1);
}

// Byte j zero-extended into the 16-bit lanes of the low 256 bits, byte j+1
// into the upper (from a vector with the same 16 bytes in each 128 bits).
inline __m512i HalvesByteMask(int j) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(BroadcastByteMask(j)),
                            BroadcastByteMask(j + 1), 1);
}

// vphaddd within each 128-bit lane of 512-bit vectors: [a0+a1, a2+a3,
// b0+b1, b2+b3] per lane.
inline __m512i HorizontalPairSums(__m512i a, __m512i b) {
  const __m512 fa = _mm512_castsi512_ps(a), fb = _mm512_castsi512_ps(b);
  return _mm512_add_epi32(
      _mm512_castps_si512(_mm512_shuffle_ps(fa, fb, _MM_SHUFFLE(2, 0, 2, 0))),
      _mm512_castps_si512(_mm512_shuffle_ps(fa, fb, _MM_SHUFFLE(3, 1, 3, 1))));
}

// Q4_K in AVX-512 builds. Per block b (256 values) of a pair, the exact
// integers E_b = Σ_{j even} sc_j·Σ q_w·q_x and O_b (odd sub-blocks j), and
// per group of 4 blocks one float step on [E_0..E_3 | O_0..O_3]:
//   acc -= mins_b · (d_x·Σ q_x per sub-block)   for each real block b,
//   acc = fma(float(E|O), [d_0..d_3 | d_0..d_3] · [d_x0..d_x3 | ...], acc),
// both kernels below (in-place rows for decode, packed rows for prefill)
// with the same float operations.
inline __m256 Q4_KGroupStep(__m256i even_odd, __m256 d, __m256 dx, __m256 acc) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(even_odd), _mm256_mul_ps(d, dx),
                         acc);
}

// min_j · dmin of a Q4_K block as floats, lane j = sub-block j.
inline __m256 Q4_KMins(const uint8_t* block, __m128i scales_and_mins) {
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                           _mm_srli_si128(scales_and_mins, 8))),
                       _mm256_set1_ps(LoadF16(block + 2)));
}

// In place: a chunk's 32 bytes, loaded into both halves and shifted by 0 | 4,
// are its two sub-blocks' 64 values in order (even sub-block low, odd high);
// vpmaddubsw and vpdpwssd by the sub-block scales sum each half, and a
// vphaddd tree over the group's 4 blocks gives [E_0..E_3 | O_0..O_3].
template <int R, int C, bool kTail>
inline void Q4_KGroupWide(const uint8_t* rows, int64_t row_bytes,
                          const ActivationRows<R>& a, int64_t g0, int64_t count,
                          FloatLanes<R, C>& lanes) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i shifts = HalfShifts(0, 4);
  __m512i isum[kKQuantGroupBlocks][R][C];
  alignas(16) float d_super[C][kKQuantGroupBlocks];
#pragma GCC unroll 4
  for (int s = 0; s < kKQuantGroupBlocks; ++s) {
    const int64_t b = g0 + s;
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t) {
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) isum[s][t][c] = _mm512_setzero_si512();
    }
    if (kTail && s >= count) {  // padding of the last group
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) d_super[c][s] = 0.0f;
      continue;
    }
    const uint8_t* block[C];
    __m512i scales[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      block[c] = rows + c * row_bytes + b * model::kQ4_KBytes;
      d_super[c][s] = LoadF16(block[c]);
      const __m128i scales_and_mins = Q4KScalesAndMins(block[c] + 4);
      scales[c] = _mm512_broadcast_i32x4(scales_and_mins);
      const __m256 mins = Q4_KMins(block[c], scales_and_mins);
#pragma GCC unroll 4
      for (int t = 0; t < R; ++t) {
        lanes.acc[t][c] = _mm256_fnmadd_ps(
            mins, _mm256_loadu_ps(a.scaled32[t] + 8 * b), lanes.acc[t][c]);
      }
    }
#pragma GCC unroll 4
    for (int chunk = 0; chunk < 4; ++chunk) {
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const __m512i w = _mm512_and_si512(
            _mm512_srlv_epi16(
                _mm512_broadcast_i64x4(Load32(block[c] + 16 + 32 * chunk)),
                shifts),
            nibble);
        const __m512i scale =
            _mm512_shuffle_epi8(scales[c], HalvesByteMask(2 * chunk));
#pragma GCC unroll 4
        for (int t = 0; t < R; ++t) {
          isum[s][t][c] = _mm512_dpwssd_epi32(
              isum[s][t][c],
              _mm512_maddubs_epi16(w, Load64(a.q[t] + 256 * b + 64 * chunk)),
              scale);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int t = 0; t < R; ++t) {
    const __m256 dx =
        _mm256_broadcast_ps(reinterpret_cast<const __m128*>(a.d[t] + g0));
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      // 128-bit lane k of `quarters`: the 4 blocks' sums of lanes 4k..4k+3
      // (lanes 0-7 even sub-blocks, 8-15 odd).
      const __m512i quarters =
          HorizontalPairSums(HorizontalPairSums(isum[0][t][c], isum[1][t][c]),
                             HorizontalPairSums(isum[2][t][c], isum[3][t][c]));
      const __m512i halves =
          _mm512_shuffle_i64x2(quarters, quarters, _MM_SHUFFLE(3, 1, 2, 0));
      const __m256i even_odd = _mm256_add_epi32(
          _mm512_castsi512_si256(halves), _mm512_extracti64x4_epi64(halves, 1));
      const __m128 d4 = _mm_load_ps(d_super[c]);
      lanes.acc[t][c] =
          Q4_KGroupStep(even_odd, _mm256_set_m128(d4, d4), dx, lanes.acc[t][c]);
    }
  }
}

template <int R, int C>
void Q4_KDotsWide(const uint8_t* rows, int64_t row_bytes, int64_t cols,
                  const Int8Activations& x, int64_t t0, float* y, int64_t ldy) {
  FloatLanes<R, C> lanes;
  const ActivationRows<R> a(x, t0, /*k_quants=*/true);
  const int64_t blocks = cols / 256;
  int64_t g0 = 0;
  for (; g0 + kKQuantGroupBlocks <= blocks; g0 += kKQuantGroupBlocks) {
    Q4_KGroupWide<R, C, false>(rows, row_bytes, a, g0, kKQuantGroupBlocks,
                               lanes);
  }
  if (g0 < blocks) {
    Q4_KGroupWide<R, C, true>(rows, row_bytes, a, g0, blocks - g0, lanes);
  }
  lanes.Store(y, ldy);
}

// Q4_K weight rows repacked for the prefill kernel in tiles of two rows.
// Per block: 8 chunks of 64 bytes (32 per row: values 4j..4j+3 of the
// sub-blocks in kPackedSubBlock order, one unsigned byte each), the rows'
// sub-block scales as int32 in the same order (2 x 8), and their
// min_j · dmin as floats in sub-block order (2 x 8); per group of 4 blocks
// then [d_0..d_3 | d_0..d_3] per row (2 x 8 floats).
constexpr int64_t kPackedQ4_KBlockBytes = 512 + 64 + 64;
constexpr int64_t kPackedQ4_KGroupBytes =
    kKQuantGroupBlocks * kPackedQ4_KBlockBytes + 64;

void PackQ4_KWeights(const uint8_t* rows, int64_t row_bytes, int64_t row_count,
                     int64_t blocks, uint8_t* out) {
  const int64_t groups = (blocks + kKQuantGroupBlocks - 1) / kKQuantGroupBlocks;
  const int64_t tile_bytes = groups * kPackedQ4_KGroupBytes;
  const int64_t tiles = (row_count + 1) / 2;
  // Zeros where no real block or row writes: the last group of each tile
  // (padding blocks, and d entries past the last block) and, with an odd
  // row count, the last tile's second row. Real blocks overwrite the rest.
  if (row_count % 2 != 0) {
    std::memset(out + (tiles - 1) * tile_bytes, 0, tile_bytes);
  }
  for (int64_t t = 0; t < tiles; ++t) {
    std::memset(out + t * tile_bytes + (groups - 1) * kPackedQ4_KGroupBytes, 0,
                kPackedQ4_KGroupBytes);
  }
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m128i order =
      _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, -1, -1, -1, -1, -1, -1, -1, -1);
  for (int64_t r = 0; r < row_count; ++r) {
    const uint8_t* row = rows + r * row_bytes;
    uint8_t* tile = out + r / 2 * tile_bytes;
    const int i = static_cast<int>(r % 2);
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = row + b * model::kQ4_KBytes;
      uint8_t* group = tile + b / kKQuantGroupBlocks * kPackedQ4_KGroupBytes;
      uint8_t* packed = group + b % kKQuantGroupBlocks * kPackedQ4_KBlockBytes;
      __m256i v[8];  // sub-blocks 0..7
#pragma GCC unroll 4
      for (int chunk = 0; chunk < 4; ++chunk) {
        const __m256i bytes = Load32(block + 16 + 32 * chunk);
        v[2 * chunk] = _mm256_and_si256(bytes, nibble);
        v[2 * chunk + 1] =
            _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
      }
      __m256i lanes[8];
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) lanes[p] = v[kPackedSubBlock[p]];
      Transpose8x8(lanes);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        _mm256_storeu_si256(
            reinterpret_cast<__m256i*>(packed + 64 * j + 32 * i), lanes[j]);
      }
      const __m128i scales_and_mins = Q4KScalesAndMins(block + 4);
      _mm256_storeu_si256(
          reinterpret_cast<__m256i*>(packed + 512 + 32 * i),
          _mm256_cvtepu8_epi32(_mm_shuffle_epi8(scales_and_mins, order)));
      _mm256_storeu_ps(reinterpret_cast<float*>(packed + 576 + 32 * i),
                       Q4_KMins(block, scales_and_mins));
      float* d = reinterpret_cast<float*>(
          group + kKQuantGroupBlocks * kPackedQ4_KBlockBytes + 32 * i);
      d[b % kKQuantGroupBlocks] = d[b % kKQuantGroupBlocks + 4] =
          LoadF16(block);
    }
  }
}

// R packed activation rows from t0 by C tiles of packed Q4_K rows: per
// chunk one vpdpbusd per pair gives 4 values of each sub-block of both
// rows; vpmulld by the sub-block scales and a vphaddd tree over the group's
// blocks give each row's [E_0..E_3 | O_0..O_3] in its half.
template <int R, int C>
void PackedQ4_KDots(const uint8_t* tiles, int64_t blocks,
                    const Int8Activations& x, int64_t t0, float* y, int64_t ldy,
                    int64_t rows_left) {
  __m512 acc[R][C];
  const int8_t* xq[R];
  const float* dx[R];
  const float* sums[R];
#pragma GCC unroll 4
  for (int t = 0; t < R; ++t) {
    xq[t] = x.packed_k(t0 + t);
    dx[t] = x.d256(t0 + t);
    sums[t] = x.scaled_sums32(t0 + t);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[t][c] = _mm512_setzero_ps();
  }
  const int64_t groups = (blocks + kKQuantGroupBlocks - 1) / kKQuantGroupBlocks;
  const int64_t tile_stride = groups * kPackedQ4_KGroupBytes;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group = tiles + g * kPackedQ4_KGroupBytes;
    __m512i pairs[R][C];  // the first two blocks' vphaddd
    __m512i tree[R][C];   // ... and the group's
    for (int s = 0; s < kKQuantGroupBlocks; ++s) {
      const int64_t b = g * kKQuantGroupBlocks + s;
      __m512i sub[R][C];
      if (b < blocks) {
        const uint8_t* w = group + s * kPackedQ4_KBlockBytes;
#pragma GCC unroll 4
        for (int t = 0; t < R; ++t) {
          const __m512 scaled =
              _mm512_broadcast_f32x8(_mm256_loadu_ps(sums[t] + 8 * b));
#pragma GCC unroll 4
          for (int c = 0; c < C; ++c) {
            sub[t][c] = _mm512_setzero_si512();
            acc[t][c] = _mm512_fnmadd_ps(
                _mm512_loadu_ps(w + c * tile_stride + 576), scaled, acc[t][c]);
          }
        }
        PackedGroupDots</*kUnsignedWeights=*/true>(w, tile_stride, xq, 256 * b,
                                                   sub);
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
          const __m512i scale = _mm512_loadu_si512(w + c * tile_stride + 512);
#pragma GCC unroll 4
          for (int t = 0; t < R; ++t) {
            sub[t][c] = _mm512_mullo_epi32(sub[t][c], scale);
          }
        }
      } else {
#pragma GCC unroll 4
        for (int t = 0; t < R; ++t) {
#pragma GCC unroll 4
          for (int c = 0; c < C; ++c) sub[t][c] = _mm512_setzero_si512();
        }
      }
#pragma GCC unroll 4
      for (int t = 0; t < R; ++t) {
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
          if (s % 2 == 0) {
            tree[t][c] = sub[t][c];
          } else if (s == 1) {
            pairs[t][c] = HorizontalPairSums(tree[t][c], sub[t][c]);
          } else {
            tree[t][c] = HorizontalPairSums(
                pairs[t][c], HorizontalPairSums(tree[t][c], sub[t][c]));
          }
        }
      }
    }
    const uint8_t* d = group + kKQuantGroupBlocks * kPackedQ4_KBlockBytes;
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t) {
      const __m512 dxg =
          _mm512_broadcast_f32x4(_mm_loadu_ps(dx[t] + kKQuantGroupBlocks * g));
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        acc[t][c] = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(tree[t][c]),
            _mm512_mul_ps(_mm512_loadu_ps(d + c * tile_stride), dxg),
            acc[t][c]);
      }
    }
  }
  StoreTileHalves(acc, y, ldy, rows_left);
}

void PackedQ4_KRowDots(const uint8_t* rows, int64_t row_bytes,
                       int64_t row_count, int64_t cols,
                       const Int8Activations& x, float* y, int64_t ldy) {
  const int64_t blocks = cols / 256;
  const int64_t groups = (blocks + kKQuantGroupBlocks - 1) / kKQuantGroupBlocks;
  const int64_t tile_stride = groups * kPackedQ4_KGroupBytes;
  const int64_t tiles = (row_count + 1) / 2;
  CacheAlignedVector<uint8_t>& packed = PackedWeightBuffer();
  int64_t first = 0;  // the first tile in the buffer
  ForEachPackedTile<2>(
      x, cols, tiles, tile_stride,
      [&](int64_t i0, int64_t i1) {
        first = i0;
        const int64_t r1 = std::min(row_count, 2 * i1);
        packed.resize((i1 - i0) * tile_stride);
        PackQ4_KWeights(rows + 2 * i0 * row_bytes, row_bytes, r1 - 2 * i0,
                        blocks, packed.data());
      },
      [&]<int R, int C>(int64_t i, int64_t t) {
        PackedQ4_KDots<R, C>(packed.data() + (i - first) * tile_stride, blocks,
                             x, t, y + t * ldy + 2 * i, ldy, row_count - 2 * i);
      });
}

// [g x 8, g+1 x 8 | g+2 x 8, g+3 x 8] (bytes, per 128-bit lane).
inline __m256i GroupQuadMask(int g) {
  return _mm256_setr_m128i(GroupPairMask(g), GroupPairMask(g + 2));
}

// Q6_K: 64 bytes of ql hold a half's values 0-63 (low nibbles) and 64-127
// (high) in order; their 2-bit highs come from the half's 32 qh bytes,
// loaded into both 256-bit halves and shifted by 0 | 2 and 4 | 6.
template <int R, int C>
void Q6_KDotsWide(const uint8_t* rows, int64_t row_bytes, int64_t cols,
                  const Int8Activations& x, int64_t t0, float* y, int64_t ldy) {
  WideLanes<R, C> lanes;
  const ActivationRows<R> a(x, t0, /*k_quants=*/true);
  const auto& q = a.q;
  const auto& d = a.d;
  const auto& sums = a.scaled16;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i low2 = _mm512_set1_epi8(0x03);
  const __m512i shifts_lo = HalfShifts(0, 2);
  const __m512i shifts_hi = HalfShifts(4, 6);
  for (int64_t b = 0; b < cols / 256; ++b) {
    const uint8_t* block[C];
    __m256i scales8[C];
    __m512i isum[R][C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      block[c] = rows + c * row_bytes + b * model::kQ6_KBytes;
      const __m128i group_scales =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(block[c] + 192));
      scales8[c] = _mm256_broadcastsi128_si256(group_scales);
      // 32 · d · scale_g, subtracted against Σ q_x · d_x per group.
      const __m512 offsets =
          _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(group_scales)),
                        _mm512_set1_ps(32.0f * LoadF16(block[c] + 208)));
#pragma GCC unroll 4
      for (int t = 0; t < R; ++t) {
        isum[t][c] = _mm512_setzero_si512();
        lanes.terms[t][c] = _mm512_fnmadd_ps(
            offsets, _mm512_loadu_ps(sums[t] + 16 * b), lanes.terms[t][c]);
      }
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const __m512i a = Load64(block[c] + 64 * h);
        const __m512i hb =
            _mm512_broadcast_i64x4(Load32(block[c] + 128 + 32 * h));
        auto high_bits = [&](__m512i shifts) {
          return _mm512_slli_epi16(
              _mm512_and_si512(_mm512_srlv_epi16(hb, shifts), low2), 4);
        };
        const __m512i w_lo =
            _mm512_or_si512(_mm512_and_si512(a, low4), high_bits(shifts_lo));
        const __m512i w_hi =
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), low4),
                            high_bits(shifts_hi));
        const __m512i scale_lo = _mm512_cvtepi8_epi16(
            _mm256_shuffle_epi8(scales8[c], GroupQuadMask(8 * h)));
        const __m512i scale_hi = _mm512_cvtepi8_epi16(
            _mm256_shuffle_epi8(scales8[c], GroupQuadMask(8 * h + 4)));
#pragma GCC unroll 4
        for (int t = 0; t < R; ++t) {
          const int8_t* xq = q[t] + 256 * b + 128 * h;
          isum[t][c] = _mm512_dpwssd_epi32(
              isum[t][c], _mm512_maddubs_epi16(w_lo, Load64(xq)), scale_lo);
          isum[t][c] = _mm512_dpwssd_epi32(
              isum[t][c], _mm512_maddubs_epi16(w_hi, Load64(xq + 64)),
              scale_hi);
        }
      }
    }
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m512 d_super = _mm512_set1_ps(LoadF16(block[c] + 208));
#pragma GCC unroll 4
      for (int t = 0; t < R; ++t) {
        lanes.acc[t][c] = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(isum[t][c]),
            _mm512_mul_ps(d_super, _mm512_set1_ps(d[t][b])), lanes.acc[t][c]);
      }
    }
  }
  lanes.Store(y, ldy);
}
#pragma GCC diagnostic pop
#endif  // PDSERVE_INT8_AVX512

template <int R, int C>
void Dots(TensorFormat format, const uint8_t* rows, int64_t row_bytes,
          int64_t cols, const Int8Activations& x, int64_t t0, float* y,
          int64_t ldy) {
#ifdef PDSERVE_INT8_AVX512
  switch (format) {
    case TensorFormat::kQ8_0:  // measured faster than a 512-bit form
      return Q8_0Dots<R, C>(rows, row_bytes, cols, x, t0, y, ldy);
    case TensorFormat::kQ4_K:
      return Q4_KDotsWide<R, C>(rows, row_bytes, cols, x, t0, y, ldy);
    default:
      return Q6_KDotsWide<R, C>(rows, row_bytes, cols, x, t0, y, ldy);
  }
#else
  switch (format) {
    case TensorFormat::kQ8_0:
      return Q8_0Dots<R, C>(rows, row_bytes, cols, x, t0, y, ldy);
    case TensorFormat::kQ4_K:
      return Q4_KDots<R, C>(rows, row_bytes, cols, x, t0, y, ldy);
    default:
      return Q6_KDots<R, C>(rows, row_bytes, cols, x, t0, y, ldy);
  }
#endif
}

// Activation rows [t0, t1) against C weight rows: groups of 4 rows share
// each weight unpack.
template <int C>
void RowGroups(TensorFormat format, const uint8_t* rows, int64_t row_bytes,
               int64_t cols, const Int8Activations& x, int64_t t0, int64_t t1,
               float* y, int64_t ldy) {
  int64_t t = t0;
  for (; t + 4 <= t1; t += 4) {
    Dots<4, C>(format, rows, row_bytes, cols, x, t, y + t * ldy, ldy);
  }
  switch (t1 - t) {
    case 3:
      return Dots<3, C>(format, rows, row_bytes, cols, x, t, y + t * ldy, ldy);
    case 2:
      return Dots<2, C>(format, rows, row_bytes, cols, x, t, y + t * ldy, ldy);
    case 1:
      return Dots<1, C>(format, rows, row_bytes, cols, x, t, y + t * ldy, ldy);
    default:
      return;
  }
}

}  // namespace

bool Int8ActivationKernelsAvailable() { return true; }

void Int8RowDots(TensorFormat format, const uint8_t* rows, int64_t row_bytes,
                 int64_t row_count, int64_t cols, const Int8Activations& x,
                 float* y, int64_t ldy) {
#ifdef PDSERVE_INT8_VNNI
  if (format == TensorFormat::kQ8_0 && x.has_packed_q8_0()) {
    return PackedQ8_0RowDots(rows, row_bytes, row_count, cols, x, y, ldy);
  }
#endif
#ifdef PDSERVE_INT8_AVX512
  if (format == TensorFormat::kQ4_K && x.has_packed_k()) {
    return PackedQ4_KRowDots(rows, row_bytes, row_count, cols, x, y, ldy);
  }
#endif
  // Activation rows in blocks that stay in L1/L2 while the weight rows pass
  // over them, K-quant rows two at a time (each activation load feeds two
  // weight rows).
  const int64_t block_rows = std::max<int64_t>(4, (64 << 10) / cols / 4 * 4);
  for (int64_t t0 = 0; t0 < x.rows(); t0 += block_rows) {
    const int64_t t1 = std::min(x.rows(), t0 + block_rows);
    int64_t r = 0;
    // Q8_0 pairs weight rows only for wider inputs: at 1-4 activation rows
    // the paired kernel measured 2.6-3x slower (32000 x 768 rows, and whole
    // decode steps), at 512 rows 4-7% faster.
    const bool pair_rows = format != TensorFormat::kQ8_0 || x.rows() > 4;
    for (; pair_rows && r + 2 <= row_count; r += 2) {
      RowGroups<2>(format, rows + r * row_bytes, row_bytes, cols, x, t0, t1,
                   y + r, ldy);
    }
    for (; r < row_count; ++r) {
      RowGroups<1>(format, rows + r * row_bytes, row_bytes, cols, x, t0, t1,
                   y + r, ldy);
    }
  }
}

#else  // !PDSERVE_INT8_AVX2

bool Int8ActivationKernelsAvailable() { return false; }

void Int8RowDots(TensorFormat, const uint8_t*, int64_t, int64_t, int64_t,
                 const Int8Activations&, float*, int64_t) {}

#endif

}  // namespace pdserve::engine::internal
