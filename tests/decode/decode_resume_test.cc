// Stream migration's worker half (DecodeWorker::Submit with a Resumption):
// a request continued from the tokens another worker streamed produces
// exactly what an unbroken run produces after them — greedy and sampled
// (seed, penalties, min_tokens), with speculation, across TP degrees, with
// stop strings and a grammar — and its text picks up at the byte the client
// has. Bad resumptions are refused precisely and leak nothing.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "decode_test_util.h"

namespace pdserve::decode {
namespace {

using testing_util::AllGoldenCases;
using testing_util::ExpectNoLeak;
using testing_util::Greedy;
using testing_util::MakeWorker;
using testing_util::Options;

// Every delta of one stream, as a client would see them arrive.
class Deltas {
 public:
  StreamCallback Callback() {
    return [this](const TokenDelta& d) {
      absl::MutexLock lock(&mu_);
      deltas_.push_back(d);
      if (d.finished) finished_ = true;
    };
  }
  bool Wait() {
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(&finished_),
                                absl::Seconds(120));
  }
  std::vector<TokenDelta> deltas() {
    absl::MutexLock lock(&mu_);
    return deltas_;
  }

 private:
  absl::Mutex mu_;
  std::vector<TokenDelta> deltas_;
  bool finished_ = false;
};

struct Observed {
  std::vector<int32_t> tokens;
  std::string text;
  FinishReason reason = FinishReason::kNone;
  absl::Status status;
  // After delta i: tokens and text bytes the client has (a cut point).
  std::vector<std::pair<size_t, size_t>> cuts;
};

Observed Collect(Deltas& d) {
  EXPECT_TRUE(d.Wait());
  Observed run;
  for (const TokenDelta& delta : d.deltas()) {
    run.tokens.insert(run.tokens.end(), delta.tokens.begin(),
                      delta.tokens.end());
    run.text += delta.text;
    if (!delta.finished)
      run.cuts.emplace_back(run.tokens.size(), run.text.size());
    if (delta.finished) {
      run.reason = delta.reason;
      run.status = delta.status;
    }
  }
  return run;
}

Observed Submit(DecodeWorker& worker, uint64_t id,
                const std::vector<int32_t>& prompt, const RequestParams& params,
                const Resumption* resume = nullptr) {
  Deltas d;
  const absl::Status s =
      worker.Submit(id, prompt, params, d.Callback(), resume);
  EXPECT_TRUE(s.ok()) << s;
  if (!s.ok()) return {};
  return Collect(d);
}

// Runs `params` on `prompt` unbroken, then again resumed at several cut
// points of the first run; each resumed run must be the unbroken run's
// tail, token for token and byte for byte.
void ExpectResumesMatch(DecodeWorker& worker,
                        const std::vector<int32_t>& prompt,
                        const RequestParams& params, uint64_t base_id) {
  const Observed whole = Submit(worker, base_id, prompt, params);
  ASSERT_TRUE(whole.status.ok()) << whole.status;
  ASSERT_GE(whole.cuts.size(), 3u) << "too short to cut";
  const std::vector<size_t> picks = {0, whole.cuts.size() / 2,
                                     whole.cuts.size() - 1};
  for (size_t pick : picks) {
    const auto [tokens, bytes] = whole.cuts[pick];
    if (tokens >= whole.tokens.size()) continue;
    Resumption resume;
    resume.output.assign(whole.tokens.begin(), whole.tokens.begin() + tokens);
    resume.delivered_text_bytes = static_cast<int64_t>(bytes);
    const Observed rest =
        Submit(worker, base_id + 1 + pick, prompt, params, &resume);
    EXPECT_TRUE(rest.status.ok()) << rest.status;
    EXPECT_EQ(rest.reason, whole.reason) << "cut after " << tokens;
    EXPECT_EQ(rest.tokens, std::vector<int32_t>(whole.tokens.begin() + tokens,
                                                whole.tokens.end()))
        << "cut after " << tokens << " tokens";
    EXPECT_EQ(whole.text.substr(0, bytes) + rest.text, whole.text)
        << "cut after " << tokens << " tokens, " << bytes << " bytes";
  }
}

class ResumeTest
    : public ::testing::TestWithParam<std::tuple<int, SpeculationMode>> {};

TEST_P(ResumeTest, GreedyContinuationIsTheUnbrokenRunsTail) {
  const auto [tp, mode] = GetParam();
  auto worker = MakeWorker(Options(tp, mode));
  ASSERT_NE(worker, nullptr);
  const auto cases = AllGoldenCases();
  for (size_t i = 0; i < 3 && i < cases.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "golden case " << i);
    ExpectResumesMatch(*worker, cases[i].prompt_ids,
                       Greedy(cases[i].max_new_tokens), 100 * (i + 1));
  }
  ExpectNoLeak(*worker);
}

class SampledResumeTest : public ResumeTest {};

