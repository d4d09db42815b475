// JSON schemas (the subset README.md lists) and "any JSON object" to grammar
// rules. Whatever the grammar accepts parses as JSON and validates against
// the schema; keywords outside the subset are INVALID_ARGUMENT naming the
// keyword and its JSON path, never ignored.
#pragma once

#include <string_view>

#include "absl/status/statusor.h"
#include "grammar/grammar_ir.h"

namespace pdserve::grammar::internal {

struct JsonGrammarOptions {
  int max_whitespace = 20;     // bytes of [ \t\n\r] per gap
  int max_schema_depth = 32;   // nested subschemas
  int max_subschemas = 10000;  // subschemas compiled, $ref targets included
  int max_schema_bytes = 1 << 20;
};

// The rule of the whole output: optional whitespace, a value of `schema`,
// optional whitespace.
[[nodiscard]] absl::StatusOr<int32_t> CompileJsonSchema(
    std::string_view schema, const JsonGrammarOptions& options,
    GrammarBuilder* builder);

// The rule of any JSON object (OpenAI's json_object mode), whitespace around.
[[nodiscard]] absl::StatusOr<int32_t> CompileAnyJsonObject(
    const JsonGrammarOptions& options, GrammarBuilder* builder);

}  // namespace pdserve::grammar::internal
