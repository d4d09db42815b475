// The OpenAI-compatible wire format, as pure functions (no sockets): parsing
// and validating /v1/completions and /v1/chat/completions bodies into a
// GenerationRequest, the chat template for base models, response bodies, SSE
// chunks and OpenAI's error shape. http_server.cc puts them on the wire.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "router/chat_prompt.h"
#include "router/generation_backend.h"
#include "router/tool_calls.h"

namespace pdserve::router {

enum class OpenAiEndpoint { kCompletions, kChatCompletions };

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};

// One prompt of a completions request: text or token ids.
struct PromptInput {
  std::optional<std::string> text;
  std::optional<std::vector<int32_t>> ids;
};

struct OpenAiRequest {
  OpenAiEndpoint endpoint = OpenAiEndpoint::kCompletions;
  // `model` may be empty (the cluster's only model); request_id is empty.
  // Holds the first prompt.
  GenerationRequest generation;
  // Completions: every prompt of the request (a batch: `prompt` as an array
  // of strings or of token-id arrays), the first also in `generation`. Choice
  // index = prompt index * n + choice (OpenAI's numbering).
  std::vector<PromptInput> prompts;
  std::vector<ChatMessage> messages;  // chat only; already rendered in prompt
  // Chat: how to read tool calls back from the answer, and the answer's start
  // that the prompt already holds (a forced call's opening).
  ToolCallFormat tool_format = ToolCallFormat::kNone;
  std::string answer_prefix;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  // Choices to generate (OpenAI's `n`), each an independent request with
  // seed generation.sampling.seed + index.
  int n = 1;
  // Candidates per prompt (best_of >= n); when more than n, the n with the
  // highest cumulative log-probability are returned (never streamed).
  int best_of = 1;
};

// The most choices one request may ask for (`n`), and the most prompts times
// choices of a batch: each is a full generation (prefill included) counted by
// the admission limit.
inline constexpr int kMaxChoices = 16;
inline constexpr int kMaxBatchChoices = 64;

// Parses and validates a request body (INVALID_ARGUMENT naming the field for
// malformed JSON, wrong types, n outside [1, kMaxChoices], best_of outside [n,
// kMaxChoices] and other unsupported options, out-of-range values, and any
// field the server does not honour). Chat messages are rendered with
// `chat_prompt` (the model's template; null: the base-model fallback), whose
// refusals (a template's raise_exception, tools it cannot express) come back as
// INVALID_ARGUMENT.
[[nodiscard]] absl::StatusOr<OpenAiRequest> ParseOpenAiRequest(
    OpenAiEndpoint endpoint, std::string_view body,
    const ChatPrompt* chat_prompt = nullptr);

// The chat template for base models (no template of their own):
//
//   System: <content>\n      (one line group per message, in order;
//   User: <content>\n         roles capitalized)
//   Assistant: <content>\n
//   Assistant:               (the cue; the model continues after the colon)
//
// Plain role prefixes keep the prompt readable text a base model has seen in
// training (dialogue), with no special tokens it would not know.
std::string RenderChatPrompt(const std::vector<ChatMessage>& messages);

// HTTP status for a backend/validation status: INVALID_ARGUMENT,
// OUT_OF_RANGE, FAILED_PRECONDITION -> 400; NOT_FOUND -> 404;
// RESOURCE_EXHAUSTED -> 429; UNAVAILABLE -> 503; DEADLINE_EXCEEDED -> 504;
// CANCELLED -> 499 (client closed); UNIMPLEMENTED -> 501; else 500.
int HttpStatusFor(const absl::Status& status);

// {"error": {"message", "type", "param": null, "code"}} with the type (and
// code) OpenAI uses for that HTTP status.
std::string ErrorBody(int http_status, std::string_view message);
std::string ErrorBody(const absl::Status& status);

// The "logprobs" of a choice: null unless requested; otherwise, for
// completions {"tokens", "token_logprobs", "top_logprobs" (one object per
// token: its top_logprobs alternatives plus the token itself), "text_offset"}
// and for chat {"content": [{"token", "logprob", "bytes", "top_logprobs":
// [{"token", "logprob", "bytes"}]}], "refusal": null}. A token is shown as
// its text when that is valid UTF-8, else as "bytes:\xe2\x80" (a piece of a
// character), or "token_id:N" when the backend has no tokenizer.
struct LogprobsOutput {
  bool requested = false;
  int32_t top_logprobs = 0;
  // Completions with echo: the prompt's tokens come first (token 0 with null
  // numbers, as OpenAI lists it), their text_offset counting from the start
  // of the prompt text.
  std::optional<PromptEcho> prompt;
  std::vector<TokenLogprob> tokens;
  // Completions: characters of the choice's text before the first of
  // `tokens` (the echoed prompt, a stream's earlier chunks).
  int64_t text_offset = 0;
};

