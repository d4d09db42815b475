// Loading real and synthetic models: configs, tensor equality between the
// GGUF and safetensors layouts (which proves the RoPE row permutation),
// slices, dtype conversion, tokenizer specs and dummy weights.
#include <cmath>
#include <filesystem>

#include "common/float16.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/gguf_file.h"
#include "model/safetensors_file.h"
#include "model/tensor_layout.h"
#include "model/weight_source.h"
#include "model_test_util.h"
#include "nlohmann/json.hpp"

namespace pdserve::model {
namespace {

using ::pdserve::model::testing::kModelsDir;
using ::pdserve::model::testing::kStoriesDir;
using ::pdserve::model::testing::kStoriesGguf;
using ::pdserve::model::testing::ScopedTempDir;
using ::testing::HasSubstr;

std::unique_ptr<WeightSource> OpenOrDie(const std::string& path,
                                        LoadFormat format) {
  auto source = OpenModel(path, format);
  EXPECT_TRUE(source.ok()) << source.status();
  return source.ok() ? std::move(*source) : nullptr;
}

std::vector<float> ReadAll(const WeightSource& source, const std::string& name,
                           const Slice2D& slice = {}) {
  auto info = source.GetTensorInfo(name);
  EXPECT_TRUE(info.ok()) << info.status();
  if (!info.ok()) return {};
  int64_t rows = 1;
  for (size_t d = 0; d + 1 < info->shape.size(); ++d) rows *= info->shape[d];
  int64_t cols = info->shape.back();
  int64_t row_end = slice.row_end == -1 ? rows : slice.row_end;
  int64_t col_end = slice.col_end == -1 ? cols : slice.col_end;
  std::vector<float> out((row_end - slice.row_begin) *
                         (col_end - slice.col_begin));
  absl::Status status = source.ReadF32(name, slice, out.data());
  EXPECT_TRUE(status.ok()) << status;
  return out;
}

void ExpectStoriesConfig(const ModelConfig& config) {
  EXPECT_EQ(config.architecture, "llama");
  EXPECT_EQ(config.hidden_size, 64);
  EXPECT_EQ(config.num_layers, 5);
  EXPECT_EQ(config.num_heads, 8);
  EXPECT_EQ(config.num_kv_heads, 4);
  EXPECT_EQ(config.head_dim, 8);
  EXPECT_EQ(config.intermediate_size, 172);
  EXPECT_EQ(config.vocab_size, 512);
  EXPECT_FLOAT_EQ(config.rms_norm_eps, 1e-5f);
  EXPECT_FLOAT_EQ(config.rope_theta, 10000.0f);
  EXPECT_EQ(config.bos_token_id, 1);
  EXPECT_EQ(config.eos_token_id, 2);
  EXPECT_FALSE(config.tie_word_embeddings);
  EXPECT_EQ(config.dtype, DType::kF32);
}

TEST(ModelConfigTest, ParsesStoriesConfig) {
  std::string text = testing::ReadBytes(kStoriesDir + "/config.json");
  auto config = ParseHfConfigJson(text, "stories/config.json");
  ASSERT_TRUE(config.ok()) << config.status();
  ExpectStoriesConfig(*config);
  EXPECT_EQ(config->max_position_embeddings, 512);
  EXPECT_EQ(config->q_dim(), 64);
  EXPECT_EQ(config->kv_dim(), 32);
}

TEST(ModelConfigTest, DefaultsFollowTransformers) {
  auto config = ParseHfConfigJson(
      R"({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "vocab_size": 100, "rms_norm_eps": 1e-6,
          "max_position_embeddings": 256, "torch_dtype": "bfloat16",
          "eos_token_id": [7, 8]})",
      "x.json");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->num_kv_heads, 4);
  EXPECT_EQ(config->head_dim, 16);
  EXPECT_FLOAT_EQ(config->rope_theta, 10000.0f);
  EXPECT_EQ(config->dtype, DType::kBF16);
  EXPECT_EQ(config->eos_token_id, 7);
  EXPECT_FALSE(config->tie_word_embeddings);
}

