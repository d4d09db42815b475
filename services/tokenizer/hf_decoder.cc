#include "tokenizer/hf_decoder.h"

#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/status_macros.h"
#include "tokenizer/hf_pre_tokenizer.h"
#include "tokenizer/utf8.h"

namespace pdserve::tokenizer::hf {
namespace {

constexpr char kBom[] = "\xEF\xBB\xBF";

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Bytes of a byte-level token: each character through the GPT-2 table; the
// reference turns characters outside it into 0.
std::string ByteLevelBytes(const std::string& token) {
  std::string bytes;
  bytes.reserve(token.size());
  for (size_t pos = 0; pos < token.size();) {
    size_t len;
    const uint32_t cp = utf8::DecodeAt(token, pos, &len);
    const int b = UnicodeToByte(cp);
    bytes.push_back(static_cast<char>(b < 0 ? 0 : b));
    pos += len;
  }
  return bytes;
}

std::string DecodeRun(const std::string& bytes, bool strip_bom) {
  std::string_view view = bytes;
  if (strip_bom && view.starts_with(kBom)) view.remove_prefix(3);
  return utf8::Lossy(view);
}

class ByteLevelDecoder : public Decoder {
 public:
  explicit ByteLevelDecoder(const absl::flat_hash_set<std::string>* added)
      : added_(added) {}
  absl::Status DecodeChain(std::vector<std::string>* tokens) const override {
    std::vector<std::string> out;
    std::string run;
    bool in_run = false;
    for (std::string& token : *tokens) {
      if (added_->contains(token)) {
        if (in_run) out.push_back(DecodeRun(run, false));
        run.clear();
        in_run = false;
        out.push_back(std::move(token));
      } else {
        run += ByteLevelBytes(token);
        in_run = true;
      }
    }
    if (in_run) out.push_back(DecodeRun(run, false));
    *tokens = std::move(out);
    return absl::OkStatus();
  }

 private:
  const absl::flat_hash_set<std::string>* added_;
};

class ByteFallbackDecoder : public Decoder {
 public:
  absl::Status DecodeChain(std::vector<std::string>* tokens) const override {
    std::vector<std::string> out;
    std::string run;
    for (std::string& token : *tokens) {
      const int b = ByteFallbackValue(token);
      if (b >= 0) {
        run.push_back(static_cast<char>(b));
        continue;
      }
      if (!run.empty()) out.push_back(DecodeRun(run, true));
      run.clear();
      out.push_back(std::move(token));
    }
    if (!run.empty()) out.push_back(DecodeRun(run, true));
    *tokens = std::move(out);
    return absl::OkStatus();
  }
};

class FuseDecoder : public Decoder {
 public:
  absl::Status DecodeChain(std::vector<std::string>* tokens) const override {
    std::string all;
    for (const std::string& t : *tokens) all += t;
    tokens->assign(1, std::move(all));
    return absl::OkStatus();
  }
};

class StripDecoder : public Decoder {
 public:
  StripDecoder(std::string content, int start, int stop)
      : content_(std::move(content)), start_(start), stop_(stop) {}
  absl::Status DecodeChain(std::vector<std::string>* tokens) const override {
    for (std::string& t : *tokens) {
      size_t b = 0;
      for (int i = 0;
           i < start_ && std::string_view(t).substr(b).starts_with(content_);
           ++i) {
        b += content_.size();
      }
      size_t e = t.size();
      for (int i = 0; i < stop_ && e >= b + content_.size() &&
                      std::string_view(t).substr(0, e).ends_with(content_);
           ++i) {
        e -= content_.size();
      }
      t = t.substr(b, e - b);
    }
    return absl::OkStatus();
  }

 private:
  std::string content_;
  int start_, stop_;
};

class ReplaceDecoder : public Decoder {
 public:
  ReplaceDecoder(Regex pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  absl::Status DecodeChain(std::vector<std::string>* tokens) const override {
    for (std::string& t : *tokens) {
      PDS_ASSIGN_OR_RETURN(t, pattern_.ReplaceAll(t, content_));
    }
    return absl::OkStatus();
  }

 private:
  Regex pattern_;
  std::string content_;
};

class MetaspaceDecoder : public Decoder {
 public:
  explicit MetaspaceDecoder(std::string replacement)
      : replacement_(std::move(replacement)) {}
  absl::Status DecodeChain(std::vector<std::string>* tokens) const override {
    for (size_t i = 0; i < tokens->size(); ++i) {
      std::string& t = (*tokens)[i];
      t = absl::StrReplaceAll(t, {{replacement_, " "}});
      if (i == 0 && absl::StartsWith(t, " ")) t.erase(0, 1);
    }
    return absl::OkStatus();
  }

