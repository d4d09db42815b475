// Text <-> token ids for a model, with two backends:
// - SentencePiece: a Hugging Face folder's tokenizer.model is loaded as is, and
//   a GGUF `llama` vocabulary (tokenizer.ggml.*) is turned into the equivalent
//   ModelProto first (see proto_builder.h), so both give identical ids.
// - Hugging Face tokenizer.json (hf_tokenizer.h): BPE with its normalizers,
//   pre-tokenizers, added tokens, post-processor and decoders, byte-identical
//   to @huggingface/tokenizers; a GGUF `gpt2` vocabulary is mapped onto it.
//
// Thread-safety: a Tokenizer is immutable after Create(); all const methods
// may be called concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/weight_source.h"

namespace pdserve::tokenizer {

namespace internal {
class TokenizerImpl;
class StreamDecoder;
}  // namespace internal

class Tokenizer {
 public:
  // Loads the tokenizer described by `spec`: exactly one of
  // `hf_tokenizer_json_path` (with optional `hf_tokenizer_config_path`),
  // `sentencepiece_model_path` or a GGUF vocabulary (`tokens`...) must be
  // set. A malformed tokenizer.json is INVALID_ARGUMENT naming the file, the
  // JSON key path and what is wrong.
  // Errors: NOT_FOUND / INVALID_ARGUMENT naming the file or metadata field;
  // never crashes on a corrupt, truncated or empty tokenizer.model.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Tokenizer>> Create(
      const model::TokenizerSpec& spec);

  // Like Create() for a serialized SentencePiece ModelProto held in memory.
  // `description` names its origin in errors.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Tokenizer>>
  CreateFromSerializedProto(std::string_view serialized,
                            std::string_view description);

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // SentencePiece encoding of `text`, preceded by BOS when `add_bos` (and the
  // vocabulary has one). Errors: INVALID_ARGUMENT from SentencePiece.
  // tokenizer.json: `add_bos` means the post-processor's special tokens
  // (Hugging Face's add_special_tokens); added tokens written in `text`
  // (e.g. "<|im_start|>") become their ids; invalid UTF-8 in `text` is
  // replaced by U+FFFD first, as a JavaScript string would hold it.
  [[nodiscard]] absl::StatusOr<std::vector<int32_t>> Encode(
      std::string_view text, bool add_bos = true) const;

  // SentencePiece decoding of `ids`: control tokens (BOS/EOS) are invisible,
  // the leading space of the first word is dropped (the dummy prefix), runs
  // of byte pieces are assembled into UTF-8 with U+FFFD for each invalid
  // byte. A greedy continuation decoded on its own is exactly the golden
  // `text`. Errors: OUT_OF_RANGE for an id outside [0, vocab_size()).
  // tokenizer.json: the reference's decode with skip_special_tokens and
  // without clean_up_tokenization_spaces (so decode(encode(s)) == s).
  [[nodiscard]] absl::StatusOr<std::string> Decode(
      std::span<const int32_t> ids) const;

  int32_t vocab_size() const;
  int32_t bos_id() const;  // -1 when the vocabulary has none
  int32_t eos_id() const;  // -1 when the vocabulary has none
  int32_t unk_id() const;
  bool IsEos(int32_t id) const { return id >= 0 && id == eos_id(); }
  // A control token (BOS, EOS, ...): invisible in decoded text. False for an
  // id outside the vocabulary.
  bool IsControl(int32_t id) const;

  // The raw piece, e.g. "▁the" or "<0x0A>". OUT_OF_RANGE for a bad id. The
  // view lives as long as the Tokenizer.
  [[nodiscard]] absl::StatusOr<std::string_view> IdToPiece(int32_t id) const;

  // The bytes `id` stands for in running text, as logprob listings show a
  // token: a word piece with its leading space ("▁the" -> " the"), a byte
  // piece's raw byte (possibly part of a UTF-8 character: callers that need
  // valid UTF-8 must escape or replace), the surface of <unk>, and a control
  // token's piece as written ("</s>"), so that it is not invisible. No
  // dummy-prefix stripping: that depends on the position, not the token.
  // OUT_OF_RANGE for a bad id.
  [[nodiscard]] absl::StatusOr<std::string> TokenBytes(int32_t id) const;

  // FAILED_PRECONDITION naming both sizes unless the model's embedding/lm_head
  // vocabulary is ours or ours plus at most kMaxVocabPadding padding rows (a
  // smaller one would be fed ids it has no embedding for; a much larger one
  // belongs to another tokenizer). LoadTokenizerForModel then accepts the
  // padding ids: they decode to no text (IsPadding).
  static constexpr int kMaxVocabPadding = 1024;
  [[nodiscard]] absl::Status CheckCompatibleWith(int model_vocab_size) const;
  // An id of the model's padding rows (only after LoadTokenizerForModel).
  bool IsPadding(int32_t id) const;

 private:
  friend class IncrementalDetokenizer;
  friend absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizerForModel(
      const model::WeightSource& source);
  // OUT_OF_RANGE unless 0 <= id < vocab_size().
  absl::Status CheckId(int32_t id) const;
  explicit Tokenizer(std::unique_ptr<internal::TokenizerImpl> impl);

  std::unique_ptr<internal::TokenizerImpl> impl_;
};

// Loads `source.tokenizer_spec()` and checks it against the model's vocab_size.
[[nodiscard]] absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizerForModel(
    const model::WeightSource& source);

}  // namespace pdserve::tokenizer
