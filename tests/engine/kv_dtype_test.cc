// The CPU engine with a bf16 KV pool (EngineOptions::kv_dtype): the
// conversions it relies on, the goldens through every attention path, and
// its logits against the f32 reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "common/float16.h"
#include "engine/matmul.h"
#include "engine_test_util.h"

namespace pdserve::engine {
namespace {

using testing_util::GreedyGenerate;
using testing_util::IdentityBlockTable;
using testing_util::MakePool;
using testing_util::OpenStories;
using testing_util::PrefillAllLogits;

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Values that exercise every rounding branch: exact ties (even and odd kept
// bit), just above and below ties, the largest finite float (rounds to
// infinity), infinities, NaNs, denormals and zeros of both signs.
std::vector<float> EdgeValues() {
  std::vector<float> values = {0.0f,
                               -0.0f,
                               1.0f,
                               -1.0f,
                               FromBits(0x3f808000),  // tie, kept bit even
                               FromBits(0x3f818000),  // tie, kept bit odd
                               FromBits(0x3f808001),  // just above a tie
                               FromBits(0x3f807fff),  // just below a tie
                               std::numeric_limits<float>::max(),
                               -std::numeric_limits<float>::max(),
                               std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::quiet_NaN(),
                               FromBits(0x7f800001),  // signalling NaN
                               FromBits(0xff812345),  // negative NaN
                               std::numeric_limits<float>::denorm_min(),
                               FromBits(0x007fffff),  // largest denormal
                               std::numeric_limits<float>::min()};
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> any_bits;
  for (int i = 0; i < 4000; ++i) values.push_back(FromBits(any_bits(rng)));
  return values;
}

TEST(Bf16RowTest, VectorRoundingMatchesScalarBitForBit) {
  const std::vector<float> values = EdgeValues();
  // Every length up to 40 and every start offset mod 8 (vector body + tail).
  for (size_t offset = 0; offset < 8; ++offset) {
    for (size_t n = 0; n <= 40 && offset + n <= values.size(); ++n) {
      std::vector<uint16_t> out(n, 0xdead);
      FloatRowToBf16(values.data() + offset, out.data(), n);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(out[i], FloatToBf16(values[offset + i]))
            << "value bits 0x" << std::hex << Bits(values[offset + i]);
      }
    }
  }
  std::vector<uint16_t> all(values.size());
  FloatRowToBf16(values.data(), all.data(), values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    ASSERT_EQ(all[i], FloatToBf16(values[i]))
        << "value bits 0x" << std::hex << Bits(values[i]);
  }
}

TEST(Bf16RowTest, WideningIsExactAndRoundTrips) {
  std::vector<uint16_t> patterns(1 << 16);
  for (uint32_t i = 0; i < patterns.size(); ++i) patterns[i] = i;
  std::vector<float> wide(patterns.size());
  Bf16RowToFloat(patterns.data() + 3, wide.data(), patterns.size() - 3);
  for (size_t i = 0; i + 3 < patterns.size(); ++i) {
    ASSERT_EQ(Bits(wide[i]), uint32_t{patterns[i + 3]} << 16);
    if (!std::isnan(wide[i])) {
      // Every bf16 value is a float that rounds to itself.
      ASSERT_EQ(FloatToBf16(wide[i]), patterns[i + 3]);
    }
  }
}

std::unique_ptr<LlamaEngine> MakeEngineWithKv(
    const model::WeightSource& weights, std::optional<kv::KvDType> dtype) {
  EngineOptions options;
  options.num_threads = 2;
  options.kv_dtype = dtype;
  auto engine = LlamaEngine::Create(weights, options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

TEST(CpuKvDTypeTest, LayoutReportsBf16AndHalvesTheBlockBytes) {
  auto weights = OpenStories(true);
  ASSERT_NE(weights, nullptr);
  auto f32 = MakeEngineWithKv(*weights, std::nullopt);
  auto bf16 = MakeEngineWithKv(*weights, kv::KvDType::kBF16);
  ASSERT_NE(f32, nullptr);
  ASSERT_NE(bf16, nullptr);
  EXPECT_EQ(f32->KvLayout(16).dtype, kv::KvDType::kF32);
  EXPECT_EQ(bf16->KvLayout(16).dtype, kv::KvDType::kBF16);
  EXPECT_EQ(bf16->KvLayout(16).block_bytes() * 2,
            f32->KvLayout(16).block_bytes());
}

TEST(CpuKvDTypeTest, UnsupportedTypesAndMismatchedPoolsAreRefused) {
  auto weights = OpenStories(true);
  ASSERT_NE(weights, nullptr);
  EngineOptions options;
  options.kv_dtype = kv::KvDType::kF16;
  auto refused = LlamaEngine::Create(*weights, options);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("f32 or bf16"), std::string::npos)
      << refused.status();

  // An f32 pool handed to a bf16 engine (and the reverse) is refused before
  // anything is written into it.
  auto bf16 = MakeEngineWithKv(*weights, kv::KvDType::kBF16);
  auto f32 = MakeEngineWithKv(*weights, std::nullopt);
  ASSERT_NE(bf16, nullptr);
  ASSERT_NE(f32, nullptr);
  auto f32_pool = MakePool(*f32, 16, 4);
  auto bf16_pool = MakePool(*bf16, 16, 4);
  const std::vector<int32_t> prompt = {1, 403, 407};
  const std::vector<int32_t> table = IdentityBlockTable(4);
  for (auto [engine, pool] : {std::pair{bf16.get(), f32_pool.get()},
                              std::pair{f32.get(), bf16_pool.get()}}) {
    ForwardBatch batch;
    SequenceStep step;
    step.tokens = prompt;
    step.num_tokens = 3;
    step.block_table = table;
    step.logit_indices = {2};
    batch.sequences.push_back(step);
    ForwardResult result;
    absl::Status status = engine->Forward(batch, *pool, &result);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  }
  // Both engines still serve their own pools.
  EXPECT_FALSE(PrefillAllLogits(*bf16, *bf16_pool, prompt, table).empty());
}

// Chunk 0: the whole prompt through the GEMM attention path; 3: prompt
// chunks of < 8 queries through the decode path (several query tokens per
// KV pass, as a verify step); 16: one chunk per KV block.
class Bf16GoldenTest : public ::testing::TestWithParam<int> {};

TEST_P(Bf16GoldenTest, GreedyTokensMatchGolden) {
  auto weights = OpenStories(true);
  ASSERT_NE(weights, nullptr);
  auto engine = MakeEngineWithKv(*weights, kv::KvDType::kBF16);
  ASSERT_NE(engine, nullptr);
  for (const char* file : {"golden.jsonl", "golden_long.jsonl"}) {
    for (const auto& golden : pdserve::testing::LoadGoldenCases(file)) {
      auto pool = MakePool(*engine, 16, 64);
      ASSERT_NE(pool, nullptr);
      auto tokens = GreedyGenerate(*engine, *pool, golden.prompt_ids,
                                   golden.max_new_tokens, GetParam());
      EXPECT_EQ(tokens, golden.greedy_ids)
          << file << ": \"" << golden.prompt
          << "\" (smallest top-2 margin of the golden: "
          << golden.min_top2_margin << ")";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Chunks, Bf16GoldenTest, ::testing::Values(0, 3, 16),
                         [](const auto& info) {
                           return absl::StrCat("Chunk", info.param);
                         });

TEST(CpuKvDTypeTest, Bf16LogitsStayWithinBf16ToleranceOfF32) {
  auto weights = OpenStories(true);
  ASSERT_NE(weights, nullptr);
  auto f32 = MakeEngineWithKv(*weights, std::nullopt);
  auto bf16 = MakeEngineWithKv(*weights, kv::KvDType::kBF16);
  ASSERT_NE(f32, nullptr);
  ASSERT_NE(bf16, nullptr);
  const auto golden = pdserve::testing::LoadGoldenCases("golden_long.jsonl");
  ASSERT_FALSE(golden.empty());
  const std::vector<int32_t>& prompt = golden[0].prompt_ids;
  const auto table = IdentityBlockTable((prompt.size() + 15) / 16);
  auto f32_pool = MakePool(*f32, 16, table.size());
  auto bf16_pool = MakePool(*bf16, 16, table.size());
  const auto want = PrefillAllLogits(*f32, *f32_pool, prompt, table);
  const auto got = PrefillAllLogits(*bf16, *bf16_pool, prompt, table);
  ASSERT_EQ(got.size(), want.size());
  double worst = 0;
  bool any_difference = false;
  for (size_t t = 0; t < want.size(); ++t) {
    worst = std::max(worst, testing_util::MaxRelativeError(got[t], want[t]));
    any_difference |= got[t] != want[t];
  }
  // bf16 keeps 8 significant bits (relative rounding error <= 2^-9 per K/V
  // element); through the layers that stays within a few percent of the
  // logits' range. And it must not be zero: the pool really is bf16.
  EXPECT_LT(worst, 5e-2);
  EXPECT_TRUE(any_difference);
  std::printf(
      "bf16 KV vs f32 KV, %zu prompt positions: max relative logit "
      "error %.2e\n",
      want.size(), worst);
}

}  // namespace
}  // namespace pdserve::engine
