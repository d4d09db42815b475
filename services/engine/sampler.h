// Token sampling: greedy, temperature, min-p, top-k, top-p, with a
// per-request seed, after the logit processors a request asks for: logit
// bias, min_tokens, and the repetition, frequency and presence penalties.
//
// The processed distribution is a pure function of (logits, params, the
// request's prompt and output tokens, output index). The decode worker, the
// last prefill stage and the speculative verifier all compute it through
// ProcessedDistribution / DrawToken, so speculation stays lossless under every
// control: a verify row i sees the output extended by drafts 1..i, exactly
// the history it would have had without speculation.
//
// Randomness is counter-based: the uniform draw for output token i of a
// request is a pure function of (seed, i). Whichever process samples token i
// (the last prefill stage for the first token, the decode worker afterwards,
// a speculative verifier) draws the same number, so a fixed seed reproduces
// the same text through every layout.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/sampling_params.h"

namespace pdserve::engine {

// A request's structured-output state (services/grammar's matcher behind it):
// which tokens may come next, advanced token by token and rewound when a
// speculative verify backs out of drafts.
class TokenConstraint {
 public:
  virtual ~TokenConstraint() = default;
  // Sets every token the constraint forbids now to -infinity.
  [[nodiscard]] virtual absl::Status MaskLogits(std::span<float> logits) = 0;
  // Advances by `token` (INVALID_ARGUMENT if it is forbidden).
  [[nodiscard]] virtual absl::Status Accept(int32_t token) = 0;
  // Undoes the last `count` Accepts.
  [[nodiscard]] virtual absl::Status Rollback(int count) = 0;
};

// The request's tokens the logit processors read. Spans must outlive the call.
struct SamplingHistory {
  // Read only when the request penalizes prompt tokens too.
  std::span<const int32_t> prompt;
  std::span<const int32_t> output;  // tokens generated before this one
  // The ids min_tokens holds back (the model's EOS ids).
  std::span<const int32_t> end_tokens;
};

// Applies the logit processors of `params` to `logits` in place, for output
// index `index` (the number of tokens generated before this one; min_tokens
// compares against it).
void ApplyLogitProcessors(std::span<float> logits, const SamplingParams& params,
                          const SamplingHistory& history, uint64_t index);

// One of a position's most likely tokens and its log-probability.
struct TopLogprob {
  int32_t token = -1;
  float logprob = 0.0f;
  bool operator==(const TopLogprob&) const = default;
};

// The most alternatives a request may ask for per output token (OpenAI's
// chat API allows 20; each costs a pass over nothing but the heap).
inline constexpr int kMaxTopLogprobs = 20;

// What a client sees of the distribution an output token came from. Both are
// under the model's unmodified distribution (softmax of the raw logits,
// temperature 1, before top-k/top-p), as OpenAI-style APIs report it: the
// numbers do not change with the sampling parameters.
struct TokenLogprobs {
  float logprob = 0.0f;         // of the emitted token
  std::vector<TopLogprob> top;  // most likely first; ties: lower id first
};

struct SampledToken {
  int32_t token = -1;
  // log p(token), as TokenLogprobs::logprob.
  float logprob = 0.0f;
  // The `top_logprobs` most likely tokens, when Sample was asked for them.
  std::vector<TopLogprob> top;
};

// log p(token) and the `top_n` (clamped to the vocabulary) most likely tokens
// of `logits`. One pass for the normalizer, one for the candidates.
TokenLogprobs ComputeTokenLogprobs(std::span<const float> logits, int32_t token,
                                   int top_n);

// Uniform in [0, 1) for draw `stream` of output index `index` of a request.
double UniformForRequest(uint64_t seed, uint64_t index, uint64_t stream = 0);

// The distribution sampling draws from, given already processed logits:
// softmax(logits / T), then the min-p filter, then top-k, then the top-p
// nucleus, renormalized. Greedy params give a one-hot on the arg-max (lowest
// id on ties). `probs` is resized to logits.size(). Logit processors are not
// applied here (see ProcessedDistribution).
void SamplingDistribution(std::span<const float> logits,
                          const SamplingParams& params,
                          std::vector<float>* probs);

// The distribution output token `index` is drawn from: the logit processors
// on a copy of the raw `logits`, then SamplingDistribution.
void ProcessedDistribution(std::span<const float> logits,
                           const SamplingParams& params,
                           const SamplingHistory& history, uint64_t index,
                           std::vector<float>* probs);

// Inverse-CDF draw from `probs` (need not be normalized) with uniform `u`.
int32_t DrawFromDistribution(std::span<const float> probs, double u);

// Picks output token `index` of a request from its logits, nothing else (no
// log-softmax pass: what a verifier or a plain decode loop needs).
// `history` feeds the logit processors (ignored when none is on).
int32_t DrawToken(std::span<const float> logits, const SamplingParams& params,
                  uint64_t index, const SamplingHistory& history = {});

// DrawToken plus the token's log-probability; with
// `top_logprobs` > 0 also reports that many most likely alternatives. The
// log-probabilities are of the raw logits (TokenLogprobs), whatever the
// processors did.
SampledToken Sample(std::span<const float> logits, const SamplingParams& params,
                    uint64_t index, int top_logprobs = 0,
                    const SamplingHistory& history = {});

// Sample with a structured-output constraint (null: plain Sample): the
// processors, then the constraint's mask, then temperature / min-p / top-k /
// top-p over what is left. Log-probabilities stay those of the raw logits.
// FAILED_PRECONDITION when no token is allowed; the constraint's own errors.
// The constraint is not advanced (the caller Accepts the token it keeps).
[[nodiscard]] absl::StatusOr<SampledToken> SampleWithConstraint(
    std::span<const float> logits, const SamplingParams& params, uint64_t index,
    int top_logprobs, const SamplingHistory& history,
    TokenConstraint* constraint);

// Arg-max, lowest id on ties.
int32_t ArgMax(std::span<const float> logits);

}  // namespace pdserve::engine
