// The int8-activation kernels (engine/int8_dot.h) against a float64
// reference: Σ of the dequantized weights times the activations as rounded.
// Built twice: with this machine's instruction set (the 512-bit K-quant
// kernels where AVX-512 VNNI exists) and, as engine_int8_dot_avx2_test,
// with AVX-512 off, so the 256-bit kernels that other x86 machines run are
// tested here too.
#include "engine/int8_dot.h"

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "model/quant_formats.h"

// Distinct suite names, so the two binaries' tests have distinct names.
#ifdef INT8_DOT_WITHOUT_AVX512
#define INT8_DOT_SUITE Int8DotAvx2Test
#define INT8_DOT_FORMATS Int8DotAvx2FormatsTest
#else
#define INT8_DOT_SUITE Int8DotTest
#define INT8_DOT_FORMATS Int8DotFormatsTest
#endif

namespace pdserve::engine::internal {
namespace {

using model::TensorFormat;

std::vector<float> Gaussian(int64_t count, uint32_t seed, float sigma) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, sigma);
  std::vector<float> values(count);
  for (float& v : values) v = normal(rng);
  return values;
}

TEST(INT8_DOT_SUITE, BuildHasTheKernels) {
#ifdef __AVX2__
  EXPECT_TRUE(Int8ActivationKernelsAvailable());
#else
  EXPECT_FALSE(Int8ActivationKernelsAvailable());
#endif
}

TEST(INT8_DOT_SUITE, RoundingIsWithinHalfAStepAndSumsAreExact) {
  constexpr int64_t kCols = 512;
  const std::vector<float> x = Gaussian(3 * kCols, 1, 2.0f);
  Int8Activations rounded;
  rounded.Quantize(x.data(), 3, kCols, true, true);
  for (int64_t t = 0; t < 3; ++t) {
    for (int64_t k = 0; k < kCols; ++k) {
      const float v32 = rounded.Value(TensorFormat::kQ8_0, t, k);
      const float v256 = rounded.Value(TensorFormat::kQ4_K, t, k);
      EXPECT_LE(std::abs(v32 - x[t * kCols + k]),
                0.5f * rounded.d32(t)[k / 32] * 1.0001f);
      EXPECT_LE(std::abs(v256 - x[t * kCols + k]),
                0.5f * rounded.d256(t)[k / 256] * 1.0001f);
    }
    for (int64_t g = 0; g < kCols / 16; ++g) {
      int sum = 0;
      for (int i = 0; i < 16; ++i) sum += rounded.q256(t)[16 * g + i];
      EXPECT_EQ(rounded.sums16(t)[g], sum);
      EXPECT_FLOAT_EQ(rounded.scaled_sums16(t)[g],
                      rounded.d256(t)[g / 16] * static_cast<float>(sum));
    }
  }
  // A zero block rounds to zeros with scale 0, not NaN.
  std::vector<float> zeros(kCols, 0.0f);
  rounded.Quantize(zeros.data(), 1, kCols, true, true);
  EXPECT_EQ(rounded.d32(0)[0], 0.0f);
  EXPECT_EQ(rounded.Value(TensorFormat::kQ4_K, 0, 7), 0.0f);
}

class INT8_DOT_FORMATS : public ::testing::TestWithParam<TensorFormat> {};

// Every (activation row, weight row) product against float64 sums of the
// dequantized weights times the rounded activations (1e-5 of Σ|w·x|: f32
// accumulation only), and each row's results bit-identical to the same row
// multiplied alone. 37 weight rows: pairs and an odd last row; 768 values:
// three K super-blocks, 24 Q8_0 blocks (a 512-bit pair loop would have none
// left over; 800 values below leaves one).
TEST_P(INT8_DOT_FORMATS, EqualsFloat64ProductOfTheRoundedActivations) {
  const TensorFormat format = GetParam();
  if (!Int8ActivationKernelsAvailable()) GTEST_SKIP() << "no int8 kernels";
  for (int64_t cols : {int64_t{768}, int64_t{800}, int64_t{1280}}) {
    if (cols % model::BlockElements(format) != 0) continue;
    SCOPED_TRACE(cols);
    constexpr int64_t kRows = 37;
    const int64_t row_bytes = model::RowBytes(format, cols);
    const std::vector<float> w = Gaussian(kRows * cols, 2, 0.05f);
    std::vector<uint8_t> stored(kRows * row_bytes);
    std::vector<float> dequantized(kRows * cols);
    for (int64_t r = 0; r < kRows; ++r) {
      model::QuantizeRow(format, w.data() + r * cols, cols,
                         stored.data() + r * row_bytes);
      model::DequantizeRow(format, stored.data() + r * row_bytes, cols,
                           dequantized.data() + r * cols);
    }
    const bool q8_0 = format == TensorFormat::kQ8_0;
    for (int64_t n : {1, 2, 3, 4, 5, 9, 100}) {
      SCOPED_TRACE(n);
      const std::vector<float> x = Gaussian(n * cols, 10 + n, 1.0f);
      Int8Activations rounded;
      rounded.Quantize(x.data(), n, cols, q8_0, !q8_0);
      std::vector<float> y(n * kRows);
      Int8RowDots(format, stored.data(), row_bytes, kRows, cols, rounded,
                  y.data(), kRows);
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t r = 0; r < kRows; ++r) {
          double want = 0, magnitude = 0;
          for (int64_t k = 0; k < cols; ++k) {
            const double product =
                double{dequantized[r * cols + k]} * rounded.Value(format, t, k);
            want += product;
            magnitude += std::abs(product);
          }
          ASSERT_NEAR(y[t * kRows + r], want, 1e-5 * magnitude)
              << "row " << t << " x weight row " << r;
        }
      }
      const int64_t t = n - 1;
      Int8Activations alone;
      alone.Quantize(x.data() + t * cols, 1, cols, q8_0, !q8_0);
      std::vector<float> y_alone(kRows);
      Int8RowDots(format, stored.data(), row_bytes, kRows, cols, alone,
                  y_alone.data(), kRows);
      for (int64_t r = 0; r < kRows; ++r) {
        ASSERT_EQ(y_alone[r], y[t * kRows + r]) << "weight row " << r;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, INT8_DOT_FORMATS,
                         ::testing::Values(TensorFormat::kQ8_0,
                                           TensorFormat::kQ4_K,
                                           TensorFormat::kQ6_K),
                         [](const auto& info) {
                           return std::string(
                               model::TensorFormatName(info.param));
                         });

}  // namespace
}  // namespace pdserve::engine::internal
