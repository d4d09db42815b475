// Token sampling: greedy, temperature, top-k, top-p, with a per-request seed.
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

namespace pdserve::engine {

struct SamplingParams {
  float temperature = 0.0f;  // 0 = greedy
  int top_k = 0;             // 0 = off
  float top_p = 1.0f;        // 1 = off
  uint64_t seed = 0;

  bool greedy() const { return temperature <= 0.0f || top_k == 1; }
  // INVALID_ARGUMENT naming the field: temperature < 0 or not finite,
  // top_k < 0, top_p outside (0, 1].
  [[nodiscard]] absl::Status Validate() const;
};

struct SampledToken {
  int32_t token = -1;
  // log p(token) under the model's unmodified distribution (softmax of the
  // raw logits, temperature 1), as OpenAI-style APIs report it.
  float logprob = 0.0f;
};

// Uniform in [0, 1) for draw `stream` of output index `index` of a request.
double UniformForRequest(uint64_t seed, uint64_t index, uint64_t stream = 0);

// The distribution sampling draws from: softmax(logits / T) restricted to
// top-k and then the top-p nucleus, renormalized. Greedy params give a one-hot
// on the arg-max (lowest id on ties). `probs` is resized to logits.size().
void SamplingDistribution(std::span<const float> logits,
                          const SamplingParams& params,
                          std::vector<float>* probs);

// Inverse-CDF draw from `probs` (need not be normalized) with uniform `u`.
int32_t DrawFromDistribution(std::span<const float> probs, double u);

// Picks output token `index` of a request from its logits.
SampledToken Sample(std::span<const float> logits, const SamplingParams& params,
                    uint64_t index);

// Arg-max, lowest id on ties.
int32_t ArgMax(std::span<const float> logits);

}  // namespace pdserve::engine
