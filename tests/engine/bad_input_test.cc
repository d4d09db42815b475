// Engine construction and forward steps reject bad input with a precise
// status and leave the engine usable.
#include <gtest/gtest.h>

#include "engine/engine_backend.h"
#include "engine_test_util.h"

namespace pdserve::engine {
namespace {

using testing_util::IdentityBlockTable;
using testing_util::MakeEngine;
using testing_util::MakePool;
using testing_util::OpenStories;

TEST(EngineBadInputTest, ImpossibleShardsAreRejected) {
  auto weights = OpenStories(true);
  ASSERT_NE(weights, nullptr);
  struct Case {
    ShardSpec shard;
    const char* expected;
  } cases[] = {
      {{3, 2, 0, 1}, "invalid layer range"},
      {{0, 6, 0, 1}, "invalid layer range"},
      {{0, -1, 0, 3}, "does not divide"},
      {{0, -1, 2, 2}, "invalid tensor-parallel rank"},
      {{0, -1, 0, 2}, "needs a communicator"},
  };
  for (const auto& c : cases) {
    EngineOptions options;
    options.shard = c.shard;
    auto engine = LlamaEngine::Create(*weights, options);
    ASSERT_FALSE(engine.ok());
    EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(engine.status().message().find(c.expected), std::string::npos)
        << engine.status();
  }
}

// Asking for the CUDA backend where it cannot run is a precise error, not a
// silent fall back to the CPU.
TEST(EngineBadInputTest, CudaBackendWhereItCannotRunIsAPreciseError) {
  auto weights = OpenStories(true);
  ASSERT_NE(weights, nullptr);
  EngineOptions options;
  options.backend = Backend::kCuda;
  auto engine = LlamaEngine::Create(*weights, options);
  if (!CudaBackendCompiled()) {
    ASSERT_FALSE(engine.ok());
    EXPECT_EQ(engine.status().code(), absl::StatusCode::kUnimplemented);
    EXPECT_NE(engine.status().message().find("PDSERVE_CUDA"), std::string::npos)
        << engine.status();
  } else if (!engine.ok()) {
    EXPECT_EQ(engine.status().code(), absl::StatusCode::kFailedPrecondition)
        << engine.status();
  }
  // A bad shard is reported as such whatever the backend.
  options.shard = {3, 2, 0, 1};
  auto bad = LlamaEngine::Create(*weights, options);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
}

// Staging KV from a host pool into the engine's pool checks that the host
// pool mirrors it and that every block id is inside; a good copy moves exactly
// the named blocks.
TEST(EngineBadInputTest, CopyBlocksFromHostChecksTheMirrorAndIds) {
  auto weights = OpenStories(true);
  ASSERT_NE(weights, nullptr);
  auto engine = MakeEngine(*weights);
  ASSERT_NE(engine, nullptr);
  auto pool = engine->CreateKvPool(16, 4);
  ASSERT_TRUE(pool.ok()) << pool.status();
  auto host = MakePool(*engine, 16, 4);
  auto smaller = MakePool(*engine, 16, 3);
  auto other_blocks = MakePool(*engine, 8, 4);
  ASSERT_NE(host, nullptr);

  const std::vector<int32_t> one = {1};
  auto status = engine->CopyBlocksFromHost(*smaller, one, **pool);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("does not mirror"), std::string::npos)
      << status;
  status = engine->CopyBlocksFromHost(*other_blocks, one, **pool);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  for (int32_t bad : {-1, 4}) {
    const std::vector<int32_t> ids = {0, bad};
    status = engine->CopyBlocksFromHost(*host, ids, **pool);
    EXPECT_EQ(status.code(), absl::StatusCode::kOutOfRange) << status;
    EXPECT_NE(status.message().find("outside a pool of 4"), std::string::npos)
        << status;
  }

