// Which layers each pipeline stage holds: explicit splits ("2,2,1") and `auto`,
// which balances per-layer cost so the slowest stage is as fast as it can be.
// Stage 0 also pays for the embedding and the last stage for the final norm +
// lm_head, so with a heavy head the last stage gets fewer layers. Among splits
// with the same slowest stage, `auto` takes the most even one (least sum of
// squared stage costs), and on ties puts layers on earlier stages first.
//
// Pure functions except MeasureLayerCosts (which runs the engine); all are
// thread-safe.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/llama_engine.h"
#include "model/model_config.h"
#include "model/weight_source.h"

namespace pdserve::prefill {

// The cost of one microbatch, split by where it is paid. Units are arbitrary
// but shared (seconds when measured).
struct LayerCostProfile {
  std::vector<double> layer_cost;  // one entry per model layer
  double embedding_cost = 0;       // paid by stage 0
  double head_cost = 0;  // final norm + lm_head, paid by the last stage

  std::string DebugString() const;
};

// Layers per stage for `num_stages` stages over `num_layers` layers, from
// "a,b,c" (whitespace around entries allowed). INVALID_ARGUMENT naming the
// entry or the count that is wrong.
[[nodiscard]] absl::StatusOr<std::vector<int>> ParseLayerSplit(
    std::string_view text, int num_layers, int num_stages);

// The contiguous split (each stage ≥ 1 layer) minimizing the most expensive
// stage. INVALID_ARGUMENT if num_stages < 1 or exceeds the layer count, or a
// cost is negative or not finite.
[[nodiscard]] absl::StatusOr<std::vector<int>> AutoLayerSplit(
    const LayerCostProfile& costs, int num_stages);

// Cost of each stage of `split` under `costs` (for reports and tests).
std::vector<double> StageCosts(const LayerCostProfile& costs,
                               const std::vector<int>& split);

// A FLOP model of one microbatch of `microbatch_tokens` prompt tokens (a chunk
// attending over itself) with `logit_rows` rows of logits, in nominal
// seconds. For shapes whose weights are not at hand (dummy configs).
LayerCostProfile EstimateLayerCosts(const model::ModelConfig& config,
                                    int microbatch_tokens, int logit_rows);

// Times one single-layer engine shard per layer on a microbatch of
// `microbatch_tokens` tokens (best of `repeats`). The first and last shards
// also run the embedding / the head: their excess over the median middle layer
// is reported as embedding_cost / head_cost.
[[nodiscard]] absl::StatusOr<LayerCostProfile> MeasureLayerCosts(
    const model::WeightSource& weights, int microbatch_tokens, int logit_rows,
    int threads, int repeats = 3);

// "auto" -> AutoLayerSplit(costs), otherwise ParseLayerSplit.
[[nodiscard]] absl::StatusOr<std::vector<int>> ResolveLayerSplit(
    std::string_view text, int num_stages, const LayerCostProfile& costs);

// Engine shards (layer ranges) of a split.
std::vector<engine::ShardSpec> SplitToShards(const std::vector<int>& split);

}  // namespace pdserve::prefill
