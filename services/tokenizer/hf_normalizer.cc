#include "tokenizer/hf_normalizer.h"

#include <unicode/bytestream.h>
#include <unicode/locid.h>
#include <unicode/normalizer2.h>
#include <unicode/unistr.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace pdserve::tokenizer::hf {
namespace {

bool IsAscii(std::string_view s) {
  for (char c : s) {
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  }
  return true;
}

class UnicodeNormalizer : public Normalizer {
 public:
  explicit UnicodeNormalizer(const icu::Normalizer2* n) : n_(n) {}
  absl::StatusOr<std::string> Normalize(std::string text) const override {
    // ASCII is invariant under every normalization form.
    if (IsAscii(text)) return text;
    UErrorCode status = U_ZERO_ERROR;
    if (n_->isNormalizedUTF8(text, status) && U_SUCCESS(status)) return text;
    status = U_ZERO_ERROR;
    std::string out;
    icu::StringByteSink<std::string> sink(
        &out, static_cast<int32_t>(text.size() + 16));
    n_->normalizeUTF8(0, text, sink, nullptr, status);
    if (U_FAILURE(status)) {
      return absl::InternalError(
          absl::StrCat("ICU normalization failed: ", u_errorName(status)));
    }
    return out;
  }

 private:
  const icu::Normalizer2* n_;  // owned by ICU, lives for the process
};

class ReplaceNormalizer : public Normalizer {
 public:
  ReplaceNormalizer(Regex pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  absl::StatusOr<std::string> Normalize(std::string text) const override {
    return pattern_.ReplaceAll(text, content_);
  }

 private:
  Regex pattern_;
  std::string content_;
};

class PrependNormalizer : public Normalizer {
 public:
  explicit PrependNormalizer(std::string prepend)
      : prepend_(std::move(prepend)) {}
  absl::StatusOr<std::string> Normalize(std::string text) const override {
    // The reference prepends to every non-empty piece (empty pieces never
    // reach the normalizer).
    if (text.empty()) return text;
    return prepend_ + text;
  }

 private:
  std::string prepend_;
};

class LowercaseNormalizer : public Normalizer {
 public:
  absl::StatusOr<std::string> Normalize(std::string text) const override {
    if (IsAscii(text)) {
      for (char& c : text) {
        if (c >= 'A' && c <= 'Z') c = static_cast<char>(c + 32);
      }
      return text;
    }
    // JavaScript's toLowerCase: full, locale-independent mapping.
    icu::UnicodeString u = icu::UnicodeString::fromUTF8(text);
    u.toLower(icu::Locale::getRoot());
    std::string out;
    u.toUTF8String(out);
    return out;
  }
};

class StripNormalizer : public Normalizer {
 public:
  StripNormalizer(bool left, bool right, Regex lead, Regex trail)
      : left_(left),
        right_(right),
        lead_(std::move(lead)),
        trail_(std::move(trail)) {}
  absl::StatusOr<std::string> Normalize(std::string text) const override {
    if (left_) {
      PDS_ASSIGN_OR_RETURN(text, lead_.ReplaceAll(text, ""));
    }
    if (right_) {
      PDS_ASSIGN_OR_RETURN(text, trail_.ReplaceAll(text, ""));
    }
    return text;
  }

 private:
  bool left_, right_;
  Regex lead_, trail_;
};

class SequenceNormalizer : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> parts)
      : parts_(std::move(parts)) {}
  absl::StatusOr<std::string> Normalize(std::string text) const override {
    for (const auto& part : parts_) {
      PDS_ASSIGN_OR_RETURN(text, part->Normalize(std::move(text)));
    }
    return text;
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> parts_;
};

absl::StatusOr<const icu::Normalizer2*> IcuInstance(const std::string& type,
                                                    const JsonPath& at) {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* n = nullptr;
  if (type == "NFC") n = icu::Normalizer2::getNFCInstance(status);
  if (type == "NFD") n = icu::Normalizer2::getNFDInstance(status);
  if (type == "NFKC") n = icu::Normalizer2::getNFKCInstance(status);
  if (type == "NFKD") n = icu::Normalizer2::getNFKDInstance(status);
  if (n == nullptr || U_FAILURE(status)) {
    return at.Error(absl::StrCat("ICU has no ", type,
                                 " normalizer: ", u_errorName(status)));
  }
  return n;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Normalizer>> ParseNormalizer(
    const Json& j, const JsonPath& at) {
  if (j.is_null()) return nullptr;
  PDS_ASSIGN_OR_RETURN(std::string type, GetType(j, at));
  if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    PDS_ASSIGN_OR_RETURN(const icu::Normalizer2* n, IcuInstance(type, at));
    return std::make_unique<UnicodeNormalizer>(n);
  }
  if (type == "Replace") {
    PDS_ASSIGN_OR_RETURN(const Json* pattern, Member(j, "pattern", at));
    if (pattern == nullptr) return at.Key("pattern").Error("missing pattern");
    PDS_ASSIGN_OR_RETURN(Regex regex,
                         ParsePattern(*pattern, at.Key("pattern")));
    PDS_ASSIGN_OR_RETURN(std::string content, GetString(j, "content", at));
    return std::make_unique<ReplaceNormalizer>(std::move(regex),
                                               std::move(content));
  }
  if (type == "Prepend") {
    PDS_ASSIGN_OR_RETURN(std::string prepend, GetString(j, "prepend", at));
    return std::make_unique<PrependNormalizer>(std::move(prepend));
  }
  if (type == "Lowercase") return std::make_unique<LowercaseNormalizer>();
  if (type == "Strip") {
    PDS_ASSIGN_OR_RETURN(bool left, GetBool(j, "strip_left", at, false));
    PDS_ASSIGN_OR_RETURN(bool right, GetBool(j, "strip_right", at, false));
    PDS_ASSIGN_OR_RETURN(
        Regex lead, Regex::Compile(absl::StrCat("\\A", kJsWhitespace, "+")));
    PDS_ASSIGN_OR_RETURN(Regex trail,
                         Regex::Compile(absl::StrCat(kJsWhitespace, "+\\z")));
    return std::make_unique<StripNormalizer>(left, right, std::move(lead),
                                             std::move(trail));
  }
  if (type == "Sequence") {
    PDS_ASSIGN_OR_RETURN(const Json* list, Member(j, "normalizers", at));
    const JsonPath list_at = at.Key("normalizers");
    if (list == nullptr || !list->is_array()) {
      return list_at.Error("expected a list of normalizers");
    }
    std::vector<std::unique_ptr<Normalizer>> parts;
    for (size_t i = 0; i < list->size(); ++i) {
      PDS_ASSIGN_OR_RETURN(std::unique_ptr<Normalizer> part,
                           ParseNormalizer((*list)[i], list_at.Index(i)));
      if (part != nullptr) parts.push_back(std::move(part));
    }
    return std::make_unique<SequenceNormalizer>(std::move(parts));
  }
  return at.Key("type").Error(
      absl::StrCat("unsupported normalizer type \"", type,
                   "\" (supported: NFC, NFD, NFKC, NFKD, Replace, Prepend, "
                   "Lowercase, Strip, Sequence)"));
}

}  // namespace pdserve::tokenizer::hf