// Chat models end a turn on any of several tokens (Llama 3: <|end_of_text|>,
// <|eom_id|>, <|eot_id|>), listed in config.json and generation_config.json.
TEST(ModelConfigTest, EveryListedEosTokenEndsASequence) {
  auto config = ParseHfConfigJson(
      R"({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "vocab_size": 100, "rms_norm_eps": 1e-6,
          "max_position_embeddings": 256, "eos_token_id": [7, 8]})",
      "x.json");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->IsEos(7));
  EXPECT_TRUE(config->IsEos(8));
  EXPECT_FALSE(config->IsEos(9));
  ASSERT_TRUE(MergeGenerationConfigJson(
                  R"({"eos_token_id": [8, 9], "do_sample": true})",
                  "generation_config.json", &*config)
                  .ok());
  EXPECT_EQ(config->eos_token_id, 7);
  EXPECT_TRUE(config->IsEos(9));
  EXPECT_FALSE(config->IsEos(10));
  const absl::Status outside = MergeGenerationConfigJson(
      R"({"eos_token_id": 100})", "generation_config.json", &*config);
  EXPECT_FALSE(outside.ok());
  EXPECT_NE(outside.message().find("generation_config.json"), std::string::npos)
      << outside;
  EXPECT_FALSE(MergeGenerationConfigJson(R"({"eos_token_id": "x"})",
                                         "generation_config.json", &*config)
                   .ok());
  EXPECT_FALSE(
      MergeGenerationConfigJson("[", "generation_config.json", &*config).ok());
}

TEST(ModelConfigTest, DTypeNamesAndSizes) {
  EXPECT_EQ(DTypeName(DType::kF32), "F32");
  EXPECT_EQ(DTypeName(DType::kF16), "F16");
  EXPECT_EQ(DTypeName(DType::kBF16), "BF16");
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
}

TEST(ModelConfigTest, ValidateRejectsInconsistentHeads) {
  ModelConfig config = testing::MakeTinyModel(DType::kF32).config;
  ASSERT_TRUE(config.Validate().ok());
  config.num_kv_heads = 3;
  EXPECT_THAT(config.Validate().message(), HasSubstr("num_key_value_heads"));
  config = testing::MakeTinyModel(DType::kF32).config;
  config.head_dim = 5;
  EXPECT_THAT(config.Validate().message(), HasSubstr("head_dim"));
}

TEST(ModelConfigTest, IdentityAgreesAcrossLayoutsAndDetectsChanges) {
  auto gguf = OpenOrDie(kStoriesGguf, LoadFormat::kGguf);
  auto hf = OpenOrDie(kStoriesDir, LoadFormat::kSafetensors);
  ASSERT_TRUE(gguf && hf);
  EXPECT_EQ(gguf->config().Identity(), hf->config().Identity());
  ModelConfig changed = hf->config();
  changed.num_kv_heads = 8;
  EXPECT_NE(changed.Identity(), hf->config().Identity());
}

TEST(LoadFormatTest, Parses) {
  EXPECT_EQ(*ParseLoadFormat("auto"), LoadFormat::kAuto);
  EXPECT_EQ(*ParseLoadFormat("gguf"), LoadFormat::kGguf);
  EXPECT_EQ(*ParseLoadFormat("safetensors"), LoadFormat::kSafetensors);
  EXPECT_EQ(*ParseLoadFormat("dummy"), LoadFormat::kDummy);
  EXPECT_FALSE(ParseLoadFormat("pickle").ok());
  EXPECT_EQ(LayerTensorName(3, "mlp.up_proj.weight"),
            "model.layers.3.mlp.up_proj.weight");
}

TEST(StoriesTest, BothLayoutsLoadWithTheSameConfig) {
  for (LoadFormat format : {LoadFormat::kGguf, LoadFormat::kAuto}) {
    auto gguf = OpenOrDie(kStoriesGguf, format);
    ASSERT_TRUE(gguf);
    ExpectStoriesConfig(gguf->config());
    EXPECT_EQ(gguf->description(), kStoriesGguf);
  }
  for (LoadFormat format : {LoadFormat::kSafetensors, LoadFormat::kAuto}) {
    auto hf = OpenOrDie(kStoriesDir, format);
    ASSERT_TRUE(hf);
    ExpectStoriesConfig(hf->config());
  }
}

