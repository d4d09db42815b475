// Pipelines of S = 1..5 in-process stages reproduce the single-process engine:
// the KV each stage sends for a request equals the reference KV, and the last
// stage's first token equals the golden one, for every chunk policy.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "engine/engine_test_util.h"
#include "engine/llama_engine.h"
#include "engine/sampler.h"
#include "prefill/in_process_group.h"
#include "prefill/layer_split.h"
#include "testing/golden.h"

namespace pdserve::prefill {
namespace {

using engine::testing_util::ExtractKv;
using engine::testing_util::MaxRelativeError;

constexpr int kBlockSize = 16;

struct Reference {
  std::vector<int32_t> prompt;
  int32_t golden_first = -1;
  std::vector<float> kv;                       // [layer][k|v][head][pos][dim]
  std::vector<float> last_logits;              // of the last prompt position
  std::vector<std::vector<float>> all_logits;  // of every prompt position
};

class PrefillPipelineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    weights_ = engine::testing_util::OpenStories(true).release();
    auto full = engine::testing_util::MakeEngine(*weights_, {}, nullptr, 1);
    std::vector<pdserve::testing::GoldenCase> cases =
        pdserve::testing::LoadGoldenCases();
    for (auto& c : pdserve::testing::LoadGoldenCases("golden_long.jsonl")) {
      cases.push_back(c);
    }
    references_ = new std::vector<Reference>;
    for (const auto& c : cases) {
      Reference ref;
      ref.prompt = c.prompt_ids;
      ref.golden_first = c.greedy_ids[0];
      const int n = static_cast<int>(ref.prompt.size());
      const int blocks = (n + kBlockSize - 1) / kBlockSize;
      auto pool = engine::testing_util::MakePool(*full, kBlockSize, blocks);
      auto table = engine::testing_util::IdentityBlockTable(blocks);
      auto logits = engine::testing_util::PrefillAllLogits(*full, *pool,
                                                           ref.prompt, table);
      ref.last_logits = logits.back();
      ref.all_logits = logits;
      ref.kv = ExtractKv(*pool, n);
      references_->push_back(std::move(ref));
    }
  }
  static void TearDownTestSuite() {
    delete references_;
    delete weights_;
  }

  static std::unique_ptr<InProcessPrefillGroup> MakeGroup(
      std::vector<int> split, StageKvOutput* kv_out, bool prefix_reuse = false,
      int64_t blocks = 1024, int budget = 64, ChunkPolicy policy = {}) {
    PrefillGroupOptions options;
    options.layer_split = std::move(split);
    options.threads_per_stage = 1;
    options.scheduler.block_size = kBlockSize;
    options.scheduler.num_blocks = blocks;
    options.scheduler.microbatch_token_budget = budget;
    options.scheduler.prefix_reuse = prefix_reuse;
    options.scheduler.chunk_policy = policy;
    auto group = InProcessPrefillGroup::Create(*weights_, options, kv_out);
    EXPECT_TRUE(group.ok()) << group.status();
    return group.ok() ? std::move(group).value() : nullptr;
  }

  static void ExpectKvMatches(const CapturingKvOutput& out, uint64_t id,
                              const Reference& ref, const std::string& what) {
    const int layers = weights_->config().num_layers;
    const int n = static_cast<int>(ref.prompt.size());
    std::vector<float> got = out.Collected(id, layers, n);
    ASSERT_EQ(got.size(), ref.kv.size()) << what;
    for (float v : got) ASSERT_FALSE(std::isnan(v)) << what << ": KV missing";
    EXPECT_LE(MaxRelativeError(got, ref.kv), 1e-6) << what;
    std::vector<int> counts = out.WriteCounts(id, layers, n);
    EXPECT_TRUE(
        std::all_of(counts.begin(), counts.end(), [](int c) { return c == 1; }))
        << what << ": every (layer, position) is sent exactly once";
  }

  static model::WeightSource* weights_;
  static std::vector<Reference>* references_;
};

model::WeightSource* PrefillPipelineTest::weights_ = nullptr;
std::vector<Reference>* PrefillPipelineTest::references_ = nullptr;

std::vector<int> SplitFor(int stages, const model::ModelConfig& config) {
  auto split = AutoLayerSplit(EstimateLayerCosts(config, 64, 1), stages);
  EXPECT_TRUE(split.ok()) << split.status();
  return *split;
}

