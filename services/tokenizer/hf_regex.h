// PCRE2 (UTF + Unicode properties, JIT) behind a small RAII wrapper, and the
// translation of the Oniguruma patterns tokenizer.json files carry into PCRE2
// syntax with the semantics the JavaScript reference gives them.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

struct pcre2_real_code_8;

namespace pdserve::tokenizer::hf {

// Rewrites an Oniguruma pattern (as written in tokenizer.json `Regex`) into
// PCRE2 syntax: `\s`/`\S` become the Unicode White_Space property (what
// Oniguruma means; PCRE2's \s differs at U+0085/U+180E across versions),
// `\d` is \p{Nd}, `\w` the Unicode word class, and inline case-insensitive
// groups `(?i:...)` fold ASCII letters only (PCRE2 10.42 would also fold
// U+017F and U+212A into s and k; Oniguruma's and the reference's behaviour
// on these real patterns is ASCII folding). INVALID_ARGUMENT for constructs
// PCRE2 cannot express the same way (nested classes, `&&` intersections).
[[nodiscard]] absl::StatusOr<std::string> TranslateOniguruma(
    std::string_view pattern);

// JavaScript's whitespace (`\s`, String.prototype.trim): White_Space
// without U+0085, plus U+FEFF, as a PCRE2 group.
inline constexpr char kJsWhitespace[] =
    "(?:(?!\\x{85})\\p{White_Space}|\\x{FEFF})";
inline constexpr char kJsNonWhitespace[] =
    "(?:\\x{85}|(?!\\x{FEFF})\\P{White_Space})";

// Quotes `literal` so that PCRE2 matches it verbatim.
std::string QuoteLiteral(std::string_view literal);

// An immutable compiled pattern; copies share the code. Thread-safe: each
// thread matches with its own match data.
class Regex {
 public:
  // `pattern` in PCRE2 syntax, compiled UTF | UCP | MULTILINE (Oniguruma's
  // ^ and $ are line anchors), JIT-compiled when the platform allows.
  // INVALID_ARGUMENT with PCRE2's message and offset for a bad pattern.
  [[nodiscard]] static absl::StatusOr<Regex> Compile(std::string_view pattern);

  // Calls `fn(begin, end)` (byte offsets) for every match in `text`, left to
  // right, as JavaScript's matchAll with the `gu` flags: after an empty match
  // the search resumes one character later. `text` must be valid UTF-8.
  // INTERNAL when PCRE2 gives up (match limit).
  [[nodiscard]] absl::Status ForEachMatch(
      std::string_view text,
      const std::function<void(size_t, size_t)>& fn) const;

  // Convenience: replaces every match with `replacement` (no group refs).
  [[nodiscard]] absl::StatusOr<std::string> ReplaceAll(
      std::string_view text, std::string_view replacement) const;

 private:
  struct Deleter {
    void operator()(pcre2_real_code_8* code) const;
  };
  std::shared_ptr<pcre2_real_code_8> code_;
};

}  // namespace pdserve::tokenizer::hf
