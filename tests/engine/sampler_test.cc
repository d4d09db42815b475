#include "engine/sampler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>

namespace pdserve::engine {
namespace {

TEST(SamplerTest, GreedyPicksArgMaxWithLowestIdOnTies) {
  std::vector<float> logits = {0.5f, 2.0f, 2.0f, -1.0f};
  SamplingParams params;
  auto sampled = Sample(logits, params, 0);
  EXPECT_EQ(sampled.token, 1);
  double log_z = std::log(std::exp(0.5) + 2 * std::exp(2.0) + std::exp(-1.0));
  EXPECT_NEAR(sampled.logprob, 2.0 - log_z, 1e-5);
}

TEST(SamplerTest, TopKOneIsGreedy) {
  std::vector<float> logits = {0.1f, 0.3f, 3.0f, 0.2f};
  SamplingParams params{
      .temperature = 1.5f, .top_k = 1, .top_p = 1.0f, .seed = 7};
  for (uint64_t i = 0; i < 20; ++i)
    EXPECT_EQ(Sample(logits, params, i).token, 2);
}

TEST(SamplerTest, FixedSeedIsReproducibleAndSeedsDiffer) {
  std::vector<float> logits(64);
  for (int i = 0; i < 64; ++i) logits[i] = std::sin(i * 0.37f);
  SamplingParams a{.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .seed = 42};
  SamplingParams b = a;
  b.seed = 43;
  std::vector<int32_t> first, second, other;
  for (uint64_t i = 0; i < 50; ++i) {
    first.push_back(Sample(logits, a, i).token);
    second.push_back(Sample(logits, a, i).token);
    other.push_back(Sample(logits, b, i).token);
  }
  EXPECT_EQ(first, second);
  EXPECT_NE(first, other);
}

TEST(SamplerTest, TopKAndTopPRestrictTheSupport) {
  std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.15f),
                               std::log(0.05f)};
  std::vector<float> probs;
  SamplingDistribution(logits, {.temperature = 1.0f, .top_k = 2, .top_p = 1.0f},
                       &probs);
  EXPECT_NEAR(probs[0], 0.5 / 0.8, 1e-6);
  EXPECT_NEAR(probs[1], 0.3 / 0.8, 1e-6);
  EXPECT_EQ(probs[2], 0.0f);
  SamplingDistribution(
      logits, {.temperature = 1.0f, .top_k = 0, .top_p = 0.75f}, &probs);
  EXPECT_NEAR(probs[0], 0.5 / 0.8, 1e-6);
  EXPECT_NEAR(probs[1], 0.3 / 0.8, 1e-6);
  EXPECT_EQ(probs[3], 0.0f);
}

TEST(SamplerTest, DrawsFollowTheDistribution) {
  // Chi-square goodness of fit over 20000 draws, 4 categories (3 dof):
  // the 0.999 quantile is 16.27.
  std::vector<float> logits = {std::log(0.4f), std::log(0.3f), std::log(0.2f),
                               std::log(0.1f)};
  SamplingParams params{
      .temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .seed = 1234};
  std::vector<int> counts(4);
  const int n = 20000;
  for (int i = 0; i < n; ++i) ++counts[Sample(logits, params, i).token];
  const double expected[] = {0.4, 0.3, 0.2, 0.1};
  double chi2 = 0;
  for (int k = 0; k < 4; ++k) {
    double e = expected[k] * n;
    chi2 += (counts[k] - e) * (counts[k] - e) / e;
  }
  EXPECT_LT(chi2, 16.27);
}

TEST(SamplerTest, ValidateRejectsBadParams) {
  auto invalid = [](SamplingParams p) { return !p.Validate().ok(); };
  EXPECT_TRUE(invalid({.temperature = -1.0f}));
  EXPECT_TRUE(invalid({.temperature = NAN}));
  EXPECT_TRUE(invalid({.top_k = -2}));
  EXPECT_TRUE(invalid({.top_p = 0.0f}));
  EXPECT_TRUE(invalid({.top_p = 1.5f}));
  SamplingParams good{.temperature = 0.7f, .top_k = 40, .top_p = 0.9f};
  EXPECT_TRUE(good.Validate().ok());
}

}  // namespace
}  // namespace pdserve::engine
