#include "grammar/grammar.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "grammar/automaton.h"
#include "grammar/grammar_ir.h"
#include "grammar/json_schema_compiler.h"
#include "grammar/regex_compiler.h"
#include "tokenizer/tokenizer.h"

namespace pdserve::grammar {

using internal::GrammarAutomaton;
using internal::GrammarBuilder;

namespace {

constexpr int64_t kMaxGrammarElements = 2'000'000;
constexpr size_t kMaxChoices = 10'000;
constexpr size_t kMaxChoiceBytes = 1 << 20;
constexpr int kMaxJsonWhitespace = 256;

uint64_t Fnv1a(uint64_t h, std::string_view bytes) {
  for (char c : bytes) {
    h ^= static_cast<uint8_t>(c);
    h *= 1099511628211ull;
  }
  return h;
}

std::string Printable(std::string_view bytes) {
  return absl::CEscape(
      absl::string_view(bytes.data(), std::min<size_t>(bytes.size(), 64)));
}

}  // namespace

// ---------------------------------------------------------------------------
// TokenVocabulary

TokenVocabulary::~TokenVocabulary() = default;

absl::StatusOr<std::shared_ptr<const TokenVocabulary>>
TokenVocabulary::FromTokenizer(const tokenizer::Tokenizer& tokenizer,
                               std::vector<int32_t> eos_ids) {
  const int32_t n = tokenizer.vocab_size();
  std::vector<std::string> bytes(n);
  int32_t word_piece = -1;
  for (int32_t id = 0; id < n; ++id) {
    if (tokenizer.IsControl(id)) continue;  // never text
    PDS_ASSIGN_OR_RETURN(bytes[id], tokenizer.TokenBytes(id));
    if (word_piece < 0 && bytes[id].size() >= 3 && bytes[id][0] == ' ' &&
        std::isalpha(static_cast<unsigned char>(bytes[id][1]))) {
      word_piece = id;
    }
  }
  // Does decoding drop the first token's leading space (SentencePiece's
  // dummy prefix)? Ask the decoder itself.
  bool strips = false;
  if (word_piece >= 0) {
    const int32_t ids[] = {word_piece};
    PDS_ASSIGN_OR_RETURN(std::string decoded, tokenizer.Decode(ids));
    strips = decoded == bytes[word_piece].substr(1);
  }
  return Create(std::move(bytes), std::move(eos_ids), strips);
}

absl::StatusOr<std::shared_ptr<const TokenVocabulary>> TokenVocabulary::Create(
    std::vector<std::string> token_bytes, std::vector<int32_t> eos_ids,
    bool first_token_strips_leading_space) {
  if (token_bytes.empty()) {
    return absl::InvalidArgumentError("token vocabulary is empty");
  }
  if (token_bytes.size() > (1u << 24)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "token vocabulary of ", token_bytes.size(), " ids is too large"));
  }
  std::sort(eos_ids.begin(), eos_ids.end());
  eos_ids.erase(std::unique(eos_ids.begin(), eos_ids.end()), eos_ids.end());
  if (eos_ids.empty()) {
    return absl::InvalidArgumentError(
        "a grammar vocabulary needs at least one EOS id (how else would a "
        "constrained output end?)");
  }
  auto vocabulary = std::shared_ptr<TokenVocabulary>(new TokenVocabulary());
  vocabulary->is_eos_.assign(token_bytes.size(), 0);
  for (int32_t id : eos_ids) {
    if (id < 0 || id >= static_cast<int32_t>(token_bytes.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "EOS id ", id, " is outside the vocabulary of ", token_bytes.size()));
    }
    token_bytes[id].clear();  // EOS is never text
    vocabulary->is_eos_[id] = 1;
  }
  uint64_t h = 14695981039346656037ull;
  for (const std::string& b : token_bytes) {
    h = Fnv1a(h, absl::StrCat(b.size(), ":"));
    h = Fnv1a(h, b);
  }
  for (int32_t id : eos_ids) h = Fnv1a(h, absl::StrCat("eos", id));
  vocabulary->fingerprint_ =
      absl::StrCat(token_bytes.size(), "/", h, "/",
                   first_token_strips_leading_space ? "strip" : "keep");
  std::vector<std::string_view> views(token_bytes.begin(), token_bytes.end());
  vocabulary->trie_ = std::make_unique<internal::TokenTrie>(views);
  if (first_token_strips_leading_space) {
    for (std::string_view& v : views) {
      if (!v.empty() && v[0] == ' ') v.remove_prefix(1);
    }
    vocabulary->first_trie_ = std::make_unique<internal::TokenTrie>(views);
  }
  vocabulary->token_bytes_ = std::move(token_bytes);
  vocabulary->eos_ids_ = std::move(eos_ids);
  vocabulary->first_token_strips_leading_space_ =
      first_token_strips_leading_space;
  return vocabulary;
}

