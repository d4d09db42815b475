// WeightSource over a GGUF file: llama.cpp tensor names mapped to canonical
// names, shapes reversed from ggml order, q/k rows permuted from Meta's
// interleaved RoPE layout into HF rotate-half order on read.
#include <limits>

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
      if (absl::EndsWith(tensor.info.name, ".self_attn.q_proj.weight") ||
          absl::EndsWith(tensor.info.name, ".self_attn.k_proj.weight")) {
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
  if (*architecture != "llama") {
    return absl::InvalidArgumentError(
        absl::StrCat(gguf.path(), ": general.architecture \"", *architecture,
                     "\" is not supported (only llama)"));
  }
  config.architecture = *architecture;
  PDS_ASSIGN_OR_RETURN(config.hidden_size,
                       RequiredPositiveInt(gguf, "llama.embedding_length"));
  PDS_ASSIGN_OR_RETURN(config.intermediate_size,
                       RequiredPositiveInt(gguf, "llama.feed_forward_length"));
  PDS_ASSIGN_OR_RETURN(config.num_layers,
                       RequiredPositiveInt(gguf, "llama.block_count"));
  PDS_ASSIGN_OR_RETURN(config.num_heads,
                       RequiredPositiveInt(gguf, "llama.attention.head_count"));
  PDS_ASSIGN_OR_RETURN(config.max_position_embeddings,
                       RequiredPositiveInt(gguf, "llama.context_length"));
  PDS_ASSIGN_OR_RETURN(
      std::optional<int> kv_heads,
      OptionalPositiveInt(gguf, "llama.attention.head_count_kv"));
  config.num_kv_heads = kv_heads.value_or(config.num_heads);

  absl::StatusOr<double> eps =
      gguf.GetFloat("llama.attention.layer_norm_rms_epsilon");
  if (!eps.ok()) return AsInvalid(eps.status());
  config.rms_norm_eps = static_cast<float>(*eps);
  if (gguf.FindMetadata("llama.rope.freq_base") != nullptr) {
    PDS_ASSIGN_OR_RETURN(double theta, gguf.GetFloat("llama.rope.freq_base"));
    config.rope_theta = static_cast<float>(theta);
  }
  if (gguf.FindMetadata("llama.rope.scaling.type") != nullptr) {
    PDS_ASSIGN_OR_RETURN(std::string scaling,
                         gguf.GetString("llama.rope.scaling.type"));
    if (scaling != "none") {
      return absl::InvalidArgumentError(
          absl::StrCat(gguf.path(), ": llama.rope.scaling.type \"", scaling,
                       "\" is not supported"));
    }
  }

  // key_length is the head size in newer files; rope.dimension_count equals
  // it for Llama (the whole head is rotated).
  PDS_ASSIGN_OR_RETURN(std::optional<int> key_length,
                       OptionalPositiveInt(gguf, "llama.attention.key_length"));
  PDS_ASSIGN_OR_RETURN(std::optional<int> rope_dims,
                       OptionalPositiveInt(gguf, "llama.rope.dimension_count"));
  if (key_length.has_value()) {
    config.head_dim = *key_length;
  } else if (rope_dims.has_value()) {
    config.head_dim = *rope_dims;
  } else {
    if (config.hidden_size % config.num_heads != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(gguf.path(),
                       ": llama.embedding_length is not a multiple of "
                       "llama.attention.head_count and no head size is given"));
    }
    config.head_dim = config.hidden_size / config.num_heads;
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
