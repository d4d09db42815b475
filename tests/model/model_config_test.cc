// config.json of each supported family (Llama 2/3.x, Mistral, Qwen2.5,
// Qwen3) onto the one engine description: the flags, RoPE scaling and the
// defaults each transformers config class applies, and Identity() telling
// them apart.
#include "model/model_config.h"

#include <set>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/tensor_layout.h"
#include "nlohmann/json.hpp"

namespace pdserve::model {
namespace {

using Json = nlohmann::json;
using ::testing::HasSubstr;

// The keys every family's config.json has, small sizes.
Json Base(const std::string& model_type) {
  return {{"model_type", model_type}, {"hidden_size", 64},
          {"intermediate_size", 128}, {"num_hidden_layers", 2},
          {"num_attention_heads", 4}, {"num_key_value_heads", 2},
          {"vocab_size", 256},        {"max_position_embeddings", 2048},
          {"rms_norm_eps", 1e-6},     {"rope_theta", 500000.0},
          {"hidden_act", "silu"}};
}

ModelConfig ParseOrDie(const Json& json) {
  absl::StatusOr<ModelConfig> config =
      ParseHfConfigJson(json.dump(), "config.json");
  EXPECT_TRUE(config.ok()) << config.status();
  return config.ok() ? *config : ModelConfig();
}

TEST(FamilyConfigTest, Llama31RopeScalingAndEosList) {
  Json json = Base("llama");
  json["rope_scaling"] = {{"factor", 8.0},
                          {"low_freq_factor", 1.0},
                          {"high_freq_factor", 4.0},
                          {"original_max_position_embeddings", 8192},
                          {"rope_type", "llama3"}};
  json["max_position_embeddings"] = 131072;
  json["eos_token_id"] = {128, 129, 130};
  json["attention_bias"] = false;
  json["mlp_bias"] = false;
  json["pretraining_tp"] = 1;
  const ModelConfig c = ParseOrDie(json);
  EXPECT_EQ(c.architecture, "llama");
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::kLlama3);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 8.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_scaling.original_max_position, 8192);
  // Llama 3.1's config already names its long context.
  EXPECT_EQ(c.max_position_embeddings, 131072);
  EXPECT_FALSE(c.qkv_bias || c.o_bias || c.qk_norm);
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_TRUE(c.IsEos(128) && c.IsEos(129) && c.IsEos(130));
}

TEST(FamilyConfigTest, LlamaAttentionBiasMeansQkvAndOutputBias) {
  Json json = Base("llama");
  json["attention_bias"] = true;
  const ModelConfig c = ParseOrDie(json);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_TRUE(c.o_bias);
  std::vector<std::string> names;
  for (const ExpectedTensor& t : LlamaTensorLayout(c)) names.push_back(t.name);
  EXPECT_THAT(names,
              ::testing::Contains("model.layers.1.self_attn.o_proj.bias"));
}

TEST(FamilyConfigTest, Qwen25HasQkvBiasTiedEmbeddingsAndNoWindow) {
  Json json = Base("qwen2");
  json["tie_word_embeddings"] = true;
  json["sliding_window"] = 32768;  // written, but off without the flag
  json["use_sliding_window"] = false;
  json["max_window_layers"] = 21;
  json["rope_scaling"] = nullptr;
  const ModelConfig c = ParseOrDie(json);
  EXPECT_EQ(c.architecture, "qwen2");
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.sliding_window, 0);
  std::vector<std::pair<std::string, std::vector<int64_t>>> layer0;
  for (const ExpectedTensor& t : LlamaTensorLayout(c)) {
    if (t.name.starts_with("model.layers.0.self_attn.")) {
      layer0.emplace_back(t.name, t.shape);
    }
  }
  EXPECT_THAT(layer0,
              ::testing::ElementsAre(
                  std::pair<std::string, std::vector<int64_t>>(
                      "model.layers.0.self_attn.q_proj.weight", {64, 64}),
                  std::pair<std::string, std::vector<int64_t>>(
                      "model.layers.0.self_attn.k_proj.weight", {32, 64}),
                  std::pair<std::string, std::vector<int64_t>>(
                      "model.layers.0.self_attn.v_proj.weight", {32, 64}),
                  std::pair<std::string, std::vector<int64_t>>(
                      "model.layers.0.self_attn.q_proj.bias", {64}),
                  std::pair<std::string, std::vector<int64_t>>(
                      "model.layers.0.self_attn.k_proj.bias", {32}),
                  std::pair<std::string, std::vector<int64_t>>(
                      "model.layers.0.self_attn.v_proj.bias", {32}),
                  std::pair<std::string, std::vector<int64_t>>(
                      "model.layers.0.self_attn.o_proj.weight", {64, 64})));
}

