#include "model/tensor_layout.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "model/weight_source.h"

namespace pdserve::model {

std::vector<ExpectedTensor> LlamaTensorLayout(const ModelConfig& config) {
  const int64_t hidden = config.hidden_size;
  const int64_t intermediate = config.intermediate_size;
  const int64_t q_dim =
      static_cast<int64_t>(config.num_heads) * config.head_dim;
  const int64_t kv_dim =
      static_cast<int64_t>(config.num_kv_heads) * config.head_dim;
  const int64_t vocab = config.vocab_size;

  std::vector<ExpectedTensor> layout;
  layout.reserve(3 + (9 + 3 * static_cast<size_t>(config.num_experts)) *
                         static_cast<size_t>(config.num_layers));
  layout.push_back({"model.embed_tokens.weight", {vocab, hidden}});
  for (int layer = 0; layer < config.num_layers; ++layer) {
    auto add = [&](std::string_view suffix, std::vector<int64_t> shape) {
      layout.push_back({LayerTensorName(layer, suffix), std::move(shape)});
    };
    add("input_layernorm.weight", {hidden});
    add("self_attn.q_proj.weight", {q_dim, hidden});
    add("self_attn.k_proj.weight", {kv_dim, hidden});
    add("self_attn.v_proj.weight", {kv_dim, hidden});
    if (config.qkv_bias) {
      add("self_attn.q_proj.bias", {q_dim});
      add("self_attn.k_proj.bias", {kv_dim});
      add("self_attn.v_proj.bias", {kv_dim});
    }
    if (config.qk_norm) {
      add("self_attn.q_norm.weight", {config.head_dim});
      add("self_attn.k_norm.weight", {config.head_dim});
    }
    add("self_attn.o_proj.weight", {hidden, q_dim});
    if (config.o_bias) add("self_attn.o_proj.bias", {hidden});
    add("post_attention_layernorm.weight", {hidden});
    if (!config.IsMoeLayer(layer)) {
      add("mlp.gate_proj.weight", {intermediate, hidden});
      add("mlp.up_proj.weight", {intermediate, hidden});
      add("mlp.down_proj.weight", {hidden, intermediate});
      continue;
    }
    const int64_t width = config.expert_intermediate_size;
    layout.push_back(
        {RouterTensorName(config, layer), {config.num_experts, hidden}});
    for (int e = 0; e < config.num_experts; ++e) {
      layout.push_back(
          {ExpertTensorName(config, layer, e, ExpertProjection::kGate),
           {width, hidden}});
      layout.push_back(
          {ExpertTensorName(config, layer, e, ExpertProjection::kUp),
           {width, hidden}});
      layout.push_back(
          {ExpertTensorName(config, layer, e, ExpertProjection::kDown),
           {hidden, width}});
    }
    if (const int64_t shared = config.shared_expert_intermediate_size;
        shared > 0) {
      add("mlp.shared_expert.gate_proj.weight", {shared, hidden});
      add("mlp.shared_expert.up_proj.weight", {shared, hidden});
      add("mlp.shared_expert.down_proj.weight", {hidden, shared});
      add("mlp.shared_expert_gate.weight", {1, hidden});
    }
  }
  layout.push_back({"model.norm.weight", {hidden}});
  if (!config.tie_word_embeddings) {
    layout.push_back({"lm_head.weight", {vocab, hidden}});
  }
  return layout;
}

bool IsArchitectureTensorName(std::string_view name) {
  // Per-layer attention and MLP parameters: what the family flags decide.
  // (Checkpoints also carry buffers such as rotary_emb.inv_freq, which no
  // config reads.)
  if (!name.starts_with("model.layers.")) return false;
  for (std::string_view part : {".self_attn.", ".mlp.", ".block_sparse_moe."}) {
    if (name.find(part) != std::string_view::npos) {
      return name.ends_with(".weight") || name.ends_with(".bias");
    }
  }
  return false;
}

std::string RouterTensorName(const ModelConfig& config, int layer) {
  return LayerTensorName(layer, config.architecture == "mixtral"
                                    ? "block_sparse_moe.gate.weight"
                                    : "mlp.gate.weight");
}

std::string ExpertTensorName(const ModelConfig& config, int layer, int expert,
                             ExpertProjection projection) {
  if (config.architecture == "mixtral") {
    // MixtralBlockSparseTop2MLP: w1 gate, w3 up, w2 down.
    const char* w = projection == ExpertProjection::kGate ? "w1"
                    : projection == ExpertProjection::kUp ? "w3"
                                                          : "w2";
    return LayerTensorName(layer, absl::StrCat("block_sparse_moe.experts.",
                                               expert, ".", w, ".weight"));
  }
  const char* proj = projection == ExpertProjection::kGate ? "gate_proj"
                     : projection == ExpertProjection::kUp ? "up_proj"
                                                           : "down_proj";
  return LayerTensorName(
      layer, absl::StrCat("mlp.experts.", expert, ".", proj, ".weight"));
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace pdserve::model
