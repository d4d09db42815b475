// The architecture hyper-parameters of a Llama-family model, as read from a
// Hugging Face config.json or GGUF metadata. Every supported family (Llama
// 2/3.x, Mistral, Qwen2/2.5, Qwen3, and the mixtures of experts Qwen3-MoE,
// Qwen2-MoE and Mixtral) is one engine description: the Llama graph plus the
// flags below (projection biases, per-head q/k RMSNorm, RoPE scaling, a
// sliding attention window, routed experts in place of the dense MLP); the
// engine has one code path.
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

// How RoPE frequencies are stretched for long contexts (HF `rope_scaling`,
// transformers' rope init functions). kFreqFactors: each frequency divided
// by a stored factor (GGUF rope_freqs.weight, how llama.cpp stores llama3).
enum class RopeScalingType {
  kNone,
  kLinear,
  kDynamic,
  kLlama3,
  kYarn,
  kFreqFactors
};
std::string_view RopeScalingName(RopeScalingType type);

struct RopeScaling {
  RopeScalingType type = RopeScalingType::kNone;
  double factor = 1.0;
  // The context the model was trained at: llama3's old context, yarn's
  // correction range, and where dynamic NTK starts growing the base.
  int original_max_position = 0;
  double low_freq_factor = 1.0;   // llama3
  double high_freq_factor = 4.0;  // llama3
  double beta_fast = 32.0;        // yarn
  double beta_slow = 1.0;         // yarn
  bool truncate = true;           // yarn: integer correction range
  // yarn: cos and sin are multiplied by it (so attention logits by its
  // square), resolved from attention_factor or mscale/mscale_all_dim.
  double attention_factor = 1.0;
  std::vector<float> freq_factors;  // kFreqFactors: head_dim / 2 divisors
};

struct ModelConfig {
 private:
  static bool IsEosListed(const std::vector<int32_t>& ids, int id) {
    for (int32_t x : ids) {
      if (x == id) return true;
    }
    return false;
  }

 public:
  // The HF model_type: "llama", "mistral", "qwen2", "qwen3", "qwen3_moe",
  // "qwen2_moe" or "mixtral". The engine reads the flags below, never the
  // name; only the tensor names depend on it (Mixtral's block_sparse_moe).
  std::string architecture = "llama";
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

  // q_proj/k_proj/v_proj carry a bias (Qwen2; Llama/Qwen3 attention_bias).
  bool qkv_bias = false;
  // o_proj carries a bias (Llama/Qwen3 attention_bias).
  bool o_bias = false;
  // Per-head RMSNorm of q and k (weights self_attn.{q,k}_norm.weight of
  // head_dim) after the projections, before RoPE (Qwen3).
  bool qk_norm = false;
  // Each query attends to at most this many keys, itself included (keys at
  // positions > position - window), in the layers that window; 0 means the
  // whole context in every layer.
  int sliding_window = 0;
  // Which layers window when sliding_window > 0, one flag per layer (Qwen2/
  // Qwen3 with use_sliding_window: the layers from max_window_layers on, or
  // those layer_types calls "sliding_attention"). Empty: every layer
  // (Mistral).
  std::vector<bool> windowed_layers;
  // The window of model layer `layer` (0: none).
  int LayerWindow(int layer) const {
    if (sliding_window <= 0) return 0;
    if (windowed_layers.empty()) return sliding_window;
    return layer >= 0 && layer < static_cast<int>(windowed_layers.size()) &&
                   windowed_layers[layer]
               ? sliding_window
               : 0;
  }
  // True when every layer windows (then keys older than the window are never
  // read again by any layer).
  bool EveryLayerWindowed() const {
    if (sliding_window <= 0) return false;
    for (bool windowed : windowed_layers) {
      if (!windowed) return false;
    }
    return true;
  }
  RopeScaling rope_scaling;

  // Mixture of experts. num_experts == 0: every layer's MLP is the dense
  // SwiGLU of intermediate_size. Otherwise a sparse layer routes each token
  // to its experts_per_token best of num_experts SwiGLU experts of
  // expert_intermediate_size: softmax over the router logits, the top k
  // (ties: the lower expert index first, as torch.topk on CPU), their
  // probabilities as weights.
  int num_experts = 0;
  int experts_per_token = 0;
  int expert_intermediate_size = 0;
  // The top-k weights renormalised to sum to 1 (Qwen norm_topk_prob;
  // Mixtral always); otherwise the probabilities as they are.
  bool normalize_expert_weights = false;
  // Qwen2-MoE: an always-on shared expert of this width beside the routed
  // ones, its output scaled by sigmoid(shared_expert_gate . x); 0: none.
  int shared_expert_intermediate_size = 0;
  // Layers whose MLP stays dense with experts present (Qwen mlp_only_layers
  // and decoder_sparse_step), one flag per layer; empty: none.
  std::vector<bool> dense_layers;
  // Whether model layer `layer` routes to experts.
  bool IsMoeLayer(int layer) const {
    if (num_experts <= 0) return false;
    return dense_layers.empty() ||
           !(layer >= 0 && layer < static_cast<int>(dense_layers.size()) &&
             dense_layers[layer]);
  }
  bool HasExperts() const { return num_experts > 0; }

  // Checks internal consistency (positive sizes, num_heads % num_kv_heads == 0,
  // head_dim even, a known architecture, sane rope_scaling, ...). Errors name
  // the offending key.
  [[nodiscard]] absl::Status Validate() const;

  // A stable string naming everything that must agree between two processes
  // that exchange hidden states or KV (used by compatibility handshakes).
  std::string Identity() const;

  int q_dim() const { return num_heads * head_dim; }
  int kv_dim() const { return num_kv_heads * head_dim; }
};

// Adds the end-of-sequence ids of a generation_config.json (`eos_token_id`,
// a number or a list: what transformers' generate() stops on) to `config`.
// INVALID_ARGUMENT naming the file for a malformed file or an id outside the
// vocabulary.
[[nodiscard]] absl::Status MergeGenerationConfigJson(
    std::string_view json_text, std::string_view source_name,
    ModelConfig* config);

// Parses a Hugging Face config.json of model_type llama, mistral, qwen2,
// qwen3, qwen3_moe, qwen2_moe or mixtral (the MoE keys as each family's
// transformers config class reads them, with its defaults: num_experts /
// num_local_experts, num_experts_per_tok, moe_intermediate_size (Mixtral:
// intermediate_size), norm_topk_prob, decoder_sparse_step, mlp_only_layers,
// shared_expert_intermediate_size). `source_name` (usually the path) is
// included in every error. Missing required keys, an unknown model_type and any
// key whose value the engine does not implement (hidden_act other than silu,
// mlp_bias, an unknown rope_scaling type or field, ...) are INVALID_ARGUMENT
// naming the key. Defaults follow each family's transformers config class:
// head_dim = hidden_size / num_attention_heads (Qwen3: 128),
// num_key_value_heads = num_attention_heads, Mistral's sliding_window 4096 when
// the key is absent; Qwen2/Qwen3 window only with use_sliding_window, in the
// layers from max_window_layers on (or those layer_types marks
// "sliding_attention"), as transformers' Qwen2Config derives them. With linear,
// dynamic or yarn rope scaling, max_position_embeddings becomes the scaled
// context (factor x the original), which is what such a model serves.
[[nodiscard]] absl::StatusOr<ModelConfig> ParseHfConfigJson(
    std::string_view json_text, std::string_view source_name);

}  // namespace pdserve::model