TEST(StoriesTest, EveryCanonicalTensorIsEqualInBothLayouts) {
  auto gguf = OpenOrDie(kStoriesGguf, LoadFormat::kGguf);
  auto hf = OpenOrDie(kStoriesDir, LoadFormat::kSafetensors);
  ASSERT_TRUE(gguf && hf);
  std::vector<ExpectedTensor> layout = LlamaTensorLayout(hf->config());
  ASSERT_EQ(layout.size(), 1u + 9u * 5u + 2u);
  for (const ExpectedTensor& expected : layout) {
    SCOPED_TRACE(expected.name);
    auto gguf_info = gguf->GetTensorInfo(expected.name);
    auto hf_info = hf->GetTensorInfo(expected.name);
    ASSERT_TRUE(gguf_info.ok() && hf_info.ok());
    EXPECT_EQ(gguf_info->shape, expected.shape);
    EXPECT_EQ(hf_info->shape, expected.shape);
    EXPECT_EQ(gguf_info->dtype, DType::kF32);
    std::vector<float> from_gguf = ReadAll(*gguf, expected.name);
    std::vector<float> from_hf = ReadAll(*hf, expected.name);
    ASSERT_EQ(from_gguf.size(), from_hf.size());
    int mismatches = 0;
    for (size_t i = 0; i < from_hf.size(); ++i) {
      if (std::abs(from_gguf[i] - from_hf[i]) > 1e-6f) ++mismatches;
    }
    EXPECT_EQ(mismatches, 0);
  }
}

TEST(StoriesTest, SlicesEqualTheSubBlockOfTheFullRead) {
  auto gguf = OpenOrDie(kStoriesGguf, LoadFormat::kGguf);
  auto hf = OpenOrDie(kStoriesDir, LoadFormat::kSafetensors);
  ASSERT_TRUE(gguf && hf);
  const std::vector<std::pair<std::string, Slice2D>> cases = {
      {"model.layers.2.self_attn.q_proj.weight", {8, 24, 0, -1}},
      {"model.layers.2.self_attn.q_proj.weight", {3, 29, 5, 40}},
      {"model.layers.4.self_attn.k_proj.weight", {4, 12, 60, 64}},
      {"model.layers.0.mlp.down_proj.weight", {10, 20, 100, 172}},
      {"model.embed_tokens.weight", {500, -1, 0, 64}},
      {"lm_head.weight", {0, 1, 0, 1}},
      {"model.norm.weight", {0, 1, 10, 20}},
      {"model.layers.1.input_layernorm.weight", {0, -1, 63, -1}},
      {"model.layers.3.self_attn.v_proj.weight", {7, 7, 0, -1}},  // empty
  };
  for (const WeightSource* source : {gguf.get(), hf.get()}) {
    for (const auto& [name, slice] : cases) {
      SCOPED_TRACE(source->description() + " " + name);
      TensorInfo info = *source->GetTensorInfo(name);
      std::vector<float> full = ReadAll(*source, name);
      std::vector<float> part = ReadAll(*source, name, slice);
      const int64_t cols = info.shape.back();
      const int64_t row_end = slice.row_end == -1
                                  ? static_cast<int64_t>(full.size()) / cols
                                  : slice.row_end;
      const int64_t col_end = slice.col_end == -1 ? cols : slice.col_end;
      const int64_t part_cols = col_end - slice.col_begin;
      ASSERT_EQ(part.size(),
                static_cast<size_t>((row_end - slice.row_begin) * part_cols));
      for (int64_t r = slice.row_begin; r < row_end; ++r) {
        for (int64_t c = slice.col_begin; c < col_end; ++c) {
          ASSERT_EQ(
              part[(r - slice.row_begin) * part_cols + c - slice.col_begin],
              full[r * cols + c])
              << r << "," << c;
        }
      }
    }
  }
}

