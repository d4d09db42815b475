// When a bf16 engine's greedy output may differ from the fp32/float64
// reference, and when it may not (the criterion of vLLM's
// check_logprobs_close, with the tolerance measured, not guessed):
//
//   - the two sequences agree token for token up to the first position where
//     they differ (if they never differ: exact);
//   - there, each side's token is among the other side's top-5, and the
//     reference's margin between its token and the engine's is at most the
//     tolerance: the bf16 engine's measured logit error, times two (the
//     margin is a difference of two logits, each off by up to the error);
//   - the comparison stops at that position (the continuations condition on
//     different text from there on).
//
// So greedy equality stays required wherever every reference margin on the
// continuation exceeds the tolerance, and each flip is reported with its
// margin. Logprobs stand in for logits: a difference of two logprobs of one
// distribution is the difference of their logits.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/engine_test_util.h"
#include "engine/sampler.h"
#include "testing/golden.h"

namespace pdserve::engine::testing_util {

inline constexpr int kAgreementTopK = 5;

struct GreedyAgreement {
  bool pass = false;
  bool exact = false;
  int divergence = -1;  // first differing position, -1 when exact
  double reference_margin = 0;
  std::string report;  // empty when exact
};

// log p of `token` in `scores` (its own token or one of its top entries).
inline std::optional<double> LogprobOf(const TokenLogprobs& scores,
                                       int32_t token, int32_t own_token) {
  if (token == own_token) return scores.logprob;
  for (const TopLogprob& t : scores.top) {
    if (t.token == token) return t.logprob;
  }
  return std::nullopt;
}

inline bool InTopK(const TokenLogprobs& scores, int32_t token) {
  const size_t k = std::min<size_t>(kAgreementTopK, scores.top.size());
  for (size_t i = 0; i < k; ++i) {
    if (scores.top[i].token == token) return true;
  }
  return false;
}

// reference_scores[i] / candidate_scores[i]: the log-probabilities (with at
// least kAgreementTopK alternatives) of the distribution each side chose
// token i from. `tolerance` in logits.
inline GreedyAgreement CompareGreedyWithinBf16(
    std::span<const int32_t> reference,
    std::span<const TokenLogprobs> reference_scores,
    std::span<const int32_t> candidate,
    std::span<const TokenLogprobs> candidate_scores, double tolerance) {
  GreedyAgreement a;
  const size_t common = std::min(reference.size(), candidate.size());
  size_t i = 0;
  while (i < common && reference[i] == candidate[i]) ++i;
  if (i == common) {
    a.exact = reference.size() == candidate.size();
    a.pass = a.exact;
    if (!a.exact) {
      a.divergence = static_cast<int>(i);
      a.report =
          absl::StrCat("lengths differ: ", candidate.size(),
                       " tokens against the reference's ", reference.size());
    }
    return a;
  }
  a.divergence = static_cast<int>(i);
  if (i >= reference_scores.size() || i >= candidate_scores.size()) {
    a.report = absl::StrCat("flip at generated token ", i,
                            " and no scores there to judge it");
    return a;
  }
  const TokenLogprobs& ref = reference_scores[i];
  const TokenLogprobs& cand = candidate_scores[i];
  const std::optional<double> ref_of_cand =
      LogprobOf(ref, candidate[i], reference[i]);
  const bool cand_in_ref_top = InTopK(ref, candidate[i]);
  const bool ref_in_cand_top = InTopK(cand, reference[i]);
  a.reference_margin = ref_of_cand ? ref.logprob - *ref_of_cand
                                   : std::numeric_limits<double>::infinity();
  a.pass = cand_in_ref_top && ref_in_cand_top && ref_of_cand &&
           a.reference_margin <= tolerance;
  a.report = absl::StrFormat(
      "flip at generated token %d: reference %d, engine %d; reference margin "
      "%.4f (tolerance %.4f)%s%s -> %s",
      i, reference[i], candidate[i], a.reference_margin, tolerance,
      cand_in_ref_top ? "" : "; engine token not in the reference top-5",
      ref_in_cand_top ? "" : "; reference token not in the engine top-5",
      a.pass ? "within bf16 error" : "NOT explained by bf16 error");
  return a;
}

// The tolerance from a measured worst absolute logit error.
inline double Bf16MarginTolerance(double worst_abs_logit_error) {
  return 2.0 * worst_abs_logit_error;
}

// max |a - b| over every entry of two [position][vocab] logit tables.
inline double WorstAbsLogitError(const std::vector<std::vector<float>>& a,
                                 const std::vector<std::vector<float>>& b) {
  double worst = a.size() == b.size() ? 0.0 : INFINITY;
  for (size_t t = 0; t < std::min(a.size(), b.size()); ++t) {
    if (a[t].size() != b[t].size()) return INFINITY;
    for (size_t j = 0; j < a[t].size(); ++j) {
      worst = std::max(worst, std::abs(double{a[t][j]} - b[t][j]));
    }
  }
  return worst;
}

// The bf16 engine's measured logit error: the CUDA engine (with `cuda`)
// against the fp32 CPU engine at every position of golden_logits.json's
// prompt, in absolute logits. INFINITY when the engine cannot be made.
inline double MeasureCudaAbsLogitError(const model::WeightSource& weights,
                                       CudaOptions cuda = {}) {
  EngineOptions options;
  options.backend = Backend::kCuda;
  options.cuda = cuda;
  auto gpu = LlamaEngine::Create(weights, options);
  EXPECT_TRUE(gpu.ok()) << gpu.status();
  if (!gpu.ok()) return INFINITY;
  auto cpu = MakeEngine(weights);
  const std::vector<int32_t> prompt =
      ::pdserve::testing::LoadGoldenLogits().prompt_ids;
  const int blocks = static_cast<int>(prompt.size()) / 16 + 1;
  const std::vector<int32_t> table = IdentityBlockTable(blocks);
  auto gpu_pool = (*gpu)->CreateKvPool(16, blocks);
  EXPECT_TRUE(gpu_pool.ok()) << gpu_pool.status();
  if (!gpu_pool.ok()) return INFINITY;
  auto cpu_pool = MakePool(*cpu, 16, blocks);
  return WorstAbsLogitError(PrefillAllLogits(**gpu, **gpu_pool, prompt, table),
                            PrefillAllLogits(*cpu, *cpu_pool, prompt, table));
}

// Each token's log-probability with kAgreementTopK alternatives, from the
// logits that chose it.
inline std::vector<TokenLogprobs> ScoresOf(
    const std::vector<int32_t>& tokens,
    const std::vector<std::vector<float>>& logits) {
  std::vector<TokenLogprobs> scores;
  for (size_t i = 0; i < std::min(tokens.size(), logits.size()); ++i) {
    scores.push_back(
        ComputeTokenLogprobs(logits[i], tokens[i], kAgreementTopK));
  }
  return scores;
}

}  // namespace pdserve::engine::testing_util