  const int64_t block_bytes = host->layout().block_bytes();
  auto* src = static_cast<unsigned char*>(host->data());
  for (int64_t i = 0; i < 4 * block_bytes; ++i) src[i] = (i * 7 + 3) & 0xff;
  const std::vector<int32_t> ids = {2, 0};
  ASSERT_TRUE(engine->CopyBlocksFromHost(*host, ids, **pool).ok());
  const auto* dst = static_cast<const unsigned char*>((*pool)->data());
  for (int b = 0; b < 4; ++b) {
    const bool copied = b == 0 || b == 2;
    int64_t equal = 0;
    for (int64_t i = 0; i < block_bytes; ++i) {
      equal += dst[b * block_bytes + i] == src[b * block_bytes + i];
    }
    if (copied) {
      EXPECT_EQ(equal, block_bytes) << "block " << b;
    } else {
      EXPECT_LT(equal, block_bytes) << "block " << b << " was not named";
    }
  }
}

// Copying a sequence's KV positions out to a host mirror moves exactly those
// slots (the engine computed them) and refuses ranges the table cannot hold.
TEST(EngineBadInputTest, CopyTokensToHostMovesThosePositionsOnly) {
  auto weights = OpenStories(true);
  ASSERT_NE(weights, nullptr);
  auto engine = MakeEngine(*weights);
  ASSERT_NE(engine, nullptr);
  auto pool = engine->CreateKvPool(16, 4);
  ASSERT_TRUE(pool.ok()) << pool.status();
  auto host = MakePool(*engine, 16, 4);
  ASSERT_NE(host, nullptr);
  // 20 prompt tokens through blocks {2, 0}: positions 0..15 in block 2,
  // 16..19 in block 0.
  std::vector<int32_t> tokens = {1,  403, 407, 261, 378, 5,  6,  7,  8,  9,
                                 10, 11,  12,  13,  14,  15, 16, 17, 18, 19};
  const std::vector<int32_t> table = {2, 0};
  ForwardBatch batch;
  SequenceStep step;
  step.tokens = tokens;
  step.num_tokens = static_cast<int>(tokens.size());
  step.block_table = table;
  batch.sequences.push_back(step);
  ForwardResult result;
  ASSERT_TRUE(engine->Forward(batch, **pool, &result).ok());

  ASSERT_TRUE(engine->CopyTokensToHost(**pool, table, 10, 18, *host).ok());
  const kv::KvCacheLayout& layout = host->layout();
  const float* want = static_cast<const float*>((*pool)->data());
  const float* got = static_cast<const float*>(host->data());
  for (int t = 0; t < 20; ++t) {
    const bool copied = t >= 10 && t < 18;
    for (int layer = 0; layer < layout.num_layers; ++layer) {
      for (int kv = 0; kv < 2; ++kv) {
        for (int head = 0; head < layout.num_kv_heads; ++head) {
          const int64_t at =
              layout.Offset(table[t / 16], layer, kv, head, t % 16);
          for (int d = 0; d < layout.head_dim; ++d) {
            ASSERT_EQ(got[at + d], copied ? want[at + d] : 0.0f)
                << "position " << t << " layer " << layer;
          }
        }
      }
    }
  }

  auto status = engine->CopyTokensToHost(**pool, table, 10, 40, *host);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("the block table has 2"), std::string::npos)
      << status;
  status = engine->CopyTokensToHost(**pool, table, 12, 10, *host);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  const std::vector<int32_t> bad_table = {2, 9};
  status = engine->CopyTokensToHost(**pool, bad_table, 10, 18, *host);
  EXPECT_EQ(status.code(), absl::StatusCode::kOutOfRange) << status;
  auto smaller = MakePool(*engine, 16, 3);
  status = engine->CopyTokensToHost(**pool, table, 10, 18, *smaller);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
}

TEST(EngineBadInputTest, BadBatchesAreRejectedAndEngineKeepsWorking) {
  auto weights = OpenStories(true);
  auto engine = MakeEngine(*weights);
  auto pool = MakePool(*engine, 16, 4);
  std::vector<int32_t> tokens = {1, 403, 407};
  auto table = IdentityBlockTable(4);
  auto base = [&] {
    ForwardBatch batch;
    SequenceStep s;
    s.tokens = tokens;
    s.num_tokens = 3;
    s.block_table = table;
    s.logit_indices = {2};
    batch.sequences.push_back(s);
    return batch;
  };
  ForwardResult result;
  {
    ForwardBatch empty;
    EXPECT_EQ(engine->Forward(empty, *pool, &result).code(),
              absl::StatusCode::kInvalidArgument);
  }
  {
    std::vector<int32_t> bad_tokens = {1, 512, 3};
    auto batch = base();
    batch.sequences[0].tokens = bad_tokens;
    auto status = engine->Forward(batch, *pool, &result);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find("token id 512"), std::string::npos)
        << status;
  }
  {
    std::vector<int32_t> negative = {1, -7, 3};
    auto batch = base();
    batch.sequences[0].tokens = negative;
    EXPECT_EQ(engine->Forward(batch, *pool, &result).code(),
              absl::StatusCode::kInvalidArgument);
  }
  {
    auto batch = base();
    batch.sequences[0].start_position =
        engine->config().max_position_embeddings - 2;
    auto status = engine->Forward(batch, *pool, &result);
    EXPECT_EQ(status.code(), absl::StatusCode::kOutOfRange);
    EXPECT_NE(status.message().find("context"), std::string::npos) << status;
  }
  {
    auto batch = base();
    batch.sequences[0].start_position = 62;  // 65 tokens need 5 blocks of 16
    EXPECT_EQ(engine->Forward(batch, *pool, &result).code(),
              absl::StatusCode::kInvalidArgument);
  }
  {
    std::vector<int32_t> bad_table = {9};
    auto batch = base();
    batch.sequences[0].block_table = bad_table;
    auto status = engine->Forward(batch, *pool, &result);
    EXPECT_EQ(status.code(), absl::StatusCode::kOutOfRange);
    EXPECT_NE(status.message().find("block id 9"), std::string::npos) << status;
  }
  {
    auto batch = base();
    batch.sequences[0].logit_indices = {2, 1};
    EXPECT_EQ(engine->Forward(batch, *pool, &result).code(),
              absl::StatusCode::kInvalidArgument);
  }
  {
    auto batch = base();
    batch.sequences[0].num_tokens = 0;
    EXPECT_EQ(engine->Forward(batch, *pool, &result).code(),
              absl::StatusCode::kInvalidArgument);
  }
  {
    auto other_layout = engine->KvLayout(16);
    other_layout.num_kv_heads = 2;
    auto other_pool = kv::KvPool::Create(other_layout, 4);
    ASSERT_TRUE(other_pool.ok());
    auto status = engine->Forward(base(), **other_pool, &result);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find("does not match"), std::string::npos)
        << status;
  }
  {
    auto stage = MakeEngine(*weights, ShardSpec{1, 3, 0, 1});
    auto stage_pool = MakePool(*stage, 16, 4);
    auto batch = base();
    std::vector<float> short_hidden(5);
    batch.hidden_in = short_hidden;
    EXPECT_EQ(stage->Forward(batch, *stage_pool, &result).code(),
              absl::StatusCode::kInvalidArgument);
  }
  // Still serving.
  ASSERT_TRUE(engine->Forward(base(), *pool, &result).ok());
  EXPECT_EQ(result.num_logit_rows, 1);
}

}  // namespace
}  // namespace pdserve::engine
