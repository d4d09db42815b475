#include "engine/matmul.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "common/float16.h"
#include "common/thread_pool.h"

namespace pdserve::engine {
namespace {

// Every micro-kernel row count (1..6) and tail: rows not a multiple of 6,
// output rows not a multiple of the 16-row panel, inner sizes not a multiple
// of 8, and inputs large enough to take the cache-blocked path (n * in * 4 >
// 64 KiB: several k-blocks accumulated into y, several row blocks). The BLAS
// baseline the bench compares against is checked the same way.
TEST(MatMulTest, MatchesNaiveProductForAllShapeTails) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  ThreadPool pool(2);
  struct Shape {
    int64_t in, out;
  };
  std::vector<Shape> shapes;
  for (int64_t in : {1, 7, 8, 9, 64, 172}) {
    for (int64_t out : {1, 3, 15, 16, 17, 67, 130}) shapes.push_back({in, out});
  }
  shapes.push_back({1000, 33});  // k-blocks of 384 + a 232 tail
  for (int64_t n : {1, 2, 3, 4, 5, 6, 7, 12, 13, 32, 65, 200, 400}) {
    for (const Shape& shape : shapes) {
      const int64_t in = shape.in, out = shape.out;
      if (n * in > 200 * 1000) continue;
      std::vector<float> x(n * in), w(out * in);
      for (auto& v : x) v = dist(rng);
      for (auto& v : w) v = dist(rng);
      absl::StatusOr<PackedMatrix> packed =
          PackedMatrix::Pack(w.data(), out, in);
      ASSERT_TRUE(packed.ok()) << packed.status();
      std::vector<float> y_packed(n * out, NAN), y_blas(n * out, NAN);
      PackedMatMul(x.data(), n, *packed, y_packed.data(), pool);
      BlasMatMul(x.data(), n, in, w.data(), out, y_blas.data(), pool);
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t o = 0; o < out; ++o) {
          double expected = 0;
          for (int64_t k = 0; k < in; ++k)
            expected += double{x[i * in + k]} * w[o * in + k];
          const double tolerance =
              1e-4 * (1 + std::abs(expected)) + 2e-6 * static_cast<double>(in);
          ASSERT_NEAR(y_packed[i * out + o], expected, tolerance)
              << "packed n=" << n << " in=" << in << " out=" << out << " at "
              << i << "," << o;
          ASSERT_NEAR(y_blas[i * out + o], expected, tolerance)
              << "blas n=" << n << " in=" << in << " out=" << out << " at " << i
              << "," << o;
        }
      }
    }
  }
}

TEST(MatMulTest, PackedMatrixKeepsEveryElementAndZeroPadsTheLastPanel) {
  const int64_t rows = 21, cols = 5;  // one full panel and 5 rows of another
  std::vector<float> w(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) w[i] = static_cast<float>(i + 1);
  absl::StatusOr<PackedMatrix> packed =
      PackedMatrix::Pack(w.data(), rows, cols);
  ASSERT_TRUE(packed.ok()) << packed.status();
  EXPECT_EQ(packed->panels(), 2);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c)
      EXPECT_EQ(packed->At(r, c), w[r * cols + c]) << r << "," << c;
  }
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t r = rows % kPanelRows; r < kPanelRows; ++r)
      EXPECT_EQ(packed->panel(1)[c * kPanelRows + r], 0.0f);
  }
  EXPECT_EQ(reinterpret_cast<uintptr_t>(packed->panel(0)) % 64, 0u);

  absl::StatusOr<PackedMatrix> empty = PackedMatrix::Pack(w.data(), 0, cols);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->rows(), 0);
}

TEST(MatMulTest, SizeBeyondAnyMemoryIsResourceExhausted) {
  const float w = 1.0f;  // never read: the size is refused first
  absl::StatusOr<PackedMatrix> packed =
      PackedMatrix::Pack(&w, int64_t{1} << 40, int64_t{1} << 40);
  EXPECT_EQ(packed.status().code(), absl::StatusCode::kResourceExhausted)
      << packed.status();
}