TEST(StoriesTest, ReadErrors) {
  auto gguf = OpenOrDie(kStoriesGguf, LoadFormat::kGguf);
  ASSERT_TRUE(gguf);
  float out[64 * 64];
  EXPECT_EQ(gguf->ReadF32("no.such.weight", {}, out).code(),
            absl::StatusCode::kNotFound);
  EXPECT_FALSE(gguf->HasTensor("no.such.weight"));
  EXPECT_EQ(gguf->GetTensorInfo("no.such.weight").status().code(),
            absl::StatusCode::kNotFound);
  const std::string q = "model.layers.0.self_attn.q_proj.weight";
  for (Slice2D bad :
       {Slice2D{0, 65, 0, -1}, Slice2D{-1, 2, 0, -1}, Slice2D{0, 1, 0, 65},
        Slice2D{5, 4, 0, -1}, Slice2D{0, 1, 10, 9}}) {
    absl::Status status = gguf->ReadF32(q, bad, out);
    EXPECT_EQ(status.code(), absl::StatusCode::kOutOfRange) << status;
    EXPECT_THAT(status.message(), HasSubstr(q));
  }
}

TEST(StoriesTest, GgufTokenizerSpecHasTheVocabulary) {
  auto gguf = OpenOrDie(kStoriesGguf, LoadFormat::kGguf);
  ASSERT_TRUE(gguf);
  auto spec = gguf->tokenizer_spec();
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_TRUE(spec->sentencepiece_model_path.empty());
  EXPECT_EQ(spec->ggml_model, "llama");
  ASSERT_EQ(spec->tokens.size(), 512u);
  EXPECT_EQ(spec->scores.size(), 512u);
  EXPECT_EQ(spec->token_types.size(), 512u);
  EXPECT_EQ(spec->tokens[0], "<unk>");
  EXPECT_EQ(spec->tokens[1], "<s>");
  EXPECT_EQ(spec->tokens[2], "</s>");
  EXPECT_EQ(spec->tokens[3], "<0x00>");
  EXPECT_EQ(spec->token_types[0], 2);
  EXPECT_EQ(spec->token_types[1], 3);
  EXPECT_EQ(spec->token_types[3], 6);
  EXPECT_EQ(spec->bos_token_id, 1);
  EXPECT_EQ(spec->eos_token_id, 2);
  EXPECT_EQ(spec->unk_token_id, 0);
  EXPECT_EQ(spec->pad_token_id, -1);  // stored as 0xFFFFFFFF
  EXPECT_TRUE(spec->add_bos);
  EXPECT_FALSE(spec->add_eos);
}

TEST(StoriesTest, SafetensorsTokenizerSpecPointsAtTokenizerModel) {
  auto hf = OpenOrDie(kStoriesDir, LoadFormat::kSafetensors);
  ASSERT_TRUE(hf);
  auto spec = hf->tokenizer_spec();
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->sentencepiece_model_path, kStoriesDir + "/tokenizer.model");
  EXPECT_TRUE(spec->tokens.empty());
  EXPECT_EQ(spec->bos_token_id, 1);
  EXPECT_EQ(spec->eos_token_id, 2);
}

