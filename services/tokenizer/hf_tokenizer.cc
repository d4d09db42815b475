#include "tokenizer/hf_tokenizer.h"

#include <algorithm>
#include <limits>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/mapped_file.h"
#include "common/status_macros.h"
#include "tokenizer/utf8.h"

namespace pdserve::tokenizer::hf {
namespace {

absl::string_view Absl(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

absl::StatusOr<Json> ParseJsonFile(const std::string& path) {
  PDS_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  try {
    return Json::parse(text);
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": invalid JSON: ", e.what()));
  }
}

// A token named in tokenizer_config.json: a string, {"content": ...}, or null.
std::optional<std::string> ConfigToken(const Json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object()) {
    auto it = v.find("content");
    if (it != v.end() && it->is_string()) return it->get<std::string>();
  }
  return std::nullopt;
}

// ------------------------------------------------------------------------
// Streams

// Decodes with a StreamPlan: raw bytes accumulate in a run that is emitted
// as far as it is decodable; a text token flushes the run.
class PlannedStream : public internal::StreamDecoder {
 public:
  PlannedStream(const HfTokenizer& tok, bool at_text_start)
      : tok_(tok),
        plan_(*tok.stream_plan()),
        strip_left_(at_text_start ? plan_.strip_leading : 0),
        first_token_(at_text_start) {}

  std::string Push(int32_t id) override {
    if (tok_.IsControl(id)) return "";  // skipped, as in Decode
    const StreamPlan::Token& t = plan_.tokens[id];
    std::string out;
    if (t.kind == StreamPlan::Kind::kRaw) {
      run_ += t.text;
      DrainRun(/*end=*/false, &out);
    } else {
      DrainRun(/*end=*/true, &out);
      std::string_view text = t.text;
      if (first_token_ && plan_.strip_first_token && text.starts_with(" ")) {
        text.remove_prefix(1);
      }
      out += text;
    }
    first_token_ = false;
    return Emit(std::move(out));
  }

  std::string Finish() override {
    std::string out;
    DrainRun(/*end=*/true, &out);
    return Emit(std::move(out));
  }

  size_t pending_bytes() const override { return run_.size(); }

 private:
  void DrainRun(bool end, std::string* out) {
    if (run_.empty() && !end) return;
    if (plan_.run_strips_bom && run_start_) {
      // TextDecoder drops a byte order mark at the start of each run.
      constexpr std::string_view kBom = "\xEF\xBB\xBF";
      if (!end && run_.size() < 3 && kBom.starts_with(run_)) return;
      if (absl::StartsWith(run_, Absl(kBom))) run_.erase(0, 3);
      run_start_ = false;
    }
    const size_t n = end ? run_.size() : utf8::DecodablePrefix(run_);
    utf8::AppendLossy(std::string_view(run_).substr(0, n), out);
    run_.erase(0, n);
    if (end) run_start_ = true;
  }

  std::string Emit(std::string out) {
    size_t cut = 0;
    while (strip_left_ > 0 && cut < out.size()) {
      if (out[cut] != plan_.strip_char) {
        strip_left_ = 0;
        break;
      }
      ++cut;
      --strip_left_;
    }
    if (cut > 0) out.erase(0, cut);
    return out;
  }

  const HfTokenizer& tok_;
  const StreamPlan& plan_;
  std::string run_;
  bool run_start_ = true;
  int strip_left_;
  bool first_token_;
};

// For decoder chains without a plan: re-decodes everything and emits what
// grew, holding back a trailing U+FFFD (it may be a character still
// arriving). Quadratic; only for unusual decoder configurations.
class RedecodeStream : public internal::StreamDecoder {
 public:
  explicit RedecodeStream(const HfTokenizer& tok) : tok_(tok) {}
  std::string Push(int32_t id) override {
    ids_.push_back(id);
    return Next(false);
  }
  std::string Finish() override { return Next(true); }
  size_t pending_bytes() const override { return 0; }

