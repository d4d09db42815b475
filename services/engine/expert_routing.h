// Top-k routing of a mixture-of-experts layer, shared by the backends and
// unit-tested on its own (the tie rule is part of the model's meaning).
#pragma once

#include <cstdint>

namespace pdserve::engine {

// One token's routing: the softmax of its router logits (in double), the k
// most probable experts, ties to the lower index (what torch.topk returns
// on the CPU, so transformers' choice), their probabilities as weights,
// renormalised to sum to 1 when `normalize` (Qwen norm_topk_prob, Mixtral).
// `experts` and `weights` get k entries, most probable first.
void RouteToken(const float* logits, int num_experts, int k, bool normalize,
                int32_t* experts, float* weights);

}  // namespace pdserve::engine
