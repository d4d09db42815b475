// tokenizer.json `pre_tokenizer`: Split (PCRE2 regex or literal, every
// behavior, invert), ByteLevel (GPT-2 byte-to-unicode map, optional GPT-2
// regex and prefix space), Digits, Metaspace, Whitespace, WhitespaceSplit,
// Sequence.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tokenizer/hf_json.h"

namespace pdserve::tokenizer::hf {

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Replaces `pieces` by their pre-tokenization (each piece split further or
  // rewritten; empty results dropped as the reference does).
  // `section_index` is the position of this text among the pieces between
  // added tokens (Metaspace's prepend_scheme "first" looks at it).
  [[nodiscard]] virtual absl::Status PreTokenize(
      std::vector<std::string>* pieces, int section_index) const = 0;
};

// nullptr for a JSON null; INVALID_ARGUMENT naming the key path otherwise.
[[nodiscard]] absl::StatusOr<std::unique_ptr<PreTokenizer>> ParsePreTokenizer(
    const Json& j, const JsonPath& at);

// A ByteLevel pre-tokenizer built in code (GGUF gpt2 vocabularies): splits
// with `regex` (PCRE2 syntax) when non-empty, then maps bytes to the GPT-2
// alphabet.
[[nodiscard]] absl::StatusOr<std::unique_ptr<PreTokenizer>>
MakeByteLevelPreTokenizer(const std::string& split_regex);

// The GPT-2 byte <-> unicode table: printable Latin-1 bytes map to
// themselves, the others to U+0100 + n in byte order.
const std::string& ByteToUnicode(unsigned char b);  // UTF-8 of its char
// -1 when `cp` is not in the table.
int UnicodeToByte(uint32_t cp);

}  // namespace pdserve::tokenizer::hf
