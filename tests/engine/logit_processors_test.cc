// The sampling controls (min_p, min_tokens, logit_bias, repetition, frequency
// and presence penalties): for each, the tokens DrawToken samples and the
// tokens a speculative verify emits follow the processed distribution
// exactly (chi-square against a float64 reference written here from the
// published formulas, not from the sampler), and differ measurably from the
// unprocessed one, so a control that silently did nothing would fail.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <string>

#include "engine/sampler.h"
#include "speculative/proposer.h"
#include "speculative/verifier.h"
#include "testing/chi_square.h"

namespace pdserve::engine {
namespace {

constexpr int kVocab = 24;
constexpr int kDraws = 20000;

using pdserve::testing::ChiSquareRatio;

std::vector<float> TestLogits(uint64_t seed) {
  std::vector<float> l(kVocab);
  for (int v = 0; v < kVocab; ++v) {
    l[v] = 4.0f * static_cast<float>(UniformForRequest(seed, v, 9)) - 1.0f;
  }
  return l;
}

// The reference: float64, straight from the definitions.
//  - min_tokens (vLLM): EOS ids impossible while fewer than min_tokens were
//    generated;
//  - logit_bias (OpenAI): added to the logit;
//  - repetition_penalty (CTRL, Keskar et al. 2019, as Hugging Face's
//    RepetitionPenaltyLogitsProcessor and vLLM): tokens seen in prompt or
//    output, positive logit / r, negative logit * r;
//  - frequency / presence penalty (OpenAI's documented formula):
//    mu[j] -= c[j] * alpha_frequency + (c[j] > 0) * alpha_presence;
//  - temperature softmax, then min_p (Nguyen et al. 2024): drop tokens with
//    p < min_p * max p, renormalize.
struct Controls {
  float temperature = 1.0f;
  float min_p = 0;
  int min_tokens = 0;
  std::map<int, float> bias;
  float repetition = 1;
  float frequency = 0;
  float presence = 0;
};

std::vector<double> Reference(const std::vector<float>& logits,
                              const Controls& c,
                              const std::vector<int32_t>& prompt,
                              const std::vector<int32_t>& output,
                              const std::vector<int32_t>& eos) {
  std::vector<double> mu(logits.begin(), logits.end());
  if (static_cast<int>(output.size()) < c.min_tokens) {
    for (int32_t e : eos) mu[e] = -std::numeric_limits<double>::infinity();
  }
  for (const auto& [t, b] : c.bias) mu[t] += b;
  std::set<int32_t> seen(prompt.begin(), prompt.end());
  seen.insert(output.begin(), output.end());
  std::map<int32_t, int> count;
  for (int32_t t : output) ++count[t];
  for (int32_t t : seen) {
    if (c.repetition != 1) {
      mu[t] = mu[t] > 0 ? mu[t] / c.repetition : mu[t] * c.repetition;
    }
  }
  for (const auto& [t, n] : count) {
    mu[t] -= n * c.frequency + (n > 0 ? c.presence : 0.0);
  }
  double max_mu = -std::numeric_limits<double>::infinity();
  for (double m : mu) max_mu = std::max(max_mu, m);
  std::vector<double> p(kVocab);
  double z = 0;
  for (int v = 0; v < kVocab; ++v) {
    p[v] = std::exp((mu[v] - max_mu) / c.temperature);
    z += p[v];
  }
  double max_p = 0;
  for (double& x : p) {
    x /= z;
    max_p = std::max(max_p, x);
  }
  if (c.min_p > 0) {
    double kept = 0;
    for (double& x : p) {
      if (x < c.min_p * max_p) x = 0;
      kept += x;
    }
    for (double& x : p) x /= kept;
  }
  return p;
}

SamplingParams ToParams(const Controls& c) {
  SamplingParams p;
  p.temperature = c.temperature;
  p.min_p = c.min_p;
  p.min_tokens = c.min_tokens;
  for (const auto& [t, b] : c.bias) p.logit_bias.push_back({t, b});
  p.repetition_penalty = c.repetition;
  p.frequency_penalty = c.frequency;
  p.presence_penalty = c.presence;
  return p;
}

struct Case {
  std::string name;
  Controls controls;
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  cases.push_back({"MinP", {.min_p = 0.3f}});
  cases.push_back({"MinTokens", {.min_tokens = 4}});  // 3 generated
  cases.push_back({"LogitBias", {.bias = {{2, 3.0f}, {5, -100.0f}}}});
  cases.push_back({"RepetitionPenalty", {.repetition = 2.5f}});
  cases.push_back({"FrequencyPenalty", {.frequency = 1.2f}});
  cases.push_back({"PresencePenalty", {.presence = 1.5f}});
  cases.push_back({"NegativePenalties", {.frequency = -0.8f, .presence = -1}});
  cases.push_back({"AllTogether",
                   {.temperature = 0.8f,
                    .min_p = 0.02f,
                    .min_tokens = 5,
                    .bias = {{7, 2.0f}},
                    .repetition = 1.3f,
                    .frequency = 0.7f,
                    .presence = 0.4f}});
  return cases;
}

// A history in which the penalized tokens carry much of the mass: the most
// likely tokens appear in the output (some twice) and the prompt, and the
// EOS id is likely too.
struct History {
  std::vector<int32_t> prompt;
  std::vector<int32_t> output;
  std::vector<int32_t> eos;
};

History MakeHistory(const std::vector<float>& logits) {
  std::vector<int32_t> order(kVocab);
  for (int v = 0; v < kVocab; ++v) order[v] = v;
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return logits[a] > logits[b]; });
  History h;
  h.prompt = {order[0], order[4], 11, order[4]};
  h.output = {order[1], order[2], order[1]};
  h.eos = {order[3]};
  return h;
}

