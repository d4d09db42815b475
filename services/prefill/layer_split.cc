#include "prefill/layer_split.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "kv/kv_pool.h"

namespace pdserve::prefill {
namespace {

// Cost of stage layers [begin, end) of a model with `costs`.
double RangeCost(const LayerCostProfile& costs,
                 const std::vector<double>& prefix, int begin, int end) {
  const int layers = static_cast<int>(costs.layer_cost.size());
  double cost = prefix[end] - prefix[begin];
  if (begin == 0) cost += costs.embedding_cost;
  if (end == layers) cost += costs.head_cost;
  return cost;
}

}  // namespace

std::string LayerCostProfile::DebugString() const {
  return absl::StrCat("embedding ", embedding_cost, ", layers [",
                      absl::StrJoin(layer_cost, ", "), "], head ", head_cost);
}

absl::StatusOr<std::vector<int>> ParseLayerSplit(std::string_view text,
                                                 int num_layers,
                                                 int num_stages) {
  const absl::string_view input(text.data(), text.size());
  if (absl::StripAsciiWhitespace(input).empty()) {
    return absl::InvalidArgumentError(
        "layer split is empty (expected \"auto\" or layers per stage, e.g. "
        "\"2,2,1\")");
  }
  std::vector<int> split;
  int index = 0;
  for (absl::string_view entry : absl::StrSplit(input, ',')) {
    ++index;
    entry = absl::StripAsciiWhitespace(entry);
    int layers = 0;
    if (entry.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer split \"", input, "\": entry ", index, " is empty"));
    }
    if (!absl::SimpleAtoi(entry, &layers)) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer split \"", input, "\": entry ", index, " (\"",
                       entry, "\") is not an integer"));
    }
    if (layers < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer split \"", input, "\": entry ", index, " is ",
                       layers, " but every stage needs at least one layer"));
    }
    split.push_back(layers);
  }
  if (static_cast<int>(split.size()) != num_stages) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer split \"", input, "\" has ", split.size(),
                     " entries but there are ", num_stages, " stages"));
  }
  int64_t total = 0;
  for (int layers : split) total += layers;
  if (total != num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer split \"", input, "\" covers ", total,
                     " layers but the model has ", num_layers));
  }
  return split;
}

std::vector<double> StageCosts(const LayerCostProfile& costs,
                               const std::vector<int>& split) {
  const int layers = static_cast<int>(costs.layer_cost.size());
  std::vector<double> prefix(layers + 1, 0.0);
  for (int l = 0; l < layers; ++l)
    prefix[l + 1] = prefix[l] + costs.layer_cost[l];
  std::vector<double> out;
  int begin = 0;
  for (int n : split) {
    const int end = std::min(begin + n, layers);
    out.push_back(RangeCost(costs, prefix, begin, end));
    begin = end;
  }
  return out;
}