// Every golden prompt under every chunk policy, all interleaved in one group
// per depth S, KV and first tokens against the single-process engine.
TEST_F(PrefillPipelineTest, EveryDepthChunkSizeAndPolicyMatchesTheEngine) {
  std::vector<ChunkPolicy> policies;
  for (auto kind : {ChunkPolicyKind::kFixed, ChunkPolicyKind::kEqualCost}) {
    for (int chunk : {1, 7, 64, 0})
      policies.push_back(ChunkPolicy{kind, chunk});
  }
  for (int stages = 1; stages <= 5; ++stages) {
    std::vector<int> split = SplitFor(stages, weights_->config());
    CapturingKvOutput kv_out;
    auto group = MakeGroup(split, &kv_out);
    ASSERT_NE(group, nullptr);
    struct Submitted {
      std::shared_ptr<PrefillTicket> ticket;
      size_t ref;
      std::string what;
    };
    std::vector<Submitted> submitted;
    uint64_t id = 1;
    for (const ChunkPolicy& policy : policies) {
      for (size_t r = 0; r < references_->size(); ++r) {
        PrefillRequest request;
        request.request_id = id++;
        request.prompt = (*references_)[r].prompt;
        request.chunk_policy = policy;
        auto ticket = group->Submit(std::move(request));
        ASSERT_TRUE(ticket.ok()) << ticket.status();
        submitted.push_back(
            {*ticket, r,
             absl::StrCat("S=", stages, " policy ", policy.DebugString(),
                          " prompt ", r)});
      }
    }
    for (const Submitted& s : submitted) {
      auto outcome = s.ticket->Wait(absl::Seconds(60));
      ASSERT_TRUE(outcome.ok()) << s.what << ": " << outcome.status();
      const Reference& ref = (*references_)[s.ref];
      EXPECT_EQ(outcome->first_token.token, ref.golden_first) << s.what;
      EXPECT_EQ(outcome->cached_tokens, 0) << s.what;
      ExpectKvMatches(kv_out, s.ticket->request_id(), ref, s.what);
    }
    // Chunks of several requests shared microbatches.
    StageStats first = group->stage(0).stats();
    EXPECT_GT(first.chunks, first.microbatches) << "S=" << stages;
    EXPECT_EQ(group->coordinator().stats().used_blocks, 0) << "S=" << stages;
    EXPECT_EQ(group->coordinator().stats().completed,
              static_cast<int64_t>(submitted.size()));
  }
}

TEST_F(PrefillPipelineTest, ExplicitSplitsAndSeededSamplingOfTheFirstToken) {
  const Reference& ref = references_->back();
  for (const std::vector<int>& split :
       std::vector<std::vector<int>>{{1, 4}, {4, 1}, {2, 2, 1}, {1, 3, 1}}) {
    CapturingKvOutput kv_out;
    auto group = MakeGroup(split, &kv_out, false, 64, 48,
                           ChunkPolicy{ChunkPolicyKind::kEqualCost, 40});
    ASSERT_NE(group, nullptr);
    for (uint64_t seed : {1u, 7u, 12345u}) {
      PrefillRequest request;
      request.request_id = seed;
      request.prompt = ref.prompt;
      request.sampling.temperature = 0.9f;
      request.sampling.top_p = 0.95f;
      request.sampling.seed = seed;
      request.top_logprobs = static_cast<int>(seed % 5);
      auto ticket = group->Submit(request);
      ASSERT_TRUE(ticket.ok()) << ticket.status();
      auto outcome = (*ticket)->Wait(absl::Seconds(60));
      ASSERT_TRUE(outcome.ok()) << outcome.status();
      // The same counter-based draw the single-process engine makes.
      engine::SampledToken expected = engine::Sample(
          ref.last_logits, request.sampling, 0, request.top_logprobs);
      EXPECT_EQ(outcome->first_token.token, expected.token) << "seed " << seed;
      EXPECT_NEAR(outcome->first_token.logprob, expected.logprob, 1e-4);
      ASSERT_EQ(outcome->first_token.top.size(), expected.top.size());
      for (size_t k = 0; k < expected.top.size(); ++k) {
        EXPECT_EQ(outcome->first_token.top[k].token, expected.top[k].token);
        EXPECT_NEAR(outcome->first_token.top[k].logprob,
                    expected.top[k].logprob, 1e-4);
      }
      ExpectKvMatches(kv_out, seed, ref, absl::StrCat("seed ", seed));
    }
  }
}