 private:
  std::string replacement_;
};

class SequenceDecoder : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> parts)
      : parts_(std::move(parts)) {}
  absl::Status DecodeChain(std::vector<std::string>* tokens) const override {
    for (const auto& part : parts_)
      PDS_RETURN_IF_ERROR(part->DecodeChain(tokens));
    return absl::OkStatus();
  }

 private:
  std::vector<std::unique_ptr<Decoder>> parts_;
};

absl::StatusOr<std::string> StripContent(const Json& j, const JsonPath& at) {
  PDS_ASSIGN_OR_RETURN(std::string content, GetString(j, "content", at, " "));
  size_t len = 0;
  if (content.empty() || !utf8::IsWellFormed(content) ||
      (utf8::DecodeAt(content, 0, &len), len != content.size())) {
    return at.Key("content").Error("must be a single character");
  }
  return content;
}

// Flattens a decoder config into its steps (Sequence unrolled).
absl::Status Steps(const Json& j, const JsonPath& at,
                   std::vector<std::pair<const Json*, JsonPath>>* out) {
  PDS_ASSIGN_OR_RETURN(std::string type, GetType(j, at));
  if (type != "Sequence") {
    out->emplace_back(&j, at);
    return absl::OkStatus();
  }
  PDS_ASSIGN_OR_RETURN(const Json* list, Member(j, "decoders", at));
  if (list == nullptr || !list->is_array()) {
    return at.Key("decoders").Error("expected a list of decoders");
  }
  for (size_t i = 0; i < list->size(); ++i) {
    if ((*list)[i].is_null()) continue;
    PDS_RETURN_IF_ERROR(Steps((*list)[i], at.Key("decoders").Index(i), out));
  }
  return absl::OkStatus();
}

}  // namespace

int ByteFallbackValue(const std::string& token) {
  // The reference: six characters "<0x..>", parseInt of the two after "0x"
  // (which reads leading hex digits only).
  if (token.size() != 6 || !absl::StartsWith(token, "<0x") ||
      token.back() != '>') {
    return -1;
  }
  const int hi = HexValue(token[3]);
  if (hi < 0) return -1;
  const int lo = HexValue(token[4]);
  return lo < 0 ? hi : hi * 16 + lo;
}

absl::StatusOr<std::unique_ptr<Decoder>> ParseDecoder(
    const Json& j, const JsonPath& at,
    const absl::flat_hash_set<std::string>* added) {
  if (j.is_null()) return nullptr;
  PDS_ASSIGN_OR_RETURN(std::string type, GetType(j, at));
  if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>(added);
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (type == "Fuse") return std::make_unique<FuseDecoder>();
  if (type == "Strip") {
    PDS_ASSIGN_OR_RETURN(std::string content, StripContent(j, at));
    PDS_ASSIGN_OR_RETURN(int64_t start, GetInt(j, "start", at, 0));
    PDS_ASSIGN_OR_RETURN(int64_t stop, GetInt(j, "stop", at, 0));
    if (start < 0 || stop < 0 || start > 1 << 20 || stop > 1 << 20) {
      return at.Error("start and stop must be small non-negative counts");
    }
    return std::make_unique<StripDecoder>(
        std::move(content), static_cast<int>(start), static_cast<int>(stop));
  }
  if (type == "Replace") {
    PDS_ASSIGN_OR_RETURN(const Json* pattern, Member(j, "pattern", at));
    if (pattern == nullptr) return at.Key("pattern").Error("missing pattern");
    PDS_ASSIGN_OR_RETURN(Regex regex,
                         ParsePattern(*pattern, at.Key("pattern")));
    PDS_ASSIGN_OR_RETURN(std::string content, GetString(j, "content", at));
    return std::make_unique<ReplaceDecoder>(std::move(regex),
                                            std::move(content));
  }
  if (type == "Metaspace") {
    PDS_ASSIGN_OR_RETURN(std::string replacement,
                         GetString(j, "replacement", at, "\xE2\x96\x81"));
    if (replacement.empty()) {
      return at.Key("replacement").Error("must not be empty");
    }
    return std::make_unique<MetaspaceDecoder>(std::move(replacement));
  }
  if (type == "Sequence") {
    PDS_ASSIGN_OR_RETURN(const Json* list, Member(j, "decoders", at));
    const JsonPath list_at = at.Key("decoders");
    if (list == nullptr || !list->is_array()) {
      return list_at.Error("expected a list of decoders");
    }
    std::vector<std::unique_ptr<Decoder>> parts;
    for (size_t i = 0; i < list->size(); ++i) {
      PDS_ASSIGN_OR_RETURN(std::unique_ptr<Decoder> part,
                           ParseDecoder((*list)[i], list_at.Index(i), added));
      if (part != nullptr) parts.push_back(std::move(part));
    }
    return std::make_unique<SequenceDecoder>(std::move(parts));
  }
  return at.Key("type").Error(absl::StrCat(
      "unsupported decoder type \"", type,
      "\" (supported: ByteLevel, Metaspace, ByteFallback, Fuse, Strip, "
      "Replace, Sequence)"));
}

