#include "speculative/truncated_weights.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "model/config_override.h"

namespace pdserve::speculative {

absl::StatusOr<std::unique_ptr<model::WeightSource>> MakeLayerTruncatedWeights(
    const model::WeightSource& base, int num_layers) {
  if (num_layers < 1 || num_layers > base.config().num_layers)
    return absl::InvalidArgumentError(
        absl::StrCat("draft layer count ", num_layers, " outside [1, ",
                     base.config().num_layers, "]"));
  model::ModelConfig config = base.config();
  config.num_layers = num_layers;
  // Per-layer windows (Qwen) keep those of the layers kept, in the parser's
  // one form: none windowed is no window, all is the empty list.
  std::vector<bool>& windowed = config.windowed_layers;
  if (!windowed.empty()) {
    windowed.resize(num_layers);
    const int count =
        static_cast<int>(std::count(windowed.begin(), windowed.end(), true));
    if (count == 0) config.sliding_window = 0;
    if (count == 0 || count == num_layers) windowed.clear();
  }
  // Dense layers among sparse ones (Qwen MoE) likewise: none dense is the
  // empty list, none sparse is no experts.
  std::vector<bool>& dense = config.dense_layers;
  if (!dense.empty()) {
    dense.resize(num_layers);
    const int count =
        static_cast<int>(std::count(dense.begin(), dense.end(), true));
    if (count == num_layers) {
      config.num_experts = config.experts_per_token = 0;
      config.expert_intermediate_size = 0;
      config.shared_expert_intermediate_size = 0;
      config.normalize_expert_weights = false;
    }
    if (count == 0 || count == num_layers) dense.clear();
  }
  return std::make_unique<model::ConfigOverrideWeights>(
      base, std::move(config),
      absl::StrCat(base.description(), " (first ", num_layers, " layers)"));
}

}  // namespace pdserve::speculative
