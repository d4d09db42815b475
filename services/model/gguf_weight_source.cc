// WeightSource over a GGUF file: llama.cpp tensor names mapped to canonical
// names, shapes reversed from ggml order, q/k rows permuted from Meta's
// interleaved RoPE layout into HF rotate-half order on read.
#include <cmath>
#include <cstring>
#include <limits>
#include <span>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/absl_compat.h"
#include "model/gguf_file.h"
#include "model/mapped_weight_source.h"

namespace pdserve::model {
namespace {

struct NameMapping {
  std::string_view gguf;
  std::string_view canonical;
};

// Per-layer tensor stems: blk.N.<gguf>.<suffix> -> model.layers.N.<canonical>.
constexpr NameMapping kLayerNames[] = {
    {"attn_norm", "input_layernorm"},
    {"attn_q", "self_attn.q_proj"},
    {"attn_k", "self_attn.k_proj"},
    {"attn_v", "self_attn.v_proj"},
    {"attn_output", "self_attn.o_proj"},
    {"attn_q_norm", "self_attn.q_norm"},
    {"attn_k_norm", "self_attn.k_norm"},
    {"ffn_norm", "post_attention_layernorm"},
    {"ffn_gate", "mlp.gate_proj"},
    {"ffn_up", "mlp.up_proj"},
    {"ffn_down", "mlp.down_proj"},
};

constexpr NameMapping kGlobalNames[] = {
    {"token_embd", "model.embed_tokens"},
    {"output_norm", "model.norm"},
    {"output", "lm_head"},
};

// Missing metadata is a malformed model, so the NOT_FOUND of GgufFile's
// getters becomes INVALID_ARGUMENT (the message already names file and key).
absl::Status AsInvalid(const absl::Status& status) {
  if (status.ok() || status.code() != absl::StatusCode::kNotFound) {
    return status;
  }
  return absl::InvalidArgumentError(status.message());
}

absl::StatusOr<int> RequiredPositiveInt(const GgufFile& gguf,
                                        std::string_view key) {
  absl::StatusOr<int64_t> value = gguf.GetInt(key);
  if (!value.ok()) return AsInvalid(value.status());
  if (*value <= 0 || *value > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat(gguf.path(), ": metadata key ", ToAbsl(key), " = ", *value,
                     " is out of range"));
  }
  return static_cast<int>(*value);
}

absl::StatusOr<std::optional<int>> OptionalPositiveInt(const GgufFile& gguf,
                                                       std::string_view key) {
  if (gguf.FindMetadata(key) == nullptr) return std::optional<int>();
  PDS_ASSIGN_OR_RETURN(int value, RequiredPositiveInt(gguf, key));
  return std::optional<int>(value);
}

// Token ids are stored as uint32 with 0xFFFFFFFF meaning "none"; anything
// that does not fit int32 maps to -1.
absl::StatusOr<int32_t> OptionalTokenId(const GgufFile& gguf,
                                        std::string_view key) {
  if (gguf.FindMetadata(key) == nullptr) return -1;
  PDS_ASSIGN_OR_RETURN(int64_t value, gguf.GetInt(key));
  if (value < 0 || value > std::numeric_limits<int32_t>::max()) return -1;
  return static_cast<int32_t>(value);
}

absl::StatusOr<bool> OptionalBool(const GgufFile& gguf, std::string_view key,
                                  bool default_value) {
  if (gguf.FindMetadata(key) == nullptr) return default_value;
  return gguf.GetBool(key);
}

class GgufWeightSource final : public MappedWeightSource {
 public:
  explicit GgufWeightSource(GgufFile gguf)
      : file_(std::make_shared<GgufFile>(std::move(gguf))), gguf_(*file_) {
    mapping_owner_ = file_;
  }

