// The seam between the router's public front-ends (OpenAI HTTP, gRPC
// Generation) and whatever produces tokens. The front-ends only ever talk to a
// GenerationBackend; the real one (admit on a decode worker, prefill on a
// prefill group, stream from the decode worker) and the tests' fake both sit
// behind it.
//
// Callback contract (both front-ends rely on it):
//   * Start() either fails (no callback is ever made) or returns a call; the
//     observer then gets zero or more OnDelta() and exactly one OnDone(), the
//     last callback, from any thread, never two at once for one call.
//   * OnDone(OK) follows a delta with `finished` set; OnDone(error) may come
//     before any delta (the front-ends map it to a status code) or after some
//     (a mid-stream error).
//   * GenerationCall::Cancel() never blocks and never calls the observer
//     synchronously; OnDone(CANCELLED) (or whatever came first) follows soon.
//   * The observer must stay alive until OnDone() returns; the call handle may
//     be destroyed at any time (destroying it does not cancel).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "rpc/request_contract.h"

namespace pdserve::router {

enum class FinishReason { kNone, kStop, kLength, kCancelled, kError };

// "stop", "length", "cancelled", "error" ("" for kNone).
const char* FinishReasonName(FinishReason reason);

// The contract's (services/rpc/request_contract.h). The seed is always
// resolved by the front-end: the client's, or NewRandomSeed().

struct GenerationRequest {
  std::string request_id;
  // Which public API it came through ("openai_completions", "openai_chat",
  // "grpc_generate", "grpc_generate_unary"): a metrics label.
  std::string api;
  std::string model;  // resolved: never empty once Start() is called
  // Exactly one of the two is the prompt.
  std::optional<std::string> prompt_text;
  std::optional<std::vector<int32_t>> prompt_ids;
  // Text prompts: let the tokenizer add its special tokens (BOS). False for
  // a chat rendered by the model's template, which writes its own.
  bool add_special_tokens = true;
  int32_t max_tokens = rpc::kDefaultMaxTokens;
  engine::SamplingParams sampling;
  std::vector<std::string> stop;
  // Keep generating past the end-of-sequence token until max_tokens (what
  // load generators ask for fixed-length outputs: vLLM's `ignore_eos`).
  bool ignore_eos = false;
  // Report each output token's log-probability (GenerationDelta::logprobs),
  // with its top_logprobs (0 to kMaxTopLogprobs) most likely alternatives;
  // top_logprobs > 0 needs logprobs.
  bool logprobs = false;
  int32_t top_logprobs = 0;
  // Return the prompt as well (OpenAI's `echo`): the first delta carries it
  // (GenerationDelta::echo), with logprobs its tokens' log-probabilities
  // under the model. With echo, max_tokens may be 0 (score the prompt only).
  bool echo = false;
  absl::Time deadline = absl::InfiniteFuture();
};

inline constexpr int kMaxTopLogprobs = rpc::kMaxTopLogprobs;
// A client's request id is echoed on every response item: bounded.
inline constexpr size_t kMaxRequestIdBytes = 256;

// A token at an output position with its log-probability under the model's
// raw distribution (temperature 1, before top-k/top-p).
struct TokenAlternative {
  int32_t token_id = -1;
  float logprob = 0.0f;
  // What the token stands for in running text (Tokenizer::TokenBytes: may be
  // a lone byte of a UTF-8 character); empty when the backend has no
  // tokenizer.
  std::string bytes;
  // A control token (BOS, EOS): shown by its piece ("<s>") but adds nothing
  // to the text.
  bool control = false;
};

struct TokenLogprob {
  TokenAlternative chosen;            // the emitted token
  std::vector<TokenAlternative> top;  // most likely first, when asked
};

// The prompt, when the request asked for echo.
struct PromptEcho {
  // The prompt as text: as given, or its token ids decoded (empty when the
  // backend has no tokenizer).
  std::string text;
  // With logprobs: prompt token 0 (nothing precedes it, so it has no
  // log-probability) and tokens 1.. each with log p(token | the tokens
  // before it) and the request's top_logprobs alternatives.
  TokenAlternative first_token;
  std::vector<TokenLogprob> scored_tokens;
};

struct GenerationUsage {
  int32_t prompt_tokens = 0;
  int32_t completion_tokens = 0;
  int32_t cached_prompt_tokens = 0;
};

struct GenerationTiming {
  double time_to_first_token_seconds = 0;
  double total_seconds = 0;
  double queue_seconds = 0;
  double prefill_seconds = 0;
};

struct GenerationDelta {
  // Set on the first delta only, and only for requests with echo (it may be
  // a delta of its own, before any token).
  std::optional<PromptEcho> echo;
  std::vector<int32_t> token_ids;
  std::string text;  // never half a UTF-8 character
  // One per token id when the request asked for logprobs.
  std::vector<TokenLogprob> logprobs;
  // Set on the last delta only.
  bool finished = false;
  FinishReason finish_reason = FinishReason::kNone;
  GenerationUsage usage;
  GenerationTiming timing;
};

class GenerationObserver {
 public:
  virtual ~GenerationObserver() = default;
  virtual void OnDelta(GenerationDelta delta) = 0;
  virtual void OnDone(absl::Status status) = 0;
};

class GenerationCall {
 public:
  virtual ~GenerationCall() = default;
  // Asks the backend to stop (frees the request's KV everywhere). Idempotent
  // and thread-safe: front-ends may call it from two threads at once.
  virtual void Cancel() = 0;
};

struct ModelDescription {
  std::string name;
  int32_t context_length = 0;
  int32_t vocab_size = 0;
};

class GenerationBackend {
 public:
  virtual ~GenerationBackend() = default;
  // The models this cluster serves (usually one).
  virtual std::vector<ModelDescription> ListModels() const = 0;
  // OK when at least one prefill group and one decode worker can take work.
  virtual absl::Status Health() const = 0;
  // Errors: INVALID_ARGUMENT (bad request, e.g. prompt over the context),
  // NOT_FOUND (model), RESOURCE_EXHAUSTED (admission limit), UNAVAILABLE
  // (nothing healthy), DEADLINE_EXCEEDED.
  [[nodiscard]] virtual absl::StatusOr<std::unique_ptr<GenerationCall>> Start(
      GenerationRequest request, GenerationObserver* observer) = 0;
};

// Front-end checks shared by HTTP and gRPC: one prompt, non-empty, valid
// UTF-8, and the request contract's (max_tokens, sampling, logprobs, stop
// strings: services/rpc/request_contract.h) plus valid UTF-8 stop strings.
// INVALID_ARGUMENT naming the field.
inline constexpr int kMaxStopStrings = rpc::kMaxStopStrings;
[[nodiscard]] absl::Status ValidateGenerationRequest(
    const GenerationRequest& request);

// The served model for `requested`: "" means the only model (INVALID_ARGUMENT
// when there are several); NOT_FOUND for a name the backend does not serve.
[[nodiscard]] absl::StatusOr<ModelDescription> ResolveModel(
    const GenerationBackend& backend, const std::string& requested);

// Called by a front-end for a request it refused before reaching the
// backend (malformed body, unknown model, invalid field): metrics count every
// request, not only those a backend saw. `api` as GenerationRequest::api.
using RejectionHook =
    std::function<void(const std::string& api, absl::StatusCode code)>;

// A fresh request id ("req-" + 16 hex digits), unique within the process.
std::string NewRequestId();

// A random sampling seed for a request that did not fix one (thread-safe).
uint64_t NewRandomSeed();

}  // namespace pdserve::router
