#include "chat_template/lexer.h"

#include <cctype>

#include "absl/strings/str_cat.h"
#include "chat_template/unicode.h"
#include "chat_template/value.h"

namespace pdserve::chat_template::internal {

const char* TokenTypeName(TokenType type) {
  static constexpr const char* kNames[] = {
      "Text",
      "NumericLiteral",
      "StringLiteral",
      "Identifier",
      "Equals",
      "OpenParen",
      "CloseParen",
      "OpenStatement",
      "CloseStatement",
      "OpenExpression",
      "CloseExpression",
      "OpenSquareBracket",
      "CloseSquareBracket",
      "OpenCurlyBracket",
      "CloseCurlyBracket",
      "Comma",
      "Dot",
      "Colon",
      "Pipe",
      "CallOperator",
      "AdditiveBinaryOperator",
      "MultiplicativeBinaryOperator",
      "ExponentiationBinaryOperator",
      "ComparisonBinaryOperator",
      "UnaryOperator",
      "Comment",
  };
  return kNames[static_cast<int>(type)];
}

Position PositionOf(std::string_view source, uint32_t offset) {
  Position p{1, 1};
  for (size_t i = 0; i < offset && i < source.size(); ++i) {
    if (source[i] == '\n') {
      ++p.line;
      p.column = 1;
    } else {
      ++p.column;
    }
  }
  return p;
}

namespace {

// The preprocessed text with, for each byte, its offset in the original
// source (for error positions).
struct Mapped {
  std::string text;
  std::vector<uint32_t> origin;

