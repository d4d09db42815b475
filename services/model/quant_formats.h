// Storage formats of weight tensors, the GGML block-quantized ones included,
// written from their public description (ggml's block_q8_0, block_q4_K and
// block_q6_K; little-endian, no padding):
//
//   Q8_0  32 values in 34 bytes:  f16 d, int8 q[32];        x = d·q
//   Q4_K 256 values in 144 bytes: f16 d, f16 dmin, 12 bytes of packed 6-bit
//         (scale, min) pairs for 8 sub-blocks of 32, 128 bytes of 4-bit q;
//         sub-block j: x = (d·scale_j)·q − dmin·min_j. Bytes qs[32c + l] hold
//         value l of sub-block 2c in the low nibble and of 2c+1 in the high.
//   Q6_K 256 values in 210 bytes: ql[128] (low 4 bits), qh[64] (high 2
//         bits), int8 scales[16] (one per 16 values), f16 d;
//         x = (d·scale_{i/16})·(q − 32) with q the 6-bit value.
//
// A tensor of these formats is stored row by row, each row a whole number
// of blocks along its innermost dimension; that is what lets a row range
// (and a column range on block boundaries) be used in place.
#pragma once

#include <cstdint>
#include <string_view>

namespace pdserve::model {

enum class TensorFormat : uint8_t { kF32, kF16, kBF16, kQ8_0, kQ4_K, kQ6_K };

std::string_view TensorFormatName(TensorFormat format);  // "Q4_K", "F16", ...
bool IsQuantized(TensorFormat format);
// Values per block (1 for F32/F16/BF16) and bytes per block.
int64_t BlockElements(TensorFormat format);
int64_t BlockBytes(TensorFormat format);
// Bytes of `elements` values; `elements` must be a multiple of the block.
inline int64_t RowBytes(TensorFormat format, int64_t elements) {
  return elements / BlockElements(format) * BlockBytes(format);
}

inline constexpr int64_t kQ8_0Elements = 32;
inline constexpr int64_t kQ8_0Bytes = 34;
inline constexpr int64_t kQKElements = 256;  // Q4_K and Q6_K super-blocks
inline constexpr int64_t kQ4_KBytes = 144;
inline constexpr int64_t kQ6_KBytes = 210;

// Sub-block j (0..7) of a Q4_K block: its 6-bit scale and min from the 12
// packed bytes. j < 4: low 6 bits of bytes j and j+4. j >= 4: the low/high
// nibble of byte j+4 plus the top two bits of bytes j-4 / j as bits 4-5.
inline void Q4KScaleMin(const uint8_t* scales, int j, uint8_t* scale,
                        uint8_t* min) {
  if (j < 4) {
    *scale = scales[j] & 63;
    *min = scales[j + 4] & 63;
  } else {
    *scale = (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4);
    *min = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
  }
}

// out[0, count) = the values of `count` consecutive elements at `src`
// (count a multiple of BlockElements(format)). The reference the kernels
// and tests/model/ggml_blocks_ref.py are checked against.
void DequantizeRow(TensorFormat format, const uint8_t* src, int64_t count,
                   float* out);

// Encodes `count` values into `format` (count a multiple of the block): a
// plain reference quantizer (round to nearest with per-block max scaling,
// no search), for tests and for the benchmark's file generator. F32/F16/
// BF16 are conversions.
void QuantizeRow(TensorFormat format, const float* src, int64_t count,
                 uint8_t* out);

}  // namespace pdserve::model