 private:
  std::string Next(bool end) {
    absl::StatusOr<std::string> text = tok_.Decode(ids_);
    if (!text.ok()) return "";
    std::string_view now = *text;
    if (!end && now.ends_with("\xEF\xBF\xBD")) now.remove_suffix(3);
    if (now.size() <= emitted_ || now.substr(0, emitted_) != emitted_text_) {
      return "";
    }
    std::string delta(now.substr(emitted_));
    emitted_text_ += delta;
    emitted_ = emitted_text_.size();
    return delta;
  }
  const HfTokenizer& tok_;
  std::vector<int32_t> ids_;
  std::string emitted_text_;
  size_t emitted_ = 0;
};

// ------------------------------------------------------------------------
// GGUF gpt2 pre-tokenizer names (llama.cpp's tokenizer.ggml.pre) -> the
// regexes llama.cpp splits with, applied in order.
struct GgufPre {
  std::vector<std::string> regexes;
  bool ignore_merges = false;
};

std::optional<GgufPre> GgufPreTokenizer(const std::string& pre) {
  static const char kLlama3[] =
      "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
      "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|"
      "\\s+";
  static const char kQwen2[] =
      "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
      "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
  static const char kGpt2[] =
      "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|"
      "\\s+(?!\\S)";
  const auto is = [&](std::initializer_list<const char*> names) {
    return std::any_of(names.begin(), names.end(),
                       [&](const char* n) { return pre == n; });
  };
  if (is({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
          "midm-2.0", "lfm2"})) {
    return GgufPre{{kLlama3}, true};
  }
  if (is({"qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"})) {
    return GgufPre{{kQwen2}, false};
  }
  if (is({"gpt-2", "phi-2", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de",
          "jina-v2-code", "mpt", "olmo", "jais"})) {
    return GgufPre{{kGpt2}, false};
  }
  if (is({"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
          "minerva-7b"})) {
    return GgufPre{{"\\p{N}", kGpt2}, false};
  }
  if (is({"default"})) {
    return GgufPre{
        {"[\\p{P}\\$\\+<=>\\^~\\|]+", kGpt2, "\\p{N}+", "[0-9][0-9][0-9]"},
        false};
  }
  return std::nullopt;
}

}  // namespace

// --------------------------------------------------------------------------
// Loading

absl::StatusOr<std::unique_ptr<HfTokenizer>> HfTokenizer::FromFiles(
    const std::string& json_path, const std::string& config_path) {
  PDS_ASSIGN_OR_RETURN(Json tokenizer, ParseJsonFile(json_path));
  std::optional<Json> config;
  if (!config_path.empty()) {
    PDS_ASSIGN_OR_RETURN(config, ParseJsonFile(config_path));
    if (!config->is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(config_path, ": expected a JSON object"));
    }
  }
  return FromJson(tokenizer, config ? &*config : nullptr, json_path);
}

absl::StatusOr<std::unique_ptr<HfTokenizer>> HfTokenizer::FromJson(
    const Json& tokenizer, const Json* config, const std::string& file) {
  std::unique_ptr<HfTokenizer> tok(new HfTokenizer());
  try {
    PDS_RETURN_IF_ERROR(tok->Load(tokenizer, config, file));
  } catch (const Json::exception& e) {
    // nlohmann throws on a value of an unexpected type deep inside; keep
    // the file in the message.
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": malformed tokenizer.json: ", e.what()));
  }
  return tok;
}