// Qwen2's per-layer window as transformers' Qwen2Config derives it: only
// with use_sliding_window, in the layers from max_window_layers on, or in
// those layer_types names "sliding_attention".
TEST(FamilyConfigTest, QwenWindowsTheLayersFromMaxWindowLayersOn) {
  Json json = Base("qwen2");
  json["num_hidden_layers"] = 4;
  json["sliding_window"] = 8;
  json["max_window_layers"] = 2;
  json["use_sliding_window"] = false;  // Qwen2.5's shipped configs
  ModelConfig c = ParseOrDie(json);
  EXPECT_EQ(c.sliding_window, 0);
  for (int l = 0; l < 4; ++l) EXPECT_EQ(c.LayerWindow(l), 0);

  json["use_sliding_window"] = true;
  c = ParseOrDie(json);
  EXPECT_EQ(c.sliding_window, 8);
  EXPECT_EQ(c.windowed_layers, std::vector<bool>({false, false, true, true}));
  EXPECT_EQ(c.LayerWindow(1), 0);
  EXPECT_EQ(c.LayerWindow(2), 8);
  EXPECT_FALSE(c.EveryLayerWindowed());
  EXPECT_NE(c.Identity().find("window=8(layers=0011)"), std::string::npos)
      << c.Identity();

  json["max_window_layers"] = 0;  // every layer: the Mistral form
  c = ParseOrDie(json);
  EXPECT_TRUE(c.windowed_layers.empty());
  EXPECT_TRUE(c.EveryLayerWindowed());
  EXPECT_EQ(c.LayerWindow(0), 8);

  json["max_window_layers"] = 4;  // none
  c = ParseOrDie(json);
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_EQ(c.LayerWindow(3), 0);

  json.erase("max_window_layers");  // default 28: none of 4 layers
  EXPECT_EQ(ParseOrDie(json).sliding_window, 0);

  // layer_types, when listed, decide.
  json["layer_types"] = {"sliding_attention", "full_attention",
                         "sliding_attention", "full_attention"};
  c = ParseOrDie(json);
  EXPECT_EQ(c.windowed_layers, std::vector<bool>({true, false, true, false}));
  json["use_sliding_window"] = false;
  EXPECT_EQ(ParseOrDie(json).sliding_window, 0);
}

TEST(FamilyConfigTest, Qwen3HasQkNormAndItsOwnHeadDim) {
  Json json = Base("qwen3");
  json["head_dim"] = 32;  // 4 heads x 32 != hidden 64
  json["attention_bias"] = false;
  json["layer_types"] = {"full_attention", "full_attention"};
  const ModelConfig c = ParseOrDie(json);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_EQ(c.head_dim, 32);
  EXPECT_EQ(c.q_dim(), 128);
  bool has_norm = false;
  for (const ExpectedTensor& t : LlamaTensorLayout(c)) {
    if (t.name == "model.layers.1.self_attn.k_norm.weight") {
      has_norm = true;
      EXPECT_EQ(t.shape, std::vector<int64_t>{32});
    }
    if (t.name == "model.layers.0.self_attn.o_proj.weight") {
      EXPECT_EQ(t.shape, (std::vector<int64_t>{64, 128}));
    }
  }
  EXPECT_TRUE(has_norm);
  // Qwen3Config's default head_dim is 128, not hidden / heads.
  json.erase("head_dim");
  EXPECT_EQ(ParseOrDie(json).head_dim, 128);
}

TEST(FamilyConfigTest, MistralSlidingWindowDefaultsAsTransformersDoes) {
  Json json = Base("mistral");
  json["sliding_window"] = 16;
  EXPECT_EQ(ParseOrDie(json).sliding_window, 16);
  json["sliding_window"] = nullptr;  // Mistral v0.2+
  EXPECT_EQ(ParseOrDie(json).sliding_window, 0);
  json.erase("sliding_window");  // MistralConfig's default
  EXPECT_EQ(ParseOrDie(json).sliding_window, 4096);
  // Llama ignores the key, as LlamaConfig does.
  Json llama = Base("llama");
  llama["sliding_window"] = 16;
  EXPECT_EQ(ParseOrDie(llama).sliding_window, 0);
}