TEST_P(SampledResumeTest, SampledContinuationDrawsWhatTheUnbrokenRunDrew) {
  // The uniforms are a function of (seed, output index), so a resumed
  // request with the same seed draws token k exactly as the first worker
  // would have; penalties and min_tokens count the resumed tokens.
  const auto [tp, mode] = GetParam();
  auto worker = MakeWorker(Options(tp, mode));
  ASSERT_NE(worker, nullptr);
  const auto cases = AllGoldenCases();
  RequestParams p = Greedy(48);
  p.sampling.temperature = 0.9f;
  p.sampling.top_p = 0.95f;
  p.sampling.top_k = 40;
  p.sampling.seed = 1234;
  p.sampling.presence_penalty = 0.4f;
  p.sampling.frequency_penalty = 0.3f;
  p.sampling.repetition_penalty = 1.1f;
  p.sampling.min_tokens = 30;
  ExpectResumesMatch(*worker, cases[0].prompt_ids, p, 1000);
  ExpectNoLeak(*worker);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, ResumeTest,
    ::testing::Values(std::make_tuple(1, SpeculationMode::kOff),
                      std::make_tuple(2, SpeculationMode::kNgram),
                      std::make_tuple(1, SpeculationMode::kDraft)),
    [](const auto& info) {
      const SpeculationMode m = std::get<1>(info.param);
      return absl::StrCat("Tp", std::get<0>(info.param),
                          m == SpeculationMode::kOff     ? "Off"
                          : m == SpeculationMode::kNgram ? "Ngram"
                                                         : "Draft");
    });

// Not with a draft model: its proposals are themselves sampled, and which
// are made depends on the step boundaries (adaptive γ starts afresh), so the
// verifier keeps the target's distribution (decode_sampling_test's
// chi-square tests) but not the unbroken run's draws.
INSTANTIATE_TEST_SUITE_P(
    Layouts, SampledResumeTest,
    ::testing::Values(std::make_tuple(1, SpeculationMode::kOff),
                      std::make_tuple(2, SpeculationMode::kNgram)),
    [](const auto& info) {
      return absl::StrCat(
          "Tp", std::get<0>(info.param),
          std::get<1>(info.param) == SpeculationMode::kOff ? "Off" : "Ngram");
    });

TEST(ResumeStopTest, StopStringAfterTheCutEndsTheResumedRunWhereItWould) {
  auto worker = MakeWorker(Options(1, SpeculationMode::kOff));
  ASSERT_NE(worker, nullptr);
  const auto cases = AllGoldenCases();
  const auto& c = cases[0];
  // A stop string from the second half of the golden text.
  const std::string stop = c.text.substr(c.text.size() * 2 / 3, 5);
  RequestParams p = Greedy(c.max_new_tokens);
  p.stop = {stop};
  const Observed whole = Submit(*worker, 1, c.prompt_ids, p);
  ASSERT_EQ(whole.reason, FinishReason::kStop);
  ExpectResumesMatch(*worker, c.prompt_ids, p, 10);
  ExpectNoLeak(*worker);
}

TEST(ResumeGrammarTest, GrammarStateFollowsTheResumedTokens) {
  auto worker = MakeWorker(Options(1, SpeculationMode::kOff));
  ASSERT_NE(worker, nullptr);
  const auto cases = AllGoldenCases();
  RequestParams p = Greedy(40);
  p.sampling.temperature = 0.7f;
  p.sampling.seed = 7;
  p.sampling.structured_output.kind = engine::StructuredOutput::Kind::kRegex;
  p.sampling.structured_output.text = "(Once|Then) upon a [a-z]+( [a-z]+)+\\.";
  ExpectResumesMatch(*worker, cases[0].prompt_ids, p, 20);
  ExpectNoLeak(*worker);
}

TEST(ResumeBadInputTest, RefusedPreciselyAndNothingLeaks) {
  auto worker = MakeWorker(Options(1, SpeculationMode::kOff));
  ASSERT_NE(worker, nullptr);
  const std::vector<int32_t> prompt = AllGoldenCases()[0].prompt_ids;
  auto refused = [&](const Resumption& resume, const RequestParams& params) {
    Deltas d;
    return worker->Submit(77, prompt, params, d.Callback(), &resume);
  };
  Resumption empty;
  EXPECT_EQ(refused(empty, Greedy(8)).code(),
            absl::StatusCode::kInvalidArgument);
  Resumption too_many;
  too_many.output.assign(8, 5);
  absl::Status s = refused(too_many, Greedy(8));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("nothing of max_new_tokens"), std::string::npos)
      << s;
  Resumption out_of_vocab;
  out_of_vocab.output = {5, 1 << 20};
  s = refused(out_of_vocab, Greedy(8));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("outside the vocabulary"), std::string::npos) << s;
  Resumption text_beyond;
  text_beyond.output = {5};
  text_beyond.delivered_text_bytes = 1000;
  s = refused(text_beyond, Greedy(8));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("bytes of text"), std::string::npos) << s;
  Resumption scored;
  scored.output = {5};
  RequestParams with_scores = Greedy(8);
  with_scores.prompt_logprobs = true;
  EXPECT_EQ(refused(scored, with_scores).code(),
            absl::StatusCode::kInvalidArgument);
  // The id was never taken: a good request under it runs.
  Resumption good;
  good.output = {prompt.back()};
  Deltas d;
  ASSERT_TRUE(worker->Submit(77, prompt, Greedy(4), d.Callback(), &good).ok());
  const Observed run = Collect(d);
  EXPECT_EQ(run.tokens.size(), 3u);
  ExpectNoLeak(*worker);
}

}  // namespace
}  // namespace pdserve::decode
