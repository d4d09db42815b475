// Bad requests, splits and options get precise errors, and the group keeps
// serving afterwards.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <optional>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "engine/engine_test_util.h"
#include "prefill/chunk_policy.h"
#include "prefill/in_process_group.h"
#include "prefill/kv_output.h"
#include "prefill/layer_split.h"
#include "prefill/prefill_coordinator.h"
#include "prefill/stage_link.h"

namespace pdserve::prefill {
namespace {

using ::testing::HasSubstr;

void ExpectError(const absl::Status& status, absl::StatusCode code,
                 const std::string& text) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(text)) << status;
}

TEST(LayerSplitBadInputTest, NamesTheWrongEntryOrCount) {
  ExpectError(ParseLayerSplit("", 5, 3).status(),
              absl::StatusCode::kInvalidArgument, "layer split is empty");
  ExpectError(ParseLayerSplit("2,,1", 5, 3).status(),
              absl::StatusCode::kInvalidArgument, "entry 2 is empty");
  ExpectError(ParseLayerSplit("2,x,1", 5, 3).status(),
              absl::StatusCode::kInvalidArgument,
              "entry 2 (\"x\") is not an integer");
  ExpectError(ParseLayerSplit("2,1.5,1", 5, 3).status(),
              absl::StatusCode::kInvalidArgument, "is not an integer");
  ExpectError(ParseLayerSplit("2,0,3", 5, 3).status(),
              absl::StatusCode::kInvalidArgument,
              "entry 2 is 0 but every stage needs at least one layer");
  ExpectError(ParseLayerSplit("3,-1,3", 5, 3).status(),
              absl::StatusCode::kInvalidArgument, "entry 2 is -1");
  ExpectError(ParseLayerSplit("3,2", 5, 3).status(),
              absl::StatusCode::kInvalidArgument,
              "has 2 entries but there are 3 stages");
  ExpectError(ParseLayerSplit("2,2,2", 5, 3).status(),
              absl::StatusCode::kInvalidArgument,
              "covers 6 layers but the model has 5");
  ExpectError(ParseLayerSplit("99999999999,1", 5, 2).status(),
              absl::StatusCode::kInvalidArgument, "is not an integer");
  LayerCostProfile costs;
  costs.layer_cost.assign(5, 1.0);
  ExpectError(AutoLayerSplit(costs, 6).status(),
              absl::StatusCode::kInvalidArgument,
              "cannot split 5 layers over 6 stages");
  ExpectError(AutoLayerSplit(costs, 0).status(),
              absl::StatusCode::kInvalidArgument, "must be >= 1, got 0");
  costs.layer_cost[2] = std::nan("");
  ExpectError(AutoLayerSplit(costs, 2).status(),
              absl::StatusCode::kInvalidArgument, "finite and >= 0");
  costs.layer_cost[2] = 1.0;
  ExpectError(ResolveLayerSplit("aut0", 2, costs).status(),
              absl::StatusCode::kInvalidArgument, "entry 1 (\"aut0\")");
  EXPECT_TRUE(ResolveLayerSplit(" auto ", 2, costs).ok());
}

TEST(ChunkPolicyBadInputTest, UnknownKindAndNegativeSize) {
  ExpectError(ParseChunkPolicy("medium", 8).status(),
              absl::StatusCode::kInvalidArgument,
              "unknown chunk policy \"medium\"");
  ExpectError(ParseChunkPolicy("fixed", -3).status(),
              absl::StatusCode::kInvalidArgument,
              "chunk size must be >= 0 (0 = whole prompt), got -3");
}

// Passes writes through, but while held keeps their completions back, so a
// request stays in flight for as long as a test needs it to (the tiny model
// prefills a prompt faster than the test can submit a duplicate).
class HoldableKvOutput : public StageKvOutput {
 public:
  void Write(const KvWrite& write,
             std::function<void(absl::Status)> done) override {
    {
      absl::MutexLock lock(&mu_);
      if (held_) {
        pending_.push_back(std::move(done));
        return;
      }
    }
    done(absl::OkStatus());
  }
  void Hold() {
    absl::MutexLock lock(&mu_);
    held_ = true;
  }
  void Release() {
    std::vector<std::function<void(absl::Status)>> pending;
    {
      absl::MutexLock lock(&mu_);
      held_ = false;
      pending.swap(pending_);
    }
    for (auto& done : pending) done(absl::OkStatus());
  }

 private:
  absl::Mutex mu_;
  bool held_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::function<void(absl::Status)>> pending_ ABSL_GUARDED_BY(mu_);
};

class PrefillBadInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    weights_ = engine::testing_util::OpenStories(true);
    ASSERT_NE(weights_, nullptr);
    PrefillGroupOptions options;
    options.layer_split = {3, 2};
    options.scheduler.block_size = 16;
    options.scheduler.num_blocks = 8;  // 128 tokens
    auto group = InProcessPrefillGroup::Create(*weights_, options, &kv_out_);
    ASSERT_TRUE(group.ok()) << group.status();
    group_ = std::move(group).value();
  }
  // A failed expectation must not leave completions held behind a group that
  // is about to wait for them.
  void TearDown() override { kv_out_.Release(); }

  absl::Status Submit(PrefillRequest request) {
    return group_->Submit(std::move(request)).status();
  }

  std::unique_ptr<model::WeightSource> weights_;
  HoldableKvOutput kv_out_;
  std::unique_ptr<InProcessPrefillGroup> group_;
};

TEST_F(PrefillBadInputTest, RequestsGetPreciseErrorsAndTheGroupKeepsServing) {
  PrefillRequest good;
  good.request_id = 1;
  good.prompt = {1, 403, 407, 261, 378};

  PrefillRequest empty = good;
  empty.prompt.clear();
  ExpectError(Submit(empty), absl::StatusCode::kInvalidArgument,
              "request 1: prompt is empty");

  const int context = weights_->config().max_position_embeddings;
  PrefillRequest too_long = good;
  too_long.prompt.assign(context + 1, 5);
  ExpectError(
      Submit(too_long), absl::StatusCode::kInvalidArgument,
      absl::StrCat("prompt has ", context + 1,
                   " tokens but the model's context is ", context, " tokens"));

  PrefillRequest bad_token = good;
  bad_token.prompt[3] = 512;
  ExpectError(Submit(bad_token), absl::StatusCode::kInvalidArgument,
              "prompt token 3 is 512, outside the vocabulary [0, 512)");
  bad_token.prompt[3] = -1;
  ExpectError(Submit(bad_token), absl::StatusCode::kInvalidArgument,
              "prompt token 3 is -1");

  PrefillRequest bad_sampling = good;
  bad_sampling.sampling.temperature = -0.5f;
  ExpectError(Submit(bad_sampling), absl::StatusCode::kInvalidArgument,
              "sampling: temperature must be a finite number >= 0");
  bad_sampling.sampling.temperature = std::nanf("");
  ExpectError(Submit(bad_sampling), absl::StatusCode::kInvalidArgument,
              "temperature");
  bad_sampling.sampling.temperature = 1.0f;
  bad_sampling.sampling.top_p = 0.0f;
  ExpectError(Submit(bad_sampling), absl::StatusCode::kInvalidArgument,
              "top_p must be in (0, 1], got 0");
  bad_sampling.sampling.top_p = 1.0f;
  bad_sampling.sampling.top_k = -2;
  ExpectError(Submit(bad_sampling), absl::StatusCode::kInvalidArgument,
              "top_k must be >= 0, got -2");

  PrefillRequest bad_chunk = good;
  bad_chunk.chunk_policy = ChunkPolicy{ChunkPolicyKind::kFixed, -1};
  ExpectError(Submit(bad_chunk), absl::StatusCode::kInvalidArgument,
              "chunk policy: chunk size must be >= 0");

  // 200 tokens need 13 blocks; the group has 8.
  PrefillRequest too_big = good;
  too_big.prompt.assign(200, 5);
  ExpectError(Submit(too_big), absl::StatusCode::kResourceExhausted,
              "prompt needs 13 KV blocks of 16 tokens but the prefill group "
              "has 8");

  // None of that left anything behind: the good request runs. Its KV
  // completions are held so it is certainly still in flight when the
  // duplicate arrives.
  kv_out_.Hold();
  auto ticket = group_->Submit(good);
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  ExpectError(Submit(good), absl::StatusCode::kAlreadyExists,
              "request 1 is already being prefilled");
  kv_out_.Release();
  auto outcome = (*ticket)->Wait(absl::Seconds(30));
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  EXPECT_EQ(outcome->first_token.token, 432);  // golden "Once upon a time"
  EXPECT_EQ(group_->coordinator().stats().used_blocks, 0);
  ExpectError(group_->Cancel(1), absl::StatusCode::kNotFound,
              "request 1 is not being prefilled");
  // The id is free again once finished.
  EXPECT_TRUE(group_->Submit(good).ok());
}

