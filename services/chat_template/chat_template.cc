#include "chat_template/chat_template.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "chat_template/interpreter.h"
#include "chat_template/lexer.h"
#include "chat_template/parser.h"

namespace pdserve::chat_template {
namespace {

using internal::Kind;
using internal::TemplateError;
using internal::Value;

constexpr size_t kMaxSourceBytes = size_t{1} << 20;
constexpr char kRaisedPayload[] = "pdserve.chat_template/raised";

absl::Status ToStatus(const TemplateError& e) {
  absl::Status status(e.code, e.message);
  if (e.raised) status.SetPayload(kRaisedPayload, absl::Cord("1"));
  return status;
}

// A canonical array index ("0", "17"; not "01" or "-1"): JavaScript objects
// list these keys first, in numeric order, whatever the order in the JSON.
bool IsArrayIndex(const std::string& key, double& index) {
  if (key.empty() || key.size() > 10) return false;
  if (key.size() > 1 && key[0] == '0') return false;
  for (char c : key) {
    if (c < '0' || c > '9') return false;
  }
  index = std::strtod(key.c_str(), nullptr);
  return index < 4294967295.0;
}

template <typename Json>
Value FromJson(const Json& j, int depth, int max_depth,
               internal::Interpreter& in) {
  if (depth > max_depth) {
    internal::Fail(
        absl::StrCat("the context nests deeper than ", max_depth, " levels"));
  }
  in.Charge(1);
  switch (j.type()) {
    case Json::value_t::null:
    case Json::value_t::discarded:
      return Value::Null();
    case Json::value_t::boolean:
      return Value::Bool(j.template get<bool>());
    case Json::value_t::number_integer:
      return Value::Int(static_cast<double>(j.template get<int64_t>()));
    case Json::value_t::number_unsigned:
      return Value::Int(static_cast<double>(j.template get<uint64_t>()));
    case Json::value_t::number_float: {
      // JSON.parse has one number type: an integral value is an integer.
      const double d = j.template get<double>();
      return std::isfinite(d) && std::floor(d) == d ? Value::Int(d)
                                                    : Value::Float(d);
    }
    case Json::value_t::string:
      return in.NewString(j.template get_ref<const std::string&>());
    case Json::value_t::array: {
      in.CheckItems(j.size());
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& item : j) {
        items.push_back(FromJson(item, depth + 1, max_depth, in));
      }
      return Value::Array(std::move(items));
    }
    case Json::value_t::object: {
      in.CheckItems(j.size());
      std::vector<std::pair<double, const std::string*>> indexed;
      for (auto it = j.begin(); it != j.end(); ++it) {
        double index;
        if (IsArrayIndex(it.key(), index))
          indexed.emplace_back(index, &it.key());
      }
      std::sort(indexed.begin(), indexed.end());
      auto data = std::make_shared<internal::ObjectData>();
      for (const auto& [index, key] : indexed) {
        data->Set(*key, FromJson(j.at(*key), depth + 1, max_depth, in));
      }
      for (auto it = j.begin(); it != j.end(); ++it) {
        double index;
        if (IsArrayIndex(it.key(), index)) continue;
        data->Set(it.key(), FromJson(it.value(), depth + 1, max_depth, in));
      }
      return Value::Object(std::move(data));
    }
    case Json::value_t::binary:
      internal::Fail("the context holds binary data");
  }
  return Value::Null();
}

}  // namespace

absl::StatusOr<ChatTemplate> ChatTemplate::Parse(std::string_view source,
                                                 std::string_view origin) {
  if (source.size() > kMaxSourceBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(origin), ": chat template of ", source.size(),
                     " bytes is larger than ", kMaxSourceBytes));
  }
  ChatTemplate t;
  t.origin_ = std::string(origin);
  t.source_ = std::make_shared<const std::string>(source);
  try {
    const std::vector<internal::Token> tokens =
        internal::Tokenize(*t.source_, t.origin_);
    t.program_ = std::make_shared<const internal::Program>(
        internal::Parse(tokens, *t.source_, t.origin_));
  } catch (const TemplateError& e) {
    return ToStatus(e);
  }
  return t;
}