  void Append(const Mapped& from, size_t begin, size_t end) {
    text.append(from.text, begin, end - begin);
    origin.insert(origin.end(), from.origin.begin() + begin,
                  from.origin.begin() + end);
  }
};

bool IsLineTerminatorBefore(const std::string& s, size_t pos) {
  // JavaScript's multiline `^`: after \n, \r, U+2028 or U+2029.
  if (pos == 0) return true;
  const char c = s[pos - 1];
  if (c == '\n' || c == '\r') return true;
  return pos >= 3 && (s.compare(pos - 3, 3, "\xE2\x80\xA8") == 0 ||
                      s.compare(pos - 3, 3, "\xE2\x80\xA9") == 0);
}

// Matches /{%(-?)\s*(?:end)?generation\s*(-?)%}(\s*)/ at `pos`.
bool MatchGenerationTag(const std::string& s, size_t pos, bool& lstrip,
                        bool& rstrip, size_t& after_begin, size_t& end) {
  if (s.compare(pos, 2, "{%") != 0) return false;
  size_t i = pos + 2;
  lstrip = i < s.size() && s[i] == '-';
  if (lstrip) ++i;
  while (size_t n = JsWhitespaceAt(s, i)) i += n;
  if (s.compare(i, 3, "end") == 0 && s.compare(i + 3, 10, "generation") == 0) {
    i += 3;
  }
  if (s.compare(i, 10, "generation") != 0) return false;
  i += 10;
  while (size_t n = JsWhitespaceAt(s, i)) i += n;
  rstrip = i < s.size() && s[i] == '-' && s.compare(i + 1, 2, "%}") == 0;
  if (rstrip) ++i;
  if (s.compare(i, 2, "%}") != 0) return false;
  i += 2;
  after_begin = i;
  while (size_t n = JsWhitespaceAt(s, i)) i += n;
  end = i;
  return true;
}

Mapped Preprocess(std::string_view source) {
  Mapped m;
  m.text.assign(source);
  m.origin.resize(source.size());
  for (size_t i = 0; i < source.size(); ++i) m.origin[i] = i;
  if (!m.text.empty() && m.text.back() == '\n') {
    m.text.pop_back();
    m.origin.pop_back();
  }
  // lstrip_blocks: /^[ \t]*({[#%-])/gm -> "$1".
  {
    Mapped out;
    size_t i = 0;
    while (i < m.text.size()) {
      if (IsLineTerminatorBefore(m.text, i)) {
        size_t j = i;
        while (j < m.text.size() && (m.text[j] == ' ' || m.text[j] == '\t')) {
          ++j;
        }
        if (j + 1 < m.text.size() && m.text[j] == '{' &&
            (m.text[j + 1] == '#' || m.text[j + 1] == '%' ||
             m.text[j + 1] == '-')) {
          out.Append(m, j, j + 2);
          i = j + 2;
          continue;
        }
      }
      out.Append(m, i, i + 1);
      ++i;
    }
    m = std::move(out);
  }
  // trim_blocks: /([#%-]})\n/g -> "$1".
  {
    Mapped out;
    size_t i = 0;
    while (i < m.text.size()) {
      const char c = m.text[i];
      if ((c == '#' || c == '%' || c == '-') && i + 2 < m.text.size() &&
          m.text[i + 1] == '}' && m.text[i + 2] == '\n') {
        out.Append(m, i, i + 2);
        i += 3;
        continue;
      }
      out.Append(m, i, i + 1);
      ++i;
    }
    m = std::move(out);
  }
  // transformers' {% generation %} / {% endgeneration %} tags vanish.
  {
    Mapped out;
    size_t last = 0;
    size_t pos = 0;
    while ((pos = m.text.find("{%", pos)) != std::string::npos) {
      bool lstrip = false, rstrip = false;
      size_t after_begin = 0, end = 0;
      if (!MatchGenerationTag(m.text, pos, lstrip, rstrip, after_begin, end)) {
        ++pos;
        continue;
      }
      size_t text_end = pos;
      while (lstrip && text_end > last) {
        // Step back over whitespace code points.
        size_t start = text_end - 1;
        while (start > last &&
               (static_cast<unsigned char>(m.text[start]) & 0xC0) == 0x80) {
          --start;
        }
        if (JsWhitespaceAt(m.text, start) != text_end - start) break;
        text_end = start;
      }
      out.Append(m, last, text_end);
      if (!rstrip) out.Append(m, after_begin, end);
      last = end;
      pos = end;
    }
    out.Append(m, last, m.text.size());
    m = std::move(out);
  }
  return m;
}

bool IsWord(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
         (c >= '0' && c <= '9') || c == '_';
}
bool IsDigit(char c) { return c >= '0' && c <= '9'; }

struct Rule {
  const char* seq;
  TokenType type;
};
// The reference's ORDERED_MAPPING_TABLE, in order.
constexpr Rule kRules[] = {
    {"{%", TokenType::kOpenStatement},
    {"%}", TokenType::kCloseStatement},
    {"{{", TokenType::kOpenExpression},
    {"}}", TokenType::kCloseExpression},
    {"(", TokenType::kOpenParen},
    {")", TokenType::kCloseParen},
    {"{", TokenType::kOpenCurlyBracket},
    {"}", TokenType::kCloseCurlyBracket},
    {"[", TokenType::kOpenSquareBracket},
    {"]", TokenType::kCloseSquareBracket},
    {",", TokenType::kComma},
    {".", TokenType::kDot},
    {":", TokenType::kColon},
    {"|", TokenType::kPipe},
    {"<=", TokenType::kComparisonBinaryOperator},
    {">=", TokenType::kComparisonBinaryOperator},
    {"==", TokenType::kComparisonBinaryOperator},
    {"!=", TokenType::kComparisonBinaryOperator},
    {"<", TokenType::kComparisonBinaryOperator},
    {">", TokenType::kComparisonBinaryOperator},
    {"+", TokenType::kAdditiveBinaryOperator},
    {"-", TokenType::kAdditiveBinaryOperator},
    {"~", TokenType::kAdditiveBinaryOperator},
    {"**", TokenType::kExponentiationBinaryOperator},
    {"*", TokenType::kMultiplicativeBinaryOperator},
    {"//", TokenType::kMultiplicativeBinaryOperator},
    {"/", TokenType::kMultiplicativeBinaryOperator},
    {"%", TokenType::kMultiplicativeBinaryOperator},
    {"=", TokenType::kEquals},
};

class Lexer {
 public:
  Lexer(std::string_view source, std::string_view origin)
      : source_(source), origin_(origin), m_(Preprocess(source)) {}

