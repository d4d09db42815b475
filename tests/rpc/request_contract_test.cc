// The request contract (services/rpc/request_contract.h): its bounds, its
// defaults, and wire <-> engine round trips of sampling and logprob fields.
#include "rpc/request_contract.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

namespace pdserve::rpc {
namespace {

engine::SamplingParams Sampling(float temperature, float top_p, int top_k) {
  engine::SamplingParams s;
  s.temperature = temperature;
  s.top_p = top_p;
  s.top_k = top_k;
  return s;
}

TEST(RequestContractTest, SamplingBoundsNameTheField) {
  EXPECT_TRUE(CheckSampling({}).ok());
  EXPECT_TRUE(CheckSampling(Sampling(kMaxTemperature, 1.0f, 0)).ok());
  for (const auto& [sampling, field] :
       std::vector<std::pair<engine::SamplingParams, std::string>>{
           {Sampling(-0.1f, 1.0f, 0), "temperature"},
           {Sampling(2.5f, 1.0f, 0), "temperature"},
           {Sampling(std::nanf(""), 1.0f, 0), "temperature"},
           {Sampling(1.0f, 0.0f, 0), "top_p"},
           {Sampling(1.0f, 1.5f, 0), "top_p"},
           {Sampling(1.0f, 1.0f, -1), "top_k"}}) {
    const absl::Status s = CheckSampling(sampling);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(s.message().find(field), std::string::npos) << s;
    EXPECT_NE(s.message().find("sampling: "), std::string::npos) << s;
  }
}

TEST(RequestContractTest, MaxTokensLogprobsAndStops) {
  EXPECT_TRUE(CheckMaxTokens(1, false).ok());
  EXPECT_FALSE(CheckMaxTokens(0, false).ok());
  EXPECT_TRUE(CheckMaxTokens(0, true).ok());
  EXPECT_FALSE(CheckMaxTokens(-1, true).ok());
  EXPECT_FALSE(CheckMaxTokens(int64_t{1} << 40, false).ok());
  EXPECT_TRUE(CheckLogprobs(true, kMaxTopLogprobs).ok());
  EXPECT_FALSE(CheckLogprobs(true, kMaxTopLogprobs + 1).ok());
  EXPECT_FALSE(CheckLogprobs(false, 1).ok());
  EXPECT_FALSE(CheckLogprobs(true, -1).ok());
  EXPECT_TRUE(CheckStops(std::vector<std::string>{"a", "\n"}).ok());
  EXPECT_FALSE(CheckStops(std::vector<std::string>{""}).ok());
  EXPECT_FALSE(
      CheckStops(std::vector<std::string>(kMaxStopStrings + 1, "x")).ok());
  EXPECT_EQ(MaxTokensFromWorkerWire(0), kDefaultMaxTokens);
  EXPECT_EQ(MaxTokensFromWorkerWire(7), 7);
}

TEST(RequestContractTest, SamplingCrossesTheWire) {
  v1::SamplingParams wire;
  // Unset top_p (0 on the wire) is off; an unset seed takes the fallback.
  engine::SamplingParams s = SamplingFromWire(wire, 99);
  EXPECT_EQ(s.top_p, 1.0f);
  EXPECT_EQ(s.repetition_penalty, 1.0f);
  EXPECT_EQ(s.seed, 99u);
  // Every field there and back: the one type every layer keeps.
  engine::SamplingParams sent;
  sent.temperature = 0.7f;
  sent.top_p = 0.9f;
  sent.top_k = 40;
  sent.seed = 12345;
  sent.min_p = 0.05f;
  sent.presence_penalty = 0.5f;
  sent.frequency_penalty = -0.25f;
  sent.repetition_penalty = 1.2f;
  sent.min_tokens = 3;
  sent.logit_bias = {{2, -1.5f}, {7, 3.0f}};
  sent.structured_output.kind = engine::StructuredOutput::Kind::kChoice;
  sent.structured_output.choices = {"yes", "no"};
  SamplingToWire(sent, &wire);
  s = SamplingFromWire(wire, 99);
  EXPECT_EQ(s.temperature, sent.temperature);
  EXPECT_EQ(s.top_p, sent.top_p);
  EXPECT_EQ(s.top_k, sent.top_k);
  EXPECT_EQ(s.seed, sent.seed);  // a set seed, 0 included, is kept
  EXPECT_EQ(s.min_p, sent.min_p);
  EXPECT_EQ(s.presence_penalty, sent.presence_penalty);
  EXPECT_EQ(s.frequency_penalty, sent.frequency_penalty);
  EXPECT_EQ(s.repetition_penalty, sent.repetition_penalty);
  EXPECT_EQ(s.min_tokens, sent.min_tokens);
  ASSERT_EQ(s.logit_bias.size(), 2u);
  EXPECT_EQ(s.logit_bias[0].token, 2);  // sorted by token
  EXPECT_EQ(s.logit_bias[1].bias, 3.0f);
  EXPECT_EQ(s.structured_output, sent.structured_output);
  EXPECT_TRUE(CheckSampling(s).ok());
  wire.set_seed(0);
  EXPECT_EQ(SamplingFromWire(wire, 99).seed, 0u);
}

TEST(RequestContractTest, LogprobsCrossTheWire) {
  engine::TokenLogprobs l;
  l.logprob = -0.25f;
  l.top = {{3, -0.25f}, {9, -1.5f}};
  v1::TokenLogprob wire;
  LogprobsToWire(l, &wire);
  ASSERT_EQ(wire.top_size(), 2);
  EXPECT_EQ(wire.top(1).token_id(), 9);
  const engine::TokenLogprobs back = LogprobsFromWire(wire);
  EXPECT_EQ(back.logprob, l.logprob);
  EXPECT_EQ(back.top, l.top);
}

}  // namespace
}  // namespace pdserve::rpc