// How a token is shown in logprob listings (see LogprobsOutput).
std::string TokenDisplay(const TokenAlternative& token);
// Characters `token` adds to the text (UTF-8 lead bytes: a piece of a
// character counts once, with its first byte; a control token none).
int64_t TokenCharacters(const TokenAlternative& token);
// Characters of UTF-8 text (lead bytes).
int64_t TextCharacters(std::string_view text);

// What a finished generation produced (non-streaming bodies, final chunks).
struct CompletionOutcome {
  std::string text;  // chat with tool calls: the text outside them
  FinishReason finish_reason = FinishReason::kNone;
  GenerationUsage usage;
  LogprobsOutput logprobs;
  std::vector<ToolCall> tool_calls;  // chat only
};

// best_of: from `candidates` (per_prompt consecutive outcomes per prompt, each
// with its tokens' logprobs) the n of each prompt with the highest cumulative
// log-probability (sum of the chosen tokens' raw logprobs; ties: lower
// index), in that order. The dropped candidates' completion tokens stay in the
// usage (added to the prompt's first kept choice: CombinedUsage sums them), as
// OpenAI bills every candidate. Without `keep_logprobs` the logprobs are
// removed (the client did not ask for them).
std::vector<CompletionOutcome> BestCandidates(
    std::vector<CompletionOutcome> candidates, int per_prompt, int n,
    bool keep_logprobs);

// "stop" or "length" for OpenAI (cancelled/error are not OpenAI reasons and
// map to null).
std::string OpenAiFinishReason(FinishReason reason);

// The complete non-streaming response body: one choice per outcome (index =
// position), usage as CombinedUsage.
std::string CompletionBody(OpenAiEndpoint endpoint, std::string_view id,
                           int64_t created, std::string_view model,
                           const std::vector<CompletionOutcome>& choices,
                           int choices_per_prompt);
inline std::string CompletionBody(OpenAiEndpoint endpoint, std::string_view id,
                                  int64_t created, std::string_view model,
                                  const CompletionOutcome& outcome) {
  return CompletionBody(endpoint, id, created, model,
                        std::vector<CompletionOutcome>{outcome}, 1);
}

// Usage of a whole request: each prompt's tokens once (choices
// [p * n, (p + 1) * n) share prompt p), completions summed.
GenerationUsage CombinedUsage(const std::vector<GenerationUsage>& choices,
                              int choices_per_prompt);

// One SSE event "data: {...}\n\n" carrying a text delta (and the logprobs of
// the tokens that came with it, when requested); `finish_reason` kNone keeps
// it null. For chat, `first` adds the assistant role to delta.
std::string StreamChunkEvent(OpenAiEndpoint endpoint, std::string_view id,
                             int64_t created, std::string_view model,
                             std::string_view text, FinishReason finish_reason,
                             bool first, const LogprobsOutput& logprobs = {},
                             int choice_index = 0);
// A chat chunk carrying a choice's tool calls (each whole, numbered by
// `index`), finish_reason "tool_calls".
std::string StreamToolCallsEvent(std::string_view id, int64_t created,
                                 std::string_view model,
                                 const std::vector<ToolCall>& calls,
                                 int choice_index);
// The trailing usage chunk (stream_options.include_usage): empty choices.
std::string StreamUsageEvent(OpenAiEndpoint endpoint, std::string_view id,
                             int64_t created, std::string_view model,
                             const GenerationUsage& usage);
// An error after the stream started: "data: {"error": ...}\n\n".
std::string StreamErrorEvent(const absl::Status& status);
inline constexpr std::string_view kStreamDoneEvent = "data: [DONE]\n\n";

// GET /v1/models body.
std::string ModelsBody(const std::vector<ModelDescription>& models,
                       int64_t created);
// GET /v1/models/{id} body: one model object.
std::string ModelBody(const ModelDescription& model, int64_t created);

// POST /tokenize (vLLM's shape): {"model"?, "prompt": "...",
// "add_special_tokens"?: true} or {"model"?, "messages": [...],
// "add_special_tokens"?: true} (the chat prompt as /v1/chat/completions
// renders it). Unknown fields are refused by name.
struct TokenizeRequest {
  std::string model;
  std::string text;
  bool add_special_tokens = true;
};
[[nodiscard]] absl::StatusOr<TokenizeRequest> ParseTokenizeRequest(
    std::string_view body, const ChatPrompt* chat_prompt = nullptr);
// {"count": N, "max_model_len": L, "tokens": [...]}
std::string TokenizeBody(const std::vector<int32_t>& ids,
                         int32_t max_model_len);

// POST /detokenize: {"model"?, "tokens": [ids]} -> {"prompt": "text"}.
struct DetokenizeRequest {
  std::string model;
  std::vector<int32_t> tokens;
};
[[nodiscard]] absl::StatusOr<DetokenizeRequest> ParseDetokenizeRequest(
    std::string_view body);
std::string DetokenizeBody(std::string_view text);

}  // namespace pdserve::router
