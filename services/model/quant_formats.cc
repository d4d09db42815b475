#include "model/quant_formats.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/float16.h"

namespace pdserve::model {
namespace {

float LoadF16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return F16ToFloat(bits);
}

void StoreF16(uint8_t* p, float value) {
  const uint16_t bits = FloatToF16(value);
  std::memcpy(p, &bits, 2);
}

int NearestInt(float x) { return static_cast<int>(std::lrintf(x)); }

void DequantizeQ8_0(const uint8_t* block, float* out) {
  const float d = LoadF16(block);
  const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
  for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>(q[i]);
}

void DequantizeQ4_K(const uint8_t* block, float* out) {
  const float d = LoadF16(block);
  const float dmin = LoadF16(block + 2);
  const uint8_t* scales = block + 4;
  const uint8_t* qs = block + 16;
  for (int c = 0; c < 4; ++c) {  // 64 values: sub-blocks 2c (low) and 2c+1
    uint8_t sc, m;
    Q4KScaleMin(scales, 2 * c, &sc, &m);
    const float d1 = d * sc, m1 = dmin * m;
    Q4KScaleMin(scales, 2 * c + 1, &sc, &m);
    const float d2 = d * sc, m2 = dmin * m;
    const uint8_t* q = qs + 32 * c;
    for (int l = 0; l < 32; ++l) out[64 * c + l] = d1 * (q[l] & 0xF) - m1;
    for (int l = 0; l < 32; ++l) out[64 * c + 32 + l] = d2 * (q[l] >> 4) - m2;
  }
}

// Value i of a Q6_K block (0..63, before the -32 offset). Within each half
// of 128 values, value 32k + l (k < 4, l < 32) takes its low nibble from
// ql[64h + l + 32 (k & 1)] (low nibble for k < 2, high for k >= 2) and its
// top two bits from bits 2k..2k+1 of qh[32h + l].
int Q6KValue(const uint8_t* ql, const uint8_t* qh, int i) {
  const int h = i / 128, k = (i % 128) / 32, l = i % 32;
  const uint8_t low_byte = ql[64 * h + l + 32 * (k & 1)];
  const int low = k < 2 ? (low_byte & 0xF) : (low_byte >> 4);
  const int high = (qh[32 * h + l] >> (2 * k)) & 3;
  return low | (high << 4);
}

void DequantizeQ6_K(const uint8_t* block, float* out) {
  const uint8_t* ql = block;
  const uint8_t* qh = block + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
  const float d = LoadF16(block + 208);
  for (int i = 0; i < 256; ++i) {
    out[i] = d * static_cast<float>(scales[i / 16]) *
             static_cast<float>(Q6KValue(ql, qh, i) - 32);
  }
}

void QuantizeQ8_0(const float* x, uint8_t* block) {
  float amax = 0;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.0f;
  const float id = d != 0 ? 1.0f / d : 0.0f;
  StoreF16(block, d);
  int8_t* q = reinterpret_cast<int8_t*>(block + 2);
  for (int i = 0; i < 32; ++i) {
    q[i] = static_cast<int8_t>(std::clamp(NearestInt(x[i] * id), -127, 127));
  }
}

void QuantizeQ4_K(const float* x, uint8_t* block) {
  float scale[8], min[8];
  float max_scale = 0, max_min = 0;
  for (int j = 0; j < 8; ++j) {
    float lo = 0, hi = x[32 * j];
    for (int i = 0; i < 32; ++i) {
      lo = std::min(lo, x[32 * j + i]);
      hi = std::max(hi, x[32 * j + i]);
    }
    scale[j] = std::max(hi - lo, 0.0f) / 15.0f;
    min[j] = -lo;
    max_scale = std::max(max_scale, scale[j]);
    max_min = std::max(max_min, min[j]);
  }
  StoreF16(block, max_scale / 63.0f);
  StoreF16(block + 2, max_min / 63.0f);
  // Scales are encoded against the f16 values the reader will see.
  const float d = LoadF16(block), dmin = LoadF16(block + 2);
  uint8_t ls[8], lm[8];
  for (int j = 0; j < 8; ++j) {
    ls[j] = static_cast<uint8_t>(
        d > 0 ? std::clamp(NearestInt(scale[j] / d), 0, 63) : 0);
    lm[j] = static_cast<uint8_t>(
        dmin > 0 ? std::clamp(NearestInt(min[j] / dmin), 0, 63) : 0);
  }
  uint8_t* scales = block + 4;
  std::memset(scales, 0, 12);
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      scales[j] |= ls[j];
      scales[j + 4] |= lm[j];
    } else {
      scales[j + 4] =
          static_cast<uint8_t>((ls[j] & 0xF) | ((lm[j] & 0xF) << 4));
      scales[j - 4] |= static_cast<uint8_t>((ls[j] >> 4) << 6);
      scales[j] |= static_cast<uint8_t>((lm[j] >> 4) << 6);
    }
  }
  uint8_t q[256];
  for (int j = 0; j < 8; ++j) {
    const float step = d * ls[j], offset = dmin * lm[j];
    for (int i = 0; i < 32; ++i) {
      q[32 * j + i] = static_cast<uint8_t>(
          step > 0
              ? std::clamp(NearestInt((x[32 * j + i] + offset) / step), 0, 15)
              : 0);
    }
  }
  uint8_t* qs = block + 16;
  for (int c = 0; c < 4; ++c) {
    for (int l = 0; l < 32; ++l) {
      qs[32 * c + l] =
          static_cast<uint8_t>(q[64 * c + l] | (q[64 * c + 32 + l] << 4));
    }
  }
}