template <typename Json>
absl::StatusOr<std::string> ChatTemplate::RenderImpl(
    const Json& context, const RenderOptions& options) const {
  if (!context.is_object() && !context.is_null()) {
    return absl::InvalidArgumentError(
        absl::StrCat(origin_, ": the render context must be a JSON object"));
  }
  internal::Limits limits;
  limits.max_output_bytes = options.limits.max_output_bytes;
  limits.max_steps = options.limits.max_steps;
  limits.max_depth = options.limits.max_depth;
  limits.max_items = options.limits.max_items;
  limits.max_json_depth = options.limits.max_context_depth;
  try {
    internal::Interpreter interpreter(limits, *source_, origin_,
                                      options.local_time);
    std::shared_ptr<internal::Scope> global = interpreter.MakeGlobals();
    if (context.is_object()) {
      for (auto it = context.begin(); it != context.end(); ++it) {
        // The reference declares context variables next to its globals and
        // refuses to redeclare one.
        if (global->vars.contains(it.key())) {
          return absl::InvalidArgumentError(
              absl::StrCat(origin_, ": Variable already declared: ", it.key()));
        }
      }
      for (auto it = context.begin(); it != context.end(); ++it) {
        global->Set(it.key(), FromJson(it.value(), 1, limits.max_json_depth,
                                       interpreter));
      }
    }
    std::string out = interpreter.Run(*program_, global);
    global.reset();
    return out;
  } catch (const TemplateError& e) {
    return ToStatus(e);
  }
}

absl::StatusOr<std::string> ChatTemplate::Render(
    const nlohmann::ordered_json& context, const RenderOptions& options) const {
  return RenderImpl(context, options);
}

absl::StatusOr<std::string> ChatTemplate::Render(
    const nlohmann::json& context, const RenderOptions& options) const {
  return RenderImpl(context, options);
}

bool IsRaisedByTemplate(const absl::Status& status) {
  return status.GetPayload(kRaisedPayload).has_value();
}

// ---- tokenizer_config.json ----

const std::string* TokenizerConfigTemplates::Select(bool has_tools) const {
  if (has_tools) {
    auto it = templates.find("tool_use");
    if (it != templates.end()) return &it->second;
  }
  auto it = templates.find("default");
  return it == templates.end() ? nullptr : &it->second;
}

namespace {

absl::StatusOr<std::string> ReadToken(const nlohmann::ordered_json& config,
                                      const char* key,
                                      std::string_view origin) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::string();
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {
    auto content = it->find("content");
    if (content != it->end() && content->is_string()) {
      return content->get<std::string>();
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat(std::string(origin), ": \"", key,
                   "\" must be a string or an object with a string "
                   "\"content\""));
}

}  // namespace

absl::StatusOr<TokenizerConfigTemplates> ReadTokenizerConfig(
    const nlohmann::ordered_json& config, std::string_view origin) {
  if (!config.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(
        std::string(origin), ": a tokenizer config must be a JSON object"));
  }
  TokenizerConfigTemplates out;
  auto bos = ReadToken(config, "bos_token", origin);
  if (!bos.ok()) return bos.status();
  out.bos_token = *std::move(bos);
  auto eos = ReadToken(config, "eos_token", origin);
  if (!eos.ok()) return eos.status();
  out.eos_token = *std::move(eos);
  auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) return out;
  if (it->is_string()) {
    out.templates["default"] = it->get<std::string>();
    return out;
  }
  if (!it->is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(origin),
                     ": \"chat_template\" must be a string or a list of "
                     "{\"name\", \"template\"} objects"));
  }
  for (size_t i = 0; i < it->size(); ++i) {
    const auto& entry = (*it)[i];
    const auto name = entry.is_object() ? entry.find("name") : entry.end();
    const auto text = entry.is_object() ? entry.find("template") : entry.end();
    if (!entry.is_object() || name == entry.end() || !name->is_string() ||
        text == entry.end() || !text->is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(
          std::string(origin), ": \"chat_template\"[", i,
          "] must be an object with string \"name\" and \"template\""));
    }
    out.templates[name->get<std::string>()] = text->get<std::string>();
  }
  return out;
}

absl::StatusOr<TokenizerConfigTemplates> ReadTokenizerConfigFile(
    const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  nlohmann::ordered_json config =
      nlohmann::ordered_json::parse(buffer.str(), nullptr, false);
  if (config.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not valid JSON"));
  }
  return ReadTokenizerConfig(config, path);
}

}  // namespace pdserve::chat_template