class LogitProcessorsTest : public ::testing::TestWithParam<Case> {};

TEST_P(LogitProcessorsTest, DrawsFollowTheProcessedDistribution) {
  const Controls& c = GetParam().controls;
  const std::vector<float> logits = TestLogits(1);
  const History h = MakeHistory(logits);
  SamplingParams params = ToParams(c);
  ASSERT_TRUE(params.ValidateForVocab(kVocab).ok());
  const SamplingHistory history{h.prompt, h.output, h.eos};
  const uint64_t index = h.output.size();
  const std::vector<double> expected =
      Reference(logits, c, h.prompt, h.output, h.eos);
  Controls off;
  off.temperature = c.temperature;
  const std::vector<double> unprocessed =
      Reference(logits, off, h.prompt, h.output, h.eos);

  // The distribution itself, entry by entry.
  std::vector<float> probs;
  ProcessedDistribution(logits, params, history, index, &probs);
  for (int v = 0; v < kVocab; ++v) {
    EXPECT_NEAR(probs[v], expected[v], 1e-6) << "token " << v;
  }
  std::map<int, int> counts;
  for (int seed = 0; seed < kDraws; ++seed) {
    params.seed = seed;
    ++counts[DrawToken(logits, params, index, history)];
  }
  EXPECT_LT(ChiSquareRatio(counts, expected, kDraws), 1.0);
  // The control changed the distribution enough for the test to see it.
  EXPECT_GT(ChiSquareRatio(counts, unprocessed, kDraws), 1.0);
}

// Greedy decoding takes the arg-max of the processed logits.
TEST_P(LogitProcessorsTest, GreedyTakesTheProcessedArgMax) {
  const Controls& c = GetParam().controls;
  const std::vector<float> logits = TestLogits(1);
  const History h = MakeHistory(logits);
  SamplingParams params = ToParams(c);
  params.temperature = 0;
  const std::vector<double> expected =
      Reference(logits, c, h.prompt, h.output, h.eos);
  const int32_t want = static_cast<int32_t>(
      std::max_element(expected.begin(), expected.end()) - expected.begin());
  EXPECT_EQ(
      DrawToken(logits, params, h.output.size(), {h.prompt, h.output, h.eos}),
      want);
}