absl::StatusOr<std::vector<int>> AutoLayerSplit(const LayerCostProfile& costs,
                                                int num_stages) {
  const int layers = static_cast<int>(costs.layer_cost.size());
  if (num_stages < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("number of stages must be >= 1, got ", num_stages));
  }
  if (num_stages > layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot split ", layers, " layers over ", num_stages,
                     " stages: every stage needs at least one layer"));
  }
  auto bad = [](double c) { return !std::isfinite(c) || c < 0; };
  if (bad(costs.embedding_cost) || bad(costs.head_cost) ||
      std::any_of(costs.layer_cost.begin(), costs.layer_cost.end(), bad)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer costs must be finite and >= 0: ", costs.DebugString()));
  }
  std::vector<double> prefix(layers + 1, 0.0);
  for (int l = 0; l < layers; ++l)
    prefix[l + 1] = prefix[l] + costs.layer_cost[l];
  constexpr double kInf = std::numeric_limits<double>::infinity();
  // suffix[r][j]: the smallest bottleneck splitting layers [j, L) over r
  // stages, each holding at least one layer.
  std::vector<std::vector<double>> suffix(
      num_stages + 1, std::vector<double>(layers + 1, kInf));
  suffix[0][layers] = 0;
  for (int r = 1; r <= num_stages; ++r) {
    for (int j = layers - r; j >= 0; --j) {
      double best = kInf;
      for (int e = j + 1; e <= layers - (r - 1); ++e) {
        best = std::min(
            best, std::max(RangeCost(costs, prefix, j, e), suffix[r - 1][e]));
      }
      suffix[r][j] = best;
    }
  }
  const double bottleneck = suffix[num_stages][0];
  const double limit = bottleneck * (1 + 1e-9) + 1e-300;
  // Many splits share the optimal bottleneck (uniform layers); among them take
  // the most even one (least sum of squared stage costs), so no stage is left
  // with a sliver. squares[r][j]: that minimum for layers [j, L) over r
  // stages, every stage under the bottleneck.
  std::vector<std::vector<double>> squares(
      num_stages + 1, std::vector<double>(layers + 1, kInf));
  squares[0][layers] = 0;
  for (int r = 1; r <= num_stages; ++r) {
    for (int j = layers - r; j >= 0; --j) {
      for (int e = j + 1; e <= layers - (r - 1); ++e) {
        const double cost = RangeCost(costs, prefix, j, e);
        if (cost > limit || squares[r - 1][e] == kInf) continue;
        squares[r][j] =
            std::min(squares[r][j], cost * cost + squares[r - 1][e]);
      }
    }
  }
  // Walk from the front; on (near) ties the earlier stage takes more layers,
  // so the last stage, which also runs the head, stays lightest.
  std::vector<int> split;
  int begin = 0;
  for (int s = 0; s < num_stages; ++s) {
    const int remaining = num_stages - s - 1;
    const double target = squares[remaining + 1][begin];
    int chosen = -1;
    for (int e = layers - remaining; e > begin; --e) {
      const double cost = RangeCost(costs, prefix, begin, e);
      if (cost > limit || squares[remaining][e] == kInf) continue;
      if (cost * cost + squares[remaining][e] <= target * (1 + 1e-9) + 1e-300) {
        chosen = e;
        break;
      }
    }
    if (chosen < 0) {
      return absl::InternalError("auto layer split found no feasible stage");
    }
    split.push_back(chosen - begin);
    begin = chosen;
  }
  return split;
}

LayerCostProfile EstimateLayerCosts(const model::ModelConfig& config,
                                    int microbatch_tokens, int logit_rows) {
  const double t = std::max(microbatch_tokens, 1);
  const double h = config.hidden_size;
  constexpr double kFlopsPerSecond = 1e11;  // nominal; only ratios matter
  // Projections (q, k, v, o), MLP (gate, up, down), causal attention over the
  // chunk (QKᵀ and PV, half the square), norms and element-wise work.
  const double projections =
      2 * t * h * (2.0 * config.q_dim() + 2.0 * config.kv_dim());
  const double dense_mlp = 2 * t * 3 * h * config.intermediate_size;
  // A sparse layer: the router, each token's k experts (the tokens spread
  // over the experts, so the FLOPs are those of k experts per token) and
  // the shared expert; a Qwen-MoE layer costs far less than its dense
  // neighbour of intermediate_size, which is what the split must balance.
  const double sparse_mlp =
      2 * t * h *
      (config.num_experts + 3.0 * (double{config.experts_per_token} *
                                       config.expert_intermediate_size +
                                   config.shared_expert_intermediate_size));
  const double attention = 2 * t * t * config.q_dim();
  const double elementwise = 10 * t * h;
  LayerCostProfile costs;
  for (int layer = 0; layer < config.num_layers; ++layer) {
    const double mlp = config.IsMoeLayer(layer) ? sparse_mlp : dense_mlp;
    costs.layer_cost.push_back((projections + mlp + attention + elementwise) /
                               kFlopsPerSecond);
  }
  costs.embedding_cost = t * h / kFlopsPerSecond;  // a gather
  costs.head_cost =
      (2.0 * logit_rows * h * config.vocab_size + 4 * t * h) / kFlopsPerSecond;
  return costs;
}

