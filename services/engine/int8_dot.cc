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
  if (for_q8_0) {
    q32_.resize(n * cols);
    d32_.resize(n * (cols / 32));
  }
  if (for_k_quants) {
    q256_.resize(n * cols);
    d256_.resize(n * (cols / 256));
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
      for (int64_t b = 0; b < cols / 32; ++b) {
        d32_[t * (cols / 32) + b] =
            QuantizeBlock(row + 32 * b, 32, q32_.data() + t * cols + 32 * b);
      }
    }
    if (!for_k_quants_) continue;
    int8_t* q = q256_.data() + t * cols;
    float* d = d256_.data() + t * (cols / 256);
    for (int64_t b = 0; b < cols / 256; ++b) {
      d[b] = QuantizeBlock(row + 256 * b, 256, q + 256 * b);
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

// Q8_0: per block of 32, Σ w·x = (d_w·d_x)·Σ q_w·q_x. vpdpbusd multiplies
// unsigned by signed bytes, so |q_w| goes unsigned and q_w's sign moves onto
// q_x (the products are unchanged).
template <int R, int C>
void Q8_0Dots(const uint8_t* rows, int64_t row_bytes, int64_t cols,
              const Int8Activations& x, int64_t t0, float* y, int64_t ldy) {
  FloatLanes<R, C> lanes;
  const ActivationRows<R> a(x, t0, /*k_quants=*/false);
  const auto& q = a.q;
  const auto& d = a.d;
  for (int64_t b = 0; b < cols / 32; ++b) {
    __m256i w[C], w_abs[C];
    float dw[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const uint8_t* block = rows + c * row_bytes + b * model::kQ8_0Bytes;
      dw[c] = LoadF16(block);
      w[c] = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(block + 18),
                                 reinterpret_cast<const __m128i*>(block + 2));
      w_abs[c] = _mm256_sign_epi8(w[c], w[c]);
    }
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t) {
      const __m256i xq = Load32(q[t] + 32 * b);
      const float dx = d[t][b];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const __m256i dot = DotBytes(_mm256_setzero_si256(), w_abs[c],
                                     _mm256_sign_epi8(xq, w[c]));
        lanes.acc[t][c] =
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw[c] * dx),
                            lanes.acc[t][c]);
      }
    }
  }
  lanes.Store(y, ldy);
}

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

// Q4_K: a chunk's 32 bytes, loaded into both halves and shifted by 0 | 4,
// are its two sub-blocks' 64 values in order.
template <int R, int C>
void Q4_KDotsWide(const uint8_t* rows, int64_t row_bytes, int64_t cols,
                  const Int8Activations& x, int64_t t0, float* y, int64_t ldy) {
  WideLanes<R, C> lanes;
  const ActivationRows<R> a(x, t0, /*k_quants=*/true);
  const auto& q = a.q;
  const auto& d = a.d;
  const auto& sums = a.scaled32;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i shifts = HalfShifts(0, 4);
  for (int64_t b = 0; b < cols / 256; ++b) {
    const uint8_t* block[C];
    __m512i scales[C];
    __m512i isum[R][C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      block[c] = rows + c * row_bytes + b * model::kQ4_KBytes;
      const __m128i scales_and_mins = Q4KScalesAndMins(block[c] + 4);
      scales[c] = _mm512_broadcast_i32x4(scales_and_mins);
      // min_j · dmin, subtracted against Σ q_x · d_x per sub-block.
      const __m256 mins = _mm256_mul_ps(
          _mm256_cvtepi32_ps(
              _mm256_cvtepu8_epi32(_mm_srli_si128(scales_and_mins, 8))),
          _mm256_set1_ps(LoadF16(block[c] + 2)));
#pragma GCC unroll 4
      for (int t = 0; t < R; ++t) {
        isum[t][c] = _mm512_setzero_si512();
        lanes.terms[t][c] = _mm512_castps256_ps512(
            _mm256_fnmadd_ps(mins, _mm256_loadu_ps(sums[t] + 8 * b),
                             _mm512_castps512_ps256(lanes.terms[t][c])));
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
          isum[t][c] = _mm512_dpwssd_epi32(
              isum[t][c],
              _mm512_maddubs_epi16(w, Load64(q[t] + 256 * b + 64 * chunk)),
              scale);
        }
      }
    }
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m512 d_super = _mm512_set1_ps(LoadF16(block[c]));
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
