#include "router/chat_prompt.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "router/openai_api.h"

namespace pdserve::router {
namespace {

using ojson = nlohmann::ordered_json;

// How the answer must begin so that the model calls a tool (tool_choice
// "required") or the named one: the call's opening, written into the prompt
// after the generation prompt. The model then writes the rest of the call.
std::string ForcedCallOpening(ToolCallFormat format, const ToolChoice& choice) {
  const bool named = choice.kind == ToolChoice::Kind::kFunction;
  const std::string name_json = ojson(choice.function).dump();
  switch (format) {
    case ToolCallFormat::kHermes:
      return named ? absl::StrCat("<tool_call>\n{\"name\": ", name_json,
                                  ", \"arguments\": ")
                   : "<tool_call>\n{\"name\": \"";
    case ToolCallFormat::kLlama3Json:
      return named
                 ? absl::StrCat("{\"name\": ", name_json, ", \"parameters\": ")
                 : "{\"name\": \"";
    case ToolCallFormat::kNone:
      break;
  }
  return "";
}

}  // namespace

std::unique_ptr<ChatPrompt> ChatPrompt::Fallback() {
  return std::unique_ptr<ChatPrompt>(new ChatPrompt());
}

absl::StatusOr<std::unique_ptr<ChatPrompt>> ChatPrompt::ForModel(
    const std::string& model_path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path dir(model_path);
  if (!fs::is_directory(dir, ec)) dir = dir.parent_path();
  const fs::path config = dir / "tokenizer_config.json";
  if (!fs::exists(config, ec)) return Fallback();
  absl::StatusOr<chat_template::TokenizerConfigTemplates> read =
      chat_template::ReadTokenizerConfigFile(config.string());
  if (!read.ok()) return read.status();
  std::unique_ptr<ChatPrompt> prompt(new ChatPrompt());
  prompt->origin_ = config.string();
  prompt->bos_token_ = read->bos_token;
  prompt->eos_token_ = read->eos_token;
  for (const auto& [name, source] : read->templates) {
    absl::StatusOr<chat_template::ChatTemplate> parsed =
        chat_template::ChatTemplate::Parse(
            source,
            absl::StrCat(config.string(), " chat_template[", name, "]"));
    if (!parsed.ok()) return parsed.status();
    prompt->templates_.emplace(name, *std::move(parsed));
  }
  return prompt;
}

absl::StatusOr<std::unique_ptr<ChatPrompt>> ChatPrompt::ForGguf(
    const std::string& path, const model::TokenizerSpec& spec) {
  if (spec.chat_template.empty()) return Fallback();
  auto token = [&spec](int32_t id) -> std::string {
    return id >= 0 && id < static_cast<int32_t>(spec.tokens.size())
               ? spec.tokens[id]
               : "";
  };
  return FromSource(spec.chat_template,
                    absl::StrCat(path, " tokenizer.chat_template"),
                    token(spec.bos_token_id), token(spec.eos_token_id));
}

absl::StatusOr<std::unique_ptr<ChatPrompt>> ChatPrompt::FromSource(
    const std::string& source, const std::string& origin,
    const std::string& bos_token, const std::string& eos_token) {
  absl::StatusOr<chat_template::ChatTemplate> parsed =
      chat_template::ChatTemplate::Parse(source, origin);
  if (!parsed.ok()) return parsed.status();
  std::unique_ptr<ChatPrompt> prompt(new ChatPrompt());
  prompt->origin_ = origin;
  prompt->bos_token_ = bos_token;
  prompt->eos_token_ = eos_token;
  prompt->templates_.emplace("default", *std::move(parsed));
  return prompt;
}

absl::StatusOr<RenderedChat> ChatPrompt::Render(const ChatInput& input) const {
  const bool has_tools = input.tools.is_array() && !input.tools.empty() &&
                         input.tool_choice.kind != ToolChoice::Kind::kNone;
  RenderedChat out;
  if (templates_.empty()) {
    if (has_tools) {
      return absl::InvalidArgumentError(
          "'tools': this model has no chat template, so it was never taught "
          "a tool-call format (send tool_choice \"none\" or no tools)");
    }
    if (!input.kwargs.empty()) {
      return absl::InvalidArgumentError(
          "'chat_template_kwargs': this model has no chat template for them");
    }
    std::vector<ChatMessage> messages;
    for (const ojson& message : input.messages) {
      const ojson& content =
          message.contains("content") ? message["content"] : ojson();
      messages.push_back(
          {message.value("role", ""),
           content.is_string() ? content.get<std::string>() : ""});
    }
    out.text = RenderChatPrompt(messages);
    if (!input.add_generation_prompt) {
      out.text.resize(out.text.size() - std::string_view("Assistant:").size());
    }
    return out;
  }
  // transformers' choice between named templates.
  const chat_template::ChatTemplate* chosen = nullptr;
  if (has_tools) {
    if (auto it = templates_.find("tool_use"); it != templates_.end()) {
      chosen = &it->second;
    }
  }
  if (chosen == nullptr) {
    auto it = templates_.find("default");
    chosen = it != templates_.end() ? &it->second : &templates_.begin()->second;
  }
  if (has_tools) {
    out.tool_format = DetectToolCallFormat(chosen->source());
    if (out.tool_format == ToolCallFormat::kNone) {
      return absl::InvalidArgumentError(
          "'tools': this model's chat template shows no tool-call format "
          "pdserve can read back (hermes <tool_call> tags or Llama 3.1 "
          "JSON)");
    }
  }
  ojson context = input.kwargs;
  context["messages"] = input.messages;
  if (has_tools) context["tools"] = input.tools;
  context["add_generation_prompt"] = input.add_generation_prompt;
  context["bos_token"] = bos_token_;
  context["eos_token"] = eos_token_;
  // Real conversations take ~1e4 interpreted steps (a thousand turns ~1e6);
  // the renderer's default of 1e7 is seconds of router CPU a client could
  // ask for with one request.
  chat_template::RenderOptions options;
  options.limits.max_steps = 2'000'000;
  absl::StatusOr<std::string> text = chosen->Render(context, options);
  if (!text.ok()) {
    if (chat_template::IsRaisedByTemplate(text.status())) {
      return absl::InvalidArgumentError(
          absl::StrCat("the model's chat template refused the conversation: ",
                       text.status().message()));
    }
    // A render limit or a template error on this conversation: the request
    // is the cause (RESOURCE_EXHAUSTED would be a 429 inviting a retry).
    return absl::InvalidArgumentError(absl::StrCat(
        "rendering the model's chat template: ", text.status().message()));
  }
  out.text = *std::move(text);
  if (has_tools && (input.tool_choice.kind == ToolChoice::Kind::kRequired ||
                    input.tool_choice.kind == ToolChoice::Kind::kFunction)) {
    if (!input.add_generation_prompt) {
      return absl::InvalidArgumentError(
          "'tool_choice': forcing a tool call needs the generation prompt");
    }
    out.answer_prefix = ForcedCallOpening(out.tool_format, input.tool_choice);
    out.text += out.answer_prefix;
  }
  out.add_special_tokens = false;
  return out;
}

std::string ChatPrompt::Describe() const {
  if (templates_.empty()) {
    return "base-model fallback (\"User: ...\\nAssistant:\"): the model "
           "ships no chat template";
  }
  std::vector<std::string> names;
  for (const auto& [name, t] : templates_) {
    names.push_back(absl::StrCat(
        name, " (", t.source().size(), " bytes, tool calls: ",
        ToolCallFormatName(DetectToolCallFormat(t.source())), ")"));
  }
  return absl::StrCat("the model's chat template from ", origin_, ": ",
                      absl::StrJoin(names, ", "));
}

}  // namespace pdserve::router