absl::Status HfTokenizer::Load(const Json& root, const Json* config,
                               const std::string& file) {
  const JsonPath top(file, "");
  if (!root.is_object()) return top.Error("expected a JSON object");

  // ---- model: vocab and merges.
  PDS_ASSIGN_OR_RETURN(const Json* model, Member(root, "model", top));
  const JsonPath model_at = top.Key("model");
  if (model == nullptr) return model_at.Error("missing");
  PDS_ASSIGN_OR_RETURN(std::string model_type,
                       GetString(*model, "type", model_at, "BPE"));
  if (model_type != "BPE") {
    return model_at.Key("type").Error(absl::StrCat(
        "unsupported model type \"", model_type, "\" (supported: BPE)"));
  }
  PDS_ASSIGN_OR_RETURN(const Json* vocab, Member(*model, "vocab", model_at));
  const JsonPath vocab_at = model_at.Key("vocab");
  if (vocab == nullptr || !vocab->is_object()) {
    return vocab_at.Error("expected an object mapping tokens to ids");
  }
  constexpr int64_t kMaxId = std::numeric_limits<int32_t>::max() - 1;
  int64_t max_id = -1;
  tokens_.reserve(vocab->size() + 1024);
  for (const auto& [token, id] : vocab->items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
        id.get<int64_t>() > kMaxId) {
      return vocab_at.Key(token).Error(absl::StrCat(
          "id must be an integer in [0, ", kMaxId, "], found ", id.dump()));
    }
    tokens_[token] = static_cast<int32_t>(id.get<int64_t>());
    max_id = std::max(max_id, id.get<int64_t>());
  }

  // ---- added tokens (laid over the vocabulary, as the reference does).
  PDS_ASSIGN_OR_RETURN(const Json* added, Member(root, "added_tokens", top));
  const JsonPath added_at = top.Key("added_tokens");
  if (added != nullptr && !added->is_array()) {
    return added_at.Error("expected a list");
  }
  if (added != nullptr) {
    for (size_t i = 0; i < added->size(); ++i) {
      const Json& a = (*added)[i];
      const JsonPath at = added_at.Index(i);
      AddedToken t;
      PDS_ASSIGN_OR_RETURN(t.content, GetString(a, "content", at));
      if (t.content.empty()) return at.Key("content").Error("missing or empty");
      if (!utf8::IsWellFormed(t.content)) {
        return at.Key("content").Error("not valid UTF-8");
      }
      PDS_ASSIGN_OR_RETURN(int64_t id, GetInt(a, "id", at, -1));
      if (id < 0 || id > kMaxId) {
        return at.Key("id").Error(
            absl::StrCat("id must be an integer in [0, ", kMaxId, "]"));
      }
      t.id = static_cast<int32_t>(id);
      PDS_ASSIGN_OR_RETURN(t.lstrip, GetBool(a, "lstrip", at, false));
      PDS_ASSIGN_OR_RETURN(t.rstrip, GetBool(a, "rstrip", at, false));
      PDS_ASSIGN_OR_RETURN(t.single_word, GetBool(a, "single_word", at, false));
      PDS_ASSIGN_OR_RETURN(t.special, GetBool(a, "special", at, false));
      PDS_ASSIGN_OR_RETURN(t.normalized,
                           GetBool(a, "normalized", at, !t.special));
      tokens_[t.content] = t.id;
      max_id = std::max(max_id, id);
      added_.push_back(std::move(t));
    }
  }
  if (max_id < 0) return vocab_at.Error("the vocabulary is empty");
  if (max_id > static_cast<int64_t>(tokens_.size()) * 4 + 1024) {
    return vocab_at.Error(
        absl::StrCat("ids are absurdly sparse: the largest is ", max_id,
                     " for ", tokens_.size(), " tokens"));
  }
  vocab_size = static_cast<int32_t>(max_id + 1);
  pieces_.assign(vocab_size, "");
  is_added_.assign(vocab_size, false);
  is_control_.assign(vocab_size, false);
  std::vector<bool> present(vocab_size, false);
  for (const auto& [token, id] : vocab->items()) {
    pieces_[id.get<int32_t>()] = token;
    present[id.get<int32_t>()] = true;
  }
  for (const AddedToken& t : added_) {
    pieces_[t.id] = t.content;
    present[t.id] = true;
    is_added_[t.id] = true;
    added_contents_.insert(t.content);
    if (t.special) is_control_[t.id] = true;
  }

  // ---- BPE options.
  PDS_ASSIGN_OR_RETURN(unk_token_, GetString(*model, "unk_token", model_at));
  BpeOptions options;
  if (!unk_token_.empty()) {
    auto it = tokens_.find(unk_token_);
    if (it == tokens_.end()) {
      return model_at.Key("unk_token")
          .Error(absl::StrCat("\"", unk_token_, "\" is not in the vocabulary"));
    }
    options.unk_id = it->second;
    unk_id = it->second;
  }
  PDS_ASSIGN_OR_RETURN(options.byte_fallback,
                       GetBool(*model, "byte_fallback", model_at, false));
  PDS_ASSIGN_OR_RETURN(options.fuse_unk,
                       GetBool(*model, "fuse_unk", model_at, false));
  PDS_ASSIGN_OR_RETURN(options.ignore_merges,
                       GetBool(*model, "ignore_merges", model_at, false));
  for (const char* key : {"end_of_word_suffix", "continuing_subword_suffix"}) {
    PDS_ASSIGN_OR_RETURN(std::string v, GetString(*model, key, model_at));
    if (!v.empty()) {
      return model_at.Key(key).Error("subword suffixes are not supported");
    }
  }
  PDS_ASSIGN_OR_RETURN(const Json* dropout,
                       Member(*model, "dropout", model_at));
  if (dropout != nullptr && dropout->is_number() &&
      dropout->get<double>() != 0.0) {
    return model_at.Key("dropout").Error("BPE dropout is not supported");
  }

  PDS_ASSIGN_OR_RETURN(const Json* merges, Member(*model, "merges", model_at));
  const JsonPath merges_at = model_at.Key("merges");
  if (merges == nullptr || !merges->is_array()) {
    return merges_at.Error("expected a list of merges");
  }
  std::vector<std::pair<std::string, std::string>> merge_list;
  merge_list.reserve(merges->size());
  for (size_t i = 0; i < merges->size(); ++i) {
    const Json& m = (*merges)[i];
    if (m.is_string()) {
      // "a b": split at the first space (tokens cannot contain spaces in
      // this format).
      const std::string s = m.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || space == 0 || space + 1 >= s.size()) {
        return merges_at.Index(i).Error(
            absl::StrCat("expected \"left right\", found \"", s, "\""));
      }
      const size_t second_space = s.find(' ', space + 1);
      merge_list.emplace_back(
          s.substr(0, space),
          s.substr(space + 1, second_space == std::string::npos
                                  ? std::string::npos
                                  : second_space - space - 1));
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() &&
               m[1].is_string()) {
      merge_list.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
    } else {
      return merges_at.Index(i).Error(
          absl::StrCat("expected \"left right\" or [\"left\", \"right\"], "
                       "found ",
                       m.dump()));
    }
  }
  BpeModel::MergeError merge_error;
  model_ = BpeModel::Create(&tokens_, merge_list, options, &merge_error);
  if (model_ == nullptr) {
    return merges_at.Index(merge_error.index).Error(merge_error.what);
  }

  // ---- components.
  PDS_ASSIGN_OR_RETURN(const Json* normalizer, Member(root, "normalizer", top));
  if (normalizer != nullptr) {
    PDS_ASSIGN_OR_RETURN(normalizer_,
                         ParseNormalizer(*normalizer, top.Key("normalizer")));
  }
  PDS_ASSIGN_OR_RETURN(const Json* pre, Member(root, "pre_tokenizer", top));
  if (pre != nullptr) {
    PDS_ASSIGN_OR_RETURN(pre_tokenizer_,
                         ParsePreTokenizer(*pre, top.Key("pre_tokenizer")));
  }
  PDS_ASSIGN_OR_RETURN(const Json* decoder, Member(root, "decoder", top));
  if (decoder != nullptr) {
    PDS_ASSIGN_OR_RETURN(
        decoder_, ParseDecoder(*decoder, top.Key("decoder"), &added_contents_));
  }
  PDS_ASSIGN_OR_RETURN(
      plan_, BuildStreamPlan(decoder ? *decoder : Json(), pieces_, is_added_));
  // A hole in the ids reads as the unk token, as in the reference.
  for (int32_t id = 0; plan_ && id < vocab_size; ++id) {
    if (!present[id]) plan_->tokens[id] = {StreamPlan::Kind::kText, ""};
  }

  // ---- post-processor (single sequence).
  PDS_ASSIGN_OR_RETURN(const Json* post, Member(root, "post_processor", top));
  const auto resolve = [&](const std::string& token,
                           const JsonPath& at) -> absl::StatusOr<int32_t> {
    auto it = tokens_.find(token);
    if (it == tokens_.end()) {
      return at.Error(absl::StrCat("special token \"", token,
                                   "\" is not in the vocabulary"));
    }
    return it->second;
  };
  std::function<absl::Status(const Json&, const JsonPath&)> parse_post =
      [&](const Json& p, const JsonPath& at) -> absl::Status {
    PDS_ASSIGN_OR_RETURN(std::string type, GetType(p, at));
    if (type == "ByteLevel") return absl::OkStatus();  // ids unchanged
    if (type == "Sequence") {
      PDS_ASSIGN_OR_RETURN(const Json* list, Member(p, "processors", at));
      if (list == nullptr || !list->is_array()) {
        return at.Key("processors").Error("expected a list");
      }
      for (size_t i = 0; i < list->size(); ++i) {
        PDS_RETURN_IF_ERROR(
            parse_post((*list)[i], at.Key("processors").Index(i)));
      }
      return absl::OkStatus();
    }
    if (type == "TemplateProcessing") {
      PDS_ASSIGN_OR_RETURN(const Json* single, Member(p, "single", at));
      const JsonPath single_at = at.Key("single");
      if (single == nullptr || !single->is_array()) {
        return single_at.Error("expected a list");
      }
      std::vector<int32_t> before, after;
      bool seen_a = false;
      for (size_t i = 0; i < single->size(); ++i) {
        const Json& item = (*single)[i];
        const JsonPath item_at = single_at.Index(i);
        if (item.is_object() && item.contains("SpecialToken")) {
          PDS_ASSIGN_OR_RETURN(std::string id,
                               GetString(item["SpecialToken"], "id",
                                         item_at.Key("SpecialToken")));
          PDS_ASSIGN_OR_RETURN(
              int32_t tid, resolve(id, item_at.Key("SpecialToken").Key("id")));
          (seen_a ? after : before).push_back(tid);
        } else if (item.is_object() && item.contains("Sequence")) {
          seen_a = true;
        } else {
          return item_at.Error(
              "expected {\"SpecialToken\": ...} or "
              "{\"Sequence\": ...}");
        }
      }
      prefix_ids_.insert(prefix_ids_.begin(), before.begin(), before.end());
      suffix_ids_.insert(suffix_ids_.end(), after.begin(), after.end());
      return absl::OkStatus();
    }
    if (type == "BertProcessing" || type == "RobertaProcessing") {
      for (const char* key : {"cls", "sep"}) {
        PDS_ASSIGN_OR_RETURN(const Json* v, Member(p, key, at));
        if (v == nullptr || !v->is_array() || v->empty() ||
            !(*v)[0].is_string()) {
          return at.Key(key).Error("expected [token, id]");
        }
        PDS_ASSIGN_OR_RETURN(int32_t tid,
                             resolve((*v)[0].get<std::string>(), at.Key(key)));
        if (std::string_view(key) == "cls") {
          prefix_ids_.insert(prefix_ids_.begin(), tid);
        } else {
          suffix_ids_.push_back(tid);
        }
      }
      return absl::OkStatus();
    }
    return at.Key("type").Error(absl::StrCat(
        "unsupported post-processor type \"", type,
        "\" (supported: TemplateProcessing, ByteLevel, BertProcessing, "
        "RobertaProcessing, Sequence)"));
  };
  if (post != nullptr) {
    PDS_RETURN_IF_ERROR(parse_post(*post, top.Key("post_processor")));
  }

  // ---- added-token splitters (contents matched before and after
  // normalization).
  for (size_t i = 0; i < added_.size(); ++i) {
    AddedToken& t = added_[i];
    added_by_content_.try_emplace(t.content, static_cast<int>(i));
    Splitter* splitter = &raw_splitter_;
    std::string content = t.content;
    if (t.normalized && normalizer_ != nullptr) {
      PDS_ASSIGN_OR_RETURN(content, normalizer_->Normalize(t.content));
      added_by_content_.try_emplace(content, static_cast<int>(i));
      splitter = &normalized_splitter_;
    }
    if (content.empty()) continue;
    // The first token with a given content wins, as in the reference map.
    splitter->index.try_emplace(content, static_cast<int>(i));
  }
  for (Splitter* s : {&raw_splitter_, &normalized_splitter_}) {
    s->lengths_by_first_byte.assign(256, {});
    for (const auto& [content, index] : s->index) {
      auto& lengths =
          s->lengths_by_first_byte[static_cast<unsigned char>(content[0])];
      if (std::find(lengths.begin(), lengths.end(), content.size()) ==
          lengths.end()) {
        lengths.push_back(content.size());
      }
    }
    for (auto& lengths : s->lengths_by_first_byte) {
      std::sort(lengths.rbegin(), lengths.rend());
    }
  }
  PDS_ASSIGN_OR_RETURN(Regex lead,
                       Regex::Compile(absl::StrCat("\\A", kJsWhitespace, "+")));
  PDS_ASSIGN_OR_RETURN(Regex trail,
                       Regex::Compile(absl::StrCat(kJsWhitespace, "+\\z")));
  leading_ws_ = std::move(lead);
  trailing_ws_ = std::move(trail);

  // ---- bos / eos: tokenizer_config.json when it names them, else the
  // post-processor's tokens around the text.
  if (!prefix_ids_.empty()) bos_id = prefix_ids_.front();
  if (!suffix_ids_.empty()) eos_id = suffix_ids_.back();
  if (config != nullptr) {
    const JsonPath config_at("tokenizer_config.json", "");
    for (auto [key, target] :
         {std::pair{"bos_token", &bos_id}, std::pair{"eos_token", &eos_id},
          std::pair{"unk_token", &unk_id}}) {
      auto it = config->find(key);
      if (it == config->end()) continue;
      const std::optional<std::string> token = ConfigToken(*it);
      if (!token.has_value()) {
        if (it->is_null()) *target = -1;
        continue;
      }
      auto found = tokens_.find(*token);
      if (found == tokens_.end()) {
        return config_at.Key(key).Error(
            absl::StrCat("\"", *token, "\" is not in the vocabulary"));
      }
      *target = found->second;
    }
    // Tokens the config lists as additional specials are skipped in
    // decoding too (the reference compares by content).
    auto it = config->find("additional_special_tokens");
    if (it != config->end() && it->is_array()) {
      for (const Json& v : *it) {
        const std::optional<std::string> token = ConfigToken(v);
        if (!token.has_value()) continue;
        auto found = tokens_.find(*token);
        if (found != tokens_.end()) is_control_[found->second] = true;
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<HfTokenizer>> HfTokenizer::FromGgufGpt2(
    const model::TokenizerSpec& spec) {
  const std::string file = "GGUF tokenizer.ggml.* vocabulary";
  const std::string pre_name =
      spec.ggml_pre.empty() ? "default" : spec.ggml_pre;
  const std::optional<GgufPre> pre = GgufPreTokenizer(pre_name);
  if (!pre.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": tokenizer.ggml.pre \"", pre_name,
                     "\" is not a supported pre-tokenizer (supported: "
                     "llama-bpe and its aliases, qwen2, gpt-2, starcoder, "
                     "default)"));
  }
  if (spec.tokens.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": tokenizer.ggml.tokens is empty"));
  }
  if (spec.merges.empty()) {
    // llama.cpp refuses a BPE vocabulary without merges too.
    return absl::InvalidArgumentError(
        absl::StrCat(file,
                     ": tokenizer.ggml.merges is missing or empty (a gpt2 "
                     "vocabulary needs its merges)"));
  }
  if (!spec.token_types.empty() &&
      spec.token_types.size() != spec.tokens.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        file, ": tokenizer.ggml.token_type has ", spec.token_types.size(),
        " entries for ", spec.tokens.size(), " tokens"));
  }
  // The equivalent tokenizer.json: byte-level BPE, llama.cpp's regexes as
  // Split pre-tokenizers, control (3) and user-defined (4) tokens as added
  // tokens matched verbatim.
  Json vocab = Json::object();
  Json added = Json::array();
  for (size_t id = 0; id < spec.tokens.size(); ++id) {
    const int type = spec.token_types.empty() ? 1 : spec.token_types[id];
    if (type == 3 || type == 4) {
      added.push_back({{"id", id},
                       {"content", spec.tokens[id]},
                       {"special", type == 3},
                       {"normalized", false},
                       {"lstrip", false},
                       {"rstrip", false},
                       {"single_word", false}});
    }
    vocab[spec.tokens[id]] = id;
  }
  Json splits = Json::array();
  for (const std::string& regex : pre->regexes) {
    splits.push_back({{"type", "Split"},
                      {"pattern", {{"Regex", regex}}},
                      {"behavior", "Isolated"},
                      {"invert", false}});
  }
  splits.push_back({{"type", "ByteLevel"},
                    {"add_prefix_space", false},
                    {"use_regex", false}});
  Json single = Json::array();
  Json special_tokens = Json::object();
  const auto add_special = [&](int32_t id) -> absl::Status {
    if (id < 0 || id >= static_cast<int32_t>(spec.tokens.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          file, ": special token id ", id, " is outside the vocabulary"));
    }
    single.push_back(
        {{"SpecialToken", {{"id", spec.tokens[id]}, {"type_id", 0}}}});
    return absl::OkStatus();
  };
  if (spec.add_bos && spec.bos_token_id >= 0) {
    PDS_RETURN_IF_ERROR(add_special(spec.bos_token_id));
  }
  single.push_back({{"Sequence", {{"id", "A"}, {"type_id", 0}}}});
  if (spec.add_eos && spec.eos_token_id >= 0) {
    PDS_RETURN_IF_ERROR(add_special(spec.eos_token_id));
  }
  Json merges = Json::array();
  for (const std::string& m : spec.merges) merges.push_back(m);
  Json doc = {
      {"added_tokens", std::move(added)},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "Sequence"}, {"pretokenizers", std::move(splits)}}},
      {"post_processor", {{"type", "TemplateProcessing"}, {"single", single}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model",
       {{"type", "BPE"},
        {"vocab", std::move(vocab)},
        {"merges", std::move(merges)},
        {"ignore_merges", pre->ignore_merges}}},
  };
  Json config = Json::object();
  for (auto [key, id] : {std::pair{"bos_token", spec.bos_token_id},
                         std::pair{"eos_token", spec.eos_token_id},
                         std::pair{"unk_token", spec.unk_token_id}}) {
    if (id >= 0 && id < static_cast<int32_t>(spec.tokens.size())) {
      config[key] = spec.tokens[id];
    } else {
      config[key] = nullptr;
    }
  }
  return FromJson(doc, &config, file);
}