// A verify row i sees the output extended by drafts 1..i: the token emitted
// after an accepted draft follows the processed distribution with that draft
// in the history (the penalties apply to it), and a verifier that forgot the
// draft would be caught.
TEST_P(LogitProcessorsTest, SpeculativeVerifyKeepsTheProcessedDistribution) {
  const Controls& c = GetParam().controls;
  const std::vector<float> row0 = TestLogits(1);
  // Row 1 as row 0: the draft (row 0's favourite) is likely again, so the
  // penalties its presence in the history brings move visible mass.
  const std::vector<float> row1 = row0;
  const History h = MakeHistory(row0);
  std::vector<float> both(row0);
  both.insert(both.end(), row1.begin(), row1.end());
  SamplingParams params = ToParams(c);
  const SamplingHistory history{h.prompt, h.output, h.eos};
  const uint64_t index = h.output.size();
  const std::vector<double> p0 = Reference(row0, c, h.prompt, h.output, h.eos);
  // A one-hot draft on row 0's most likely processed token (accepted often).
  const int32_t draft =
      static_cast<int32_t>(std::max_element(p0.begin(), p0.end()) - p0.begin());
  std::vector<int32_t> after_draft = h.output;
  after_draft.push_back(draft);
  const std::vector<double> p1 =
      Reference(row1, c, h.prompt, after_draft, h.eos);
  const std::vector<double> p1_without_draft =
      Reference(row1, c, h.prompt, h.output, h.eos);
  std::map<int, int> first, second;
  int accepted = 0;
  for (int seed = 0; seed < kDraws; ++seed) {
    params.seed = seed;
    absl::StatusOr<speculative::VerifyOutcome> out =
        speculative::VerifyDraft(both, kVocab, std::vector<int32_t>{draft}, {},
                                 params, index, {}, history);
    ASSERT_TRUE(out.ok()) << out.status();
    ++first[out->tokens[0]];
    if (out->accepted_drafts == 1) {
      ++accepted;
      ++second[out->tokens[1]];
    }
  }
  EXPECT_LT(ChiSquareRatio(first, p0, kDraws), 1.0);
  ASSERT_GT(accepted, kDraws / 10);
  EXPECT_LT(ChiSquareRatio(second, p1, accepted), 1.0);
  // Penalties that depend on the output see the draft; min_p, min_tokens
  // (5 > 4 tokens) and logit_bias alone do not.
  const bool history_matters =
      c.repetition != 1 || c.frequency != 0 || c.presence != 0;
  if (history_matters) {
    EXPECT_GT(ChiSquareRatio(second, p1_without_draft, accepted), 1.0);
  }
}

INSTANTIATE_TEST_SUITE_P(Controls, LogitProcessorsTest,
                         ::testing::ValuesIn(Cases()),
                         [](const auto& info) { return info.param.name; });

TEST(LogitProcessorsTest, MinTokensLiftsAtTheCount) {
  std::vector<float> logits(kVocab, 0.0f);
  logits[3] = 10.0f;  // EOS, by far the most likely
  SamplingParams params;
  params.min_tokens = 2;
  const std::vector<int32_t> eos = {3};
  EXPECT_NE(DrawToken(logits, params, 0, {{}, {}, eos}), 3);
  const std::vector<int32_t> one = {1};
  EXPECT_NE(DrawToken(logits, params, 1, {{}, one, eos}), 3);
  const std::vector<int32_t> two = {1, 1};
  EXPECT_EQ(DrawToken(logits, params, 2, {{}, two, eos}), 3);
}

TEST(LogitProcessorsTest, LogprobsStayThoseOfTheRawDistribution) {
  const std::vector<float> logits = TestLogits(3);
  SamplingParams params;
  params.logit_bias = {{0, 50.0f}};
  SampledToken s = Sample(logits, params, 0, /*top_logprobs=*/1);
  EXPECT_EQ(s.token, 0);
  EXPECT_FLOAT_EQ(s.logprob, ComputeTokenLogprobs(logits, 0, 0).logprob);
  EXPECT_EQ(s.top[0].token, ArgMax(logits));
}

TEST(LogitProcessorsTest, ValidateNamesTheField) {
  auto message = [](SamplingParams p) {
    return std::string(p.ValidateForVocab(kVocab).message());
  };
  SamplingParams p;
  p.min_p = 1.5f;
  EXPECT_NE(message(p).find("min_p"), std::string::npos);
  p = {};
  p.presence_penalty = -2.5f;
  EXPECT_NE(message(p).find("presence_penalty"), std::string::npos);
  p = {};
  p.frequency_penalty = std::nanf("");
  EXPECT_NE(message(p).find("frequency_penalty"), std::string::npos);
  p = {};
  p.repetition_penalty = 0;
  EXPECT_NE(message(p).find("repetition_penalty"), std::string::npos);
  p = {};
  p.min_tokens = -1;
  EXPECT_NE(message(p).find("min_tokens"), std::string::npos);
  p = {};
  p.logit_bias = {{3, 1.0f}, {3, 2.0f}};
  EXPECT_NE(message(p).find("sorted and unique"), std::string::npos);
  p = {};
  p.logit_bias = {{kVocab, 1.0f}};
  EXPECT_NE(message(p).find("outside the vocabulary"), std::string::npos);
  p = {};
  p.logit_bias = {{1, 101.0f}};
  EXPECT_NE(message(p).find("logit_bias for token 1"), std::string::npos);
  p = {};
  EXPECT_TRUE(p.ValidateForVocab(kVocab).ok());
}

}  // namespace
}  // namespace pdserve::engine
