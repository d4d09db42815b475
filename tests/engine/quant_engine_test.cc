// Quantized (Q8_0, Q4_K, Q6_K) and f16 weights on the CPU engine: the packed
// kernels against f32 products of the dequantized rows, and whole models
// against the same weights dequantized to f32, unsharded and under TP = 2.
//
// Tolerance. A quantized GGUF and its dequantized f32 twin hold bit-identical
// weight values (the kernels dequantize exactly as model::DequantizeRow, which
// tests/model checks bit for bit against a numpy reference), so the only
// difference is the order of f32 summation: a dot product of K terms in a
// different order differs by about sqrt(K)·2^-24 relative to the sum of
// magnitudes (K <= 1024 here: ~2e-6), and two layers, RMSNorm and softmax
// carry that through without amplifying it by more than ~10x. Measured: at
// most 2.6e-6 of the largest logit for Q8_0/Q4_K_M/Q6_K (0 for F16, whose
// panels go through the f32 micro-kernel in the same order). 1e-4 leaves 40x
// headroom and is still 100x below the effect of any real error (a wrong
// block, scale or nibble moves logits by > 1e-2).
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "common/thread_pool.h"
#include "engine/int8_dot.h"
#include "engine/matmul.h"
#include "engine_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/config_override.h"
#include "model/gguf_writer.h"
#include "model/quant_formats.h"
#include "model/tensor_layout.h"
#include "model_test_util.h"

namespace pdserve::engine {
namespace {

using model::TensorFormat;
using ::testing::HasSubstr;
using testing_util::GreedyGenerate;
using testing_util::IdentityBlockTable;
using testing_util::MakeEngine;
using testing_util::MakePool;
using testing_util::MaxRelativeError;
using testing_util::PrefillAllLogits;

constexpr double kLogitTolerance = 1e-4;
// With activations rounded to int8 (QuantizedMatmul::kInt8Activations, the
// default) the engine computes a different function: every activation value
// moves by up to half its block's step (max|x|/254), ~0.5% of a product's
// size, compounded through two layers, attention and the output head.
// Measured against the dequantized f32 model: at most 0.034 (Q8_0), 0.053
// (Q4_K_M), 0.049 (Q6_K) of the largest logit; 0.1 leaves 2x headroom. The
// kernels themselves are held to 1e-5 against the f32 product of the rounded
// activations (Int8ActivationsEqualProductOfTheRoundedActivations), which is
// where a wrong block, scale or nibble would show. Sharding moves f32
// rounding by ulps, which can flip an activation's int8 rounding: TP = 2
// measured 0.008-0.015 from unsharded, so it is held to this tolerance too.
constexpr double kInt8LogitTolerance = 0.1;

// ---------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------

std::vector<float> RandomValues(int64_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.1f);
  std::vector<float> values(count);
  for (float& v : values) v = normal(rng);
  return values;
}

std::vector<uint8_t> Encode(TensorFormat format, const std::vector<float>& w,
                            int64_t rows, int64_t cols) {
  const int64_t row_bytes = model::RowBytes(format, cols);
  std::vector<uint8_t> bytes(rows * row_bytes);
  for (int64_t r = 0; r < rows; ++r) {
    model::QuantizeRow(format, w.data() + r * cols, cols,
                       bytes.data() + r * row_bytes);
  }
  return bytes;
}

std::vector<float> Decode(TensorFormat format, const uint8_t* data,
                          int64_t row_bytes, int64_t rows, int64_t cols) {
  std::vector<float> values(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    model::DequantizeRow(format, data + r * row_bytes, cols,
                         values.data() + r * cols);
  }
  return values;
}

// A kRows x kCols matrix of random weights stored in `format`, as a
// WeightMatrix over the stored bytes and as packed f32 of their dequantized
// values (the reference product).
struct StoredMatrix {
  static constexpr int64_t kRows = 72, kCols = 1024;  // 4 panels + a partial
  std::vector<uint8_t> stored;
  std::vector<float> dequantized;
  WeightMatrix matrix;
  std::optional<PackedMatrix> reference;

