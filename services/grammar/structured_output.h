// Structured output for the workers that sample: turns a request's
// engine::StructuredOutput into a grammar matcher behind the sampler's
// engine::TokenConstraint, compiling each spec once per worker against the
// model's vocabulary (README.md, "Structured output in the workers").
//
// Thread-safety: StructuredOutputCompiler is thread-safe; a constraint it
// returns belongs to one request and one thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "engine/sampler.h"
#include "grammar/grammar.h"

namespace pdserve::tokenizer {
class Tokenizer;
}
namespace pdserve::model {
class WeightSource;
}

namespace pdserve::grammar {

// The grammar spec a request's structured output names.
GrammarSpec ToGrammarSpec(const engine::StructuredOutput& structured_output);

// A matcher of `grammar` at the start of the output, as the sampler's
// constraint.
std::unique_ptr<engine::TokenConstraint> NewMatcherConstraint(
    std::shared_ptr<const CompiledGrammar> grammar);

class StructuredOutputCompiler {
 public:
  // `tokenizer` may be null (a model without tokenizer files): every
  // structured request is then FAILED_PRECONDITION. `end_tokens`: the ids
  // that end generation (allowed exactly when the output is complete).
  StructuredOutputCompiler(const tokenizer::Tokenizer* tokenizer,
                           std::vector<int32_t> end_tokens);
  // Loads the model's tokenizer itself, on the first structured request (a
  // prefill stage needs none otherwise; a model without tokenizer files makes
  // structured requests FAILED_PRECONDITION). `weights` must outlive this.
  StructuredOutputCompiler(const model::WeightSource& weights,
                           std::vector<int32_t> end_tokens);
  ~StructuredOutputCompiler();

  // A fresh matcher at the start of the output. INVALID_ARGUMENT naming the
  // schema keyword / regex construct / limit at fault.
  [[nodiscard]] absl::StatusOr<std::unique_ptr<engine::TokenConstraint>>
  NewConstraint(const engine::StructuredOutput& structured_output);

  int64_t compilations() const { return cache_.compilations(); }

 private:
  // The vocabulary, built on the first structured request (its trie costs
  // memory a worker that never sees one should not pay).
  absl::StatusOr<std::shared_ptr<const TokenVocabulary>> Vocabulary();

  const model::WeightSource* const weights_ = nullptr;
  const std::vector<int32_t> end_tokens_;
  absl::Mutex mu_;
  const tokenizer::Tokenizer* tokenizer_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<tokenizer::Tokenizer> owned_tokenizer_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const TokenVocabulary> vocabulary_ ABSL_GUARDED_BY(mu_);
  absl::Status vocabulary_error_ ABSL_GUARDED_BY(mu_);
  GrammarCache cache_;
};

}  // namespace pdserve::grammar
