// The face of services/speculative: a Proposer guesses up to γ tokens that
// continue a request's accepted history; the target model then checks them all
// in one forward (verifier.h). Proposers never see rejected tokens as history:
// each call passes the full accepted history, so a stateful proposer (draft
// model) rolls its own state back to the common prefix itself.
//
// Thread-safety: a Proposer is driven by one scheduler thread; not
// thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "engine/sampler.h"

namespace pdserve::speculative {

// Streams of engine::UniformForRequest(seed, output_index, stream) the
// speculative path draws from. Stream 0 is the plain sampler's, so a step
// without drafts samples exactly as non-speculative decoding does.
inline constexpr uint64_t kAcceptStream = 1;    // accept/reject a draft
inline constexpr uint64_t kResidualStream = 2;  // resample after a reject
inline constexpr uint64_t kDraftStream = 3;     // the draft model's own draw

struct ProposalRequest {
  uint64_t request_id = 0;
  // Prompt + accepted output. Its last token is the one the target feeds next
  // (its KV is not in the target cache yet).
  std::span<const int32_t> history;
  int max_tokens = 0;  // γ for this step; 0 asks for nothing
  engine::SamplingParams sampling;
  // Output index the first proposed token would take (for counter-based
  // randomness of a sampling draft).
  uint64_t first_output_index = 0;
};

struct Proposal {
  std::vector<int32_t> tokens;  // at most max_tokens
  // The draft distribution q of each proposed token, [tokens][vocab]. Empty
  // when the proposal is deterministic (q is then one-hot on the token).
  std::vector<std::vector<float>> probs;
};

class Proposer {
 public:
  virtual ~Proposer() = default;
  virtual std::string_view name() const = 0;
  // One proposal per request, in order (an empty one is allowed). Errors are
  // proposer failures; the caller may decode without speculation.
  [[nodiscard]] virtual absl::Status Propose(
      std::span<const ProposalRequest> requests,
      std::vector<Proposal>* proposals) = 0;
  // The request left (finished, aborted, preempted): drop its state.
  virtual void Forget(uint64_t request_id) {}
  // Relative cost of proposing one token, in units of one target decode step
  // at batch 1 (0 for lookups); feeds the adaptive γ.
  virtual double cost_per_token() const { return 0.0; }
};

// Prompt lookup: the longest suffix of the history of length in
// [min_ngram, max_ngram] that occurred earlier in the history proposes the
// tokens that followed its most recent earlier occurrence.
struct NgramOptions {
  int min_ngram = 1;
  int max_ngram = 4;
};
std::unique_ptr<Proposer> MakeNgramProposer(const NgramOptions& options = {});

// Proposes from fixed token sequences: when a history is a prefix of one of
// them, the tokens that follow it. With the target's own greedy continuations
// this is the always-right proposer of the benchmark; with altered ones a
// proposer that is wrong at known places (tests).
std::unique_ptr<Proposer> MakeScriptedProposer(
    std::vector<std::vector<int32_t>> sequences);

}  // namespace pdserve::speculative