  StoredMatrix(TensorFormat format, uint32_t seed) {
    stored = Encode(format, RandomValues(kRows * kCols, seed), kRows, kCols);
    const int64_t row_bytes = model::RowBytes(format, kCols);
    dequantized = Decode(format, stored.data(), row_bytes, kRows, kCols);
    EXPECT_TRUE(matrix
                    .AppendStored(format, stored.data(), row_bytes, kRows,
                                  kCols, 0, nullptr)
                    .ok());
    auto packed = PackedMatrix::Pack(dequantized.data(), kRows, kCols);
    EXPECT_TRUE(packed.ok()) << packed.status();
    if (packed.ok()) reference = std::move(*packed);
  }
};

class WeightMatrixTest : public ::testing::TestWithParam<TensorFormat> {};

TEST_P(WeightMatrixTest, EqualsF32ProductOfTheDequantizedRows) {
  const TensorFormat format = GetParam();
  constexpr int64_t kRows = StoredMatrix::kRows, kCols = StoredMatrix::kCols;
  StoredMatrix m(format, 1);
  ASSERT_TRUE(m.reference.has_value());
  const WeightMatrix& matrix = m.matrix;
  const PackedMatrix& reference = *m.reference;
  ThreadPool pool(2);
  EXPECT_EQ(matrix.At(37, 500), m.dequantized[37 * kCols + 500]);
  // Row-dot (1-4 rows), panel decode (5-64) and blocked prefill (300 rows:
  // 1.2 MB of activations) paths.
  for (int64_t n : {1, 2, 3, 4, 5, 7, 16, 300}) {
    const std::vector<float> x = RandomValues(n * kCols, 100 + n);
    std::vector<float> got(n * kRows), want(n * kRows);
    MatMul(x.data(), n, matrix, got.data(), pool);
    PackedMatMul(x.data(), n, reference, want.data(), pool);
    EXPECT_LT(MaxRelativeError(got, want), 1e-5)
        << model::TensorFormatName(format) << " n " << n;
  }
}

TEST_P(WeightMatrixTest, ColumnSlicesAndInterleavedRopeRows) {
  // What a TP rank of a GGUF model appends: q rows stored in interleaved
  // order (head_dim 16), and a block-aligned column range of a wider row.
  const TensorFormat format = GetParam();
  constexpr int64_t kRows = 64, kFullCols = 1024, kHeadDim = 16;
  const int64_t col0 = 512, cols = 512;
  const std::vector<float> w = RandomValues(kRows * kFullCols, 2);
  const std::vector<uint8_t> stored = Encode(format, w, kRows, kFullCols);
  const int64_t row_bytes = model::RowBytes(format, kFullCols);
  const std::vector<float> full =
      Decode(format, stored.data(), row_bytes, kRows, kFullCols);
  // Expected: HF row p·d/2 + j is stored row 2j + p.
  std::vector<float> hf(kRows * cols);
  for (int64_t r = 0; r < kRows; ++r) {
    const int64_t head = r / kHeadDim, within = r % kHeadDim;
    const int64_t stored_row = head * kHeadDim + 2 * (within % (kHeadDim / 2)) +
                               within / (kHeadDim / 2);
    std::copy_n(full.begin() + stored_row * kFullCols + col0, cols,
                hf.begin() + r * cols);
  }
  WeightMatrix matrix;
  ASSERT_TRUE(matrix
                  .AppendStored(format,
                                stored.data() + model::RowBytes(format, col0),
                                row_bytes, kRows, cols, kHeadDim, nullptr)
                  .ok());
  auto reference = PackedMatrix::Pack(hf.data(), kRows, cols);
  ASSERT_TRUE(reference.ok());
  ThreadPool pool(2);
  for (int64_t n : {1, 6, 600}) {
    const std::vector<float> x = RandomValues(n * cols, 7 + n);
    std::vector<float> got(n * kRows), want(n * kRows);
    MatMul(x.data(), n, matrix, got.data(), pool);
    PackedMatMul(x.data(), n, *reference, want.data(), pool);
    EXPECT_LT(MaxRelativeError(got, want), 1e-5) << "n " << n;
  }
}

// The int8 path against f32 products of the dequantized weights with the
// activations as the kernels rounded them: the integer parts are exact, so
// only f32 summation order separates the two (1e-5, as above). Each row's
// outputs are bit-identical whatever it is multiplied together with.
TEST_P(WeightMatrixTest, Int8ActivationsEqualProductOfTheRoundedActivations) {
  const TensorFormat format = GetParam();
  if (format == TensorFormat::kF16) GTEST_SKIP() << "f16 stays f32";
  if (!internal::Int8ActivationKernelsAvailable()) {
    GTEST_SKIP() << "no int8 kernels in this build";
  }
  constexpr int64_t kRows = StoredMatrix::kRows, kCols = StoredMatrix::kCols;
  StoredMatrix m(format, 3);
  ASSERT_TRUE(m.reference.has_value());
  WeightMatrix& matrix = m.matrix;
  const PackedMatrix& reference = *m.reference;
  ThreadPool pool(2);
  matrix.set_int8_activations(true);
  ASSERT_TRUE(matrix.int8_activations());
  const bool q8_0 = format == TensorFormat::kQ8_0;
  for (int64_t n : {1, 2, 3, 4, 5, 7, 16, 300}) {
    const std::vector<float> x = RandomValues(n * kCols, 200 + n);
    internal::Int8Activations rounded;
    rounded.Quantize(x.data(), n, kCols, q8_0, !q8_0);
    std::vector<float> x_rounded(n * kCols);
    double worst_rounding = 0;
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t k = 0; k < kCols; ++k) {
        x_rounded[t * kCols + k] = rounded.Value(format, t, k);
        const float scale =
            q8_0 ? rounded.d32(t)[k / 32] : rounded.d256(t)[k / 256];
        worst_rounding = std::max(
            worst_rounding,
            static_cast<double>(
                std::abs(x_rounded[t * kCols + k] - x[t * kCols + k]) / scale));
      }
    }
    EXPECT_LE(worst_rounding, 0.5 + 1e-4) << "n " << n;
    std::vector<float> got(n * kRows), want(n * kRows);
    MatMul(x.data(), n, matrix, got.data(), pool);
    PackedMatMul(x_rounded.data(), n, reference, want.data(), pool);
    EXPECT_LT(MaxRelativeError(got, want), 1e-5)
        << model::TensorFormatName(format) << " n " << n;
    // Row by row alone: the same bits.
    for (int64_t t : {int64_t{0}, n / 2, n - 1}) {
      std::vector<float> alone(kRows);
      MatMul(x.data() + t * kCols, 1, matrix, alone.data(), pool);
      for (int64_t r = 0; r < kRows; ++r) {
        ASSERT_EQ(alone[r], got[t * kRows + r]) << "n " << n << " row " << t;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Formats, WeightMatrixTest,
    ::testing::Values(TensorFormat::kF16, TensorFormat::kQ8_0,
                      TensorFormat::kQ4_K, TensorFormat::kQ6_K),
    [](const auto& info) {
      return std::string(model::TensorFormatName(info.param));
    });

TEST(WeightMatrixTest, MixedFormatsInOneFusedMatrix) {
  // q|k|v of a Q4_K_M file: Q4_K, Q4_K, Q6_K segments, 16-row-unaligned.
  constexpr int64_t kCols = 256;
  const std::pair<TensorFormat, int64_t> parts[] = {{TensorFormat::kQ4_K, 40},
                                                    {TensorFormat::kQ8_0, 24},
                                                    {TensorFormat::kQ6_K, 20},
                                                    {TensorFormat::kF16, 9}};
  WeightMatrix matrix;
  std::vector<std::vector<uint8_t>> storage;
  std::vector<float> dequantized;
  uint32_t seed = 10;
  for (const auto& [format, rows] : parts) {
    const std::vector<float> w = RandomValues(rows * kCols, seed++);
    storage.push_back(Encode(format, w, rows, kCols));
    const int64_t row_bytes = model::RowBytes(format, kCols);
    const std::vector<float> d =
        Decode(format, storage.back().data(), row_bytes, rows, kCols);
    dequantized.insert(dequantized.end(), d.begin(), d.end());
    ASSERT_TRUE(matrix
                    .AppendStored(format, storage.back().data(), row_bytes,
                                  rows, kCols, 0, nullptr)
                    .ok());
  }
  EXPECT_EQ(matrix.rows(), 93);
  EXPECT_EQ(matrix.FormatSummary(), "Q4_K 40 + Q8_0 24 + Q6_K 20 + F16 9 rows");
  auto reference = PackedMatrix::Pack(dequantized.data(), 93, kCols);
  ASSERT_TRUE(reference.ok());
  ThreadPool pool(2);
  for (int64_t n : {1, 3, 9, 1100}) {
    const std::vector<float> x = RandomValues(n * kCols, 50 + n);
    std::vector<float> got(n * 93), want(n * 93);
    MatMul(x.data(), n, matrix, got.data(), pool);
    PackedMatMul(x.data(), n, *reference, want.data(), pool);
    EXPECT_LT(MaxRelativeError(got, want), 1e-5) << "n " << n;
  }
}

// ---------------------------------------------------------------------------
// Whole models
// ---------------------------------------------------------------------------

// Big enough for Q4_K blocks to split under TP = 2: each rank's share of
// o_proj (4 heads x 64) and down_proj (512) columns is whole 256-blocks.
model::ModelConfig TestConfig(int hidden = 512, int heads = 8) {
  model::ModelConfig config;
  config.hidden_size = hidden;
  config.intermediate_size = 1024;
  config.num_layers = 2;
  config.num_heads = heads;
  config.num_kv_heads = heads / 2;
  config.head_dim = 64;
  config.vocab_size = 320;
  config.max_position_embeddings = 128;
  config.rms_norm_eps = 1e-5f;
  config.rope_theta = 10000.0f;
  return config;
}

std::vector<float> ModelValues(const std::string& name,
                               const std::vector<int64_t>& shape) {
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  std::mt19937 rng(static_cast<uint32_t>(std::hash<std::string>()(name)));
  // Norm weights around 1; projections scaled like a trained model's so
  // activations stay O(1) through the layers.
  const bool norm = shape.size() == 1;
  std::normal_distribution<float> normal(
      norm ? 1.0f : 0.0f,
      norm ? 0.1f : 1.0f / std::sqrt(static_cast<float>(shape.back())));
  std::vector<float> values(count);
  for (float& v : values) v = normal(rng);
  if (name == "lm_head.weight") {
    for (float& v : values) v *= 8.0f;  // confident, well-separated logits
  }
  return values;
}

// The format a model of `kind` stores tensor `name` in.
TensorFormat FormatOf(const model::ModelConfig& config, TensorFormat kind,
                      const std::string& name) {
  if (name.find("norm") != std::string::npos) return TensorFormat::kF32;
  if (kind == TensorFormat::kQ4_K) return model::Q4KMFormatOf(config, name);
  return kind;
}

struct ModelPair {
  std::unique_ptr<model::WeightSource> quantized, dequantized;
};

// A GGUF of `kind` and an f32 GGUF of exactly its dequantized values.
ModelPair WritePair(const model::ModelConfig& config, TensorFormat kind,
                    const std::string& dir) {
  const std::string quantized = dir + "/model.gguf";
  const std::string dequantized = dir + "/dequantized.gguf";
  auto format_of = [&](const std::string& name) {
    return FormatOf(config, kind, name);
  };
  EXPECT_TRUE(
      model::WriteLlamaGguf(quantized, config, ModelValues, format_of).ok());
  auto through_format = [&](const std::string& name,
                            const std::vector<int64_t>& shape) {
    std::vector<float> values = ModelValues(name, shape);
    const TensorFormat format = format_of(name);
    const int64_t cols = shape.back();
    const int64_t rows = static_cast<int64_t>(values.size()) / cols;
    const std::vector<uint8_t> bytes = Encode(format, values, rows, cols);
    return Decode(format, bytes.data(), model::RowBytes(format, cols), rows,
                  cols);
  };
  EXPECT_TRUE(model::WriteLlamaGguf(
                  dequantized, config, through_format,
                  [](const std::string&) { return TensorFormat::kF32; })
                  .ok());
  ModelPair pair;
  auto a = model::OpenModel(quantized);
  auto b = model::OpenModel(dequantized);
  EXPECT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(b.ok()) << b.status();
  if (a.ok()) pair.quantized = std::move(a).value();
  if (b.ok()) pair.dequantized = std::move(b).value();
  return pair;
}

std::vector<int32_t> Prompt(int length, int vocab) {
  std::vector<int32_t> prompt = {1};
  for (int i = 1; i < length; ++i) prompt.push_back((i * 37 + 11) % vocab);
  return prompt;
}

class QuantizedModelTest : public ::testing::TestWithParam<TensorFormat> {
 protected:
  model::testing::ScopedTempDir dir_;
};

// The quantized model's logits against the dequantized f32 model's:
// prefill at every position of a 100-token prompt (blocked prefill path),
// in chunks of 7 (panel decode path) and greedy decode; returns the largest
// relative error seen (each also checked against `tolerance`).
double CompareWithDequantized(const ModelPair& pair,
                              const model::ModelConfig& config,
                              QuantizedMatmul mode, double tolerance) {
  auto engine = MakeEngine(*pair.quantized, {}, nullptr, 2, mode);
  auto reference = MakeEngine(*pair.dequantized);
  EXPECT_NE(engine, nullptr);
  EXPECT_NE(reference, nullptr);
  if (engine == nullptr || reference == nullptr) return 1;
  double worst = 0;
  auto check = [&](const std::vector<float>& got,
                   const std::vector<float>& want, const std::string& where) {
    const double error = MaxRelativeError(got, want);
    worst = std::max(worst, error);
    EXPECT_LT(error, tolerance) << where;
    return error < tolerance;
  };
  const std::vector<int32_t> prompt = Prompt(100, config.vocab_size);
  auto pool_a = MakePool(*engine, 16, 16);
  auto pool_b = MakePool(*reference, 16, 16);
  const auto table = IdentityBlockTable(16);
  auto got = PrefillAllLogits(*engine, *pool_a, prompt, table);
  auto want = PrefillAllLogits(*reference, *pool_b, prompt, table);
  EXPECT_EQ(got.size(), want.size());
  if (got.size() != want.size()) return 1;
  for (size_t t = 0; t < got.size(); ++t) {
    if (!check(got[t], want[t], absl::StrCat("position ", t))) break;
  }
  auto chunked = PrefillAllLogits(*engine, *MakePool(*engine, 16, 16), prompt,
                                  table, /*chunk=*/7);
  for (size_t t = 0; t < got.size(); ++t) {
    if (!check(chunked[t], want[t], absl::StrCat("chunked, position ", t))) {
      break;
    }
  }
  std::vector<std::vector<float>> got_steps, want_steps;
  const std::vector<int32_t> short_prompt = Prompt(12, config.vocab_size);
  auto got_ids = GreedyGenerate(*engine, *MakePool(*engine, 16, 4),
                                short_prompt, 20, 0, &got_steps);
  auto want_ids = GreedyGenerate(*reference, *MakePool(*reference, 16, 4),
                                 short_prompt, 20, 0, &want_steps);
  for (size_t i = 0; i < std::min(got_steps.size(), want_steps.size()); ++i) {
    if (!check(got_steps[i], want_steps[i], absl::StrCat("decode step ", i))) {
      break;
    }
  }
  // Greedy tokens agree wherever the reference's top-2 margin exceeds what
  // the tolerance allows; with these weights every margin does.
  EXPECT_EQ(got_ids, want_ids);
  return worst;
}

TEST_P(QuantizedModelTest, LogitsMatchTheDequantizedF32Model) {
  const TensorFormat kind = GetParam();
  const model::ModelConfig config = TestConfig();
  ModelPair pair = WritePair(config, kind, dir_.path());
  ASSERT_NE(pair.quantized, nullptr);
  ASSERT_NE(pair.dequantized, nullptr);
  {
    auto engine = MakeEngine(*pair.quantized);
    auto reference = MakeEngine(*pair.dequantized);
    ASSERT_NE(engine, nullptr);
    ASSERT_NE(reference, nullptr);
    // Weights stay in their format: the quantized engine holds a fraction
    // of the f32 one's bytes (Q4_K ~ 4.5-6.6 bits, Q8_0 8.5, F16 16 of 32).
    const double ratio = static_cast<double>(engine->weight_bytes()) /
                         static_cast<double>(reference->weight_bytes());
    const double max_ratio = kind == TensorFormat::kF16    ? 0.51
                             : kind == TensorFormat::kQ8_0 ? 0.28
                                                           : 0.22;
    EXPECT_LT(ratio, max_ratio) << model::TensorFormatName(kind);
  }
  CompareWithDequantized(pair, config, QuantizedMatmul::kExact,
                         kLogitTolerance);
}

TEST_P(QuantizedModelTest, Int8ActivationLogitsWithinTheirTolerance) {
  const TensorFormat kind = GetParam();
  const model::ModelConfig config = TestConfig();
  ModelPair pair = WritePair(config, kind, dir_.path());
  ASSERT_NE(pair.quantized, nullptr);
  ASSERT_NE(pair.dequantized, nullptr);
  const double worst = CompareWithDequantized(
      pair, config, QuantizedMatmul::kInt8Activations, kInt8LogitTolerance);
  // Not f32 rounding: the activations really are rounded (F16 weights keep
  // the f32 path, so they stay exact).
  if (kind == TensorFormat::kF16) {
    EXPECT_LT(worst, kLogitTolerance);
  } else {
    EXPECT_GT(worst, kLogitTolerance);
  }
  RecordProperty("max_relative_logit_error", std::to_string(worst));
}

// TP = 2 in-process ranks against the unsharded quantized engine.
std::vector<std::vector<float>> RunTp(const model::WeightSource& weights,
                                      int tp,
                                      const std::vector<int32_t>& prompt,
                                      QuantizedMatmul mode) {
  auto group = comm::InProcessGroup::Create(tp);
  EXPECT_TRUE(group.ok());
  std::vector<std::unique_ptr<LlamaEngine>> ranks;
  for (int r = 0; r < tp; ++r) {
    ranks.push_back(MakeEngine(weights, ShardSpec{0, -1, r, tp},
                               (*group)->rank(r), 1, mode));
    if (ranks.back() == nullptr) return {};
  }
  std::vector<std::vector<std::vector<float>>> per_rank(tp);
  std::vector<std::thread> threads;
  for (int r = 0; r < tp; ++r) {
    threads.emplace_back([&, r] {
      auto pool = MakePool(*ranks[r], 16, 8);
      per_rank[r] = PrefillAllLogits(*ranks[r], *pool, prompt,
                                     IdentityBlockTable(8), /*chunk=*/5);
    });
  }
  for (auto& t : threads) t.join();
  return per_rank[0];
}

TEST_P(QuantizedModelTest, TensorParallelTwoRanksMatchUnsharded) {
  const TensorFormat kind = GetParam();
  const model::ModelConfig config = TestConfig();
  ModelPair pair = WritePair(config, kind, dir_.path());
  ASSERT_NE(pair.quantized, nullptr);
  const std::vector<int32_t> prompt = Prompt(40, config.vocab_size);
  for (const auto& [mode, tolerance] :
       {std::pair{QuantizedMatmul::kExact, kLogitTolerance},
        std::pair{QuantizedMatmul::kInt8Activations, kInt8LogitTolerance}}) {
    auto reference = RunTp(*pair.quantized, 1, prompt, mode);
    auto sharded = RunTp(*pair.quantized, 2, prompt, mode);
    ASSERT_EQ(sharded.size(), reference.size());
    for (size_t t = 0; t < sharded.size(); ++t) {
      ASSERT_LT(MaxRelativeError(sharded[t], reference[t]), tolerance)
          << "position " << t
          << (tolerance == kLogitTolerance ? " exact" : " int8");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Formats, QuantizedModelTest,
    ::testing::Values(TensorFormat::kF16, TensorFormat::kQ8_0,
                      TensorFormat::kQ4_K, TensorFormat::kQ6_K),
    [](const auto& info) {
      return std::string(model::TensorFormatName(info.param));
    });

// A llama GGUF's attention.sliding_window is Mistral's window over every
// layer: the file with the key computes what the windowless file computes
// under a config with that window (the engine's Mistral path, checked
// against the float64 reference in families_test), and differs from the
// windowless file once a query has more keys than the window.
TEST(GgufSlidingWindowTest, IsMistralsWindowOverEveryLayer) {
  model::ModelConfig windowed = TestConfig();
  windowed.sliding_window = 8;
  model::ModelConfig full = windowed;
  full.sliding_window = 0;
  model::testing::ScopedTempDir dir;
  auto f32 = [](const std::string&) { return TensorFormat::kF32; };
  const std::string windowed_path = dir.File("windowed.gguf");
  const std::string full_path = dir.File("full.gguf");
  ASSERT_TRUE(
      model::WriteLlamaGguf(windowed_path, windowed, ModelValues, f32).ok());
  ASSERT_TRUE(model::WriteLlamaGguf(full_path, full, ModelValues, f32).ok());
  auto windowed_file = model::OpenModel(windowed_path);
  auto full_file = model::OpenModel(full_path);
  ASSERT_TRUE(windowed_file.ok()) << windowed_file.status();
  ASSERT_TRUE(full_file.ok()) << full_file.status();
  EXPECT_EQ((*windowed_file)->config().sliding_window, 8);
  model::ConfigOverrideWeights full_with_window(**full_file, windowed);

  const std::vector<int32_t> prompt = Prompt(40, windowed.vocab_size);
  const auto table = IdentityBlockTable(16);
  auto logits = [&](const model::WeightSource& weights) {
    auto engine = MakeEngine(weights);
    EXPECT_NE(engine, nullptr);
    if (engine == nullptr) return std::vector<std::vector<float>>{};
    return PrefillAllLogits(*engine, *MakePool(*engine, 16, 16), prompt, table);
  };
  const auto from_file = logits(**windowed_file);
  const auto from_config = logits(full_with_window);
  const auto without = logits(**full_file);
  ASSERT_EQ(from_file.size(), prompt.size());
  ASSERT_EQ(from_config.size(), prompt.size());
  ASSERT_EQ(without.size(), prompt.size());
  for (size_t t = 0; t < prompt.size(); ++t) {
    EXPECT_EQ(from_file[t], from_config[t]) << "position " << t;
    if (t < 8) {
      EXPECT_LT(MaxRelativeError(from_file[t], without[t]), 1e-6) << t;
    } else {
      EXPECT_GT(MaxRelativeError(from_file[t], without[t]), 1e-3) << t;
    }
  }
  // A window over some layers only has no GGUF spelling.
  model::ModelConfig some_layers = windowed;
  some_layers.windowed_layers = {false, true};
  const absl::Status refused = model::WriteLlamaGguf(
      dir.File("some.gguf"), some_layers, ModelValues, f32);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), HasSubstr("some layers only"));
}

TEST(QuantizedModelTest, TensorParallelSplitThatCutsABlockIsRefused) {
  // hidden 256 with 4 heads of 64: under TP = 2 each rank would hold 128
  // of o_proj's 256 columns, half a Q4_K block.
  const model::ModelConfig config = TestConfig(/*hidden=*/256, /*heads=*/4);
  model::testing::ScopedTempDir dir;
  const std::string path = dir.File("model.gguf");
  ASSERT_TRUE(model::WriteLlamaGguf(path, config, ModelValues,
                                    [&](const std::string& name) {
                                      return FormatOf(
                                          config, TensorFormat::kQ4_K, name);
                                    })
                  .ok());
  auto weights = model::OpenModel(path);
  ASSERT_TRUE(weights.ok());
  auto group = comm::InProcessGroup::Create(2);
  EngineOptions options;
  options.shard = ShardSpec{0, -1, 1, 2};
  options.communicator = (*group)->rank(1);
  auto engine = LlamaEngine::Create(**weights, options);
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(engine.status().message(),
              HasSubstr("tensor model.layers.0.self_attn.o_proj.weight is "
                        "Q4_K (blocks of 256 values along rows of 256): "
                        "tensor-parallel rank 1 of 2 would hold columns "
                        "[128, 256), which cut a block"));
  // Q8_0's 32-value blocks split there fine.
  const std::string q8 = dir.File("q8.gguf");
  ASSERT_TRUE(model::WriteLlamaGguf(q8, config, ModelValues,
                                    [&](const std::string& name) {
                                      return FormatOf(
                                          config, TensorFormat::kQ8_0, name);
                                    })
                  .ok());
  auto q8_weights = model::OpenModel(q8);
  ASSERT_TRUE(q8_weights.ok());
  EXPECT_TRUE(LlamaEngine::Create(**q8_weights, options).ok());
}

}  // namespace
}  // namespace pdserve::engine
