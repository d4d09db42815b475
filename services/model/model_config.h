// The architecture hyper-parameters of a Llama-family model, as read from a
// Hugging Face config.json or GGUF metadata.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace pdserve::model {

enum class DType { kF32, kF16, kBF16 };
std::string_view DTypeName(DType dtype);
size_t DTypeSize(DType dtype);

struct ModelConfig {
 private:
  static bool IsEosListed(const std::vector<int32_t>& ids, int id) {
    for (int32_t x : ids) {
      if (x == id) return true;
    }
    return false;
  }

 public:
  std::string architecture = "llama";  // only "llama" is supported
  int hidden_size = 0;
  int intermediate_size = 0;
  int num_layers = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int vocab_size = 0;
  int max_position_embeddings = 0;
  float rms_norm_eps = 1e-5f;
  float rope_theta = 10000.0f;
  bool tie_word_embeddings = false;
  int bos_token_id = 1;
  int eos_token_id = 2;
  // Every token that ends a sequence: eos_token_id first, then the others a
  // chat model lists (Llama 3: <|end_of_text|>, <|eom_id|>, <|eot_id|>) in
  // config.json or generation_config.json. Empty: only eos_token_id.
  std::vector<int> eos_token_ids;
  bool IsEos(int token) const {
    if (token == eos_token_id) return true;
    for (int id : eos_token_ids) {
      if (id == token) return true;
    }
    return false;
  }
  // eos_token_id and eos_token_ids, without repeats (what min_tokens holds
  // back).
  std::vector<int32_t> EndTokenIds() const {
    std::vector<int32_t> ids = {eos_token_id};
    for (int id : eos_token_ids) {
      if (!IsEosListed(ids, id)) ids.push_back(id);
    }
    return ids;
  }
  DType dtype = DType::kF32;  // storage dtype declared by the model

  // Checks internal consistency (positive sizes, num_heads % num_kv_heads == 0,
  // head_dim even, ...). Errors name the offending key.
  [[nodiscard]] absl::Status Validate() const;

  // A stable string naming everything that must agree between two processes
  // that exchange hidden states or KV (used by compatibility handshakes).
  std::string Identity() const;

  int q_dim() const { return num_heads * head_dim; }
  int kv_dim() const { return num_kv_heads * head_dim; }
};

// Parses a Hugging Face config.json. `source_name` (usually the path) is
// included in every error. Missing required keys are INVALID_ARGUMENT naming
// the key; head_dim defaults to hidden_size / num_attention_heads and
// num_key_value_heads to num_attention_heads, as transformers does.
// Adds the end-of-sequence ids of a generation_config.json (`eos_token_id`,
// a number or a list: what transformers' generate() stops on) to `config`.
// INVALID_ARGUMENT naming the file for a malformed file or an id outside the
// vocabulary.
[[nodiscard]] absl::Status MergeGenerationConfigJson(
    std::string_view json_text, std::string_view source_name,
    ModelConfig* config);

[[nodiscard]] absl::StatusOr<ModelConfig> ParseHfConfigJson(
    std::string_view json_text, std::string_view source_name);

}  // namespace pdserve::model
