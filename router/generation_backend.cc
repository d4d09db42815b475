#include "router/generation_backend.h"

#include <atomic>
#include <cmath>
#include <random>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
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
  PDS_RETURN_IF_ERROR(rpc::CheckMaxTokens(request.max_tokens, request.echo));
  PDS_RETURN_IF_ERROR(rpc::CheckSampling(request.sampling));
  PDS_RETURN_IF_ERROR(
      rpc::CheckLogprobs(request.logprobs, request.top_logprobs));
  PDS_RETURN_IF_ERROR(rpc::CheckStops(request.stop));
  for (const std::string& stop : request.stop) {
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
