// Log-probabilities through the decode worker: every streamed token's
// logprob and top alternatives equal what the single-process engine computes
// for the same sequence (one prefill over prompt + output, logits at every
// output position), through TP 1/2 and speculation off / n-gram / draft (a
// verified token's numbers are its row's, as without speculation), for greedy
// and sampled requests; token 0 of a remote prefill carries the prefill's
// numbers; requests that did not ask get none (bad reports:
// decode_bad_input_test).
#include <gtest/gtest.h>

#include <cmath>

#include "decode_test_util.h"
#include "engine/engine_test_util.h"
#include "engine/sampler.h"

namespace pdserve::decode {
namespace {

using testing_util::AllGoldenCases;
using testing_util::ExpectNoLeak;
using testing_util::Greedy;
using testing_util::MakeWorker;
using testing_util::Options;
using testing_util::RemotePrefill;
using testing_util::Stories;
using testing_util::Stream;

// Same numbers within float tolerance (batching, TP and verify change the
// summation order); alternatives' ids must match except where the reference
// itself nearly ties two neighbours.
void ExpectSameLogprobs(const std::vector<engine::TokenLogprobs>& got,
                        const std::vector<engine::TokenLogprobs>& want,
                        const std::string& what) {
  constexpr float kTolerance = 1e-3f;
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i].logprob, want[i].logprob, kTolerance)
        << what << " token " << i;
    EXPECT_LE(got[i].logprob, 0.0f);
    ASSERT_EQ(got[i].top.size(), want[i].top.size()) << what << " token " << i;
    for (size_t k = 0; k < want[i].top.size(); ++k) {
      EXPECT_NEAR(got[i].top[k].logprob, want[i].top[k].logprob, kTolerance)
          << what << " token " << i << " alternative " << k;
      const auto near = [&](size_t j) {
        return j < want[i].top.size() &&
               std::abs(want[i].top[j].logprob - want[i].top[k].logprob) <
                   kTolerance;
      };
      if (!near(k - 1) && !near(k + 1)) {
        EXPECT_EQ(got[i].top[k].token, want[i].top[k].token)
            << what << " token " << i << " alternative " << k;
      }
    }
  }
}

struct Layout {
  int tp;
  SpeculationMode mode;
};

class LogprobsTest : public ::testing::TestWithParam<Layout> {};

TEST_P(LogprobsTest, GreedyLogprobsMatchTheSingleProcessEngine) {
  auto worker = MakeWorker(Options(GetParam().tp, GetParam().mode));
  ASSERT_NE(worker, nullptr);
  const auto cases = AllGoldenCases();
  // Three asking for 5 alternatives, one for none, one not asking at all:
  // one batch, so greedy rows of requests without logprobs share the step.
  const int asks[] = {5, 5, 5, 0, -1};
  std::vector<Stream> streams(std::size(asks));
  for (size_t i = 0; i < streams.size(); ++i) {
    RequestParams p = Greedy(cases[i].max_new_tokens);
    p.logprobs = asks[i] >= 0;
    p.top_logprobs = std::max(asks[i], 0);
    ASSERT_TRUE(
        worker->Submit(i, cases[i].prompt_ids, p, streams[i].Callback()).ok());
  }
  for (size_t i = 0; i < streams.size(); ++i) {
    ASSERT_TRUE(streams[i].Wait());
    ASSERT_TRUE(streams[i].status().ok()) << streams[i].status();
    EXPECT_EQ(streams[i].tokens(), cases[i].greedy_ids) << "case " << i;
    if (asks[i] < 0) {
      EXPECT_TRUE(streams[i].logprobs().empty());
      continue;
    }
    const auto got = streams[i].logprobs();
    ExpectSameLogprobs(got,
                       engine::testing_util::ReferenceLogprobs(
                           *Stories().weights, cases[i].prompt_ids,
                           cases[i].greedy_ids, asks[i]),
                       "case " + std::to_string(i));
    // Greedy: the emitted token is the most likely one.
    for (size_t t = 0; asks[i] > 0 && t < got.size(); ++t) {
      EXPECT_EQ(got[t].top[0].token, cases[i].greedy_ids[t]);
      EXPECT_EQ(got[t].top[0].logprob, got[t].logprob);
    }
  }
  ExpectNoLeak(*worker);
}