// The last stage sees only its chunk's tokens, yet a repetition penalty
// covers the whole prompt: the first token equals the single-process draw
// with the full prompt as history (and differs from plain greedy, so the
// penalty took effect), for splits whose last stage gets a short final chunk.
TEST_F(PrefillPipelineTest,
       FirstTokenAppliesTheLogitProcessorsToTheWholePrompt) {
  const Reference& ref = references_->back();
  // A token of the prompt's start that its last 100 tokens (more than any
  // final chunk here) do not hold, biased to be the arg-max by 1: the
  // repetition penalty (positive logits / 10) must then take it down.
  const std::vector<float>& logits = ref.last_logits;
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  int32_t early = -1;
  for (size_t i = 1; i < 20 && early < 0; ++i) {
    const int32_t t = ref.prompt[i];
    if (std::find(ref.prompt.end() - 100, ref.prompt.end(), t) ==
            ref.prompt.end() &&
        max_logit - logits[t] < 50) {
      early = t;
    }
  }
  ASSERT_GE(early, 0);
  engine::SamplingParams greedy_penalized;
  greedy_penalized.repetition_penalty = 10.0f;
  greedy_penalized.logit_bias = {{early, max_logit - logits[early] + 1.0f}};
  const std::vector<int32_t> end_tokens = weights_->config().EndTokenIds();
  const int32_t expected = engine::DrawToken(logits, greedy_penalized, 0,
                                             {ref.prompt, {}, end_tokens});
  // Only the final chunk's tokens as history would keep `early`.
  const std::vector<int32_t> tail(ref.prompt.end() - 100, ref.prompt.end());
  ASSERT_EQ(
      engine::DrawToken(logits, greedy_penalized, 0, {tail, {}, end_tokens}),
      early);
  ASSERT_NE(expected, early);
  for (const std::vector<int>& split :
       std::vector<std::vector<int>>{{2, 2, 1}, {1, 4}}) {
    CapturingKvOutput kv_out;
    auto group = MakeGroup(split, &kv_out, false, 64, 48,
                           ChunkPolicy{ChunkPolicyKind::kEqualCost, 40});
    ASSERT_NE(group, nullptr);
    PrefillRequest request;
    request.request_id = 1;
    request.prompt = ref.prompt;
    request.sampling = greedy_penalized;
    auto ticket = group->Submit(request);
    ASSERT_TRUE(ticket.ok()) << ticket.status();
    auto outcome = (*ticket)->Wait(absl::Seconds(60));
    ASSERT_TRUE(outcome.ok()) << outcome.status();
    EXPECT_EQ(outcome->first_token.token, expected);
  }
}

TEST_F(PrefillPipelineTest, PrefixReuseSkipsComputeButStillSendsTheKv) {
  const Reference& ref = references_->back();  // 261 tokens
  CapturingKvOutput kv_out;
  auto group = MakeGroup({2, 2, 1}, &kv_out, /*prefix_reuse=*/true, 64, 64,
                         ChunkPolicy{ChunkPolicyKind::kFixed, 64});
  ASSERT_NE(group, nullptr);
  auto run = [&](uint64_t id, const std::vector<int32_t>& prompt) {
    PrefillRequest request;
    request.request_id = id;
    request.prompt = prompt;
    auto ticket = group->Submit(request);
    EXPECT_TRUE(ticket.ok()) << ticket.status();
    auto outcome = (*ticket)->Wait(absl::Seconds(60));
    EXPECT_TRUE(outcome.ok()) << outcome.status();
    return outcome.ok() ? *outcome : PrefillOutcome{};
  };
  PrefillOutcome first = run(1, ref.prompt);
  EXPECT_EQ(first.cached_tokens, 0);
  const int64_t tokens_after_first = group->stage(0).stats().tokens;
  EXPECT_EQ(tokens_after_first, static_cast<int64_t>(ref.prompt.size()));

  // The same prompt again: 16 full blocks (256 tokens) come from the cache,
  // only the last 5 tokens are computed, and all 261 positions are sent.
  PrefillOutcome again = run(2, ref.prompt);
  EXPECT_EQ(again.cached_tokens, 256);
  EXPECT_EQ(again.first_token.token, ref.golden_first);
  EXPECT_EQ(group->stage(0).stats().tokens - tokens_after_first, 5);
  ExpectKvMatches(kv_out, 2, ref, "reused prefix");
  EXPECT_EQ(group->coordinator().stats().used_blocks, 0);
  EXPECT_GT(group->coordinator().block_manager().cached_blocks(), 0);

  // A prompt sharing only the first 100 tokens reuses 6 blocks (96 tokens)
  // and its KV equals the engine's for the new prompt.
  std::vector<int32_t> other(ref.prompt.begin(), ref.prompt.begin() + 100);
  other.insert(other.end(), references_->front().prompt.begin(),
               references_->front().prompt.end());
  PrefillOutcome shared = run(3, other);
  EXPECT_EQ(shared.cached_tokens, 96);
  auto full = engine::testing_util::MakeEngine(*weights_, {}, nullptr, 1);
  auto pool = engine::testing_util::MakePool(*full, kBlockSize, 8);
  auto table = engine::testing_util::IdentityBlockTable(8);
  auto logits =
      engine::testing_util::PrefillAllLogits(*full, *pool, other, table);
  Reference other_ref;
  other_ref.prompt = other;
  other_ref.kv = ExtractKv(*pool, static_cast<int>(other.size()));
  ExpectKvMatches(kv_out, 3, other_ref, "shared prefix");
  EXPECT_EQ(shared.first_token.token, engine::ArgMax(logits.back()));
}

