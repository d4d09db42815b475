// Reading tokenizer.json with errors that name the file, the JSON key path
// (e.g. `pre_tokenizer.pretokenizers[0].pattern.Regex`) and what is wrong.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"
#include "tokenizer/hf_regex.h"

namespace pdserve::tokenizer::hf {

using Json = nlohmann::json;

// Where a JSON value sits: the file it came from and its key path.
class JsonPath {
 public:
  JsonPath(std::string file, std::string path)
      : file_(std::move(file)), path_(std::move(path)) {}

  JsonPath Key(absl::string_view key) const;
  JsonPath Index(size_t i) const;
  const std::string& file() const { return file_; }
  const std::string& path() const { return path_; }

  // INVALID_ARGUMENT "<file>: <path>: <what>".
  absl::Status Error(absl::string_view what) const;

 private:
  std::string file_;
  std::string path_;
};

// `j[key]` when present and not null, else nullptr. Errors when `j` is not an
// object.
[[nodiscard]] absl::StatusOr<const Json*> Member(const Json& j,
                                                 std::string_view key,
                                                 const JsonPath& at);

// Typed optional getters: `fallback` when missing or null, an error naming
// the key when present with the wrong type.
[[nodiscard]] absl::StatusOr<std::string> GetString(const Json& j,
                                                    std::string_view key,
                                                    const JsonPath& at,
                                                    std::string fallback = "");
[[nodiscard]] absl::StatusOr<bool> GetBool(const Json& j, std::string_view key,
                                           const JsonPath& at, bool fallback);
[[nodiscard]] absl::StatusOr<int64_t> GetInt(const Json& j,
                                             std::string_view key,
                                             const JsonPath& at,
                                             int64_t fallback);
// The required "type" string of a component.
[[nodiscard]] absl::StatusOr<std::string> GetType(const Json& j,
                                                  const JsonPath& at);

// A `pattern` object: {"String": "..."} (matched literally) or
// {"Regex": "..."} (Oniguruma syntax, translated; see TranslateOniguruma).
// Errors name the key and, for a bad regex, PCRE2's complaint.
[[nodiscard]] absl::StatusOr<Regex> ParsePattern(const Json& pattern,
                                                 const JsonPath& at);

}  // namespace pdserve::tokenizer::hf
