// Builds a serialized SentencePiece ModelProto from a vocabulary embedded in
// GGUF metadata (tokenizer.ggml.*), so that GGUF models are tokenized by the
// very same SentencePiece library as Hugging Face models (tokenizer.model).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "model/weight_source.h"

namespace pdserve::tokenizer {

// SentencePiece piece types (sentencepiece_model.proto, SentencePiece.Type).
// llama.cpp's token types (tokenizer.ggml.token_type) use the same numbers;
// llama.cpp's 0 ("undefined") is treated as NORMAL.
enum class PieceType : int32_t {
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6,
};

// Serializes a ModelProto for `spec` (which must carry a "llama" vocabulary:
// tokens, scores and token_types of equal, non-zero length), with a BPE
// trainer_spec and llama's normalizer_spec (identity, add_dummy_prefix,
// no whitespace squeezing, escaped whitespace). byte_fallback is on when the
// vocabulary has byte pieces. For a vocabulary converted from a
// tokenizer.model, the bytes are identical to that file.
// Errors: INVALID_ARGUMENT (naming the offending field/index),
// UNIMPLEMENTED for a non-SentencePiece ggml_model such as "gpt2".
[[nodiscard]] absl::StatusOr<std::string> BuildSentencePieceModelProto(
    const model::TokenizerSpec& spec);

}  // namespace pdserve::tokenizer
