// Damaged and hostile model files: every one must give an error naming the
// file, never a crash or an out-of-bounds read (these also run under
// ASan/UBSan).
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <map>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/gguf_file.h"
#include "model/gguf_writer.h"
#include "model/model_config.h"
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

// Offsets to truncate at: all of [0, dense_end) and `spread` more spread
// evenly over [dense_end, size).
std::vector<size_t> TruncationPoints(size_t dense_end, size_t size,
                                     size_t spread) {
  std::vector<size_t> points;
  for (size_t offset = 0; offset < dense_end && offset < size; ++offset) {
    points.push_back(offset);
  }
  for (size_t i = 0; i < spread; ++i) {
    points.push_back(dense_end + (size - 1 - dense_end) * i / (spread - 1));
  }
  return points;
}

void ExpectOpenFails(const std::string& path, LoadFormat format,
                     const std::string& must_contain) {
  auto source = OpenModel(path, format);
  ASSERT_FALSE(source.ok()) << "opened " << path;
  EXPECT_THAT(source.status().message(), HasSubstr(must_contain));
}

TEST(TruncatedFileTest, GgufTruncatedAnywhereIsAnError) {
  const std::string original = testing::ReadBytes(kStoriesGguf);
  auto gguf = GgufFile::Open(kStoriesGguf);
  ASSERT_TRUE(gguf.ok()) << gguf.status();
  ScopedTempDir dir;
  const std::string path = dir.File("cut.gguf");
  // Written once, then cut shorter and shorter in place: one truncate()
  // per point instead of rewriting thousands of files.
  testing::WriteBytes(path, original);
  std::vector<size_t> points =
      TruncationPoints(gguf->data_offset(), original.size(), 50);
  int checked = 0;
  for (auto it = points.rbegin(); it != points.rend(); ++it) {
    const size_t length = *it;
    ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(length)), 0);
    auto source = OpenModel(path, LoadFormat::kAuto);
    ASSERT_FALSE(source.ok()) << "opened a file cut at " << length;
    ASSERT_THAT(source.status().message(), HasSubstr(path)) << length;
    ++checked;
  }
  EXPECT_GT(checked, 10000);
}

TEST(TruncatedFileTest, SafetensorsTruncatedAnywhereIsAnError) {
  const std::string original =
      testing::ReadBytes(kStoriesDir + "/model.safetensors");
  uint64_t header_length;
  std::memcpy(&header_length, original.data(), 8);
  ScopedTempDir dir;
  testing::WriteBytes(dir.File("config.json"),
                      testing::ReadBytes(kStoriesDir + "/config.json"));
  const std::string path = dir.File("model.safetensors");
  testing::WriteBytes(path, original);
  std::vector<size_t> points =
      TruncationPoints(8 + header_length, original.size(), 50);
  for (auto it = points.rbegin(); it != points.rend(); ++it) {
    const size_t length = *it;
    ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(length)), 0);
    auto source = OpenModel(dir.path(), LoadFormat::kAuto);
    ASSERT_FALSE(source.ok()) << "opened a file cut at " << length;
    ASSERT_THAT(source.status().message(), HasSubstr(path)) << length;
  }
}

class GgufHeaderTest : public ::testing::Test {
 protected:
  void SetUp() override { bytes_ = testing::ReadBytes(kStoriesGguf); }
  void ExpectFails(const std::string& must_contain) {
    const std::string path = dir_.File("bad.gguf");
    testing::WriteBytes(path, bytes_);
    auto source = OpenModel(path, LoadFormat::kGguf);
    ASSERT_FALSE(source.ok());
    EXPECT_THAT(source.status().message(), HasSubstr(path));
    EXPECT_THAT(source.status().message(), HasSubstr(must_contain));
  }

  ScopedTempDir dir_;
  std::string bytes_;
};

TEST_F(GgufHeaderTest, BadMagic) {
  bytes_[0] = 'X';
  ExpectFails("magic");
}

TEST_F(GgufHeaderTest, Version2) {
  testing::PutU32At(&bytes_, 4, 2);
  ExpectFails("version 2");
}

TEST_F(GgufHeaderTest, AbsurdTensorCount) {
  testing::PutU64At(&bytes_, 8, uint64_t{1} << 60);
  ExpectFails("tensor count");
}

TEST_F(GgufHeaderTest, AbsurdMetadataCount) {
  testing::PutU64At(&bytes_, 16, uint64_t{1} << 60);
  ExpectFails("metadata count");
}

TEST_F(GgufHeaderTest, KeyLengthPastEndOfFile) {
  testing::PutU64At(&bytes_, 24, bytes_.size());  // first key's length
  ExpectFails("past the end");
}

TEST_F(GgufHeaderTest, HugeKeyLength) {
  testing::PutU64At(&bytes_, 24, ~uint64_t{0});
  ExpectFails("past the end");
}

TEST_F(GgufHeaderTest, AbsurdArrayCount) {
  // The first key is tokenizer.ggml.tokens (21 bytes): after its length,
  // name, type (u32) and element type (u32) comes the element count.
  ASSERT_EQ(bytes_.substr(32, 21), "tokenizer.ggml.tokens");
  testing::PutU64At(&bytes_, 32 + 21 + 8, uint64_t{1} << 60);
  ExpectFails("elements");
}

TEST_F(GgufHeaderTest, StringElementLengthPastEndOfFile) {
  // First token string length follows the element count.
  testing::PutU64At(&bytes_, 32 + 21 + 16, uint64_t{1} << 40);
  ExpectFails("past the end");
}

TEST_F(GgufHeaderTest, UnknownValueType) {
  testing::PutU32At(&bytes_, 32 + 21, 99);
  ExpectFails("unknown type 99");
}