TEST(GgufFileTest, ReadsStoriesMetadata) {
  auto gguf = GgufFile::Open(kStoriesGguf);
  ASSERT_TRUE(gguf.ok()) << gguf.status();
  EXPECT_EQ(gguf->version(), 3u);
  EXPECT_EQ(gguf->alignment(), 32u);
  EXPECT_EQ(gguf->data_offset() % 32, 0u);
  EXPECT_EQ(gguf->metadata().size(), 19u);
  EXPECT_EQ(gguf->tensors().size(), 48u);
  EXPECT_EQ(*gguf->GetInt("llama.block_count"), 5);
  EXPECT_EQ(*gguf->GetString("general.architecture"), "llama");
  EXPECT_NEAR(*gguf->GetFloat("llama.attention.layer_norm_rms_epsilon"), 1e-5,
              1e-9);
  EXPECT_EQ(gguf->GetStringArray("tokenizer.ggml.tokens")->size(), 512u);
  EXPECT_EQ(gguf->GetInt("no.such.key").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(gguf->GetString("llama.block_count").status().code(),
            absl::StatusCode::kInvalidArgument);
  const GgufTensorInfo* embd = gguf->FindTensor("token_embd.weight");
  ASSERT_NE(embd, nullptr);
  EXPECT_EQ(embd->ne, (std::vector<uint64_t>{64, 512}));
  EXPECT_EQ(embd->Shape(), (std::vector<int64_t>{512, 64}));
  EXPECT_EQ(gguf->TensorData(*embd).size(), 512u * 64u * 4u);
  EXPECT_EQ(CanonicalNameFromGguf("blk.12.ffn_down.weight"),
            "model.layers.12.mlp.down_proj.weight");
  EXPECT_EQ(CanonicalNameFromGguf("output.weight"), "lm_head.weight");
  EXPECT_EQ(CanonicalNameFromGguf("rope_freqs.weight"), "rope_freqs.weight");
}

TEST(GgufFileTest, ReadsEveryValueTypeAndNestedArrays) {
  ScopedTempDir dir;
  testing::GgufBuilder builder;
  auto scalar = [](auto value) {
    return std::string(reinterpret_cast<const char*>(&value), sizeof(value));
  };
  builder.AddRaw("u8", 0, scalar(uint8_t{200}));
  builder.AddRaw("i8", 1, scalar(int8_t{-100}));
  builder.AddRaw("u16", 2, scalar(uint16_t{60000}));
  builder.AddRaw("i16", 3, scalar(int16_t{-30000}));
  builder.AddRaw("u32", 4, scalar(uint32_t{4000000000u}));
  builder.AddRaw("i32", 5, scalar(int32_t{-2000000000}));
  builder.AddRaw("f32", 6, scalar(1.5f));
  builder.AddRaw("bool", 7, scalar(uint8_t{1}));
  builder.AddStr("str", "hello");
  builder.AddRaw("u64", 10, scalar(uint64_t{1} << 40));
  builder.AddRaw("i64", 11, scalar(int64_t{-(int64_t{1} << 40)}));
  builder.AddRaw("f64", 12, scalar(2.25));
  // [[1, 2], [3]] as an array of arrays of int32.
  std::string nested;
  testing::AppendU32(&nested, 9);
  testing::AppendU64(&nested, 2);
  testing::AppendU32(&nested, 5);
  testing::AppendU64(&nested, 2);
  testing::AppendU32(&nested, 1);
  testing::AppendU32(&nested, 2);
  testing::AppendU32(&nested, 5);
  testing::AppendU64(&nested, 1);
  testing::AppendU32(&nested, 3);
  builder.AddRaw("nested", 9, nested);
  builder.AddStrArray("strs", {"a", "", "ccc"});
  builder.AddU32("general.alignment", 64);
  builder.alignment = 64;
  builder.AddTensor({"t", {3}, 0, std::string(12, '\0'), std::nullopt});
  builder.AddTensor({"u", {2, 2}, 1, std::string(8, '\0'), std::nullopt});
  const std::string path = dir.File("types.gguf");
  testing::WriteBytes(path, builder.Build());

  auto gguf = GgufFile::Open(path);
  ASSERT_TRUE(gguf.ok()) << gguf.status();
  EXPECT_EQ(*gguf->GetInt("u8"), 200);
  EXPECT_EQ(*gguf->GetInt("i8"), -100);
  EXPECT_EQ(*gguf->GetInt("u16"), 60000);
  EXPECT_EQ(*gguf->GetInt("i16"), -30000);
  EXPECT_EQ(*gguf->GetInt("u32"), 4000000000ll);
  EXPECT_EQ(*gguf->GetInt("i32"), -2000000000);
  EXPECT_EQ(*gguf->GetFloat("f32"), 1.5);
  EXPECT_EQ(*gguf->GetBool("bool"), true);
  EXPECT_EQ(*gguf->GetString("str"), "hello");
  EXPECT_EQ(*gguf->GetInt("u64"), int64_t{1} << 40);
  EXPECT_EQ(*gguf->GetInt("i64"), -(int64_t{1} << 40));
  EXPECT_EQ(*gguf->GetFloat("f64"), 2.25);
  EXPECT_EQ(*gguf->GetStringArray("strs"),
            (std::vector<std::string>{"a", "", "ccc"}));
  const GgufValue* value = gguf->FindMetadata("nested");
  ASSERT_NE(value, nullptr);
  EXPECT_EQ(value->array_type, GgufValueType::kArray);
  ASSERT_EQ(value->AsArray()->size(), 2u);
  const GgufValue& first = (*value->AsArray())[0];
  EXPECT_EQ(first.array_type, GgufValueType::kInt32);
  ASSERT_EQ(first.AsArray()->size(), 2u);
  EXPECT_EQ(*(*first.AsArray())[1].AsInt64(), 2);
  EXPECT_EQ(*(*(*value->AsArray())[1].AsArray())[0].AsInt64(), 3);
  EXPECT_EQ(gguf->alignment(), 64u);
  EXPECT_EQ(gguf->data_offset() % 64, 0u);
  EXPECT_EQ(gguf->FindTensor("u")->offset, 64u);
  EXPECT_EQ(gguf->FindTensor("u")->dtype(), DType::kF16);
}

TEST(GgufFileTest, CanListUnsupportedTypesForMetadataReaders) {
  ScopedTempDir dir;
  testing::GgufBuilder builder;
  builder.AddStr("general.architecture", "llama");
  builder.AddTensor({"q", {32}, 2, std::string(18, '\0'), std::nullopt});
  const std::string path = dir.File("q4.gguf");
  testing::WriteBytes(path, builder.Build());
  EXPECT_FALSE(GgufFile::Open(path).ok());
  GgufOpenOptions options;
  options.allow_unsupported_tensor_types = true;
  auto gguf = GgufFile::Open(path, options);
  ASSERT_TRUE(gguf.ok()) << gguf.status();
  EXPECT_FALSE(gguf->tensors()[0].supported);
  EXPECT_EQ(*gguf->GetString("general.architecture"), "llama");
}

class SyntheticDtypeTest : public ::testing::TestWithParam<DType> {};

TEST_P(SyntheticDtypeTest, BothFormatsConvertExactly) {
  const DType dtype = GetParam();
  testing::TinyModel model = testing::MakeTinyModel(dtype);
  ScopedTempDir dir;
  const std::string gguf_path = dir.File("tiny.gguf");
  testing::WriteBytes(gguf_path, testing::TinyGguf(model).Build());
  testing::WriteTinySafetensors(model, dir.path());

  auto gguf = OpenOrDie(gguf_path, LoadFormat::kAuto);
  auto hf = OpenOrDie(dir.path(), LoadFormat::kAuto);
  ASSERT_TRUE(gguf && hf);
  EXPECT_EQ(gguf->config().Identity(), model.config.Identity());
  EXPECT_EQ(hf->config().Identity(), model.config.Identity());
  EXPECT_EQ(gguf->config().dtype, dtype);
  EXPECT_EQ(hf->config().dtype, dtype);
  for (const auto& [name, expected] : model.values) {
    SCOPED_TRACE(name);
    for (const WeightSource* source : {gguf.get(), hf.get()}) {
      EXPECT_EQ(source->GetTensorInfo(name)->dtype, dtype);
      EXPECT_EQ(ReadAll(*source, name), expected) << source->description();
    }
  }
  // A column slice of an odd width exercises the vector loop's tail.
  const std::string up = "model.layers.1.mlp.up_proj.weight";
  std::vector<float> part = ReadAll(*gguf, up, {1, 11, 1, 8});
  const std::vector<float>& full = model.values.at(up);
  for (int r = 1; r < 11; ++r) {
    for (int c = 1; c < 8; ++c) {
      EXPECT_EQ(part[(r - 1) * 7 + c - 1], full[r * 8 + c]);
    }
  }
  auto spec = gguf->tokenizer_spec();
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->tokens.size(), 16u);
  EXPECT_EQ(spec->scores[3], -3.0f);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, SyntheticDtypeTest,
                         ::testing::Values(DType::kF32, DType::kF16,
                                           DType::kBF16),
                         [](const auto& info) {
                           return std::string(DTypeName(info.param));
                         });

