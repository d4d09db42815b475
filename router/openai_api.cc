#include "router/openai_api.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "tokenizer/detokenizer.h"

namespace pdserve::router {
namespace {

using json = nlohmann::json;

absl::Status FieldError(std::string_view field, std::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("'", absl::string_view(field.data(), field.size()), "' ",
                   absl::string_view(what.data(), what.size())));
}

// Reads an optional number field into `out` (null = absent).
absl::Status ReadNumber(const json& body, const char* field, double* out) {
  auto it = body.find(field);
  if (it == body.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_number()) return FieldError(field, "must be a number");
  *out = it->get<double>();
  if (!std::isfinite(*out)) return FieldError(field, "must be finite");
  return absl::OkStatus();
}

// Reads an optional integer field (a float with an integral value is not
// accepted: OpenAI's schema says integer).
absl::Status ReadInteger(const json& body, const char* field, int64_t* out) {
  auto it = body.find(field);
  if (it == body.end() || it->is_null()) return absl::OkStatus();
  if (it->is_number_unsigned()) {
    uint64_t v = it->get<uint64_t>();
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return FieldError(field, "is out of range");
    }
    *out = static_cast<int64_t>(v);
    return absl::OkStatus();
  }
  if (!it->is_number_integer()) return FieldError(field, "must be an integer");
  *out = it->get<int64_t>();
  return absl::OkStatus();
}

absl::Status ReadBool(const json& body, const char* field, bool* out) {
  auto it = body.find(field);
  if (it == body.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_boolean()) return FieldError(field, "must be a boolean");
  *out = it->get<bool>();
  return absl::OkStatus();
}

// One prompt: a non-empty string or a non-empty array of token ids.
absl::Status ReadOnePrompt(const json& prompt, PromptInput* out) {
  if (prompt.is_string()) {
    out->text = prompt.get<std::string>();
    if (out->text->empty()) return FieldError("prompt", "must not be empty");
    return absl::OkStatus();
  }
  if (prompt.is_array()) {
    if (prompt.empty()) return FieldError("prompt", "must not be empty");
    std::vector<int32_t> ids;
    ids.reserve(prompt.size());
    for (const json& id : prompt) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
          id.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
        return FieldError("prompt",
                          "must be a string or an array of token ids");
      }
      ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
    }
    out->ids = std::move(ids);
    return absl::OkStatus();
  }
  return FieldError("prompt", "must be a string or an array of token ids");
}

