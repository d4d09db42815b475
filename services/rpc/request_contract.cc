#include "rpc/request_contract.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"

namespace pdserve::rpc {

absl::Status CheckSampling(const engine::SamplingParams& s) {
  if (!std::isfinite(s.temperature) || s.temperature < 0 ||
      s.temperature > kMaxTemperature) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling: temperature must be in [0, ", kMaxTemperature,
                     "] (got ", s.temperature, ")"));
  }
  if (!std::isfinite(s.top_p) || s.top_p <= 0 || s.top_p > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling: top_p must be in (0, 1] (got ", s.top_p, ")"));
  }
  if (s.top_k < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling: top_k must be >= 0 (got ", s.top_k, ")"));
  }
  // The processors' bounds are the engine's own (one definition).
  if (absl::Status status = s.Validate(); !status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling: ", status.message()));
  }
  return absl::OkStatus();
}

absl::Status CheckMaxTokens(int64_t max_tokens, bool echo) {
  const int64_t least = echo ? 0 : 1;
  if (max_tokens < least || max_tokens > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_tokens must be at least ", least,
        echo ? "" : " (0 only with echo)", " (got ", max_tokens, ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckLogprobs(bool logprobs, int64_t top_logprobs) {
  if (top_logprobs < 0 || top_logprobs > kMaxTopLogprobs) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_logprobs must be in [0, ", kMaxTopLogprobs, "] (got ",
                     top_logprobs, ")"));
  }
  if (top_logprobs > 0 && !logprobs) {
    return absl::InvalidArgumentError(
        "top_logprobs needs logprobs to be requested");
  }
  return absl::OkStatus();
}

absl::Status CheckStops(std::span<const std::string> stop) {
  if (stop.size() > kMaxStopStrings) {
    return absl::InvalidArgumentError(absl::StrCat(
        "at most ", kMaxStopStrings, " stop strings (got ", stop.size(), ")"));
  }
  for (const std::string& s : stop) {
    if (s.empty()) {
      return absl::InvalidArgumentError("stop strings must not be empty");
    }
  }
  return absl::OkStatus();
}

engine::SamplingParams SamplingFromWire(const v1::SamplingParams& wire,
                                        uint64_t seed_if_unset) {
  engine::SamplingParams s;
  s.temperature = wire.temperature();
  s.top_p = wire.top_p() == 0 ? 1.0f : wire.top_p();
  s.top_k = wire.top_k();
  s.seed = wire.has_seed() ? wire.seed() : seed_if_unset;
  s.min_p = wire.min_p();
  s.presence_penalty = wire.presence_penalty();
  s.frequency_penalty = wire.frequency_penalty();
  s.repetition_penalty =
      wire.repetition_penalty() == 0 ? 1.0f : wire.repetition_penalty();
  s.min_tokens = wire.min_tokens();
  s.logit_bias.reserve(wire.logit_bias_size());
  for (const auto& [token, bias] : wire.logit_bias()) {
    s.logit_bias.push_back({token, bias});
  }
  using Kind = engine::StructuredOutput::Kind;
  const v1::StructuredOutput& so = wire.structured_output();
  switch (so.kind_case()) {
    case v1::StructuredOutput::kJsonObject:
      s.structured_output.kind = Kind::kJsonObject;
      break;
    case v1::StructuredOutput::kJsonSchema:
      s.structured_output.kind = Kind::kJsonSchema;
      s.structured_output.text = so.json_schema();
      break;
    case v1::StructuredOutput::kRegex:
      s.structured_output.kind = Kind::kRegex;
      s.structured_output.text = so.regex();
      break;
    case v1::StructuredOutput::kChoice:
      s.structured_output.kind = Kind::kChoice;
      s.structured_output.choices.assign(so.choice().choices().begin(),
                                         so.choice().choices().end());
      break;
    case v1::StructuredOutput::KIND_NOT_SET:
      break;
  }
  // A proto map has no order; the engine wants tokens sorted.
  std::sort(s.logit_bias.begin(), s.logit_bias.end(),
            [](const engine::LogitBias& a, const engine::LogitBias& b) {
              return a.token < b.token;
            });
  return s;
}

void SamplingToWire(const engine::SamplingParams& s, v1::SamplingParams* wire) {
  wire->set_temperature(s.temperature);
  wire->set_top_p(s.top_p);
  wire->set_top_k(s.top_k);
  wire->set_seed(s.seed);
  wire->set_min_p(s.min_p);
  wire->set_presence_penalty(s.presence_penalty);
  wire->set_frequency_penalty(s.frequency_penalty);
  wire->set_repetition_penalty(s.repetition_penalty);
  wire->set_min_tokens(s.min_tokens);
  for (const engine::LogitBias& b : s.logit_bias) {
    (*wire->mutable_logit_bias())[b.token] = b.bias;
  }
  using Kind = engine::StructuredOutput::Kind;
  const engine::StructuredOutput& so = s.structured_output;
  switch (so.kind) {
    case Kind::kJsonObject:
      wire->mutable_structured_output()->mutable_json_object();
      break;
    case Kind::kJsonSchema:
      wire->mutable_structured_output()->set_json_schema(so.text);
      break;
    case Kind::kRegex:
      wire->mutable_structured_output()->set_regex(so.text);
      break;
    case Kind::kChoice:
      for (const std::string& c : so.choices) {
        wire->mutable_structured_output()->mutable_choice()->add_choices(c);
      }
      break;
    case Kind::kNone:
      break;
  }
}

void AlternativesToWire(
    std::span<const engine::TopLogprob> alternatives,
    google::protobuf::RepeatedPtrField<v1::TopLogprob>* out) {
  for (const engine::TopLogprob& t : alternatives) {
    v1::TopLogprob* alternative = out->Add();
    alternative->set_token_id(t.token);
    alternative->set_logprob(t.logprob);
  }
}

void LogprobsToWire(const engine::TokenLogprobs& logprobs,
                    v1::TokenLogprob* wire) {
  wire->set_logprob(logprobs.logprob);
  AlternativesToWire(logprobs.top, wire->mutable_top());
}

engine::TokenLogprobs LogprobsFromWire(const v1::TokenLogprob& wire) {
  engine::TokenLogprobs out;
  out.logprob = wire.logprob();
  out.top.reserve(wire.top_size());
  for (const v1::TopLogprob& t : wire.top()) {
    out.top.push_back({t.token_id(), t.logprob()});
  }
  return out;
}

}  // namespace pdserve::rpc
