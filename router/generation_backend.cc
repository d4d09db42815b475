#include "router/generation_backend.h"

#include <atomic>
#include <cmath>
#include <random>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "tokenizer/detokenizer.h"

namespace pdserve::router {

const char* FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kNone:
      return "";
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kError:
      return "error";
  }
  return "";
}

absl::Status ValidateGenerationRequest(const GenerationRequest& request) {
  if (request.prompt_text.has_value() == request.prompt_ids.has_value()) {
    return absl::InvalidArgumentError(
        "exactly one of prompt text or prompt token ids is required");
  }
  if (request.prompt_text.has_value()) {
    if (request.prompt_text->empty()) {
      return absl::InvalidArgumentError("prompt must not be empty");
    }
    if (!tokenizer::IsValidUtf8(*request.prompt_text)) {
      return absl::InvalidArgumentError("prompt is not valid UTF-8");
    }
  } else {
    if (request.prompt_ids->empty()) {
      return absl::InvalidArgumentError("prompt token ids must not be empty");
    }
    for (int32_t id : *request.prompt_ids) {
      if (id < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("prompt token id ", id, " is negative"));
      }
    }
  }
  if (request.max_tokens < (request.echo ? 0 : 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens must be at least ", request.echo ? 0 : 1,
                     request.echo ? "" : " (0 only with echo)", " (got ",
                     request.max_tokens, ")"));
  }
  const SamplingOptions& s = request.sampling;
  if (!std::isfinite(s.temperature) || s.temperature < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature must be >= 0 (got ", s.temperature, ")"));
  }
  if (!std::isfinite(s.top_p) || s.top_p <= 0 || s.top_p > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_p must be in (0, 1] (got ", s.top_p, ")"));
  }
  if (s.top_k < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_k must be >= 0 (got ", s.top_k, ")"));
  }
  if (request.top_logprobs < 0 || request.top_logprobs > kMaxTopLogprobs) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_logprobs must be in [0, ", kMaxTopLogprobs, "] (got ",
                     request.top_logprobs, ")"));
  }
  if (request.top_logprobs > 0 && !request.logprobs) {
    return absl::InvalidArgumentError(
        "top_logprobs needs logprobs to be requested");
  }
  if (request.stop.size() > kMaxStopStrings) {
    return absl::InvalidArgumentError(absl::StrCat("at most ", kMaxStopStrings,
                                                   " stop strings (got ",
                                                   request.stop.size(), ")"));
  }
  for (const std::string& stop : request.stop) {
    if (stop.empty()) {
      return absl::InvalidArgumentError("stop strings must not be empty");
    }
    if (!tokenizer::IsValidUtf8(stop)) {
      return absl::InvalidArgumentError("stop string is not valid UTF-8");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelDescription> ResolveModel(const GenerationBackend& backend,
                                              const std::string& requested) {
  std::vector<ModelDescription> models = backend.ListModels();
  if (requested.empty()) {
    if (models.size() == 1) return models[0];
    if (models.empty()) return absl::UnavailableError("no model is served");
    return absl::InvalidArgumentError(
        "model is required: this cluster serves several models");
  }
  for (const ModelDescription& model : models) {
    if (model.name == requested) return model;
  }
  return absl::NotFoundError(
      absl::StrCat("The model `", requested, "` does not exist"));
}

uint64_t NewRandomSeed() {
  thread_local absl::BitGen gen;
  return absl::Uniform<uint64_t>(gen);
}

std::string NewRequestId() {
  // A random per-process base keeps ids unique across router restarts; the
  // counter keeps them unique within one.
  static const uint64_t base = std::random_device{}() * 0x9E3779B97F4A7C15ull;
  static std::atomic<uint64_t> counter{0};
  return absl::StrFormat("req-%016x", base + counter.fetch_add(1));
}

}  // namespace pdserve::router