bool TokenVocabulary::IsEos(int32_t id) const {
  return id >= 0 && id < size() && is_eos_[id] != 0;
}

std::string_view TokenVocabulary::FirstTokenBytes(int32_t id) const {
  std::string_view b = token_bytes_[id];
  if (first_token_strips_leading_space_ && !b.empty() && b[0] == ' ') {
    b.remove_prefix(1);
  }
  return b;
}

// ---------------------------------------------------------------------------
// CompiledGrammar

CompiledGrammar::~CompiledGrammar() = default;

absl::StatusOr<std::shared_ptr<const CompiledGrammar>> CompiledGrammar::Compile(
    const GrammarSpec& spec,
    std::shared_ptr<const TokenVocabulary> vocabulary) {
  if (vocabulary == nullptr) {
    return absl::InvalidArgumentError("grammar compiled without a vocabulary");
  }
  if (spec.max_json_whitespace < 0 ||
      spec.max_json_whitespace > kMaxJsonWhitespace) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_json_whitespace must be in [0, ", kMaxJsonWhitespace,
                     "], not ", spec.max_json_whitespace));
  }
  GrammarBuilder builder(kMaxGrammarElements);
  internal::JsonGrammarOptions json_options;
  json_options.max_whitespace = spec.max_json_whitespace;
  int32_t root = -1;
  switch (spec.kind) {
    case GrammarSpec::Kind::kJsonObject: {
      PDS_ASSIGN_OR_RETURN(
          root, internal::CompileAnyJsonObject(json_options, &builder));
      break;
    }
    case GrammarSpec::Kind::kJsonSchema: {
      PDS_ASSIGN_OR_RETURN(
          root, internal::CompileJsonSchema(spec.text, json_options, &builder));
      break;
    }
    case GrammarSpec::Kind::kRegex: {
      PDS_ASSIGN_OR_RETURN(internal::Symbol s,
                           internal::CompileRegex(
                               spec.text, internal::RegexOptions(), &builder));
      root = builder.NewRule();
      builder.AddAlternative(root, {s});
      break;
    }
    case GrammarSpec::Kind::kChoice: {
      if (spec.choices.empty()) {
        return absl::InvalidArgumentError(
            "guided choice needs at least one choice");
      }
      if (spec.choices.size() > kMaxChoices) {
        return absl::InvalidArgumentError(
            absl::StrCat("guided choice has ", spec.choices.size(),
                         " choices; the limit is ", kMaxChoices));
      }
      size_t total = 0;
      root = builder.NewRule();
      for (size_t i = 0; i < spec.choices.size(); ++i) {
        total += spec.choices[i].size();
        if (total > kMaxChoiceBytes) {
          return absl::InvalidArgumentError(absl::StrCat(
              "guided choices exceed ", kMaxChoiceBytes, " bytes in all"));
        }
        if (spec.choices[i].empty()) {
          return absl::InvalidArgumentError(
              absl::StrCat("guided choice ", i, " is empty"));
        }
        internal::Sequence seq;
        builder.AppendLiteral(spec.choices[i], &seq);
        builder.AddAlternative(root, seq);
      }
      break;
    }
  }
  PDS_ASSIGN_OR_RETURN(internal::Grammar grammar,
                       std::move(builder).Build(root));
  auto compiled = std::shared_ptr<CompiledGrammar>(new CompiledGrammar());
  compiled->automaton_ = std::make_unique<GrammarAutomaton>(
      std::move(grammar), vocabulary.get(), internal::AutomatonLimits());
  PDS_RETURN_IF_ERROR(compiled->automaton_->Init());
  compiled->vocabulary_ = std::move(vocabulary);
  return compiled;
}

