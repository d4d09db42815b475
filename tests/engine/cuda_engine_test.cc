// The CUDA backend against the fp32 CPU reference (label `gpu`; every test
// skips where no GPU is visible). bf16 weights and activations move logits by
// O(1e-2): logits are compared within that tolerance, greedy tokens exactly on
// the goldens, and any greedy flip is reported with the reference's top-2
// margin at that position.
#include <gtest/gtest.h>

#include <algorithm>
#include <thread>

#include "bf16_agreement.h"
#include "comm/communicator.h"
#include "engine/backend_flags.h"
#include "engine/engine_backend.h"
#include "engine_test_util.h"
#include "family_reference.h"
#include "testing/gpu.h"

namespace pdserve::engine {
namespace {

using testing_util::IdentityBlockTable;
using testing_util::MaxRelativeError;
using testing_util::OpenStories;

// bf16 has an 8-bit mantissa (relative step 2^-8 = 0.4 %); through 5 layers
// and the lm_head the logits of stories260K stay within a few percent.
constexpr double kBf16LogitTolerance = 3e-2;

using ::pdserve::testing::GpuVisible;

#define SKIP_WITHOUT_GPU()                             \
  if (!GpuVisible()) GTEST_SKIP() << "no GPU visible"; \
  static_assert(true)

std::unique_ptr<LlamaEngine> MakeCudaEngine(
    const model::WeightSource& weights, CudaOptions cuda = {},
    ShardSpec shard = {}, comm::Communicator* communicator = nullptr) {
  EngineOptions options;
  options.backend = Backend::kCuda;
  options.cuda = cuda;
  options.cuda.max_tokens_per_step = 1024;
  options.shard = shard;
  options.communicator = communicator;
  auto engine = LlamaEngine::Create(weights, options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

std::unique_ptr<kv::KvPool> MakeDevicePool(LlamaEngine& engine, int block_size,
                                           int64_t blocks) {
  auto pool = engine.CreateKvPool(block_size, blocks);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? std::move(pool).value() : nullptr;
}

CudaOptions Eager() {
  CudaOptions options;
  options.use_graphs = false;
  return options;
}

// One step of `sequences`: sequence s continues at positions[s] with tokens
// [s] (all of whose rows want logits). Returns the logits.
std::vector<float> Step(LlamaEngine& engine, kv::KvPool& pool,
                        const std::vector<std::vector<int32_t>>& tokens,
                        const std::vector<int>& positions,
                        const std::vector<std::vector<int32_t>>& tables) {
  ForwardBatch batch;
  for (size_t s = 0; s < tokens.size(); ++s) {
    SequenceStep step;
    step.tokens = tokens[s];
    step.num_tokens = static_cast<int>(tokens[s].size());
    step.start_position = positions[s];
    step.block_table = tables[s];
    for (int i = 0; i < step.num_tokens; ++i) step.logit_indices.push_back(i);
    batch.sequences.push_back(step);
  }
  ForwardResult result;
  const absl::Status status = engine.Forward(batch, pool, &result);
  EXPECT_TRUE(status.ok()) << status;
  return result.logits;
}

int32_t Argmax(const float* row, int vocab) {
  return static_cast<int32_t>(std::max_element(row, row + vocab) - row);
}

// Every golden continuation, through every attention kernel, graphs on and
// off: token for token where the reference's margins exceed the measured
// bf16 error, and where one is smaller a flip there is allowed only under
// the bf16 criterion (bf16_agreement.h); every flip is printed.
TEST(CudaEngineTest, GoldenGreedyTokensWithinTheBf16Criterion) {
  SKIP_WITHOUT_GPU();
  auto weights = OpenStories(true);
  ASSERT_NE(weights, nullptr);
  for (AttentionKernels kernels :
       {AttentionKernels::kAuto, AttentionKernels::kTensorCore,
        AttentionKernels::kLegacy}) {
    CudaOptions measured;
    measured.attention = kernels;
    const double error =
        testing_util::MeasureCudaAbsLogitError(*weights, measured);
    const double tolerance = testing_util::Bf16MarginTolerance(error);
    std::printf(
        "[ cuda     ] attention %s: measured bf16 logit error %.4f, margin "
        "tolerance %.4f\n",
        AttentionKernelsName(kernels), error, tolerance);
    for (bool graphs : {true, false}) {
      CudaOptions cuda = measured;
      cuda.use_graphs = graphs;
      auto engine = MakeCudaEngine(*weights, cuda);
      ASSERT_NE(engine, nullptr);
      int cases = 0, exact = 0;
      for (const char* file : {"golden.jsonl", "golden_long.jsonl"}) {
        for (const auto& golden : pdserve::testing::LoadGoldenCases(file)) {
          auto pool = MakeDevicePool(*engine, 16, 64);
          ASSERT_NE(pool, nullptr);
          std::vector<std::vector<float>> logits;
          const auto tokens =
              testing_util::GreedyGenerate(*engine, *pool, golden.prompt_ids,
                                           golden.max_new_tokens, 0, &logits);
          const auto reference = testing_util::ReferenceLogprobs(
              *weights, golden.prompt_ids, golden.greedy_ids,
              testing_util::kAgreementTopK);
          const auto agreement = testing_util::CompareGreedyWithinBf16(
              golden.greedy_ids, reference, tokens,
              testing_util::ScoresOf(tokens, logits), tolerance);
          ++cases;
          exact += agreement.exact;
          if (!agreement.exact) {
            std::printf(
                "[ cuda     ] %s %s, \"%s\": %s\n",
                AttentionKernelsName(kernels), graphs ? "graphs" : "eager",
                golden.prompt.substr(0, 40).c_str(), agreement.report.c_str());
          }
          EXPECT_TRUE(agreement.pass)
              << AttentionKernelsName(kernels) << ", "
              << (graphs ? "graphs" : "eager") << ", " << file << ", \""
              << golden.prompt << "\": " << agreement.report;
        }
      }
      std::printf(
          "[ cuda     ] attention %s, %s: %d/%d golden continuations exact\n",
          AttentionKernelsName(kernels), graphs ? "graphs" : "eager", exact,
          cases);
    }
  }
}

// The precision target, measured as Hugging Face transformers' bf16
// run was: every position of golden_logits.json's prompt against the
// float64 logits, worst |error| / max |logit| of the row.
TEST(CudaEngineTest, PromptLogitsAgainstFloat64Goldens) {
  SKIP_WITHOUT_GPU();
  auto weights = OpenStories(true);
  ASSERT_NE(weights, nullptr);
  const auto golden = pdserve::testing::LoadGoldenLogits();
  const int blocks = static_cast<int>(golden.prompt_ids.size()) / 16 + 1;
  const auto table = IdentityBlockTable(blocks);
  auto worst_of = [&](const std::vector<std::vector<float>>& logits) {
    EXPECT_EQ(logits.size(), golden.logits.size());
    double worst = 0;
    for (size_t t = 0; t < std::min(logits.size(), golden.logits.size()); ++t) {
      double error = 0, scale = 0;
      for (size_t j = 0; j < golden.logits[t].size(); ++j) {
        error = std::max(error, std::abs(logits[t][j] - golden.logits[t][j]));
        scale = std::max(scale, std::abs(golden.logits[t][j]));
      }
      worst = std::max(worst, error / scale);
    }
    return worst;
  };
  // For scale: the fp32 CPU engine, and the same with bf16 KV.
  for (std::optional<kv::KvDType> kv :
       {std::optional<kv::KvDType>(), std::optional(kv::KvDType::kBF16)}) {
    EngineOptions options;
    options.kv_dtype = kv;
    auto cpu = LlamaEngine::Create(*weights, options);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    auto pool = testing_util::MakePool(**cpu, 16, blocks);
    std::printf("[ cuda     ] CPU engine, %s KV: worst %.2e of max |logit|\n",
                kv ? "bf16" : "f32",
                worst_of(testing_util::PrefillAllLogits(
                    **cpu, *pool, golden.prompt_ids, table)));
  }
  for (AttentionKernels kernels :
       {AttentionKernels::kAuto, AttentionKernels::kTensorCore,
        AttentionKernels::kLegacy}) {
    CudaOptions cuda = Eager();
    cuda.attention = kernels;
    auto gpu = MakeCudaEngine(*weights, cuda);
    ASSERT_NE(gpu, nullptr);
    for (int chunk : {0, 1}) {  // the whole prompt, then token by token
      auto pool = MakeDevicePool(*gpu, 16, blocks);
      const double worst = worst_of(testing_util::PrefillAllLogits(
          *gpu, *pool, golden.prompt_ids, table, chunk));
      std::printf(
          "[ cuda     ] attention %s, chunk %d: worst %.2e of max |logit| "
          "(HF transformers bf16: 1.0e-2)\n",
          AttentionKernelsName(kernels), chunk, worst);
      EXPECT_LE(worst, 1.0e-2)
          << AttentionKernelsName(kernels) << " chunk " << chunk;
    }
  }
}

// Where precision goes, layer by layer: the hidden state after layers
// [0, l) from the CUDA engine (a pipeline stage shard) against the fp32 CPU
// engine's, as max |error| / max |h| over the prompt, for l = 1..L; and the
// same for the CPU engine with bf16 KV, for scale. A jump at one layer
// points at what that layer's kernels do.
TEST(CudaEngineTest, PrecisionBisectLayerByLayer) {
  SKIP_WITHOUT_GPU();
  auto weights = OpenStories(true);
  ASSERT_NE(weights, nullptr);
  const auto prompt = pdserve::testing::LoadGoldenLogits().prompt_ids;
  const int blocks = static_cast<int>(prompt.size()) / 16 + 1;
  const auto table = IdentityBlockTable(blocks);
  const int layers = weights->config().num_layers;
  auto hidden = [&](LlamaEngine& engine, kv::KvPool& pool) {
    ForwardBatch batch;
    SequenceStep step;
    step.tokens = prompt;
    step.num_tokens = static_cast<int>(prompt.size());
    step.block_table = table;
    batch.sequences.push_back(step);
    ForwardResult result;
    const absl::Status status = engine.Forward(batch, pool, &result);
    EXPECT_TRUE(status.ok()) << status;
    return result.hidden_out;
  };
  for (int l = 1; l < layers; ++l) {
    EngineOptions cpu_options;
    cpu_options.shard = ShardSpec{0, l, 0, 1};
    auto cpu = LlamaEngine::Create(*weights, cpu_options);
    cpu_options.kv_dtype = kv::KvDType::kBF16;
    auto cpu_bf16 = LlamaEngine::Create(*weights, cpu_options);
    ASSERT_TRUE(cpu.ok() && cpu_bf16.ok());
    auto pool = testing_util::MakePool(**cpu, 16, blocks);
    auto pool_bf16 = testing_util::MakePool(**cpu_bf16, 16, blocks);
    const auto want = hidden(**cpu, *pool);
    const double bf16_kv =
        MaxRelativeError(hidden(**cpu_bf16, *pool_bf16), want);
    std::printf("[ cuda     ] after layer %d: CPU bf16 KV %.2e", l, bf16_kv);
    for (AttentionKernels kernels :
         {AttentionKernels::kAuto, AttentionKernels::kLegacy}) {
      CudaOptions cuda = Eager();
      cuda.attention = kernels;
      auto gpu = MakeCudaEngine(*weights, cuda, ShardSpec{0, l, 0, 1});
      ASSERT_NE(gpu, nullptr);
      auto gpu_pool = MakeDevicePool(*gpu, 16, blocks);
      const double error = MaxRelativeError(hidden(*gpu, *gpu_pool), want);
      std::printf(", GPU %s %.2e", AttentionKernelsName(kernels), error);
      // bf16 GEMM inputs and KV: a few 1e-3 per layer, not 1e-1.
      EXPECT_LT(error, 5e-2) << "layer " << l;
    }
    std::printf("\n");
  }
}

TEST(CudaEngineTest, PromptLogitsWithinBf16ToleranceOfCpuReference) {
  SKIP_WITHOUT_GPU();
  auto weights = OpenStories(true);
  ASSERT_NE(weights, nullptr);
  auto cpu = testing_util::MakeEngine(*weights);
  const auto prompt =
      pdserve::testing::LoadGoldenCases("golden_long.jsonl")[0].prompt_ids;
  const auto table = IdentityBlockTable(64);
  auto cpu_pool = testing_util::MakePool(*cpu, 16, 64);
  for (AttentionKernels kernels :
       {AttentionKernels::kAuto, AttentionKernels::kTensorCore,
        AttentionKernels::kLegacy}) {
    CudaOptions cuda;
    cuda.attention = kernels;
    auto gpu = MakeCudaEngine(*weights, cuda);
    ASSERT_NE(gpu, nullptr);
    for (int chunk : {0, 7}) {  // one chunk, and chunks of 7 tokens
      auto gpu_pool = MakeDevicePool(*gpu, 16, 64);
      const auto expected =
          testing_util::PrefillAllLogits(*cpu, *cpu_pool, prompt, table, chunk);
      const auto actual =
          testing_util::PrefillAllLogits(*gpu, *gpu_pool, prompt, table, chunk);
      ASSERT_EQ(actual.size(), expected.size());
      double worst = 0;
      for (size_t t = 0; t < actual.size(); ++t) {
        worst = std::max(worst, MaxRelativeError(actual[t], expected[t]));
      }
      std::printf(
          "[ cuda     ] attention %s, chunk %d: worst logit error %.2e of max "
          "|logit| (golden_long[0] vs the CPU engine)\n",
          AttentionKernelsName(kernels), chunk, worst);
      EXPECT_LT(worst, kBf16LogitTolerance) << "chunk " << chunk;
    }
  }
}

// A dummy-weight model (deterministic values from the config alone) of
// `config_json`, written to a fresh file.
std::unique_ptr<model::WeightSource> DummyModel(
    const std::string& name, const std::string& config_json) {
  const std::string path = ::testing::TempDir() + "/" + name + ".json";
  FILE* file = std::fopen(path.c_str(), "w");
  if (file == nullptr) return nullptr;
  std::fputs(config_json.c_str(), file);
  std::fclose(file);
  auto source = model::OpenModel(path, model::LoadFormat::kDummy);
  EXPECT_TRUE(source.ok()) << source.status();
  return source.ok() ? std::move(*source) : nullptr;
}

std::string FamilyConfig(const std::string& model_type,
                         const std::string& extra) {
  return "{\"model_type\": \"" + model_type +
         "\", \"hidden_size\": 128, \"intermediate_size\": 256, "
         "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, "
         "\"num_key_value_heads\": 2, \"head_dim\": 32, \"vocab_size\": 512, "
         "\"max_position_embeddings\": 32, \"rms_norm_eps\": 1e-6" +
         extra + "}";
}

// ---------------------------------------------------------------------------
// The model families on the GPU: the tiny checkpoints of
// tests/model/reference (Llama 3.1 RoPE, Llama linear RoPE with q/k/v and
// o_proj biases and head_dim 12, Qwen2.5 biases and tied embeddings, Qwen3
// q/k norms, Mistral's window of 8, Qwen2's window in 2 of 3 layers) against
// the fp32 CPU engine, which engine_families_test holds to the float64
// reference. Dropping any of these features moves the CPU engine's logits by
// more than twice the tolerance used here (engine_families_test,
// EachFeatureMovesLogitsBeyondTheCudaTolerance), so a kernel that ignored
// one fails these tests.

const std::map<std::string, testing_util::FamilyReference>& Families() {
  static const auto* families =
      new std::map<std::string, testing_util::FamilyReference>(
          testing_util::GeneratedOrBundledFamilies(
              FAMILIES_DIR, testing_util::kFamilyMaxNew));
  return *families;
}

std::unique_ptr<model::WeightSource> OpenFamily(
    const testing_util::FamilyReference& family) {
  auto opened = model::OpenModel(family.dir);
  EXPECT_TRUE(opened.ok()) << opened.status();
  return opened.ok() ? std::move(*opened) : nullptr;
}

// Scattered blocks, so neither a window nor a block boundary can hide behind
// an identity table.
const std::vector<int32_t> kScatteredTable = {5, 2, 7, 0, 3, 6, 1, 4};

double WorstRelativeError(const std::vector<std::vector<float>>& actual,
                          const std::vector<std::vector<float>>& expected) {
  EXPECT_EQ(actual.size(), expected.size());
  if (actual.size() != expected.size()) return INFINITY;
  double worst = 0;
  for (size_t t = 0; t < actual.size(); ++t) {
    worst = std::max(worst, MaxRelativeError(actual[t], expected[t]));
  }
  return worst;
}

// Every prompt position's logits, through every attention kernel, graphs on
// and off, prefilled at once (prefill kernel), in chunks of 7 (a cached
// prefix) and token by token (decode steps: the decode kernel with its
// splits, graph replays).
TEST(CudaFamiliesTest, PromptLogitsWithinBf16ToleranceOfCpuEngine) {
  SKIP_WITHOUT_GPU();
  ASSERT_FALSE(Families().empty());
  for (const auto& [name, family] : Families()) {
    SCOPED_TRACE(name);
    auto weights = OpenFamily(family);
    ASSERT_NE(weights, nullptr);
    // The CUDA backend refuses experts by name (engine_families_test).
    if (weights->config().HasExperts()) continue;
    auto cpu = testing_util::MakeEngine(*weights);
    ASSERT_NE(cpu, nullptr);
    auto cpu_pool = testing_util::MakePool(*cpu, 16, 8);
    const auto expected = testing_util::PrefillAllLogits(
        *cpu, *cpu_pool, family.prompt_ids, kScatteredTable);
    for (AttentionKernels kernels :
         {AttentionKernels::kAuto, AttentionKernels::kTensorCore,
          AttentionKernels::kLegacy}) {
      for (bool graphs : {true, false}) {
        CudaOptions cuda;
        cuda.attention = kernels;
        cuda.use_graphs = graphs;
        auto gpu = MakeCudaEngine(*weights, cuda);
        ASSERT_NE(gpu, nullptr);
        for (int chunk : {0, 7, 1}) {
          auto gpu_pool = MakeDevicePool(*gpu, 16, 8);
          ASSERT_NE(gpu_pool, nullptr);
          const double worst = WorstRelativeError(
              testing_util::PrefillAllLogits(*gpu, *gpu_pool, family.prompt_ids,
                                             kScatteredTable, chunk),
              expected);
          std::printf(
              "[ cuda     ] %s, attention %s, %s, chunk %d: worst logit "
              "error %.2e of max |logit|\n",
              name.c_str(), AttentionKernelsName(kernels),
              graphs ? "graphs" : "eager", chunk, worst);
          EXPECT_LT(worst, testing_util::kCudaFamilyLogitTolerance)
              << AttentionKernelsName(kernels)
              << (graphs ? " graphs" : " eager") << " chunk " << chunk;
        }
      }
    }
  }
}

// Greedy continuations under the bf16 criterion (bf16_agreement.h) against
// the CPU engine's, with the tolerance measured on the family's own prompt.
TEST(CudaFamiliesTest, GreedyTokensWithinTheBf16CriterionOfCpuEngine) {
  SKIP_WITHOUT_GPU();
  ASSERT_FALSE(Families().empty());
  for (const auto& [name, family] : Families()) {
    SCOPED_TRACE(name);
    auto weights = OpenFamily(family);
    ASSERT_NE(weights, nullptr);
    // The CUDA backend refuses experts by name (engine_families_test).
    if (weights->config().HasExperts()) continue;
    auto cpu = testing_util::MakeEngine(*weights);
    ASSERT_NE(cpu, nullptr);
    auto cpu_pool = testing_util::MakePool(*cpu, 16, 8);
    const auto want = testing_util::GreedyGenerate(
        *cpu, *cpu_pool, family.prompt_ids, testing_util::kFamilyMaxNew);
    const auto reference = testing_util::ReferenceLogprobs(
        *weights, family.prompt_ids, want, testing_util::kAgreementTopK);
    auto prompt_pool = testing_util::MakePool(*cpu, 16, 8);
    const auto cpu_prompt_logits = testing_util::PrefillAllLogits(
        *cpu, *prompt_pool, family.prompt_ids, IdentityBlockTable(8));
    for (AttentionKernels kernels :
         {AttentionKernels::kAuto, AttentionKernels::kTensorCore,
          AttentionKernels::kLegacy}) {
      CudaOptions cuda;
      cuda.attention = kernels;
      auto gpu = MakeCudaEngine(*weights, cuda);
      ASSERT_NE(gpu, nullptr);
      auto measure_pool = MakeDevicePool(*gpu, 16, 8);
      ASSERT_NE(measure_pool, nullptr);
      const double tolerance =
          testing_util::Bf16MarginTolerance(testing_util::WorstAbsLogitError(
              testing_util::PrefillAllLogits(*gpu, *measure_pool,
                                             family.prompt_ids,
                                             IdentityBlockTable(8)),
              cpu_prompt_logits));
      auto gpu_pool = MakeDevicePool(*gpu, 16, 8);
      ASSERT_NE(gpu_pool, nullptr);
      std::vector<std::vector<float>> logits;
      const auto got =
          testing_util::GreedyGenerate(*gpu, *gpu_pool, family.prompt_ids,
                                       testing_util::kFamilyMaxNew, 0, &logits);
      const auto agreement = testing_util::CompareGreedyWithinBf16(
          want, reference, got, testing_util::ScoresOf(got, logits), tolerance);
      std::printf(
          "[ cuda     ] %s, attention %s: greedy %s (tolerance %.4f)%s%s\n",
          name.c_str(), AttentionKernelsName(kernels),
          agreement.exact ? "exact" : "differs", tolerance,
          agreement.exact ? "" : ": ", agreement.report.c_str());
      EXPECT_TRUE(agreement.pass)
          << AttentionKernelsName(kernels) << ": " << agreement.report;
    }
  }
}

// Tensor-parallel ranks on one GPU (host all-reduce): the biases sliced with
// their heads (TP 4 replicates the KV heads of every family with fewer), the
// o_proj bias added once after the sum, q/k norms and windows per rank.
TEST(CudaFamiliesTest, TensorParallelRanksWithinBf16ToleranceOfCpuEngine) {
  SKIP_WITHOUT_GPU();
  ASSERT_FALSE(Families().empty());
  for (const auto& [name, family] : Families()) {
    SCOPED_TRACE(name);
    auto weights = OpenFamily(family);
    ASSERT_NE(weights, nullptr);
    // The CUDA backend refuses experts by name (engine_families_test).
    if (weights->config().HasExperts()) continue;
    auto cpu = testing_util::MakeEngine(*weights);
    ASSERT_NE(cpu, nullptr);
    auto cpu_pool = testing_util::MakePool(*cpu, 16, 8);
    const auto expected = testing_util::PrefillAllLogits(
        *cpu, *cpu_pool, family.prompt_ids, kScatteredTable, 7);
    for (int tp : {2, 4}) {
      if (weights->config().num_heads % tp != 0) continue;
      SCOPED_TRACE(absl::StrCat("tp ", tp));
      auto group = comm::InProcessGroup::Create(tp);
      ASSERT_TRUE(group.ok()) << group.status();
      std::vector<std::vector<std::vector<float>>> ranks(tp);
      std::vector<std::thread> threads;
      for (int r = 0; r < tp; ++r) {
        threads.emplace_back([&, r] {
          auto engine = MakeCudaEngine(
              *weights, Eager(), ShardSpec{0, -1, r, tp}, (*group)->rank(r));
          if (engine == nullptr) return;
          auto rank_pool = MakeDevicePool(*engine, 16, 8);
          if (rank_pool == nullptr) return;
          ranks[r] = testing_util::PrefillAllLogits(
              *engine, *rank_pool, family.prompt_ids, kScatteredTable, 7);
        });
      }
      for (auto& thread : threads) thread.join();
      for (int r = 1; r < tp; ++r) EXPECT_EQ(ranks[r], ranks[0]);
      const double worst = WorstRelativeError(ranks[0], expected);
      std::printf("[ cuda     ] %s, TP %d: worst logit error %.2e of max\n",
                  name.c_str(), tp, worst);
      EXPECT_LT(worst, testing_util::kCudaFamilyLogitTolerance);
    }
  }
}

// RoPE scaling reaches the kernels through the shared cos/sin tables: each
// type's logits on the GPU within the bf16 criterion of the CPU engine.
TEST(CudaEngineTest, RopeScalingTypesWithinBf16ToleranceOfCpuReference) {
  SKIP_WITHOUT_GPU();
  for (const std::string scaling :
       {"{\"rope_type\": \"linear\", \"factor\": 2.0}",
        "{\"rope_type\": \"dynamic\", \"factor\": 4.0}",
        "{\"rope_type\": \"yarn\", \"factor\": 4.0, "
        "\"original_max_position_embeddings\": 16}",
        "{\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": "
        "1.0, \"high_freq_factor\": 4.0, "
        "\"original_max_position_embeddings\": 32}"}) {
    SCOPED_TRACE(scaling);
    auto weights = DummyModel(
        "scaled", FamilyConfig("llama", ", \"rope_scaling\": " + scaling));
    ASSERT_NE(weights, nullptr);
    auto cpu = testing_util::MakeEngine(*weights);
    auto gpu = MakeCudaEngine(*weights, Eager());
    ASSERT_NE(gpu, nullptr);
    // Past the trained context of 32 where the type stretches it.
    std::vector<int32_t> prompt(
        std::min(60, weights->config().max_position_embeddings));
    for (size_t i = 0; i < prompt.size(); ++i) {
      prompt[i] = static_cast<int32_t>((i * 37 + 11) % 512);
    }
    const auto table = IdentityBlockTable(4);
    auto cpu_pool = testing_util::MakePool(*cpu, 16, 4);
    auto gpu_pool = MakeDevicePool(*gpu, 16, 4);
    const auto expected =
        testing_util::PrefillAllLogits(*cpu, *cpu_pool, prompt, table);
    const auto actual =
        testing_util::PrefillAllLogits(*gpu, *gpu_pool, prompt, table);
    ASSERT_EQ(actual.size(), expected.size());
    for (size_t t = 0; t < actual.size(); ++t) {
      EXPECT_LT(MaxRelativeError(actual[t], expected[t]), kBf16LogitTolerance)
          << "position " << t;
    }
  }
}

// Between kernels that sum in different orders (a batch of 3 rows and a row
// alone may take different GEMM kernels; cuBLAS and the small-batch GEMV
// certainly do), f32-level differences flip the bf16 rounding of a few
// activations per layer, and stories260K's logits move by up to ~5e-3 of
// their maximum (measured on the H200: 1.6e-3 to 4.8e-3). The same kernels
// (graph replay and eager launches) stay within 1e-3.
constexpr double kOtherKernelsTolerance = 1e-2;

// Decode and verify steps of a ragged batch (3 sequences, padded to the
// graph bucket of 4) through graphs equal the eager launches, and every
// sequence's rows equal running it alone.
TEST(CudaEngineTest, GraphReplayEqualsEagerAndBatchingEqualsAlone) {
  SKIP_WITHOUT_GPU();
  auto weights = OpenStories(true);
  ASSERT_NE(weights, nullptr);
  auto graphed = MakeCudaEngine(*weights);
  auto eager = MakeCudaEngine(*weights, Eager());
  auto alone = MakeCudaEngine(*weights, Eager());
  ASSERT_TRUE(graphed && eager && alone);
  const int vocab = weights->config().vocab_size;
  const auto cases = pdserve::testing::LoadGoldenCases();
  ASSERT_GE(cases.size(), 3u);
  std::vector<std::vector<int32_t>> prompts, tables;
  for (int s = 0; s < 3; ++s) {
    prompts.push_back(cases[s].prompt_ids);
    tables.push_back(IdentityBlockTable(8, 8 * s));
  }
  auto pool_g = MakeDevicePool(*graphed, 16, 32);
  auto pool_e = MakeDevicePool(*eager, 16, 32);
  auto pool_a = MakeDevicePool(*alone, 16, 32);
  std::vector<int> positions(3, 0);
  // Prefill (eager in both: mixed lengths).
  Step(*graphed, *pool_g, prompts, positions, tables);
  Step(*eager, *pool_e, prompts, positions, tables);
  for (int s = 0; s < 3; ++s) {
    Step(*alone, *pool_a, {prompts[s]}, {0}, {tables[s]});
    positions[s] = static_cast<int>(prompts[s].size());
  }
  std::vector<std::vector<int32_t>> next = {{5}, {6}, {7}};
  for (int step = 0; step < 7; ++step) {
    if (step == 4) next = {{5, 6, 7}, {8, 9, 10}, {11, 12, 13}};  // verify
    // Different draft counts per sequence: the padded (ragged) graph.
    if (step == 6) next = {{5}, {8, 9}, {11, 12, 13}};
    const auto g = Step(*graphed, *pool_g, next, positions, tables);
    const auto e = Step(*eager, *pool_e, next, positions, tables);
    ASSERT_EQ(g.size(), e.size());
    EXPECT_LT(MaxRelativeError(g, e), 1e-3) << "step " << step;
    size_t row = 0;
    for (int s = 0; s < 3; ++s) {
      const auto a =
          Step(*alone, *pool_a, {next[s]}, {positions[s]}, {tables[s]});
      const std::vector<float> batched(
          e.begin() + row * vocab, e.begin() + (row + next[s].size()) * vocab);
      EXPECT_LT(MaxRelativeError(batched, a), kOtherKernelsTolerance)
          << "step " << step << " sequence " << s;
      for (size_t i = 0; i < next[s].size(); ++i) {
        EXPECT_EQ(Argmax(g.data() + (row + i) * vocab, vocab),
                  Argmax(a.data() + i * vocab, vocab));
      }
      row += next[s].size();
      positions[s] += static_cast<int>(next[s].size());
    }
  }
}

// Greedy picks made on the device equal the argmax of the copied logits, and
// argmax_only leaves the logits on the device.
TEST(CudaEngineTest, DeviceArgmaxEqualsHostArgmax) {
  SKIP_WITHOUT_GPU();
  auto weights = OpenStories(true);
  ASSERT_NE(weights, nullptr);
  auto engine = MakeCudaEngine(*weights);
  ASSERT_NE(engine, nullptr);
  const auto prompt = pdserve::testing::LoadGoldenCases()[0].prompt_ids;
  const auto table = IdentityBlockTable(8);
  const int vocab = weights->config().vocab_size;
  for (bool argmax_only : {false, true}) {
    auto pool = MakeDevicePool(*engine, 16, 8);
    ForwardBatch batch;
    SequenceStep step;
    step.tokens = prompt;
    step.num_tokens = static_cast<int>(prompt.size());
    step.block_table = table;
    for (int i = 0; i < step.num_tokens; ++i) step.logit_indices.push_back(i);
    batch.sequences.push_back(step);
    batch.argmax_only = argmax_only;
    ForwardResult result;
    ASSERT_TRUE(engine->Forward(batch, *pool, &result).ok());
    ASSERT_EQ(result.argmax.size(), prompt.size());
    if (argmax_only) {
      EXPECT_TRUE(result.logits.empty());
      continue;
    }
    for (size_t r = 0; r < prompt.size(); ++r) {
      EXPECT_EQ(result.argmax[r],
                Argmax(result.logits.data() + r * vocab, vocab));
    }
  }
}

// Decode steps of 1 or 2 rows go through the small-batch GEMV; with it off,
// through cuBLAS: the same logits within the other-kernels tolerance, every
// step.
TEST(CudaEngineTest, SmallBatchGemvEqualsCublas) {
  SKIP_WITHOUT_GPU();
  auto weights = OpenStories(true);
  ASSERT_NE(weights, nullptr);
  CudaOptions cublas = Eager();
  cublas.small_batch_gemv = false;
  auto a = MakeCudaEngine(*weights, Eager());
  auto b = MakeCudaEngine(*weights, cublas);
  ASSERT_TRUE(a && b);
  const auto cases = pdserve::testing::LoadGoldenCases();
  for (int batch : {1, 3}) {
    std::vector<std::vector<int32_t>> prompts, tables;
    std::vector<int> positions;
    for (int s = 0; s < batch; ++s) {
      prompts.push_back(cases[s].prompt_ids);
      tables.push_back(IdentityBlockTable(8, 8 * s));
      positions.push_back(0);
    }
    auto pool_a = MakeDevicePool(*a, 16, 8 * batch);
    auto pool_b = MakeDevicePool(*b, 16, 8 * batch);
    Step(*a, *pool_a, prompts, positions, tables);
    Step(*b, *pool_b, prompts, positions, tables);
    for (int s = 0; s < batch; ++s) {
      positions[s] = static_cast<int>(prompts[s].size());
    }
    std::vector<std::vector<int32_t>> next(batch, std::vector<int32_t>{7});
    for (int step = 0; step < 4; ++step) {
      const auto la = Step(*a, *pool_a, next, positions, tables);
      const auto lb = Step(*b, *pool_b, next, positions, tables);
      EXPECT_LT(MaxRelativeError(la, lb), kOtherKernelsTolerance)
          << "batch " << batch << " step " << step;
      for (int s = 0; s < batch; ++s) ++positions[s];
    }
  }
}

TEST(CudaEngineTest, FusedResidualNormEqualsUnfused) {
  SKIP_WITHOUT_GPU();
  auto weights = OpenStories(true);
  ASSERT_NE(weights, nullptr);
  CudaOptions unfused = Eager();
  unfused.fuse_residual_norm = false;
  auto a = MakeCudaEngine(*weights, Eager());
  auto b = MakeCudaEngine(*weights, unfused);
  ASSERT_TRUE(a && b);
  const auto prompt = pdserve::testing::LoadGoldenCases()[0].prompt_ids;
  const auto table = IdentityBlockTable(8);
  auto pool_a = MakeDevicePool(*a, 16, 8);
  auto pool_b = MakeDevicePool(*b, 16, 8);
  // The same float operations in the same order: bitwise equal.
  EXPECT_EQ(testing_util::PrefillAllLogits(*a, *pool_a, prompt, table),
            testing_util::PrefillAllLogits(*b, *pool_b, prompt, table));
}

// TP = 2 with both ranks on one GPU (threads, host all-reduce) equals TP = 1
// within bf16 tolerance; the two ranks agree bitwise.
TEST(CudaEngineTest, TensorParallelTwoRanksOnOneGpuEqualsOneRank) {
  SKIP_WITHOUT_GPU();
  auto weights = OpenStories(true);
  ASSERT_NE(weights, nullptr);
  auto single = MakeCudaEngine(*weights);
  ASSERT_NE(single, nullptr);
  const auto prompt = pdserve::testing::LoadGoldenCases()[1].prompt_ids;
  const auto table = IdentityBlockTable(8);
  auto pool = MakeDevicePool(*single, 16, 8);
  const auto expected =
      testing_util::PrefillAllLogits(*single, *pool, prompt, table);

  auto group = comm::InProcessGroup::Create(2);
  ASSERT_TRUE(group.ok()) << group.status();
  std::vector<std::vector<std::vector<float>>> ranks(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      auto engine = MakeCudaEngine(*weights, {}, ShardSpec{0, -1, r, 2},
                                   (*group)->rank(r));
      if (engine == nullptr) return;
      auto rank_pool = MakeDevicePool(*engine, 16, 8);
      ranks[r] =
          testing_util::PrefillAllLogits(*engine, *rank_pool, prompt, table);
    });
  }
  for (auto& thread : threads) thread.join();
  ASSERT_EQ(ranks[0].size(), expected.size());
  EXPECT_EQ(ranks[0], ranks[1]);
  for (size_t t = 0; t < expected.size(); ++t) {
    EXPECT_LT(MaxRelativeError(ranks[0][t], expected[t]), kBf16LogitTolerance)
        << "position " << t;
  }
}

// A two-stage pipeline on the GPU (hidden states out of stage 0, into stage
// 1) equals the whole model.
TEST(CudaEngineTest, PipelineStagesEqualWholeModel) {
  SKIP_WITHOUT_GPU();
  auto weights = OpenStories(true);
  ASSERT_NE(weights, nullptr);
  auto whole = MakeCudaEngine(*weights, Eager());
  auto first = MakeCudaEngine(*weights, Eager(), ShardSpec{0, 2, 0, 1});
  auto second = MakeCudaEngine(*weights, Eager(), ShardSpec{2, -1, 0, 1});
  ASSERT_TRUE(whole && first && second);
  const auto prompt = pdserve::testing::LoadGoldenCases()[2].prompt_ids;
  const auto table = IdentityBlockTable(8);
  auto pool_w = MakeDevicePool(*whole, 16, 8);
  auto pool_1 = MakeDevicePool(*first, 16, 8);
  auto pool_2 = MakeDevicePool(*second, 16, 8);
  const auto expected =
      testing_util::PrefillAllLogits(*whole, *pool_w, prompt, table);

  ForwardBatch batch;
  SequenceStep step;
  step.tokens = prompt;
  step.num_tokens = static_cast<int>(prompt.size());
  step.block_table = table;
  batch.sequences.push_back(step);
  ForwardResult hidden;
  ASSERT_TRUE(first->Forward(batch, *pool_1, &hidden).ok());
  ASSERT_EQ(hidden.hidden_out.size(),
            prompt.size() * weights->config().hidden_size);
  batch.hidden_in = hidden.hidden_out;
  for (int i = 0; i < step.num_tokens; ++i) {
    batch.sequences[0].logit_indices.push_back(i);
  }
  ForwardResult result;
  ASSERT_TRUE(second->Forward(batch, *pool_2, &result).ok());
  const int vocab = weights->config().vocab_size;
  for (size_t t = 0; t < expected.size(); ++t) {
    const std::vector<float> row(result.logits.begin() + t * vocab,
                                 result.logits.begin() + (t + 1) * vocab);
    EXPECT_LT(MaxRelativeError(row, expected[t]), 1e-4) << "position " << t;
  }
}

TEST(CudaEngineTest, BadInputIsRefusedAndTheEngineKeepsServing) {
  SKIP_WITHOUT_GPU();
  auto weights = OpenStories(true);
  ASSERT_NE(weights, nullptr);
  auto engine = MakeCudaEngine(*weights);
  ASSERT_NE(engine, nullptr);
  EXPECT_EQ(engine->KvLayout(16).dtype, kv::KvDType::kBF16);
  EXPECT_TRUE(engine->kv_on_device());
  auto pool = MakeDevicePool(*engine, 16, 4);
  const auto table = IdentityBlockTable(4);
  const std::vector<int32_t> bad_token = {weights->config().vocab_size};
  ForwardBatch batch;
  SequenceStep step;
  step.tokens = bad_token;
  step.num_tokens = 1;
  step.block_table = table;
  step.logit_indices = {0};
  batch.sequences.push_back(step);
  ForwardResult result;
  EXPECT_EQ(engine->Forward(batch, *pool, &result).code(),
            absl::StatusCode::kInvalidArgument);
  // A host f32 pool is not this engine's pool.
  auto host_pool =
      kv::KvPool::Create(testing_util::MakeEngine(*weights)->KvLayout(16), 4);
  ASSERT_TRUE(host_pool.ok());
  const std::vector<int32_t> good = {1};
  batch.sequences[0].tokens = good;
  EXPECT_EQ(engine->Forward(batch, **host_pool, &result).code(),
            absl::StatusCode::kInvalidArgument);
  // More tokens than the engine's step capacity (1024 here).
  std::vector<int32_t> prompt(400, 1);
  const auto big_table = IdentityBlockTable(25);
  auto big_pool = MakeDevicePool(*engine, 16, 25 * 3);
  ForwardBatch wide;
  for (int s = 0; s < 3; ++s) {
    SequenceStep chunk;
    chunk.tokens = prompt;
    chunk.num_tokens = 400;
    chunk.block_table = big_table;
    wide.sequences.push_back(chunk);
  }
  const absl::Status over = engine->Forward(wide, *big_pool, &result);
  EXPECT_EQ(over.code(), absl::StatusCode::kInvalidArgument) << over;
  // Still serving.
  EXPECT_FALSE(Step(*engine, *pool, {good}, {0}, {table}).empty());
}

}  // namespace
}  // namespace pdserve::engine
