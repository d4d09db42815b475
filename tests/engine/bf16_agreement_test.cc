// The bf16 greedy criterion (bf16_agreement.h) on made-up scores: exact
// sequences pass; a flip passes only where the reference margin is within
// the tolerance and both tokens are in each other's top-5; anything else
// (a large margin, a token outside the top-5, a length difference) fails
// with a report naming the position and the margin.
#include "bf16_agreement.h"

#include <gtest/gtest.h>

namespace pdserve::engine::testing_util {
namespace {

// Scores of `token` with alternatives (token, logprob), best first.
TokenLogprobs Scores(float logprob,
                     std::vector<std::pair<int32_t, float>> alternatives) {
  TokenLogprobs s;
  s.logprob = logprob;
  for (const auto& [t, lp] : alternatives) s.top.push_back({t, lp});
  return s;
}

TEST(Bf16AgreementTest, IdenticalSequencesAreExact) {
  const std::vector<int32_t> tokens = {5, 6, 7};
  const std::vector<TokenLogprobs> scores(3, Scores(-0.1f, {{5, -0.1f}}));
  const auto a = CompareGreedyWithinBf16(tokens, scores, tokens, scores, 0.1);
  EXPECT_TRUE(a.exact);
  EXPECT_TRUE(a.pass);
  EXPECT_EQ(a.divergence, -1);
  EXPECT_TRUE(a.report.empty());
}

TEST(Bf16AgreementTest, NearTieFlipWithinTheToleranceIsAccepted) {
  const std::vector<int32_t> reference = {5, 6, 7, 8};
  const std::vector<int32_t> candidate = {5, 6, 9, 9};
  std::vector<TokenLogprobs> ref(4, Scores(-0.1f, {})), cand(4, ref[0]);
  // Position 2: the reference prefers 7 over 9 by 0.02; the engine 9 over 7.
  ref[2] = Scores(-0.70f, {{7, -0.70f}, {9, -0.72f}, {1, -3.0f}});
  cand[2] = Scores(-0.69f, {{9, -0.69f}, {7, -0.71f}, {1, -3.0f}});
  const auto a = CompareGreedyWithinBf16(reference, ref, candidate, cand, 0.05);
  EXPECT_TRUE(a.pass) << a.report;
  EXPECT_FALSE(a.exact);
  EXPECT_EQ(a.divergence, 2);
  EXPECT_NEAR(a.reference_margin, 0.02, 1e-6);
  EXPECT_NE(a.report.find("flip at generated token 2"), std::string::npos);
  EXPECT_NE(a.report.find("within bf16 error"), std::string::npos);
  // The same flip with a tolerance below the margin: a failure.
  const auto strict =
      CompareGreedyWithinBf16(reference, ref, candidate, cand, 0.01);
  EXPECT_FALSE(strict.pass);
  EXPECT_NE(strict.report.find("NOT explained"), std::string::npos);
}

TEST(Bf16AgreementTest, FlipsOutsideTheTopFiveFail) {
  const std::vector<int32_t> reference = {7};
  const std::vector<int32_t> candidate = {9};
  // 9 is the reference's 6th choice.
  const std::vector<TokenLogprobs> ref = {Scores(-1.0f, {{7, -1.0f},
                                                         {1, -1.1f},
                                                         {2, -1.2f},
                                                         {3, -1.3f},
                                                         {4, -1.4f},
                                                         {9, -1.45f}})};
  const std::vector<TokenLogprobs> cand = {
      Scores(-1.0f, {{9, -1.0f}, {7, -1.01f}})};
  auto a = CompareGreedyWithinBf16(reference, ref, candidate, cand, 10.0);
  EXPECT_FALSE(a.pass);
  EXPECT_NE(a.report.find("engine token not in the reference top-5"),
            std::string::npos);
  // And the reference token outside the engine's top-5.
  const std::vector<TokenLogprobs> ref2 = {
      Scores(-1.0f, {{7, -1.0f}, {9, -1.01f}})};
  const std::vector<TokenLogprobs> cand2 = {Scores(-1.0f, {{9, -1.0f}})};
  a = CompareGreedyWithinBf16(reference, ref2, candidate, cand2, 10.0);
  EXPECT_FALSE(a.pass);
  EXPECT_NE(a.report.find("reference token not in the engine top-5"),
            std::string::npos);
}

TEST(Bf16AgreementTest, LengthsAndMissingScoresFail) {
  const std::vector<int32_t> reference = {5, 6};
  const std::vector<int32_t> shorter = {5};
  const std::vector<TokenLogprobs> scores(2, Scores(-0.1f, {}));
  auto a = CompareGreedyWithinBf16(reference, scores, shorter, scores, 1.0);
  EXPECT_FALSE(a.pass);
  EXPECT_NE(a.report.find("lengths differ"), std::string::npos);
  const std::vector<int32_t> flipped = {5, 9};
  a = CompareGreedyWithinBf16(reference, scores, flipped, {}, 1.0);
  EXPECT_FALSE(a.pass);
  EXPECT_NE(a.report.find("no scores"), std::string::npos);
}

TEST(Bf16AgreementTest, WorstAbsLogitErrorAndTolerance) {
  EXPECT_DOUBLE_EQ(WorstAbsLogitError({{1.0f, 2.0f}, {3.0f, -4.0f}},
                                      {{1.5f, 2.0f}, {3.0f, -4.25f}}),
                   0.5);
  EXPECT_EQ(WorstAbsLogitError({{1.0f}}, {}), INFINITY);
  EXPECT_DOUBLE_EQ(Bf16MarginTolerance(0.03), 0.06);
}

}  // namespace
}  // namespace pdserve::engine::testing_util