// prompt: a string, an array of token ids, or a batch: an array of strings or
// of token-id arrays (at most kMaxBatchChoices prompts; what
// lm-eval-harness's batched loglikelihood requests send).
absl::Status ReadPrompts(const json& body, std::vector<PromptInput>* out) {
  auto it = body.find("prompt");
  if (it == body.end() || it->is_null()) {
    return FieldError("prompt", "is required");
  }
  const bool batch = it->is_array() && !it->empty() &&
                     ((*it)[0].is_string() || (*it)[0].is_array());
  if (!batch) return ReadOnePrompt(*it, &out->emplace_back());
  if (it->size() > static_cast<size_t>(kMaxBatchChoices)) {
    return FieldError("prompt", absl::StrCat("holds more than ",
                                             kMaxBatchChoices, " prompts"));
  }
  for (const json& prompt : *it) {
    if (prompt.is_string() != (*it)[0].is_string()) {
      return FieldError("prompt",
                        "mixes text and token-id prompts in one batch");
    }
    if (absl::Status s = ReadOnePrompt(prompt, &out->emplace_back()); !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

using ojson = nlohmann::ordered_json;

absl::Status MessageError(size_t index, std::string_view field,
                          std::string_view what) {
  return FieldError(absl::StrCat("messages[", index, "]", std::string(field)),
                    what);
}

// A message's text: a string, or text parts joined (a text model has no
// other parts). Null only where `may_be_null` (an assistant turn that only
// calls tools).
absl::Status ReadContent(size_t index, const ojson& message, bool may_be_null,
                         std::string* text) {
  auto content = message.find("content");
  if (content == message.end() || content->is_null()) {
    if (may_be_null) return absl::OkStatus();
    return MessageError(index, ".content", "is required");
  }
  if (content->is_string()) {
    *text = content->get<std::string>();
    return absl::OkStatus();
  }
  if (!content->is_array()) {
    return MessageError(index, ".content",
                        "must be a string or an array of text parts");
  }
  for (const ojson& part : *content) {
    auto type = part.is_object() ? part.find("type") : part.end();
    if (!part.is_object() || type == part.end() || *type != "text" ||
        !part.contains("text") || !part["text"].is_string()) {
      return MessageError(index, ".content",
                          "parts must be {\"type\": \"text\", \"text\": ...}");
    }
    *text += part["text"].get<std::string>();
  }
  return absl::OkStatus();
}

// An assistant turn's tool_calls, with each call's `arguments` (JSON text
// on the wire) as an object, as chat templates expect them.
absl::Status ReadToolCalls(size_t index, const ojson& calls, ojson* out) {
  if (!calls.is_array()) {
    return MessageError(index, ".tool_calls", "must be an array");
  }
  *out = ojson::array();
  for (const ojson& call : calls) {
    const ojson* function = call.is_object() && call.contains("function")
                                ? &call["function"]
                                : nullptr;
    if (function == nullptr || !function->is_object() ||
        !function->contains("name") || !(*function)["name"].is_string()) {
      return MessageError(index, ".tool_calls",
                          "each needs function.name (a string)");
    }
    ojson arguments = ojson::object();
    if (auto a = function->find("arguments");
        a != function->end() && !a->is_null()) {
      if (a->is_string()) {
        arguments = ojson::parse(a->get<std::string>(), nullptr, false);
      } else {
        arguments = *a;
      }
      if (arguments.is_discarded() || !arguments.is_object()) {
        return MessageError(index, ".tool_calls",
                            "function.arguments must be a JSON object (or its "
                            "text)");
      }
    }
    ojson normalized = {
        {"id", call.value("id", "")},
        {"type", "function"},
        {"function",
         {{"name", (*function)["name"]}, {"arguments", std::move(arguments)}}}};
    out->push_back(std::move(normalized));
  }
  return absl::OkStatus();
}

// One chat message (the index-th) into `chat` (and its plain role/content
// pair into `plain`).
absl::Status ReadMessage(size_t index, const ojson& message, ChatInput* chat,
                         std::vector<ChatMessage>* plain) {
  static const absl::flat_hash_set<std::string_view> kMessageFields = {
      "role", "content", "name", "tool_calls", "tool_call_id"};
  if (!message.is_object()) {
    return FieldError("messages", "must hold objects");
  }
  for (const auto& [key, value] : message.items()) {
    if (!value.is_null() && !kMessageFields.contains(key)) {
      return MessageError(index, absl::StrCat(".", key),
                          "is not supported by this server (refused "
                          "rather than ignored)");
    }
  }
  auto role = message.find("role");
  if (role == message.end() || !role->is_string()) {
    return MessageError(index, ".role", "is required");
  }
  std::string role_name = role->get<std::string>();
  if (role_name == "developer") role_name = "system";
  if (role_name != "system" && role_name != "user" &&
      role_name != "assistant" && role_name != "tool") {
    return MessageError(index, ".role",
                        "must be system, developer, user, assistant or "
                        "tool");
  }
  ojson normalized = {{"role", role_name}};
  const bool calls_tools = role_name == "assistant" &&
                           message.contains("tool_calls") &&
                           !message["tool_calls"].is_null();
  std::string text;
  PDS_RETURN_IF_ERROR(ReadContent(index, message, calls_tools, &text));
  normalized["content"] = text;
  if (auto name = message.find("name");
      name != message.end() && !name->is_null()) {
    if (!name->is_string()) {
      return MessageError(index, ".name", "must be a string");
    }
    normalized["name"] = *name;
  }
  if (calls_tools) {
    ojson calls;
    PDS_RETURN_IF_ERROR(ReadToolCalls(index, message["tool_calls"], &calls));
    normalized["tool_calls"] = std::move(calls);
  } else if (message.contains("tool_calls") &&
             !message["tool_calls"].is_null()) {
    return MessageError(index, ".tool_calls",
                        "only assistant turns call tools");
  }
  if (auto id = message.find("tool_call_id");
      id != message.end() && !id->is_null()) {
    if (role_name != "tool" || !id->is_string()) {
      return MessageError(index, ".tool_call_id",
                          "belongs to a tool turn, as a string");
    }
    normalized["tool_call_id"] = *id;
  }
  chat->messages.push_back(std::move(normalized));
  plain->push_back({role_name, std::move(text)});
  return absl::OkStatus();
}

// The request's `tools` and `tool_choice` into `chat`.
absl::Status ReadTools(const ojson& body, ChatInput* chat) {
  if (auto tools = body.find("tools");
      tools != body.end() && !tools->is_null()) {
    if (!tools->is_array()) return FieldError("tools", "must be an array");
    for (const ojson& tool : *tools) {
      if (!tool.is_object() || tool.value("type", "") != "function" ||
          !tool.contains("function") || !tool["function"].is_object() ||
          !tool["function"].contains("name") ||
          !tool["function"]["name"].is_string()) {
        return FieldError("tools",
                          "each must be {\"type\": \"function\", \"function\": "
                          "{\"name\": ..., \"parameters\": ...}}");
      }
    }
    if (!tools->empty()) chat->tools = *tools;
  }
  if (auto choice = body.find("tool_choice");
      choice != body.end() && !choice->is_null()) {
    ToolChoice& c = chat->tool_choice;
    if (choice->is_string()) {
      const std::string v = choice->get<std::string>();
      if (v == "auto") {
        c.kind = ToolChoice::Kind::kAuto;
      } else if (v == "none") {
        c.kind = ToolChoice::Kind::kNone;
      } else if (v == "required") {
        c.kind = ToolChoice::Kind::kRequired;
      } else {
        return FieldError("tool_choice",
                          "must be \"auto\", \"none\", \"required\" or "
                          "{\"type\": \"function\", \"function\": {\"name\": "
                          "...}}");
      }
    } else if (choice->is_object() && choice->value("type", "") == "function" &&
               choice->contains("function") &&
               (*choice)["function"].is_object() &&
               (*choice)["function"].contains("name") &&
               (*choice)["function"]["name"].is_string()) {
      c.kind = ToolChoice::Kind::kFunction;
      c.function = (*choice)["function"]["name"].get<std::string>();
      bool known = false;
      if (chat->tools.is_array()) {
        for (const ojson& tool : chat->tools) {
          known |= tool["function"]["name"] == c.function;
        }
      }
      if (!known) {
        return FieldError("tool_choice",
                          absl::StrCat("names function '", c.function,
                                       "', which is not in 'tools'"));
      }
    } else {
      return FieldError("tool_choice",
                        "must be \"auto\", \"none\", \"required\" or "
                        "{\"type\": \"function\", \"function\": {\"name\": "
                        "...}}");
    }
    if (c.kind == ToolChoice::Kind::kRequired && chat->tools.is_null()) {
      return FieldError("tool_choice", "\"required\" needs 'tools'");
    }
  }
  return absl::OkStatus();
}

// Chat messages, tools and template options into `chat` (and the plain
// role/content pairs into `plain`).
absl::Status ReadChat(const ojson& body, ChatInput* chat,
                      std::vector<ChatMessage>* plain) {
  auto it = body.find("messages");
  if (it == body.end() || it->is_null()) {
    return FieldError("messages", "is required");
  }
  if (!it->is_array() || it->empty()) {
    return FieldError("messages", "must be a non-empty array");
  }
  for (size_t i = 0; i < it->size(); ++i) {
    PDS_RETURN_IF_ERROR(ReadMessage(i, (*it)[i], chat, plain));
  }
  PDS_RETURN_IF_ERROR(ReadTools(body, chat));
  if (auto kwargs = body.find("chat_template_kwargs");
      kwargs != body.end() && !kwargs->is_null()) {
    if (!kwargs->is_object()) {
      return FieldError("chat_template_kwargs", "must be an object");
    }
    for (const auto& [key, value] : kwargs->items()) {
      if (key == "messages" || key == "tools" || key == "bos_token" ||
          key == "eos_token" || key == "add_generation_prompt") {
        return FieldError("chat_template_kwargs",
                          absl::StrCat("may not set '", key,
                                       "' (the request's own fields do)"));
      }
    }
    chat->kwargs = *kwargs;
  }
  if (auto add = body.find("add_generation_prompt");
      add != body.end() && !add->is_null()) {
    if (!add->is_boolean()) {
      return FieldError("add_generation_prompt", "must be a boolean");
    }
    chat->add_generation_prompt = add->get<bool>();
  }
  return absl::OkStatus();
}

absl::Status ReadStop(const json& body, std::vector<std::string>* stop) {
  auto it = body.find("stop");
  if (it == body.end() || it->is_null()) return absl::OkStatus();
  if (it->is_string()) {
    stop->push_back(it->get<std::string>());
  } else if (it->is_array()) {
    for (const json& s : *it) {
      if (!s.is_string()) return FieldError("stop", "must hold strings");
      stop->push_back(s.get<std::string>());
    }
  } else {
    return FieldError("stop", "must be a string or an array of strings");
  }
  return absl::OkStatus();
}

// Every body field this server reads, per endpoint. Anything else is refused
// by name: a client that sends `response_format`, `repetition_penalty` or
// `guided_json` must learn that nothing enforced it, not get a 200 with
// output that ignored it. (A null value is the same as absent.)
absl::Status RejectUnknownFields(OpenAiEndpoint endpoint, const json& body) {
  static const absl::flat_hash_set<std::string_view> kCommon = {
      "model",
      "max_tokens",
      "max_completion_tokens",
      "temperature",
      "top_p",
      "top_k",
      "seed",
      "n",
      "stop",
      "ignore_eos",
      "stream",
      "stream_options",
      "logprobs",
      "top_logprobs",
      "best_of",
      "frequency_penalty",
      "presence_penalty",
      "repetition_penalty",
      "min_p",
      "min_tokens",
      "logit_bias",
      "response_format",
      "guided_json",
      "guided_regex",
      "guided_choice",
      "tools",
      "functions",
      "echo"};
  // Fields the endpoint's own readers check (refused there when misplaced).
  static const absl::flat_hash_set<std::string_view> kCompletions = {"prompt",
                                                                     "suffix"};
  static const absl::flat_hash_set<std::string_view> kChat = {
      "messages", "tool_choice", "chat_template_kwargs",
      "add_generation_prompt"};
  const auto& own =
      endpoint == OpenAiEndpoint::kCompletions ? kCompletions : kChat;
  for (const auto& [key, value] : body.items()) {
    if (value.is_null() || kCommon.contains(key) || own.contains(key)) {
      continue;
    }
    return FieldError(key,
                      "is not supported by this server (refused rather than "
                      "ignored)");
  }
  return absl::OkStatus();
}

// Options we cannot honour are refused rather than silently ignored, unless
// they are at their neutral value.
absl::Status RejectUnsupported(const json& body) {
  for (const char* field : {"suffix", "functions"}) {
    auto it = body.find(field);
    if (it == body.end() || it->is_null()) continue;
    if (it->is_boolean() && !it->get<bool>()) continue;
    return FieldError(field, "is not supported");
  }
  return absl::OkStatus();
}

// Structured output, as OpenAI (`response_format`: text, json_object,
// json_schema with its `schema`) and vLLM (`guided_json` as an object or a
// string, `guided_regex`, `guided_choice`) spell it: at most one of them.
// The spec is compiled later, against the model's vocabulary (errors there
// are 400s too).
// `body_text`: the schema is taken from it in its own key order (the parsed
// `body` sorts keys, and properties are produced in their declared order).
absl::Status ReadStructuredOutput(const json& body, std::string_view body_text,
                                  engine::StructuredOutput* out) {
  auto ordered_dump = [&](std::initializer_list<const char*> path) {
    ojson node = ojson::parse(body_text, nullptr, false);
    for (const char* key : path) node = ojson(node.at(key));
    return node.dump();
  };
  using Kind = engine::StructuredOutput::Kind;
  std::vector<std::string> named;
  for (const char* field :
       {"response_format", "guided_json", "guided_regex", "guided_choice"}) {
    auto it = body.find(field);
    if (it != body.end() && !it->is_null()) named.push_back(field);
  }
  if (named.empty()) return absl::OkStatus();
  if (named.size() > 1) {
    return FieldError(named[1],
                      absl::StrCat("cannot be combined with ", named[0],
                                   " (one format per "
                                   "request)"));
  }
  const std::string& field = named[0];
  const json& value = body.at(field);
  if (field == "response_format") {
    if (!value.is_object() || !value.contains("type") ||
        !value["type"].is_string()) {
      return FieldError(field, "must be an object with a string \"type\"");
    }
    const std::string type = value["type"];
    if (type == "text") return absl::OkStatus();
    if (type == "json_object") {
      out->kind = Kind::kJsonObject;
      return absl::OkStatus();
    }
    if (type != "json_schema") {
      return FieldError(field, absl::StrCat("type \"", type,
                                            "\" is not one of text, "
                                            "json_object, json_schema"));
    }
    auto spec = value.find("json_schema");
    if (spec == value.end() || !spec->is_object()) {
      return FieldError(field,
                        "json_schema must be an object holding \"schema\"");
    }
    auto schema = spec->find("schema");
    if (schema == spec->end() ||
        !(schema->is_object() || schema->is_boolean())) {
      return FieldError(field, "json_schema.schema must be a JSON schema");
    }
    out->kind = Kind::kJsonSchema;
    out->text = ordered_dump({"response_format", "json_schema", "schema"});
    return absl::OkStatus();
  }
  if (field == "guided_json") {
    if (value.is_string()) {
      out->text = value.get<std::string>();
    } else if (value.is_object() || value.is_boolean()) {
      out->text = ordered_dump({"guided_json"});
    } else {
      return FieldError(field, "must be a JSON schema (an object or a string)");
    }
    out->kind = Kind::kJsonSchema;
    return absl::OkStatus();
  }
  if (field == "guided_regex") {
    if (!value.is_string()) return FieldError(field, "must be a string");
    out->kind = Kind::kRegex;
    out->text = value.get<std::string>();
    return absl::OkStatus();
  }
  if (!value.is_array() || value.empty()) {
    return FieldError(field, "must be a non-empty array of strings");
  }
  for (const json& c : value) {
    if (!c.is_string()) return FieldError(field, "must hold strings");
    out->choices.push_back(c.get<std::string>());
  }
  out->kind = Kind::kChoice;
  return absl::OkStatus();
}

// A number field in [least, most] (absent: `*out` unchanged).
absl::Status ReadBoundedNumber(const json& body, const char* field,
                               double least, double most, double* out) {
  if (absl::Status s = ReadNumber(body, field, out); !s.ok()) return s;
  if (!(*out >= least && *out <= most)) {
    return FieldError(field,
                      absl::StrCat("must be in [", least, ", ", most, "]"));
  }
  return absl::OkStatus();
}

// The logit processors and min_p (engine/sampler.h), as OpenAI and vLLM
// name them: presence_penalty, frequency_penalty, repetition_penalty, min_p,
// min_tokens and logit_bias ({"token id": bias}).
absl::Status ReadLogitProcessors(const json& body, int64_t max_tokens,
                                 engine::SamplingParams* sampling) {
  double presence = 0, frequency = 0, repetition = 1, min_p = 0;
  if (absl::Status s =
          ReadBoundedNumber(body, "presence_penalty", -engine::kMaxAbsPenalty,
                            engine::kMaxAbsPenalty, &presence);
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          ReadBoundedNumber(body, "frequency_penalty", -engine::kMaxAbsPenalty,
                            engine::kMaxAbsPenalty, &frequency);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = ReadNumber(body, "repetition_penalty", &repetition);
      !s.ok()) {
    return s;
  }
  if (!(repetition > 0 && repetition <= engine::kMaxRepetitionPenalty)) {
    return FieldError(
        "repetition_penalty",
        absl::StrCat("must be in (0, ", engine::kMaxRepetitionPenalty, "]"));
  }
  if (absl::Status s = ReadBoundedNumber(body, "min_p", 0, 1, &min_p);
      !s.ok()) {
    return s;
  }
  int64_t min_tokens = 0;
  if (absl::Status s = ReadInteger(body, "min_tokens", &min_tokens); !s.ok()) {
    return s;
  }
  if (min_tokens < 0 || min_tokens > max_tokens) {
    return FieldError(
        "min_tokens",
        absl::StrCat("must be in [0, max_tokens = ", max_tokens, "]"));
  }
  sampling->presence_penalty = static_cast<float>(presence);
  sampling->frequency_penalty = static_cast<float>(frequency);
  sampling->repetition_penalty = static_cast<float>(repetition);
  sampling->min_p = static_cast<float>(min_p);
  sampling->min_tokens = static_cast<int32_t>(min_tokens);
  auto it = body.find("logit_bias");
  if (it == body.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_object()) {
    return FieldError("logit_bias",
                      "must be an object of token id strings to numbers");
  }
  if (it->size() > static_cast<size_t>(engine::kMaxLogitBiasEntries)) {
    return FieldError("logit_bias",
                      absl::StrCat("has ", it->size(), " entries; at most ",
                                   engine::kMaxLogitBiasEntries));
  }
  for (const auto& [key, value] : it->items()) {
    int32_t token = 0;
    if (!absl::SimpleAtoi(key, &token) || token < 0) {
      return FieldError("logit_bias",
                        absl::StrCat("key \"", key,
                                     "\" is not a token id (a non-negative "
                                     "integer)"));
    }
    if (!value.is_number()) {
      return FieldError("logit_bias", absl::StrCat("value for token ", token,
                                                   " must be a number"));
    }
    const double bias = value.get<double>();
    if (!(std::abs(bias) <= engine::kMaxAbsLogitBias)) {
      return FieldError("logit_bias",
                        absl::StrCat("value for token ", token,
                                     " must be in [-", engine::kMaxAbsLogitBias,
                                     ", ", engine::kMaxAbsLogitBias, "]"));
    }
    sampling->logit_bias.push_back({token, static_cast<float>(bias)});
  }
  std::sort(sampling->logit_bias.begin(), sampling->logit_bias.end(),
            [](const engine::LogitBias& a, const engine::LogitBias& b) {
              return a.token < b.token;
            });
  for (size_t i = 1; i < sampling->logit_bias.size(); ++i) {
    if (sampling->logit_bias[i].token == sampling->logit_bias[i - 1].token) {
      return FieldError("logit_bias",
                        absl::StrCat("names token ",
                                     sampling->logit_bias[i].token, " twice"));
    }
  }
  return absl::OkStatus();
}

// An optional count of alternatives per token in [0, kMaxTopLogprobs].
absl::Status ReadAlternativesCount(const json& body, const char* field,
                                   int64_t* out) {
  if (absl::Status s = ReadInteger(body, field, out); !s.ok()) return s;
  if (*out < 0 || *out > kMaxTopLogprobs) {
    return FieldError(field,
                      absl::StrCat("must be in [0, ", kMaxTopLogprobs, "]"));
  }
  return absl::OkStatus();
}

// completions: "logprobs": N (0-20) asks for the tokens' logprobs and N
// alternatives each. chat: "logprobs": true, "top_logprobs": N (needs
// logprobs).
absl::Status ReadLogprobs(OpenAiEndpoint endpoint, const json& body,
                          GenerationRequest* request) {
  auto it = body.find("logprobs");
  const bool present = it != body.end() && !it->is_null();
  int64_t top = 0;
  if (endpoint == OpenAiEndpoint::kCompletions) {
    if (body.contains("top_logprobs") && !body["top_logprobs"].is_null()) {
      return FieldError("top_logprobs",
                        "is a chat option; completions take \"logprobs\": N");
    }
    if (!present || (it->is_boolean() && !it->get<bool>())) {
      return absl::OkStatus();
    }
    if (absl::Status s = ReadAlternativesCount(body, "logprobs", &top);
        !s.ok()) {
      return s;
    }
    request->logprobs = true;
    request->top_logprobs = static_cast<int32_t>(top);
    return absl::OkStatus();
  }
  if (absl::Status s = ReadBool(body, "logprobs", &request->logprobs);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = ReadAlternativesCount(body, "top_logprobs", &top);
      !s.ok()) {
    return s;
  }
  if (top > 0 && !request->logprobs) {
    return FieldError("top_logprobs", "needs \"logprobs\": true");
  }
  request->top_logprobs = static_cast<int32_t>(top);
  return absl::OkStatus();
}

const char* ErrorType(int http_status) {
  switch (http_status) {
    case 400:
    case 404:
    case 413:
    case 401:
    case 403:
      return "invalid_request_error";
    case 429:
      return "rate_limit_error";
    case 499:
      return "cancelled";
    case 501:
      return "not_implemented";
    case 503:
      return "service_unavailable";
    case 504:
      return "timeout";
    default:
      return "server_error";
  }
}

const char* ObjectName(OpenAiEndpoint endpoint, bool chunk) {
  if (endpoint == OpenAiEndpoint::kCompletions) return "text_completion";
  return chunk ? "chat.completion.chunk" : "chat.completion";
}

json UsageJson(const GenerationUsage& usage) {
  json out = {{"prompt_tokens", usage.prompt_tokens},
              {"completion_tokens", usage.completion_tokens},
              {"total_tokens", usage.prompt_tokens + usage.completion_tokens}};
  if (usage.cached_prompt_tokens > 0) {
    out["prompt_tokens_details"] = {
        {"cached_tokens", usage.cached_prompt_tokens}};
  }
  return out;
}

json FinishJson(FinishReason reason) {
  std::string name = OpenAiFinishReason(reason);
  return name.empty() ? json(nullptr) : json(name);
}

// Text from generated tokens is valid UTF-8 by the detokenizer's contract;
// replacing (not throwing) keeps a broken backend from killing the thread.
std::string Dump(const json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string Event(const json& value) {
  return absl::StrCat("data: ", Dump(value), "\n\n");
}

json BytesJson(const TokenAlternative& token) {
  if (token.bytes.empty()) return nullptr;
  json out = json::array();
  for (char c : token.bytes) out.push_back(static_cast<unsigned char>(c));
  return out;
}

json LogprobsJson(OpenAiEndpoint endpoint, const LogprobsOutput& logprobs) {
  if (!logprobs.requested) return nullptr;
  if (endpoint == OpenAiEndpoint::kChatCompletions) {
    json content = json::array();
    for (const TokenLogprob& l : logprobs.tokens) {
      json top = json::array();
      for (const TokenAlternative& t : l.top) {
        top.push_back({{"token", TokenDisplay(t)},
                       {"logprob", t.logprob},
                       {"bytes", BytesJson(t)}});
      }
      content.push_back({{"token", TokenDisplay(l.chosen)},
                         {"logprob", l.chosen.logprob},
                         {"bytes", BytesJson(l.chosen)},
                         {"top_logprobs", std::move(top)}});
    }
    return {{"content", std::move(content)}, {"refusal", nullptr}};
  }
  json tokens = json::array();
  json token_logprobs = json::array();
  json top_logprobs = json::array();
  json text_offset = json::array();
  // One listed token at `offset`; as OpenAI's legacy API, its alternatives
  // object holds the top_logprobs alternatives plus the token itself.
  auto append = [&](const TokenLogprob& l, int64_t offset) {
    const std::string shown = TokenDisplay(l.chosen);
    tokens.push_back(shown);
    token_logprobs.push_back(l.chosen.logprob);
    json alternatives = json::object();
    for (const TokenAlternative& t : l.top) {
      alternatives[TokenDisplay(t)] = t.logprob;
    }
    if (!alternatives.contains(shown)) alternatives[shown] = l.chosen.logprob;
    top_logprobs.push_back(std::move(alternatives));
    text_offset.push_back(offset);
  };
  if (logprobs.prompt.has_value()) {
    const PromptEcho& prompt = *logprobs.prompt;
    // Token 0 has no numbers: nothing precedes it.
    tokens.push_back(TokenDisplay(prompt.first_token));
    token_logprobs.push_back(nullptr);
    top_logprobs.push_back(nullptr);
    text_offset.push_back(0);
    // Offsets index the prompt text: control tokens (BOS) add nothing to it,
    // and the first word's piece carries SentencePiece's dummy-prefix space,
    // which the text does not start with.
    bool first_text_token = true;
    auto characters = [&](const TokenAlternative& token) {
      if (token.control) return int64_t{0};  // before first_text_token
      int64_t n = TokenCharacters(token);
      if (first_text_token && absl::StartsWith(token.bytes, " ") &&
          !absl::StartsWith(prompt.text, " ")) {
        --n;
      }
      first_text_token = false;
      return n;
    };
    int64_t offset = characters(prompt.first_token);
    for (const TokenLogprob& l : prompt.scored_tokens) {
      append(l, offset);
      offset += characters(l.chosen);
    }
  }
  int64_t offset = logprobs.text_offset;
  for (const TokenLogprob& l : logprobs.tokens) {
    append(l, offset);
    offset += TokenCharacters(l.chosen);
  }
  return {{"tokens", std::move(tokens)},
          {"token_logprobs", std::move(token_logprobs)},
          {"top_logprobs", std::move(top_logprobs)},
          {"text_offset", std::move(text_offset)}};
}

}  // namespace

namespace {

// The prompt(s) of a completion, or the rendered chat of a chat completion.
absl::Status ReadPromptOrChat(OpenAiEndpoint endpoint, const json& body,
                              std::string_view body_text,
                              const ChatPrompt* chat_prompt,
                              OpenAiRequest* request) {
  GenerationRequest& gen = request->generation;
  if (endpoint == OpenAiEndpoint::kCompletions) {
    PDS_RETURN_IF_ERROR(ReadPrompts(body, &request->prompts));
    gen.prompt_text = request->prompts.front().text;
    gen.prompt_ids = request->prompts.front().ids;
    return absl::OkStatus();
  }
  // Key order matters to templates (tojson of tool schemas): read the chat
  // fields from an order-keeping parse.
  const ojson ordered = ojson::parse(body_text, nullptr, false);
  ChatInput chat;
  PDS_RETURN_IF_ERROR(ReadChat(ordered, &chat, &request->messages));
  const std::unique_ptr<ChatPrompt> fallback =
      chat_prompt == nullptr ? ChatPrompt::Fallback() : nullptr;
  absl::StatusOr<RenderedChat> rendered =
      (chat_prompt != nullptr ? *chat_prompt : *fallback).Render(chat);
  if (!rendered.ok()) return rendered.status();
  gen.prompt_text = std::move(rendered->text);
  gen.add_special_tokens = rendered->add_special_tokens;
  request->tool_format = rendered->tool_format;
  request->answer_prefix = std::move(rendered->answer_prefix);
  return absl::OkStatus();
}

// max_tokens (or max_completion_tokens) and echo, checked together.
absl::Status ReadLengthAndEcho(OpenAiEndpoint endpoint, const json& body,
                               GenerationRequest* gen) {
  // The contract's default when absent, for both endpoints (OpenAI's chat
  // would run to the context; a fixed default keeps a forgotten field from
  // holding KV for minutes).
  int64_t max_tokens = rpc::kDefaultMaxTokens;
  PDS_RETURN_IF_ERROR(ReadInteger(body, "max_tokens", &max_tokens));
  PDS_RETURN_IF_ERROR(ReadInteger(body, "max_completion_tokens", &max_tokens));
  if (endpoint == OpenAiEndpoint::kCompletions) {
    PDS_RETURN_IF_ERROR(ReadBool(body, "echo", &gen->echo));
  } else if (auto it = body.find("echo");
             it != body.end() && !it->is_null() &&
             !(it->is_boolean() && !it->get<bool>())) {
    return FieldError("echo", "is a completions option");
  }
  // max_tokens 0 with echo scores the prompt (lm-eval-harness's
  // loglikelihood requests) or just returns it.
  PDS_RETURN_IF_ERROR(rpc::CheckMaxTokens(max_tokens, gen->echo));
  gen->max_tokens = static_cast<int32_t>(max_tokens);
  return absl::OkStatus();
}

// temperature, top_p, top_k, seed and the logit processors.
absl::Status ReadSampling(const json& body, int64_t max_tokens,
                          engine::SamplingParams* sampling) {
  double temperature = 1.0;  // OpenAI's default
  PDS_RETURN_IF_ERROR(ReadNumber(body, "temperature", &temperature));
  if (temperature < 0 || temperature > rpc::kMaxTemperature) {
    return FieldError("temperature", absl::StrCat("must be in [0, ",
                                                  rpc::kMaxTemperature, "]"));
  }
  double top_p = 1.0;
  PDS_RETURN_IF_ERROR(ReadNumber(body, "top_p", &top_p));
  if (top_p <= 0 || top_p > 1) return FieldError("top_p", "must be in (0, 1]");
  int64_t top_k = 0;
  PDS_RETURN_IF_ERROR(ReadInteger(body, "top_k", &top_k));
  if (top_k == -1) top_k = 0;  // vLLM's "off"
  if (top_k < 0 || top_k > std::numeric_limits<int32_t>::max()) {
    return FieldError("top_k", "must be >= 0 (or -1 for off)");
  }
  // No seed: a fresh one, so repeated sampled requests differ (OpenAI's
  // behaviour); a given seed reproduces the text.
  int64_t seed = static_cast<int64_t>(NewRandomSeed());
  PDS_RETURN_IF_ERROR(ReadInteger(body, "seed", &seed));
  sampling->temperature = static_cast<float>(temperature);
  sampling->top_p = static_cast<float>(top_p);
  sampling->top_k = static_cast<int32_t>(top_k);
  sampling->seed = static_cast<uint64_t>(seed);
  return ReadLogitProcessors(body, max_tokens, sampling);
}

// n and best_of, within the per-request and per-batch bounds.
absl::Status ReadChoiceCounts(const json& body, OpenAiRequest* request) {
  int64_t n = 1;
  PDS_RETURN_IF_ERROR(ReadInteger(body, "n", &n));
  if (n < 1 || n > kMaxChoices) {
    return FieldError("n", absl::StrCat("must be in [1, ", kMaxChoices, "]"));
  }
  request->n = static_cast<int>(n);
  // best_of: that many candidates per prompt, the n with the highest
  // cumulative log-probability returned (OpenAI's completions option).
  int64_t best_of = n;
  PDS_RETURN_IF_ERROR(ReadInteger(body, "best_of", &best_of));
  if (best_of < n || best_of > kMaxChoices) {
    return FieldError(
        "best_of", absl::StrCat("must be in [n = ", n, ", ", kMaxChoices, "]"));
  }
  request->best_of = static_cast<int>(best_of);
  if (request->prompts.size() * request->best_of > kMaxBatchChoices) {
    return FieldError(
        request->best_of > request->n ? "best_of" : "n",
        absl::StrCat("times the ", request->prompts.size(), " prompts exceeds ",
                     kMaxBatchChoices, " choices"));
  }
  return absl::OkStatus();
}

// Options that cannot go together with the others asked.
absl::Status CheckCombinations(const OpenAiRequest& request) {
  const GenerationRequest& gen = request.generation;
  if (gen.sampling.structured_output.enabled()) {
    // A completed grammar allows only EOS: running past it, or holding EOS
    // back, would leave no token to sample.
    if (gen.ignore_eos) {
      return FieldError("ignore_eos",
                        "cannot be combined with structured "
                        "output (the grammar ends the output)");
    }
    if (gen.sampling.min_tokens > 0) {
      return FieldError("min_tokens",
                        "cannot be combined with structured "
                        "output (the grammar ends the output)");
    }
    if (request.tool_format != ToolCallFormat::kNone) {
      return FieldError("tools",
                        "cannot be combined with structured output "
                        "(tool calls have their own format)");
    }
  }
  if (request.stream && request.best_of > request.n) {
    // Which candidates win is known only once all have finished.
    return FieldError("best_of", "cannot exceed n when streaming");
  }
  return absl::OkStatus();
}

// The contract's checks, for every prompt of a batch.
absl::Status ValidateEveryPrompt(const OpenAiRequest& request) {
  PDS_RETURN_IF_ERROR(ValidateGenerationRequest(request.generation));
  for (size_t p = 1; p < request.prompts.size(); ++p) {
    GenerationRequest other = request.generation;
    other.prompt_text = request.prompts[p].text;
    other.prompt_ids = request.prompts[p].ids;
    if (absl::Status s = ValidateGenerationRequest(other); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt ", p, ": ", s.message()));
    }
  }
  return absl::OkStatus();
}

// The body as a JSON object, or a precise error.
absl::StatusOr<json> ParseJsonObject(std::string_view body_text) {
  json body = json::parse(body_text, /*cb=*/nullptr,
                          /*allow_exceptions=*/false);
  if (body.is_discarded()) {
    return absl::InvalidArgumentError(
        "request body is not valid JSON (or not valid UTF-8)");
  }
  if (!body.is_object()) {
    return absl::InvalidArgumentError("request body must be a JSON object");
  }
  return body;
}

}  // namespace

absl::StatusOr<OpenAiRequest> ParseOpenAiRequest(
    OpenAiEndpoint endpoint, std::string_view body_text,
    const ChatPrompt* chat_prompt) {
  PDS_ASSIGN_OR_RETURN(json body, ParseJsonObject(body_text));
  OpenAiRequest request;
  request.endpoint = endpoint;
  GenerationRequest& gen = request.generation;

  if (auto it = body.find("model"); it != body.end() && !it->is_null()) {
    if (!it->is_string()) return FieldError("model", "must be a string");
    gen.model = it->get<std::string>();
  }
  PDS_RETURN_IF_ERROR(RejectUnknownFields(endpoint, body));
  PDS_RETURN_IF_ERROR(
      ReadPromptOrChat(endpoint, body, body_text, chat_prompt, &request));
  PDS_RETURN_IF_ERROR(RejectUnsupported(body));
  if (endpoint == OpenAiEndpoint::kCompletions && body.contains("tools") &&
      !body["tools"].is_null()) {
    return FieldError("tools", "is a chat option (/v1/chat/completions)");
  }
  PDS_RETURN_IF_ERROR(ReadLogprobs(endpoint, body, &gen));
  PDS_RETURN_IF_ERROR(ReadLengthAndEcho(endpoint, body, &gen));
  PDS_RETURN_IF_ERROR(ReadSampling(body, gen.max_tokens, &gen.sampling));
  PDS_RETURN_IF_ERROR(ReadChoiceCounts(body, &request));
  PDS_RETURN_IF_ERROR(ReadStop(body, &gen.stop));
  // vLLM's extension, sent by its benchmark_serving and genai-perf for
  // fixed-length outputs.
  PDS_RETURN_IF_ERROR(ReadBool(body, "ignore_eos", &gen.ignore_eos));
  PDS_RETURN_IF_ERROR(ReadBool(body, "stream", &request.stream));
  PDS_RETURN_IF_ERROR(
      ReadStructuredOutput(body, body_text, &gen.sampling.structured_output));
  PDS_RETURN_IF_ERROR(CheckCombinations(request));
  if (auto it = body.find("stream_options");
      it != body.end() && !it->is_null()) {
    if (!it->is_object()) {
      return FieldError("stream_options", "must be an object");
    }
    PDS_RETURN_IF_ERROR(ReadBool(*it, "include_usage", &request.include_usage));
  }
  PDS_RETURN_IF_ERROR(ValidateEveryPrompt(request));
  return request;
}

std::string RenderChatPrompt(const std::vector<ChatMessage>& messages) {
  std::string prompt;
  for (const ChatMessage& message : messages) {
    const char* role = message.role == "system" ? "System"
                       : message.role == "user" ? "User"
                       : message.role == "tool" ? "Tool"
                                                : "Assistant";
    absl::StrAppend(&prompt, role, ": ", message.content, "\n");
  }
  absl::StrAppend(&prompt, "Assistant:");
  return prompt;
}

int HttpStatusFor(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition:
      return 400;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kCancelled:
      return 499;
    case absl::StatusCode::kUnimplemented:
      return 501;
    case absl::StatusCode::kUnavailable:
      return 503;
    case absl::StatusCode::kDeadlineExceeded:
      return 504;
    default:
      return 500;
  }
}

std::string ErrorBody(int http_status, std::string_view message) {
  json error = {{"message", std::string(message)},
                {"type", ErrorType(http_status)},
                {"param", nullptr},
                {"code", nullptr}};
  if (http_status == 404) error["code"] = "model_not_found";
  if (http_status == 401) error["code"] = "invalid_api_key";
  if (http_status == 429) error["code"] = "rate_limit_exceeded";
  return Dump(json{{"error", std::move(error)}});
}

std::string ErrorBody(const absl::Status& status) {
  return ErrorBody(
      HttpStatusFor(status),
      std::string_view(status.message().data(), status.message().size()));
}

std::string TokenDisplay(const TokenAlternative& token) {
  if (token.bytes.empty()) return absl::StrCat("token_id:", token.token_id);
  if (tokenizer::IsValidUtf8(token.bytes)) return token.bytes;
  std::string shown = "bytes:";
  for (char c : token.bytes) {
    absl::StrAppendFormat(&shown, "\\x%02x", static_cast<unsigned char>(c));
  }
  return shown;
}

int64_t TextCharacters(std::string_view text) {
  int64_t characters = 0;
  for (char c : text) characters += (c & 0xC0) != 0x80 ? 1 : 0;
  return characters;
}

int64_t TokenCharacters(const TokenAlternative& token) {
  return token.control ? 0 : TextCharacters(token.bytes);
}

std::string OpenAiFinishReason(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    default:
      return "";
  }
}

GenerationUsage CombinedUsage(const std::vector<GenerationUsage>& choices,
                              int choices_per_prompt) {
  GenerationUsage total;
  const size_t per_prompt = std::max(1, choices_per_prompt);
  for (size_t i = 0; i < choices.size(); ++i) {
    const GenerationUsage& u = choices[i];
    if (i % per_prompt == 0) {
      total.prompt_tokens += u.prompt_tokens;
      total.cached_prompt_tokens += u.cached_prompt_tokens;
    }
    total.completion_tokens += u.completion_tokens;
  }
  return total;
}

namespace {

// OpenAI's tool_calls array; stream deltas number the calls (`index`).
json ToolCallsJson(const std::vector<ToolCall>& calls, bool indexed) {
  json out = json::array();
  for (size_t i = 0; i < calls.size(); ++i) {
    json call = {
        {"id", calls[i].id},
        {"type", "function"},
        {"function",
         {{"name", calls[i].name}, {"arguments", calls[i].arguments}}}};
    if (indexed) call["index"] = i;
    out.push_back(std::move(call));
  }
  return out;
}

}  // namespace

std::vector<CompletionOutcome> BestCandidates(
    std::vector<CompletionOutcome> candidates, int per_prompt, int n,
    bool keep_logprobs) {
  std::vector<CompletionOutcome> best;
  if (per_prompt <= 0) return best;
  const size_t prompts = candidates.size() / per_prompt;
  for (size_t p = 0; p < prompts; ++p) {
    std::vector<std::pair<double, int>> ranked;  // (-cumulative, index)
    for (int i = 0; i < per_prompt; ++i) {
      const CompletionOutcome& c = candidates[p * per_prompt + i];
      double cumulative = 0;
      for (const TokenLogprob& t : c.logprobs.tokens) {
        cumulative += t.chosen.logprob;
      }
      ranked.push_back({-cumulative, i});
    }
    std::sort(ranked.begin(), ranked.end());
    int32_t dropped_tokens = 0;
    for (int k = std::min(n, per_prompt); k < per_prompt; ++k) {
      dropped_tokens +=
          candidates[p * per_prompt + ranked[k].second].usage.completion_tokens;
    }
    for (int k = 0; k < std::min(n, per_prompt); ++k) {
      CompletionOutcome& c = candidates[p * per_prompt + ranked[k].second];
      if (k == 0) c.usage.completion_tokens += dropped_tokens;
      if (!keep_logprobs) c.logprobs.tokens.clear();
      c.logprobs.requested = keep_logprobs;
      best.push_back(std::move(c));
    }
  }
  return best;
}

std::string CompletionBody(OpenAiEndpoint endpoint, std::string_view id,
                           int64_t created, std::string_view model,
                           const std::vector<CompletionOutcome>& outcomes,
                           int choices_per_prompt) {
  json choices = json::array();
  std::vector<GenerationUsage> usages;
  for (size_t i = 0; i < outcomes.size(); ++i) {
    const CompletionOutcome& outcome = outcomes[i];
    json choice = {{"index", i},
                   {"logprobs", LogprobsJson(endpoint, outcome.logprobs)},
                   {"finish_reason", FinishJson(outcome.finish_reason)}};
    if (endpoint == OpenAiEndpoint::kCompletions) {
      choice["text"] = outcome.text;
    } else if (!outcome.tool_calls.empty()) {
      // OpenAI's shape for an answer that calls tools: content null unless
      // the model also wrote text, finish_reason "tool_calls".
      choice["message"] = {
          {"role", "assistant"},
          {"content", outcome.text.empty() ? json() : json(outcome.text)},
          {"tool_calls", ToolCallsJson(outcome.tool_calls, /*indexed=*/false)}};
      choice["finish_reason"] = "tool_calls";
    } else {
      choice["message"] = {{"role", "assistant"}, {"content", outcome.text}};
    }
    choices.push_back(std::move(choice));
    usages.push_back(outcome.usage);
  }
  json body = {{"id", std::string(id)},
               {"object", ObjectName(endpoint, /*chunk=*/false)},
               {"created", created},
               {"model", std::string(model)},
               {"choices", std::move(choices)},
               {"usage", UsageJson(CombinedUsage(usages, choices_per_prompt))}};
  return Dump(body);
}

std::string StreamChunkEvent(OpenAiEndpoint endpoint, std::string_view id,
                             int64_t created, std::string_view model,
                             std::string_view text, FinishReason finish_reason,
                             bool first, const LogprobsOutput& logprobs,
                             int choice_index) {
  json choice = {{"index", choice_index},
                 {"logprobs", LogprobsJson(endpoint, logprobs)},
                 {"finish_reason", FinishJson(finish_reason)}};
  if (endpoint == OpenAiEndpoint::kCompletions) {
    choice["text"] = std::string(text);
  } else {
    json delta = json::object();
    if (first) delta["role"] = "assistant";
    if (!text.empty() || first) delta["content"] = std::string(text);
    choice["delta"] = std::move(delta);
  }
  json chunk = {{"id", std::string(id)},
                {"object", ObjectName(endpoint, /*chunk=*/true)},
                {"created", created},
                {"model", std::string(model)},
                {"choices", json::array({std::move(choice)})}};
  return Event(chunk);
}

std::string StreamToolCallsEvent(std::string_view id, int64_t created,
                                 std::string_view model,
                                 const std::vector<ToolCall>& calls,
                                 int choice_index) {
  json choice = {
      {"index", choice_index},
      {"logprobs", nullptr},
      {"finish_reason", "tool_calls"},
      {"delta", {{"tool_calls", ToolCallsJson(calls, /*indexed=*/true)}}}};
  json chunk = {{"id", std::string(id)},
                {"object", ObjectName(OpenAiEndpoint::kChatCompletions,
                                      /*chunk=*/true)},
                {"created", created},
                {"model", std::string(model)},
                {"choices", json::array({std::move(choice)})}};
  return Event(chunk);
}

std::string StreamUsageEvent(OpenAiEndpoint endpoint, std::string_view id,
                             int64_t created, std::string_view model,
                             const GenerationUsage& usage) {
  json chunk = {{"id", std::string(id)},
                {"object", ObjectName(endpoint, /*chunk=*/true)},
                {"created", created},
                {"model", std::string(model)},
                {"choices", json::array()},
                {"usage", UsageJson(usage)}};
  return Event(chunk);
}

std::string StreamErrorEvent(const absl::Status& status) {
  return absl::StrCat("data: ", ErrorBody(status), "\n\n");
}

namespace {

json ModelObject(const ModelDescription& model, int64_t created) {
  return {{"id", model.name},
          {"object", "model"},
          {"created", created},
          {"owned_by", "pdserve"},
          {"max_model_len", model.context_length}};
}

// A JSON object body with only `allowed` fields (null = absent).
absl::StatusOr<json> ParseObjectWithFields(
    std::string_view body_text,
    std::initializer_list<std::string_view> allowed) {
  PDS_ASSIGN_OR_RETURN(json body, ParseJsonObject(body_text));
  for (const auto& [key, value] : body.items()) {
    if (value.is_null()) continue;
    if (std::find(allowed.begin(), allowed.end(), key) == allowed.end()) {
      return FieldError(key,
                        "is not supported by this server (refused rather "
                        "than ignored)");
    }
  }
  return body;
}

absl::Status ReadModel(const json& body, std::string* model) {
  if (auto it = body.find("model"); it != body.end() && !it->is_null()) {
    if (!it->is_string()) return FieldError("model", "must be a string");
    *model = it->get<std::string>();
  }
  return absl::OkStatus();
}

}  // namespace

std::string ModelsBody(const std::vector<ModelDescription>& models,
                       int64_t created) {
  json data = json::array();
  for (const ModelDescription& model : models) {
    data.push_back(ModelObject(model, created));
  }
  return Dump(json{{"object", "list"}, {"data", std::move(data)}});
}

std::string ModelBody(const ModelDescription& model, int64_t created) {
  return Dump(ModelObject(model, created));
}

absl::StatusOr<TokenizeRequest> ParseTokenizeRequest(
    std::string_view text, const ChatPrompt* chat_prompt) {
  absl::StatusOr<json> body = ParseObjectWithFields(
      text, {"model", "prompt", "messages", "add_special_tokens", "tools",
             "tool_choice", "chat_template_kwargs", "add_generation_prompt"});
  if (!body.ok()) return body.status();
  TokenizeRequest request;
  PDS_RETURN_IF_ERROR(ReadModel(*body, &request.model));
  PDS_RETURN_IF_ERROR(
      ReadBool(*body, "add_special_tokens", &request.add_special_tokens));
  const bool has_prompt =
      body->contains("prompt") && !(*body)["prompt"].is_null();
  const bool has_messages =
      body->contains("messages") && !(*body)["messages"].is_null();
  if (has_prompt == has_messages) {
    return absl::InvalidArgumentError(
        "send exactly one of 'prompt' (a string) or 'messages'");
  }
  if (has_prompt) {
    if (!(*body)["prompt"].is_string()) {
      return FieldError("prompt", "must be a string");
    }
    request.text = (*body)["prompt"].get<std::string>();
    return request;
  }
  // As /v1/chat/completions renders it: the ids the model would see.
  const ojson ordered = ojson::parse(text, nullptr, false);
  ChatInput chat;
  std::vector<ChatMessage> plain;
  PDS_RETURN_IF_ERROR(ReadChat(ordered, &chat, &plain));
  const std::unique_ptr<ChatPrompt> fallback =
      chat_prompt == nullptr ? ChatPrompt::Fallback() : nullptr;
  absl::StatusOr<RenderedChat> rendered =
      (chat_prompt != nullptr ? *chat_prompt : *fallback).Render(chat);
  if (!rendered.ok()) return rendered.status();
  request.text = std::move(rendered->text);
  if (!body->contains("add_special_tokens") ||
      (*body)["add_special_tokens"].is_null()) {
    request.add_special_tokens = rendered->add_special_tokens;
  }
  return request;
}

std::string TokenizeBody(const std::vector<int32_t>& ids,
                         int32_t max_model_len) {
  return Dump(json{{"count", ids.size()},
                   {"max_model_len", max_model_len},
                   {"tokens", ids}});
}

absl::StatusOr<DetokenizeRequest> ParseDetokenizeRequest(
    std::string_view text) {
  absl::StatusOr<json> body = ParseObjectWithFields(text, {"model", "tokens"});
  if (!body.ok()) return body.status();
  DetokenizeRequest request;
  PDS_RETURN_IF_ERROR(ReadModel(*body, &request.model));
  auto it = body->find("tokens");
  if (it == body->end() || it->is_null()) {
    return FieldError("tokens", "is required");
  }
  if (!it->is_array()) return FieldError("tokens", "must be an array of ids");
  for (const json& id : *it) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
        id.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      return FieldError("tokens", "must hold non-negative integer ids");
    }
    request.tokens.push_back(static_cast<int32_t>(id.get<int64_t>()));
  }
  return request;
}

std::string DetokenizeBody(std::string_view text) {
  return Dump(json{{"prompt", text}});
}

}  // namespace pdserve::router
