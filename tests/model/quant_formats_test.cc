// The GGML block formats: dequantization against hand-built blocks of known
// values and, bit for bit, against an independent numpy dequantizer
// (ggml_blocks_ref.py); the reference quantizers' error; quantized GGUF
// files read in place and through ReadF32.
#include "model/quant_formats.h"

#include <cmath>
#include <cstring>
#include <random>

#include "common/float16.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/gguf_file.h"
#include "model/gguf_writer.h"
#include "model/tensor_layout.h"
#include "model/weight_source.h"
#include "model_test_util.h"
#include "testing/shell.h"

namespace pdserve::model {
namespace {

using ::pdserve::model::testing::ScopedTempDir;

void PutF16(uint8_t* p, float value) {
  const uint16_t bits = FloatToF16(value);
  std::memcpy(p, &bits, 2);
}

TEST(QuantFormatsTest, BlockGeometry) {
  EXPECT_EQ(BlockElements(TensorFormat::kQ8_0), 32);
  EXPECT_EQ(BlockBytes(TensorFormat::kQ8_0), 34);
  EXPECT_EQ(BlockElements(TensorFormat::kQ4_K), 256);
  EXPECT_EQ(BlockBytes(TensorFormat::kQ4_K), 144);
  EXPECT_EQ(BlockElements(TensorFormat::kQ6_K), 256);
  EXPECT_EQ(BlockBytes(TensorFormat::kQ6_K), 210);
  EXPECT_EQ(RowBytes(TensorFormat::kQ4_K, 768), 3 * 144);
  EXPECT_EQ(RowBytes(TensorFormat::kF16, 768), 1536);
}

TEST(QuantFormatsTest, Q8_0KnownValues) {
  uint8_t block[34];
  PutF16(block, 0.5f);
  for (int i = 0; i < 32; ++i) block[2 + i] = static_cast<uint8_t>(i - 16);
  float out[32];
  DequantizeRow(TensorFormat::kQ8_0, block, 32, out);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(out[i], 0.5f * (i - 16)) << i;
}

TEST(QuantFormatsTest, Q4_KKnownValues) {
  // Sub-block j: scale j + 1 (j + 33 for j >= 4, to use the top bits) and
  // min 2j (2j + 40 for j >= 4); value l of sub-block j has q = (j + l) % 16.
  uint8_t block[144] = {};
  PutF16(block, 0.25f);
  PutF16(block + 2, 0.125f);
  int scale[8], min[8];
  for (int j = 0; j < 8; ++j) {
    scale[j] = j < 4 ? j + 1 : j + 33;
    min[j] = j < 4 ? 2 * j : 2 * j + 40;
  }
  uint8_t* s = block + 4;
  for (int j = 0; j < 4; ++j) {
    s[j] = static_cast<uint8_t>(scale[j] | ((scale[j + 4] >> 4) << 6));
    s[j + 4] = static_cast<uint8_t>(min[j] | ((min[j + 4] >> 4) << 6));
    s[j + 8] =
        static_cast<uint8_t>((scale[j + 4] & 0xF) | ((min[j + 4] & 0xF) << 4));
  }
  for (int c = 0; c < 4; ++c) {
    for (int l = 0; l < 32; ++l) {
      block[16 + 32 * c + l] = static_cast<uint8_t>(
          ((2 * c + l) % 16) | (((2 * c + 1 + l) % 16) << 4));
    }
  }
  float out[256];
  DequantizeRow(TensorFormat::kQ4_K, block, 256, out);
  for (int j = 0; j < 8; ++j) {
    for (int l = 0; l < 32; ++l) {
      const float expected =
          0.25f * scale[j] * ((j + l) % 16) - 0.125f * min[j];
      EXPECT_EQ(out[32 * j + l], expected) << j << " " << l;
    }
  }
}

TEST(QuantFormatsTest, Q6_KKnownValues) {
  // Value i: q = i % 64 (stored with the +32 offset, so x uses q - 32);
  // scale of 16-value group g: g - 8.
  uint8_t block[210] = {};
  uint8_t* ql = block;
  uint8_t* qh = block + 128;
  for (int i = 0; i < 256; ++i) {
    const int q = i % 64;
    const int h = i / 128, k = (i % 128) / 32, l = i % 32;
    ql[64 * h + l + 32 * (k & 1)] |=
        static_cast<uint8_t>(k < 2 ? (q & 0xF) : (q & 0xF) << 4);
    qh[32 * h + l] |= static_cast<uint8_t>((q >> 4) << (2 * k));
  }
  for (int g = 0; g < 16; ++g) block[192 + g] = static_cast<uint8_t>(g - 8);
  PutF16(block + 208, 0.5f);
  float out[256];
  DequantizeRow(TensorFormat::kQ6_K, block, 256, out);
  for (int i = 0; i < 256; ++i) {
    EXPECT_EQ(out[i], 0.5f * (i / 16 - 8) * (i % 64 - 32)) << i;
  }
}

// Random bytes for every field, with finite f16 scales.
std::vector<uint8_t> RandomBlocks(TensorFormat format, int blocks,
                                  std::mt19937& rng) {
  const int64_t bytes = BlockBytes(format);
  std::vector<uint8_t> data(blocks * bytes);
  for (uint8_t& b : data) b = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> scale(-2.0f, 2.0f);
  for (int b = 0; b < blocks; ++b) {
    uint8_t* block = data.data() + b * bytes;
    switch (format) {
      case TensorFormat::kQ8_0:
        PutF16(block, scale(rng));
        break;
      case TensorFormat::kQ4_K:
        PutF16(block, scale(rng));
        PutF16(block + 2, scale(rng));
        break;
      case TensorFormat::kQ6_K:
        PutF16(block + 208, scale(rng));
        break;
      default:
        break;
    }
  }
  return data;
}

class NumpyReferenceTest : public ::testing::TestWithParam<TensorFormat> {};

TEST_P(NumpyReferenceTest, DequantizationIsBitExact) {
  const TensorFormat format = GetParam();
  std::mt19937 rng(1234 + static_cast<int>(format));
  constexpr int kBlocks = 64;
  const std::vector<uint8_t> data = RandomBlocks(format, kBlocks, rng);
  const int64_t count = kBlocks * BlockElements(format);
  std::vector<float> ours(count);
  DequantizeRow(format, data.data(), count, ours.data());

  ScopedTempDir dir;
  testing::WriteBytes(dir.File("blocks.bin"),
                      std::string(data.begin(), data.end()));
  const std::string script =
      std::string(PDSERVE_SOURCE_DIR) + "/tests/model/ggml_blocks_ref.py";
  const pdserve::testing::CommandResult run = pdserve::testing::RunShell(
      "/usr/bin/python3 " + script + " " +
          std::string(TensorFormatName(format)) + " " + dir.File("blocks.bin") +
          " " + dir.File("values.f32"),
      dir.path());
  ASSERT_EQ(run.code, 0)
      << run.output << "\n(needs Debian's python3-numpy: scripts/setup.sh)";
  const std::string theirs = testing::ReadBytes(dir.File("values.f32"));
  ASSERT_EQ(theirs.size(), count * sizeof(float));
  int mismatches = 0;
  for (int64_t i = 0; i < count && mismatches < 10; ++i) {
    float value;
    std::memcpy(&value, theirs.data() + i * sizeof(float), sizeof(float));
    if (std::memcmp(&value, &ours[i], sizeof(float)) != 0) {
      ++mismatches;
      ADD_FAILURE() << TensorFormatName(format) << " value " << i << ": ours "
                    << ours[i] << ", numpy " << value;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, NumpyReferenceTest,
                         ::testing::Values(TensorFormat::kQ8_0,
                                           TensorFormat::kQ4_K,
                                           TensorFormat::kQ6_K),
                         [](const auto& info) {
                           return std::string(TensorFormatName(info.param));
                         });

// The reference quantizers: round trip within each format's step.
TEST(QuantFormatsTest, QuantizersRoundTripWithinTheirStep) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::vector<float> x(4 * 256);
  for (float& v : x) v = normal(rng);
  // Worst case per format, relative to the block's largest magnitude:
  // Q8_0 half a step of amax/127; Q4_K half a step of (max-min)/15 plus
  // the 6-bit scale/min rounding; Q6_K half a step of amax/31 plus the
  // 8-bit scale rounding.
  const std::pair<TensorFormat, float> cases[] = {
      {TensorFormat::kQ8_0, 0.5f / 127 + 1e-3f},
      {TensorFormat::kQ4_K, 2.0f / 15},
      {TensorFormat::kQ6_K, 1.5f / 31}};
  for (const auto& [format, bound] : cases) {
    std::vector<uint8_t> bytes(RowBytes(format, x.size()));
    QuantizeRow(format, x.data(), x.size(), bytes.data());
    std::vector<float> back(x.size());
    DequantizeRow(format, bytes.data(), x.size(), back.data());
    const int64_t block = BlockElements(format);
    double sum_sq = 0, err_sq = 0;
    for (size_t b = 0; b < x.size() / block; ++b) {
      float amax = 0;
      for (int64_t i = 0; i < block; ++i)
        amax = std::max(amax, std::fabs(x[b * block + i]));
      for (int64_t i = 0; i < block; ++i) {
        const float err = std::fabs(back[b * block + i] - x[b * block + i]);
        EXPECT_LE(err, bound * 2 * amax)
            << TensorFormatName(format) << " value " << b * block + i;
        sum_sq += double{x[b * block + i]} * x[b * block + i];
        err_sq += double{err} * err;
      }
    }
    // Signal to noise: what separates a working quantizer from a broken one.
    const double snr_db = 10 * std::log10(sum_sq / err_sq);
    EXPECT_GT(snr_db, format == TensorFormat::kQ4_K   ? 18
                      : format == TensorFormat::kQ6_K ? 28
                                                      : 38)
        << TensorFormatName(format);
  }
}

ModelConfig QuantTestConfig() {
  ModelConfig config;
  config.hidden_size = 256;
  config.intermediate_size = 512;
  config.num_layers = 2;
  config.num_heads = 4;
  config.num_kv_heads = 2;
  config.head_dim = 64;
  config.vocab_size = 320;
  config.max_position_embeddings = 64;
  config.rms_norm_eps = 1e-5f;
  config.rope_theta = 10000.0f;
  return config;
}

std::vector<float> Values(const std::string& name,
                          const std::vector<int64_t>& shape) {
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  std::mt19937 rng(static_cast<uint32_t>(std::hash<std::string>()(name)));
  std::normal_distribution<float> normal(shape.size() == 1 ? 1.0f : 0.0f,
                                         0.05f);
  std::vector<float> values(count);
  for (float& v : values) v = normal(rng);
  return values;
}

class QuantizedGgufTest : public ::testing::TestWithParam<TensorFormat> {};

TEST_P(QuantizedGgufTest, ReadF32IsTheDequantizedValuesInHfLayout) {
  const TensorFormat format = GetParam();
  const ModelConfig config = QuantTestConfig();
  ScopedTempDir dir;
  const std::string path = dir.File("model.gguf");
  auto format_of = [&](const std::string& name) {
    if (format == TensorFormat::kQ4_K) return Q4KMFormatOf(config, name);
    return name.find("norm") != std::string::npos ? TensorFormat::kF32 : format;
  };
  ASSERT_TRUE(WriteLlamaGguf(path, config, Values, format_of).ok());
  auto source = OpenModel(path);
  ASSERT_TRUE(source.ok()) << source.status();
  for (const ExpectedTensor& expected : LlamaTensorLayout(config)) {
    SCOPED_TRACE(expected.name);
    const TensorFormat stored_format = format_of(expected.name);
    auto info = (*source)->GetTensorInfo(expected.name);
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->format, stored_format);
    // What the reader must return: the writer's values through the format.
    const std::vector<float> values = Values(expected.name, expected.shape);
    const int64_t cols = expected.shape.back();
    const int64_t rows = static_cast<int64_t>(values.size()) / cols;
    std::vector<uint8_t> row_bytes(RowBytes(stored_format, cols));
    std::vector<float> want(values.size());
    for (int64_t r = 0; r < rows; ++r) {
      QuantizeRow(stored_format, values.data() + r * cols, cols,
                  row_bytes.data());
      DequantizeRow(stored_format, row_bytes.data(), cols,
                    want.data() + r * cols);
    }
    std::vector<float> got(values.size());
    ASSERT_TRUE((*source)->ReadF32(expected.name, {}, got.data()).ok());
    EXPECT_EQ(got, want);
    // A slice of block-aligned columns, as a TP rank reads it.
    if (rows > 1) {
      const int64_t block = BlockElements(stored_format);
      const int64_t col_begin = cols / 2 / block * block;
      std::vector<float> slice(2 * (cols - col_begin));
      ASSERT_TRUE(
          (*source)
              ->ReadF32(expected.name, {1, 3, col_begin, -1}, slice.data())
              .ok());
      for (int64_t r = 0; r < 2; ++r) {
        for (int64_t c = col_begin; c < cols; ++c) {
          ASSERT_EQ(slice[r * (cols - col_begin) + c - col_begin],
                    want[(r + 1) * cols + c]);
        }
      }
    }
    // In place: the stored rows inside the mapping.
    auto stored = (*source)->GetStoredTensor(expected.name);
    ASSERT_TRUE(stored.ok()) << stored.status();
    EXPECT_EQ(stored->format, stored_format);
    EXPECT_EQ(stored->rows, rows);
    EXPECT_EQ(stored->cols, cols);
    EXPECT_EQ(stored->row_bytes, RowBytes(stored_format, cols));
    EXPECT_NE(stored->owner, nullptr);
    const bool qk = expected.name.find("q_proj") != std::string::npos ||
                    expected.name.find("k_proj") != std::string::npos;
    EXPECT_EQ(stored->interleaved_rope_head_dim, qk ? config.head_dim : 0);
    // Stored row 1 is HF row 1, or HF row d/2 for a q/k projection (the
    // interleaved pairs 2j, 2j+1 hold HF rows j and d/2 + j).
    if (rows > 1) {
      std::vector<float> row1(cols);
      DequantizeRow(stored_format, stored->data + stored->row_bytes, cols,
                    row1.data());
      const int64_t hf_row = qk ? config.head_dim / 2 : 1;
      EXPECT_TRUE(
          std::equal(row1.begin(), row1.end(), want.begin() + hf_row * cols));
    }
  }
}

TEST_P(QuantizedGgufTest, StoredViewsOutliveTheSource) {
  const TensorFormat format = GetParam();
  const ModelConfig config = QuantTestConfig();
  ScopedTempDir dir;
  const std::string path = dir.File("model.gguf");
  ASSERT_TRUE(WriteLlamaGguf(path, config, Values, [&](const std::string& n) {
                return n.find("norm") != std::string::npos ? TensorFormat::kF32
                                                           : format;
              }).ok());
  StoredTensor stored;
  {
    auto source = OpenModel(path);
    ASSERT_TRUE(source.ok()) << source.status();
    auto view =
        (*source)->GetStoredTensor("model.layers.1.mlp.down_proj.weight");
    ASSERT_TRUE(view.ok());
    stored = *view;
  }
  std::vector<float> row(stored.cols);
  DequantizeRow(stored.format,
                stored.data + (stored.rows - 1) * stored.row_bytes, stored.cols,
                row.data());  // ASan would flag an unmapped read
  EXPECT_TRUE(std::isfinite(row.back()));
}

INSTANTIATE_TEST_SUITE_P(
    Formats, QuantizedGgufTest,
    ::testing::Values(TensorFormat::kF16, TensorFormat::kQ8_0,
                      TensorFormat::kQ4_K, TensorFormat::kQ6_K),
    [](const auto& info) { return std::string(TensorFormatName(info.param)); });

// A real vocabulary handed to the writer comes back as the file's tokenizer
// (a quantized model with a real tokenizer, as community GGUF files are);
// one of another size is refused.
TEST(GgufWriterTest, EmbedsTheGivenVocabulary) {
  const ModelConfig base = QuantTestConfig();
  TokenizerSpec vocabulary;
  vocabulary.ggml_model = "llama";
  const char* const kSpecial[] = {"<unk>", "<s>", "</s>"};
  for (int i = 0; i < base.vocab_size; ++i) {
    // "\u2581" is SentencePiece's word-start mark.
    vocabulary.tokens.push_back(i < 3 ? kSpecial[i]
                                      : "\xe2\x96\x81w" + std::to_string(i));
    vocabulary.scores.push_back(-0.5f * i);
    vocabulary.token_types.push_back(i == 0 ? 2 : i < 3 ? 3 : 1);
  }
  vocabulary.bos_token_id = 1;
  vocabulary.eos_token_id = 2;
  vocabulary.unk_token_id = 0;
  vocabulary.add_bos = false;
  ScopedTempDir dir;
  const std::string path = dir.File("model.gguf");
  auto q8 = [](const std::string& name) {
    return name.find("norm") != std::string::npos ? TensorFormat::kF32
                                                  : TensorFormat::kQ8_0;
  };
  ASSERT_TRUE(WriteLlamaGguf(path, base, Values, q8, &vocabulary).ok());
  auto source = OpenModel(path);
  ASSERT_TRUE(source.ok()) << source.status();
  auto spec = (*source)->tokenizer_spec();
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->ggml_model, "llama");
  EXPECT_EQ(spec->tokens, vocabulary.tokens);
  EXPECT_EQ(spec->scores, vocabulary.scores);
  EXPECT_EQ(spec->token_types, vocabulary.token_types);
  EXPECT_EQ(spec->bos_token_id, 1);
  EXPECT_EQ(spec->eos_token_id, 2);
  EXPECT_EQ(spec->unk_token_id, 0);
  EXPECT_FALSE(spec->add_bos);

  vocabulary.tokens.pop_back();
  const absl::Status short_vocabulary =
      WriteLlamaGguf(dir.File("short.gguf"), base, Values, q8, &vocabulary);
  EXPECT_EQ(short_vocabulary.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(short_vocabulary.message()),
              ::testing::HasSubstr("exactly vocab_size (320) tokens"));
}

}  // namespace
}  // namespace pdserve::model
