#include "engine/sampling_params.h"

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"

namespace pdserve::engine {

absl::Status SamplingParams::Validate() const {
  if (!std::isfinite(temperature) || temperature < 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "temperature must be a finite number >= 0, got ", temperature));
  }
  if (top_k < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("top_k must be >= 0, got ", top_k));
  if (!(top_p > 0.0f && top_p <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_p must be in (0, 1], got ", top_p));
  }
  if (!(min_p >= 0.0f && min_p <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("min_p must be in [0, 1], got ", min_p));
  }
  for (const auto& [name, value] :
       {std::pair<const char*, float>{"presence_penalty", presence_penalty},
        {"frequency_penalty", frequency_penalty}}) {
    if (!(std::abs(value) <= kMaxAbsPenalty)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " must be in [-", kMaxAbsPenalty, ", ",
                       kMaxAbsPenalty, "], got ", value));
    }
  }
  if (!(repetition_penalty > 0.0f &&
        repetition_penalty <= kMaxRepetitionPenalty)) {
    return absl::InvalidArgumentError(
        absl::StrCat("repetition_penalty must be in (0, ",
                     kMaxRepetitionPenalty, "], got ", repetition_penalty));
  }
  if (min_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("min_tokens must be >= 0, got ", min_tokens));
  }
  if (logit_bias.size() > static_cast<size_t>(kMaxLogitBiasEntries)) {
    return absl::InvalidArgumentError(
        absl::StrCat("logit_bias has ", logit_bias.size(), " entries; at most ",
                     kMaxLogitBiasEntries));
  }
  for (size_t i = 0; i < logit_bias.size(); ++i) {
    const LogitBias& b = logit_bias[i];
    if (b.token < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("logit_bias token ", b.token, " is negative"));
    }
    if (i > 0 && b.token <= logit_bias[i - 1].token) {
      return absl::InvalidArgumentError(
          absl::StrCat("logit_bias tokens must be sorted and unique (", b.token,
                       " after ", logit_bias[i - 1].token, ")"));
    }
    if (!(std::abs(b.bias) <= kMaxAbsLogitBias)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "logit_bias for token ", b.token, " must be in [-", kMaxAbsLogitBias,
          ", ", kMaxAbsLogitBias, "], got ", b.bias));
    }
  }
  return absl::OkStatus();
}

absl::Status SamplingParams::ValidateForVocab(int vocab_size) const {
  if (absl::Status s = Validate(); !s.ok()) return s;
  if (!logit_bias.empty() && logit_bias.back().token >= vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("logit_bias token ", logit_bias.back().token,
                     " is outside the vocabulary of ", vocab_size));
  }
  return absl::OkStatus();
}

}  // namespace pdserve::engine
