// A WeightSource that shows only the first `num_layers` layers of another
// (same embedding, final norm and lm_head): the cheapest draft model that
// shares the target's tokenizer, used by tests and benchmarks.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "model/weight_source.h"

namespace pdserve::speculative {

// `base` must outlive the result. INVALID_ARGUMENT unless
// 1 <= num_layers <= base.config().num_layers.
[[nodiscard]] absl::StatusOr<std::unique_ptr<model::WeightSource>>
MakeLayerTruncatedWeights(const model::WeightSource& base, int num_layers);

}  // namespace pdserve::speculative