absl::StatusOr<std::optional<StreamPlan>> BuildStreamPlan(
    const Json& j, const std::vector<std::string>& pieces,
    const std::vector<bool>& is_added) {
  StreamPlan plan;
  plan.tokens.resize(pieces.size());
  for (size_t id = 0; id < pieces.size(); ++id) {
    plan.tokens[id].text = pieces[id];
  }
  if (j.is_null()) return plan;  // the reference joins tokens as they are
  std::vector<std::pair<const Json*, JsonPath>> steps;
  PDS_RETURN_IF_ERROR(Steps(j, JsonPath("", "decoder"), &steps));
  // Per-token steps apply while no step has grouped tokens yet; after Fuse
  // only a leading Strip is expressible.
  bool grouped = false;  // a byte step ran: tokens may be raw bytes now
  bool fused = false;
  absl::flat_hash_set<std::string> no_added;
  for (const auto& [step, at] : steps) {
    PDS_ASSIGN_OR_RETURN(std::string type, GetType(*step, at));
    if (type == "Fuse") {
      fused = true;
      continue;
    }
    if (type == "Strip" && (fused || !grouped)) {
      PDS_ASSIGN_OR_RETURN(std::string content, StripContent(*step, at));
      PDS_ASSIGN_OR_RETURN(int64_t start, GetInt(*step, "start", at, 0));
      PDS_ASSIGN_OR_RETURN(int64_t stop, GetInt(*step, "stop", at, 0));
      if (fused) {
        // Trailing strips would need look-ahead.
        if (stop != 0 || content.size() != 1 || plan.strip_leading != 0) {
          return std::nullopt;
        }
        plan.strip_char = content[0];
        plan.strip_leading = static_cast<int>(start);
        continue;
      }
      // Per token, on the token strings.
      StripDecoder strip(content, static_cast<int>(start),
                         static_cast<int>(stop));
      for (StreamPlan::Token& t : plan.tokens) {
        std::vector<std::string> one = {t.text};
        PDS_RETURN_IF_ERROR(strip.DecodeChain(&one));
        t.text = one[0];
      }
      continue;
    }
    if (fused || grouped) return std::nullopt;
    if (type == "Replace") {
      PDS_ASSIGN_OR_RETURN(std::unique_ptr<Decoder> d,
                           ParseDecoder(*step, at, &no_added));
      for (StreamPlan::Token& t : plan.tokens) {
        std::vector<std::string> one = {t.text};
        PDS_RETURN_IF_ERROR(d->DecodeChain(&one));
        t.text = one[0];
      }
    } else if (type == "Metaspace") {
      PDS_ASSIGN_OR_RETURN(std::string replacement,
                           GetString(*step, "replacement", at, "\xE2\x96\x81"));
      if (replacement.empty()) return std::nullopt;
      for (StreamPlan::Token& t : plan.tokens) {
        t.text = absl::StrReplaceAll(t.text, {{replacement, " "}});
      }
      plan.strip_first_token = true;
      // Later per-token steps would see the first token already stripped.
      grouped = true;
    } else if (type == "ByteFallback") {
      for (StreamPlan::Token& t : plan.tokens) {
        const int b = ByteFallbackValue(t.text);
        if (b >= 0) {
          t.kind = StreamPlan::Kind::kRaw;
          t.text = std::string(1, static_cast<char>(b));
        }
      }
      plan.run_strips_bom = true;
      grouped = true;
    } else if (type == "ByteLevel") {
      for (size_t id = 0; id < plan.tokens.size(); ++id) {
        StreamPlan::Token& t = plan.tokens[id];
        if (is_added[id]) continue;
        t.kind = StreamPlan::Kind::kRaw;
        t.text = ByteLevelBytes(t.text);
      }
      grouped = true;
    } else {
      return std::nullopt;
    }
  }
  return plan;
}

}  // namespace pdserve::tokenizer::hf