// Builds GGUFs of the tiny synthetic model with one thing wrong.
class GgufSyntheticTest : public ::testing::Test {
 protected:
  testing::GgufBuilder Tiny() {
    return testing::TinyGguf(testing::MakeTinyModel(DType::kF32));
  }
  absl::Status Open(const testing::GgufBuilder& builder) {
    path_ = dir_.File("tiny.gguf");
    testing::WriteBytes(path_, builder.Build());
    return OpenModel(path_, LoadFormat::kGguf).status();
  }
  void ExpectFails(const testing::GgufBuilder& builder,
                   const std::string& must_contain) {
    absl::Status status = Open(builder);
    ASSERT_FALSE(status.ok());
    EXPECT_THAT(status.message(), HasSubstr(path_));
    EXPECT_THAT(status.message(), HasSubstr(must_contain));
  }

  ScopedTempDir dir_;
  std::string path_;
};

TEST_F(GgufSyntheticTest, TheUnmodifiedTinyModelOpens) {
  EXPECT_TRUE(Open(Tiny()).ok());
}

// llama.attention.sliding_window is Mistral's window, over every layer.
TEST_F(GgufSyntheticTest, LlamaSlidingWindowWindowsEveryLayer) {
  testing::GgufBuilder builder = Tiny();
  builder.AddU32("llama.attention.sliding_window", 4);
  ASSERT_TRUE(Open(builder).ok());
  auto weights = OpenModel(path_, LoadFormat::kGguf);
  ASSERT_TRUE(weights.ok()) << weights.status();
  const ModelConfig& config = (*weights)->config();
  EXPECT_EQ(config.sliding_window, 4);
  for (int layer = 0; layer < config.num_layers; ++layer) {
    EXPECT_EQ(config.LayerWindow(layer), 4) << layer;
  }
  EXPECT_TRUE(config.EveryLayerWindowed());
}

TEST_F(GgufSyntheticTest, UnsupportedTensorTypeNamesTensorAndType) {
  testing::GgufBuilder builder = Tiny();
  builder.tensors()[3].ggml_type = 2;  // Q4_0
  ExpectFails(builder,
              builder.tensors()[3].name + " has unsupported type Q4_0");
}

TEST_F(GgufSyntheticTest, TensorOffsetPastEndOfFile) {
  testing::GgufBuilder builder = Tiny();
  builder.tensors()[2].offset_override = uint64_t{1} << 20;
  ExpectFails(builder, builder.tensors()[2].name);
}

TEST_F(GgufSyntheticTest, TensorOffsetNearUint64Max) {
  testing::GgufBuilder builder = Tiny();
  builder.tensors()[2].offset_override = ~uint64_t{0} - 31;
  ExpectFails(builder, "past the end of the data section");
}

TEST_F(GgufSyntheticTest, MisalignedTensorOffset) {
  testing::GgufBuilder builder = Tiny();
  builder.tensors()[1].offset_override = 4;
  ExpectFails(builder, "alignment");
}

TEST_F(GgufSyntheticTest, AbsurdShapeOverflows) {
  testing::GgufBuilder builder = Tiny();
  builder.tensors()[0].ne = {uint64_t{1} << 40, uint64_t{1} << 40};
  ExpectFails(builder, "absurd shape");
}

TEST_F(GgufSyntheticTest, TooManyDimensions) {
  testing::GgufBuilder builder = Tiny();
  builder.tensors()[0].ne = {1, 1, 1, 1, 8};
  ExpectFails(builder, "dimensions");
}

TEST_F(GgufSyntheticTest, ShapeMismatchAgainstMetadata) {
  testing::GgufBuilder builder = Tiny();
  for (auto& tensor : builder.tensors()) {
    if (tensor.name == "blk.1.ffn_up.weight") tensor.ne = {8, 6};
  }
  ExpectFails(builder, "model.layers.1.mlp.up_proj.weight has shape [6, 8]");
}

TEST_F(GgufSyntheticTest, MissingTensor) {
  testing::GgufBuilder builder = Tiny();
  auto& tensors = builder.tensors();
  for (auto it = tensors.begin(); it != tensors.end(); ++it) {
    if (it->name == "blk.0.attn_v.weight") {
      tensors.erase(it);
      break;
    }
  }
  ExpectFails(builder, "missing tensor model.layers.0.self_attn.v_proj.weight");
}

TEST_F(GgufSyntheticTest, MissingOutputMeansTiedEmbeddings) {
  testing::GgufBuilder builder = Tiny();
  auto& tensors = builder.tensors();
  for (auto it = tensors.begin(); it != tensors.end(); ++it) {
    if (it->name == "output.weight") {
      tensors.erase(it);
      break;
    }
  }
  path_ = dir_.File("tied.gguf");
  testing::WriteBytes(path_, builder.Build());
  auto source = OpenModel(path_, LoadFormat::kGguf);
  ASSERT_TRUE(source.ok()) << source.status();
  EXPECT_TRUE((*source)->config().tie_word_embeddings);
  EXPECT_FALSE((*source)->HasTensor("lm_head.weight"));
}

TEST_F(GgufSyntheticTest, EachRequiredMetadataKeyRemovedInTurn) {
  for (const char* key : {"general.architecture", "llama.context_length",
                          "llama.embedding_length", "llama.feed_forward_length",
                          "llama.block_count", "llama.attention.head_count",
                          "llama.attention.layer_norm_rms_epsilon"}) {
    SCOPED_TRACE(key);
    testing::GgufBuilder builder = Tiny();
    ASSERT_TRUE(builder.RemoveMetadata(key));
    ExpectFails(builder, key);
  }
}

TEST_F(GgufSyntheticTest, MetadataOfTheWrongType) {
  testing::GgufBuilder builder = Tiny();
  builder.RemoveMetadata("llama.block_count");
  builder.AddStr("llama.block_count", "two");
  ExpectFails(builder, "llama.block_count");
}

TEST_F(GgufSyntheticTest, DuplicateKey) {
  testing::GgufBuilder builder = Tiny();
  builder.AddU32("llama.block_count", 2);
  ExpectFails(builder, "duplicate metadata key llama.block_count");
}