  std::vector<Token> Run() {
    const std::string& src = m_.text;
    const size_t length = src.size();
    while (pos_ < length) {
      const bool have_last = !tokens_.empty();
      const TokenType last = have_last ? tokens_.back().type : TokenType::kText;
      if (!have_last || last == TokenType::kCloseStatement ||
          last == TokenType::kCloseExpression || last == TokenType::kComment) {
        size_t end = pos_;
        while (true) {
          end = src.find('{', end);
          if (end == std::string::npos) {
            end = length;
            break;
          }
          const char next = end + 1 < length ? src[end + 1] : '\0';
          if (next == '%' || next == '{' || next == '#') break;
          ++end;
        }
        if (end > pos_) {
          Push(TokenType::kText, src.substr(pos_, end - pos_), pos_);
          pos_ = end;
          continue;
        }
      }
      if (src[pos_] == '{') {
        const char next = At(pos_ + 1);
        if (next == '#') {
          const size_t start = pos_;
          pos_ += 2;
          const bool strip_before = At(pos_) == '-';
          if (strip_before) ++pos_;
          const size_t end = src.find("#}", pos_);
          if (end == std::string::npos)
            Error("Missing end of comment tag", start);
          std::string comment = src.substr(pos_, end - pos_);
          const bool strip_after = !comment.empty() && comment.back() == '-';
          if (strip_after) comment.pop_back();
          if (strip_before) StripTrailingWhitespace();
          Push(TokenType::kComment, std::move(comment), start);
          pos_ = end + 2;
          if (strip_after) SkipLeadingWhitespace();
          continue;
        }
        if (At(pos_ + 2) == '-') {
          if (next == '%') {
            StripTrailingWhitespace();
            Push(TokenType::kOpenStatement, "{%", pos_);
            pos_ += 3;
            continue;
          }
          if (next == '{') {
            StripTrailingWhitespace();
            Push(TokenType::kOpenExpression, "{{", pos_);
            curly_depth_ = 0;
            pos_ += 3;
            continue;
          }
        }
      }
      ConsumeWhile([&](size_t p) { return JsWhitespaceAt(src, p); });
      const char c = src[pos_];
      if (c == '-' && At(pos_ + 2) == '}') {
        const char next = At(pos_ + 1);
        if (next == '%' || next == '}') {
          Push(next == '%' ? TokenType::kCloseStatement
                           : TokenType::kCloseExpression,
               next == '%' ? "%}" : "}}", pos_);
          pos_ += 3;
          SkipLeadingWhitespace();
          continue;
        }
      }
      if (c == '-' || c == '+') {
        if (!have_last || last == TokenType::kText) {
          Error(absl::StrCat("Unexpected character: ", std::string(1, c)),
                pos_);
        }
        switch (last) {
          case TokenType::kIdentifier:
          case TokenType::kNumericLiteral:
          case TokenType::kStringLiteral:
          case TokenType::kCloseParen:
          case TokenType::kCloseSquareBracket:
            break;  // A binary operator.
          default: {
            const size_t start = pos_;
            ++pos_;
            std::string num = ConsumeWhile(
                [&](size_t p) -> size_t { return IsDigit(src[p]) ? 1 : 0; });
            if (!num.empty() && At(pos_) == '.' && IsDigit(At(pos_ + 1))) {
              ++pos_;
              num += "." + ConsumeWhile([&](size_t p) -> size_t {
                       return IsDigit(src[p]) ? 1 : 0;
                     });
            }
            Push(num.empty() ? TokenType::kUnaryOperator
                             : TokenType::kNumericLiteral,
                 std::string(1, c) + num, start);
            continue;
          }
        }
      }
      bool matched = false;
      for (const Rule& rule : kRules) {
        if (rule.seq[0] != c) continue;
        const std::string_view seq = rule.seq;
        if (seq == "}}" && curly_depth_ > 0) continue;
        if (src.compare(pos_, seq.size(), seq) != 0) continue;
        Push(rule.type, std::string(seq), pos_);
        if (rule.type == TokenType::kOpenExpression) {
          curly_depth_ = 0;
        } else if (rule.type == TokenType::kOpenCurlyBracket) {
          ++curly_depth_;
        } else if (rule.type == TokenType::kCloseCurlyBracket) {
          --curly_depth_;
        }
        pos_ += seq.size();
        matched = true;
        break;
      }
      if (matched) continue;
      if (c == '\'' || c == '"') {
        const size_t start = pos_;
        ++pos_;
        std::string str = ConsumeString(c, start);
        Push(TokenType::kStringLiteral, std::move(str), start);
        ++pos_;
        continue;
      }
      if (IsDigit(c)) {
        const size_t start = pos_;
        std::string num = ConsumeWhile(
            [&](size_t p) -> size_t { return IsDigit(src[p]) ? 1 : 0; });
        if (last != TokenType::kDot && At(pos_) == '.' &&
            IsDigit(At(pos_ + 1))) {
          ++pos_;
          num += "." + ConsumeWhile([&](size_t p) -> size_t {
                   return IsDigit(src[p]) ? 1 : 0;
                 });
        }
        Push(TokenType::kNumericLiteral, std::move(num), start);
        continue;
      }
      if (IsWord(c)) {
        const size_t start = pos_;
        std::string word = ConsumeWhile(
            [&](size_t p) -> size_t { return IsWord(src[p]) ? 1 : 0; });
        Push(TokenType::kIdentifier, std::move(word), start);
        continue;
      }
      size_t next = pos_;
      std::string shown;
      AppendUtf8(DecodeUtf8(src, next), shown);
      Error(absl::StrCat("Unexpected character: ", shown), pos_);
    }
    return std::move(tokens_);
  }

