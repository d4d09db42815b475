// Grammar-constrained decoding: a JSON schema, JSON object, regular expression
// or list of choices is compiled against a model's token vocabulary into an
// automaton; a per-request matcher says which tokens keep the output a valid
// prefix of an accepted string (README.md states the contract: supported
// schema keywords, the regex subset, the whitespace bound, limits).
//
// Thread-safety: TokenVocabulary and CompiledGrammar are immutable to their
// users and may be shared by any number of threads (a CompiledGrammar's lazy
// automaton and mask cache sit behind its own mutex). A GrammarMatcher belongs
// to one request and one thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace pdserve::tokenizer {
class Tokenizer;
}

namespace pdserve::grammar {

namespace internal {
class GrammarAutomaton;
class TokenTrie;
}  // namespace internal

// What the output must be.
struct GrammarSpec {
  enum class Kind {
    kJsonObject,  // any JSON object (OpenAI response_format json_object)
    kJsonSchema,  // `text` is a JSON schema (OpenAI json_schema, guided_json)
    kRegex,       // `text` is a regular expression, fully matched
    kChoice,      // exactly one of `choices` (guided_choice)
  };
  Kind kind = Kind::kJsonObject;
  std::string text;
  std::vector<std::string> choices;
  // Whitespace bytes allowed in each gap between JSON tokens (and before and
  // after the value): a model cannot loop on whitespace forever.
  int max_json_whitespace = 20;

  static GrammarSpec JsonObject() { return {}; }
  static GrammarSpec JsonSchema(std::string schema) {
    GrammarSpec s;
    s.kind = Kind::kJsonSchema;
    s.text = std::move(schema);
    return s;
  }
  static GrammarSpec Regex(std::string pattern) {
    GrammarSpec s;
    s.kind = Kind::kRegex;
    s.text = std::move(pattern);
    return s;
  }
  static GrammarSpec Choice(std::vector<std::string> choices) {
    GrammarSpec s;
    s.kind = Kind::kChoice;
    s.choices = std::move(choices);
    return s;
  }
};

// The bytes each token id contributes to the output text, and the ids that end
// generation. Built once per model and shared by every grammar compiled for it.
class TokenVocabulary {
 public:
  // Tokens that are control tokens (other than the EOS ids) never match a
  // grammar. `first_token_strips_leading_space`: the output's first token
  // loses one leading space when decoded (SentencePiece's dummy prefix);
  // FromTokenizer detects it by decoding a word piece alone.
  [[nodiscard]] static absl::StatusOr<std::shared_ptr<const TokenVocabulary>>
  FromTokenizer(const tokenizer::Tokenizer& tokenizer,
                std::vector<int32_t> eos_ids);
  // `token_bytes[id]`; an empty string never matches (padding, control).
  // INVALID_ARGUMENT for an EOS id outside the vocabulary or no EOS at all.
  [[nodiscard]] static absl::StatusOr<std::shared_ptr<const TokenVocabulary>>
  Create(std::vector<std::string> token_bytes, std::vector<int32_t> eos_ids,
         bool first_token_strips_leading_space = false);

  ~TokenVocabulary();
  int32_t size() const { return static_cast<int32_t>(token_bytes_.size()); }
  const std::string& token_bytes(int32_t id) const { return token_bytes_[id]; }
  const std::vector<int32_t>& eos_ids() const { return eos_ids_; }
  bool IsEos(int32_t id) const;
  bool first_token_strips_leading_space() const {
    return first_token_strips_leading_space_;
  }
  // Identifies the contents (bytes, EOS ids, policy) for compilation caches.
  const std::string& fingerprint() const { return fingerprint_; }

  // Internal: the prefix trie of the token bytes (and of the first-token
  // variants when leading spaces are stripped).
  const internal::TokenTrie& trie() const { return *trie_; }
  const internal::TokenTrie& first_token_trie() const {
    return first_trie_ ? *first_trie_ : *trie_;
  }
  // The bytes of `id` as the output's first token.
  std::string_view FirstTokenBytes(int32_t id) const;