TEST(ConversionTest, F16SpecialValuesAndLongRuns) {
  // Subnormals, infinities and both zeros, in runs longer than one vector.
  std::vector<uint16_t> bits = {0x0000, 0x8000, 0x0001, 0x03ff, 0x0400, 0x3c00,
                                0xbc00, 0x7bff, 0x7c00, 0xfc00, 0x3555, 0x1234,
                                0xc000, 0x0200, 0x5640, 0x8001, 0x4248};
  testing::TinyModel model = testing::MakeTinyModel(DType::kF16);
  ScopedTempDir dir;
  std::string data(reinterpret_cast<const char*>(bits.data()), bits.size() * 2);
  testing::WriteBytes(dir.File("config.json"),
                      testing::TinyConfigJson(model.config, DType::kF16));
  std::vector<testing::SafetensorsEntry> entries;
  for (const auto& [name, values] : model.values) {
    std::string encoded;
    for (float v : values) {
      uint16_t h = FloatToF16(v);
      encoded.append(reinterpret_cast<const char*>(&h), 2);
    }
    entries.push_back({name, "F16", model.shapes.at(name), encoded});
  }
  entries.push_back({"extra.special", "F16", {17}, data});
  testing::WriteBytes(dir.File("model.safetensors"),
                      testing::BuildSafetensors(entries));
  auto hf = OpenOrDie(dir.path(), LoadFormat::kSafetensors);
  ASSERT_TRUE(hf);
  std::vector<float> out = ReadAll(*hf, "extra.special");
  ASSERT_EQ(out.size(), bits.size());
  for (size_t i = 0; i < bits.size(); ++i) {
    float expected = F16ToFloat(bits[i]);
    EXPECT_EQ(std::memcmp(&out[i], &expected, 4), 0) << i;
  }
}

