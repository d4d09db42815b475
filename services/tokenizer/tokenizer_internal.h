// Private to services/tokenizer: the backend behind Tokenizer (SentencePiece
// or Hugging Face tokenizer.json), shared with the IncrementalDetokenizer.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "tokenizer/sentencepiece_wrapper.h"

namespace pdserve::tokenizer::internal {

// The state of one stream of decoded ids (IncrementalDetokenizer's engine).
// Ids reaching it are already range-checked.
class StreamDecoder {
 public:
  virtual ~StreamDecoder() = default;
  virtual std::string Push(int32_t id) = 0;
  virtual std::string Finish() = 0;
  virtual size_t pending_bytes() const = 0;
};

// A tokenizer backend. Immutable after creation; every method may be called
// from any thread at once. Ids passed in are already checked against
// vocab_size.
class TokenizerImpl {
 public:
  virtual ~TokenizerImpl() = default;
  [[nodiscard]] virtual absl::StatusOr<std::vector<int32_t>> Encode(
      std::string_view text, bool add_special) const = 0;
  [[nodiscard]] virtual absl::StatusOr<std::string> Decode(
      std::span<const int32_t> ids) const = 0;
  virtual std::string_view IdToPiece(int32_t id) const = 0;
  virtual std::string TokenBytes(int32_t id) const = 0;
  virtual bool IsControl(int32_t id) const = 0;
  virtual std::unique_ptr<StreamDecoder> NewStream(
      bool at_text_start) const = 0;

  int32_t vocab_size = 0;
  // The model's vocabulary when it pads the tokenizer's (Qwen3: 151,936
  // rows for 151,669 ids): ids in [vocab_size, model_vocab_size) are valid
  // and stand for no text. 0 until a model adopts the tokenizer.
  int32_t model_vocab_size = 0;
  int32_t bos_id = -1;
  int32_t eos_id = -1;
  int32_t unk_id = -1;
};

// How one id decodes, precomputed from SentencePiece so that streaming can
// reproduce SentencePieceProcessor::Decode piece by piece.
struct PieceEntry {
  enum class Kind : uint8_t { kText, kControl, kUnknown, kByte };
  Kind kind = Kind::kText;
  uint8_t byte = 0;                // kByte: the raw byte
  bool starts_with_space = false;  // kText: piece starts with U+2581
  std::string text;  // kText: piece with U+2581 -> ' '; kUnknown: its surface
};

class SentencePieceImpl : public TokenizerImpl {
 public:
  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text,
                                              bool add_bos) const override;
  absl::StatusOr<std::string> Decode(
      std::span<const int32_t> ids) const override;
  std::string_view IdToPiece(int32_t id) const override;
  std::string TokenBytes(int32_t id) const override;
  bool IsControl(int32_t id) const override;
  std::unique_ptr<StreamDecoder> NewStream(bool at_text_start) const override;

  SentencePieceModel sp;
  std::vector<PieceEntry> pieces;  // indexed by id
  // Whether Decode drops the leading U+2581 of the first word (models with
  // add_dummy_prefix or remove_extra_whitespaces); probed from the library.
  bool strips_dummy_prefix = true;
};

}  // namespace pdserve::tokenizer::internal
