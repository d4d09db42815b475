// Real prefill_worker processes (S = 2 and 3) wired over UCX, fed over gRPC:
// the KV they deliver into two decode-rank sinks equals the single-process
// engine's, the first token is the golden one and the decode worker is told;
// a killed middle stage fails in-flight requests with UNAVAILABLE within a
// bound and turns health NOT_SERVING; cancel mid-prefill releases the decode
// blocks.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <string>

#include "absl/synchronization/notification.h"
#include "tests/prefill_worker/worker_test_util.h"

namespace pdserve::prefill::testing {
namespace {

using engine::testing_util::MaxRelativeError;
namespace v1 = ::pdserve::v1;

// Compares rank r's delivered KV at positions [from, n) (grant blocks `dst`
// hold positions from `cached` on) with the unsharded engine's.
void ExpectKvMatches(const model::WeightSource& weights, DecodeRanks& ranks,
                     const std::vector<int32_t>& prompt,
                     const std::vector<int64_t>& dst, int cached,
                     const std::string& what) {
  const model::ModelConfig& config = weights.config();
  const int n = static_cast<int>(prompt.size());
  const int blocks = (n + kBlockSize - 1) / kBlockSize;
  auto full = engine::testing_util::MakeEngine(weights, {}, nullptr, 1);
  auto pool = engine::testing_util::MakePool(*full, kBlockSize, blocks);
  auto table = engine::testing_util::IdentityBlockTable(blocks);
  engine::testing_util::PrefillAllLogits(*full, *pool, prompt, table);
  for (int r = 0; r < kRanks; ++r) {
    const kv::KvCacheLayout& sl = ranks.pools[r]->layout();
    std::vector<float> got, want;
    for (int layer = 0; layer < config.num_layers; ++layer) {
      for (int kv = 0; kv < 2; ++kv) {
        for (int h = 0; h < ranks.heads_per_rank; ++h) {
          for (int pos = cached; pos < n; ++pos) {
            const int t = pos - cached;
            const float* g =
                ranks.pools[r]->f32() +
                sl.Offset(dst[t / kBlockSize], layer, kv, h, t % kBlockSize);
            const float* w = pool->f32() +
                             pool->layout().Offset(pos / kBlockSize, layer, kv,
                                                   r * ranks.heads_per_rank + h,
                                                   pos % kBlockSize);
            got.insert(got.end(), g, g + config.head_dim);
            want.insert(want.end(), w, w + config.head_dim);
          }
        }
      }
    }
    EXPECT_LE(MaxRelativeError(got, want), 1e-6) << what << " rank " << r;
  }
}

void RunGolden(int stages, const std::string& split,
               std::vector<std::string> flags) {
  auto weights = engine::testing_util::OpenStories(true);
  ASSERT_NE(weights, nullptr);
  DecodeRanks ranks(weights->config());
  FakeDecode decode;
  WorkerGroup group(stages, split, std::move(flags));
  ASSERT_NE(group.stub(), nullptr);
  EXPECT_EQ(group.Health(), grpc::health::v1::HealthCheckResponse::SERVING);

  std::vector<pdserve::testing::GoldenCase> cases =
      pdserve::testing::LoadGoldenCases();
  for (auto& c : pdserve::testing::LoadGoldenCases("golden_long.jsonl")) {
    cases.push_back(c);
  }
  int64_t next_block = kSinkBlocks - 1;
  int notified = 0;
  for (size_t i = 0; i < cases.size() + 1; ++i) {
    // The last round repeats the longest prompt with the decode side
    // holding its first block already (cached_tokens = 16).
    const bool offset_round = i == cases.size();
    const auto& c = offset_round ? cases.back() : cases[i];
    const int cached = offset_round ? kBlockSize : 0;
    const int n = static_cast<int>(c.prompt_ids.size());
    std::vector<int64_t> dst;
    for (int b = 0; b < (n - cached + kBlockSize - 1) / kBlockSize; ++b) {
      dst.push_back(next_block--);
    }
    const uint64_t id = 1000 + i;
    v1::PrefillSubmitResponse response;
    v1::PrefillSubmitRequest request =
        MakeRequest(id, c.prompt_ids, ranks, dst, cached, decode.address());
    // Alternatives of token 0 cross the last stage -> stage 0 link.
    request.set_top_logprobs(static_cast<int>(i % 4));
    grpc::Status s = group.Prefill(request, &response);
    ASSERT_TRUE(s.ok()) << s.error_message() << "\n" << group.Logs();
    EXPECT_EQ(response.first_token(), c.greedy_ids[0]) << "prompt " << i;
    EXPECT_LT(response.first_token_logprob(), 0.0f);
    ASSERT_EQ(response.first_token_top_logprobs_size(),
              static_cast<int>(i % 4));
    if (i % 4 > 0) {
      // Greedy: token 0 is the most likely one.
      EXPECT_EQ(response.first_token_top_logprobs(0).token_id(),
                c.greedy_ids[0]);
      EXPECT_EQ(response.first_token_top_logprobs(0).logprob(),
                response.first_token_logprob());
    }
    EXPECT_TRUE(response.decode_notified());
    ++notified;
    for (auto& sink : ranks.sinks) {
      EXPECT_TRUE(sink->Wait(id, absl::Seconds(10)).ok());
    }
    ExpectKvMatches(*weights, ranks, c.prompt_ids, dst, cached,
                    absl::StrCat("S=", stages, " prompt ", i));
    // Sink blocks are reused only by later prompts of this test: fine, each
    // check happens before the next write.
    next_block = kSinkBlocks - 1;
  }
  {
    // Scoring only (no destination): the prompt's logprobs cross the stage
    // links and equal the engine's; no KV leaves, nobody is notified.
    const auto& c = cases.back();
    v1::PrefillSubmitRequest request;
    request.set_request_id(7000);
    for (int32_t t : c.prompt_ids) request.add_prompt_ids(t);
    request.set_prompt_logprobs(true);
    request.set_top_logprobs(2);
    v1::PrefillSubmitResponse response;
    grpc::Status s = group.Prefill(request, &response);
    ASSERT_TRUE(s.ok()) << s.error_message() << "\n" << group.Logs();
    EXPECT_EQ(response.first_token(), c.greedy_ids[0]);
    EXPECT_FALSE(response.decode_notified());
    const int n = static_cast<int>(c.prompt_ids.size());
    ASSERT_EQ(response.prompt_logprobs_size(), n - 1);
    const int blocks = (n + kBlockSize - 1) / kBlockSize;
    auto full = engine::testing_util::MakeEngine(*weights, {}, nullptr, 1);
    auto pool = engine::testing_util::MakePool(*full, kBlockSize, blocks);
    auto logits = engine::testing_util::PrefillAllLogits(
        *full, *pool, c.prompt_ids,
        engine::testing_util::IdentityBlockTable(blocks));
    for (int k = 1; k < n; ++k) {
      const engine::TokenLogprobs want =
          engine::ComputeTokenLogprobs(logits[k - 1], c.prompt_ids[k], 2);
      const v1::TokenLogprob& got = response.prompt_logprobs(k - 1);
      ASSERT_NEAR(got.logprob(), want.logprob, 1e-4) << "prompt token " << k;
      ASSERT_EQ(got.top_size(), 2);
      EXPECT_EQ(got.top(0).token_id(), want.top[0].token);
      EXPECT_NEAR(got.top(1).logprob(), want.top[1].logprob, 1e-4);
    }
  }
  auto notices = decode.notices();
  ASSERT_EQ(static_cast<int>(notices.size()), notified);
  for (size_t i = 0; i < notices.size(); ++i) {
    const auto& c = i < cases.size() ? cases[i] : cases.back();
    EXPECT_EQ(notices[i].request_id, 1000 + i);
    EXPECT_EQ(notices[i].first_token, c.greedy_ids[0]);
    // The decode worker hears token 0's numbers with the notice.
    EXPECT_LT(notices[i].first_token_logprob.logprob(), 0.0f);
    EXPECT_EQ(notices[i].first_token_logprob.top_size(),
              static_cast<int>(i % 4));
  }
  EXPECT_EQ(ranks.active(), 0);

  grpc::ClientContext context;
  v1::PrefillLoad load;
  ASSERT_TRUE(group.stub()->GetLoad(&context, {}, &load).ok());
  EXPECT_TRUE(load.serving());
  EXPECT_EQ(load.kv_blocks_used(), 0);
  EXPECT_EQ(load.kv_blocks_total(), 256);
  EXPECT_EQ(load.completed(), static_cast<int64_t>(notified) + 1);  // + scoring
  ASSERT_EQ(load.stages_size(), stages);
  EXPECT_GT(load.stages(0).microbatches(), 0);
}

TEST(PrefillWorkerTest, TwoStagesDeliverEngineKvAndGoldenFirstToken) {
  RunGolden(2, "3,2",
            {"--chunk-policy", "equal-cost", "--chunk-tokens", "16",
             "--microbatch-tokens", "32"});
}

TEST(PrefillWorkerTest, ThreeStagesDeliverEngineKvAndGoldenFirstToken) {
  RunGolden(3, "2,2,1",
            {"--chunk-policy", "fixed", "--chunk-tokens", "7",
             "--microbatch-tokens", "16"});
}

// Fires a Prefill without waiting; `done` is notified with its status.
struct AsyncPrefill {
  grpc::ClientContext context;
  v1::PrefillSubmitResponse response;
  grpc::Status status;
  absl::Notification done;
  absl::Time finished;
};

std::unique_ptr<AsyncPrefill> StartPrefill(WorkerGroup& group,
                                           const v1::PrefillSubmitRequest& r) {
  auto call = std::make_unique<AsyncPrefill>();
  call->context.set_deadline(
      absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  AsyncPrefill* c = call.get();
  group.stub()->async()->Prefill(&c->context, &r, &c->response,
                                 [c](grpc::Status s) {
                                   c->status = std::move(s);
                                   c->finished = absl::Now();
                                   c->done.Notify();
                                 });
  return call;
}

TEST(PrefillWorkerTest, KilledMiddleStageFailsInFlightAndTurnsUnhealthy) {
  auto weights = engine::testing_util::OpenStories(true);
  ASSERT_NE(weights, nullptr);
  DecodeRanks ranks(weights->config());
  WorkerGroup group(3, "2,2,1", {"--chunk-tokens", "16"});
  ASSERT_NE(group.stub(), nullptr);
  const auto cases = pdserve::testing::LoadGoldenCases("golden_long.jsonl");
  const auto& prompt = cases.back().prompt_ids;
  const int blocks = (static_cast<int>(prompt.size()) + 15) / 16;

  // One request first: every stage connects to the sinks, so the next ones
  // go straight into the pipeline.
  {
    std::vector<int64_t> dst;
    for (int b = 0; b < blocks; ++b) dst.push_back(200 + b);
    v1::PrefillSubmitResponse response;
    grpc::Status s =
        group.Prefill(MakeRequest(6, prompt, ranks, dst, 0, ""), &response);
    ASSERT_TRUE(s.ok()) << s.error_message() << group.Logs();
    for (auto& sink : ranks.sinks)
      ASSERT_TRUE(sink->Wait(6, absl::Seconds(10)).ok());
  }
  // Freeze the middle stage so requests are certainly in flight, then kill it.
  group.Signal(1, SIGSTOP);
  std::vector<v1::PrefillSubmitRequest> requests;
  std::vector<std::unique_ptr<AsyncPrefill>> calls;
  for (int i = 0; i < 3; ++i) {
    std::vector<int64_t> dst;
    for (int b = 0; b < blocks; ++b) dst.push_back(i * blocks + b);
    requests.push_back(MakeRequest(7 + i, prompt, ranks, dst, 0, ""));
  }
  for (const auto& r : requests) calls.push_back(StartPrefill(group, r));
  absl::SleepFor(absl::Milliseconds(300));
  for (const auto& c : calls) EXPECT_FALSE(c->done.HasBeenNotified());
  const absl::Time killed = absl::Now();
  group.Kill(1);
  for (size_t i = 0; i < calls.size(); ++i) {
    ASSERT_TRUE(
        calls[i]->done.WaitForNotificationWithTimeout(absl::Seconds(10)))
        << group.Logs();
    EXPECT_EQ(calls[i]->status.error_code(), grpc::StatusCode::UNAVAILABLE)
        << calls[i]->status.error_message();
    EXPECT_NE(calls[i]->status.error_message().find("stage 1"),
              std::string::npos)
        << calls[i]->status.error_message();
    // Bound: heartbeat period + a refused connection, with slack for a
    // loaded machine.
    EXPECT_LT(calls[i]->finished - killed, absl::Seconds(5));
  }
  EXPECT_EQ(group.Health(), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  // New work is refused at once, precisely.
  std::vector<int64_t> dst;
  for (int b = 0; b < blocks; ++b) dst.push_back(100 + b);
  v1::PrefillSubmitResponse response;
  grpc::Status s =
      group.Prefill(MakeRequest(50, prompt, ranks, dst, 0, ""), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  // The decode ranks get their blocks back: stage 0 revoked the KV (or the
  // sinks saw a writer die); the quarantine is 2 s.
  for (auto& sink : ranks.sinks) (void)sink->Cancel(50);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (ranks.active() > 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(ranks.active(), 0);
}

TEST(PrefillWorkerTest, CancelMidPrefillReleasesEverything) {
  auto weights = engine::testing_util::OpenStories(true);
  ASSERT_NE(weights, nullptr);
  DecodeRanks ranks(weights->config());
  // A long heartbeat timeout: the last stage is frozen on purpose below.
  WorkerGroup group(
      2, "3,2", {"--chunk-tokens", "16", "--heartbeat-timeout-ms", "20000"});
  ASSERT_NE(group.stub(), nullptr);
  const auto cases = pdserve::testing::LoadGoldenCases("golden_long.jsonl");
  const auto& prompt = cases.back().prompt_ids;
  const int blocks = (static_cast<int>(prompt.size()) + 15) / 16;
  std::vector<int64_t> dst;
  for (int b = 0; b < blocks; ++b) dst.push_back(b);
  group.Signal(1, SIGSTOP);
  auto request = MakeRequest(77, prompt, ranks, dst, 0, "");
  auto call = StartPrefill(group, request);
  absl::SleepFor(absl::Milliseconds(300));
  {
    grpc::ClientContext context;
    v1::PrefillCancelRequest cancel;
    cancel.set_request_id(77);
    v1::PrefillCancelResponse ignored;
    grpc::Status s = group.stub()->Cancel(&context, cancel, &ignored);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  group.Signal(1, SIGCONT);
  ASSERT_TRUE(call->done.WaitForNotificationWithTimeout(absl::Seconds(15)))
      << group.Logs();
  EXPECT_EQ(call->status.error_code(), grpc::StatusCode::CANCELLED)
      << call->status.error_message();
  // Both sides released: the prefill group's blocks and the decode ranks'.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  int64_t used = -1;
  while (absl::Now() < deadline) {
    grpc::ClientContext context;
    v1::PrefillLoad load;
    if (group.stub()->GetLoad(&context, {}, &load).ok()) {
      used = load.kv_blocks_used() + load.in_flight();
    }
    if (used == 0 && ranks.active() == 0) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(used, 0);
  EXPECT_EQ(ranks.active(), 0);
  for (auto& sink : ranks.sinks) {
    EXPECT_FALSE(sink->Wait(77, absl::Seconds(1)).ok());
  }
  // The group still serves.
  std::vector<int64_t> dst2;
  for (int b = 0; b < blocks; ++b) dst2.push_back(100 + b);
  v1::PrefillSubmitResponse response;
  grpc::Status s =
      group.Prefill(MakeRequest(78, prompt, ranks, dst2, 0, ""), &response);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(response.first_token(), cases.back().greedy_ids[0]);
}

// --step-trace: one line per microbatch a stage computed, with the shape the
// layout planner's step costs take (its profile replays the disaggregated
// calibration at the speed these lines say the stage ran at).
TEST(PrefillWorkerTest, StepTraceHasEveryMicrobatchWithItsShape) {
  auto weights = engine::testing_util::OpenStories(true);
  ASSERT_NE(weights, nullptr);
  DecodeRanks ranks(weights->config());
  WorkerGroup group(2, "3,2",
                    {"--chunk-policy", "fixed", "--chunk-tokens", "16",
                     "--microbatch-tokens", "32"},
                    /*trace_steps=*/true);
  ASSERT_NE(group.stub(), nullptr);
  const auto cases = pdserve::testing::LoadGoldenCases("golden_long.jsonl");
  const auto& prompt = cases.back().prompt_ids;
  const int64_t n = static_cast<int64_t>(prompt.size());
  ASSERT_GT(n, 32) << "a prompt of several chunks";
  std::vector<int64_t> dst;
  for (int b = 0; b < (n + 15) / 16; ++b) dst.push_back(b);
  const double sent = absl::ToUnixMicros(absl::Now()) * 1e-6;
  v1::PrefillSubmitResponse response;
  grpc::Status s =
      group.Prefill(MakeRequest(5, prompt, ranks, dst, 0, ""), &response);
  ASSERT_TRUE(s.ok()) << s.error_message() << "\n" << group.Logs();
  const double answered = absl::ToUnixMicros(absl::Now()) * 1e-6;
  for (int stage = 0; stage < 2; ++stage) {
    SCOPED_TRACE(absl::StrCat("stage ", stage));
    std::ifstream in(group.StepTrace(stage));
    ASSERT_TRUE(in) << group.StepTrace(stage);
    std::string line;
    ASSERT_TRUE(std::getline(in, line));
    EXPECT_EQ(line,
              "end_unix_s,seconds,sequences,tokens_fed,logit_rows,"
              "attended_positions,output_tokens");
    int microbatches = 0, logit_rows = 0, first_tokens = 0;
    int64_t tokens = 0, attended = 0;
    double last_end = 0;
    while (std::getline(in, line)) {
      double end = 0, seconds = 0;
      int chunks = 0, fed = 0, rows = 0, out = 0;
      long long att = 0;
      ASSERT_EQ(std::sscanf(line.c_str(), "%lf,%lf,%d,%d,%d,%lld,%d", &end,
                            &seconds, &chunks, &fed, &rows, &att, &out),
                7)
          << line;
      EXPECT_EQ(chunks, 1) << "one request";
      EXPECT_LE(fed, 32) << "within the microbatch budget";
      EXPECT_GT(seconds, 0);
      EXPECT_GE(end, std::max(last_end, sent)) << "in order, after the send";
      EXPECT_LE(end, answered);
      last_end = end;
      ++microbatches;
      tokens += fed;
      logit_rows += rows;
      first_tokens += out;
      attended += att;
    }
    EXPECT_GE(microbatches, static_cast<int>((n + 31) / 32));
    EXPECT_EQ(tokens, n);
    // Σ over positions p of p + 1, whatever the chunking.
    EXPECT_EQ(attended, n * (n + 1) / 2);
    // The LM head and the sampled first token are the last stage's.
    EXPECT_EQ(logit_rows, stage == 1 ? 1 : 0);
    EXPECT_EQ(first_tokens, stage == 1 ? 1 : 0);
  }
  EXPECT_EQ(response.first_token(), cases.back().greedy_ids[0]);
}

}  // namespace
}  // namespace pdserve::prefill::testing
