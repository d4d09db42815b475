// tokenizer.json `normalizer`: NFC/NFD/NFKC/NFKD (ICU), Replace, Prepend,
// Lowercase, Strip, Sequence. Applied to each piece of text between added
// tokens, before pre-tokenization.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "tokenizer/hf_json.h"

namespace pdserve::tokenizer::hf {

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  // `text` is valid UTF-8; so is the result.
  [[nodiscard]] virtual absl::StatusOr<std::string> Normalize(
      std::string text) const = 0;
};

// nullptr for a JSON null. INVALID_ARGUMENT naming the key path for an
// unknown type or a bad field.
[[nodiscard]] absl::StatusOr<std::unique_ptr<Normalizer>> ParseNormalizer(
    const Json& j, const JsonPath& at);

}  // namespace pdserve::tokenizer::hf
