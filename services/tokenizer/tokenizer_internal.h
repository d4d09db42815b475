// Private to services/tokenizer: the state behind Tokenizer, shared with the
// IncrementalDetokenizer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tokenizer/sentencepiece_wrapper.h"

namespace pdserve::tokenizer::internal {

// How one id decodes, precomputed from SentencePiece so that streaming can
// reproduce SentencePieceProcessor::Decode piece by piece.
struct PieceEntry {
  enum class Kind : uint8_t { kText, kControl, kUnknown, kByte };
  Kind kind = Kind::kText;
  uint8_t byte = 0;                // kByte: the raw byte
  bool starts_with_space = false;  // kText: piece starts with U+2581
  std::string text;  // kText: piece with U+2581 -> ' '; kUnknown: its surface
};

struct TokenizerImpl {
  SentencePieceModel sp;
  std::vector<PieceEntry> pieces;  // indexed by id
  int32_t vocab_size = 0;
  int32_t bos_id = -1;
  int32_t eos_id = -1;
  int32_t unk_id = -1;
  // Whether Decode drops the leading U+2581 of the first word (models with
  // add_dummy_prefix or remove_extra_whitespaces); probed from the library.
  bool strips_dummy_prefix = true;
};

}  // namespace pdserve::tokenizer::internal
