// Helpers shared by the tokenizer tests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/weight_source.h"

namespace pdserve::tokenizer::testing {

std::string ModelsDir();
std::string Stories260KDir();

struct GoldenCase {
  std::string prompt;
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> greedy_ids;
  std::string text;
};
// Every line of golden.jsonl and golden_long.jsonl.
std::vector<GoldenCase> LoadGoldens();

// A GGUF-style spec (tokens/scores/types) read back out of a tokenizer.model
// through SentencePiece itself.
absl::StatusOr<model::TokenizerSpec> SpecFromSentencePieceFile(
    const std::string& path);

// The spec embedded in stories260K.gguf, via model::OpenModel when
// services/model is built in; otherwise SpecFromSentencePieceFile of the HF
// tokenizer.model (the same vocabulary). `from_gguf` says which.
absl::StatusOr<model::TokenizerSpec> GgufSpec(bool* from_gguf);

}  // namespace pdserve::tokenizer::testing