TEST_F(GgufSyntheticTest, ArraysNestedTooDeep) {
  testing::GgufBuilder builder = Tiny();
  std::string payload;
  for (int depth = 0; depth < 100; ++depth) {
    testing::AppendU32(&payload, 9);  // array of ...
    testing::AppendU64(&payload, 1);  // one element
  }
  testing::AppendU32(&payload, 4);
  testing::AppendU64(&payload, 0);
  builder.AddRaw("deep", 9, payload.substr(0, payload.size()));
  ExpectFails(builder, "nests arrays");
}

TEST_F(GgufSyntheticTest, InvalidBool) {
  testing::GgufBuilder builder = Tiny();
  builder.AddRaw("flag", 7, std::string(1, '\x07'));
  ExpectFails(builder, "invalid bool");
}

TEST_F(GgufSyntheticTest, BadAlignment) {
  testing::GgufBuilder builder = Tiny();
  builder.AddU32("general.alignment", 24);
  ExpectFails(builder, "general.alignment");
}

TEST_F(GgufSyntheticTest, HeadCountNotDivisibleByKvHeads) {
  testing::GgufBuilder builder = Tiny();
  builder.RemoveMetadata("llama.attention.head_count_kv");
  builder.AddU32("llama.attention.head_count_kv", 3);
  ExpectFails(builder, "num_key_value_heads");
}

// The family metadata and tensors of GGUF files, refused by name.
TEST_F(GgufSyntheticTest, FamilyFeaturesTheReaderCannotMapAreRefused) {
  {
    testing::GgufBuilder builder = Tiny();
    builder.AddStr("llama.rope.scaling.type", "longrope");
    ExpectFails(builder,
                "llama.rope.scaling.type \"longrope\" is not supported");
  }
  {
    testing::GgufBuilder builder = Tiny();
    builder.AddStr("llama.rope.scaling.type", "yarn");
    ExpectFails(builder, "llama.rope.scaling.factor");
  }
  {
    // Qwen's window covers the layers from max_window_layers on, which a
    // GGUF does not say.
    testing::GgufBuilder builder = Tiny();
    builder.RemoveMetadata("general.architecture");
    builder.AddStr("general.architecture", "qwen2");
    builder.RenameMetadataPrefix("llama.", "qwen2.");
    ASSERT_TRUE(Open(builder).ok()) << Open(builder);
    builder.AddU32("qwen2.attention.sliding_window", 4);
    ExpectFails(builder,
                "qwen2.attention.sliding_window is not supported for qwen2 "
                "GGUF files (which layers window, max_window_layers, is not "
                "recorded");
  }
  {
    testing::GgufBuilder builder = Tiny();
    builder.AddU32("llama.attention.sliding_window", 0);
    ExpectFails(builder, "llama.attention.sliding_window");
  }
  {
    testing::GgufBuilder builder = Tiny();
    builder.RemoveMetadata("general.architecture");
    builder.AddStr("general.architecture", "gemma2");
    ExpectFails(builder, "general.architecture \"gemma2\" is not supported");
  }
  {
    // Llama 3.x frequency factors must cover head_dim / 2 = 2 pairs.
    testing::GgufBuilder builder = Tiny();
    testing::GgufBuilder::Tensor factors;
    factors.name = "rope_freqs.weight";
    factors.ne = {3};
    factors.ggml_type = 0;  // F32
    factors.data = std::string(12, '\0');
    builder.AddTensor(factors);
    ExpectFails(builder,
                "rope_freqs.weight must be F32 of head_dim / 2 = 2 values");
  }
  {
    testing::GgufBuilder builder = Tiny();
    testing::GgufBuilder::Tensor bias;
    bias.name = "blk.0.attn_q.bias";
    bias.ne = {8};
    bias.ggml_type = 0;
    bias.data = std::string(32, '\0');
    builder.AddTensor(bias);
    ExpectFails(builder, "q/k/v biases in a \"llama\" GGUF are not supported");
  }
}

// rope_freqs.weight (how llama.cpp stores Llama 3.x RoPE) is read into the
// config and part of its identity.
TEST_F(GgufSyntheticTest, RopeFrequencyFactorsAreRead) {
  testing::GgufBuilder builder = Tiny();
  testing::GgufBuilder::Tensor factors;
  factors.name = "rope_freqs.weight";
  factors.ne = {2};
  factors.ggml_type = 0;
  const float values[2] = {1.0f, 8.0f};
  factors.data.assign(reinterpret_cast<const char*>(values), sizeof values);
  builder.AddTensor(factors);
  path_ = dir_.File("factors.gguf");
  testing::WriteBytes(path_, builder.Build());
  auto source = OpenModel(path_, LoadFormat::kGguf);
  ASSERT_TRUE(source.ok()) << source.status();
  const RopeScaling& rope = (*source)->config().rope_scaling;
  EXPECT_EQ(rope.type, RopeScalingType::kFreqFactors);
  EXPECT_EQ(rope.freq_factors, (std::vector<float>{1.0f, 8.0f}));
  EXPECT_THAT((*source)->config().Identity(),
              HasSubstr("rope=freq_factors(1,8)"));
}

// Safetensors folders with one thing wrong.
class SafetensorsBadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = testing::MakeTinyModel(DType::kF32);
    testing::WriteTinySafetensors(model_, dir_.path());
    weights_ = dir_.File("model.safetensors");
  }
  void ExpectFails(const std::string& must_contain,
                   const std::string& file_name) {
    auto source = OpenModel(dir_.path(), LoadFormat::kSafetensors);
    ASSERT_FALSE(source.ok());
    EXPECT_THAT(source.status().message(), HasSubstr(file_name));
    EXPECT_THAT(source.status().message(), HasSubstr(must_contain));
  }
  // A one-tensor safetensors file from a raw header.
  void WriteRaw(const std::string& header, const std::string& data) {
    testing::WriteBytes(weights_, testing::BuildSafetensorsRaw(header, data));
  }

  testing::TinyModel model_;
  ScopedTempDir dir_;
  std::string weights_;
};