// The vector exp must stay within a few ulp of double-precision math over the
// whole range attention and SiLU feed it: every lane position and tail, ties,
// scores far below the maximum (e^-100 must read as ~0, not NaN or inf).
TEST(MatMulTest, MaxOfAndFirstAboveMatchScalarScans) {
  std::mt19937 rng(17);
  for (int64_t n : {0, 1, 7, 8, 9, 23, 1000}) {
    std::uniform_int_distribution<int> dist(-20, 20);  // many exact ties
    std::vector<float> x(n);
    for (auto& v : x) v = static_cast<float>(dist(rng));
    const float max_value =
        n == 0 ? -INFINITY : *std::max_element(x.begin(), x.end());
    EXPECT_EQ(MaxOf(x.data(), n), max_value) << "n=" << n;
    for (float t : {-21.0f, -3.0f, 0.0f, 19.0f, 20.0f, 25.0f}) {
      for (bool or_equal : {false, true}) {
        int64_t want = n;
        for (int64_t i = 0; i < n; ++i) {
          if (or_equal ? x[i] >= t : x[i] > t) {
            want = i;
            break;
          }
        }
        EXPECT_EQ(FirstAbove(x.data(), n, t, or_equal), want)
            << "n=" << n << " t=" << t << " or_equal=" << or_equal;
      }
    }
  }
}

TEST(MatMulTest, LogSumExpMatchesDoublePrecision) {
  std::mt19937 rng(13);
  // Vocabulary-sized rows included: the float lanes flush into the double
  // total every 2048 terms.
  for (int64_t n : {1, 7, 8, 9, 31, 1027, 32000, 262144}) {
    for (float spread : {0.0f, 1.0f, 30.0f, 200.0f}) {
      std::uniform_real_distribution<float> dist(-spread, spread);
      std::vector<float> x(n);
      for (auto& v : x) v = dist(rng);
      double max_value = -INFINITY, sum = 0;
      for (float v : x) max_value = std::max<double>(max_value, v);
      for (float v : x) sum += std::exp(v - max_value);
      const double want = max_value + std::log(sum);
      // A logprob is logit - LogSumExp: what matters is the absolute error.
      EXPECT_NEAR(LogSumExp(x.data(), n), want, 2e-6 * (1 + std::abs(want)))
          << "n=" << n << " spread=" << spread;
    }
  }
  EXPECT_EQ(LogSumExp(nullptr, 0), -INFINITY);
}

TEST(MatMulTest, SoftmaxMatchesDoublePrecision) {
  std::mt19937 rng(11);
  for (int64_t n : {1, 2, 7, 8, 9, 16, 31, 100, 1027}) {
    for (float spread : {0.0f, 1.0f, 30.0f, 200.0f}) {
      std::uniform_real_distribution<float> dist(-spread, spread);
      std::vector<float> p(n);
      for (auto& v : p) v = dist(rng);
      double max_value = -INFINITY, sum = 0;
      for (float v : p) max_value = std::max<double>(max_value, v);
      std::vector<double> expected(n);
      for (int64_t i = 0; i < n; ++i)
        sum += expected[i] = std::exp(p[i] - max_value);
      const std::vector<float> input = p;
      SoftmaxInPlace(p.data(), n);
      double total = 0;
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_TRUE(std::isfinite(p[i])) << "n=" << n << " i=" << i;
        // The float subtraction p - max alone may round the exponent by half
        // an ulp of |p - max|: that much relative error is inherent.
        const double argument = std::abs(double{input[i]} - max_value);
        const double want = expected[i] / sum;
        ASSERT_NEAR(p[i], want, (1e-6 + 6e-8 * argument) * want + 1e-30)
            << "n=" << n << " spread=" << spread << " i=" << i;
        total += p[i];
      }
      EXPECT_NEAR(total, 1.0, 1e-5);
    }
  }
}

TEST(MatMulTest, SiluMulMatchesDoublePrecision) {
  std::vector<float> gate, up;
  for (float g = -120.0f; g <= 120.0f; g += 0.37f) {
    gate.push_back(g);
    up.push_back(1.5f - 0.01f * g);
  }
  std::vector<float> out(gate.size());
  SiluMul(gate.data(), up.data(), out.data(),
          static_cast<int64_t>(gate.size()));
  for (size_t i = 0; i < gate.size(); ++i) {
    const double expected =
        gate[i] / (1.0 + std::exp(-double{gate[i]})) * up[i];
    ASSERT_NEAR(out[i], expected, 1e-6 * std::abs(expected) + 1e-30)
        << "gate=" << gate[i];
  }
}

