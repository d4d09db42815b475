#include "engine/matmul.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "common/thread_pool.h"

namespace pdserve::engine {
namespace {

// Every tile shape and tail: rows not a multiple of 3 or 4, inner sizes not a
// multiple of 8, both the skinny kernel and the BLAS path.
TEST(MatMulTest, MatchesNaiveProductForAllShapeTails) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  ThreadPool pool(2);
  for (int64_t n : {1, 2, 3, 4, 5, 7, 8, 13, 32, 64, 65, 100}) {
    for (int64_t in : {1, 7, 8, 9, 64, 172}) {
      for (int64_t out : {1, 3, 4, 5, 67, 130}) {
        std::vector<float> x(n * in), w(out * in), y(n * out, NAN);
        for (auto& v : x) v = dist(rng);
        for (auto& v : w) v = dist(rng);
        MatMulTransposedWeights(x.data(), n, in, w.data(), out, y.data(), pool);
        for (int64_t i = 0; i < n; ++i) {
          for (int64_t o = 0; o < out; ++o) {
            double expected = 0;
            for (int64_t k = 0; k < in; ++k)
              expected += double{x[i * in + k]} * w[o * in + k];
            ASSERT_NEAR(y[i * out + o], expected,
                        1e-4 * (1 + std::abs(expected)))
                << "n=" << n << " in=" << in << " out=" << out << " at " << i
                << "," << o;
          }
        }
      }
    }
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

}  // namespace
}  // namespace pdserve::engine