TEST_F(SafetensorsBadTest, TheUnmodifiedTinyModelOpens) {
  auto source = OpenModel(dir_.path(), LoadFormat::kSafetensors);
  EXPECT_TRUE(source.ok()) << source.status();
}

TEST_F(SafetensorsBadTest, HeaderLengthPastEndOfFile) {
  std::string bytes = testing::ReadBytes(weights_);
  testing::PutU64At(&bytes, 0, bytes.size());
  testing::WriteBytes(weights_, bytes);
  ExpectFails("header length", weights_);
}

TEST_F(SafetensorsBadTest, HugeHeaderLength) {
  std::string bytes = testing::ReadBytes(weights_);
  testing::PutU64At(&bytes, 0, ~uint64_t{0});
  testing::WriteBytes(weights_, bytes);
  ExpectFails("header length", weights_);
}

TEST_F(SafetensorsBadTest, InvalidHeaderJson) {
  WriteRaw(R"({"a": {"dtype": "F32", "shape": [1], )", "xxxx");
  ExpectFails("invalid header JSON", weights_);
}

TEST_F(SafetensorsBadTest, HeaderNotAnObject) {
  WriteRaw("[1, 2, 3]", "");
  ExpectFails("not an object", weights_);
}

TEST_F(SafetensorsBadTest, DataOffsetsOutOfRange) {
  WriteRaw(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
           std::string(12, '\0'));
  ExpectFails("data_offsets [8, 16] out of range", weights_);
}

TEST_F(SafetensorsBadTest, DataOffsetsHuge) {
  WriteRaw(
      R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [18446744073709551615, 8]}})",
      std::string(12, '\0'));
  ExpectFails("data_offsets", weights_);
}

TEST_F(SafetensorsBadTest, NegativeOffsets) {
  WriteRaw(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}})",
           std::string(12, '\0'));
  ExpectFails("data_offsets", weights_);
}

TEST_F(SafetensorsBadTest, SizeDisagreesWithShape) {
  WriteRaw(R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})",
           std::string(12, '\0'));
  ExpectFails("need 12", weights_);
}

TEST_F(SafetensorsBadTest, ShapeOverflow) {
  WriteRaw(
      R"({"a": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})",
      "");
  ExpectFails("shape", weights_);
}

TEST_F(SafetensorsBadTest, UnsupportedDtype) {
  WriteRaw(R"({"a": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}})",
           std::string(8, '\0'));
  ExpectFails("unsupported dtype \"I64\"", weights_);
}

TEST_F(SafetensorsBadTest, MissingFields) {
  WriteRaw(R"({"a": {"shape": [1], "data_offsets": [0, 4]}})",
           std::string(4, '\0'));
  ExpectFails("dtype", weights_);
  WriteRaw(R"({"a": {"dtype": "F32", "data_offsets": [0, 4]}})",
           std::string(4, '\0'));
  ExpectFails("shape", weights_);
  WriteRaw(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})",
           std::string(4, '\0'));
  ExpectFails("data_offsets", weights_);
}

TEST_F(SafetensorsBadTest, ShapeMismatchAgainstConfig) {
  nlohmann::json config =
      nlohmann::json::parse(testing::ReadBytes(dir_.File("config.json")));
  config["intermediate_size"] = 10;
  testing::WriteBytes(dir_.File("config.json"), config.dump());
  ExpectFails("model.layers.0.mlp.gate_proj.weight has shape [12, 8]",
              weights_);
}

TEST_F(SafetensorsBadTest, MissingTensor) {
  model_.values.erase("model.layers.1.self_attn.o_proj.weight");
  testing::WriteTinySafetensors(model_, dir_.path());
  ExpectFails("missing tensor model.layers.1.self_attn.o_proj.weight",
              weights_);
}

TEST_F(SafetensorsBadTest, MissingLmHeadWhenNotTied) {
  model_.values.erase("lm_head.weight");
  testing::WriteTinySafetensors(model_, dir_.path());
  ExpectFails("missing tensor lm_head.weight", weights_);
}

TEST_F(SafetensorsBadTest, EachRequiredConfigKeyRemovedInTurn) {
  const std::string config_path = dir_.File("config.json");
  const std::string original = testing::ReadBytes(config_path);
  for (const char* key :
       {"hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "vocab_size", "rms_norm_eps",
        "max_position_embeddings"}) {
    SCOPED_TRACE(key);
    nlohmann::json config = nlohmann::json::parse(original);
    ASSERT_EQ(config.erase(key), 1u);
    testing::WriteBytes(config_path, config.dump());
    ExpectFails(std::string("\"") + key + "\" is missing", config_path);
  }
}

TEST_F(SafetensorsBadTest, ConfigValuesOfTheWrongKind) {
  const std::string config_path = dir_.File("config.json");
  const std::string original = testing::ReadBytes(config_path);
  const std::vector<std::pair<std::string, nlohmann::json>> cases = {
      {"hidden_size", "8"},         {"hidden_size", 8.5},
      {"hidden_size", -8},          {"num_hidden_layers", 1e30},
      {"rms_norm_eps", "small"},    {"torch_dtype", "int8"},
      {"model_type", "gpt2"},       {"tie_word_embeddings", 1},
      {"vocab_size", 4294967296ll}, {"head_dim", 3},
  };
  for (const auto& [key, value] : cases) {
    SCOPED_TRACE(key + "=" + value.dump());
    nlohmann::json config = nlohmann::json::parse(original);
    config[key] = value;
    testing::WriteBytes(config_path, config.dump());
    ExpectFails(key, config_path);
  }
}

