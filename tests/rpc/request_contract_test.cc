// The request contract (services/rpc/request_contract.h): its bounds, its
// defaults, and wire <-> engine round trips of sampling and logprob fields.
#include "rpc/request_contract.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

namespace pdserve::rpc {
namespace {

TEST(RequestContractTest, SamplingBoundsNameTheField) {
  EXPECT_TRUE(CheckSampling({}).ok());
  EXPECT_TRUE(CheckSampling({kMaxTemperature, 1.0f, 0, 0}).ok());
  for (const auto& [sampling, field] :
       std::vector<std::pair<Sampling, std::string>>{
           {{-0.1f, 1.0f, 0, 0}, "temperature"},
           {{2.5f, 1.0f, 0, 0}, "temperature"},
           {{std::nanf(""), 1.0f, 0, 0}, "temperature"},
           {{1.0f, 0.0f, 0, 0}, "top_p"},
           {{1.0f, 1.5f, 0, 0}, "top_p"},
           {{1.0f, 1.0f, -1, 0}, "top_k"}}) {
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
  Sampling s = SamplingFromWire(wire, 99);
  EXPECT_EQ(s.top_p, 1.0f);
  EXPECT_EQ(s.seed, 99u);
  const Sampling sent{0.7f, 0.9f, 40, 12345};
  SamplingToWire(sent, &wire);
  s = SamplingFromWire(wire, 99);
  EXPECT_EQ(s.temperature, sent.temperature);
  EXPECT_EQ(s.top_p, sent.top_p);
  EXPECT_EQ(s.top_k, sent.top_k);
  EXPECT_EQ(s.seed, sent.seed);  // a set seed, 0 included, is kept
  wire.set_seed(0);
  EXPECT_EQ(SamplingFromWire(wire, 99).seed, 0u);
  const engine::SamplingParams e = ToEngine(sent);
  EXPECT_EQ(e.temperature, sent.temperature);
  EXPECT_EQ(e.top_k, sent.top_k);
  EXPECT_EQ(e.top_p, sent.top_p);
  EXPECT_EQ(e.seed, sent.seed);
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
