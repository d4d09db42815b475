// The request contract: what a generation request may ask for, what it gets
// when it leaves a field out, and how its sampling and logprob fields cross
// the wire (pdserve.v1) into the engine's types — decided here once for every
// layer that receives a request: the router's OpenAI and gRPC front-ends, the
// decode worker's Admit and the prefill group's Prefill. A layer may check
// more (the router: UTF-8, the context length), never differently.
//
// Library pdserve::request_contract (proto + the engine's plain types; it does
// not link the engine).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "engine/sampler.h"
#include "pdserve/v1/common.pb.h"

namespace pdserve::rpc {

// max_tokens when a request does not say (OpenAI's completions default; a
// fixed default keeps a forgotten field from holding KV for minutes).
inline constexpr int32_t kDefaultMaxTokens = 16;
// The most alternatives per token a request may ask for (OpenAI's chat: 20).
inline constexpr int kMaxTopLogprobs = engine::kMaxTopLogprobs;
inline constexpr int kMaxStopStrings = 16;
// OpenAI's bound; one bound on every API (gRPC took 9 when HTTP refused it).
inline constexpr float kMaxTemperature = 2.0f;

// INVALID_ARGUMENT "sampling: <field> ...": temperature outside [0,
// kMaxTemperature] or not finite, top_p outside (0, 1], top_k < 0, and the
// processors' bounds (engine::SamplingParams::Validate). Token ids of
// logit_bias are checked against the vocabulary where it is known.
// (Every layer keeps a request's sampling fields as the engine's own
// engine::SamplingParams: one type from the front-end to the sampler.)
[[nodiscard]] absl::Status CheckSampling(
    const engine::SamplingParams& sampling);

// max_tokens >= 1, or >= 0 with echo (0 = score or return the prompt only),
// and within int32.
[[nodiscard]] absl::Status CheckMaxTokens(int64_t max_tokens, bool echo);

// top_logprobs in [0, kMaxTopLogprobs], and > 0 only with logprobs.
[[nodiscard]] absl::Status CheckLogprobs(bool logprobs, int64_t top_logprobs);

// At most kMaxStopStrings, none empty.
[[nodiscard]] absl::Status CheckStops(std::span<const std::string> stop);

// The wire's sampling fields: proto3 cannot tell an unset top_p from 0, so 0
// reads as 1 (off); an unset seed reads as `seed_if_unset` (the router's
// front-end passes a fresh random one, workers 0: the router always sets
// it).
engine::SamplingParams SamplingFromWire(const v1::SamplingParams& wire,
                                        uint64_t seed_if_unset);
void SamplingToWire(const engine::SamplingParams& sampling,
                    v1::SamplingParams* wire);

// A worker's max_tokens field (AdmitRequest): 0 is unset = the default.
inline int32_t MaxTokensFromWorkerWire(int32_t wire) {
  return wire == 0 ? kDefaultMaxTokens : wire;
}

// Log-probabilities on the wire: a token's and its alternatives.
void LogprobsToWire(const engine::TokenLogprobs& logprobs,
                    v1::TokenLogprob* wire);
engine::TokenLogprobs LogprobsFromWire(const v1::TokenLogprob& wire);
void AlternativesToWire(
    std::span<const engine::TopLogprob> alternatives,
    google::protobuf::RepeatedPtrField<v1::TopLogprob>* out);

}  // namespace pdserve::rpc