int64_t CompiledGrammar::grammar_size() const {
  return automaton_->grammar_size();
}
int64_t CompiledGrammar::automaton_states() const {
  return automaton_->num_states();
}

// ---------------------------------------------------------------------------
// GrammarCache

absl::StatusOr<std::shared_ptr<const CompiledGrammar>> GrammarCache::Get(
    const GrammarSpec& spec,
    std::shared_ptr<const TokenVocabulary> vocabulary) {
  if (vocabulary == nullptr) {
    return absl::InvalidArgumentError("grammar compiled without a vocabulary");
  }
  std::string key = absl::StrCat(
      static_cast<int>(spec.kind), "|", spec.max_json_whitespace, "|",
      vocabulary->fingerprint(), "|", spec.text.size(), ":", spec.text);
  for (const std::string& c : spec.choices)
    absl::StrAppend(&key, "|", c.size(), ":", c);
  {
    absl::MutexLock lock(&mu_);
    for (Entry& e : entries_) {
      if (e.key == key) {
        e.last_use = ++clock_;
        return e.grammar;
      }
    }
  }
  // Compiled outside the lock; a racing duplicate is harmless.
  PDS_ASSIGN_OR_RETURN(std::shared_ptr<const CompiledGrammar> grammar,
                       CompiledGrammar::Compile(spec, std::move(vocabulary)));
  absl::MutexLock lock(&mu_);
  ++compilations_;
  for (Entry& e : entries_) {
    if (e.key == key) return e.grammar;
  }
  if (entries_.size() >= capacity_ && !entries_.empty()) {
    auto oldest = std::min_element(
        entries_.begin(), entries_.end(),
        [](const Entry& a, const Entry& b) { return a.last_use < b.last_use; });
    entries_.erase(oldest);
  }
  if (capacity_ > 0) entries_.push_back({std::move(key), grammar, ++clock_});
  return grammar;
}

int64_t GrammarCache::compilations() const {
  absl::MutexLock lock(&mu_);
  return compilations_;
}

// ---------------------------------------------------------------------------
// GrammarMatcher

GrammarMatcher::GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar)
    : grammar_(std::move(grammar)) {
  states_.push_back(grammar_->automaton_->start());
  text_sizes_.push_back(0);
}

int32_t GrammarMatcher::BitmaskWords() const {
  return (grammar_->vocabulary().size() + 31) / 32;
}

std::string_view GrammarMatcher::BytesAt(int32_t token, int position) const {
  const TokenVocabulary& v = grammar_->vocabulary();
  return position == 0 ? v.FirstTokenBytes(token) : v.token_bytes(token);
}

absl::Status GrammarMatcher::FillNextTokenBitmask(std::span<uint32_t> bitmask) {
  const int32_t words = BitmaskWords();
  if (static_cast<int64_t>(bitmask.size()) < words) {
    return absl::InvalidArgumentError(
        absl::StrCat("token bitmask has ", bitmask.size(),
                     " words; the vocabulary needs ", words));
  }
  std::fill(bitmask.begin(), bitmask.end(), 0u);
  if (terminated_) return absl::OkStatus();
  const bool first = num_accepted() == 0 &&
                     grammar_->vocabulary().first_token_strips_leading_space();
  return grammar_->automaton_->FillMask(states_.back(), first,
                                        bitmask.first(words));
}

