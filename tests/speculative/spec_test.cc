// Proposers, the lossless verifier (exact distribution checks, including a
// deliberately biased verifier that must fail them) and the adaptive γ.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>

#include "engine/sampler.h"
#include "model/weight_source.h"
#include "speculative/adaptive_gamma.h"
#include "speculative/draft_proposer.h"
#include "speculative/proposer.h"
#include "speculative/truncated_weights.h"
#include "speculative/verifier.h"
#include "testing/chi_square.h"
#include "testing/golden.h"

namespace pdserve::speculative {
namespace {

using pdserve::testing::ChiSquareRatio;

std::vector<float> RandomLogits(int vocab, uint64_t seed, float scale) {
  std::vector<float> l(vocab);
  for (int v = 0; v < vocab; ++v)
    l[v] = scale * static_cast<float>(engine::UniformForRequest(seed, v, 9));
  return l;
}

TEST(NgramProposerTest, ProposesWhatFollowedTheLatestMatch) {
  auto p = MakeNgramProposer({1, 3});
  std::vector<int32_t> h = {5, 1, 2, 3, 4, 9, 1, 2};
  ProposalRequest r;
  r.history = h;
  r.max_tokens = 3;
  std::vector<Proposal> out;
  ASSERT_TRUE(p->Propose({&r, 1}, &out).ok());
  EXPECT_EQ(out[0].tokens, (std::vector<int32_t>{3, 4, 9}));
  EXPECT_TRUE(out[0].probs.empty());
  std::vector<int32_t> none = {1, 2, 3};
  r.history = none;
  ASSERT_TRUE(p->Propose({&r, 1}, &out).ok());
  EXPECT_TRUE(out[0].tokens.empty());
}

TEST(VerifierTest, GreedyKeepsAgreeingPrefixPlusCorrection) {
  const int vocab = 6;
  // Row i's arg-max is argmaxes[i].
  std::vector<int32_t> argmaxes = {3, 1, 4, 2};
  std::vector<float> logits(argmaxes.size() * vocab, 0.0f);
  for (size_t i = 0; i < argmaxes.size(); ++i)
    logits[i * vocab + argmaxes[i]] = 5.0f;
  engine::SamplingParams greedy;
  auto all =
      VerifyDraft(logits, vocab, std::vector<int32_t>{3, 1, 4}, {}, greedy, 0);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->tokens, (std::vector<int32_t>{3, 1, 4, 2}));  // + bonus
  EXPECT_EQ(all->accepted_drafts, 3);
  auto some =
      VerifyDraft(logits, vocab, std::vector<int32_t>{3, 0, 4}, {}, greedy, 0);
  ASSERT_TRUE(some.ok());
  EXPECT_EQ(some->tokens, (std::vector<int32_t>{3, 1}));
  EXPECT_EQ(some->accepted_drafts, 1);
}

// The argmax-only greedy verify (GPU engines return argmaxes, not logits)
// agrees with VerifyDraft on random logits with ties and random drafts.
TEST(VerifierTest, GreedyFromArgmaxEqualsVerifyDraft) {
  const int vocab = 7;
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> small(0, 3), token(0, vocab - 1);
  engine::SamplingParams greedy;
  for (int trial = 0; trial < 500; ++trial) {
    const int gamma = trial % 5;
    std::vector<float> logits((gamma + 1) * vocab);
    for (float& v : logits) v = static_cast<float>(small(rng));  // many ties
    std::vector<int32_t> argmax(gamma + 1);
    for (int i = 0; i <= gamma; ++i) {
      const float* row = logits.data() + i * vocab;
      argmax[i] =
          static_cast<int32_t>(std::max_element(row, row + vocab) - row);
    }
    std::vector<int32_t> draft(gamma);
    for (int i = 0; i < gamma; ++i) {
      // Half the drafts agree, so long accepted runs occur.
      draft[i] = small(rng) < 2 ? argmax[i] : token(rng);
    }
    auto want = VerifyDraft(logits, vocab, draft, {}, greedy, trial);
    auto got = VerifyGreedyFromArgmax(argmax, draft);
    ASSERT_TRUE(want.ok() && got.ok());
    EXPECT_EQ(got->tokens, want->tokens) << "trial " << trial;
    EXPECT_EQ(got->accepted_drafts, want->accepted_drafts) << "trial " << trial;
  }
  EXPECT_EQ(VerifyGreedyFromArgmax(std::vector<int32_t>{1, 2},
                                   std::vector<int32_t>{1, 2})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(VerifierBadInputTest, RejectsInconsistentSizes) {
  std::vector<float> logits(10, 0.0f);
  engine::SamplingParams greedy;
  auto wrong_rows =
      VerifyDraft(logits, 5, std::vector<int32_t>{1, 2}, {}, greedy, 0);
  EXPECT_EQ(wrong_rows.status().code(), absl::StatusCode::kInvalidArgument);
  auto bad_token =
      VerifyDraft(logits, 5, std::vector<int32_t>{7}, {}, greedy, 0);
  EXPECT_EQ(bad_token.status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<std::vector<float>> probs(2, std::vector<float>(5, 0.2f));
  auto bad_probs =
      VerifyDraft(logits, 5, std::vector<int32_t>{1}, probs, greedy, 0);
  EXPECT_EQ(bad_probs.status().code(), absl::StatusCode::kInvalidArgument);
}

// The first emitted token of a sampling verify must follow the target's p
// exactly, whatever the draft distribution q, for a stochastic draft (q a
// different softmax) and a deterministic one (q one-hot on a likely token).
class RejectionSamplingTest : public ::testing::TestWithParam<bool> {};

TEST_P(RejectionSamplingTest, FirstTokenFollowsTargetAndAcceptAllDoesNot) {
  const bool deterministic = GetParam();
  const int vocab = 24, n = 20000;
  engine::SamplingParams params;
  params.temperature = 1.0f;
  std::vector<float> logits = RandomLogits(vocab, 1, 3.0f);
  std::vector<float> bonus = RandomLogits(vocab, 2, 3.0f);
  std::vector<float> both(logits);
  both.insert(both.end(), bonus.begin(), bonus.end());
  std::vector<float> p, q;
  engine::SamplingDistribution(logits, params, &p);
  engine::SamplingDistribution(RandomLogits(vocab, 3, 3.0f), params, &q);
  std::vector<double> expected(p.begin(), p.end());
  const int32_t fixed_draft = engine::ArgMax(logits);
  std::map<int, int> counts, biased;
  for (int seed = 0; seed < n; ++seed) {
    params.seed = seed;
    std::vector<int32_t> draft;
    std::vector<std::vector<float>> probs;
    if (deterministic) {
      draft = {fixed_draft};
    } else {
      draft = {engine::DrawFromDistribution(
          q, engine::UniformForRequest(seed, 0, kDraftStream))};
      probs = {q};
    }
    auto out = VerifyDraft(both, vocab, draft, probs, params, 0);
    ASSERT_TRUE(out.ok());
    ++counts[out->tokens[0]];
    VerifyOptions accept_all;
    accept_all.accept_all_for_test = true;
    auto bad = VerifyDraft(both, vocab, draft, probs, params, 0, accept_all);
    ASSERT_TRUE(bad.ok());
    ++biased[bad->tokens[0]];
  }
  EXPECT_LT(ChiSquareRatio(counts, expected, n), 1.0);
  EXPECT_GT(ChiSquareRatio(biased, expected, n), 1.0);
}

INSTANTIATE_TEST_SUITE_P(Drafts, RejectionSamplingTest, ::testing::Bool(),
                         [](const auto& info) {
                           return info.param ? "OneHot" : "Stochastic";
                         });

TEST(VerifierTest, FixedSeedReproducible) {
  const int vocab = 16;
  std::vector<float> logits = RandomLogits(vocab * 3, 4, 2.0f);
  engine::SamplingParams params;
  params.temperature = 0.8f;
  params.seed = 77;
  std::vector<int32_t> draft = {1, 2};
  auto a = VerifyDraft(logits, vocab, draft, {}, params, 5);
  auto b = VerifyDraft(logits, vocab, draft, {}, params, 5);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->tokens, b->tokens);
}

TEST(AdaptiveGammaTest, GrowsWithAcceptanceShrinksAndProbes) {
  AdaptiveGammaOptions o;
  o.max_gamma = 5;
  o.cost_per_draft_token = 0.1;
  AdaptiveGamma g(o);
  for (int i = 0; i < 20; ++i) g.Record(g.gamma() > 0 ? g.gamma() : 1, 5);
  EXPECT_EQ(g.gamma(), 5);
  for (int i = 0; i < 60; ++i) g.Record(5, 0);
  EXPECT_EQ(g.gamma(), 0);
  int probes = 0;
  for (int i = 0; i < 32; ++i) probes += g.NextGamma();
  EXPECT_EQ(probes, 2);  // probe_interval 16
}

TEST(TruncatedWeightsTest, RejectsBadLayerCounts) {
  auto weights = model::OpenModel(pdserve::testing::Stories260KGguf());
  ASSERT_TRUE(weights.ok());
  EXPECT_EQ(MakeLayerTruncatedWeights(**weights, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeLayerTruncatedWeights(**weights, 6).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto three = MakeLayerTruncatedWeights(**weights, 3);
  ASSERT_TRUE(three.ok());
  EXPECT_EQ((*three)->config().num_layers, 3);
}

// A Qwen target whose window covers some layers: the draft keeps the windows
// of the layers it keeps, in the config's one form (none windowed: no
// window; all: the empty list), and stays a valid config.
TEST(TruncatedWeightsTest, KeepsThePerLayerWindowsOfItsLayers) {
  auto stories = model::OpenModel(pdserve::testing::Stories260KGguf());
  ASSERT_TRUE(stories.ok());
  struct Windowed : model::WeightSource {
    const model::WeightSource* base = nullptr;
    model::ModelConfig c;
    const model::ModelConfig& config() const override { return c; }
    const std::string& description() const override {
      return base->description();
    }
    bool HasTensor(std::string_view n) const override {
      return base->HasTensor(n);
    }
    absl::StatusOr<model::TensorInfo> GetTensorInfo(
        std::string_view n) const override {
      return base->GetTensorInfo(n);
    }
    absl::Status ReadF32(std::string_view n, const model::Slice2D& s,
                         float* out) const override {
      return base->ReadF32(n, s, out);
    }
    absl::StatusOr<model::TokenizerSpec> tokenizer_spec() const override {
      return base->tokenizer_spec();
    }
  } windowed;
  windowed.base = stories->get();
  windowed.c = (*stories)->config();
  ASSERT_EQ(windowed.c.num_layers, 5);
  windowed.c.sliding_window = 8;
  windowed.c.windowed_layers = {false, true, true, false, true};
  struct Want {
    int layers;
    int window;
    std::vector<bool> windowed_layers;
  };
  for (const Want& want : {Want{1, 0, {}}, Want{3, 8, {false, true, true}},
                           Want{5, 8, {false, true, true, false, true}}}) {
    auto draft = MakeLayerTruncatedWeights(windowed, want.layers);
    ASSERT_TRUE(draft.ok()) << draft.status();
    const model::ModelConfig& c = (*draft)->config();
    EXPECT_TRUE(c.Validate().ok()) << c.Validate();
    EXPECT_EQ(c.sliding_window, want.window) << want.layers;
    EXPECT_EQ(c.windowed_layers, want.windowed_layers) << want.layers;
  }
  windowed.c.windowed_layers = {true, true, false, false, false};
  auto draft = MakeLayerTruncatedWeights(windowed, 2);
  ASSERT_TRUE(draft.ok()) << draft.status();
  EXPECT_EQ((*draft)->config().sliding_window, 8);
  EXPECT_TRUE((*draft)->config().windowed_layers.empty());
  EXPECT_EQ((*draft)->config().LayerWindow(1), 8);
}

// A draft proposer reused across diverging histories (rollback to the common
// prefix) proposes exactly what a fresh one does; the target as its own
// draft proposes the golden greedy continuation.
TEST(DraftProposerTest, RollbackMatchesFreshAndTargetDraftsGolden) {
  auto weights = model::OpenModel(pdserve::testing::Stories260KGguf());
  ASSERT_TRUE(weights.ok());
  DraftModelOptions o;
  o.num_blocks = 64;
  auto reused = MakeDraftModelProposer(**weights, o);
  ASSERT_TRUE(reused.ok()) << reused.status();
  auto golden = pdserve::testing::LoadGoldenCases()[0];
  std::vector<int32_t> h = golden.prompt_ids;
  ProposalRequest r;
  r.request_id = 7;
  r.max_tokens = 4;
  std::vector<Proposal> out;
  r.history = h;
  ASSERT_TRUE((*reused)->Propose({&r, 1}, &out).ok());
  EXPECT_EQ(out[0].tokens, std::vector<int32_t>(golden.greedy_ids.begin(),
                                                golden.greedy_ids.begin() + 4));
  // Accept two tokens plus a different third: the draft cache must roll back.
  h.insert(h.end(), golden.greedy_ids.begin(), golden.greedy_ids.begin() + 2);
  h.push_back(golden.greedy_ids[2] + 1);
  r.history = h;
  ASSERT_TRUE((*reused)->Propose({&r, 1}, &out).ok());
  auto fresh = MakeDraftModelProposer(**weights, o);
  ASSERT_TRUE(fresh.ok());
  std::vector<Proposal> fresh_out;
  ASSERT_TRUE((*fresh)->Propose({&r, 1}, &fresh_out).ok());
  EXPECT_EQ(out[0].tokens, fresh_out[0].tokens);
  EXPECT_EQ(out[0].tokens.size(), 4u);
}

}  // namespace
}  // namespace pdserve::speculative