// The family flags against the tensors: each missing or misshapen new
// tensor, and one the config does not announce, named precisely.
class FamilyTensorsBadTest : public SafetensorsBadTest {
 protected:
  // Rewrites config.json with `edit` applied and the tensors in model_.
  void Write(const std::function<void(nlohmann::json&)>& edit) {
    testing::WriteTinySafetensors(model_, dir_.path());
    nlohmann::json config =
        nlohmann::json::parse(testing::ReadBytes(dir_.File("config.json")));
    edit(config);
    testing::WriteBytes(dir_.File("config.json"), config.dump());
  }
  void AddTensor(const std::string& name, std::vector<int64_t> shape) {
    int64_t count = 1;
    for (int64_t d : shape) count *= d;
    model_.values[name] = std::vector<float>(count, 0.5f);
    model_.shapes[name] = std::move(shape);
  }
  void AddQwen2Biases(int64_t q_dim = 8, int64_t kv_dim = 4) {
    for (int layer = 0; layer < 2; ++layer) {
      const std::string p = "model.layers." + std::to_string(layer) + ".";
      AddTensor(p + "self_attn.q_proj.bias", {q_dim});
      AddTensor(p + "self_attn.k_proj.bias", {kv_dim});
      AddTensor(p + "self_attn.v_proj.bias", {kv_dim});
    }
  }
  static void Qwen2(nlohmann::json& c) { c["model_type"] = "qwen2"; }
  static void Qwen3(nlohmann::json& c) { c["model_type"] = "qwen3"; }
};

TEST_F(FamilyTensorsBadTest, Qwen2WithAllItsBiasesOpens) {
  AddQwen2Biases();
  Write(Qwen2);
  auto source = OpenModel(dir_.path(), LoadFormat::kSafetensors);
  EXPECT_TRUE(source.ok()) << source.status();
}

TEST_F(FamilyTensorsBadTest, Qwen2WithoutBiases) {
  Write(Qwen2);
  ExpectFails(
      "missing tensor model.layers.0.self_attn.q_proj.bias (expected shape "
      "[8])",
      dir_.path());
}

TEST_F(FamilyTensorsBadTest, WrongBiasShape) {
  AddQwen2Biases(/*q_dim=*/8, /*kv_dim=*/8);
  Write(Qwen2);
  ExpectFails(
      "tensor model.layers.0.self_attn.k_proj.bias has shape [8] but the "
      "config implies [4]",
      weights_);
}

TEST_F(FamilyTensorsBadTest, BiasTheConfigDoesNotAnnounce) {
  AddQwen2Biases();
  Write([](nlohmann::json&) {});  // llama, attention_bias absent
  ExpectFails("is not part of a llama model with this config (qkv_bias=0",
              weights_);
}

TEST_F(FamilyTensorsBadTest, Qwen3MissingQNorm) {
  for (int layer = 0; layer < 2; ++layer) {
    AddTensor(
        "model.layers." + std::to_string(layer) + ".self_attn.k_norm.weight",
        {4});
  }
  Write(Qwen3);
  ExpectFails(
      "missing tensor model.layers.0.self_attn.q_norm.weight (expected "
      "shape [4])",
      dir_.path());
}

TEST_F(FamilyTensorsBadTest, Qwen3NormOfHiddenSizeInsteadOfHeadDim) {
  for (int layer = 0; layer < 2; ++layer) {
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    AddTensor(p + "self_attn.q_norm.weight", {8});
    AddTensor(p + "self_attn.k_norm.weight", {4});
  }
  Write(Qwen3);
  ExpectFails(
      "self_attn.q_norm.weight has shape [8] but the config implies [4]",
      weights_);
}

