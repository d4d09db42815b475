// The KV out path over the real UCX transport: a 3-stage in-process pipeline
// whose stages each own a transport::KvSource writing into two decode-rank
// sinks (head shards) in this process. The KV that lands in the sinks'
// granted blocks equals the single-process engine's, prefix reuse included.
#include <gtest/gtest.h>

#include <algorithm>

#include "engine/engine_test_util.h"
#include "prefill/in_process_group.h"
#include "prefill_worker/ucx_kv_output.h"
#include "testing/golden.h"
#include "transport/kv_transfer.h"
#include "transport/ucx_worker.h"

namespace pdserve::prefill {
namespace {

using engine::testing_util::MaxRelativeError;

constexpr int kBlockSize = 16;
constexpr int kRanks = 2;
constexpr int64_t kSinkBlocks = 160;

TEST(UcxKvOutputTest, StagesWriteEngineKvIntoDecodeRankShards) {
  auto weights = engine::testing_util::OpenStories(true);
  ASSERT_NE(weights, nullptr);
  const model::ModelConfig& config = weights->config();
  transport::KvModelSpec spec{config.Identity(), kv::KvDType::kF32,
                              kBlockSize,        config.head_dim,
                              config.num_layers, config.num_kv_heads};

  // Decode side: two TP ranks, each all layers and half the KV heads.
  std::vector<std::unique_ptr<transport::UcxWorker>> sink_workers;
  std::vector<std::unique_ptr<kv::KvPool>> sink_pools;
  std::vector<std::unique_ptr<transport::KvSink>> sinks;
  const int heads_per_rank = config.num_kv_heads / kRanks;
  for (int r = 0; r < kRanks; ++r) {
    auto worker = transport::UcxWorker::Create();
    ASSERT_TRUE(worker.ok()) << worker.status();
    kv::KvCacheLayout layout{config.num_layers,  0,          heads_per_rank,
                             r * heads_per_rank, kBlockSize, config.head_dim,
                             kv::KvDType::kF32};
    auto pool = kv::KvPool::Create(layout, kSinkBlocks);
    ASSERT_TRUE(pool.ok());
    auto sink = transport::KvSink::Create(worker->get(), pool->get(), spec);
    ASSERT_TRUE(sink.ok()) << sink.status();
    sink_workers.push_back(std::move(*worker));
    sink_pools.push_back(std::move(*pool));
    sinks.push_back(std::move(*sink));
  }

  // Prefill side: one worker + KvSource per stage over the stage's own pool.
  std::vector<std::unique_ptr<transport::UcxWorker>> stage_workers;
  std::vector<std::unique_ptr<transport::KvSource>> sources;
  std::vector<std::unique_ptr<UcxKvOutput>> outputs;
  PrefillGroupOptions options;
  options.layer_split = {2, 2, 1};
  options.scheduler.block_size = kBlockSize;
  options.scheduler.num_blocks = 128;
  options.scheduler.microbatch_token_budget = 64;
  options.scheduler.prefix_reuse = true;
  options.scheduler.chunk_policy = ChunkPolicy{ChunkPolicyKind::kEqualCost, 48};
  options.kv_output_factory =
      [&](int stage, kv::KvPool* pool) -> absl::StatusOr<StageKvOutput*> {
    auto worker = transport::UcxWorker::Create();
    if (!worker.ok()) return worker.status();
    auto source = transport::KvSource::Create(worker->get(), pool, spec);
    if (!source.ok()) return source.status();
    for (const auto& sink : sinks) {
      auto connected = (*source)->Connect(sink->descriptor());
      if (!connected.ok()) return connected.status();
    }
    outputs.push_back(std::make_unique<UcxKvOutput>(source->get()));
    stage_workers.push_back(std::move(*worker));
    sources.push_back(std::move(*source));
    return outputs.back().get();
  };
  auto group = InProcessPrefillGroup::Create(*weights, options, nullptr);
  ASSERT_TRUE(group.ok()) << group.status();

  std::vector<pdserve::testing::GoldenCase> cases =
      pdserve::testing::LoadGoldenCases();
  for (auto& c : pdserve::testing::LoadGoldenCases("golden_long.jsonl")) {
    cases.push_back(c);
  }
  cases.push_back(cases.back());  // again: served from the prefix cache

  auto full = engine::testing_util::MakeEngine(*weights, {}, nullptr, 1);
  int64_t next_sink_block = kSinkBlocks - 1;
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& prompt = cases[i].prompt_ids;
    const int n = static_cast<int>(prompt.size());
    const int blocks = (n + kBlockSize - 1) / kBlockSize;
    // Destination blocks scattered from the top of the pool down.
    std::vector<int64_t> dst;
    for (int b = 0; b < blocks; ++b) dst.push_back(next_sink_block--);
    const uint64_t id = 100 + i;
    PrefillRequest request;
    request.request_id = id;
    request.prompt = prompt;
    for (auto& sink : sinks) {
      auto grant = sink->Expect(id, n, dst);
      ASSERT_TRUE(grant.ok()) << grant.status();
      request.kv_grants.push_back(*grant);
    }
    auto ticket = (*group)->Submit(request);
    ASSERT_TRUE(ticket.ok()) << ticket.status();
    auto outcome = (*ticket)->Wait(absl::Seconds(60));
    ASSERT_TRUE(outcome.ok()) << outcome.status();
    EXPECT_EQ(outcome->first_token.token, cases[i].greedy_ids[0]);
    if (i + 1 == cases.size()) {
      EXPECT_EQ(outcome->cached_tokens, 256);
    }
    for (auto& sink : sinks) {
      ASSERT_TRUE(sink->Wait(id, absl::Seconds(30)).ok());
    }

    // Reference KV from the unsharded engine, compared per rank.
    auto pool = engine::testing_util::MakePool(*full, kBlockSize, blocks);
    auto table = engine::testing_util::IdentityBlockTable(blocks);
    engine::testing_util::PrefillAllLogits(*full, *pool, prompt, table);
    for (int r = 0; r < kRanks; ++r) {
      const kv::KvCacheLayout& sl = sink_pools[r]->layout();
      std::vector<float> got, want;
      for (int layer = 0; layer < config.num_layers; ++layer) {
        for (int kv = 0; kv < 2; ++kv) {
          for (int h = 0; h < heads_per_rank; ++h) {
            for (int pos = 0; pos < n; ++pos) {
              const float* g =
                  sink_pools[r]->f32() + sl.Offset(dst[pos / kBlockSize], layer,
                                                   kv, h, pos % kBlockSize);
              const float* w = pool->f32() +
                               pool->layout().Offset(pos / kBlockSize, layer,
                                                     kv, r * heads_per_rank + h,
                                                     pos % kBlockSize);
              got.insert(got.end(), g, g + config.head_dim);
              want.insert(want.end(), w, w + config.head_dim);
            }
          }
        }
      }
      EXPECT_LE(MaxRelativeError(got, want), 1e-6)
          << "prompt " << i << " rank " << r;
    }
  }
  for (auto& sink : sinks) EXPECT_EQ(sink->active_requests(), 0);
  EXPECT_EQ((*group)->coordinator().stats().used_blocks, 0);
  // Teardown order: stages, then their outputs and sources, then sinks.
  group->reset();
  outputs.clear();
  sources.clear();
  stage_workers.clear();
  sinks.clear();
}

}  // namespace
}  // namespace pdserve::prefill