// Prompt scoring: log p(prompt token k | tokens before it) from the last
// stage equals the single-process engine's at every depth and chunk size,
// mixed into microbatches with plain requests; the prefix cache is bypassed
// (a repeated prompt is scored in full) while plain requests still use it; a
// request without a KV destination writes nothing.
TEST_F(PrefillPipelineTest, PromptLogprobsMatchTheEngineAtEveryDepthAndChunk) {
  const std::vector<size_t> refs = {0, references_->size() - 1};
  for (int stages : {1, 2, 3, 5}) {
    for (ChunkPolicy policy : {ChunkPolicy{ChunkPolicyKind::kFixed, 1},
                               ChunkPolicy{ChunkPolicyKind::kFixed, 7},
                               ChunkPolicy{ChunkPolicyKind::kEqualCost, 64}}) {
      const std::string layout =
          absl::StrCat("S=", stages, " ", policy.DebugString());
      CapturingKvOutput kv_out;
      auto group = MakeGroup(SplitFor(stages, weights_->config()), &kv_out,
                             /*prefix_reuse=*/true, 256, 48, policy);
      ASSERT_NE(group, nullptr);
      struct Submitted {
        std::shared_ptr<PrefillTicket> ticket;
        size_t ref;
        bool scored, writes_kv;
        int top_n;
      };
      std::vector<Submitted> submitted;
      uint64_t id = 1;
      // Each prompt: plain (fills the prefix cache), scored with and without
      // alternatives, scored without a destination, plain again (hits it).
      for (size_t r : refs) {
        for (int variant = 0; variant < 5; ++variant) {
          PrefillRequest request;
          request.request_id = id++;
          request.prompt = (*references_)[r].prompt;
          request.prompt_logprobs = variant >= 1 && variant <= 3;
          request.top_logprobs = variant == 2 ? 3 : 0;
          request.write_kv = variant != 3;
          auto ticket = group->Submit(request);
          ASSERT_TRUE(ticket.ok()) << ticket.status();
          submitted.push_back({*ticket, r, request.prompt_logprobs,
                               request.write_kv, request.top_logprobs});
          // The plain one finishes first, so the others could reuse it.
          if (variant == 0) {
            ASSERT_TRUE((*ticket)->Wait(absl::Seconds(60)).ok());
          }
        }
      }
      for (const Submitted& s : submitted) {
        const uint64_t rid = s.ticket->request_id();
        const std::string what = absl::StrCat(layout, " request ", rid);
        auto outcome = s.ticket->Wait(absl::Seconds(60));
        ASSERT_TRUE(outcome.ok()) << what << ": " << outcome.status();
        const Reference& ref = (*references_)[s.ref];
        EXPECT_EQ(outcome->first_token.token, ref.golden_first) << what;
        const int n = static_cast<int>(ref.prompt.size());
        const int layers = weights_->config().num_layers;
        if (!s.writes_kv) {
          std::vector<int> counts = kv_out.WriteCounts(rid, layers, n);
          EXPECT_TRUE(std::all_of(counts.begin(), counts.end(),
                                  [](int c) { return c == 0; }))
              << what << ": a request without destination sent KV";
        } else {
          ExpectKvMatches(kv_out, rid, ref, what);
        }
        if (!s.scored) {
          EXPECT_TRUE(outcome->prompt_logprobs.empty()) << what;
          continue;
        }
        EXPECT_EQ(outcome->cached_tokens, 0) << what << ": cache bypassed";
        ASSERT_EQ(outcome->prompt_logprobs.size(), static_cast<size_t>(n - 1))
            << what;
        for (int k = 1; k < n; ++k) {
          const engine::TokenLogprobs expected = engine::ComputeTokenLogprobs(
              ref.all_logits[k - 1], ref.prompt[k], s.top_n);
          const engine::TokenLogprobs& got = outcome->prompt_logprobs[k - 1];
          ASSERT_NEAR(got.logprob, expected.logprob, 1e-4)
              << what << " prompt token " << k;
          ASSERT_EQ(got.top.size(), expected.top.size()) << what;
          for (size_t t = 0; t < expected.top.size(); ++t) {
            EXPECT_EQ(got.top[t].token, expected.top[t].token) << what;
            EXPECT_NEAR(got.top[t].logprob, expected.top[t].logprob, 1e-4);
          }
        }
      }
      // The last plain request of each prompt reused the cache.
      EXPECT_GT(group->coordinator().stats().cached_tokens, 0) << layout;
      EXPECT_EQ(group->coordinator().stats().used_blocks, 0) << layout;
    }
  }
}