TEST_F(PrefillBadInputTest, BadGroupOptions) {
  PrefillGroupOptions options;
  options.scheduler.num_blocks = 8;
  options.layer_split = {3, 3};
  ExpectError(
      InProcessPrefillGroup::Create(*weights_, options, nullptr).status(),
      absl::StatusCode::kInvalidArgument,
      "layer split covers 6 layers but the model has 5");
  options.layer_split = {5, 0};
  ExpectError(
      InProcessPrefillGroup::Create(*weights_, options, nullptr).status(),
      absl::StatusCode::kInvalidArgument, "at least one layer");
  options.layer_split = {5};
  options.scheduler.microbatch_token_budget = 0;
  ExpectError(
      InProcessPrefillGroup::Create(*weights_, options, nullptr).status(),
      absl::StatusCode::kInvalidArgument,
      "microbatch token budget must be >= 1, got 0");
  options.scheduler.microbatch_token_budget = 64;
  options.scheduler.num_blocks = 0;
  EXPECT_EQ(InProcessPrefillGroup::Create(*weights_, options, nullptr)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(PrefillBadInputTest, SubmitAfterShutdownIsUnavailable) {
  group_->coordinator().Shutdown();
  PrefillRequest good;
  good.request_id = 9;
  good.prompt = {1, 2, 3};
  ExpectError(Submit(good), absl::StatusCode::kUnavailable, "shutting down");
}

// A stage reporting prompt scores that do not fit the request (a peer's
// bug or a corrupted event): that request fails with INTERNAL naming the
// mismatch, nothing leaks, and the coordinator keeps serving.
TEST(PrefillCoordinatorBadInputTest, MisfitPromptScoresFailOnlyThatRequest) {
  model::ModelConfig config;
  config.vocab_size = 32;
  config.max_position_embeddings = 64;
  InProcessStageLink stage0;  // the test plays the (single) stage
  SchedulerOptions options;
  options.block_size = 4;
  options.num_blocks = 16;
  options.prefix_reuse = false;
  auto coordinator = PrefillCoordinator::Create(config, 1, options, &stage0);
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  // Answers one microbatch as the last stage would, with `scores` injected
  // for each scored chunk.
  auto serve = [&](const std::function<void(const ChunkHeader&)>& scores) {
    std::optional<StageMessage> m = stage0.Receive();
    ASSERT_TRUE(m.has_value());
    StageEvent done;
    done.kind = StageEvent::Kind::kMicrobatchDone;
    done.stage = 0;
    done.microbatch_id = m->microbatch_id;
    for (const ChunkHeader& c : m->chunks) {
      done.request_ids.push_back(c.request_id);
      if (c.prompt_logprobs) scores(c);
      if (!c.final_chunk) continue;
      StageEvent token;
      token.kind = StageEvent::Kind::kFirstToken;
      token.request_id = c.request_id;
      token.token.token = 3;
      (*coordinator)->Report(token);
      StageEvent written;
      written.kind = StageEvent::Kind::kKvWritten;
      written.request_id = c.request_id;
      (*coordinator)->Report(written);
    }
    (*coordinator)->Report(done);
  };
  auto submit = [&](uint64_t id, bool scored) {
    PrefillRequest request;
    request.request_id = id;
    request.prompt = {1, 5, 7, 9, 11};
    request.prompt_logprobs = scored;
    request.write_kv = false;
    auto ticket = (*coordinator)->Submit(request);
    EXPECT_TRUE(ticket.ok()) << ticket.status();
    return ticket.ok() ? *ticket : nullptr;
  };
  auto report_scores = [&](uint64_t id, int first, size_t count) {
    StageEvent e;
    e.kind = StageEvent::Kind::kPromptLogprobs;
    e.request_id = id;
    e.first_scored = first;
    e.prompt_logprobs.resize(count);
    (*coordinator)->Report(e);
  };

  // Scores starting at the wrong position.
  auto gap = submit(1, true);
  serve([&](const ChunkHeader& c) { report_scores(c.request_id, 2, 3); });
  ExpectError(gap->Wait(absl::Seconds(10)).status(),
              absl::StatusCode::kInternal, "do not continue");
  // More scores than the prompt has tokens after the first.
  auto extra = submit(2, true);
  serve([&](const ChunkHeader& c) { report_scores(c.request_id, 1, 5); });
  ExpectError(extra->Wait(absl::Seconds(10)).status(),
              absl::StatusCode::kInternal, "do not continue");
  // Too few scores by the time the request completes.
  auto short_scores = submit(3, true);
  serve([&](const ChunkHeader& c) { report_scores(c.request_id, 1, 2); });
  ExpectError(short_scores->Wait(absl::Seconds(10)).status(),
              absl::StatusCode::kInternal, "2 prompt tokens scored of 4");
  // Scores for a request that did not ask.
  auto unasked = submit(4, false);
  report_scores(4, 1, 4);
  serve([](const ChunkHeader&) {});
  ExpectError(unasked->Wait(absl::Seconds(10)).status(),
              absl::StatusCode::kInternal, "do not continue");
  // Still serving: a well-scored request completes with its scores.
  auto good = submit(5, true);
  serve([&](const ChunkHeader& c) {
    report_scores(c.request_id, c.token_begin + 1,
                  c.num_tokens() - (c.final_chunk ? 1 : 0));
  });
  auto outcome = good->Wait(absl::Seconds(10));
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  EXPECT_EQ(outcome->prompt_logprobs.size(), 4u);
  EXPECT_EQ((*coordinator)->stats().used_blocks, 0);
  EXPECT_EQ((*coordinator)->stats().active_requests, 0);
  (*coordinator)->Shutdown();
}

}  // namespace
}  // namespace pdserve::prefill
