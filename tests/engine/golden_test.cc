// The reference engine against the float64 goldens, for both model layouts.
#include <gtest/gtest.h>

#include "engine_test_util.h"

namespace pdserve::engine {
namespace {

using testing_util::GreedyGenerate;
using testing_util::MakeEngine;
using testing_util::MakePool;
using testing_util::OpenStories;

class GoldenTest : public ::testing::TestWithParam<bool> {};

TEST_P(GoldenTest, GreedyTokensMatchGolden) {
  auto weights = OpenStories(GetParam());
  ASSERT_NE(weights, nullptr);
  auto engine = MakeEngine(*weights);
  ASSERT_NE(engine, nullptr);
  for (const char* file : {"golden.jsonl", "golden_long.jsonl"}) {
    for (const auto& golden : pdserve::testing::LoadGoldenCases(file)) {
      auto pool = MakePool(*engine, 16, 64);
      ASSERT_NE(pool, nullptr);
      auto tokens = GreedyGenerate(*engine, *pool, golden.prompt_ids,
                                   golden.max_new_tokens);
      EXPECT_EQ(tokens, golden.greedy_ids) << file << ": " << golden.prompt;
    }
  }
}

TEST_P(GoldenTest, PromptLogitsMatchFloat64Reference) {
  auto weights = OpenStories(GetParam());
  ASSERT_NE(weights, nullptr);
  auto engine = MakeEngine(*weights);
  ASSERT_NE(engine, nullptr);
  auto golden = pdserve::testing::LoadGoldenLogits();
  auto pool = MakePool(*engine, 16, 4);
  auto logits = testing_util::PrefillAllLogits(
      *engine, *pool, golden.prompt_ids, testing_util::IdentityBlockTable(4));
  ASSERT_EQ(logits.size(), golden.logits.size());
  double worst = 0;
  for (size_t t = 0; t < logits.size(); ++t) {
    ASSERT_EQ(logits[t].size(), golden.logits[t].size());
    for (size_t v = 0; v < logits[t].size(); ++v) {
      worst = std::max(worst, std::abs(logits[t][v] - golden.logits[t][v]));
    }
  }
  EXPECT_LT(worst, 1e-4);
}

INSTANTIATE_TEST_SUITE_P(Layouts, GoldenTest, ::testing::Values(true, false),
                         [](const auto& info) {
                           return info.param ? "Gguf" : "Safetensors";
                         });

TEST(LayoutAgreementTest, GgufAndSafetensorsGiveTheSameLogits) {
  auto gguf = OpenStories(true);
  auto hf = OpenStories(false);
  ASSERT_NE(gguf, nullptr);
  ASSERT_NE(hf, nullptr);
  auto engine_a = MakeEngine(*gguf);
  auto engine_b = MakeEngine(*hf);
  auto prompt = pdserve::testing::LoadGoldenCases()[1].prompt_ids;
  auto pool_a = MakePool(*engine_a, 16, 4);
  auto pool_b = MakePool(*engine_b, 16, 4);
  auto table = testing_util::IdentityBlockTable(4);
  auto a = testing_util::PrefillAllLogits(*engine_a, *pool_a, prompt, table);
  auto b = testing_util::PrefillAllLogits(*engine_b, *pool_b, prompt, table);
  ASSERT_EQ(a.size(), b.size());
  for (size_t t = 0; t < a.size(); ++t) {
    EXPECT_LT(testing_util::MaxRelativeError(a[t], b[t]), 1e-5)
        << "position " << t;
  }
}

TEST(ForwardResultTest, ArgmaxOfEveryLogitRowIsFilled) {
  auto weights = OpenStories(true);
  ASSERT_NE(weights, nullptr);
  auto engine = MakeEngine(*weights);
  auto pool = MakePool(*engine, 16, 4);
  const auto prompt = pdserve::testing::LoadGoldenCases()[0].prompt_ids;
  const auto table = testing_util::IdentityBlockTable(4);
  ForwardBatch batch;
  SequenceStep step;
  step.tokens = prompt;
  step.num_tokens = static_cast<int>(prompt.size());
  step.block_table = table;
  step.logit_indices = {0, step.num_tokens - 1};
  batch.sequences.push_back(step);
  batch.argmax_only = true;  // a hint: the CPU backend keeps its logits
  ForwardResult result;
  ASSERT_TRUE(engine->Forward(batch, *pool, &result).ok());
  ASSERT_EQ(result.argmax.size(), 2u);
  const int vocab = weights->config().vocab_size;
  for (int r = 0; r < 2; ++r) {
    const float* row = result.logits.data() + r * vocab;
    EXPECT_EQ(result.argmax[r], std::max_element(row, row + vocab) - row);
  }
}

}  // namespace
}  // namespace pdserve::engine
