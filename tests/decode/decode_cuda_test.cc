// The decode worker on the CUDA backend (label `gpu`; skips without a GPU):
// golden greedy tokens and text with speculation off and n-gram, TP 2 with
// both ranks on one GPU, and the remote-prefill path whose KV lands in the
// host mirror and is staged to the GPU when marked complete.
#include <gtest/gtest.h>

#include "decode_test_util.h"
#include "engine/llama_engine.h"
#include "engine/sampler.h"
#include "testing/gpu.h"

namespace pdserve::decode {
namespace {

using testing_util::AllGoldenCases;
using testing_util::ExpectEveryGoldenCase;
using testing_util::ExpectNoLeak;
using testing_util::Greedy;
using testing_util::MakeWorker;
using testing_util::Stories;
using testing_util::Stream;

using ::pdserve::testing::GpuVisible;

DecodeWorkerOptions CudaOptions(int tp, SpeculationMode mode) {
  DecodeWorkerOptions o = testing_util::Options(tp, mode);
  o.backend = engine::Backend::kCuda;
  return o;
}

class CudaGoldenTest
    : public ::testing::TestWithParam<std::tuple<int, SpeculationMode>> {};

TEST_P(CudaGoldenTest, EveryGoldenPromptGivesGoldenTokensAndText) {
  if (!GpuVisible()) GTEST_SKIP() << "no GPU visible";
  const auto [tp, mode] = GetParam();
  auto worker = MakeWorker(CudaOptions(tp, mode));
  ASSERT_NE(worker, nullptr);
  // Two ranks on one GPU: NCCL refuses that, so they reduce through the host.
  EXPECT_EQ(worker->tp_communicator(), tp > 1 ? "host" : "none");
  ExpectEveryGoldenCase(*worker);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, CudaGoldenTest,
    ::testing::Values(std::make_tuple(1, SpeculationMode::kOff),
                      std::make_tuple(1, SpeculationMode::kNgram),
                      std::make_tuple(2, SpeculationMode::kOff)));

// TP 2 on two GPUs reduces with NCCL (device memory, inside graphs) and
// still gives the goldens. Needs two GPUs; skips otherwise.
TEST(CudaNcclTest, TwoRanksOnTwoGpusReduceWithNcclAndKeepGoldens) {
  if (::pdserve::testing::CudaDevices() < 2) GTEST_SKIP() << "needs two GPUs";
  DecodeWorkerOptions options = CudaOptions(2, SpeculationMode::kNgram);
  options.cuda_devices = {0, 1};
  auto worker = MakeWorker(options);
  ASSERT_NE(worker, nullptr);
  EXPECT_EQ(worker->tp_communicator(), "nccl");
  ExpectEveryGoldenCase(*worker);
}

// The prefill side on the same GPU: a CUDA engine writes the admitted blocks
// of its own device pool, which is then copied to the worker's host mirror
// (what a transport put would have done).
TEST(CudaRemoteAdmitTest, KvLandingInTheHostMirrorIsStagedToTheGpu) {
  if (!GpuVisible()) GTEST_SKIP() << "no GPU visible";
  auto worker = MakeWorker(CudaOptions(1, SpeculationMode::kOff));
  ASSERT_NE(worker, nullptr);
  const auto golden = AllGoldenCases()[4];
  engine::EngineOptions eo;
  eo.backend = engine::Backend::kCuda;
  auto prefill = engine::LlamaEngine::Create(*Stories().weights, eo);
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  kv::KvPool& mirror = worker->kv_pool(0);
  ASSERT_EQ(mirror.layout().dtype, kv::KvDType::kBF16);
  auto device_pool =
      (*prefill)->CreateKvPool(mirror.layout().block_size, mirror.num_blocks());
  ASSERT_TRUE(device_pool.ok()) << device_pool.status();

  Stream s;
  auto admit = worker->Admit(1, golden.prompt_ids,
                             Greedy(golden.max_new_tokens), s.Callback());
  ASSERT_TRUE(admit.ok()) << admit.status();
  std::vector<int32_t> table(admit->block_ids.begin(), admit->block_ids.end());
  engine::ForwardBatch batch;
  engine::SequenceStep step;
  step.tokens = golden.prompt_ids;
  step.num_tokens = static_cast<int>(golden.prompt_ids.size());
  step.block_table = table;
  step.logit_indices = {step.num_tokens - 1};
  batch.sequences.push_back(step);
  engine::ForwardResult result;
  ASSERT_TRUE((*prefill)->Forward(batch, **device_pool, &result).ok());
  ASSERT_EQ(cudaMemcpy(mirror.data(), (*device_pool)->data(),
                       mirror.size_bytes(), cudaMemcpyDeviceToHost),
            cudaSuccess);
  ASSERT_TRUE(worker->MarkKvComplete(1, result.argmax[0]).ok());
  ASSERT_TRUE(s.Wait());
  EXPECT_TRUE(s.status().ok()) << s.status();
  EXPECT_EQ(s.tokens(), golden.greedy_ids);
  ExpectNoLeak(*worker);
}

}  // namespace
}  // namespace pdserve::decode