// --------------------------------------------------------------------------
// Encoding

void HfTokenizer::Split(const Splitter& splitter, std::string_view text,
                        std::vector<Section>* out) const {
  if (splitter.empty()) {
    out->push_back({text, -1});
    return;
  }
  size_t start = 0;
  size_t i = 0;
  while (i < text.size()) {
    const auto& lengths =
        splitter.lengths_by_first_byte[static_cast<unsigned char>(text[i])];
    int match = -1;
    size_t match_len = 0;
    for (size_t len : lengths) {
      if (i + len > text.size()) continue;
      auto it = splitter.index.find(Absl(text.substr(i, len)));
      if (it != splitter.index.end()) {
        match = it->second;
        match_len = len;
        break;
      }
    }
    if (match < 0) {
      ++i;
      continue;
    }
    if (i > start) out->push_back({text.substr(start, i - start), -1});
    out->push_back({text.substr(i, match_len), match});
    i += match_len;
    start = i;
  }
  if (start < text.size()) out->push_back({text.substr(start), -1});
}

absl::Status HfTokenizer::Strip(std::vector<Section>* sections) const {
  for (size_t i = 0; i < sections->size(); ++i) {
    const int a = (*sections)[i].added;
    if (a < 0) continue;
    const AddedToken& t = added_[a];
    if (t.lstrip && i > 0 && (*sections)[i - 1].added < 0) {
      std::string_view& prev = (*sections)[i - 1].text;
      size_t keep = prev.size();
      PDS_RETURN_IF_ERROR(trailing_ws_->ForEachMatch(
          prev, [&](size_t b, size_t) { keep = std::min(keep, b); }));
      prev = prev.substr(0, keep);
    }
    if (t.rstrip && i + 1 < sections->size() && (*sections)[i + 1].added < 0) {
      std::string_view& next = (*sections)[i + 1].text;
      size_t cut = 0;
      PDS_RETURN_IF_ERROR(
          leading_ws_->ForEachMatch(next, [&](size_t b, size_t e) {
            if (b == 0) cut = e;
          }));
      next.remove_prefix(cut);
    }
  }
  return absl::OkStatus();
}