  absl::Status Init() {
    PDS_ASSIGN_OR_RETURN(config_, LlamaConfigFromGguf(gguf_));
    description_ = gguf_.path();
    for (const GgufTensorInfo& stored : gguf_.tensors()) {
      MappedTensor tensor;
      tensor.info.name = CanonicalNameFromGguf(stored.name);
      tensor.info.dtype = stored.dtype();
      tensor.info.format = stored.format;
      tensor.info.shape = stored.Shape();
      tensor.data = gguf_.TensorData(stored);
      tensor.file_path = &gguf_.path();
      // llama.cpp's converter permutes q/k of "llama" files into Meta's
      // interleaved layout; Qwen files keep HF's rotate-half rows (NEOX).
      if (config_.architecture == "llama" &&
          (absl::EndsWith(tensor.info.name, ".self_attn.q_proj.weight") ||
           absl::EndsWith(tensor.info.name, ".self_attn.k_proj.weight"))) {
        tensor.interleaved_rope_head_dim = config_.head_dim;
      }
      std::string name = tensor.info.name;
      if (!tensors_.emplace(std::move(name), std::move(tensor)).second) {
        return absl::InvalidArgumentError(
            absl::StrCat(gguf_.path(), ": two tensors map to the name ",
                         CanonicalNameFromGguf(stored.name)));
      }
    }
    return ValidateArchitecture(gguf_.path());
  }

  absl::StatusOr<TokenizerSpec> tokenizer_spec() const override {
    return TokenizerSpecFromGguf(gguf_);
  }

 private:
  std::shared_ptr<GgufFile> file_;  // shared with StoredTensor views
  GgufFile& gguf_;
};

}  // namespace

std::string CanonicalNameFromGguf(std::string_view gguf_name) {
  // Split "<stem>.<suffix>" where suffix is weight/bias.
  size_t dot = gguf_name.rfind('.');
  if (dot == std::string_view::npos) return std::string(gguf_name);
  std::string_view stem = gguf_name.substr(0, dot);
  std::string_view suffix = gguf_name.substr(dot);  // ".weight"

  for (const NameMapping& mapping : kGlobalNames) {
    if (stem == mapping.gguf)
      return absl::StrCat(ToAbsl(mapping.canonical), ToAbsl(suffix));
  }
  constexpr std::string_view kLayerPrefix = "blk.";
  if (!stem.starts_with(kLayerPrefix)) return std::string(gguf_name);
  stem.remove_prefix(kLayerPrefix.size());
  size_t layer_end = stem.find('.');
  if (layer_end == std::string_view::npos) return std::string(gguf_name);
  int layer;
  if (!absl::SimpleAtoi(ToAbsl(stem.substr(0, layer_end)), &layer) ||
      layer < 0) {
    return std::string(gguf_name);
  }
  std::string_view layer_stem = stem.substr(layer_end + 1);
  for (const NameMapping& mapping : kLayerNames) {
    if (layer_stem == mapping.gguf) {
      return absl::StrCat(LayerTensorName(layer, mapping.canonical),
                          ToAbsl(suffix));
    }
  }
  return std::string(gguf_name);
}

