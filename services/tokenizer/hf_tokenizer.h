// The Hugging Face tokenizer.json backend of Tokenizer: BPE with its
// normalizer, pre-tokenizer, added tokens, post-processor and decoder, with
// the semantics of the JavaScript reference @huggingface/tokenizers (the
// parity suite in tests/tokenizer compares ids and text byte for byte).
//
// Encode: invalid UTF-8 -> U+FFFD; split out added tokens whose content is
// matched verbatim (longest match, lstrip/rstrip trim their neighbours);
// normalize each remaining piece; split out added tokens matched after
// normalization; pre-tokenize (the piece's position among the added-token
// splits is the "section index"); BPE; post-processor when add_special.
//
// Decode: ids -> token strings, special added tokens skipped, the decoder
// chain. No clean_up_tokenization_spaces (it would break
// decode(encode(s)) == s and streaming; vLLM does the same).
//
// Immutable after creation; thread-safe (the BPE word cache locks).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "model/weight_source.h"
#include "tokenizer/hf_bpe.h"
#include "tokenizer/hf_decoder.h"
#include "tokenizer/hf_json.h"
#include "tokenizer/hf_normalizer.h"
#include "tokenizer/hf_pre_tokenizer.h"
#include "tokenizer/tokenizer_internal.h"

namespace pdserve::tokenizer::hf {

class HfTokenizer : public internal::TokenizerImpl {
 public:
  // tokenizer.json and (optional, "" for none) tokenizer_config.json.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<HfTokenizer>> FromFiles(
      const std::string& json_path, const std::string& config_path);

  // Parsed documents; `config` may be null. `file` names the origin in errors.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<HfTokenizer>> FromJson(
      const Json& tokenizer, const Json* config, const std::string& file);

  // A GGUF `gpt2` vocabulary (tokens, merges, token types, pre) as the
  // equivalent byte-level BPE tokenizer.json. INVALID_ARGUMENT for an
  // unknown tokenizer.ggml.pre, naming it.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<HfTokenizer>>
  FromGgufGpt2(const model::TokenizerSpec& spec);

  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text,
                                              bool add_special) const override;
  absl::StatusOr<std::string> Decode(
      std::span<const int32_t> ids) const override;
  std::string_view IdToPiece(int32_t id) const override;
  std::string TokenBytes(int32_t id) const override;
  bool IsControl(int32_t id) const override;
  std::unique_ptr<internal::StreamDecoder> NewStream(
      bool at_text_start) const override;

  // Decode of `ids` as a list of pieces through the decoder chain (no
  // skipping); shared by Decode and the fallback stream.
  [[nodiscard]] absl::StatusOr<std::string> DecodeAll(
      std::span<const int32_t> ids) const;
  const std::optional<StreamPlan>& stream_plan() const { return plan_; }

 private:
  struct AddedToken {
    std::string content;
    int32_t id = -1;
    bool lstrip = false, rstrip = false, single_word = false;
    bool normalized = false, special = false;
  };
  // Longest-match dictionary of added-token contents.
  struct Splitter {
    absl::flat_hash_map<std::string, int> index;  // content -> added_ index
    std::vector<std::vector<size_t>> lengths_by_first_byte;  // desc lengths
    bool empty() const { return index.empty(); }
  };
  struct Section {
    std::string_view text;
    int added = -1;  // index into added_, or -1
  };

  HfTokenizer() = default;
  absl::Status Load(const Json& tokenizer, const Json* config,
                    const std::string& file);
  void Split(const Splitter& splitter, std::string_view text,
             std::vector<Section>* out) const;
  absl::Status Strip(std::vector<Section>* sections) const;
  absl::Status EncodeText(std::string_view text,
                          std::vector<int32_t>* out) const;

  std::vector<std::string> pieces_;  // id -> token string ("" for holes)
  std::vector<bool> is_added_;
  std::vector<bool> is_control_;
  TokenMap tokens_;
  std::vector<AddedToken> added_;
  absl::flat_hash_map<std::string, int> added_by_content_;  // incl. normalized
  absl::flat_hash_set<std::string> added_contents_;
  Splitter raw_splitter_, normalized_splitter_;
  std::unique_ptr<Normalizer> normalizer_;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;
  std::unique_ptr<BpeModel> model_;
  std::unique_ptr<Decoder> decoder_;
  std::optional<StreamPlan> plan_;
  std::string unk_token_;
  // Post-processor for one sequence: ids before and after the text.
  std::vector<int32_t> prefix_ids_, suffix_ids_;
  std::optional<Regex> leading_ws_, trailing_ws_;  // lstrip / rstrip
};

}  // namespace pdserve::tokenizer::hf