absl::Status GrammarMatcher::ApplyMaskToLogits(std::span<float> logits) {
  const int32_t vocab = grammar_->vocabulary().size();
  if (static_cast<int64_t>(logits.size()) < vocab) {
    return absl::InvalidArgumentError(absl::StrCat(
        "logits have ", logits.size(), " entries; the vocabulary has ", vocab));
  }
  std::vector<uint32_t> mask(BitmaskWords());
  PDS_RETURN_IF_ERROR(FillNextTokenBitmask(mask));
  constexpr float kMinusInfinity = -std::numeric_limits<float>::infinity();
  for (int32_t id = 0; id < vocab; ++id) {
    if ((mask[id >> 5] >> (id & 31) & 1u) == 0) logits[id] = kMinusInfinity;
  }
  for (size_t id = vocab; id < logits.size(); ++id) logits[id] = kMinusInfinity;
  return absl::OkStatus();
}

absl::StatusOr<bool> GrammarMatcher::IsTokenAllowed(int32_t token) {
  const TokenVocabulary& v = grammar_->vocabulary();
  if (terminated_ || token < 0 || token >= v.size()) return false;
  if (v.IsEos(token)) return IsComplete();
  const std::string_view bytes = BytesAt(token, num_accepted());
  if (bytes.empty()) return false;
  PDS_ASSIGN_OR_RETURN(int32_t next,
                       grammar_->automaton_->Walk(states_.back(), bytes));
  return next != GrammarAutomaton::kDead;
}

absl::Status GrammarMatcher::Accept(int32_t token) {
  const TokenVocabulary& v = grammar_->vocabulary();
  if (terminated_) {
    return absl::InvalidArgumentError(
        absl::StrCat("token ", token, " after the output ended (EOS)"));
  }
  if (token < 0 || token >= v.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "token ", token, " is outside the vocabulary of ", v.size()));
  }
  if (v.IsEos(token)) {
    if (!IsComplete()) {
      return absl::InvalidArgumentError(
          absl::StrCat("EOS token ", token, " before the output is complete"));
    }
    states_.push_back(states_.back());
    text_sizes_.push_back(text_.size());
    terminated_ = true;
    return absl::OkStatus();
  }
  const std::string_view bytes = BytesAt(token, num_accepted());
  int32_t next = GrammarAutomaton::kDead;
  if (!bytes.empty()) {
    PDS_ASSIGN_OR_RETURN(next,
                         grammar_->automaton_->Walk(states_.back(), bytes));
  }
  if (next == GrammarAutomaton::kDead) {
    return absl::InvalidArgumentError(absl::StrCat(
        "token ", token, " (\"", Printable(v.token_bytes(token)),
        "\") is not allowed by the grammar after \"",
        Printable(text_.size() > 64
                      ? std::string_view(text_).substr(text_.size() - 64)
                      : std::string_view(text_)),
        "\""));
  }
  states_.push_back(next);
  text_.append(bytes);
  text_sizes_.push_back(text_.size());
  return absl::OkStatus();
}

absl::Status GrammarMatcher::Rollback(int count) {
  if (count < 0 || count > num_accepted()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot roll back ", count,
                                                   " tokens; ", num_accepted(),
                                                   " were accepted"));
  }
  if (count == 0) return absl::OkStatus();
  states_.resize(states_.size() - count);
  text_sizes_.resize(text_sizes_.size() - count);
  text_.resize(text_sizes_.back());
  terminated_ = false;  // EOS is always the last token
  return absl::OkStatus();
}

bool GrammarMatcher::IsComplete() const {
  return grammar_->automaton_->IsAccepting(states_.back());
}

}  // namespace pdserve::grammar
