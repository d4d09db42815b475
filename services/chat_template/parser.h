// Tokens -> syntax tree, a port of @huggingface/jinja's recursive-descent
// parser (same precedence, same quirks), with a nesting limit so that no
// source can exhaust the stack.
#pragma once

#include <string_view>
#include <vector>

#include "chat_template/ast.h"
#include "chat_template/lexer.h"

namespace pdserve::chat_template::internal {

// Deeper nesting (parentheses, nested blocks, chained unary operators) is a
// syntax error.
inline constexpr int kMaxParseDepth = 100;

// Throws TemplateError naming `origin`, the line and what is wrong.
Program Parse(const std::vector<Token>& tokens, std::string_view source,
              std::string_view origin);

}  // namespace pdserve::chat_template::internal