TEST(ShardedSafetensorsTest, IndexSpreadsTensorsOverShards) {
  testing::TinyModel model = testing::MakeTinyModel(DType::kBF16);
  ScopedTempDir dir;
  testing::WriteBytes(dir.File("config.json"),
                      testing::TinyConfigJson(model.config, DType::kBF16));
  std::vector<testing::SafetensorsEntry> shards[2];
  nlohmann::json weight_map = nlohmann::json::object();
  int i = 0;
  for (const auto& [name, values] : model.values) {
    std::string encoded;
    for (float v : values) {
      uint16_t b = FloatToBf16(v);
      encoded.append(reinterpret_cast<const char*>(&b), 2);
    }
    const int shard = i++ % 2;
    shards[shard].push_back({name, "BF16", model.shapes.at(name), encoded});
    weight_map[name] =
        "model-0000" + std::to_string(shard + 1) + "-of-00002.safetensors";
  }
  for (int shard = 0; shard < 2; ++shard) {
    testing::WriteBytes(dir.File("model-0000" + std::to_string(shard + 1) +
                                 "-of-00002.safetensors"),
                        testing::BuildSafetensors(shards[shard]));
  }
  testing::WriteBytes(dir.File("model.safetensors.index.json"),
                      nlohmann::json({{"metadata", {{"total_size", 0}}},
                                      {"weight_map", weight_map}})
                          .dump());
  auto hf = OpenOrDie(dir.path(), LoadFormat::kAuto);
  ASSERT_TRUE(hf);
  for (const auto& [name, expected] : model.values) {
    EXPECT_EQ(ReadAll(*hf, name), expected) << name;
  }
}

