#include "tokenizer/hf_regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "tokenizer/utf8.h"

namespace pdserve::tokenizer::hf {
namespace {

// The reference's word class (Oniguruma's \w in Unicode mode).
constexpr char kWordChars[] =
    "\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\x{B2}\\x{B3}\\x{B9}\\x{BC}-\\x{BE}";

bool IsAsciiLetter(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}
char OtherCase(char c) { return c ^ 0x20; }

// Class-safe spelling of a shorthand escape, or empty if not a shorthand.
std::string ClassShorthand(char e) {
  switch (e) {
    case 's':
      return "\\p{White_Space}";
    case 'S':
      return "\\P{White_Space}";
    case 'd':
      return "\\p{Nd}";
    case 'D':
      return "\\P{Nd}";
    case 'w':
      return std::string(kWordChars);
    case 'h':
      return "0-9A-Fa-f";
    default:
      return "";
  }
}

// Copies one escape sequence starting at pattern[i] == '\\' into `out` and
// returns its length. Braced forms (\p{..}, \x{..}) are copied whole.
size_t CopyEscape(std::string_view p, size_t i, std::string* out) {
  size_t len = 2;
  if (i + 1 < p.size()) {
    const char e = p[i + 1];
    if ((e == 'p' || e == 'P' || e == 'x') && i + 2 < p.size() &&
        p[i + 2] == '{') {
      const size_t close = p.find('}', i + 2);
      len = close == std::string_view::npos ? p.size() - i : close - i + 1;
    }
  } else {
    len = 1;
  }
  out->append(p.substr(i, len));
  return len;
}

}  // namespace

absl::StatusOr<std::string> TranslateOniguruma(std::string_view p) {
  std::string out;
  out.reserve(p.size() * 2);
  // One entry per open group: whether ASCII letters fold inside it.
  std::vector<bool> caseless = {false};
  size_t i = 0;
  while (i < p.size()) {
    const char c = p[i];
    if (c == '\\') {
      if (i + 1 >= p.size()) {
        return absl::InvalidArgumentError("pattern ends with a lone backslash");
      }
      const char e = p[i + 1];
      if (e == 'w' || e == 'W') {
        absl::StrAppend(&out, e == 'w' ? "[" : "[^", kWordChars, "]");
        i += 2;
      } else if (std::string s = ClassShorthand(e); !s.empty() && e != 'w') {
        out += e == 'h' ? "[" + s + "]" : s;
        i += 2;
      } else if (e == 'H') {
        out += "[^0-9A-Fa-f]";
        i += 2;
      } else {
        i += CopyEscape(p, i, &out);
      }
      continue;
    }
    if (c == '(') {
      if (p.substr(i, 4) == "(?i:") {
        caseless.push_back(true);
        out += "(?:";
        i += 4;
        continue;
      }
      if (p.substr(i, 5) == "(?-i:") {
        caseless.push_back(false);
        out += "(?:";
        i += 5;
        continue;
      }
      if (p.substr(i, 4) == "(?i)") {
        caseless.back() = true;
        i += 4;
        continue;
      }
      caseless.push_back(caseless.back());
      out += c;
      ++i;
      continue;
    }
    if (c == ')') {
      if (caseless.size() > 1) caseless.pop_back();
      out += c;
      ++i;
      continue;
    }
    if (c == '[') {
      // A character class, copied with shorthands expanded and, in a
      // caseless group, the other case of each ASCII letter (and range)
      // added.
      const bool fold = caseless.back();
      out += '[';
      ++i;
      if (i < p.size() && p[i] == '^') {
        out += '^';
        ++i;
      }
      bool first = true;
      while (i < p.size() && (p[i] != ']' || first)) {
        first = false;
        const char d = p[i];
        if (d == '[') {
          if (p.substr(i, 2) == "[:") {
            const size_t close = p.find(":]", i + 2);
            if (close == std::string_view::npos) {
              return absl::InvalidArgumentError(
                  absl::StrCat("unterminated POSIX class at offset ", i));
            }
            out.append(p.substr(i, close + 2 - i));
            i = close + 2;
            continue;
          }
          return absl::InvalidArgumentError(absl::StrCat(
              "nested character class at offset ", i, " is not supported"));
        }
        if (d == '&' && i + 1 < p.size() && p[i + 1] == '&') {
          return absl::InvalidArgumentError(
              absl::StrCat("character class intersection (&&) at offset ", i,
                           " is not supported"));
        }
        if (d == '\\') {
          if (i + 1 >= p.size()) break;
          const char e = p[i + 1];
          if (std::string s = ClassShorthand(e); !s.empty()) {
            out += s;
            i += 2;
          } else if (e == 'W' || e == 'H') {
            return absl::InvalidArgumentError(absl::StrCat(
                "\\", std::string(1, e), " inside a character class at offset ",
                i, " is not supported"));
          } else {
            i += CopyEscape(p, i, &out);
          }
          continue;
        }
        if (fold && IsAsciiLetter(d)) {
          if (i + 2 < p.size() && p[i + 1] == '-' && IsAsciiLetter(p[i + 2]) &&
              (std::islower(d) != 0) == (std::islower(p[i + 2]) != 0)) {
            out.append(p.substr(i, 3));
            out += OtherCase(d);
            out += '-';
            out += OtherCase(p[i + 2]);
            i += 3;
            continue;
          }
          out += d;
          out += OtherCase(d);
          ++i;
          continue;
        }
        out += d;
        ++i;
      }
      if (i >= p.size()) {
        return absl::InvalidArgumentError("unterminated character class");
      }
      out += ']';
      ++i;
      continue;
    }
    if (caseless.back() && IsAsciiLetter(c)) {
      out += '[';
      out += c;
      out += OtherCase(c);
      out += ']';
      ++i;
      continue;
    }
    out += c;
    ++i;
  }
  return out;
}

std::string QuoteLiteral(std::string_view literal) {
  std::string out;
  out.reserve(literal.size() * 2);
  for (char c : literal) {
    if (std::string_view("\\^$.|?*+()[]{}/-#").find(c) !=
            std::string_view::npos ||
        c == ' ' || c == '\t' || c == '\n' || c == '\r') {
      // PCRE2 accepts \x{..} for any code unit; simplest safe quoting for
      // ASCII syntax characters and whitespace.
      absl::StrAppend(&out, "\\x{", absl::Hex(static_cast<unsigned char>(c)),
                      "}");
    } else {
      out += c;
    }
  }
  return out;
}

void Regex::Deleter::operator()(pcre2_real_code_8* code) const {
  pcre2_code_free(code);
}

absl::StatusOr<Regex> Regex::Compile(std::string_view pattern) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(
      reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
      PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, &error, &offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    return absl::InvalidArgumentError(
        absl::StrCat("invalid regex at offset ", offset, ": ",
                     reinterpret_cast<const char*>(message)));
  }
  // JIT is an optimization only: matching falls back to the interpreter when
  // the platform has no JIT (the result is the same).
  (void)pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  Regex regex;
  regex.code_ = std::shared_ptr<pcre2_real_code_8>(code, Deleter());
  return regex;
}