absl::Status HfTokenizer::EncodeText(std::string_view text,
                                     std::vector<int32_t>* out) const {
  std::vector<Section> sections;
  Split(raw_splitter_, text, &sections);
  PDS_RETURN_IF_ERROR(Strip(&sections));
  std::vector<std::string> words;
  for (size_t i = 0; i < sections.size(); ++i) {
    const Section& section = sections[i];
    if (section.text.empty()) continue;
    if (section.added >= 0) {
      out->push_back(added_[section.added].id);
      continue;
    }
    if (auto it = added_by_content_.find(Absl(section.text));
        it != added_by_content_.end()) {
      out->push_back(added_[it->second].id);
      continue;
    }
    std::string normalized(section.text);
    if (normalizer_ != nullptr) {
      PDS_ASSIGN_OR_RETURN(normalized,
                           normalizer_->Normalize(std::move(normalized)));
    }
    if (normalized.empty()) continue;
    std::vector<Section> subsections;
    Split(normalized_splitter_, normalized, &subsections);
    PDS_RETURN_IF_ERROR(Strip(&subsections));
    for (const Section& sub : subsections) {
      if (sub.text.empty()) continue;
      if (sub.added >= 0) {
        out->push_back(added_[sub.added].id);
        continue;
      }
      if (auto it = added_by_content_.find(Absl(sub.text));
          it != added_by_content_.end()) {
        out->push_back(added_[it->second].id);
        continue;
      }
      words.assign(1, std::string(sub.text));
      if (pre_tokenizer_ != nullptr) {
        PDS_RETURN_IF_ERROR(
            pre_tokenizer_->PreTokenize(&words, static_cast<int>(i)));
      }
      model_->Tokenize(words, out);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> HfTokenizer::Encode(
    std::string_view text, bool add_special) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  if (add_special) out = prefix_ids_;
  if (utf8::IsWellFormed(text)) {
    PDS_RETURN_IF_ERROR(EncodeText(text, &out));
  } else {
    PDS_RETURN_IF_ERROR(EncodeText(utf8::Lossy(text), &out));
  }
  if (add_special)
    out.insert(out.end(), suffix_ids_.begin(), suffix_ids_.end());
  return out;
}

// --------------------------------------------------------------------------
// Decoding

absl::StatusOr<std::string> HfTokenizer::DecodeAll(
    std::span<const int32_t> ids) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    const std::string& piece = pieces_[id];
    tokens.push_back(piece.empty() ? unk_token_ : piece);
  }
  if (decoder_ == nullptr) return absl::StrJoin(tokens, " ");
  PDS_RETURN_IF_ERROR(decoder_->DecodeChain(&tokens));
  return absl::StrJoin(tokens, "");
}

absl::StatusOr<std::string> HfTokenizer::Decode(
    std::span<const int32_t> ids) const {
  std::vector<int32_t> visible;
  visible.reserve(ids.size());
  for (int32_t id : ids) {
    if (!is_control_[id]) visible.push_back(id);
  }
  return DecodeAll(visible);
}

std::string_view HfTokenizer::IdToPiece(int32_t id) const {
  return pieces_[id];
}

std::string HfTokenizer::TokenBytes(int32_t id) const {
  if (is_added_[id] || !plan_.has_value()) return pieces_[id];
  return plan_->tokens[id].text;
}

bool HfTokenizer::IsControl(int32_t id) const { return is_control_[id]; }

std::unique_ptr<internal::StreamDecoder> HfTokenizer::NewStream(
    bool at_text_start) const {
  // Without a decoder the reference joins pieces with spaces: not
  // expressible per token either.
  if (plan_.has_value() && decoder_ != nullptr) {
    return std::make_unique<PlannedStream>(*this, at_text_start);
  }
  return std::make_unique<RedecodeStream>(*this);
}

}  // namespace pdserve::tokenizer::hf