// Keys whose values the engine does not implement, each named in the error.
TEST(FamilyConfigBadTest, UnsupportedValuesNameTheKey) {
  const nlohmann::json base = {
      {"model_type", "llama"},    {"hidden_size", 64},
      {"intermediate_size", 128}, {"num_hidden_layers", 2},
      {"num_attention_heads", 4}, {"num_key_value_heads", 2},
      {"vocab_size", 256},        {"max_position_embeddings", 2048},
      {"rms_norm_eps", 1e-6}};
  struct Case {
    nlohmann::json patch;  // merged into base
    std::string message;
  };
  const std::vector<Case> cases = {
      {{{"model_type", "gemma2"}},
       "config key \"model_type\" has unsupported value \"gemma2\" (llama, "
       "mistral, qwen2, qwen3, qwen3_moe, qwen2_moe or mixtral)"},
      {{{"model_type", "deepseek_v3"}}, "\"model_type\""},
      {{{"mlp_bias", true}}, "config key \"mlp_bias\" = true"},
      {{{"hidden_act", "gelu"}}, "config key \"hidden_act\""},
      {{{"partial_rotary_factor", 0.5}},
       "config key \"partial_rotary_factor\""},
      {{{"attention_bias", "yes"}},
       "config key \"attention_bias\" must be a boolean"},
      {{{"model_type", "qwen2"},
        {"use_sliding_window", true},
        {"sliding_window", 0}},
       "config key \"sliding_window\" must be positive with "
       "use_sliding_window"},
      {{{"model_type", "qwen2"},
        {"use_sliding_window", true},
        {"max_window_layers", -1}},
       "config key \"max_window_layers\" must not be negative"},
      {{{"model_type", "qwen3"}, {"layer_types", {"full_attention"}}},
       "config key \"layer_types\" lists 1 layers, not 2"},
      {{{"model_type", "qwen2"},
        {"layer_types", {"full_attention", "chunked_attention"}}},
       "config key \"layer_types\" must list \"full_attention\" or "
       "\"sliding_attention\""},
      {{{"model_type", "mistral"}, {"sliding_window", 0}},
       "config key \"sliding_window\" must be positive or null"},
      {{{"model_type", "mistral"}, {"sliding_window", 4.5}},
       "config key \"sliding_window\" must be an integer"},
      {{{"layer_types", {"full_attention", "sliding_attention"}}},
       "config key \"layer_types\""},
      {{{"rope_scaling", "linear"}},
       "config key \"rope_scaling\" must be an object or null"},
      {{{"rope_scaling", {{"factor", 2.0}}}},
       "config key \"rope_scaling.rope_type\" is missing"},
      {{{"rope_scaling", {{"type", "longrope"}, {"factor", 2.0}}}},
       "config key \"rope_scaling.rope_type\" has unsupported value "
       "\"longrope\""},
      {{{"rope_scaling", {{"type", "linear"}}}},
       "config key \"rope_scaling.factor\" is missing"},
      {{{"rope_scaling", {{"type", "linear"}, {"factor", "2"}}}},
       "config key \"rope_scaling.factor\" must be a finite number"},
      {{{"rope_scaling", {{"type", "linear"}, {"factor", -2.0}}}},
       "config key \"rope_scaling.factor\" must be positive"},
      {{{"rope_scaling",
         {{"type", "linear"}, {"factor", 2.0}, {"low_freq_factor", 1.0}}}},
       "config key \"rope_scaling.low_freq_factor\" is not supported with "
       "rope type \"linear\""},
      {{{"rope_scaling",
         {{"type", "linear"}, {"rope_type", "yarn"}, {"factor", 2.0}}}},
       "config key \"rope_scaling.rope_type\""},
      {{{"rope_scaling",
         {{"rope_type", "llama3"},
          {"factor", 8.0},
          {"low_freq_factor", 1.0},
          {"high_freq_factor", 4.0}}}},
       "config key \"rope_scaling.original_max_position_embeddings\" is "
       "missing"},
      {{{"rope_scaling",
         {{"rope_type", "llama3"},
          {"factor", 8.0},
          {"low_freq_factor", 4.0},
          {"high_freq_factor", 4.0},
          {"original_max_position_embeddings", 8192}}}},
       "\"rope_scaling.low_freq_factor\" (4) and "
       "\"rope_scaling.high_freq_factor\" (4) must satisfy 0 < low < high"},
      {{{"rope_scaling",
         {{"rope_type", "llama3"},
          {"factor", 8.0},
          {"low_freq_factor", 1.0},
          {"high_freq_factor", 4.0},
          {"original_max_position_embeddings", 8192.5}}}},
       "config key \"rope_scaling.original_max_position_embeddings\" must "
       "be a positive integer"},
      {{{"rope_scaling",
         {{"rope_type", "yarn"}, {"factor", 4.0}, {"attention_factor", -1}}}},
       "config key \"rope_scaling.attention_factor\" must be positive"},
      {{{"rope_scaling",
         {{"rope_type", "yarn"}, {"factor", 4.0}, {"truncate", 1}}}},
       "config key \"rope_scaling.truncate\" must be a boolean"},
      {{{"rope_scaling",
         {{"rope_type", "yarn"}, {"factor", 4.0}, {"beta_fast", -32}}}},
       "\"rope_scaling.beta_fast\" and \"rope_scaling.beta_slow\" must be "
       "positive"},
      {{{"rope_parameters", {{"rope_type", "dynamic"}}}},
       "config key \"rope_parameters.factor\" is missing"},
  };
  for (const Case& c : cases) {
    nlohmann::json config = base;
    config.merge_patch(c.patch);
    SCOPED_TRACE(config.dump());
    absl::StatusOr<ModelConfig> parsed =
        ParseHfConfigJson(config.dump(), "/m/config.json");
    ASSERT_FALSE(parsed.ok());
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(parsed.status().message(), HasSubstr("/m/config.json: "));
    EXPECT_THAT(parsed.status().message(), HasSubstr(c.message));
  }
}

TEST_F(SafetensorsBadTest, ConfigNotJson) {
  testing::WriteBytes(dir_.File("config.json"), "{\"hidden_size\": 8,");
  ExpectFails("invalid JSON", dir_.File("config.json"));
}

TEST_F(SafetensorsBadTest, MissingConfig) {
  std::filesystem::remove(dir_.File("config.json"));
  ExpectFails("config.json", dir_.File("config.json"));
}

TEST_F(SafetensorsBadTest, MissingTokenizerModel) {
  auto source = OpenModel(dir_.path(), LoadFormat::kSafetensors);
  ASSERT_TRUE(source.ok()) << source.status();
  auto spec = (*source)->tokenizer_spec();
  EXPECT_FALSE(spec.ok());
  EXPECT_THAT(spec.status().message(), HasSubstr("tokenizer.model"));
}

TEST_F(SafetensorsBadTest, IndexPointingOutsideTheFolder) {
  const std::string index = dir_.File("model.safetensors.index.json");
  testing::WriteBytes(
      index,
      R"({"weight_map": {"model.norm.weight": "../model.safetensors"}})");
  ExpectFails("must be a file name", index);
  testing::WriteBytes(index, R"({"weight_map": 3})");
  ExpectFails("weight_map", index);
  testing::WriteBytes(index, R"({"weight_map": {)");
  ExpectFails("invalid JSON", index);
}

TEST_F(SafetensorsBadTest, IndexNamesATensorTheShardLacks) {
  const std::string index = dir_.File("model.safetensors.index.json");
  testing::WriteBytes(
      index, R"({"weight_map": {"model.norm.weight": "model.safetensors",
                                "ghost.weight": "model.safetensors"}})");
  ExpectFails("ghost.weight", index);
}

TEST(AutoFormatTest, UnrecognizedInputs) {
  ScopedTempDir dir;
  ExpectOpenFails(dir.File("nothing"), LoadFormat::kAuto, dir.File("nothing"));
  ExpectOpenFails(dir.path(), LoadFormat::kAuto, dir.path());
  testing::WriteBytes(dir.File("weights.bin"), "hello");
  ExpectOpenFails(dir.File("weights.bin"), LoadFormat::kAuto,
                  dir.File("weights.bin"));
  ExpectOpenFails(dir.path(), LoadFormat::kGguf, dir.path());
}

TEST(DummyBadInputTest, MissingOrBrokenConfig) {
  ScopedTempDir dir;
  ExpectOpenFails(dir.path(), LoadFormat::kDummy, "config.json");
  testing::WriteBytes(dir.File("config.json"), R"({"hidden_size": 64})");
  ExpectOpenFails(dir.File("config.json"), LoadFormat::kDummy,
                  "intermediate_size");
}