TEST_P(LogprobsTest, SampledTokensReportTheRawDistribution) {
  // Temperature and top-p shape the draw, not the reported numbers.
  auto worker = MakeWorker(Options(GetParam().tp, GetParam().mode));
  ASSERT_NE(worker, nullptr);
  const auto golden = AllGoldenCases()[1];
  RequestParams p;
  p.max_new_tokens = 24;
  p.sampling.temperature = 0.8f;
  p.sampling.top_p = 0.9f;
  p.sampling.seed = 11;
  p.logprobs = true;
  p.top_logprobs = 3;
  Stream s;
  ASSERT_TRUE(worker->Submit(0, golden.prompt_ids, p, s.Callback()).ok());
  ASSERT_TRUE(s.Wait());
  ASSERT_TRUE(s.status().ok()) << s.status();
  ExpectSameLogprobs(s.logprobs(),
                     engine::testing_util::ReferenceLogprobs(
                         *Stories().weights, golden.prompt_ids, s.tokens(), 3),
                     "sampled");
  ExpectNoLeak(*worker);
}

// What the single-process engine says of each prompt token after the ones
// before it.
std::vector<engine::TokenLogprobs> PromptReference(
    const std::vector<int32_t>& prompt, int top_n) {
  return engine::testing_util::ReferenceLogprobs(
      *Stories().weights, {prompt.front()},
      std::vector<int32_t>(prompt.begin() + 1, prompt.end()), top_n);
}

TEST_P(LogprobsTest, LocalPrefillScoresThePromptInChunks) {
  // Small steps: prompts are prefilled (and scored) over several steps,
  // several at once, beside a request that does not score.
  DecodeWorkerOptions o = Options(GetParam().tp, GetParam().mode);
  o.max_step_tokens = 40;
  auto worker = MakeWorker(o);
  ASSERT_NE(worker, nullptr);
  const auto cases = AllGoldenCases();
  // The longest prompt three times: plain (fills the prefix cache), then
  // scored twice (the cache must not skip positions), then a short one.
  struct Ask {
    size_t golden;
    bool scored;
    int top;
  };
  const std::vector<Ask> asks = {{cases.size() - 1, false, 0},
                                 {cases.size() - 1, true, 2},
                                 {cases.size() - 1, true, 0},
                                 {0, true, 3}};
  std::vector<Stream> streams(asks.size());
  for (size_t i = 0; i < asks.size(); ++i) {
    RequestParams p = Greedy(cases[asks[i].golden].max_new_tokens);
    p.prompt_logprobs = asks[i].scored;
    p.top_logprobs = asks[i].top;
    ASSERT_TRUE(worker
                    ->Submit(i, cases[asks[i].golden].prompt_ids, p,
                             streams[i].Callback())
                    .ok());
    if (i == 0) {
      ASSERT_TRUE(streams[0].Wait());
    }
  }
  for (size_t i = 0; i < asks.size(); ++i) {
    const pdserve::testing::GoldenCase& c = cases[asks[i].golden];
    ASSERT_TRUE(streams[i].Wait());
    ASSERT_TRUE(streams[i].status().ok()) << streams[i].status();
    EXPECT_EQ(streams[i].tokens(), c.greedy_ids) << "request " << i;
    if (!asks[i].scored) {
      EXPECT_TRUE(streams[i].prompt_logprobs().empty());
      continue;
    }
    ExpectSameLogprobs(streams[i].prompt_logprobs(),
                       PromptReference(c.prompt_ids, asks[i].top),
                       "request " + std::to_string(i));
  }
  ExpectNoLeak(*worker);
}

