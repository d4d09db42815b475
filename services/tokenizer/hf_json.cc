#include "tokenizer/hf_json.h"

#include "absl/strings/str_cat.h"

namespace pdserve::tokenizer::hf {

JsonPath JsonPath::Key(absl::string_view key) const {
  return JsonPath(file_, path_.empty() ? std::string(key.data(), key.size())
                                       : absl::StrCat(path_, ".", key));
}

JsonPath JsonPath::Index(size_t i) const {
  return JsonPath(file_, absl::StrCat(path_, "[", i, "]"));
}

absl::Status JsonPath::Error(absl::string_view what) const {
  return absl::InvalidArgumentError(absl::StrCat(
      file_, ": ", path_.empty() ? std::string("(top level)") : path_, ": ",
      what));
}

absl::StatusOr<const Json*> Member(const Json& j, std::string_view key,
                                   const JsonPath& at) {
  if (!j.is_object()) {
    return at.Error(absl::StrCat("expected an object, found ", j.type_name()));
  }
  auto it = j.find(std::string(key));
  if (it == j.end() || it->is_null()) return nullptr;
  return &*it;
}

absl::StatusOr<std::string> GetString(const Json& j, std::string_view key,
                                      const JsonPath& at,
                                      std::string fallback) {
  absl::StatusOr<const Json*> v = Member(j, key, at);
  if (!v.ok()) return v.status();
  if (*v == nullptr) return fallback;
  if (!(*v)->is_string()) {
    return at.Key(absl::string_view(key.data(), key.size()))
        .Error(absl::StrCat("expected a string, found ", (*v)->type_name()));
  }
  return (*v)->get<std::string>();
}

absl::StatusOr<bool> GetBool(const Json& j, std::string_view key,
                             const JsonPath& at, bool fallback) {
  absl::StatusOr<const Json*> v = Member(j, key, at);
  if (!v.ok()) return v.status();
  if (*v == nullptr) return fallback;
  if (!(*v)->is_boolean()) {
    return at.Key(absl::string_view(key.data(), key.size()))
        .Error(
            absl::StrCat("expected true or false, found ", (*v)->type_name()));
  }
  return (*v)->get<bool>();
}

absl::StatusOr<int64_t> GetInt(const Json& j, std::string_view key,
                               const JsonPath& at, int64_t fallback) {
  absl::StatusOr<const Json*> v = Member(j, key, at);
  if (!v.ok()) return v.status();
  if (*v == nullptr) return fallback;
  if (!(*v)->is_number_integer()) {
    return at.Key(absl::string_view(key.data(), key.size()))
        .Error(absl::StrCat("expected an integer, found ", (*v)->type_name()));
  }
  return (*v)->get<int64_t>();
}

absl::StatusOr<std::string> GetType(const Json& j, const JsonPath& at) {
  absl::StatusOr<const Json*> v = Member(j, "type", at);
  if (!v.ok()) return v.status();
  if (*v == nullptr || !(*v)->is_string()) {
    return at.Key("type").Error("missing component type (a string)");
  }
  return (*v)->get<std::string>();
}

absl::StatusOr<Regex> ParsePattern(const Json& pattern, const JsonPath& at) {
  if (!pattern.is_object()) {
    return at.Error(
        "expected a pattern object {\"String\": ...} or "
        "{\"Regex\": ...}");
  }
  if (auto it = pattern.find("String"); it != pattern.end()) {
    if (!it->is_string()) return at.Key("String").Error("expected a string");
    return Regex::Compile(QuoteLiteral(it->get<std::string>()));
  }
  if (auto it = pattern.find("Regex"); it != pattern.end()) {
    const JsonPath here = at.Key("Regex");
    if (!it->is_string()) return here.Error("expected a string");
    absl::StatusOr<std::string> translated =
        TranslateOniguruma(it->get<std::string>());
    if (!translated.ok()) return here.Error(translated.status().message());
    absl::StatusOr<Regex> regex = Regex::Compile(*translated);
    if (!regex.ok()) return here.Error(regex.status().message());
    return regex;
  }
  return at.Error("expected a pattern object with \"String\" or \"Regex\"");
}

}  // namespace pdserve::tokenizer::hf
