// Regular expressions (the JavaScript `u`-mode subset README.md lists) to
// grammar rules. The whole pattern must match (anchors ^ and $ are allowed only
// at its ends, where they change nothing).
#pragma once

#include <string_view>

#include "absl/status/statusor.h"
#include "grammar/grammar_ir.h"

namespace pdserve::grammar::internal {

struct RegexOptions {
  // Match the pattern against a JSON string's contents: characters JSON must
  // escape (", \, U+0000..U+001F) are produced escaped (\" \\ \n \u001f).
  bool json_string_contents = false;
  int max_pattern_bytes = 4096;
  int max_nesting = 64;
  int max_repeat = 1000;  // the largest n/m of {n,m}
};

// A symbol matching exactly the strings of `pattern`. Errors:
// INVALID_ARGUMENT "regex /…/: <what> at offset N" for syntax errors,
// unsupported constructs (backreferences, lookaround, \b, \p{…}, flags) and
// limits.
[[nodiscard]] absl::StatusOr<Symbol> CompileRegex(std::string_view pattern,
                                                  const RegexOptions& options,
                                                  GrammarBuilder* builder);

// A symbol for one character of `set` inside a JSON string (escaped where
// JSON requires).
Symbol JsonStringCharacters(const CodePointSet& set, GrammarBuilder* builder);

}  // namespace pdserve::grammar::internal
