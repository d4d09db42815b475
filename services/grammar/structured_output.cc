#include "grammar/structured_output.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "model/weight_source.h"
#include "tokenizer/tokenizer.h"

namespace pdserve::grammar {
namespace {

// The sampler's view of a GrammarMatcher.
class MatcherConstraint final : public engine::TokenConstraint {
 public:
  explicit MatcherConstraint(std::shared_ptr<const CompiledGrammar> grammar)
      : matcher_(std::move(grammar)) {}
  absl::Status MaskLogits(std::span<float> logits) override {
    return matcher_.ApplyMaskToLogits(logits);
  }
  absl::Status Accept(int32_t token) override {
    absl::Status s = matcher_.Accept(token);
    if (s.ok()) return s;
    return absl::Status(s.code(),
                        absl::StrCat("structured output: ", s.message()));
  }
  absl::Status Rollback(int count) override { return matcher_.Rollback(count); }

 private:
  GrammarMatcher matcher_;
};

}  // namespace

std::unique_ptr<engine::TokenConstraint> NewMatcherConstraint(
    std::shared_ptr<const CompiledGrammar> grammar) {
  return std::make_unique<MatcherConstraint>(std::move(grammar));
}

GrammarSpec ToGrammarSpec(const engine::StructuredOutput& s) {
  using Kind = engine::StructuredOutput::Kind;
  switch (s.kind) {
    case Kind::kJsonSchema:
      return GrammarSpec::JsonSchema(s.text);
    case Kind::kRegex:
      return GrammarSpec::Regex(s.text);
    case Kind::kChoice:
      return GrammarSpec::Choice(s.choices);
    case Kind::kJsonObject:
    case Kind::kNone:
      break;
  }
  return GrammarSpec::JsonObject();
}

StructuredOutputCompiler::StructuredOutputCompiler(
    const tokenizer::Tokenizer* tokenizer, std::vector<int32_t> end_tokens)
    : end_tokens_(std::move(end_tokens)), tokenizer_(tokenizer) {}

StructuredOutputCompiler::StructuredOutputCompiler(
    const model::WeightSource& weights, std::vector<int32_t> end_tokens)
    : weights_(&weights),
      end_tokens_(std::move(end_tokens)),
      tokenizer_(nullptr) {}

StructuredOutputCompiler::~StructuredOutputCompiler() = default;

absl::StatusOr<std::shared_ptr<const TokenVocabulary>>
StructuredOutputCompiler::Vocabulary() {
  absl::MutexLock lock(&mu_);
  if (vocabulary_ != nullptr) return vocabulary_;
  if (!vocabulary_error_.ok()) return vocabulary_error_;
  if (tokenizer_ == nullptr && weights_ != nullptr &&
      weights_->tokenizer_spec().ok()) {
    absl::StatusOr<std::unique_ptr<tokenizer::Tokenizer>> loaded =
        tokenizer::LoadTokenizerForModel(*weights_);
    if (!loaded.ok()) {
      vocabulary_error_ = absl::FailedPreconditionError(
          absl::StrCat("structured output: the model's tokenizer: ",
                       loaded.status().message()));
      return vocabulary_error_;
    }
    owned_tokenizer_ = *std::move(loaded);
    tokenizer_ = owned_tokenizer_.get();
  }
  if (tokenizer_ == nullptr) {
    vocabulary_error_ = absl::FailedPreconditionError(
        "structured output needs the model's tokenizer, and this worker has "
        "none (dummy weights or no tokenizer files)");
    return vocabulary_error_;
  }
  absl::StatusOr<std::shared_ptr<const TokenVocabulary>> built =
      TokenVocabulary::FromTokenizer(*tokenizer_, end_tokens_);
  if (!built.ok()) {
    vocabulary_error_ = absl::FailedPreconditionError(absl::StrCat(
        "structured output: the vocabulary: ", built.status().message()));
    return vocabulary_error_;
  }
  vocabulary_ = *std::move(built);
  return vocabulary_;
}

absl::StatusOr<std::unique_ptr<engine::TokenConstraint>>
StructuredOutputCompiler::NewConstraint(
    const engine::StructuredOutput& structured_output) {
  absl::StatusOr<std::shared_ptr<const TokenVocabulary>> vocabulary =
      Vocabulary();
  if (!vocabulary.ok()) return vocabulary.status();
  absl::StatusOr<std::shared_ptr<const CompiledGrammar>> grammar =
      cache_.Get(ToGrammarSpec(structured_output), *vocabulary);
  if (!grammar.ok()) {
    return absl::Status(
        grammar.status().code(),
        absl::StrCat("structured output: ", grammar.status().message()));
  }
  return NewMatcherConstraint(*std::move(grammar));
}

}  // namespace pdserve::grammar