TEST(FamilyConfigTest, LinearAndDynamicStretchTheContext) {
  for (const char* type : {"linear", "dynamic"}) {
    SCOPED_TRACE(type);
    Json json = Base("llama");
    json["rope_scaling"] = {{"type", type}, {"factor", 4.0}};
    const ModelConfig c = ParseOrDie(json);
    EXPECT_EQ(RopeScalingName(c.rope_scaling.type), type);
    EXPECT_EQ(c.rope_scaling.original_max_position, 2048);
    EXPECT_EQ(c.max_position_embeddings, 8192);
  }
}

TEST(FamilyConfigTest, YarnAttentionFactorFromFactorMscaleOrGiven) {
  Json json = Base("qwen2");
  json["max_position_embeddings"] = 32768;
  json["rope_scaling"] = {{"type", "yarn"},
                          {"factor", 4.0},
                          {"original_max_position_embeddings", 32768}};
  ModelConfig c = ParseOrDie(json);
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::kYarn);
  EXPECT_NEAR(c.rope_scaling.attention_factor, 0.1 * std::log(4.0) + 1.0,
              1e-12);
  EXPECT_DOUBLE_EQ(c.rope_scaling.beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.beta_slow, 1.0);
  EXPECT_TRUE(c.rope_scaling.truncate);
  EXPECT_EQ(c.max_position_embeddings, 131072);

  json["rope_scaling"]["mscale"] = 0.707;
  json["rope_scaling"]["mscale_all_dim"] = 0.707;
  c = ParseOrDie(json);
  EXPECT_NEAR(c.rope_scaling.attention_factor, 1.0, 1e-12);

  json["rope_scaling"]["attention_factor"] = 1.25;
  json["rope_scaling"]["beta_fast"] = 16;
  json["rope_scaling"]["beta_slow"] = 2;
  json["rope_scaling"]["truncate"] = false;
  c = ParseOrDie(json);
  EXPECT_DOUBLE_EQ(c.rope_scaling.attention_factor, 1.25);
  EXPECT_DOUBLE_EQ(c.rope_scaling.beta_fast, 16.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.beta_slow, 2.0);
  EXPECT_FALSE(c.rope_scaling.truncate);
}

TEST(FamilyConfigTest, TransformersV5RopeParameters) {
  Json json = Base("qwen3");
  json.erase("rope_theta");
  json["rope_parameters"] = {{"rope_type", "default"},
                             {"rope_theta", 1000000.0}};
  ModelConfig c = ParseOrDie(json);
  EXPECT_FLOAT_EQ(c.rope_theta, 1e6f);
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::kNone);
  json["rope_parameters"] = {
      {"rope_type", "linear"}, {"factor", 2.0}, {"rope_theta", 1000.0}};
  c = ParseOrDie(json);
  EXPECT_FLOAT_EQ(c.rope_theta, 1000.0f);
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::kLinear);
}

TEST(FamilyConfigTest, IdentityTellsEveryFlagApart) {
  const ModelConfig llama = ParseOrDie(Base("llama"));
  std::vector<Json> variants;
  variants.push_back(Base("qwen2"));
  variants.push_back(Base("qwen3"));
  variants.back()["head_dim"] = 16;  // same head_dim as llama's
  Json mistral = Base("mistral");
  mistral["sliding_window"] = 128;
  variants.push_back(mistral);
  Json biased = Base("llama");
  biased["attention_bias"] = true;
  variants.push_back(biased);
  for (const char* type : {"linear", "dynamic"}) {
    Json scaled = Base("llama");
    scaled["rope_scaling"] = {{"type", type}, {"factor", 2.0}};
    variants.push_back(scaled);
  }
  Json llama3 = Base("llama");
  llama3["rope_scaling"] = {{"rope_type", "llama3"},
                            {"factor", 8.0},
                            {"low_freq_factor", 1.0},
                            {"high_freq_factor", 4.0},
                            {"original_max_position_embeddings", 1024}};
  variants.push_back(llama3);
  Json llama3_other = llama3;
  llama3_other["rope_scaling"]["high_freq_factor"] = 2.0;
  variants.push_back(llama3_other);
  Json yarn = Base("llama");
  yarn["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 2.0}};
  variants.push_back(yarn);
  Json yarn_attention = yarn;
  yarn_attention["rope_scaling"]["attention_factor"] = 1.0;
  variants.push_back(yarn_attention);
  std::set<std::string> identities = {llama.Identity()};
  for (const Json& json : variants) {
    const std::string identity = ParseOrDie(json).Identity();
    EXPECT_TRUE(identities.insert(identity).second) << identity;
  }
  // The context is not part of the identity (a GGUF and an HF copy often
  // disagree on it).
  Json longer = Base("llama");
  longer["max_position_embeddings"] = 4096;
  EXPECT_EQ(ParseOrDie(longer).Identity(), llama.Identity());
}

// The mixtures of experts: the keys each transformers class reads, with its
// defaults, and the attention of the dense family each shares.
TEST(FamilyConfigTest, Qwen3MoeRoutesWithItsDefaultsAndDenseLayers) {
  Json json = Base("qwen3_moe");
  json["num_hidden_layers"] = 4;
  json["mlp_only_layers"] = {0};
  json["decoder_sparse_step"] = 2;  // layers 1 and 3 sparse, then minus 0
  const ModelConfig c = ParseOrDie(json);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_EQ(c.head_dim, 16);  // hidden / heads: Qwen3MoeConfig has no 128
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.experts_per_token, 8);
  EXPECT_EQ(c.expert_intermediate_size, 768);
  EXPECT_FALSE(c.normalize_expert_weights);
  EXPECT_EQ(c.shared_expert_intermediate_size, 0);
  EXPECT_FALSE(c.IsMoeLayer(0));
  EXPECT_TRUE(c.IsMoeLayer(1));
  EXPECT_FALSE(c.IsMoeLayer(2));
  EXPECT_TRUE(c.IsMoeLayer(3));
  std::vector<std::string> names;
  for (const ExpectedTensor& t : LlamaTensorLayout(c)) names.push_back(t.name);
  EXPECT_THAT(names,
              ::testing::Contains("model.layers.0.mlp.gate_proj.weight"));
  EXPECT_THAT(names, ::testing::Contains("model.layers.1.mlp.gate.weight"));
  EXPECT_THAT(names, ::testing::Contains(
                         "model.layers.3.mlp.experts.127.down_proj.weight"));
  EXPECT_THAT(names, ::testing::Not(::testing::Contains(
                         "model.layers.1.mlp.gate_proj.weight")));
}

