// Chunk policies, the microbatch former and layer splits (explicit and auto).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <numeric>
#include <sstream>

#include "model/model_config.h"
#include "model/weight_source.h"
#include "prefill/chunk_policy.h"
#include "prefill/layer_split.h"
#include "prefill/microbatch_former.h"
#include "testing/golden.h"

namespace pdserve::prefill {
namespace {

int Sum(const std::vector<int>& v) {
  return std::accumulate(v.begin(), v.end(), 0);
}

TEST(ChunkPolicyTest, FixedCutsEqualChunksAndARest) {
  ChunkPolicy fixed{ChunkPolicyKind::kFixed, 7};
  EXPECT_EQ(PlanChunks(fixed, 0, 20), (std::vector<int>{7, 7, 6}));
  EXPECT_EQ(PlanChunks(fixed, 5, 19), (std::vector<int>{7, 7}));
  EXPECT_EQ(PlanChunks(fixed, 0, 3), (std::vector<int>{3}));
  EXPECT_TRUE(PlanChunks(fixed, 4, 4).empty());
  ChunkPolicy whole{ChunkPolicyKind::kFixed, 0};
  EXPECT_EQ(PlanChunks(whole, 0, 270), (std::vector<int>{270}));
  ChunkPolicy ones{ChunkPolicyKind::kFixed, 1};
  EXPECT_EQ(PlanChunks(ones, 0, 4), (std::vector<int>{1, 1, 1, 1}));
}

TEST(ChunkPolicyTest, EqualCostChunksShrinkAndEqualizeAttentionWork) {
  // T = 100, m = 4: boundaries at 100·√(k/4) = 50, 70.7, 86.6, 100.
  EXPECT_EQ(EqualCostChunks(0, 100, 4), (std::vector<int>{50, 21, 16, 13}));
  ChunkPolicy policy{ChunkPolicyKind::kEqualCost, 64};
  for (int total : {65, 100, 270, 1000, 2048}) {
    std::vector<int> chunks = PlanChunks(policy, 0, total);
    EXPECT_EQ(Sum(chunks), total);
    EXPECT_EQ(static_cast<int>(chunks.size()), (total + 63) / 64);
    for (size_t k = 1; k < chunks.size(); ++k) {
      EXPECT_LE(chunks[k], chunks[k - 1]) << "total " << total << " k " << k;
    }
    // The work each chunk adds, b_k² − b_{k−1}², is the same up to rounding.
    double expected = double{1.0} * total * total / chunks.size();
    int end = 0;
    for (int len : chunks) {
      const double work =
          double{1.0} * (end + len) * (end + len) - double{1.0} * end * end;
      EXPECT_NEAR(work, expected, 2.0 * total + 2) << "total " << total;
      end += len;
    }
  }
  // From a reused prefix c: b_k² = c² + (k/m)(T² − c²).
  std::vector<int> tail = PlanChunks(policy, 256, 512);
  EXPECT_EQ(Sum(tail), 256);
  EXPECT_EQ(tail.size(), 4u);
  EXPECT_GT(tail.front(), tail.back());
  // Chunk size 1 and whole prompt degenerate like the fixed policy.
  EXPECT_EQ(PlanChunks(ChunkPolicy{ChunkPolicyKind::kEqualCost, 1}, 0, 5),
            (std::vector<int>{1, 1, 1, 1, 1}));
  EXPECT_EQ(PlanChunks(ChunkPolicy{ChunkPolicyKind::kEqualCost, 0}, 0, 5),
            (std::vector<int>{5}));
  // Every chunk keeps at least one token even when rounding would merge them.
  std::vector<int> many = EqualCostChunks(0, 10, 9);
  EXPECT_EQ(Sum(many), 10);
  for (int len : many) EXPECT_GE(len, 1);
}

TEST(ChunkPolicyTest, ParsesKinds) {
  auto fixed = ParseChunkPolicy("fixed", 64);
  ASSERT_TRUE(fixed.ok());
  EXPECT_EQ(fixed->DebugString(), "fixed:64");
  auto equal = ParseChunkPolicy("equal-cost", 0);
  ASSERT_TRUE(equal.ok());
  EXPECT_EQ(equal->DebugString(), "equal-cost:whole");
}

TEST(MicrobatchFormerTest, PacksChunksOfSeveralRequestsUnderTheBudget) {
  MicrobatchFormer former(10);
  former.Add(1, 0, {4, 4, 4});
  former.Add(2, 0, {3, 3});
  former.Add(3, 0, {12});
  EXPECT_EQ(former.queued_tokens(), 30);
  std::vector<std::vector<std::pair<uint64_t, int>>> batches;
  while (auto batch = former.Next()) {
    EXPECT_LE(batch->num_tokens(), 12);
    std::vector<std::pair<uint64_t, int>> shape;
    for (const ChunkWork& c : batch->chunks) {
      shape.emplace_back(c.request_id, c.chunk_index);
      // One chunk per request per microbatch.
      for (const ChunkWork& other : batch->chunks) {
        if (&other != &c) {
          EXPECT_NE(other.request_id, c.request_id);
        }
      }
    }
    batches.push_back(shape);
  }
  using P = std::pair<uint64_t, int>;
  ASSERT_EQ(batches.size(), 4u);
  EXPECT_EQ(batches[0], (std::vector<P>{{1, 0}, {2, 0}}));
  EXPECT_EQ(batches[1], (std::vector<P>{{1, 1}, {2, 1}}));
  EXPECT_EQ(batches[2], (std::vector<P>{{1, 2}}));
  EXPECT_EQ(batches[3], (std::vector<P>{{3, 0}}));  // over budget: alone
  EXPECT_TRUE(former.empty());
  EXPECT_EQ(former.queued_tokens(), 0);
}

TEST(MicrobatchFormerTest, ChunkPositionsFinalFlagAndPrefixKv) {
  MicrobatchFormer former(100);
  former.Add(7, 32, {20, 10});  // 32 tokens reused from the prefix cache
  auto first = former.Next();
  ASSERT_TRUE(first.has_value());
  ASSERT_EQ(first->chunks.size(), 1u);
  EXPECT_EQ(first->chunks[0].token_begin, 32);
  EXPECT_EQ(first->chunks[0].token_end, 52);
  EXPECT_EQ(first->chunks[0].kv_begin, 0);  // the reused prefix is sent too
  EXPECT_FALSE(first->chunks[0].final_chunk);
  auto second = former.Next();
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->chunks[0].kv_begin, 52);
  EXPECT_TRUE(second->chunks[0].final_chunk);
  EXPECT_GT(second->id, first->id);
}

TEST(MicrobatchFormerTest, RemoveDropsQueuedChunks) {
  MicrobatchFormer former(8);
  former.Add(1, 0, {4, 4});
  former.Add(2, 0, {4});
  EXPECT_TRUE(former.Remove(1));
  EXPECT_FALSE(former.Remove(1));
  auto batch = former.Next();
  ASSERT_TRUE(batch.has_value());
  ASSERT_EQ(batch->chunks.size(), 1u);
  EXPECT_EQ(batch->chunks[0].request_id, 2u);
  EXPECT_FALSE(former.Next().has_value());
}

TEST(LayerSplitTest, ParsesExplicitSplits) {
  auto split = ParseLayerSplit("2,2,1", 5, 3);
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(*split, (std::vector<int>{2, 2, 1}));
  auto spaced = ParseLayerSplit(" 3 , 2 ", 5, 2);
  ASSERT_TRUE(spaced.ok()) << spaced.status();
  EXPECT_EQ(*spaced, (std::vector<int>{3, 2}));
  auto shards = SplitToShards({2, 2, 1});
  ASSERT_EQ(shards.size(), 3u);
  EXPECT_EQ(shards[1].layer_begin, 2);
  EXPECT_EQ(shards[1].layer_end, 4);
  EXPECT_EQ(shards[2].layer_end, 5);
}

// Every split of `layers` into `stages` positive parts.
void AllSplits(int layers, int stages, std::vector<int>& current,
               std::vector<std::vector<int>>& out) {
  if (stages == 1) {
    current.push_back(layers);
    out.push_back(current);
    current.pop_back();
    return;
  }
  for (int n = 1; n <= layers - (stages - 1); ++n) {
    current.push_back(n);
    AllSplits(layers - n, stages - 1, current, out);
    current.pop_back();
  }
}

double MaxCost(const LayerCostProfile& costs, const std::vector<int>& split) {
  auto c = StageCosts(costs, split);
  return *std::max_element(c.begin(), c.end());
}

void ExpectOptimal(const LayerCostProfile& costs, int stages,
                   const std::vector<int>& split) {
  std::vector<std::vector<int>> all;
  std::vector<int> current;
  AllSplits(static_cast<int>(costs.layer_cost.size()), stages, current, all);
  double best = 1e300;
  for (const auto& s : all) best = std::min(best, MaxCost(costs, s));
  EXPECT_LE(MaxCost(costs, split), best * (1 + 1e-9));
}

TEST(LayerSplitTest, AutoGivesTheLastStageFewerLayersWhenTheHeadIsHeavy) {
  LayerCostProfile costs;
  costs.layer_cost.assign(5, 1.0);
  costs.embedding_cost = 0.05;
  costs.head_cost = 1.5;
  auto two = AutoLayerSplit(costs, 2);
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(*two, (std::vector<int>{3, 2}));
  costs.layer_cost.assign(12, 1.0);
  costs.head_cost = 2.0;
  auto three = AutoLayerSplit(costs, 3);
  ASSERT_TRUE(three.ok());
  // Stage 0 ≤ 4 layers (4.05), the last ≤ 3 (5.0): 4 + 5 + 3.
  EXPECT_EQ(*three, (std::vector<int>{4, 5, 3}));
  for (int stages = 1; stages <= 6; ++stages) {
    auto split = AutoLayerSplit(costs, stages);
    ASSERT_TRUE(split.ok()) << split.status();
    EXPECT_EQ(Sum(*split), 12);
    ExpectOptimal(costs, stages, *split);
  }
  // Uneven measured layers.
  costs.layer_cost = {3, 1, 1, 4, 1, 1, 2, 1};
  costs.head_cost = 0.5;
  for (int stages = 1; stages <= 8; ++stages) {
    auto split = AutoLayerSplit(costs, stages);
    ASSERT_TRUE(split.ok()) << split.status();
    ExpectOptimal(costs, stages, *split);
  }
}

// A Qwen-MoE whose first layers are dense (mlp_only_layers) and the rest
// sparse with narrow experts: the dense layers cost more per token, so an
// even split by layer count would leave stage 0 the slowest; auto gives it
// fewer layers.
TEST(LayerSplitTest, AutoBalancesDenseAgainstSparseLayers) {
  model::ModelConfig config;
  config.architecture = "qwen3_moe";
  config.hidden_size = 1024;
  config.intermediate_size = 8192;
  config.num_layers = 8;
  config.num_heads = 16;
  config.num_kv_heads = 4;
  config.head_dim = 64;
  config.vocab_size = 32000;
  config.max_position_embeddings = 4096;
  config.num_experts = 64;
  config.experts_per_token = 4;
  config.expert_intermediate_size = 256;
  config.dense_layers = {true, true, false, false, false, false, false, false};
  ASSERT_TRUE(config.Validate().ok()) << config.Validate();
  const LayerCostProfile costs = EstimateLayerCosts(config, 64, 1);
  EXPECT_GT(costs.layer_cost[0], 2 * costs.layer_cost[2]);
  EXPECT_EQ(costs.layer_cost[2], costs.layer_cost[7]);
  auto split = AutoLayerSplit(costs, 2);
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_LT((*split)[0], 4);
  ExpectOptimal(costs, 2, *split);
}

TEST(LayerSplitTest, AutoOnStories260KShape) {
  auto weights = model::OpenModel(testing::Stories260KGguf());
  ASSERT_TRUE(weights.ok()) << weights.status();
  const auto& config = (*weights)->config();
  // 64-token microbatches with one logits row: the head is light, layers
  // dominate. Stage 0's embedding (a gather) still tips exact ties: with 4
  // stages a 2-layer stage 0 would be the slowest, so the 2 go to stage 1.
  LayerCostProfile costs = EstimateLayerCosts(config, 64, 1);
  EXPECT_GT(costs.head_cost, 0);
  EXPECT_GT(costs.embedding_cost, 0);
  const std::vector<std::vector<int>> expected = {
      {5}, {3, 2}, {2, 2, 1}, {1, 2, 1, 1}, {1, 1, 1, 1, 1}};
  for (int stages = 1; stages <= 5; ++stages) {
    auto split = AutoLayerSplit(costs, stages);
    ASSERT_TRUE(split.ok()) << split.status();
    EXPECT_EQ(*split, expected[stages - 1]) << stages << " stages";
  }
  // Logits for every token (a vocab-heavy head, 512 x 64): the last stage
  // carries ~0.7 layer more, and still gets the fewest layers.
  LayerCostProfile heavy = EstimateLayerCosts(config, 64, 64);
  EXPECT_GT(heavy.head_cost, 0.5 * heavy.layer_cost[0]);
  auto split = AutoLayerSplit(heavy, 2);
  ASSERT_TRUE(split.ok());
  EXPECT_EQ(*split, (std::vector<int>{3, 2}));

  // Measured on the real engine: a valid split and positive costs.
  auto measured = MeasureLayerCosts(**weights, 64, 1, 1, 2);
  ASSERT_TRUE(measured.ok()) << measured.status();
  ASSERT_EQ(measured->layer_cost.size(), 5u);
  for (double c : measured->layer_cost) EXPECT_GT(c, 0);
  auto resolved = ResolveLayerSplit("auto", 3, *measured);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(Sum(*resolved), 5);
  ExpectOptimal(*measured, 3, *resolved);
}

TEST(LayerSplitTest, AutoOnLlama110MDummyShape) {
  std::ifstream file(testing::BenchConfig("llama-110m"));
  ASSERT_TRUE(file.good()) << testing::BenchConfig("llama-110m");
  std::stringstream text;
  text << file.rdbuf();
  auto config = model::ParseHfConfigJson(text.str(), "llama-110m");
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_EQ(config->num_layers, 12);
  // 512-token microbatches, one logits row: layers dominate.
  LayerCostProfile costs = EstimateLayerCosts(*config, 512, 1);
  auto two = AutoLayerSplit(costs, 2);
  ASSERT_TRUE(two.ok());
  EXPECT_EQ(*two, (std::vector<int>{6, 6}));
  auto five = AutoLayerSplit(costs, 5);
  ASSERT_TRUE(five.ok());
  // Bottleneck 3 layers; stage 0 also gathers embeddings, so it takes 2.
  EXPECT_EQ(*five, (std::vector<int>{2, 3, 3, 2, 2}));
  // Logits for all 512 rows: the 32000-wide lm_head costs ~4 layers, so the
  // last stage gets far fewer.
  LayerCostProfile heavy = EstimateLayerCosts(*config, 512, 512);
  EXPECT_GT(heavy.head_cost, 2 * heavy.layer_cost[0]);
  for (int stages = 2; stages <= 6; ++stages) {
    auto split = AutoLayerSplit(heavy, stages);
    ASSERT_TRUE(split.ok());
    EXPECT_EQ(Sum(*split), 12);
    EXPECT_LT(split->back(), split->front()) << stages << " stages";
    ExpectOptimal(heavy, stages, *split);
  }
}

}  // namespace
}  // namespace pdserve::prefill
