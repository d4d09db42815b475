// `--name value` / `--name=value` flags for pdserve's binaries, and their
// `--help`. Each lookup (Str, Num, Bool) both reads its flag and registers it
// -- name, group, default and meaning -- so Usage() is generated from the very
// table that parses and cannot drift from it. Each lookup also consumes its
// flag, so Check() can name the first flag nobody asked for; the first
// unparsable value is remembered rather than aborting.
//
//   CommandLineFlags flags;
//   if (auto s = flags.Parse(argc, argv); !s.ok()) return Fail(s);
//   flags.Group("Network");
//   const int port = flags.Num<int>("port", 0, "gRPC port (0: any free one)");
//   ...every lookup, unconditionally, so --help lists it...
//   if (flags.help_requested()) {
//     std::fputs(flags.Usage("prog [flags]").c_str(), stdout);
//     return 0;
//   }
//   if (auto s = flags.Check(); !s.ok()) return Fail(s);
#pragma once

#include <algorithm>
#include <cstddef>
#include <map>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace pdserve {

class CommandLineFlags {
 public:
  // Parses argv[first..]. `--help` and `-h` take no value and set
  // help_requested(). INVALID_ARGUMENT for a positional argument or a
  // trailing flag without a value -- unless help was asked for, in which
  // case the usage is what the user wants to see.
  [[nodiscard]] absl::Status Parse(int argc, char** argv, int first = 1) {
    absl::Status error;
    for (int i = first; i < argc; ++i) {
      std::string arg = argv[i];
      if (arg == "--help" || arg == "-h") {
        help_requested_ = true;
        continue;
      }
      if (arg.rfind("--", 0) != 0) {
        if (error.ok()) {
          error = absl::InvalidArgumentError(
              absl::StrCat("unexpected argument '", arg, "'"));
        }
        continue;
      }
      arg = arg.substr(2);
      if (auto eq = arg.find('='); eq != std::string::npos) {
        flags_[arg.substr(0, eq)] = arg.substr(eq + 1);
      } else if (i + 1 < argc) {
        flags_[arg] = argv[++i];
      } else if (error.ok()) {
        error = absl::InvalidArgumentError(
            absl::StrCat("flag --", arg, " needs a value"));
      }
    }
    return help_requested_ ? absl::OkStatus() : error;
  }

  // True when --help or -h was given: print Usage() and exit 0.
  bool help_requested() const { return help_requested_; }

  // The group the following lookups are listed under in Usage() (e.g.
  // "Network", "KV cache"). Groups print in the order first named.
  void Group(std::string_view name) { group_ = std::string(name); }

  // Whether the flag was given (and not consumed yet). Registers nothing:
  // pair it with a lookup.
  bool Has(const std::string& name) const { return flags_.count(name) != 0; }

  // The flag's value, or `def`. `help` is its one-line meaning; Usage()
  // shows `shown_default` if given, else `def` ("(none)" when empty).
  std::string Str(const std::string& name, const std::string& def,
                  std::string_view help, std::string_view shown_default = {}) {
    Register(
        name,
        shown_default.empty() ? ShownDefault(def) : std::string(shown_default),
        help);
    auto it = flags_.find(name);
    if (it == flags_.end()) return def;
    std::string value = it->second;
    flags_.erase(it);
    return value;
  }

  template <typename T>
  T Num(const std::string& name, T def, std::string_view help,
        std::string_view shown_default = {}) {
    static_assert(std::is_arithmetic_v<T> && !std::is_same_v<T, bool>,
                  "Num is for numbers; use Bool for switches");
    Register(
        name,
        shown_default.empty() ? absl::StrCat(def) : std::string(shown_default),
        help);
    auto it = flags_.find(name);
    if (it == flags_.end()) return def;
    T value{};
    bool ok;
    if constexpr (std::is_floating_point_v<T>) {
      double parsed = 0;
      ok = absl::SimpleAtod(it->second, &parsed);
      value = static_cast<T>(parsed);
    } else {
      ok = absl::SimpleAtoi(it->second, &value);
    }
    if (!ok && error_.ok()) {
      error_ = absl::InvalidArgumentError(
          absl::StrCat("--", name, ": '", it->second, "' is not a number"));
    }
    flags_.erase(it);
    return value;
  }

  // A switch: 1/0 (any integer: nonzero is on), true/false, yes/no, on/off.
  // Usage() shows the default as 1 or 0.
  bool Bool(const std::string& name, bool def, std::string_view help) {
    Register(name, def ? "1" : "0", help);
    auto it = flags_.find(name);
    if (it == flags_.end()) return def;
    const std::string text = absl::AsciiStrToLower(it->second);
    bool value = def;
    int64_t number = 0;
    if (text == "true" || text == "yes" || text == "on") {
      value = true;
    } else if (text == "false" || text == "no" || text == "off") {
      value = false;
    } else if (absl::SimpleAtoi(text, &number)) {
      value = number != 0;
    } else if (error_.ok()) {
      error_ = absl::InvalidArgumentError(absl::StrCat(
          "--", name, ": '", it->second, "' is not 0/1 or true/false"));
    }
    flags_.erase(it);
    return value;
  }

