#include "tokenizer/hf_pre_tokenizer.h"

#include <array>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/status_macros.h"
#include "tokenizer/utf8.h"

namespace pdserve::tokenizer::hf {
namespace {

struct ByteTable {
  std::array<std::string, 256> to_unicode;
  std::array<int, 512> to_byte;  // code points < 512 cover the table
};

const ByteTable& Table() {
  static const ByteTable* table = [] {
    auto* t = new ByteTable;
    t->to_byte.fill(-1);
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable =
          (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      const uint32_t cp = printable ? b : 256 + n++;
      utf8::AppendCodePoint(cp, &t->to_unicode[b]);
      t->to_byte[cp] = b;
    }
    return t;
  }();
  return *table;
}

// The regex the reference's ByteLevel pre-tokenizer uses (GPT-2's, with
// JavaScript's \s).
std::string Gpt2Regex() {
  const std::string s = kJsWhitespace;
  const std::string S = kJsNonWhitespace;
  return absl::StrCat("'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?(?:(?!", s,
                      ")[^\\p{L}\\p{N}])+|", s, "+(?!", S, ")|", s, "+");
}

absl::Status Matches(const Regex& regex, const std::string& text,
                     std::vector<std::string>* out) {
  return regex.ForEachMatch(text, [&](size_t b, size_t e) {
    if (e > b) out->emplace_back(text, b, e - b);
  });
}

class ByteLevelPre : public PreTokenizer {
 public:
  ByteLevelPre(bool add_prefix_space, std::optional<Regex> regex)
      : add_prefix_space_(add_prefix_space), regex_(std::move(regex)) {}

  absl::Status PreTokenize(std::vector<std::string>* pieces,
                           int) const override {
    std::vector<std::string> out;
    out.reserve(pieces->size());
    for (std::string& piece : *pieces) {
      if (add_prefix_space_ && !absl::StartsWith(piece, " ")) {
        piece.insert(piece.begin(), ' ');
      }
      if (regex_.has_value()) {
        PDS_RETURN_IF_ERROR(Matches(*regex_, piece, &out));
      } else {
        out.push_back(std::move(piece));
      }
    }
    const ByteTable& table = Table();
    for (std::string& piece : out) {
      std::string mapped;
      mapped.reserve(piece.size() * 2);
      for (char c : piece) mapped += table.to_unicode[static_cast<uint8_t>(c)];
      piece = std::move(mapped);
    }
    *pieces = std::move(out);
    return absl::OkStatus();
  }

 private:
  bool add_prefix_space_;
  std::optional<Regex> regex_;
};

enum class Behavior {
  kRemoved,
  kIsolated,
  kMergedWithPrevious,
  kMergedWithNext,
  kContiguous
};

class SplitPre : public PreTokenizer {
 public:
  SplitPre(Regex regex, Behavior behavior, bool invert)
      : regex_(std::move(regex)), behavior_(behavior), invert_(invert) {}

  absl::Status PreTokenize(std::vector<std::string>* pieces,
                           int) const override {
    std::vector<std::string> out;
    out.reserve(pieces->size() * 4);
    for (const std::string& piece : *pieces) {
      PDS_RETURN_IF_ERROR(SplitOne(piece, &out));
    }
    *pieces = std::move(out);
    return absl::OkStatus();
  }

 private:
  absl::Status SplitOne(const std::string& text,
                        std::vector<std::string>* out) const {
    // The reference returns only the matches when inverted, whatever the
    // behavior.
    if (invert_) return Matches(regex_, text, out);
    // (start, end, is_match) spans covering `text`; empty matches are not
    // delimiters.
    struct Span {
      size_t b, e;
      bool match;
    };
    std::vector<Span> spans;
    size_t prev = 0;
    PDS_RETURN_IF_ERROR(regex_.ForEachMatch(text, [&](size_t b, size_t e) {
      if (e == b) return;
      if (b > prev) spans.push_back({prev, b, false});
      spans.push_back({b, e, true});
      prev = e;
    }));
    if (prev < text.size()) spans.push_back({prev, text.size(), false});
    const auto emit = [&](size_t b, size_t e) {
      if (e > b) out->emplace_back(text, b, e - b);
    };
    switch (behavior_) {
      case Behavior::kIsolated:
        for (const Span& s : spans) emit(s.b, s.e);
        break;
      case Behavior::kRemoved:
        for (const Span& s : spans) {
          if (!s.match) emit(s.b, s.e);
        }
        break;
      case Behavior::kMergedWithPrevious: {
        // Each delimiter joins the piece before it.
        size_t start = 0;
        for (const Span& s : spans) {
          if (s.match) {
            emit(start, s.e);
            start = s.e;
          }
        }
        emit(start, text.size());
        break;
      }
      case Behavior::kMergedWithNext: {
        // Each delimiter starts a new piece.
        size_t start = 0;
        for (const Span& s : spans) {
          if (s.match) {
            emit(start, s.b);
            start = s.b;
          }
        }
        emit(start, text.size());
        break;
      }
      case Behavior::kContiguous: {
        // Adjacent delimiters form one piece.
        size_t i = 0;
        while (i < spans.size()) {
          size_t j = i + 1;
          if (spans[i].match) {
            while (j < spans.size() && spans[j].match) ++j;
          }
          emit(spans[i].b, spans[j - 1].e);
          i = j;
        }
        break;
      }
    }
    return absl::OkStatus();
  }

