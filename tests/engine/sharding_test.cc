// Chunked prefill, layer-range (pipeline stage) execution, tensor-parallel
// shards and mixed batches all reproduce the unsharded single-sequence engine.
#include <gtest/gtest.h>

#include <cstring>
#include <thread>

#include "comm/communicator.h"
#include "engine_test_util.h"

namespace pdserve::engine {
namespace {

using testing_util::ExtractKv;
using testing_util::IdentityBlockTable;
using testing_util::MakeEngine;
using testing_util::MakePool;
using testing_util::MaxRelativeError;
using testing_util::OpenStories;
using testing_util::PrefillAllLogits;

std::vector<int32_t> LongPrompt() {
  return pdserve::testing::LoadGoldenCases("golden_long.jsonl")[0].prompt_ids;
}

TEST(ChunkedPrefillTest, ChunksGiveSameLogitsAndKvAsOneShot) {
  auto weights = OpenStories(true);
  auto engine = MakeEngine(*weights);
  auto prompt = LongPrompt();
  const int block_size = 16;
  const int64_t blocks = (prompt.size() + block_size - 1) / block_size;
  auto table = IdentityBlockTable(blocks);
  auto reference_pool = MakePool(*engine, block_size, blocks);
  auto reference = PrefillAllLogits(*engine, *reference_pool, prompt, table);
  auto reference_kv =
      ExtractKv(*reference_pool, static_cast<int>(prompt.size()));
  for (int chunk : {1, 3, 16}) {
    auto pool = MakePool(*engine, block_size, blocks);
    auto logits = PrefillAllLogits(*engine, *pool, prompt, table, chunk);
    ASSERT_EQ(logits.size(), reference.size());
    for (size_t t = 0; t < logits.size(); ++t) {
      ASSERT_LT(MaxRelativeError(logits[t], reference[t]), 1e-5)
          << "chunk " << chunk << " position " << t;
    }
    EXPECT_LT(
        MaxRelativeError(ExtractKv(*pool, static_cast<int>(prompt.size())),
                         reference_kv),
        1e-5)
        << "chunk " << chunk;
  }
}

TEST(LayerRangeTest, FiveOneLayerStagesChainedEqualTheFullModel) {
  auto weights = OpenStories(false);
  auto full = MakeEngine(*weights);
  auto prompt = pdserve::testing::LoadGoldenCases()[2].prompt_ids;
  auto table = IdentityBlockTable(2);
  auto full_pool = MakePool(*full, 16, 2);
  auto reference = PrefillAllLogits(*full, *full_pool, prompt, table);

  const int layers = weights->config().num_layers;
  ASSERT_EQ(layers, 5);
  std::vector<std::unique_ptr<LlamaEngine>> stages;
  std::vector<std::unique_ptr<kv::KvPool>> pools;
  for (int l = 0; l < layers; ++l) {
    stages.push_back(MakeEngine(*weights, ShardSpec{l, l + 1, 0, 1}));
    ASSERT_NE(stages.back(), nullptr);
    EXPECT_EQ(stages.back()->holds_first_layer(), l == 0);
    EXPECT_EQ(stages.back()->holds_last_layer(), l == layers - 1);
    pools.push_back(MakePool(*stages.back(), 16, 2));
  }
  // Two chunks, so later chunks read KV the stages wrote earlier.
  std::vector<std::vector<float>> logits;
  const int n = static_cast<int>(prompt.size());
  for (int start = 0; start < n; start += 5) {
    int len = std::min(5, n - start);
    ForwardBatch batch;
    SequenceStep step;
    step.tokens = std::span<const int32_t>(prompt.data() + start, len);
    step.num_tokens = len;
    step.start_position = start;
    step.block_table = table;
    for (int i = 0; i < len; ++i) step.logit_indices.push_back(i);
    batch.sequences.push_back(step);
    std::vector<float> hidden;
    for (int l = 0; l < layers; ++l) {
      batch.hidden_in = hidden;
      ForwardResult result;
      ASSERT_TRUE(stages[l]->Forward(batch, *pools[l], &result).ok());
      hidden = std::move(result.hidden_out);
      if (l == layers - 1) {
        ASSERT_EQ(result.num_logit_rows, len);
        for (int i = 0; i < len; ++i) {
          const int vocab = weights->config().vocab_size;
          logits.emplace_back(result.logits.begin() + i * vocab,
                              result.logits.begin() + (i + 1) * vocab);
        }
      } else {
        ASSERT_EQ(hidden.size(),
                  static_cast<size_t>(len) * weights->config().hidden_size);
      }
    }
  }
  ASSERT_EQ(logits.size(), reference.size());
  for (size_t t = 0; t < logits.size(); ++t) {
    EXPECT_LT(MaxRelativeError(logits[t], reference[t]), 1e-5)
        << "position " << t;
  }
}

// Runs prefill + a few greedy decode steps on T in-process ranks and returns
// rank 0's logits of every step.
std::vector<std::vector<float>> RunTensorParallel(
    const model::WeightSource& weights, int tp,
    const std::vector<int32_t>& prompt, int decode_steps,
    std::vector<int64_t>* weight_bytes) {
  auto group = comm::InProcessGroup::Create(tp);
  EXPECT_TRUE(group.ok());
  std::vector<std::unique_ptr<LlamaEngine>> ranks;
  std::vector<std::unique_ptr<kv::KvPool>> pools;
  for (int r = 0; r < tp; ++r) {
    ranks.push_back(
        MakeEngine(weights, ShardSpec{0, -1, r, tp}, (*group)->rank(r), 1));
    pools.push_back(MakePool(*ranks.back(), 16, 4));
    weight_bytes->push_back(ranks.back()->weight_bytes());
  }
  std::vector<std::vector<std::vector<float>>> per_rank(tp);
  std::vector<std::thread> threads;
  for (int r = 0; r < tp; ++r) {
    threads.emplace_back([&, r] {
      auto table = IdentityBlockTable(4);
      auto logits = PrefillAllLogits(*ranks[r], *pools[r], prompt, table);
      per_rank[r].push_back(logits.back());
      int32_t next = static_cast<int32_t>(
          std::max_element(logits.back().begin(), logits.back().end()) -
          logits.back().begin());
      for (int step = 0; step < decode_steps; ++step) {
        ForwardBatch batch;
        SequenceStep s;
        s.tokens = std::span<const int32_t>(&next, 1);
        s.num_tokens = 1;
        s.start_position = static_cast<int>(prompt.size()) + step;
        s.block_table = table;
        s.logit_indices = {0};
        batch.sequences.push_back(s);
        ForwardResult result;
        EXPECT_TRUE(ranks[r]->Forward(batch, *pools[r], &result).ok());
        per_rank[r].push_back(result.logits);
        next = static_cast<int32_t>(
            std::max_element(result.logits.begin(), result.logits.end()) -
            result.logits.begin());
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 1; r < tp; ++r)
    EXPECT_EQ(per_rank[r], per_rank[0]) << "rank " << r;
  return per_rank[0];
}

TEST(TensorParallelTest, ShardsAllReducedEqualUnshardedEngine) {
  auto weights = OpenStories(true);
  auto prompt = pdserve::testing::LoadGoldenCases()[0].prompt_ids;
  std::vector<int64_t> unsharded_bytes;
  auto reference = RunTensorParallel(*weights, 1, prompt, 6, &unsharded_bytes);
  for (int tp : {2, 4, 8}) {
    std::vector<int64_t> bytes;
    auto logits = RunTensorParallel(*weights, tp, prompt, 6, &bytes);
    ASSERT_EQ(logits.size(), reference.size());
    for (size_t i = 0; i < logits.size(); ++i) {
      EXPECT_LT(MaxRelativeError(logits[i], reference[i]), 1e-5)
          << "tp " << tp << " step " << i;
    }
    // Everything but the norms is sharded: each rank holds about 1/T.
    for (int64_t b : bytes) {
      EXPECT_LT(static_cast<double>(b),
                1.0 / tp * unsharded_bytes[0] * 1.15 + 8192)
          << "tp " << tp;
    }
  }
}

TEST(TensorParallelTest, MoreRanksThanKvHeadsReplicatesKvHeads) {
  auto weights = OpenStories(true);
  ASSERT_EQ(weights->config().num_kv_heads, 4);
  auto group = comm::InProcessGroup::Create(8);
  for (int r = 0; r < 8; ++r) {
    auto engine =
        MakeEngine(*weights, ShardSpec{0, -1, r, 8}, (*group)->rank(r), 1);
    auto layout = engine->KvLayout(16);
    EXPECT_EQ(layout.num_kv_heads, 1);
    EXPECT_EQ(layout.kv_head_offset, r / 2);
  }
}

TEST(MixedBatchTest, PrefillDecodeAndVerifyInOneStepEqualRunningAlone) {
  auto weights = OpenStories(true);
  auto engine = MakeEngine(*weights);
  auto cases = pdserve::testing::LoadGoldenCases();
  const int block_size = 4;
  // Three sequences in disjoint blocks of one pool:
  //  A: first prefill chunk of 7 tokens of its prompt;
  //  B: prompt already prefilled, one decode token;
  //  C: prompt already prefilled, a 5-token speculative verify.
  const auto& a_prompt = cases[0].prompt_ids;
  const auto& b_prompt = cases[1].prompt_ids;
  const auto& c_prompt = cases[2].prompt_ids;
  std::vector<int32_t> a_tokens = a_prompt;
  a_tokens.insert(a_tokens.end(), cases[0].greedy_ids.begin(),
                  cases[0].greedy_ids.begin() + 2);
  std::vector<int32_t> b_next = {cases[1].greedy_ids[0]};
  std::vector<int32_t> c_verify(cases[2].greedy_ids.begin(),
                                cases[2].greedy_ids.begin() + 5);
  auto a_table = IdentityBlockTable(10, 0);
  auto b_table = IdentityBlockTable(10, 10);
  auto c_table = IdentityBlockTable(10, 20);

  auto prefill = [&](kv::KvPool& pool, const std::vector<int32_t>& prompt,
                     const std::vector<int32_t>& table) {
    PrefillAllLogits(*engine, pool, prompt, table);
  };
  auto step_for = [](const std::vector<int32_t>& tokens, int start,
                     const std::vector<int32_t>& table, int count) {
    SequenceStep s;
    s.tokens = std::span<const int32_t>(tokens.data(), count);
    s.num_tokens = count;
    s.start_position = start;
    s.block_table = table;
    for (int i = 0; i < count; ++i) s.logit_indices.push_back(i);
    return s;
  };

  // Mixed.
  auto mixed_pool = MakePool(*engine, block_size, 30);
  prefill(*mixed_pool, b_prompt, b_table);
  prefill(*mixed_pool, c_prompt, c_table);
  ForwardBatch mixed;
  mixed.sequences.push_back(step_for(a_tokens, 0, a_table, 7));
  mixed.sequences.push_back(
      step_for(b_next, static_cast<int>(b_prompt.size()), b_table, 1));
  mixed.sequences.push_back(
      step_for(c_verify, static_cast<int>(c_prompt.size()), c_table, 5));
  ForwardResult mixed_result;
  ASSERT_TRUE(engine->Forward(mixed, *mixed_pool, &mixed_result).ok());
  ASSERT_EQ(mixed_result.num_logit_rows, 13);

  // Alone.
  auto alone_pool = MakePool(*engine, block_size, 30);
  prefill(*alone_pool, b_prompt, b_table);
  prefill(*alone_pool, c_prompt, c_table);
  std::vector<float> alone_logits;
  for (const auto& seq : mixed.sequences) {
    ForwardBatch single;
    single.sequences.push_back(seq);
    ForwardResult r;
    ASSERT_TRUE(engine->Forward(single, *alone_pool, &r).ok());
    alone_logits.insert(alone_logits.end(), r.logits.begin(), r.logits.end());
  }
  EXPECT_LT(MaxRelativeError(mixed_result.logits, alone_logits), 1e-5);
  // Verify positions that the golden run agrees on reproduce greedy tokens.
  const int vocab = weights->config().vocab_size;
  for (int i = 0; i < 4; ++i) {
    const float* row = mixed_result.logits.data() + (8 + i) * vocab;
    EXPECT_EQ(std::max_element(row, row + vocab) - row,
              cases[2].greedy_ids[i + 1]);
  }
}

}  // namespace
}  // namespace pdserve::engine