TEST(PromptScoringTest, PreemptedMidPrefillScoresEveryTokenOnce) {
  // Two long prompts admitted together into a pool that cannot hold both:
  // the younger is preempted while prefilling and recomputed later.
  DecodeWorkerOptions o = Options(1, SpeculationMode::kOff);
  o.max_step_tokens = 48;
  o.num_blocks = 26;
  auto worker = MakeWorker(o);
  ASSERT_NE(worker, nullptr);
  const auto cases = AllGoldenCases();
  const pdserve::testing::GoldenCase& c = cases.back();
  std::vector<Stream> streams(2);
  for (size_t i = 0; i < streams.size(); ++i) {
    RequestParams p = Greedy(c.max_new_tokens);
    p.prompt_logprobs = true;
    p.top_logprobs = 1;
    ASSERT_TRUE(worker->Submit(i, c.prompt_ids, p, streams[i].Callback()).ok());
  }
  const auto want = PromptReference(c.prompt_ids, 1);
  for (size_t i = 0; i < streams.size(); ++i) {
    ASSERT_TRUE(streams[i].Wait());
    ASSERT_TRUE(streams[i].status().ok()) << streams[i].status();
    EXPECT_EQ(streams[i].tokens(), c.greedy_ids);
    ExpectSameLogprobs(streams[i].prompt_logprobs(), want,
                       "request " + std::to_string(i));
  }
  EXPECT_GT(worker->Load().preemptions, 0);
  ExpectNoLeak(*worker);
}

TEST(PromptScoringTest, RemoteAdmitRefusesPromptLogprobs) {
  auto worker = MakeWorker(Options(1, SpeculationMode::kOff));
  ASSERT_NE(worker, nullptr);
  RequestParams p = Greedy(4);
  p.prompt_logprobs = true;
  Stream s;
  auto admitted = worker->Admit(1, {1, 2, 3}, p, s.Callback());
  ASSERT_FALSE(admitted.ok());
  EXPECT_EQ(admitted.status().code(), absl::StatusCode::kInvalidArgument);
  ExpectNoLeak(*worker);
}

INSTANTIATE_TEST_SUITE_P(Layouts, LogprobsTest,
                         ::testing::Values(Layout{1, SpeculationMode::kOff},
                                           Layout{2, SpeculationMode::kOff},
                                           Layout{1, SpeculationMode::kNgram},
                                           Layout{2, SpeculationMode::kDraft}),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           const char* mode =
                               info.param.mode == SpeculationMode::kOff ? "Off"
                               : info.param.mode == SpeculationMode::kNgram
                                   ? "Ngram"
                                   : "Draft";
                           return "Tp" + std::to_string(info.param.tp) + mode;
                         });

TEST(RemoteLogprobsTest, TokenZeroCarriesThePrefillsNumbers) {
  auto worker = MakeWorker(Options(1, SpeculationMode::kNgram));
  ASSERT_NE(worker, nullptr);
  const auto golden = AllGoldenCases()[2];
  RequestParams p = Greedy(golden.max_new_tokens);
  p.logprobs = true;
  p.top_logprobs = 2;
  Stream s;
  auto admit = worker->Admit(7, golden.prompt_ids, p, s.Callback());
  ASSERT_TRUE(admit.ok()) << admit.status();
  const std::vector<float> logits =
      RemotePrefill(*worker, golden.prompt_ids, *admit);
  // The prefill reports more alternatives than asked: the worker keeps two.
  engine::TokenLogprobs first =
      engine::ComputeTokenLogprobs(logits, engine::ArgMax(logits), /*top_n=*/4);
  ASSERT_TRUE(worker->MarkKvComplete(7, engine::ArgMax(logits), first).ok());
  ASSERT_TRUE(s.Wait());
  EXPECT_EQ(s.tokens(), golden.greedy_ids);
  const auto got = s.logprobs();
  ASSERT_EQ(got.size(), golden.greedy_ids.size());
  EXPECT_EQ(got[0].logprob, first.logprob);
  ASSERT_EQ(got[0].top.size(), 2u);
  EXPECT_EQ(got[0].top[0], first.top[0]);
  EXPECT_EQ(got[0].top[1], first.top[1]);
  ExpectSameLogprobs(
      got,
      engine::testing_util::ReferenceLogprobs(
          *Stories().weights, golden.prompt_ids, golden.greedy_ids, 2),
      "remote");
  ExpectNoLeak(*worker);
}

}  // namespace
}  // namespace pdserve::decode