absl::StatusOr<ModelConfig> LlamaConfigFromGguf(const GgufFile& gguf) {
  ModelConfig config;
  absl::StatusOr<std::string> architecture =
      gguf.GetString("general.architecture");
  if (!architecture.ok()) return AsInvalid(architecture.status());
  if (*architecture != "llama" && *architecture != "qwen2" &&
      *architecture != "qwen3") {
    return absl::InvalidArgumentError(
        absl::StrCat(gguf.path(), ": general.architecture \"", *architecture,
                     "\" is not supported (llama, qwen2 or qwen3)"));
  }
  config.architecture = *architecture;
  // Metadata keys are prefixed with the architecture ("qwen3.block_count").
  const std::string& arch = *architecture;
  auto key = [&arch](std::string_view suffix) {
    return absl::StrCat(arch, ".", ToAbsl(suffix));
  };
  PDS_ASSIGN_OR_RETURN(config.hidden_size,
                       RequiredPositiveInt(gguf, key("embedding_length")));
  PDS_ASSIGN_OR_RETURN(config.intermediate_size,
                       RequiredPositiveInt(gguf, key("feed_forward_length")));
  PDS_ASSIGN_OR_RETURN(config.num_layers,
                       RequiredPositiveInt(gguf, key("block_count")));
  PDS_ASSIGN_OR_RETURN(config.num_heads,
                       RequiredPositiveInt(gguf, key("attention.head_count")));
  PDS_ASSIGN_OR_RETURN(config.max_position_embeddings,
                       RequiredPositiveInt(gguf, key("context_length")));
  PDS_ASSIGN_OR_RETURN(
      std::optional<int> kv_heads,
      OptionalPositiveInt(gguf, key("attention.head_count_kv")));
  config.num_kv_heads = kv_heads.value_or(config.num_heads);

  absl::StatusOr<double> eps =
      gguf.GetFloat(key("attention.layer_norm_rms_epsilon"));
  if (!eps.ok()) return AsInvalid(eps.status());
  config.rms_norm_eps = static_cast<float>(*eps);
  if (gguf.FindMetadata(key("rope.freq_base")) != nullptr) {
    PDS_ASSIGN_OR_RETURN(double theta, gguf.GetFloat(key("rope.freq_base")));
    config.rope_theta = static_cast<float>(theta);
  }
  if (gguf.FindMetadata(key("attention.sliding_window")) != nullptr) {
    // In a llama GGUF this is Mistral's window, over every layer (llama.cpp's
    // converter writes config.json's sliding_window). Qwen2/Qwen3 window only
    // the layers from max_window_layers on, which GGUF files do not record.
    if (arch != "llama") {
      return absl::InvalidArgumentError(absl::StrCat(
          gguf.path(), ": ", key("attention.sliding_window"),
          " is not supported for ", arch,
          " GGUF files (which layers window, max_window_layers, is not "
          "recorded; use the Hugging Face checkpoint)"));
    }
    PDS_ASSIGN_OR_RETURN(
        std::optional<int> window,
        OptionalPositiveInt(gguf, key("attention.sliding_window")));
    config.sliding_window = window.value_or(0);
  }
  // The family flags come from the tensors the file holds (llama.cpp has no
  // metadata for them): Qwen2's q/k/v biases, Qwen3's q/k norms.
  config.qkv_bias = gguf.FindTensor("blk.0.attn_q.bias") != nullptr;
  config.o_bias = gguf.FindTensor("blk.0.attn_output.bias") != nullptr;
  config.qk_norm = gguf.FindTensor("blk.0.attn_q_norm.weight") != nullptr;
  if (config.qkv_bias && arch == "llama") {
    // The converter permutes these too; the reader only permutes rows.
    return absl::InvalidArgumentError(absl::StrCat(
        gguf.path(),
        ": q/k/v biases in a \"llama\" GGUF are not supported (their "
        "interleaved RoPE order is not undone)"));
  }

  // key_length is the head size in newer files; rope.dimension_count equals
  // it for these families (the whole head is rotated).
  PDS_ASSIGN_OR_RETURN(std::optional<int> key_length,
                       OptionalPositiveInt(gguf, key("attention.key_length")));
  PDS_ASSIGN_OR_RETURN(std::optional<int> rope_dims,
                       OptionalPositiveInt(gguf, key("rope.dimension_count")));
  if (key_length.has_value()) {
    config.head_dim = *key_length;
  } else if (rope_dims.has_value()) {
    config.head_dim = *rope_dims;
  } else {
    if (config.hidden_size % config.num_heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          gguf.path(), ": ", key("embedding_length"), " is not a multiple of ",
          key("attention.head_count"), " and no head size is given"));
    }
    config.head_dim = config.hidden_size / config.num_heads;
  }
  if (rope_dims.has_value() && *rope_dims != config.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat(gguf.path(), ": ", key("rope.dimension_count"), " = ",
                     *rope_dims, " differs from the head size ",
                     config.head_dim, " (partial RoPE is not supported)"));
  }

  // RoPE scaling: linear and yarn as metadata; Llama 3.x's frequency
  // factors as the tensor rope_freqs.weight (what llama.cpp's converter
  // writes for rope_type llama3).
  RopeScaling& rope = config.rope_scaling;
  if (gguf.FindMetadata(key("rope.scaling.type")) != nullptr) {
    PDS_ASSIGN_OR_RETURN(std::string scaling,
                         gguf.GetString(key("rope.scaling.type")));
    if (scaling == "linear" || scaling == "yarn") {
      rope.type = scaling == "linear" ? RopeScalingType::kLinear
                                      : RopeScalingType::kYarn;
      absl::StatusOr<double> factor = gguf.GetFloat(key("rope.scaling.factor"));
      if (!factor.ok()) return AsInvalid(factor.status());
      rope.factor = *factor;
      rope.original_max_position = config.max_position_embeddings;
      if (scaling == "yarn") {
        PDS_ASSIGN_OR_RETURN(
            std::optional<int> original,
            OptionalPositiveInt(gguf,
                                key("rope.scaling.original_context_length")));
        rope.original_max_position =
            original.value_or(config.max_position_embeddings);
        rope.attention_factor =
            rope.factor <= 1 ? 1.0 : 0.1 * std::log(rope.factor) + 1.0;
        if (gguf.FindMetadata(key("rope.scaling.attn_factor")) != nullptr) {
          return absl::InvalidArgumentError(absl::StrCat(
              gguf.path(), ": ", key("rope.scaling.attn_factor"),
              " is not supported (use the Hugging Face checkpoint)"));
        }
      }
    } else if (scaling != "none") {
      return absl::InvalidArgumentError(
          absl::StrCat(gguf.path(), ": ", key("rope.scaling.type"), " \"",
                       scaling, "\" is not supported (none, linear or yarn)"));
    }
  }
  if (const GgufTensorInfo* factors = gguf.FindTensor("rope_freqs.weight");
      factors != nullptr) {
    if (rope.type != RopeScalingType::kNone) {
      return absl::InvalidArgumentError(
          absl::StrCat(gguf.path(), ": rope_freqs.weight together with ",
                       key("rope.scaling.type"), " is not supported"));
    }
    if (factors->dtype() != DType::kF32 || factors->ne.size() != 1 ||
        factors->ne[0] != static_cast<uint64_t>(config.head_dim / 2)) {
      return absl::InvalidArgumentError(absl::StrCat(
          gguf.path(), ": rope_freqs.weight must be F32 of head_dim / 2 = ",
          config.head_dim / 2, " values"));
    }
    const std::span<const uint8_t> bytes = gguf.TensorData(*factors);
    rope.type = RopeScalingType::kFreqFactors;
    rope.freq_factors.resize(config.head_dim / 2);
    std::memcpy(rope.freq_factors.data(), bytes.data(),
                rope.freq_factors.size() * sizeof(float));
    rope.original_max_position = config.max_position_embeddings;
  }

  const GgufTensorInfo* embedding = gguf.FindTensor("token_embd.weight");
  if (embedding == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        gguf.path(),
        ": missing tensor token_embd.weight (model.embed_tokens)"));
  }
  config.dtype = embedding->dtype();
  if (const GgufValue* tokens = gguf.FindMetadata("tokenizer.ggml.tokens");
      tokens != nullptr && tokens->AsArray() != nullptr) {
    const size_t count = tokens->AsArray()->size();
    if (count > static_cast<size_t>(std::numeric_limits<int>::max())) {
      return absl::InvalidArgumentError(
          absl::StrCat(gguf.path(), ": absurd vocabulary size ", count));
    }
    config.vocab_size = static_cast<int>(count);
  } else {
    // ne[1] is the vocabulary (outer) dimension of token_embd.
    const uint64_t rows = embedding->ne.size() == 2 ? embedding->ne[1] : 0;
    if (rows == 0 ||
        rows > static_cast<uint64_t>(std::numeric_limits<int>::max())) {
      return absl::InvalidArgumentError(
          absl::StrCat(gguf.path(),
                       ": cannot infer the vocabulary size from "
                       "token_embd.weight"));
    }
    config.vocab_size = static_cast<int>(rows);
  }
  // No output.weight means the embedding doubles as the output projection.
  config.tie_word_embeddings = gguf.FindTensor("output.weight") == nullptr;

  PDS_ASSIGN_OR_RETURN(int32_t bos,
                       OptionalTokenId(gguf, "tokenizer.ggml.bos_token_id"));
  PDS_ASSIGN_OR_RETURN(int32_t eos,
                       OptionalTokenId(gguf, "tokenizer.ggml.eos_token_id"));
  if (bos >= 0) config.bos_token_id = bos;
  if (eos >= 0) config.eos_token_id = eos;

  absl::Status valid = config.Validate();
  if (!valid.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(gguf.path(), ": ", valid.message()));
  }
  return config;
}