// Quantized tensors: the block geometry is checked against the bytes.
class QuantizedGgufBadTest : public ::testing::Test {
 protected:
  // Two tensors back to back: `first` ([rows, cols] of ggml type `type`,
  // `data_bytes` long) and a 4 KiB F32 tensor after it.
  std::string Write(uint32_t type, uint64_t cols, uint64_t rows,
                    size_t data_bytes) {
    testing::GgufBuilder builder;
    builder.AddStr("general.architecture", "llama");
    builder.AddTensor({"blk.0.attn_q.weight",
                       {cols, rows},
                       type,
                       std::string(data_bytes, '\x11'),
                       std::nullopt});
    builder.AddTensor({"blk.0.attn_norm.weight",
                       {1024},
                       0,
                       std::string(4096, '\0'),
                       std::nullopt});
    const std::string path = dir_.File("q.gguf");
    testing::WriteBytes(path, builder.Build());
    return path;
  }
  void ExpectFails(const std::string& path, const std::string& a,
                   const std::string& b) {
    auto gguf = GgufFile::Open(path);
    ASSERT_FALSE(gguf.ok());
    EXPECT_EQ(gguf.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(gguf.status().message(), HasSubstr(path));
    EXPECT_THAT(gguf.status().message(), HasSubstr(a));
    EXPECT_THAT(gguf.status().message(), HasSubstr(b));
  }
  ScopedTempDir dir_;
};

TEST_F(QuantizedGgufBadTest, WellSizedTensorsOpen) {
  EXPECT_TRUE(GgufFile::Open(Write(kGgmlTypeQ8_0, 64, 3, 3 * 2 * 34)).ok());
  EXPECT_TRUE(GgufFile::Open(Write(kGgmlTypeQ4_K, 256, 2, 2 * 144)).ok());
  EXPECT_TRUE(GgufFile::Open(Write(kGgmlTypeQ6_K, 512, 1, 2 * 210)).ok());
}

TEST_F(QuantizedGgufBadTest, RowsThatAreNotWholeBlocks) {
  ExpectFails(Write(kGgmlTypeQ4_K, 100, 2, 288), "blk.0.attn_q.weight",
              "of type Q4_K has rows of 100 values, not a multiple of its "
              "256-value blocks");
  ExpectFails(Write(kGgmlTypeQ8_0, 48, 2, 136), "blk.0.attn_q.weight",
              "of type Q8_0 has rows of 48 values");
  ExpectFails(Write(kGgmlTypeQ6_K, 128, 1, 210), "blk.0.attn_q.weight",
              "of type Q6_K has rows of 128 values");
}

TEST_F(QuantizedGgufBadTest, TensorShorterThanItsShapeRunsIntoTheNext) {
  // Declared 4 rows of 2 Q8_0 blocks (272 bytes) but 2 rows written: the
  // declared range covers the next tensor.
  ExpectFails(Write(kGgmlTypeQ8_0, 64, 4, 136),
              "tensor blk.0.attn_q.weight (Q8_0, 8 blocks of 34 bytes = 272 "
              "bytes)",
              "runs into tensor blk.0.attn_norm.weight");
  ExpectFails(Write(kGgmlTypeQ4_K, 512, 2, 144),
              "tensor blk.0.attn_q.weight (Q4_K, 4 blocks of 144 bytes",
              "runs into tensor blk.0.attn_norm.weight");
}

TEST_F(QuantizedGgufBadTest, TruncatedQuantizedModel) {
  ModelConfig config;
  config.hidden_size = 256;
  config.intermediate_size = 256;
  config.num_layers = 1;
  config.num_heads = 4;
  config.num_kv_heads = 4;
  config.head_dim = 64;
  config.vocab_size = 300;
  config.max_position_embeddings = 32;
  const std::string path = dir_.File("model.gguf");
  ASSERT_TRUE(
      WriteLlamaGguf(
          path, config,
          [](const std::string&, const std::vector<int64_t>& shape) {
            int64_t n = 1;
            for (int64_t d : shape) n *= d;
            return std::vector<float>(n, 0.5f);
          },
          [&](const std::string& name) { return Q4KMFormatOf(config, name); })
          .ok());
  ASSERT_TRUE(OpenModel(path).ok());
  const std::string bytes = testing::ReadBytes(path);
  // The last tensor is the Q6_K output head: cut anywhere inside it.
  for (size_t cut : {size_t{1}, size_t{209}, size_t{210}, size_t{5000}}) {
    const std::string truncated = dir_.File("cut.gguf");
    testing::WriteBytes(truncated, bytes.substr(0, bytes.size() - cut));
    auto source = OpenModel(truncated);
    ASSERT_FALSE(source.ok()) << cut;
    EXPECT_EQ(source.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(source.status().message(),
                HasSubstr("tensor output.weight (Q6_K, 300 blocks of 210 "
                          "bytes = 63000 bytes)"));
    EXPECT_THAT(source.status().message(), HasSubstr("file truncated?"));
  }
}

// Mixture-of-experts folders with one thing wrong: each a load error naming
// the tensor or the config key, never a model that silently runs with
// fewer experts.
class MoeBadTest : public ::testing::Test {
 protected:
  static nlohmann::json Config(const std::string& model_type) {
    nlohmann::json c = {
        {"model_type", model_type}, {"hidden_size", 16},
        {"intermediate_size", 24},  {"num_hidden_layers", 2},
        {"num_attention_heads", 2}, {"num_key_value_heads", 1},
        {"vocab_size", 32},         {"max_position_embeddings", 64},
        {"rms_norm_eps", 1e-6},     {"hidden_act", "silu"},
        {"num_experts_per_tok", 2}};
    if (model_type == "mixtral") {
      c["num_local_experts"] = 4;
    } else {
      c["num_experts"] = 4;
      c["moe_intermediate_size"] = 8;
      if (model_type == "qwen2_moe") c["shared_expert_intermediate_size"] = 8;
    }
    return c;
  }
  // Writes `config` and every tensor its layout lists (zeros), edited by
  // `edit` (name -> shape; an empty shape drops the tensor).
  void Write(
      const nlohmann::json& config,
      const std::function<void(std::map<std::string, std::vector<int64_t>>&)>&
          edit = nullptr) {
    testing::WriteBytes(dir_.File("config.json"), config.dump());
    auto parsed = ParseHfConfigJson(config.dump(), "config.json");
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    std::map<std::string, std::vector<int64_t>> shapes;
    for (const ExpectedTensor& t : LlamaTensorLayout(*parsed)) {
      shapes[t.name] = t.shape;
    }
    if (edit) edit(shapes);
    std::vector<testing::SafetensorsEntry> entries;
    for (const auto& [name, shape] : shapes) {
      if (shape.empty()) continue;
      int64_t count = 1;
      for (int64_t d : shape) count *= d;
      entries.push_back({name, "F32", shape,
                         std::string(static_cast<size_t>(count) * 4, '\0')});
    }
    testing::WriteBytes(dir_.File("model.safetensors"),
                        testing::BuildSafetensors(entries));
  }
  void ExpectFails(const std::string& must_contain) {
    auto source = OpenModel(dir_.path(), LoadFormat::kSafetensors);
    ASSERT_FALSE(source.ok());
    EXPECT_THAT(source.status().message(), HasSubstr(must_contain));
  }
  ScopedTempDir dir_;
};

TEST_F(MoeBadTest, EachFamilyOpensUnmodified) {
  for (const char* family : {"qwen3_moe", "qwen2_moe", "mixtral"}) {
    SCOPED_TRACE(family);
    Write(Config(family));
    auto source = OpenModel(dir_.path(), LoadFormat::kSafetensors);
    ASSERT_TRUE(source.ok()) << source.status();
    EXPECT_EQ((*source)->config().num_experts, 4);
  }
}

TEST_F(MoeBadTest, AMissingExpertTensorIsNamed) {
  Write(Config("qwen3_moe"), [](auto& shapes) {
    shapes["model.layers.1.mlp.experts.3.down_proj.weight"] = {};
  });
  ExpectFails("missing tensor model.layers.1.mlp.experts.3.down_proj.weight");
  Write(Config("mixtral"), [](auto& shapes) {
    shapes["model.layers.0.block_sparse_moe.experts.2.w3.weight"] = {};
  });
  ExpectFails("missing tensor model.layers.0.block_sparse_moe.experts.2.w3");
}

TEST_F(MoeBadTest, ARouterOfAnotherExpertCountIsNamed) {
  Write(Config("qwen3_moe"), [](auto& shapes) {
    shapes["model.layers.0.mlp.gate.weight"] = {5, 16};
  });
  ExpectFails("model.layers.0.mlp.gate.weight has shape [5, 16]");
}

TEST_F(MoeBadTest, AnExpertBeyondTheConfigIsRefused) {
  // A file with 5 experts under a config of 4 would run without one.
  Write(Config("qwen3_moe"), [](auto& shapes) {
    shapes["model.layers.0.mlp.experts.4.up_proj.weight"] = {8, 16};
  });
  ExpectFails("tensor model.layers.0.mlp.experts.4.up_proj.weight is not part");
  Write(Config("mixtral"), [](auto& shapes) {
    shapes["model.layers.0.block_sparse_moe.experts.4.w1.weight"] = {24, 16};
  });
  ExpectFails("experts.4.w1.weight is not part");
}

TEST_F(MoeBadTest, ASharedExpertWithoutItsGateIsNamed) {
  Write(Config("qwen2_moe"), [](auto& shapes) {
    shapes["model.layers.1.mlp.shared_expert_gate.weight"] = {};
  });
  ExpectFails("missing tensor model.layers.1.mlp.shared_expert_gate.weight");
}

TEST_F(MoeBadTest, BadExpertKeysAreNamed) {
  const std::vector<
      std::pair<std::function<void(nlohmann::json&)>, std::string>>
      cases = {
          {[](auto& c) { c["num_experts_per_tok"] = 5; },
           "\"num_experts_per_tok\" (5) must be between 1 and the number "
           "of experts (4)"},
          {[](auto& c) { c["num_experts_per_tok"] = 0; },
           "\"num_experts_per_tok\" (0)"},
          {[](auto& c) { c["num_experts"] = -1; }, "\"num_experts\""},
          {[](auto& c) { c["moe_intermediate_size"] = 0; },
           "\"moe_intermediate_size\" must be positive"},
          {[](auto& c) { c["decoder_sparse_step"] = 0; },
           "\"decoder_sparse_step\" must be positive"},
          {[](auto& c) {
             c["mlp_only_layers"] = {0, 2};
           },
           "\"mlp_only_layers\" must list layer indices below"},
          {[](auto& c) { c["mlp_only_layers"] = "0"; },
           "\"mlp_only_layers\" must be a list"},
          {[](auto& c) { c["use_sliding_window"] = true; },
           "\"use_sliding_window\" = true is not supported for qwen3_moe"},
          {[](auto& c) { c["num_experts"] = "many"; },
           "\"num_experts\" must be an integer"},
      };
  for (const auto& [edit, message] : cases) {
    nlohmann::json config = Config("qwen3_moe");
    edit(config);
    SCOPED_TRACE(config.dump());
    auto parsed = ParseHfConfigJson(config.dump(), "config.json");
    ASSERT_FALSE(parsed.ok());
    EXPECT_THAT(parsed.status().message(), HasSubstr(message));
  }
  nlohmann::json shared = Config("qwen2_moe");
  shared["shared_expert_intermediate_size"] = 0;
  EXPECT_THAT(
      ParseHfConfigJson(shared.dump(), "config.json").status().message(),
      HasSubstr("\"shared_expert_intermediate_size\" must be positive"));
  nlohmann::json mixtral = Config("mixtral");
  mixtral["num_local_experts"] = 0;
  EXPECT_THAT(
      ParseHfConfigJson(mixtral.dump(), "config.json").status().message(),
      HasSubstr("\"num_local_experts\" must be positive"));
}

}  // namespace
}  // namespace pdserve::model