namespace {

struct MatchDataDeleter {
  void operator()(pcre2_match_data* data) const { pcre2_match_data_free(data); }
};

// One match data per thread, reused across patterns and calls (matching only
// ever reads the whole-match offsets).
pcre2_match_data* ThreadMatchData() {
  thread_local std::unique_ptr<pcre2_match_data, MatchDataDeleter> data(
      pcre2_match_data_create(1, nullptr));
  return data.get();
}

}  // namespace

absl::Status Regex::ForEachMatch(
    std::string_view text,
    const std::function<void(size_t, size_t)>& fn) const {
  pcre2_match_data* md = ThreadMatchData();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t start = 0;
  while (start <= text.size()) {
    // The caller guarantees valid UTF-8: skip PCRE2's per-call check, which
    // would make a scan over n bytes cost O(n^2).
    const int rc = pcre2_match(code_.get(), subject, text.size(), start,
                               PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof(message));
      return absl::InternalError(absl::StrCat(
          "regex match failed: ", reinterpret_cast<const char*>(message)));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t b = ov[0];
    const size_t e = ov[1];
    fn(b, e);
    if (e > b) {
      start = e;
    } else {
      if (e >= text.size()) break;
      start = e + utf8::CharLength(static_cast<unsigned char>(text[e]));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> Regex::ReplaceAll(
    std::string_view text, std::string_view replacement) const {
  std::string out;
  out.reserve(text.size());
  size_t prev = 0;
  absl::Status s = ForEachMatch(text, [&](size_t b, size_t e) {
    out.append(text.substr(prev, b - prev));
    out.append(replacement);
    prev = e;
  });
  if (!s.ok()) return s;
  out.append(text.substr(prev));
  return out;
}

}  // namespace pdserve::tokenizer::hf
