// The prompt of a chat request. A model that ships a chat template (its
// tokenizer_config.json `chat_template`) gets it rendered as transformers'
// apply_chat_template does (services/chat_template), with the request's
// messages, tools and template kwargs; the rendered text already holds the
// model's special tokens, so it is tokenized without adding BOS again. A base
// model without a template keeps the plain "User: ...\nAssistant:" fallback
// (BOS added by the tokenizer).
//
// Thread-safety: immutable after creation; Render may be called from any
// thread at once.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "chat_template/chat_template.h"
#include "model/weight_source.h"
#include "nlohmann/json.hpp"
#include "router/tool_calls.h"

namespace pdserve::router {

// What the client asked about tools (OpenAI's `tool_choice`).
struct ToolChoice {
  enum class Kind { kAuto, kNone, kRequired, kFunction };
  Kind kind = Kind::kAuto;
  std::string function;  // kFunction: the name
};

// A chat request as the template sees it.
struct ChatInput {
  // Normalized messages: roles system/user/assistant/tool, text content as a
  // string, assistant tool-call arguments as objects (what templates expect:
  // vLLM and transformers pass them so).
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  // OpenAI tool definitions; null when the request has none.
  nlohmann::ordered_json tools;
  ToolChoice tool_choice;
  // Extra template variables (`chat_template_kwargs`, e.g. Qwen3's
  // enable_thinking): an object.
  nlohmann::ordered_json kwargs = nlohmann::ordered_json::object();
  bool add_generation_prompt = true;
};

struct RenderedChat {
  std::string text;
  // True for the fallback (the tokenizer adds BOS); false for a model
  // template, whose text carries its own special tokens.
  bool add_special_tokens = true;
  // How the answer's tool calls are to be read back (kNone: not at all).
  ToolCallFormat tool_format = ToolCallFormat::kNone;
  // The start of the answer written into the prompt (a forced tool call's
  // opening): the answer is read back as prefix + generated text.
  std::string answer_prefix;
};

class ChatPrompt {
 public:
  // The base-model fallback.
  static std::unique_ptr<ChatPrompt> Fallback();
  // The template of a Hugging Face model folder (tokenizer_config.json next
  // to config.json); the fallback when the folder has none (or `path` is a
  // file, e.g. a GGUF). A malformed config or template is INVALID_ARGUMENT
  // naming the file and what is wrong: a model whose template cannot be read
  // must not be served with a made-up one.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<ChatPrompt>> ForModel(
      const std::string& model_path);
  // A GGUF file's `tokenizer.chat_template` (in `spec`), its special tokens
  // spelled from the vocabulary; the fallback when the file has none.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<ChatPrompt>> ForGguf(
      const std::string& path, const model::TokenizerSpec& spec);
  // A template given as source (tests, GGUF metadata).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<ChatPrompt>> FromSource(
      const std::string& source, const std::string& origin,
      const std::string& bos_token, const std::string& eos_token);

  // INVALID_ARGUMENT with the template's own message when it refuses the
  // conversation (raise_exception), or naming what the request lacks (tools
  // with a template that has no tool-call format pdserve can read);
  // RESOURCE_EXHAUSTED when rendering hits a limit.
  [[nodiscard]] absl::StatusOr<RenderedChat> Render(
      const ChatInput& input) const;

  // For the router's start-up log: which template, from where.
  std::string Describe() const;
  bool has_template() const { return !templates_.empty(); }

 private:
  ChatPrompt() = default;

  // name -> template ("default", "tool_use", ...); empty for the fallback.
  std::map<std::string, chat_template::ChatTemplate> templates_;
  std::string origin_;
  std::string bos_token_;
  std::string eos_token_;
};

}  // namespace pdserve::router