TEST(DummyTest, Llama110mIsDeterministicAndSliceable) {
  const std::string config_path = kModelsDir + "/bench-configs/llama-110m.json";
  auto first = OpenOrDie(config_path, LoadFormat::kDummy);
  auto second = OpenOrDie(config_path, LoadFormat::kDummy);
  ASSERT_TRUE(first && second);
  EXPECT_EQ(first->description(), "dummy:" + config_path);
  const ModelConfig& config = first->config();
  EXPECT_EQ(config.hidden_size, 768);
  EXPECT_EQ(config.num_layers, 12);
  EXPECT_EQ(config.num_kv_heads, 4);
  EXPECT_EQ(config.vocab_size, 32000);
  int64_t parameters = 0;
  for (const ExpectedTensor& expected : LlamaTensorLayout(config)) {
    ASSERT_TRUE(first->HasTensor(expected.name)) << expected.name;
    EXPECT_EQ(first->GetTensorInfo(expected.name)->shape, expected.shape);
    int64_t count = 1;
    for (int64_t dim : expected.shape) count *= dim;
    parameters += count;
  }
  EXPECT_GT(parameters, 100'000'000);
  EXPECT_LT(parameters, 130'000'000);  // untied: embed + lm_head

  const std::string q = LayerTensorName(3, "self_attn.q_proj.weight");
  std::vector<float> full = ReadAll(*first, q);
  EXPECT_EQ(full, ReadAll(*first, q));
  EXPECT_EQ(full, ReadAll(*second, q));
  const float bound = 1.0f / std::sqrt(768.0f);
  float max_abs = 0.0f;
  double sum = 0.0;
  for (float v : full) {
    max_abs = std::max(max_abs, std::abs(v));
    sum += v;
  }
  EXPECT_LE(max_abs, bound);
  EXPECT_GT(max_abs, 0.9f * bound);
  EXPECT_LT(std::abs(sum / full.size()), 0.01 * bound);  // roughly centered
  std::vector<float> part = ReadAll(*first, q, {100, 130, 700, 768});
  for (int r = 100; r < 130; ++r) {
    for (int c = 700; c < 768; ++c) {
      ASSERT_EQ(part[(r - 100) * 68 + c - 700], full[r * 768 + c]);
    }
  }
  // Different tensors differ.
  std::vector<float> k_part = ReadAll(
      *first, LayerTensorName(3, "self_attn.k_proj.weight"), {0, 1, 0, 8});
  EXPECT_NE(k_part, std::vector<float>(full.begin(), full.begin() + 8));
  std::vector<float> norm =
      ReadAll(*first, LayerTensorName(0, "input_layernorm.weight"));
  for (float v : norm) ASSERT_EQ(v, 1.0f);
  std::vector<float> embed =
      ReadAll(*first, "model.embed_tokens.weight", {31990, -1, 0, -1});
  for (float v : embed) ASSERT_LE(std::abs(v), 0.05f);

  auto spec = first->tokenizer_spec();
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kFailedPrecondition);
  float out[4];
  EXPECT_EQ(first->ReadF32(q, {0, 1, 0, 769}, out).code(),
            absl::StatusCode::kOutOfRange);
}

TEST(DummyTest, TiedBf16ConfigHasNoLmHeadAndBf16Values) {
  auto source = OpenOrDie(kModelsDir + "/bench-configs/llama-1b.json",
                          LoadFormat::kDummy);
  ASSERT_TRUE(source);
  EXPECT_TRUE(source->config().tie_word_embeddings);
  EXPECT_FALSE(source->HasTensor("lm_head.weight"));
  EXPECT_EQ(source->GetTensorInfo("model.embed_tokens.weight")->dtype,
            DType::kBF16);
  std::vector<float> part =
      ReadAll(*source, LayerTensorName(15, "mlp.down_proj.weight"),
              {2000, 2004, 8000, 8192});
  for (float v : part) ASSERT_EQ(Bf16ToFloat(FloatToBf16(v)), v);
}

TEST(DummyTest, AcceptsAFolderHoldingConfigJson) {
  auto source = OpenOrDie(kStoriesDir, LoadFormat::kDummy);
  ASSERT_TRUE(source);
  ExpectStoriesConfig(source->config());
}

}  // namespace
}  // namespace pdserve::model