absl::StatusOr<TokenizerSpec> TokenizerSpecFromGguf(const GgufFile& gguf) {
  if (gguf.FindMetadata("tokenizer.ggml.tokens") == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        gguf.path(), ": no tokenizer (tokenizer.ggml.tokens is missing)"));
  }
  TokenizerSpec spec;
  PDS_ASSIGN_OR_RETURN(spec.tokens,
                       gguf.GetStringArray("tokenizer.ggml.tokens"));
  if (gguf.FindMetadata("tokenizer.ggml.model") != nullptr) {
    PDS_ASSIGN_OR_RETURN(spec.ggml_model,
                         gguf.GetString("tokenizer.ggml.model"));
  }
  if (gguf.FindMetadata("tokenizer.ggml.scores") != nullptr) {
    PDS_ASSIGN_OR_RETURN(std::vector<double> scores,
                         gguf.GetFloatArray("tokenizer.ggml.scores"));
    if (scores.size() != spec.tokens.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          gguf.path(), ": tokenizer.ggml.scores has ", scores.size(),
          " entries for ", spec.tokens.size(), " tokens"));
    }
    spec.scores.assign(scores.begin(), scores.end());
  }
  if (gguf.FindMetadata("tokenizer.ggml.token_type") != nullptr) {
    PDS_ASSIGN_OR_RETURN(std::vector<int64_t> types,
                         gguf.GetIntArray("tokenizer.ggml.token_type"));
    if (types.size() != spec.tokens.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          gguf.path(), ": tokenizer.ggml.token_type has ", types.size(),
          " entries for ", spec.tokens.size(), " tokens"));
    }
    spec.token_types.reserve(types.size());
    for (int64_t type : types) {
      if (type < std::numeric_limits<int32_t>::min() ||
          type > std::numeric_limits<int32_t>::max()) {
        return absl::InvalidArgumentError(absl::StrCat(
            gguf.path(), ": tokenizer.ggml.token_type value out of range"));
      }
      spec.token_types.push_back(static_cast<int32_t>(type));
    }
  }
  if (gguf.FindMetadata("tokenizer.ggml.merges") != nullptr) {
    PDS_ASSIGN_OR_RETURN(spec.merges,
                         gguf.GetStringArray("tokenizer.ggml.merges"));
  }
  if (gguf.FindMetadata("tokenizer.chat_template") != nullptr) {
    PDS_ASSIGN_OR_RETURN(spec.chat_template,
                         gguf.GetString("tokenizer.chat_template"));
  }
  if (gguf.FindMetadata("tokenizer.ggml.pre") != nullptr) {
    PDS_ASSIGN_OR_RETURN(spec.ggml_pre, gguf.GetString("tokenizer.ggml.pre"));
  }
  PDS_ASSIGN_OR_RETURN(spec.bos_token_id,
                       OptionalTokenId(gguf, "tokenizer.ggml.bos_token_id"));
  PDS_ASSIGN_OR_RETURN(spec.eos_token_id,
                       OptionalTokenId(gguf, "tokenizer.ggml.eos_token_id"));
  PDS_ASSIGN_OR_RETURN(
      spec.unk_token_id,
      OptionalTokenId(gguf, "tokenizer.ggml.unknown_token_id"));
  PDS_ASSIGN_OR_RETURN(
      spec.pad_token_id,
      OptionalTokenId(gguf, "tokenizer.ggml.padding_token_id"));
  PDS_ASSIGN_OR_RETURN(
      spec.add_bos, OptionalBool(gguf, "tokenizer.ggml.add_bos_token", true));
  PDS_ASSIGN_OR_RETURN(
      spec.add_eos, OptionalBool(gguf, "tokenizer.ggml.add_eos_token", false));
  return spec;
}

absl::StatusOr<std::unique_ptr<WeightSource>> OpenGgufModel(
    const std::string& path) {
  PDS_ASSIGN_OR_RETURN(GgufFile gguf, GgufFile::Open(path));
  auto source = std::make_unique<GgufWeightSource>(std::move(gguf));
  PDS_RETURN_IF_ERROR(source->Init());
  return source;
}

}  // namespace pdserve::model
