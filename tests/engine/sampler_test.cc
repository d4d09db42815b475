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

TEST(SamplerTest, TopLogprobsAreTheMostLikelyTokensByFullSort) {
  // 1000 logits with many exact ties: the heap must agree with a full sort
  // (higher logit first, lower id on ties) and with a double-precision
  // log-softmax.
  std::vector<float> logits(1000);
  for (int i = 0; i < 1000; ++i)
    logits[i] = static_cast<float>((i * 7919) % 97) * 0.125f - 3.0f;
  double z = 0;
  for (float v : logits) z += std::exp(double{v});
  const double log_z = std::log(z);
  std::vector<int32_t> order(logits.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  for (int n : {1, 5, 20, 1000}) {
    TokenLogprobs got = ComputeTokenLogprobs(logits, 17, n);
    EXPECT_NEAR(got.logprob, logits[17] - log_z, 1e-5);
    ASSERT_EQ(got.top.size(), static_cast<size_t>(n));
    for (int k = 0; k < n; ++k) {
      EXPECT_EQ(got.top[k].token, order[k]) << "n " << n << " rank " << k;
      EXPECT_NEAR(got.top[k].logprob, logits[order[k]] - log_z, 1e-5);
    }
  }
  EXPECT_TRUE(ComputeTokenLogprobs(logits, 17, 0).top.empty());
  // More than the vocabulary: all of it.
  EXPECT_EQ(ComputeTokenLogprobs(std::vector<float>{1, 2}, 0, 5).top.size(),
            2u);
}

TEST(SamplerTest, SampleReportsLogprobsOfTheRawDistribution) {
  // Temperature and top-k change what is drawn, not the reported numbers.
  std::vector<float> logits = {1.0f, 3.0f, 2.0f, 0.5f};
  SamplingParams hot{.temperature = 1.7f, .top_k = 2, .top_p = 1.0f, .seed = 3};
  for (uint64_t i = 0; i < 16; ++i) {
    SampledToken s = Sample(logits, hot, i, /*top_logprobs=*/3);
    TokenLogprobs reference = ComputeTokenLogprobs(logits, s.token, 3);
    EXPECT_EQ(s.logprob, reference.logprob);
    EXPECT_EQ(s.top, reference.top);
    ASSERT_EQ(s.top.size(), 3u);
    EXPECT_EQ(s.top[0].token, 1);
    EXPECT_EQ(s.top[1].token, 2);
    EXPECT_EQ(s.top[2].token, 0);
  }
  EXPECT_TRUE(Sample(logits, hot, 0).top.empty());
}

}  // namespace
}  // namespace pdserve::engine