  Regex regex_;
  Behavior behavior_;
  bool invert_;
};

// Pieces that are whole matches of `regex` (the reference's Digits,
// Whitespace and WhitespaceSplit are all "keep the matches").
class MatchesPre : public PreTokenizer {
 public:
  explicit MatchesPre(Regex regex) : regex_(std::move(regex)) {}
  absl::Status PreTokenize(std::vector<std::string>* pieces,
                           int) const override {
    std::vector<std::string> out;
    for (const std::string& piece : *pieces) {
      PDS_RETURN_IF_ERROR(Matches(regex_, piece, &out));
    }
    *pieces = std::move(out);
    return absl::OkStatus();
  }

 private:
  Regex regex_;
};

enum class PrependScheme { kAlways, kFirst, kNever };

class MetaspacePre : public PreTokenizer {
 public:
  MetaspacePre(std::string replacement, PrependScheme scheme, bool split)
      : replacement_(std::move(replacement)), scheme_(scheme), split_(split) {}

  absl::Status PreTokenize(std::vector<std::string>* pieces,
                           int section_index) const override {
    std::vector<std::string> out;
    for (const std::string& piece : *pieces) {
      std::string text = absl::StrReplaceAll(piece, {{" ", replacement_}});
      if (!absl::StartsWith(text, replacement_) &&
          (scheme_ == PrependScheme::kAlways ||
           (scheme_ == PrependScheme::kFirst && section_index == 0))) {
        text.insert(0, replacement_);
      }
      if (!split_) {
        if (!text.empty()) out.push_back(std::move(text));
        continue;
      }
      // Hugging Face tokenizers: split before each replacement character
      // (MergedWithNext). The JavaScript reference does not split here.
      size_t start = 0;
      size_t pos = text.find(replacement_, 1);
      while (pos != std::string::npos) {
        out.emplace_back(text, start, pos - start);
        start = pos;
        pos = text.find(replacement_, pos + replacement_.size());
      }
      if (start < text.size()) out.emplace_back(text, start);
    }
    *pieces = std::move(out);
    return absl::OkStatus();
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
  bool split_;
};

class SequencePre : public PreTokenizer {
 public:
  explicit SequencePre(std::vector<std::unique_ptr<PreTokenizer>> parts)
      : parts_(std::move(parts)) {}
  absl::Status PreTokenize(std::vector<std::string>* pieces,
                           int section_index) const override {
    for (const auto& part : parts_) {
      PDS_RETURN_IF_ERROR(part->PreTokenize(pieces, section_index));
    }
    return absl::OkStatus();
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> parts_;
};

absl::StatusOr<std::unique_ptr<PreTokenizer>> MatchesOf(const std::string& re,
                                                        const JsonPath& at) {
  absl::StatusOr<Regex> regex = Regex::Compile(re);
  if (!regex.ok()) return at.Error(regex.status().message());
  return std::make_unique<MatchesPre>(std::move(*regex));
}

}  // namespace

const std::string& ByteToUnicode(unsigned char b) {
  return Table().to_unicode[b];
}

int UnicodeToByte(uint32_t cp) { return cp < 512 ? Table().to_byte[cp] : -1; }

absl::StatusOr<std::unique_ptr<PreTokenizer>> MakeByteLevelPreTokenizer(
    const std::string& split_regex) {
  std::optional<Regex> regex;
  if (!split_regex.empty()) {
    PDS_ASSIGN_OR_RETURN(Regex r, Regex::Compile(split_regex));
    regex = std::move(r);
  }
  return std::make_unique<ByteLevelPre>(false, std::move(regex));
}

absl::StatusOr<std::unique_ptr<PreTokenizer>> ParsePreTokenizer(
    const Json& j, const JsonPath& at) {
  if (j.is_null()) return nullptr;
  PDS_ASSIGN_OR_RETURN(std::string type, GetType(j, at));
  if (type == "ByteLevel") {
    PDS_ASSIGN_OR_RETURN(bool prefix,
                         GetBool(j, "add_prefix_space", at, false));
    PDS_ASSIGN_OR_RETURN(bool use_regex, GetBool(j, "use_regex", at, true));
    std::optional<Regex> regex;
    if (use_regex) {
      PDS_ASSIGN_OR_RETURN(Regex r, Regex::Compile(Gpt2Regex()));
      regex = std::move(r);
    }
    return std::make_unique<ByteLevelPre>(prefix, std::move(regex));
  }
  if (type == "Split") {
    PDS_ASSIGN_OR_RETURN(const Json* pattern, Member(j, "pattern", at));
    if (pattern == nullptr) return at.Key("pattern").Error("missing pattern");
    PDS_ASSIGN_OR_RETURN(Regex regex,
                         ParsePattern(*pattern, at.Key("pattern")));
    PDS_ASSIGN_OR_RETURN(std::string behavior,
                         GetString(j, "behavior", at, "Isolated"));
    PDS_ASSIGN_OR_RETURN(bool invert, GetBool(j, "invert", at, false));
    Behavior b;
    if (behavior == "Isolated") {
      b = Behavior::kIsolated;
    } else if (behavior == "Removed") {
      b = Behavior::kRemoved;
    } else if (behavior == "MergedWithPrevious") {
      b = Behavior::kMergedWithPrevious;
    } else if (behavior == "MergedWithNext") {
      b = Behavior::kMergedWithNext;
    } else if (behavior == "Contiguous") {
      b = Behavior::kContiguous;
    } else {
      return at.Key("behavior")
          .Error(absl::StrCat(
              "unknown split behavior \"", behavior,
              "\" (Isolated, Removed, MergedWithPrevious, MergedWithNext, "
              "Contiguous)"));
    }
    return std::make_unique<SplitPre>(std::move(regex), b, invert);
  }
  if (type == "Digits") {
    PDS_ASSIGN_OR_RETURN(bool individual,
                         GetBool(j, "individual_digits", at, false));
    // JavaScript's \d is ASCII only, even in Unicode mode.
    return MatchesOf(individual ? "[^0-9]+|[0-9]" : "[^0-9]+|[0-9]+", at);
  }
  if (type == "Whitespace") {
    // JavaScript's \w (ASCII word characters) and \s.
    return MatchesOf(
        absl::StrCat("[A-Za-z0-9_]+|(?:(?!", kJsWhitespace, ")[^A-Za-z0-9_])+"),
        at);
  }
  if (type == "WhitespaceSplit") {
    return MatchesOf(absl::StrCat(kJsNonWhitespace, "+"), at);
  }
  if (type == "Metaspace") {
    PDS_ASSIGN_OR_RETURN(std::string replacement,
                         GetString(j, "replacement", at, "\xE2\x96\x81"));
    if (replacement.empty()) {
      return at.Key("replacement").Error("must not be empty");
    }
    PDS_ASSIGN_OR_RETURN(std::string scheme,
                         GetString(j, "prepend_scheme", at, "always"));
    PrependScheme s;
    if (scheme == "always") {
      s = PrependScheme::kAlways;
    } else if (scheme == "first") {
      s = PrependScheme::kFirst;
    } else if (scheme == "never") {
      s = PrependScheme::kNever;
    } else {
      return at.Key("prepend_scheme")
          .Error(absl::StrCat("unknown prepend scheme \"", scheme,
                              "\" (always, first, never)"));
    }
    // Older files say add_prefix_space instead of prepend_scheme.
    PDS_ASSIGN_OR_RETURN(const Json* legacy, Member(j, "add_prefix_space", at));
    if (legacy != nullptr && legacy->is_boolean() && !legacy->get<bool>() &&
        !j.contains("prepend_scheme")) {
      s = PrependScheme::kNever;
    }
    PDS_ASSIGN_OR_RETURN(bool split, GetBool(j, "split", at, true));
    return std::make_unique<MetaspacePre>(std::move(replacement), s, split);
  }
  if (type == "Sequence") {
    PDS_ASSIGN_OR_RETURN(const Json* list, Member(j, "pretokenizers", at));
    const JsonPath list_at = at.Key("pretokenizers");
    if (list == nullptr || !list->is_array()) {
      return list_at.Error("expected a list of pre-tokenizers");
    }
    std::vector<std::unique_ptr<PreTokenizer>> parts;
    for (size_t i = 0; i < list->size(); ++i) {
      PDS_ASSIGN_OR_RETURN(std::unique_ptr<PreTokenizer> part,
                           ParsePreTokenizer((*list)[i], list_at.Index(i)));
      if (part != nullptr) parts.push_back(std::move(part));
    }
    return std::make_unique<SequencePre>(std::move(parts));
  }
  return at.Key("type").Error(absl::StrCat(
      "unsupported pre-tokenizer type \"", type,
      "\" (supported: Split, ByteLevel, Digits, Metaspace, Whitespace, "
      "WhitespaceSplit, Sequence)"));
}

}  // namespace pdserve::tokenizer::hf
