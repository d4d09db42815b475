// tokenizer.json `decoder`: ByteLevel, Metaspace, ByteFallback, Fuse, Strip,
// Replace, Sequence, with the JavaScript reference's semantics on a list of
// token strings, plus the per-token plan that lets a stream decode one id at
// a time with the same result (StreamPlan).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "tokenizer/hf_json.h"

namespace pdserve::tokenizer::hf {

class Decoder {
 public:
  virtual ~Decoder() = default;
  // Rewrites the token strings in place (the reference's decode_chain).
  [[nodiscard]] virtual absl::Status DecodeChain(
      std::vector<std::string>* tokens) const = 0;
};

// The streaming form of a decoder chain: what each token contributes on its
// own, and the few effects that depend on the position in the text.
struct StreamPlan {
  enum class Kind : uint8_t {
    kText,  // `text` is emitted as is; it ends a run of raw bytes
    kRaw,   // `text` holds raw bytes joining the current run, decoded as
            // UTF-8 with replacement when the run ends
  };
  struct Token {
    Kind kind = Kind::kText;
    std::string text;
  };
  std::vector<Token> tokens;    // indexed by id
  bool run_strips_bom = false;  // ByteFallback: TextDecoder drops a BOM
  char strip_char = ' ';
  int strip_leading = 0;  // leading strip_char dropped from the whole text
  bool strip_first_token = false;  // Metaspace: the first token's space
};

// nullptr for a JSON null. `added` holds the contents of all added tokens
// (the ByteLevel decoder passes them through verbatim).
[[nodiscard]] absl::StatusOr<std::unique_ptr<Decoder>> ParseDecoder(
    const Json& j, const JsonPath& at,
    const absl::flat_hash_set<std::string>* added);

// The stream plan of decoder config `j` for tokens `pieces` (id -> string;
// `is_added[id]` for added tokens), or nullopt when the chain has a step
// whose effect spans tokens in a way the plan cannot express (then streams
// re-decode, see HfTokenizer).
[[nodiscard]] absl::StatusOr<std::optional<StreamPlan>> BuildStreamPlan(
    const Json& j, const std::vector<std::string>& pieces,
    const std::vector<bool>& is_added);

// The ByteFallback decoder's reading of "<0xXX>" (-1 when not a byte token).
int ByteFallbackValue(const std::string& token);

}  // namespace pdserve::tokenizer::hf
