// Streaming detokenization: feed generated ids one at a time and get the text
// to send now.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "tokenizer/tokenizer.h"

namespace pdserve::tokenizer {

// The deltas returned by Push() followed by Finish() concatenate to exactly
// Tokenizer::Decode() of all pushed ids (for a detokenizer started with
// `at_text_start`, the default), and every delta is valid UTF-8: bytes of a
// multi-byte character spread over byte-fallback pieces (SentencePiece,
// tokenizer.json ByteFallback) or byte-level tokens (tokenizer.json
// ByteLevel: a token may end inside a character) are held back until the
// character is complete. A run of bytes that cannot become valid UTF-8 is
// emitted as U+FFFD per bad byte (SentencePiece) or per maximal bad
// subsequence (tokenizer.json, as the reference's TextDecoder does).
//
// `at_text_start` = true decodes the ids as a text of their own, so the first
// word loses its dummy-prefix space ("▁They" -> "They"); this is how the golden
// `text` of a continuation is produced. Pass false when the ids continue text
// already shown (e.g. appended to the prompt), to keep that space.
//
// Not thread-safe (one per stream); the Tokenizer must outlive it.
class IncrementalDetokenizer {
 public:
  explicit IncrementalDetokenizer(const Tokenizer& tokenizer,
                                  bool at_text_start = true);
  ~IncrementalDetokenizer();

  // Returns the text that `id` completes (often empty for control tokens or a
  // partial character). OUT_OF_RANGE for a bad id, leaving the state as is.
  [[nodiscard]] absl::StatusOr<std::string> Push(int32_t id);

  // Convenience: Push() each id, concatenating the deltas.
  [[nodiscard]] absl::StatusOr<std::string> PushAll(
      std::span<const int32_t> ids);

  // End of stream: flushes held-back bytes of an incomplete character as
  // U+FFFD each. The detokenizer may be reused afterwards; it continues the
  // same text (no new dummy-prefix stripping).
  std::string Finish();

  // Bytes held back waiting for the rest of a UTF-8 character.
  size_t pending_bytes() const;

 private:
  const Tokenizer& tokenizer_;
  std::unique_ptr<internal::StreamDecoder> stream_;  // the backend's state
};

// Valid UTF-8 per SentencePiece's (and the Unicode standard's) strict rules:
// no overlong forms, surrogates or code points above U+10FFFF.
bool IsValidUtf8(std::string_view s);

}  // namespace pdserve::tokenizer
