// Sampling through the decode worker: fixed seeds reproduce, and speculative
// sampling keeps the target's exact distribution (the joint of the first two
// output tokens, the second drawn through a draft-model verify), while an
// accept-everything verifier is caught by the same test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <span>

#include "decode_test_util.h"
#include "engine/llama_engine.h"
#include "engine/sampler.h"
#include "kv/kv_pool.h"
#include "testing/chi_square.h"

namespace pdserve::decode {
namespace {

using testing_util::AllGoldenCases;
using testing_util::ExpectNoLeak;
using testing_util::MakeWorker;
using testing_util::Options;
using testing_util::Stories;
using testing_util::Stream;

RequestParams Sampled(uint64_t seed, int max_new_tokens) {
  RequestParams p;
  p.max_new_tokens = max_new_tokens;
  p.sampling.temperature = 0.9f;
  p.sampling.top_p = 0.95f;
  p.sampling.seed = seed;
  return p;
}

std::vector<std::vector<int32_t>> RunSeeds(int tp, SpeculationMode mode,
                                           const std::vector<uint64_t>& seeds) {
  auto worker = MakeWorker(Options(tp, mode));
  auto golden = AllGoldenCases()[1];
  std::vector<Stream> streams(seeds.size());
  for (size_t i = 0; i < seeds.size(); ++i)
    EXPECT_TRUE(worker
                    ->Submit(i, golden.prompt_ids, Sampled(seeds[i], 32),
                             streams[i].Callback())
                    .ok());
  std::vector<std::vector<int32_t>> out;
  for (auto& s : streams) {
    EXPECT_TRUE(s.Wait());
    out.push_back(s.tokens());
  }
  ExpectNoLeak(*worker);
  return out;
}

TEST(SamplingTest, FixedSeedReproducesAcrossRunsAndTpDegrees) {
  const std::vector<uint64_t> seeds = {1, 2, 3, 1};
  for (auto mode : {SpeculationMode::kOff, SpeculationMode::kNgram,
                    SpeculationMode::kDraft}) {
    auto a = RunSeeds(1, mode, seeds);
    auto b = RunSeeds(1, mode, seeds);
    auto c = RunSeeds(2, mode, seeds);
    EXPECT_EQ(a, b);
    EXPECT_EQ(a, c);
    EXPECT_EQ(a[0], a[3]);  // same seed, same request content
    EXPECT_NE(a[0], a[1]);
  }
}

// Greedy decoding under penalties and a logit bias: the processed arg-max
// chain is the same with speculation off, n-gram and draft, and at TP 1 and
// 2; it is not plain greedy's, and a frequency penalty cuts repeats.
TEST(SamplingTest, GreedyWithPenaltiesIsLayoutIndependentAndTakesEffect) {
  auto golden = AllGoldenCases()[1];
  auto run = [&](int tp, SpeculationMode mode, const RequestParams& params) {
    auto worker = MakeWorker(Options(tp, mode));
    Stream s;
    EXPECT_TRUE(
        worker->Submit(1, golden.prompt_ids, params, s.Callback()).ok());
    EXPECT_TRUE(s.Wait());
    ExpectNoLeak(*worker);
    return s.tokens();
  };
  RequestParams plain;
  plain.max_new_tokens = 48;
  RequestParams penalized = plain;
  penalized.sampling.frequency_penalty = 1.0f;
  penalized.sampling.presence_penalty = 0.5f;
  penalized.sampling.repetition_penalty = 1.2f;
  penalized.sampling.logit_bias = {{golden.prompt_ids[1], 1.5f}};
  const std::vector<int32_t> want = run(1, SpeculationMode::kOff, penalized);
  for (auto mode : {SpeculationMode::kNgram, SpeculationMode::kDraft}) {
    for (int tp : {1, 2}) EXPECT_EQ(run(tp, mode, penalized), want);
  }
  const std::vector<int32_t> greedy = run(1, SpeculationMode::kOff, plain);
  EXPECT_NE(greedy, want);
  auto repeats = [](const std::vector<int32_t>& t) {
    std::map<int32_t, int> count;
    int r = 0;
    for (int32_t x : t) r += count[x]++ > 0;
    return r;
  };
  EXPECT_LT(repeats(want), repeats(greedy));
  // A bias of +100 makes a token the greedy choice at every step.
  RequestParams forced = plain;
  forced.max_new_tokens = 8;
  forced.sampling.logit_bias = {{42, 100.0f}};
  EXPECT_EQ(run(1, SpeculationMode::kNgram, forced),
            std::vector<int32_t>(8, 42));
}

// min_tokens holds back EOS: with EOS biased to certainty a request ends at
// once, and with min_tokens = 10 it ends exactly after 10 more tokens (EOS
// is the greedy choice as soon as it is allowed).
TEST(SamplingTest, MinTokensHoldsBackEos) {
  auto golden = AllGoldenCases()[1];
  const int32_t eos = Stories().weights->config().eos_token_id;
  for (auto mode : {SpeculationMode::kOff, SpeculationMode::kNgram}) {
    auto worker = MakeWorker(Options(1, mode));
    RequestParams params;
    params.max_new_tokens = 40;
    params.sampling.logit_bias = {{eos, 100.0f}};
    Stream plain;
    ASSERT_TRUE(
        worker->Submit(1, golden.prompt_ids, params, plain.Callback()).ok());
    ASSERT_TRUE(plain.Wait());
    EXPECT_EQ(plain.tokens(), std::vector<int32_t>{eos});
    params.sampling.min_tokens = 10;
    Stream held;
    ASSERT_TRUE(
        worker->Submit(2, golden.prompt_ids, params, held.Callback()).ok());
    ASSERT_TRUE(held.Wait());
    ASSERT_EQ(held.tokens().size(), 11u);
    EXPECT_EQ(held.tokens().back(), eos);
    for (size_t i = 0; i + 1 < held.tokens().size(); ++i) {
      EXPECT_NE(held.tokens()[i], eos);
    }
    ExpectNoLeak(*worker);
  }
}

// Exact target probabilities: p(t0 | prompt) and p(t1 | prompt, t0), through
// the logit processors of `params` (tokens after the first prompt_len are the
// output).
class ExactTarget {
 public:
  ExactTarget(const engine::SamplingParams& params, size_t prompt_len)
      : params_(params), prompt_len_(prompt_len) {
    engine::EngineOptions eo;
    eo.num_threads = 1;
    engine_ =
        std::move(engine::LlamaEngine::Create(*Stories().weights, eo)).value();
    pool_ = std::move(kv::KvPool::Create(engine_->KvLayout(16), 4)).value();
  }
  std::vector<float> Next(const std::vector<int32_t>& tokens) {
    std::vector<int32_t> table = {0, 1, 2, 3};
    engine::ForwardBatch batch;
    engine::SequenceStep step;
    step.tokens = tokens;
    step.num_tokens = static_cast<int>(tokens.size());
    step.block_table = table;
    step.logit_indices = {step.num_tokens - 1};
    batch.sequences.push_back(step);
    engine::ForwardResult result;
    EXPECT_TRUE(engine_->Forward(batch, *pool_, &result).ok());
    std::vector<float> p;
    const std::span<const int32_t> history(tokens);
    const std::vector<int32_t> end_tokens = engine_->config().EndTokenIds();
    engine::ProcessedDistribution(
        result.logits, params_,
        {history.first(prompt_len_), history.subspan(prompt_len_), end_tokens},
        tokens.size() - prompt_len_, &p);
    return p;
  }

