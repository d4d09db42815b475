// The tensors a Llama model needs, with the exact shapes its config implies.
// Every loader validates against this list at open time, so the engine can
// rely on names and shapes without checking them again.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/model_config.h"

namespace pdserve::model {

struct ExpectedTensor {
  std::string name;            // canonical (HF) name
  std::vector<int64_t> shape;  // row-major, outermost first
};

// All canonical tensors of `config`, in load order (embedding, layers, final
// norm, lm_head). lm_head.weight is listed only when the embeddings are not
// tied.
std::vector<ExpectedTensor> LlamaTensorLayout(const ModelConfig& config);

// "[a, b]" for error messages.
std::string ShapeString(const std::vector<int64_t>& shape);

}  // namespace pdserve::model
