// A request's sampling parameters and their bounds: a plain struct every
// layer shares (the request contract validates with it without linking the
// engine; engine/sampler.h applies it).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace pdserve::engine {

// An additive bias on one token's logit (OpenAI `logit_bias`).
struct LogitBias {
  int32_t token = 0;
  float bias = 0.0f;
  bool operator==(const LogitBias&) const = default;
};

// Bounds every API shares (OpenAI's, where it has one).
inline constexpr float kMaxAbsPenalty = 2.0f;  // presence, frequency
inline constexpr float kMaxRepetitionPenalty = 10.0f;
inline constexpr float kMaxAbsLogitBias = 100.0f;
inline constexpr int kMaxLogitBiasEntries = 1024;

// Structured output: what the whole output must be (services/grammar compiles
// it against the model's vocabulary; the sampler masks every token that would
// leave the language). Plain data so every layer can carry it.
struct StructuredOutput {
  enum class Kind {
    kNone,
    kJsonObject,  // any JSON object (OpenAI response_format json_object)
    kJsonSchema,  // `text` is a JSON schema (json_schema, guided_json)
    kRegex,       // `text` is a regular expression (guided_regex)
    kChoice,      // exactly one of `choices` (guided_choice)
  };
  Kind kind = Kind::kNone;
  std::string text;
  std::vector<std::string> choices;
  bool enabled() const { return kind != Kind::kNone; }
  bool operator==(const StructuredOutput&) const = default;
};

struct SamplingParams {
  float temperature = 0.0f;  // 0 = greedy
  int top_k = 0;             // 0 = off
  float top_p = 1.0f;        // 1 = off
  uint64_t seed = 0;
  // Keep only tokens whose probability (after temperature) is at least
  // min_p times the most likely token's. 0 = off.
  float min_p = 0.0f;
  // Logit processors, applied to the raw logits in this order (vLLM's):
  //  1. min_tokens: while fewer than min_tokens tokens have been generated
  //     the end tokens (EOS ids) get -inf;
  //  2. logit_bias: logit[token] += bias;
  //  3. repetition_penalty r (CTRL / Hugging Face / vLLM): a token present in
  //     the prompt or the output has its logit divided by r when positive,
  //     multiplied by r when not; 1 = off;
  //  4. frequency_penalty f and presence_penalty p (OpenAI):
  //     logit[t] -= f * count_in_output(t) + p * (count_in_output(t) > 0).
  // Greedy decoding takes the arg-max of the processed logits.
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  float repetition_penalty = 1.0f;
  int32_t min_tokens = 0;
  std::vector<LogitBias> logit_bias;  // sorted by token, no repeats
  // Applied last, after the processors above, by whoever samples through a
  // TokenConstraint (engine/sampler.h).
  StructuredOutput structured_output;

  bool greedy() const { return temperature <= 0.0f || top_k == 1; }
  // The prompt's tokens count too (not only the output's): the
  // multiplicative penalty applies to every token seen so far.
  bool penalizes_prompt_tokens() const { return repetition_penalty != 1.0f; }
  // Whether any logit processor is on (then the arg-max of the raw logits is
  // not the greedy choice, and the distribution depends on the history).
  bool processes_logits() const {
    return presence_penalty != 0.0f || frequency_penalty != 0.0f ||
           repetition_penalty != 1.0f || min_tokens > 0 ||
           !logit_bias.empty() || structured_output.enabled();
  }
  // INVALID_ARGUMENT naming the field: temperature < 0 or not finite,
  // top_k < 0, top_p outside (0, 1], min_p outside [0, 1], a penalty outside
  // its bound, min_tokens < 0, logit_bias unsorted, repeated, too long, out
  // of [-kMaxAbsLogitBias, kMaxAbsLogitBias] or with a negative token.
  [[nodiscard]] absl::Status Validate() const;
  // Validate() plus every logit_bias token inside [0, vocab_size).
  [[nodiscard]] absl::Status ValidateForVocab(int vocab_size) const;
  bool operator==(const SamplingParams&) const = default;
};

}  // namespace pdserve::engine