TEST(MatMulTest, DotProductAndAxpy) {
  std::vector<float> a(37), b(37), y(37, 1.0f);
  double expected = 0;
  for (int i = 0; i < 37; ++i) {
    a[i] = 0.5f * i;
    b[i] = 1.0f - 0.01f * i;
    expected += double{a[i]} * b[i];
  }
  EXPECT_NEAR(DotProduct(a.data(), b.data(), 37), expected, 1e-3);
  Axpy(2.0f, a.data(), y.data(), 37);
  for (int i = 0; i < 37; ++i) EXPECT_FLOAT_EQ(y[i], 1.0f + 2.0f * a[i]);
}

// Runs both decode-attention kernels over `stored` (f32 rows, or bf16 rows
// read by the bf16 overloads) and compares with double-precision sums over
// `exact`, the rows' values as the kernels should see them.
template <typename Element>
void ExpectAttentionKernelsMatch(const std::vector<float>& q,
                                 const std::vector<Element>& stored,
                                 const std::vector<float>& exact,
                                 const std::vector<float>& weights,
                                 int64_t count, int64_t dim,
                                 std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> scores(count + 1, -7.0f);  // one sentinel past the end
  ScoreKeys(q.data(), stored.data(), count, dim, 0.5f, scores.data());
  for (int64_t j = 0; j < count; ++j) {
    double want = 0;
    for (int64_t d = 0; d < dim; ++d) want += double{q[d]} * exact[j * dim + d];
    ASSERT_NEAR(scores[j], 0.5 * want, 1e-5 * dim)
        << "dim " << dim << " count " << count << " key " << j;
  }
  EXPECT_EQ(scores[count], -7.0f) << "wrote past count";

  std::vector<float> out(dim + 1);
  for (int64_t d = 0; d < dim; ++d) out[d] = dist(rng);
  out[dim] = -7.0f;
  const std::vector<float> before = out;
  AccumulateWeightedRows(weights.data(), stored.data(), count, dim, out.data());
  for (int64_t d = 0; d < dim; ++d) {
    double want = before[d];
    for (int64_t j = 0; j < count; ++j) {
      want += double{weights[j]} * exact[j * dim + d];
    }
    ASSERT_NEAR(out[d], want, 1e-5 * (count + 1))
        << "dim " << dim << " count " << count << " d " << d;
  }
  EXPECT_EQ(out[dim], -7.0f) << "wrote past dim";
}

// The decode-attention kernels against double-precision sums, for head dims
// with and without a vector tail and key counts around the 8-key groups.
TEST(MatMulTest, ScoreKeysAndAccumulateWeightedRowsMatchDoublePrecision) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (int64_t dim : {4, 8, 12, 64, 72, 128, 136}) {
    for (int64_t count : {0, 1, 7, 8, 9, 16, 17, 33}) {
      SCOPED_TRACE(testing::Message() << "dim " << dim << " count " << count);
      std::vector<float> q(dim), rows(count * dim), weights(count);
      for (float& v : q) v = dist(rng);
      for (float& v : rows) v = dist(rng);
      for (float& v : weights) v = dist(rng);
      ExpectAttentionKernelsMatch(q, rows, rows, weights, count, dim, rng);
      // A bf16 KV pool's rows: the kernels must see exactly the widened
      // values (the rounding happened when the KV was written).
      std::vector<uint16_t> rows16(rows.size());
      std::vector<float> widened(rows.size());
      for (size_t i = 0; i < rows.size(); ++i) {
        rows16[i] = FloatToBf16(rows[i]);
        widened[i] = Bf16ToFloat(rows16[i]);
      }
      ExpectAttentionKernelsMatch(q, rows16, widened, weights, count, dim, rng);
    }
  }
}

}  // namespace
}  // namespace pdserve::engine