void QuantizeQ6_K(const float* x, uint8_t* block) {
  float scale[16];
  float max_scale = 0;
  for (int j = 0; j < 16; ++j) {
    float amax = 0;
    for (int i = 0; i < 16; ++i)
      amax = std::max(amax, std::fabs(x[16 * j + i]));
    scale[j] = amax / 31.0f;
    max_scale = std::max(max_scale, scale[j]);
  }
  StoreF16(block + 208, max_scale / 127.0f);
  const float d = LoadF16(block + 208);
  int8_t* scales = reinterpret_cast<int8_t*>(block + 192);
  uint8_t q[256];
  for (int j = 0; j < 16; ++j) {
    scales[j] = static_cast<int8_t>(
        d > 0 ? std::clamp(NearestInt(scale[j] / d), -128, 127) : 0);
    const float step = d * scales[j];
    for (int i = 0; i < 16; ++i) {
      const int value =
          step != 0 ? std::clamp(NearestInt(x[16 * j + i] / step), -32, 31) : 0;
      q[16 * j + i] = static_cast<uint8_t>(value + 32);
    }
  }
  uint8_t* ql = block;
  uint8_t* qh = block + 128;
  std::memset(ql, 0, 128);
  std::memset(qh, 0, 64);
  for (int i = 0; i < 256; ++i) {
    const int h = i / 128, k = (i % 128) / 32, l = i % 32;
    uint8_t& low_byte = ql[64 * h + l + 32 * (k & 1)];
    low_byte |= static_cast<uint8_t>(k < 2 ? (q[i] & 0xF) : (q[i] & 0xF) << 4);
    qh[32 * h + l] |= static_cast<uint8_t>((q[i] >> 4) << (2 * k));
  }
}

}  // namespace

std::string_view TensorFormatName(TensorFormat format) {
  switch (format) {
    case TensorFormat::kF32:
      return "F32";
    case TensorFormat::kF16:
      return "F16";
    case TensorFormat::kBF16:
      return "BF16";
    case TensorFormat::kQ8_0:
      return "Q8_0";
    case TensorFormat::kQ4_K:
      return "Q4_K";
    case TensorFormat::kQ6_K:
      return "Q6_K";
  }
  return "unknown";
}

bool IsQuantized(TensorFormat format) {
  return format == TensorFormat::kQ8_0 || format == TensorFormat::kQ4_K ||
         format == TensorFormat::kQ6_K;
}

int64_t BlockElements(TensorFormat format) {
  switch (format) {
    case TensorFormat::kQ8_0:
      return kQ8_0Elements;
    case TensorFormat::kQ4_K:
    case TensorFormat::kQ6_K:
      return kQKElements;
    default:
      return 1;
  }
}

int64_t BlockBytes(TensorFormat format) {
  switch (format) {
    case TensorFormat::kF32:
      return 4;
    case TensorFormat::kF16:
    case TensorFormat::kBF16:
      return 2;
    case TensorFormat::kQ8_0:
      return kQ8_0Bytes;
    case TensorFormat::kQ4_K:
      return kQ4_KBytes;
    case TensorFormat::kQ6_K:
      return kQ6_KBytes;
  }
  return 1;
}

void DequantizeRow(TensorFormat format, const uint8_t* src, int64_t count,
                   float* out) {
  switch (format) {
    case TensorFormat::kF32:
      if (count > 0) std::memcpy(out, src, count * sizeof(float));
      return;
    case TensorFormat::kF16:
      for (int64_t i = 0; i < count; ++i) out[i] = LoadF16(src + 2 * i);
      return;
    case TensorFormat::kBF16:
      for (int64_t i = 0; i < count; ++i) {
        uint16_t bits;
        std::memcpy(&bits, src + 2 * i, 2);
        out[i] = Bf16ToFloat(bits);
      }
      return;
    case TensorFormat::kQ8_0:
      for (int64_t b = 0; b < count / kQ8_0Elements; ++b) {
        DequantizeQ8_0(src + b * kQ8_0Bytes, out + b * kQ8_0Elements);
      }
      return;
    case TensorFormat::kQ4_K:
      for (int64_t b = 0; b < count / kQKElements; ++b) {
        DequantizeQ4_K(src + b * kQ4_KBytes, out + b * kQKElements);
      }
      return;
    case TensorFormat::kQ6_K:
      for (int64_t b = 0; b < count / kQKElements; ++b) {
        DequantizeQ6_K(src + b * kQ6_KBytes, out + b * kQKElements);
      }
      return;
  }
}

void QuantizeRow(TensorFormat format, const float* src, int64_t count,
                 uint8_t* out) {
  switch (format) {
    case TensorFormat::kF32:
      if (count > 0) std::memcpy(out, src, count * sizeof(float));
      return;
    case TensorFormat::kF16:
      for (int64_t i = 0; i < count; ++i) StoreF16(out + 2 * i, src[i]);
      return;
    case TensorFormat::kBF16:
      for (int64_t i = 0; i < count; ++i) {
        const uint16_t bits = FloatToBf16(src[i]);
        std::memcpy(out + 2 * i, &bits, 2);
      }
      return;
    case TensorFormat::kQ8_0:
      for (int64_t b = 0; b < count / kQ8_0Elements; ++b) {
        QuantizeQ8_0(src + b * kQ8_0Elements, out + b * kQ8_0Bytes);
      }
      return;
    case TensorFormat::kQ4_K:
      for (int64_t b = 0; b < count / kQKElements; ++b) {
        QuantizeQ4_K(src + b * kQKElements, out + b * kQ4_KBytes);
      }
      return;
    case TensorFormat::kQ6_K:
      for (int64_t b = 0; b < count / kQKElements; ++b) {
        QuantizeQ6_K(src + b * kQKElements, out + b * kQ6_KBytes);
      }
      return;
  }
}

}  // namespace pdserve::model
