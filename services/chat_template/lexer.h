// Template source -> tokens, a port of @huggingface/jinja's lexer including
// its preprocessing (trailing newline, lstrip_blocks, trim_blocks and the
// transformers `{% generation %}` tags), so whitespace comes out identical.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace pdserve::chat_template::internal {

enum class TokenType : uint8_t {
  kText,
  kNumericLiteral,
  kStringLiteral,
  kIdentifier,
  kEquals,
  kOpenParen,
  kCloseParen,
  kOpenStatement,
  kCloseStatement,
  kOpenExpression,
  kCloseExpression,
  kOpenSquareBracket,
  kCloseSquareBracket,
  kOpenCurlyBracket,
  kCloseCurlyBracket,
  kComma,
  kDot,
  kColon,
  kPipe,
  kCallOperator,
  kAdditiveBinaryOperator,
  kMultiplicativeBinaryOperator,
  kExponentiationBinaryOperator,
  kComparisonBinaryOperator,
  kUnaryOperator,
  kComment,
};

const char* TokenTypeName(TokenType type);

struct Token {
  TokenType type;
  std::string value;
  uint32_t offset;  // Byte offset in the original source.
};

// Line (1-based) and column of byte `offset` of `source`.
struct Position {
  int line;
  int column;
};
Position PositionOf(std::string_view source, uint32_t offset);

// Throws TemplateError (with the position in the message) on bad input.
std::vector<Token> Tokenize(std::string_view source, std::string_view origin);

}  // namespace pdserve::chat_template::internal
