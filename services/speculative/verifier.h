// SpeculativeVerifier: turns the target's logits at γ+1 positions into the
// tokens a step emits, keeping the output distribution exactly the target's.
//
// Row i of `logits` is the target's prediction after the history and drafts
// d_1..d_i (row 0: after the history alone). With output index k of the
// first draft:
//   greedy   — emit d_1..d_a while d_i == argmax(row i-1), then argmax of
//              row a (the correction, or the bonus token when all agree);
//   sampling — standard rejection sampling (Leviathan et al. / Chen et al.):
//              p_i = ProcessedDistribution(row i-1) with the output
//              history extended by d_1..d_{i-1}, q_i the draft's
//              distribution (one-hot for a deterministic proposer). Accept
//              d_i iff u < min(1, p_i(d_i) / q_i(d_i)) with
//              u = UniformForRequest(seed, k+i-1, kAcceptStream); on the
//              first reject emit a draw from normalize(max(0, p_i − q_i))
//              (kResidualStream) and stop; if all γ are accepted emit the
//              bonus token sampled from row γ exactly as engine::Sample would
//              (stream 0).
// Every draw is counter-based, so a fixed seed reproduces the same tokens.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/sampler.h"

namespace pdserve::speculative {

struct VerifyOutcome {
  std::vector<int32_t> tokens;  // accepted drafts + one target token
  int accepted_drafts = 0;
};

struct VerifyOptions {
  // Test-only: accept every draft (a deliberately biased verifier, for the
  // negative statistical check).
  bool accept_all_for_test = false;
};

// `logits` holds draft.size()+1 rows of `vocab` floats; `draft_probs` is
// empty (deterministic proposer) or one row of `vocab` per draft token.
// `history` is the request's before the first draft (its output holds the
// first_output_index generated tokens); row i's logit processors see that
// output followed by drafts 1..i, as they would have without speculation.
// With a `constraint` (structured output) every row is masked by it, row i
// in the state after drafts 1..i, after the logit processors: a draft the
// grammar forbids has p = 0 and is rejected, and the output distribution is
// the masked target's. The constraint is left as it was (the caller Accepts
// the emitted tokens); a row with no allowed token is FAILED_PRECONDITION.
// INVALID_ARGUMENT on inconsistent sizes or a draft token outside the vocab.
[[nodiscard]] absl::StatusOr<VerifyOutcome> VerifyDraft(
    std::span<const float> logits, int vocab, std::span<const int32_t> draft,
    std::span<const std::vector<float>> draft_probs,
    const engine::SamplingParams& params, uint64_t first_output_index,
    const VerifyOptions& options = {},
    const engine::SamplingHistory& history = {},
    engine::TokenConstraint* constraint = nullptr);

// The greedy case of VerifyDraft from each row's argmax alone (what a GPU
// engine returns without copying logits): drafts are accepted while they
// equal the argmax of their row, then the first mismatch's argmax (or the
// bonus row's, when every draft held) is appended. `argmax` holds
// draft.size()+1 entries. Identical to VerifyDraft for greedy params without
// logit processors (with them the raw arg-max is not the greedy choice).
[[nodiscard]] absl::StatusOr<VerifyOutcome> VerifyGreedyFromArgmax(
    std::span<const int32_t> argmax, std::span<const int32_t> draft);

}  // namespace pdserve::speculative
