#include "grammar/regex_compiler.h"

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pdserve::grammar::internal {
namespace {

constexpr uint32_t kMaxCodePoint = 0x10FFFF;

bool IsSurrogate(uint32_t c) { return c >= 0xD800 && c <= 0xDFFF; }

// Decodes strict UTF-8; false on any invalid sequence.
bool DecodeUtf8(std::string_view s, std::vector<uint32_t>* out,
                size_t* bad_offset) {
  size_t i = 0;
  while (i < s.size()) {
    const uint8_t b = static_cast<uint8_t>(s[i]);
    int length;
    uint32_t c;
    if (b < 0x80) {
      length = 1;
      c = b;
    } else if (b >= 0xC2 && b <= 0xDF) {
      length = 2;
      c = b & 0x1F;
    } else if (b >= 0xE0 && b <= 0xEF) {
      length = 3;
      c = b & 0x0F;
    } else if (b >= 0xF0 && b <= 0xF4) {
      length = 4;
      c = b & 0x07;
    } else {
      *bad_offset = i;
      return false;
    }
    if (i + length > s.size()) {
      *bad_offset = i;
      return false;
    }
    for (int k = 1; k < length; ++k) {
      const uint8_t cont = static_cast<uint8_t>(s[i + k]);
      if ((cont & 0xC0) != 0x80) {
        *bad_offset = i;
        return false;
      }
      c = (c << 6) | (cont & 0x3F);
    }
    const uint32_t min = length == 2 ? 0x80 : length == 3 ? 0x800 : 0x10000;
    if ((length > 1 && c < min) || c > kMaxCodePoint || IsSurrogate(c)) {
      *bad_offset = i;
      return false;
    }
    out->push_back(c);
    i += length;
  }
  return true;
}

CodePointSet Digits() {
  CodePointSet s;
  s.Add('0', '9');
  return s;
}
CodePointSet WordCharacters() {
  CodePointSet s;
  s.Add('0', '9');
  s.Add('A', 'Z');
  s.Add('a', 'z');
  s.Add('_', '_');
  return s;
}
// JavaScript's \s: WhiteSpace and LineTerminator.
CodePointSet Spaces() {
  CodePointSet s;
  for (uint32_t c : {0x09u, 0x0Au, 0x0Bu, 0x0Cu, 0x0Du, 0x20u, 0xA0u, 0x1680u,
                     0x2028u, 0x2029u, 0x202Fu, 0x205Fu, 0x3000u, 0xFEFFu}) {
    s.Add(c, c);
  }
  s.Add(0x2000, 0x200A);
  return s;
}
// JavaScript's `.` without the s flag: anything but a line terminator.
CodePointSet AnyButLineTerminator() {
  CodePointSet s;
  for (uint32_t c : {0x0Au, 0x0Du, 0x2028u, 0x2029u}) s.Add(c, c);
  return s.Complement();
}

bool IsSyntaxCharacter(uint32_t c) {
  return c < 0x80 &&
         std::string_view("^$\\.*+?()[]{}|/-").find(static_cast<char>(c)) !=
             std::string_view::npos;
}

int HexValue(uint32_t c) {
  if (c >= '0' && c <= '9') return static_cast<int>(c - '0');
  if (c >= 'a' && c <= 'f') return static_cast<int>(c - 'a' + 10);
  if (c >= 'A' && c <= 'F') return static_cast<int>(c - 'A' + 10);
  return -1;
}

// The JSON escape for a character JSON cannot hold raw.
std::string JsonEscape(uint32_t c) {
  switch (c) {
    case '"':
      return "\\\"";
    case '\\':
      return "\\\\";
    case '\n':
      return "\\n";
    case '\r':
      return "\\r";
    case '\t':
      return "\\t";
    case '\b':
      return "\\b";
    case '\f':
      return "\\f";
    default:
      return absl::StrFormat("\\u%04x", c);
  }
}

class RegexParser {
 public:
  RegexParser(std::string_view pattern, const RegexOptions& options,
              GrammarBuilder* builder)
      : pattern_(pattern), options_(options), b_(*builder) {}

  absl::StatusOr<Symbol> Parse() {
    if (static_cast<int>(pattern_.size()) > options_.max_pattern_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("regex is ", pattern_.size(), " bytes; the limit is ",
                       options_.max_pattern_bytes));
    }
    size_t bad = 0;
    if (!DecodeUtf8(pattern_, &cps_, &bad)) {
      return absl::InvalidArgumentError(
          absl::StrCat("regex is not valid UTF-8 at byte ", bad));
    }
    size_t end = cps_.size();
    if (end > 0 && cps_[0] == '^') pos_ = 1;
    // A trailing unescaped $ is an anchor (count the backslashes before it).
    if (end > pos_ && cps_[end - 1] == '$') {
      size_t slashes = 0;
      while (end - 1 - slashes > pos_ && cps_[end - 2 - slashes] == '\\') {
        ++slashes;
      }
      if (slashes % 2 == 0) --end;
    }
    end_ = end;
    Symbol s = ParseAlternation(0);
    if (!error_.ok()) return error_;
    if (pos_ != end_) {
      Fail(cps_[pos_] == ')' ? "unmatched ')'" : "unexpected character");
      return error_;
    }
    if (!b_.status().ok()) return b_.status();
    return s;
  }

 private:
  void Fail(const std::string& what) {
    if (error_.ok()) {
      error_ = absl::InvalidArgumentError(
          absl::StrCat("regex /", std::string(pattern_.substr(0, 200)),
                       "/: ", what, " at offset ", ByteOffset(pos_)));
    }
  }
  size_t ByteOffset(size_t cp_index) const {
    size_t bytes = 0;
    for (size_t i = 0; i < cp_index && i < cps_.size(); ++i) {
      std::string tmp;
      AppendUtf8(cps_[i], &tmp);
      bytes += tmp.size();
    }
    return bytes;
  }
  bool AtEnd() const { return pos_ >= end_; }
  uint32_t Peek() const { return cps_[pos_]; }

  Symbol Never() { return Symbol{true, b_.NewRule()}; }

  Symbol ParseAlternation(int depth) {
    if (depth > options_.max_nesting) {
      Fail(absl::StrCat("groups nested deeper than ", options_.max_nesting));
      return Never();
    }
    std::vector<Sequence> branches;
    branches.push_back(ParseConcatenation(depth));
    while (error_.ok() && !AtEnd() && Peek() == '|') {
      ++pos_;
      branches.push_back(ParseConcatenation(depth));
    }
    if (!error_.ok()) return Never();
    if (branches.size() == 1) {
      if (branches[0].empty()) return Symbol{true, b_.Choice({{}})};
      return b_.Wrap(branches[0]);
    }
    return Symbol{true, b_.Choice(branches)};
  }

  Sequence ParseConcatenation(int depth) {
    Sequence seq;
    while (error_.ok() && !AtEnd() && Peek() != '|' && Peek() != ')') {
      Sequence atom = ParseAtom(depth);
      if (!error_.ok()) break;
      ParseQuantifier(&atom);
      if (!error_.ok()) break;
      seq.insert(seq.end(), atom.begin(), atom.end());
      if (!b_.status().ok()) break;
    }
    return seq;
  }

  // Reads digits; -1 when there are none.
  int64_t ParseNumber() {
    int64_t n = -1;
    while (!AtEnd() && Peek() >= '0' && Peek() <= '9') {
      n = (n < 0 ? 0 : n) * 10 + (Peek() - '0');
      if (n > 1'000'000'000) n = 1'000'000'000;
      ++pos_;
    }
    return n;
  }

  void ParseQuantifier(Sequence* atom) {
    if (AtEnd()) return;
    int64_t min, max;
    const uint32_t c = Peek();
    if (c == '*') {
      min = 0, max = -1;
      ++pos_;
    } else if (c == '+') {
      min = 1, max = -1;
      ++pos_;
    } else if (c == '?') {
      min = 0, max = 1;
      ++pos_;
    } else if (c == '{') {
      ++pos_;
      min = ParseNumber();
      if (min < 0) {
        Fail("'{' that does not start a quantifier {n}, {n,} or {n,m}");
        return;
      }
      max = min;
      if (!AtEnd() && Peek() == ',') {
        ++pos_;
        max = ParseNumber();  // -1: unbounded
      }
      if (AtEnd() || Peek() != '}') {
        Fail("unterminated quantifier {");
        return;
      }
      ++pos_;
      if (max >= 0 && max < min) {
        Fail("quantifier {n,m} with m < n");
        return;
      }
      if (min > options_.max_repeat || max > options_.max_repeat) {
        Fail(absl::StrCat("repetition count above ", options_.max_repeat));
        return;
      }
    } else {
      return;
    }
    if (atom->empty()) {
      Fail("nothing to repeat");
      return;
    }
    if (!AtEnd() && Peek() == '?') ++pos_;  // lazy: the same language
    if (!AtEnd() &&
        (Peek() == '*' || Peek() == '+' || Peek() == '?' || Peek() == '{')) {
      Fail("nothing to repeat (a quantifier after a quantifier)");
      return;
    }
    *atom = {b_.Repeat(b_.Wrap(*atom), min, max)};
  }

  Sequence Character(uint32_t c) {
    Sequence seq;
    std::string bytes;
    if (options_.json_string_contents && (c < 0x20 || c == '"' || c == '\\')) {
      bytes = JsonEscape(c);
    } else {
      AppendUtf8(c, &bytes);
    }
    b_.AppendLiteral(bytes, &seq);
    return seq;
  }

  Sequence Set(const CodePointSet& set) {
    if (options_.json_string_contents) return {JsonStringCharacters(set, &b_)};
    return {b_.Utf8(set)};
  }

  Sequence ParseAtom(int depth) {
    const uint32_t c = Peek();
    switch (c) {
      case '(':
        return ParseGroup(depth);
      case '[': {
        CodePointSet set = ParseClass();
        if (!error_.ok()) return {};
        return Set(set);
      }
      case '.':
        ++pos_;
        return Set(AnyButLineTerminator());
      case '\\': {
        ++pos_;
        CodePointSet set;
        uint32_t literal = 0;
        if (!ParseEscape(/*in_class=*/false, &set, &literal)) return {};
        if (!set.empty()) return Set(set);
        return Character(literal);
      }
      case '^':
        Fail("'^' is only supported at the start of the pattern");
        return {};
      case '$':
        Fail("'$' is only supported at the end of the pattern");
        return {};
      case '*':
      case '+':
      case '?':
        Fail("nothing to repeat");
        return {};
      case '{':
        Fail("'{' that does not follow an atom");
        return {};
      case '}':
      case ']':
        Fail(absl::StrCat("lone '", std::string(1, static_cast<char>(c)),
                          "' (escape it)"));
        return {};
      default:
        ++pos_;
        return Character(c);
    }
  }

  Sequence ParseGroup(int depth) {
    ++pos_;  // (
    if (!AtEnd() && Peek() == '?') {
      ++pos_;
      if (AtEnd()) {
        Fail("unterminated group");
        return {};
      }
      const uint32_t kind = Peek();
      if (kind == ':') {
        ++pos_;
      } else if (kind == '<' && pos_ + 1 < end_ && cps_[pos_ + 1] != '=' &&
                 cps_[pos_ + 1] != '!') {
        // Named group: the name does not change the language.
        while (!AtEnd() && Peek() != '>') ++pos_;
        if (AtEnd()) {
          Fail("unterminated group name");
          return {};
        }
        ++pos_;
      } else if (kind == '=' || kind == '!' || kind == '<') {
        Fail("lookaround assertions are not supported");
        return {};
      } else {
        Fail("inline flags and other (?…) groups are not supported");
        return {};
      }
    }
    Symbol inner = ParseAlternation(depth + 1);
    if (!error_.ok()) return {};
    if (AtEnd() || Peek() != ')') {
      Fail("missing ')'");
      return {};
    }
    ++pos_;
    return {inner};
  }

  // After a backslash. Sets `set` for a class escape, else `literal`.
  bool ParseEscape(bool in_class, CodePointSet* set, uint32_t* literal) {
    if (AtEnd()) {
      Fail("trailing backslash");
      return false;
    }
    const size_t start = pos_ - 1;  // the backslash: errors point at it
    const uint32_t c = Peek();
    ++pos_;
    switch (c) {
      case 'd':
        *set = Digits();
        return true;
      case 'D':
        *set = Digits().Complement();
        return true;
      case 'w':
        *set = WordCharacters();
        return true;
      case 'W':
        *set = WordCharacters().Complement();
        return true;
      case 's':
        *set = Spaces();
        return true;
      case 'S':
        *set = Spaces().Complement();
        return true;
      case 't':
        *literal = '\t';
        return true;
      case 'n':
        *literal = '\n';
        return true;
      case 'r':
        *literal = '\r';
        return true;
      case 'f':
        *literal = '\f';
        return true;
      case 'v':
        *literal = '\v';
        return true;
      case '0':
        if (!AtEnd() && Peek() >= '0' && Peek() <= '9') {
          pos_ = start;
          Fail("octal escapes are not supported");
          return false;
        }
        *literal = 0;
        return true;
      case 'x': {
        if (pos_ + 2 > end_ || HexValue(cps_[pos_]) < 0 ||
            HexValue(cps_[pos_ + 1]) < 0) {
          Fail("\\x needs two hex digits");
          return false;
        }
        *literal = HexValue(cps_[pos_]) * 16 + HexValue(cps_[pos_ + 1]);
        pos_ += 2;
        return true;
      }
      case 'u': {
        uint32_t value = 0;
        if (!AtEnd() && Peek() == '{') {
          ++pos_;
          int digits = 0;
          while (!AtEnd() && HexValue(Peek()) >= 0 && digits < 7) {
            value = value * 16 + HexValue(Peek());
            ++pos_, ++digits;
          }
          if (digits == 0 || AtEnd() || Peek() != '}' ||
              value > kMaxCodePoint) {
            Fail("\\u{…} needs 1 to 6 hex digits up to 10FFFF");
            return false;
          }
          ++pos_;
        } else {
          if (pos_ + 4 > end_) {
            Fail("\\u needs four hex digits");
            return false;
          }
          for (int k = 0; k < 4; ++k) {
            const int h = HexValue(cps_[pos_ + k]);
            if (h < 0) {
              Fail("\\u needs four hex digits");
              return false;
            }
            value = value * 16 + h;
          }
          pos_ += 4;
        }
        if (IsSurrogate(value)) {
          Fail("surrogate escapes (\\uD800-\\uDFFF) are not supported");
          return false;
        }
        *literal = value;
        return true;
      }
      case 'b':
        if (in_class) {
          *literal = '\b';
          return true;
        }
        pos_ = start;
        Fail("word boundaries (\\b) are not supported");
        return false;
      case 'B':
        pos_ = start;
        Fail("word boundaries (\\B) are not supported");
        return false;
      case 'p':
      case 'P':
        pos_ = start;
        Fail("Unicode property escapes (\\p{…}) are not supported");
        return false;
      case 'k':
        pos_ = start;
        Fail("backreferences are not supported");
        return false;
      case 'c':
        pos_ = start;
        Fail("control escapes (\\cX) are not supported");
        return false;
      default:
        if (c >= '1' && c <= '9') {
          pos_ = start;
          Fail("backreferences are not supported");
          return false;
        }
        if (IsSyntaxCharacter(c)) {
          *literal = c;
          return true;
        }
        pos_ = start;
        Fail("unknown escape");
        return false;
    }
  }

  // One class member: a character (returned in `literal`) or a class escape.
  bool ParseClassAtom(CodePointSet* set, uint32_t* literal) {
    const uint32_t c = Peek();
    ++pos_;
    if (c == '\\') return ParseEscape(/*in_class=*/true, set, literal);
    *literal = c;
    return true;
  }

  CodePointSet ParseClass() {
    ++pos_;  // [
    bool negated = false;
    if (!AtEnd() && Peek() == '^') {
      negated = true;
      ++pos_;
    }
    CodePointSet set;
    while (true) {
      if (AtEnd()) {
        Fail("missing ']'");
        return {};
      }
      if (Peek() == ']') {
        ++pos_;
        break;
      }
      CodePointSet first_set;
      uint32_t first = 0;
      if (!ParseClassAtom(&first_set, &first)) return {};
      if (!first_set.empty()) {
        set.Add(first_set);
        continue;
      }
      if (pos_ + 1 < end_ && Peek() == '-' && cps_[pos_ + 1] != ']') {
        ++pos_;
        CodePointSet last_set;
        uint32_t last = 0;
        if (!ParseClassAtom(&last_set, &last)) return {};
        if (!last_set.empty()) {
          Fail("a class escape cannot end a range");
          return {};
        }
        if (last < first) {
          Fail("range out of order in character class");
          return {};
        }
        set.Add(first, last);
      } else {
        set.Add(first, first);
      }
    }
    return negated ? set.Complement() : set;
  }

  std::string_view pattern_;
  const RegexOptions& options_;
  GrammarBuilder& b_;
  std::vector<uint32_t> cps_;
  size_t pos_ = 0;
  size_t end_ = 0;
  absl::Status error_;
};

}  // namespace

Symbol JsonStringCharacters(const CodePointSet& set, GrammarBuilder* builder) {
  CodePointSet raw;
  std::vector<uint32_t> escaped;
  for (const auto& [lo, hi] : set.ranges()) {
    for (uint32_t c = lo; c <= hi && c < 0x60; ++c) {
      if (c < 0x20 || c == '"' || c == '\\') escaped.push_back(c);
    }
  }
  CodePointSet specials;
  specials.Add(0, 0x1F);
  specials.Add('"', '"');
  specials.Add('\\', '\\');
  CodePointSet allowed = specials.Complement();
  // raw = set ∩ allowed = complement(complement(set) ∪ specials)
  CodePointSet outside = set.Complement();
  outside.Add(specials);
  raw = outside.Complement();
  (void)allowed;
  const int32_t rule = builder->NewRule();
  if (!raw.empty()) builder->AddAlternative(rule, {builder->Utf8(raw)});
  for (uint32_t c : escaped) {
    Sequence seq;
    builder->AppendLiteral(JsonEscape(c), &seq);
    builder->AddAlternative(rule, seq);
  }
  return GrammarBuilder::Ref(rule);
}

absl::StatusOr<Symbol> CompileRegex(std::string_view pattern,
                                    const RegexOptions& options,
                                    GrammarBuilder* builder) {
  RegexParser parser(pattern, options, builder);
  return parser.Parse();
}

}  // namespace pdserve::grammar::internal
