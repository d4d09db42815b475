// The decode worker on the CUDA backend (label `gpu`; skips without a GPU):
// golden greedy tokens and text with speculation off and n-gram, TP 2 with
// both ranks on one GPU, and the remote-prefill path whose KV lands in the
// host mirror and is staged to the GPU when marked complete.
#include <gtest/gtest.h>

#include "decode_test_util.h"
#include "engine/bf16_agreement.h"
#include "engine/llama_engine.h"
#include "engine/sampler.h"
#include "testing/gpu.h"

namespace pdserve::decode {
namespace {

using testing_util::AllGoldenCases;
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

// Every golden prompt at once with the top-5 logprobs of each token: the
// continuation equals the golden one, or differs first where the bf16
// criterion allows (engine/bf16_agreement.h, tolerance measured on this GPU
// by the CUDA engine against the CPU engine); the text too when the tokens
// are equal; no KV left behind.
void ExpectEveryGoldenCaseWithinBf16(DecodeWorker& worker) {
  namespace tu = engine::testing_util;
  static const double tolerance =
      tu::Bf16MarginTolerance(tu::MeasureCudaAbsLogitError(*Stories().weights));
  auto cases = AllGoldenCases();
  std::vector<Stream> streams(cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    RequestParams params = Greedy(cases[i].max_new_tokens);
    params.logprobs = true;
    params.top_logprobs = tu::kAgreementTopK;
    ASSERT_TRUE(
        worker.Submit(i, cases[i].prompt_ids, params, streams[i].Callback())
            .ok());
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    ASSERT_TRUE(streams[i].Wait()) << "case " << i;
    EXPECT_TRUE(streams[i].status().ok()) << streams[i].status();
    EXPECT_EQ(streams[i].reason(), FinishReason::kLength) << "case " << i;
    const auto reference =
        tu::ReferenceLogprobs(*Stories().weights, cases[i].prompt_ids,
                              cases[i].greedy_ids, tu::kAgreementTopK);
    const auto agreement = tu::CompareGreedyWithinBf16(
        cases[i].greedy_ids, reference, streams[i].tokens(),
        streams[i].logprobs(), tolerance);
    if (agreement.exact) {
      EXPECT_EQ(streams[i].text(), cases[i].text) << "case " << i;
    } else {
      std::printf("[ cuda     ] case %zu: %s\n", i, agreement.report.c_str());
    }
    EXPECT_TRUE(agreement.pass) << "case " << i << ": " << agreement.report;
  }
  ExpectNoLeak(worker);
}

class CudaGoldenTest
    : public ::testing::TestWithParam<std::tuple<int, SpeculationMode>> {};

TEST_P(CudaGoldenTest, EveryGoldenPromptWithinTheBf16Criterion) {
  if (!GpuVisible()) GTEST_SKIP() << "no GPU visible";
  const auto [tp, mode] = GetParam();
  auto worker = MakeWorker(CudaOptions(tp, mode));
  ASSERT_NE(worker, nullptr);
  // Two ranks on one GPU: NCCL refuses that, so they reduce through the host.
  EXPECT_EQ(worker->tp_communicator(), tp > 1 ? "host" : "none");
  ExpectEveryGoldenCaseWithinBf16(*worker);
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
  ExpectEveryGoldenCaseWithinBf16(*worker);
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
  RequestParams params = Greedy(golden.max_new_tokens);
  params.logprobs = true;
  params.top_logprobs = engine::testing_util::kAgreementTopK;
  auto admit = worker->Admit(1, golden.prompt_ids, params, s.Callback());
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
  ASSERT_TRUE(worker
                  ->MarkKvComplete(1, result.argmax[0],
                                   engine::ComputeTokenLogprobs(
                                       result.logits, result.argmax[0],
                                       engine::testing_util::kAgreementTopK))
                  .ok());
  ASSERT_TRUE(s.Wait());
  EXPECT_TRUE(s.status().ok()) << s.status();
  namespace tu = engine::testing_util;
  const auto agreement = tu::CompareGreedyWithinBf16(
      golden.greedy_ids,
      tu::ReferenceLogprobs(*Stories().weights, golden.prompt_ids,
                            golden.greedy_ids, tu::kAgreementTopK),
      s.tokens(), s.logprobs(),
      tu::Bf16MarginTolerance(
          tu::MeasureCudaAbsLogitError(*Stories().weights)));
  EXPECT_TRUE(agreement.pass) << agreement.report;
  ExpectNoLeak(*worker);
}

}  // namespace
}  // namespace pdserve::decode