absl::StatusOr<LayerCostProfile> MeasureLayerCosts(
    const model::WeightSource& weights, int microbatch_tokens, int logit_rows,
    int threads, int repeats) {
  const model::ModelConfig& config = weights.config();
  const int layers = config.num_layers;
  const int tokens = std::clamp(microbatch_tokens, 1,
                                std::max(1, config.max_position_embeddings));
  const int rows = std::clamp(logit_rows, 0, tokens);
  constexpr int kBlockSize = 16;
  const int blocks = (tokens + kBlockSize - 1) / kBlockSize;
  std::vector<int32_t> table(blocks);
  for (int b = 0; b < blocks; ++b) table[b] = b;
  std::vector<int32_t> ids(tokens);
  std::mt19937 rng(7);
  for (int32_t& id : ids) id = static_cast<int32_t>(rng() % config.vocab_size);
  std::vector<float> hidden(int64_t{tokens} * config.hidden_size);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& v : hidden) v = normal(rng);

  std::vector<double> measured(layers);
  for (int l = 0; l < layers; ++l) {
    engine::EngineOptions options;
    options.shard = engine::ShardSpec{l, l + 1, 0, 1};
    options.num_threads = threads;
    PDS_ASSIGN_OR_RETURN(auto engine,
                         engine::LlamaEngine::Create(weights, options));
    PDS_ASSIGN_OR_RETURN(
        auto pool, kv::KvPool::Create(engine->KvLayout(kBlockSize), blocks));
    engine::ForwardBatch batch;
    engine::SequenceStep step;
    step.tokens = ids;
    step.num_tokens = tokens;
    step.block_table = table;
    for (int i = tokens - rows; i < tokens; ++i)
      step.logit_indices.push_back(i);
    batch.sequences.push_back(step);
    if (l > 0) batch.hidden_in = hidden;
    double best = std::numeric_limits<double>::infinity();
    for (int r = 0; r < std::max(repeats, 1) + 1; ++r) {  // +1: warm-up
      engine::ForwardResult result;
      const auto start = std::chrono::steady_clock::now();
      PDS_RETURN_IF_ERROR(engine->Forward(batch, *pool, &result));
      const double seconds = std::chrono::duration<double>(
                                 std::chrono::steady_clock::now() - start)
                                 .count();
      if (r > 0) best = std::min(best, seconds);
    }
    measured[l] = best;
  }
  LayerCostProfile costs;
  costs.layer_cost = measured;
  if (layers >= 3) {
    std::vector<double> middle(measured.begin() + 1, measured.end() - 1);
    std::nth_element(middle.begin(), middle.begin() + middle.size() / 2,
                     middle.end());
    const double typical = middle[middle.size() / 2];
    costs.embedding_cost = std::max(0.0, measured.front() - typical);
    costs.head_cost = std::max(0.0, measured.back() - typical);
    costs.layer_cost.front() -= costs.embedding_cost;
    costs.layer_cost.back() -= costs.head_cost;
  }
  return costs;
}

absl::StatusOr<std::vector<int>> ResolveLayerSplit(
    std::string_view text, int num_stages, const LayerCostProfile& costs) {
  const absl::string_view input(text.data(), text.size());
  if (absl::StripAsciiWhitespace(input) == "auto") {
    return AutoLayerSplit(costs, num_stages);
  }
  return ParseLayerSplit(text, static_cast<int>(costs.layer_cost.size()),
                         num_stages);
}

std::vector<engine::ShardSpec> SplitToShards(const std::vector<int>& split) {
  std::vector<engine::ShardSpec> shards;
  int begin = 0;
  for (int n : split) {
    shards.push_back(engine::ShardSpec{begin, begin + n, 0, 1});
    begin += n;
  }
  return shards;
}

}  // namespace pdserve::prefill