 private:
  engine::SamplingParams params_;
  size_t prompt_len_;
  std::unique_ptr<engine::LlamaEngine> engine_;
  std::unique_ptr<kv::KvPool> pool_;
};

// Chi-square of the joint (t0, t1) counts against p(t0)·p(t1|t0), bins with
// expected count < 5 pooled; returned as statistic / critical value at
// z = 4 (p ~ 3e-5, Wilson–Hilferty), so < 1 passes.
double JointChiSquareRatio(
    const std::map<std::pair<int32_t, int32_t>, int>& counts,
    const std::vector<int32_t>& prompt, const engine::SamplingParams& params,
    int n) {
  ExactTarget target(params, prompt.size());
  std::vector<float> p0 = target.Next(prompt);
  double stat = 0, pooled_e = 0, pooled_o = 0;
  int bins = 0;
  std::map<std::pair<int32_t, int32_t>, bool> seen;
  for (int32_t t0 = 0; t0 < static_cast<int32_t>(p0.size()); ++t0) {
    if (p0[t0] <= 0) continue;
    int observed_t0 = 0;
    for (const auto& [k, c] : counts)
      if (k.first == t0) observed_t0 += c;
    if (p0[t0] * n < 5) {
      pooled_e += p0[t0] * n;
      pooled_o += observed_t0;
      continue;
    }
    std::vector<int32_t> h = prompt;
    h.push_back(t0);
    std::vector<float> p1 = target.Next(h);
    for (int32_t t1 = 0; t1 < static_cast<int32_t>(p1.size()); ++t1) {
      const double e = double{p0[t0]} * p1[t1] * n;
      auto it = counts.find({t0, t1});
      const double o = it == counts.end() ? 0 : it->second;
      if (e < 5) {
        pooled_e += e;
        pooled_o += o;
        continue;
      }
      stat += (o - e) * (o - e) / e;
      ++bins;
    }
  }
  stat +=
      (pooled_o - pooled_e) * (pooled_o - pooled_e) / std::max(pooled_e, 1.0);
  ++bins;
  return stat / pdserve::testing::ChiSquareCritical(bins - 1);
}

std::map<std::pair<int32_t, int32_t>, int> SampleFirstTwo(
    bool accept_all, const std::vector<int32_t>& prompt,
    const engine::SamplingParams& params, int n, LoadReport* load) {
  auto options = Options(1, SpeculationMode::kDraft);
  options.max_running = 256;
  options.num_blocks = 600;
  options.speculation.draft_kv_blocks = 600;
  options.speculation.max_batch = 1 << 20;  // always speculate here
  options.speculation.max_gamma = 2;
  auto worker = MakeWorker(options);
  worker->SetAcceptAllDraftsForTest(accept_all);
  std::vector<Stream> streams(n);
  for (int i = 0; i < n; ++i) {
    RequestParams p;
    p.sampling = params;
    p.sampling.seed = 1000 + i;
    // Three tokens: token 1 is verified against a one-token draft.
    p.max_new_tokens = 3;
    EXPECT_TRUE(worker->Submit(i, prompt, p, streams[i].Callback()).ok());
  }
  std::map<std::pair<int32_t, int32_t>, int> counts;
  for (auto& s : streams) {
    EXPECT_TRUE(s.Wait());
    auto t = s.tokens();
    EXPECT_GE(t.size(), 2u);
    if (t.size() >= 2) ++counts[{t[0], t[1]}];
  }
  *load = worker->Load();
  ExpectNoLeak(*worker);
  return counts;
}

TEST(SpeculativeSamplingTest, FirstTokensFollowTargetExactlyBiasedFails) {
  const int n = 3000;
  engine::SamplingParams params;
  params.temperature = 1.0f;
  auto prompt = AllGoldenCases()[0].prompt_ids;
  LoadReport load;
  auto counts = SampleFirstTwo(false, prompt, params, n, &load);
  // Most requests drafted token 1 (the adaptive γ starts at 1 here).
  EXPECT_GT(load.spec_steps, n / 2);
  EXPECT_GT(load.accepted_tokens, 0);
  EXPECT_LT(load.accepted_tokens, load.drafted_tokens);  // some rejected
  EXPECT_LT(JointChiSquareRatio(counts, prompt, params, n), 1.0);
  auto biased = SampleFirstTwo(true, prompt, params, n, &load);
  EXPECT_GT(JointChiSquareRatio(biased, prompt, params, n), 1.0);
}

// The same joint check with every logit processor on: token 1's
// distribution depends on token 0 through the penalties, and the draft
// model's verify must apply them with token 0 (and the draft) in the history.
// Checked against the unprocessed target too, so a worker that dropped the
// controls would fail.
TEST(SpeculativeSamplingTest, LogitProcessorsKeepTheTargetExactly) {
  const int n = 3000;
  engine::SamplingParams params;
  params.temperature = 1.0f;
  params.min_p = 0.01f;
  params.presence_penalty = 0.8f;
  params.frequency_penalty = 0.6f;
  params.repetition_penalty = 1.4f;
  params.min_tokens = 2;
  auto prompt = AllGoldenCases()[0].prompt_ids;
  // Favour a token the prompt holds, so the penalties have mass to move.
  params.logit_bias = {{prompt[2], 2.5f}};
  LoadReport load;
  auto counts = SampleFirstTwo(false, prompt, params, n, &load);
  EXPECT_GT(load.spec_steps, n / 2);
  EXPECT_GT(load.accepted_tokens, 0);
  EXPECT_LT(JointChiSquareRatio(counts, prompt, params, n), 1.0);
  engine::SamplingParams plain;
  plain.temperature = 1.0f;
  EXPECT_GT(JointChiSquareRatio(counts, prompt, plain, n), 1.0);
}

}  // namespace
}  // namespace pdserve::decode