TEST_F(PrefillPipelineTest, StagesWorkOnDifferentMicrobatchesAtOnce) {
  // From recorded stage intervals, not wall-clock speed: with many queued
  // chunks, some microbatch of stage i runs while stage j runs another.
  // Overlap needs two stage threads on cores at once, which a 2-core machine
  // running other tests beside this one may not grant for a whole run: a
  // pipeline that overlaps does so in one of a few attempts; one that
  // serializes its stages never does.
  int overlaps = 0;
  for (int attempt = 0; attempt < 5 && overlaps == 0; ++attempt) {
    CapturingKvOutput kv_out;
    auto group = MakeGroup({2, 2, 1}, &kv_out, false, 1024, 16,
                           ChunkPolicy{ChunkPolicyKind::kFixed, 16});
    ASSERT_NE(group, nullptr);
    std::vector<std::shared_ptr<PrefillTicket>> tickets;
    for (uint64_t id = 1; id <= 6; ++id) {
      PrefillRequest request;
      request.request_id = id;
      request.prompt = (*references_)[4 + id % 2].prompt;
      auto ticket = group->Submit(request);
      ASSERT_TRUE(ticket.ok());
      tickets.push_back(*ticket);
    }
    for (auto& t : tickets) ASSERT_TRUE(t->Wait(absl::Seconds(60)).ok());
    for (int a = 0; a < group->num_stages(); ++a) {
      for (int b = a + 1; b < group->num_stages(); ++b) {
        for (const auto& x : group->stage(a).BusyIntervalsForTest()) {
          for (const auto& y : group->stage(b).BusyIntervalsForTest()) {
            if (x.first < y.second && y.first < x.second) ++overlaps;
          }
        }
      }
    }
  }
  EXPECT_GT(overlaps, 0);
}

TEST_F(PrefillPipelineTest, CancelAndBlockWaitReleaseEverything) {
  const Reference& ref = references_->back();
  CapturingKvOutput kv_out;
  // 20 blocks: one 261-token prompt (17 blocks) at a time.
  auto group = MakeGroup({3, 2}, &kv_out, false, 20, 8,
                         ChunkPolicy{ChunkPolicyKind::kFixed, 1});
  ASSERT_NE(group, nullptr);
  PrefillRequest a;
  a.request_id = 1;
  a.prompt = ref.prompt;
  PrefillRequest b = a;
  b.request_id = 2;
  PrefillRequest c = a;
  c.request_id = 3;
  auto ta = group->Submit(a);
  auto tb = group->Submit(b);  // waits for a's blocks
  auto tc = group->Submit(c);  // waits too; cancelled while waiting
  ASSERT_TRUE(ta.ok() && tb.ok() && tc.ok());
  ASSERT_TRUE(group->Cancel(3).ok());
  ASSERT_TRUE(group->Cancel(1).ok());  // mid-prefill (chunks of 1 token)
  auto ra = (*ta)->Wait(absl::Seconds(60));
  auto rc = (*tc)->Wait(absl::Seconds(60));
  EXPECT_EQ(ra.status().code(), absl::StatusCode::kCancelled) << ra.status();
  EXPECT_EQ(rc.status().code(), absl::StatusCode::kCancelled) << rc.status();
  auto rb = (*tb)->Wait(absl::Seconds(60));
  ASSERT_TRUE(rb.ok()) << rb.status();
  EXPECT_EQ(rb->first_token.token, ref.golden_first);
  ExpectKvMatches(kv_out, 2, ref, "after a cancel");
  EXPECT_EQ(group->coordinator().stats().used_blocks, 0);
  EXPECT_EQ(group->Cancel(2).code(), absl::StatusCode::kNotFound);
  // No stage keeps write bookkeeping of the cancelled request (whose final
  // chunk never came) once its writes in flight settled.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  for (int s = 0; s < group->num_stages(); ++s) {
    while (group->stage(s).open_write_entries() != 0 &&
           absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    EXPECT_EQ(group->stage(s).open_write_entries(), 0u) << "stage " << s;
  }
}

}  // namespace
}  // namespace pdserve::prefill
