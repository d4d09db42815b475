// The tensors a Llama model needs, with the exact shapes its config implies.
// Every loader validates against this list at open time, so the engine can
// rely on names and shapes without checking them again.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "model/model_config.h"

namespace pdserve::model {

struct ExpectedTensor {
  std::string name;            // canonical (HF) name
  std::vector<int64_t> shape;  // row-major, outermost first
};

// All canonical tensors of `config`, in load order (embedding, layers, final
// norm, lm_head). lm_head.weight is listed only when the embeddings are not
// tied; per layer, q/k/v biases with qkv_bias, q_norm/k_norm [head_dim]
// with qk_norm, the o_proj bias with o_bias; a sparse layer (IsMoeLayer)
// has the router [num_experts, hidden] and each expert's gate/up
// [expert_intermediate_size, hidden] and down [hidden, width] in place of
// the dense MLP, plus (shared_expert_intermediate_size > 0)
// mlp.shared_expert.{gate,up,down}_proj and mlp.shared_expert_gate [1,
// hidden].
std::vector<ExpectedTensor> LlamaTensorLayout(const ModelConfig& config);

// Whether `name` is a per-layer attention or MLP parameter (a projection's
// weight or bias, a q/k norm). A file holding one that LlamaTensorLayout
// does not list is refused: a bias the config does not announce would be
// silently dropped.
bool IsArchitectureTensorName(std::string_view name);

enum class ExpertProjection { kGate, kUp, kDown };

// Sparse layer `layer`'s router and routed-expert tensors as the family's
// checkpoints name them: Qwen mlp.gate.weight and
// mlp.experts.<e>.{gate,up,down}_proj.weight; Mixtral
// block_sparse_moe.gate.weight and block_sparse_moe.experts.<e>.{w1,w3,w2}.
std::string RouterTensorName(const ModelConfig& config, int layer);
std::string ExpertTensorName(const ModelConfig& config, int layer, int expert,
                             ExpertProjection projection);

// "[a, b]" for error messages.
std::string ShapeString(const std::vector<int64_t>& shape);

}  // namespace pdserve::model