 private:
  char At(size_t p) const { return p < m_.text.size() ? m_.text[p] : '\0'; }

  uint32_t Origin(size_t p) const {
    if (m_.origin.empty()) return 0;
    return m_.origin[p < m_.origin.size() ? p : m_.origin.size() - 1];
  }

  [[noreturn]] void Error(const std::string& what, size_t p) const {
    const Position pos = PositionOf(source_, Origin(p));
    Fail(absl::StrCat(std::string(origin_), ":", pos.line, ":", pos.column,
                      ": syntax error: ", what));
  }

  void Push(TokenType type, std::string value, size_t p) {
    tokens_.push_back(Token{type, std::move(value), Origin(p)});
  }

  // Consumes while `width(pos)` > 0; like the reference, running into the
  // end of the input while the predicate holds is an error.
  template <typename Width>
  std::string ConsumeWhile(Width width) {
    const size_t start = pos_;
    while (pos_ < m_.text.size()) {
      const size_t n = width(pos_);
      if (n == 0) break;
      pos_ += n;
      if (pos_ >= m_.text.size()) Error("Unexpected end of input", start);
    }
    return m_.text.substr(start, pos_ - start);
  }

  std::string ConsumeString(char quote, size_t start) {
    const std::string& src = m_.text;
    std::string out;
    while (true) {
      if (pos_ >= src.size()) Error("Unexpected end of input", start);
      const char c = src[pos_];
      if (c == quote) break;
      ++pos_;
      if (c != '\\') {
        out.push_back(c);
        continue;
      }
      if (pos_ >= src.size()) Error("Unexpected end of input", start);
      const char e = src[pos_++];
      switch (e) {
        case 'n':
          out.push_back('\n');
          break;
        case 't':
          out.push_back('\t');
          break;
        case 'r':
          out.push_back('\r');
          break;
        case 'b':
          out.push_back('\b');
          break;
        case 'f':
          out.push_back('\f');
          break;
        case 'v':
          out.push_back('\v');
          break;
        case '\'':
        case '"':
        case '\\':
          out.push_back(e);
          break;
        case 'x':
        case 'u': {
          const size_t n = e == 'x' ? 2 : 4;
          const std::string hex = src.substr(pos_, n);
          bool ok = hex.size() == n;
          for (char h : hex)
            ok = ok && std::isxdigit(static_cast<unsigned char>(h));
          if (!ok) {
            Error(absl::StrCat("Invalid hexadecimal escape sequence: \\",
                               std::string(1, e), hex),
                  pos_);
          }
          AppendEscapedUnit(static_cast<uint32_t>(std::stoul(hex, nullptr, 16)),
                            out);
          pos_ += n;
          break;
        }
        default: {
          size_t next = pos_ - 1;
          std::string shown;
          AppendUtf8(DecodeUtf8(src, next), shown);
          Error(absl::StrCat("Unexpected escaped character: ", shown), pos_);
        }
      }
    }
    return out;
  }

  // String.fromCharCode: a \uD83D\uDE00 pair becomes one code point.
  static void AppendEscapedUnit(uint32_t unit, std::string& out) {
    if (unit >= 0xDC00 && unit < 0xE000 && out.size() >= 3) {
      size_t p = out.size() - 3;
      const uint32_t prev = DecodeUtf8(out, p);
      if (prev >= 0xD800 && prev < 0xDC00 && p == out.size()) {
        out.resize(out.size() - 3);
        AppendUtf8(0x10000 + ((prev - 0xD800) << 10) + (unit - 0xDC00), out);
        return;
      }
    }
    AppendUtf8(unit, out);
  }

  void StripTrailingWhitespace() {
    if (tokens_.empty() || tokens_.back().type != TokenType::kText) return;
    std::string& text = tokens_.back().value;
    text.resize(TrimEnd(text).size());
    if (text.empty()) tokens_.pop_back();
  }

  void SkipLeadingWhitespace() {
    while (size_t n = JsWhitespaceAt(m_.text, pos_)) pos_ += n;
  }

  std::string_view source_;
  std::string_view origin_;
  Mapped m_;
  size_t pos_ = 0;
  int curly_depth_ = 0;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> Tokenize(std::string_view source, std::string_view origin) {
  return Lexer(source, origin).Run();
}

}  // namespace pdserve::chat_template::internal