TEST(FamilyConfigTest, Qwen2MoeHasASharedExpertAndQkvBias) {
  Json json = Base("qwen2_moe");
  json["norm_topk_prob"] = true;
  const ModelConfig c = ParseOrDie(json);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.num_experts, 60);
  EXPECT_EQ(c.experts_per_token, 4);
  EXPECT_EQ(c.expert_intermediate_size, 1408);
  EXPECT_EQ(c.shared_expert_intermediate_size, 5632);
  EXPECT_TRUE(c.normalize_expert_weights);
  EXPECT_TRUE(c.IsMoeLayer(0) && c.IsMoeLayer(1));
}

TEST(FamilyConfigTest, MixtralRenormalisesAndWindowsOnlyWhenSet) {
  Json json = Base("mixtral");
  const ModelConfig c = ParseOrDie(json);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.experts_per_token, 2);
  EXPECT_EQ(c.expert_intermediate_size, 128);  // intermediate_size
  EXPECT_TRUE(c.normalize_expert_weights);
  EXPECT_EQ(c.sliding_window, 0);  // MixtralConfig's default is null
  json["sliding_window"] = 4096;
  json["router_jitter_noise"] = 0.1;  // training only
  EXPECT_EQ(ParseOrDie(json).sliding_window, 4096);
  std::vector<std::string> names;
  for (const ExpectedTensor& t : LlamaTensorLayout(c)) names.push_back(t.name);
  EXPECT_THAT(names,
              ::testing::Contains(
                  "model.layers.1.block_sparse_moe.experts.7.w2.weight"));
}

TEST(FamilyConfigTest, AnMoeConfigWithNoSparseLayerIsDense) {
  Json json = Base("qwen3_moe");
  json["mlp_only_layers"] = {0, 1};
  const ModelConfig c = ParseOrDie(json);
  EXPECT_FALSE(c.HasExperts());
  EXPECT_EQ(c.Identity(), [] {
    Json dense = Base("qwen3_moe");
    dense["num_experts"] = 0;
    return ParseOrDie(dense).Identity();
  }());
}

TEST(FamilyConfigTest, IdentityTellsExpertSettingsApart) {
  std::set<std::string> identities;
  Json base = Base("qwen3_moe");
  for (const auto& [key, value] :
       std::vector<std::pair<std::string, Json>>{{"", nullptr},
                                                 {"num_experts", 64},
                                                 {"num_experts_per_tok", 4},
                                                 {"moe_intermediate_size", 512},
                                                 {"norm_topk_prob", true},
                                                 {"mlp_only_layers", {1}}}) {
    Json json = base;
    if (!key.empty()) json[key] = value;
    EXPECT_TRUE(identities.insert(ParseOrDie(json).Identity()).second) << key;
  }
}

}  // namespace
}  // namespace pdserve::model