 private:
  TokenVocabulary() = default;
  std::vector<std::string> token_bytes_;
  std::vector<int32_t> eos_ids_;
  std::vector<uint8_t> is_eos_;
  bool first_token_strips_leading_space_ = false;
  std::string fingerprint_;
  std::unique_ptr<internal::TokenTrie> trie_;
  std::unique_ptr<internal::TokenTrie> first_trie_;
};

// A grammar compiled against one vocabulary. Immutable to its users; shared by
// every matcher of every request that uses the same spec.
class CompiledGrammar {
 public:
  // Errors: INVALID_ARGUMENT naming the unsupported keyword/construct and
  // where it is (JSON path `$.properties.x.items`, regex offset), or the limit
  // exceeded; never a crash.
  [[nodiscard]] static absl::StatusOr<std::shared_ptr<const CompiledGrammar>>
  Compile(const GrammarSpec& spec,
          std::shared_ptr<const TokenVocabulary> vocabulary);
  ~CompiledGrammar();

  const TokenVocabulary& vocabulary() const { return *vocabulary_; }
  // Number of grammar elements (rules' symbols) and automaton states built so
  // far (the automaton grows lazily as outputs explore it).
  int64_t grammar_size() const;
  int64_t automaton_states() const;

 private:
  friend class GrammarMatcher;
  CompiledGrammar() = default;
  std::shared_ptr<const TokenVocabulary> vocabulary_;
  std::unique_ptr<internal::GrammarAutomaton> automaton_;
};

// Compiles once per (spec, vocabulary): a worker that sees the same schema on
// every request compiles it once. Thread-safe. Holds at most `capacity`
// grammars, dropping the least recently used (matchers keep theirs alive).
class GrammarCache {
 public:
  explicit GrammarCache(size_t capacity = 64) : capacity_(capacity) {}
  [[nodiscard]] absl::StatusOr<std::shared_ptr<const CompiledGrammar>> Get(
      const GrammarSpec& spec,
      std::shared_ptr<const TokenVocabulary> vocabulary);
  int64_t compilations() const;

 private:
  struct Entry {
    std::string key;
    std::shared_ptr<const CompiledGrammar> grammar;
    uint64_t last_use = 0;
  };
  const size_t capacity_;
  mutable absl::Mutex mu_;
  std::vector<Entry> entries_ ABSL_GUARDED_BY(mu_);
  uint64_t clock_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t compilations_ ABSL_GUARDED_BY(mu_) = 0;
};

// One request's position in the grammar. Copyable (a copy is a few vectors:
// a speculative verifier may copy, try drafted tokens and drop the copy) and
// rewindable (Rollback).
class GrammarMatcher {
 public:
  explicit GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar);

  // 32-bit words, bit (id % 32) of word (id / 32) set when token `id` may come
  // next: exactly the tokens whose bytes keep the output a prefix of an
  // accepted string, plus the EOS ids when the output is complete. After EOS
  // was accepted no bit is set. `bitmask` needs BitmaskWords() words.
  // Errors: INVALID_ARGUMENT for a short buffer; RESOURCE_EXHAUSTED when the
  // automaton reached its size limit.
  [[nodiscard]] absl::Status FillNextTokenBitmask(std::span<uint32_t> bitmask);
  int32_t BitmaskWords() const;
  // Sets every forbidden token's logit to -infinity. `logits` may be longer
  // than the vocabulary (padding rows): those are forbidden too.
  [[nodiscard]] absl::Status ApplyMaskToLogits(std::span<float> logits);

  // Whether `token` may come next (one walk of its bytes: cheap for a verifier
  // checking a drafted token).
  [[nodiscard]] absl::StatusOr<bool> IsTokenAllowed(int32_t token);

  // Advances by `token`. INVALID_ARGUMENT (state unchanged) when the grammar
  // forbids it, when it is out of range, or after EOS.
  [[nodiscard]] absl::Status Accept(int32_t token);
  // Undoes the last `count` accepted tokens (EOS included).
  // INVALID_ARGUMENT when fewer were accepted.
  [[nodiscard]] absl::Status Rollback(int count);
  int num_accepted() const { return static_cast<int>(states_.size()) - 1; }

  // The output so far is a complete accepted string (EOS would be allowed).
  bool IsComplete() const;
  // EOS was accepted.
  bool IsTerminated() const { return terminated_; }
  // The output text the accepted tokens spell (first-token policy applied).
  const std::string& text() const { return text_; }

 private:
  absl::StatusOr<int32_t> Walk(int32_t state, std::string_view bytes) const;
  std::string_view BytesAt(int32_t token, int position) const;

  std::shared_ptr<const CompiledGrammar> grammar_;
  // states_[k]: automaton state after k accepted text tokens.
  std::vector<int32_t> states_;
  std::vector<size_t> text_sizes_;  // text_ size after each accepted token
  std::string text_;
  bool terminated_ = false;
};

}  // namespace pdserve::grammar