  // The first bad value, or the first flag nobody asked for.
  [[nodiscard]] absl::Status Check() const {
    if (!error_.ok()) return error_;
    if (!flags_.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag --", flags_.begin()->first,
                       " (--help lists the flags)"));
    }
    return absl::OkStatus();
  }

  // "usage: <synopsis>" and then every flag looked up so far, by group, each
  // with its meaning and default, wrapped to 80 columns. `synopsis` and
  // `notes` (printed after the flags, if given) may span lines; lines longer
  // than 80 columns are wrapped.
  std::string Usage(std::string_view synopsis,
                    std::string_view notes = {}) const {
    std::string out = WrapLines(absl::StrCat("usage: ", std::string(synopsis)),
                                /*first_indent=*/7);
    out +=
        "\nEvery flag takes a value: --name VALUE or --name=VALUE. -h, --help: "
        "this text.\n";
    std::vector<std::string> groups;
    for (const Entry& e : entries_) {
      if (std::find(groups.begin(), groups.end(), e.group) == groups.end()) {
        groups.push_back(e.group);
      }
    }
    for (const std::string& group : groups) {
      absl::StrAppend(&out, "\n", group.empty() ? "Flags" : group, ":\n");
      size_t width = 0;
      for (const Entry& e : entries_) {
        if (e.group == group) width = std::max(width, e.name.size() + 2);
      }
      // The meaning starts at a common column (unless a name is very long).
      const size_t column = std::min<size_t>(kIndent + width + 2, kMaxColumn);
      for (const Entry& e : entries_) {
        if (e.group != group) continue;
        std::string line =
            absl::StrCat(std::string(kIndent, ' '), "--", e.name);
        line += line.size() + 2 <= column
                    ? std::string(column - line.size(), ' ')
                    : std::string("  ");
        const size_t first_column = line.size();
        Wrap(e.help, absl::StrCat("[default: ", e.shown_default, "]"),
             first_column, column, &line);
        out += line;
      }
    }
    if (!notes.empty()) {
      absl::StrAppend(&out, "\n", WrapLines(std::string(notes), 0));
    }
    return out;
  }

 private:
  static constexpr size_t kIndent = 2;
  static constexpr size_t kMaxColumn = 30;
  static constexpr size_t kWidth = 80;

  struct Entry {
    std::string group;
    std::string name;
    std::string shown_default;
    std::string help;
  };

  static std::string ShownDefault(const std::string& def) {
    return def.empty() ? "(none)" : def;
  }

  // The first lookup of a name registers it; later ones change nothing.
  void Register(const std::string& name, std::string shown_default,
                std::string_view help) {
    for (const Entry& e : entries_) {
      if (e.name == name) return;
    }
    entries_.push_back(
        Entry{group_, name, std::move(shown_default), std::string(help)});
  }

  // `text` with every line longer than kWidth word-wrapped: continuation
  // lines keep the line's own indent (the first line's: `first_indent`).
  // Ends with a newline.
  static std::string WrapLines(const std::string& text, size_t first_indent) {
    std::string out;
    size_t start = 0;
    bool first = true;
    while (start < text.size()) {
      size_t end = text.find('\n', start);
      if (end == std::string::npos) end = text.size();
      const std::string_view line(text.data() + start, end - start);
      if (line.size() <= kWidth) {
        out.append(line);
        out += '\n';
      } else {
        size_t indent = line.find_first_not_of(' ');
        if (indent == std::string_view::npos) indent = 0;
        out.append(line.substr(0, indent));
        Wrap(line.substr(indent), {}, indent, first ? first_indent : indent,
             &out);
      }
      first = false;
      start = end + 1;
    }
    return out;
  }

  // Appends `text` and then `last` (never split) word-wrapped to *out,
  // whose current line already holds `used` columns; continuation lines are
  // indented to `column`.
  static void Wrap(std::string_view text, std::string_view last, size_t used,
                   size_t column, std::string* out) {
    std::vector<std::string_view> words;
    for (size_t pos = 0; pos < text.size();) {
      if (text[pos] == ' ') {
        ++pos;
        continue;
      }
      size_t end = text.find(' ', pos);
      if (end == std::string_view::npos) end = text.size();
      words.push_back(text.substr(pos, end - pos));
      pos = end;
    }
    if (last.size() + kIndent > kWidth && last.find(' ') != last.npos) {
      // Too long for any line: "[default:" and its value on two lines.
      const size_t space = last.find(' ');
      words.push_back(last.substr(0, space));
      words.push_back(last.substr(space + 1));
    } else if (!last.empty()) {
      words.push_back(last);
    }
    bool line_has_word = false;
    for (std::string_view word : words) {
      if (line_has_word && used + 1 + word.size() > kWidth) {
        // A word too long for the continuation column (a default that is
        // an absolute path) moves left rather than past column 80.
        const size_t indent =
            word.size() + column <= kWidth
                ? column
                : std::max(kIndent, kWidth - std::min(kWidth, word.size()));
        *out += '\n';
        out->append(indent, ' ');
        used = indent;
        line_has_word = false;
      }
      if (line_has_word) {
        *out += ' ';
        ++used;
      }
      out->append(word);
      used += word.size();
      line_has_word = true;
    }
    *out += '\n';
  }

  std::map<std::string, std::string> flags_;
  absl::Status error_;
  bool help_requested_ = false;
  std::string group_;
  std::vector<Entry> entries_;
};

}  // namespace pdserve
