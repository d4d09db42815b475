#include "model/model_config.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/absl_compat.h"
#include "nlohmann/json.hpp"

namespace pdserve::model {
namespace {

using Json = nlohmann::json;

absl::Status BadKey(std::string_view source_name, std::string_view key,
                    std::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat(ToAbsl(source_name),
                                                 ": config key \"", ToAbsl(key),
                                                 "\" ", ToAbsl(problem)));
}

// Reads an integer that must fit an int. Floats such as 64.0 are rejected on
// purpose: a non-integral size in a config is a broken file, not a rounding
// question.
absl::StatusOr<std::optional<int>> OptionalInt(const Json& root,
                                               std::string_view key,
                                               std::string_view source_name) {
  auto it = root.find(key);
  if (it == root.end() || it->is_null()) return std::optional<int>();
  if (!it->is_number_integer()) {
    return BadKey(source_name, key, "must be an integer");
  }
  // Signed and unsigned integers are distinct JSON number kinds in nlohmann;
  // read both without a throwing conversion.
  int64_t value;
  if (it->is_number_unsigned()) {
    uint64_t unsigned_value = it->get<uint64_t>();
    if (unsigned_value >
        static_cast<uint64_t>(std::numeric_limits<int>::max())) {
      return BadKey(source_name, key, "is out of range");
    }
    value = static_cast<int64_t>(unsigned_value);
  } else {
    value = it->get<int64_t>();
  }
  if (value < std::numeric_limits<int>::min() ||
      value > std::numeric_limits<int>::max()) {
    return BadKey(source_name, key, "is out of range");
  }
  return std::optional<int>(static_cast<int>(value));
}

absl::StatusOr<int> RequiredInt(const Json& root, std::string_view key,
                                std::string_view source_name) {
  PDS_ASSIGN_OR_RETURN(std::optional<int> value,
                       OptionalInt(root, key, source_name));
  if (!value.has_value()) return BadKey(source_name, key, "is missing");
  return *value;
}

absl::StatusOr<std::optional<double>> OptionalNumber(
    const Json& root, std::string_view key, std::string_view source_name) {
  auto it = root.find(key);
  if (it == root.end() || it->is_null()) return std::optional<double>();
  if (!it->is_number()) return BadKey(source_name, key, "must be a number");
  return std::optional<double>(it->get<double>());
}

absl::StatusOr<std::optional<bool>> OptionalBool(const Json& root,
                                                 std::string_view key,
                                                 std::string_view source_name) {
  auto it = root.find(key);
  if (it == root.end() || it->is_null()) return std::optional<bool>();
  if (!it->is_boolean()) return BadKey(source_name, key, "must be a boolean");
  return std::optional<bool>(it->get<bool>());
}

absl::StatusOr<std::optional<std::string>> OptionalString(
    const Json& root, std::string_view key, std::string_view source_name) {
  auto it = root.find(key);
  if (it == root.end() || it->is_null()) return std::optional<std::string>();
  if (!it->is_string()) return BadKey(source_name, key, "must be a string");
  return std::optional<std::string>(it->get<std::string>());
}

// eos_token_id may be a list in chat models (several stop tokens); the first
// one is the primary end-of-sequence token.
absl::StatusOr<std::optional<int>> OptionalTokenId(
    const Json& root, std::string_view key, std::string_view source_name) {
  auto it = root.find(key);
  if (it != root.end() && it->is_array()) {
    if (it->empty()) return std::optional<int>();
    Json first = Json::object();
    first[std::string(key)] = it->front();
    return OptionalInt(first, key, source_name);
  }
  return OptionalInt(root, key, source_name);
}

// Every id of `eos_token_id` (a number or a list) into `ids`, once each.
absl::Status ReadEosTokenIds(const Json& root, std::string_view source_name,
                             std::vector<int>* ids) {
  auto it = root.find("eos_token_id");
  if (it == root.end() || it->is_null()) return absl::OkStatus();
  const Json list = it->is_array() ? *it : Json::array({*it});
  for (const Json& id : list) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
        id.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      return BadKey(source_name, "eos_token_id",
                    "must be a token id or a list of token ids");
    }
    const int value = static_cast<int>(id.get<int64_t>());
    if (std::find(ids->begin(), ids->end(), value) == ids->end()) {
      ids->push_back(value);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<DType> ParseTorchDtype(std::string_view text,
                                      std::string_view source_name) {
  if (text == "float32") return DType::kF32;
  if (text == "float16") return DType::kF16;
  if (text == "bfloat16") return DType::kBF16;
  return BadKey(source_name, "torch_dtype",
                absl::StrCat("has unsupported value \"", ToAbsl(text),
                             "\" (float32, float16 or bfloat16)"));
}

constexpr char kKnownArchitectures[] =
    "llama, mistral, qwen2, qwen3, qwen3_moe, qwen2_moe or mixtral";

bool IsKnownArchitecture(std::string_view name) {
  for (std::string_view known : {"llama", "mistral", "qwen2", "qwen3",
                                 "qwen3_moe", "qwen2_moe", "mixtral"}) {
    if (name == known) return true;
  }
  return false;
}

absl::Status Positive(int value, std::string_view key) {
  if (value <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config key \"", ToAbsl(key), "\" must be positive, got ", value));
  }
  return absl::OkStatus();
}

std::string FormatDouble(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.9g", value);
  return text;
}

absl::Status ValidateExperts(const ModelConfig& c) {
  if (c.num_experts < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config key \"num_experts\" must not be negative, got ",
                     c.num_experts));
  }
  if (c.num_experts == 0) {
    if (c.experts_per_token != 0 || c.shared_expert_intermediate_size != 0 ||
        !c.dense_layers.empty()) {
      return absl::InvalidArgumentError(
          "expert settings without experts (num_experts is 0)");
    }
    return absl::OkStatus();
  }
  if (c.experts_per_token < 1 || c.experts_per_token > c.num_experts) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config key \"num_experts_per_tok\" (", c.experts_per_token,
        ") must be between 1 and the number of experts (", c.num_experts, ")"));
  }
  PDS_RETURN_IF_ERROR(
      Positive(c.expert_intermediate_size, "moe_intermediate_size"));
  if (c.shared_expert_intermediate_size < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config key \"shared_expert_intermediate_size\" must not be "
        "negative, got ",
        c.shared_expert_intermediate_size));
  }
  if (!c.dense_layers.empty() &&
      static_cast<int>(c.dense_layers.size()) != c.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("dense layer flags for ", c.dense_layers.size(),
                     " layers, not num_hidden_layers (", c.num_layers, ")"));
  }
  return absl::OkStatus();
}

// The MoE keys of a qwen3_moe / qwen2_moe / mixtral config.json, with the
// defaults of transformers' Qwen3MoeConfig, Qwen2MoeConfig and
// MixtralConfig. Keys those classes read only in training
// (router_aux_loss_coef, output_router_logits, router_jitter_noise: jitter
// is applied only while training) change nothing here.
absl::Status ParseExperts(const Json& root, std::string_view source_name,
                          ModelConfig* config) {
  const std::string& family = config->architecture;
  const bool mixtral = family == "mixtral";
  const bool qwen2 = family == "qwen2_moe";
  // Qwen3MoeConfig maps num_experts onto num_local_experts (transformers
  // v5 may save either).
  const char* count_key = mixtral ? "num_local_experts" : "num_experts";
  PDS_ASSIGN_OR_RETURN(std::optional<int> experts,
                       OptionalInt(root, count_key, source_name));
  if (!experts.has_value() && !mixtral) {
    PDS_ASSIGN_OR_RETURN(experts,
                         OptionalInt(root, "num_local_experts", source_name));
  }
  config->num_experts = experts.value_or(mixtral ? 8 : qwen2 ? 60 : 128);
  if (config->num_experts < 0 || (mixtral && config->num_experts == 0)) {
    return BadKey(source_name, count_key,
                  mixtral ? "must be positive" : "must not be negative");
  }
  PDS_ASSIGN_OR_RETURN(std::optional<int> top_k,
                       OptionalInt(root, "num_experts_per_tok", source_name));
  if (mixtral) {
    // MixtralSparseMoeBlock: softmax, top k, renormalised; experts of
    // intermediate_size; every layer sparse.
    config->experts_per_token = top_k.value_or(2);
    config->expert_intermediate_size = config->intermediate_size;
    config->normalize_expert_weights = true;
  } else {
    config->experts_per_token = top_k.value_or(qwen2 ? 4 : 8);
    PDS_ASSIGN_OR_RETURN(
        std::optional<int> width,
        OptionalInt(root, "moe_intermediate_size", source_name));
    config->expert_intermediate_size = width.value_or(qwen2 ? 1408 : 768);
    PDS_ASSIGN_OR_RETURN(std::optional<bool> normalize,
                         OptionalBool(root, "norm_topk_prob", source_name));
    config->normalize_expert_weights = normalize.value_or(false);
    if (qwen2) {
      PDS_ASSIGN_OR_RETURN(
          std::optional<int> shared,
          OptionalInt(root, "shared_expert_intermediate_size", source_name));
      config->shared_expert_intermediate_size = shared.value_or(5632);
      if (config->shared_expert_intermediate_size <= 0) {
        return BadKey(source_name, "shared_expert_intermediate_size",
                      "must be positive (every Qwen2-MoE sparse layer has a "
                      "shared expert)");
      }
    }
    // A layer is sparse unless mlp_only_layers lists it, and only every
    // decoder_sparse_step-th layer ((i + 1) % step == 0), as
    // Qwen3MoeDecoderLayer / Qwen2MoeDecoderLayer decide.
    PDS_ASSIGN_OR_RETURN(std::optional<int> step,
                         OptionalInt(root, "decoder_sparse_step", source_name));
    if (step.value_or(1) < 1) {
      return BadKey(source_name, "decoder_sparse_step", "must be positive");
    }
    std::vector<bool> dense(config->num_layers, false);
    for (int l = 0; l < config->num_layers; ++l) {
      dense[l] = (l + 1) % step.value_or(1) != 0;
    }
    if (auto it = root.find("mlp_only_layers");
        it != root.end() && !it->is_null()) {
      if (!it->is_array()) {
        return BadKey(source_name, "mlp_only_layers",
                      "must be a list of layer indices");
      }
      for (const Json& index : *it) {
        if (!index.is_number_integer() || index.get<int64_t>() < 0 ||
            index.get<int64_t>() >= config->num_layers) {
          return BadKey(source_name, "mlp_only_layers",
                        absl::StrCat("must list layer indices below "
                                     "num_hidden_layers (",
                                     config->num_layers, ")"));
        }
        dense[static_cast<size_t>(index.get<int64_t>())] = true;
      }
    }
    // One description per meaning: no dense layer is an empty list, no
    // sparse layer is no experts.
    if (config->num_experts > 0 &&
        std::find(dense.begin(), dense.end(), false) == dense.end()) {
      config->num_experts = 0;
    }
    if (config->num_experts == 0) {
      config->experts_per_token = 0;
      config->expert_intermediate_size = 0;
      config->normalize_expert_weights = false;
      config->shared_expert_intermediate_size = 0;
    } else if (std::find(dense.begin(), dense.end(), true) != dense.end()) {
      config->dense_layers = std::move(dense);
    }
  }
  return absl::OkStatus();
}

// A number of a nested object (rope_scaling), errors naming
// "<parent>.<key>".
absl::StatusOr<std::optional<double>> NestedNumber(
    const Json& object, std::string_view parent, std::string_view key,
    std::string_view source_name) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return std::optional<double>();
  if (!it->is_number() || !std::isfinite(it->get<double>())) {
    return BadKey(source_name, absl::StrCat(ToAbsl(parent), ".", ToAbsl(key)),
                  "must be a finite number");
  }
  return std::optional<double>(it->get<double>());
}

absl::StatusOr<double> RequiredNestedNumber(const Json& object,
                                            std::string_view parent,
                                            std::string_view key,
                                            std::string_view source_name) {
  PDS_ASSIGN_OR_RETURN(std::optional<double> value,
                       NestedNumber(object, parent, key, source_name));
  if (!value.has_value()) {
    return BadKey(source_name, absl::StrCat(ToAbsl(parent), ".", ToAbsl(key)),
                  "is missing");
  }
  return *value;
}

// Reads `rope_scaling` (or the rope part of transformers v5's
// `rope_parameters`) the way transformers' rope init functions read it.
// Keys a type does not use are refused by name rather than ignored, so a
// config that means something the engine does not compute never loads.
absl::Status ParseRopeScaling(const Json& scaling, std::string_view parent,
                              std::string_view source_name,
                              ModelConfig* config) {
  if (!scaling.is_object()) {
    return BadKey(source_name, parent, "must be an object or null");
  }
  std::string type;
  for (const char* type_key : {"rope_type", "type"}) {
    auto it = scaling.find(type_key);
    if (it == scaling.end() || it->is_null()) continue;
    if (!it->is_string()) {
      return BadKey(source_name, absl::StrCat(ToAbsl(parent), ".", type_key),
                    "must be a string");
    }
    if (!type.empty() && type != it->get<std::string>()) {
      return BadKey(source_name, absl::StrCat(ToAbsl(parent), ".rope_type"),
                    absl::StrCat("\"", it->get<std::string>(),
                                 "\" disagrees with type \"", type, "\""));
    }
    type = it->get<std::string>();
  }
  if (type.empty()) {
    return BadKey(source_name, absl::StrCat(ToAbsl(parent), ".rope_type"),
                  "is missing");
  }
  std::vector<std::string_view> allowed = {"rope_type", "type"};
  RopeScaling& rope = config->rope_scaling;
  auto number = [&](std::string_view key) {
    return NestedNumber(scaling, parent, key, source_name);
  };
  auto required = [&](std::string_view key) {
    return RequiredNestedNumber(scaling, parent, key, source_name);
  };
  auto positive_int = [&](std::string_view key) -> absl::StatusOr<int> {
    PDS_ASSIGN_OR_RETURN(double value, required(key));
    if (value != std::floor(value) || value <= 0 ||
        value > std::numeric_limits<int>::max()) {
      return BadKey(source_name, absl::StrCat(ToAbsl(parent), ".", ToAbsl(key)),
                    "must be a positive integer");
    }
    return static_cast<int>(value);
  };
  if (type == "default") {
    rope.type = RopeScalingType::kNone;
  } else if (type == "linear" || type == "dynamic") {
    rope.type =
        type == "linear" ? RopeScalingType::kLinear : RopeScalingType::kDynamic;
    PDS_ASSIGN_OR_RETURN(rope.factor, required("factor"));
    // transformers reads neither type's original_max_position_embeddings
    // (the config's max_position_embeddings is the original context), so
    // it is accepted and not used, as there.
    allowed.insert(allowed.end(),
                   {"factor", "original_max_position_embeddings"});
    rope.original_max_position = config->max_position_embeddings;
  } else if (type == "llama3") {
    rope.type = RopeScalingType::kLlama3;
    PDS_ASSIGN_OR_RETURN(rope.factor, required("factor"));
    PDS_ASSIGN_OR_RETURN(rope.low_freq_factor, required("low_freq_factor"));
    PDS_ASSIGN_OR_RETURN(rope.high_freq_factor, required("high_freq_factor"));
    PDS_ASSIGN_OR_RETURN(rope.original_max_position,
                         positive_int("original_max_position_embeddings"));
    allowed.insert(allowed.end(),
                   {"factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings"});
  } else if (type == "yarn") {
    rope.type = RopeScalingType::kYarn;
    PDS_ASSIGN_OR_RETURN(rope.factor, required("factor"));
    rope.original_max_position = config->max_position_embeddings;
    if (auto it = scaling.find("original_max_position_embeddings");
        it != scaling.end() && !it->is_null()) {
      PDS_ASSIGN_OR_RETURN(rope.original_max_position,
                           positive_int("original_max_position_embeddings"));
    }
    PDS_ASSIGN_OR_RETURN(std::optional<double> beta_fast, number("beta_fast"));
    PDS_ASSIGN_OR_RETURN(std::optional<double> beta_slow, number("beta_slow"));
    // transformers: `get("beta_fast") or 32`, so 0 also means the default.
    rope.beta_fast = beta_fast.value_or(0) != 0 ? *beta_fast : 32.0;
    rope.beta_slow = beta_slow.value_or(0) != 0 ? *beta_slow : 1.0;
    if (auto it = scaling.find("truncate");
        it != scaling.end() && !it->is_null()) {
      if (!it->is_boolean()) {
        return BadKey(source_name, absl::StrCat(ToAbsl(parent), ".truncate"),
                      "must be a boolean");
      }
      rope.truncate = it->get<bool>();
    }
    PDS_ASSIGN_OR_RETURN(std::optional<double> attention_factor,
                         number("attention_factor"));
    PDS_ASSIGN_OR_RETURN(std::optional<double> mscale, number("mscale"));
    PDS_ASSIGN_OR_RETURN(std::optional<double> mscale_all_dim,
                         number("mscale_all_dim"));
    auto get_mscale = [](double scale, double m) {
      return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
    };
    if (attention_factor.has_value()) {
      rope.attention_factor = *attention_factor;
    } else if (mscale.value_or(0) != 0 && mscale_all_dim.value_or(0) != 0) {
      rope.attention_factor = get_mscale(rope.factor, *mscale) /
                              get_mscale(rope.factor, *mscale_all_dim);
    } else {
      rope.attention_factor = get_mscale(rope.factor, 1.0);
    }
    allowed.insert(
        allowed.end(),
        {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
         "truncate", "attention_factor", "mscale", "mscale_all_dim"});
  } else {
    return BadKey(source_name, absl::StrCat(ToAbsl(parent), ".rope_type"),
                  absl::StrCat("has unsupported value \"", type,
                               "\" (default, linear, dynamic, llama3 or "
                               "yarn)"));
  }
  for (const auto& [key, value] : scaling.items()) {
    if (key == "rope_theta" && parent == "rope_parameters") continue;
    if (std::find(allowed.begin(), allowed.end(), key) == allowed.end()) {
      return BadKey(
          source_name, absl::StrCat(ToAbsl(parent), ".", key),
          absl::StrCat("is not supported with rope type \"", type, "\""));
    }
  }
  return absl::OkStatus();
}

// The context a scaled-RoPE model serves: transformers keeps the trained
// context in max_position_embeddings for linear and dynamic scaling and in
// original_max_position_embeddings for yarn; the factor stretches it (what
// vLLM serves too). Llama 3's config already names its long context.
int ScaledContext(const ModelConfig& config) {
  const RopeScaling& rope = config.rope_scaling;
  double context = config.max_position_embeddings;
  switch (rope.type) {
    case RopeScalingType::kLinear:
    case RopeScalingType::kDynamic:
      context = config.max_position_embeddings * rope.factor;
      break;
    case RopeScalingType::kYarn:
      context = std::max(context, rope.original_max_position * rope.factor);
      break;
    case RopeScalingType::kNone:
    case RopeScalingType::kLlama3:
    case RopeScalingType::kFreqFactors:
      break;
  }
  context = std::max<double>(context, config.max_position_embeddings);
  return static_cast<int>(
      std::min<double>(context, std::numeric_limits<int>::max() / 2));
}

}  // namespace

std::string_view RopeScalingName(RopeScalingType type) {
  switch (type) {
    case RopeScalingType::kNone:
      return "none";
    case RopeScalingType::kLinear:
      return "linear";
    case RopeScalingType::kDynamic:
      return "dynamic";
    case RopeScalingType::kLlama3:
      return "llama3";
    case RopeScalingType::kYarn:
      return "yarn";
    case RopeScalingType::kFreqFactors:
      return "freq_factors";
  }
  return "unknown";
}

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
  }
  return "unknown";
}

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
      return 2;
  }
  return 4;
}

absl::Status ModelConfig::Validate() const {
  if (!IsKnownArchitecture(architecture)) {
    return absl::InvalidArgumentError(
        absl::StrCat("config key \"model_type\": unsupported architecture \"",
                     architecture, "\" (", kKnownArchitectures, ")"));
  }
  PDS_RETURN_IF_ERROR(Positive(hidden_size, "hidden_size"));
  PDS_RETURN_IF_ERROR(Positive(intermediate_size, "intermediate_size"));
  PDS_RETURN_IF_ERROR(Positive(num_layers, "num_hidden_layers"));
  PDS_RETURN_IF_ERROR(Positive(num_heads, "num_attention_heads"));
  PDS_RETURN_IF_ERROR(Positive(num_kv_heads, "num_key_value_heads"));
  PDS_RETURN_IF_ERROR(Positive(head_dim, "head_dim"));
  PDS_RETURN_IF_ERROR(Positive(vocab_size, "vocab_size"));
  PDS_RETURN_IF_ERROR(
      Positive(max_position_embeddings, "max_position_embeddings"));
  if (num_heads % num_kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config key \"num_key_value_heads\" (", num_kv_heads,
                     ") must divide num_attention_heads (", num_heads, ")"));
  }
  if (head_dim % 2 != 0) {
    // RoPE rotates pairs of dimensions.
    return absl::InvalidArgumentError(absl::StrCat(
        "config key \"head_dim\" must be even for RoPE, got ", head_dim));
  }
  // q_dim/kv_dim and the largest tensor row counts are computed in int.
  if (static_cast<int64_t>(num_heads) * head_dim >
      std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(
        "config keys \"num_attention_heads\" * \"head_dim\" overflow");
  }
  if (!(rms_norm_eps > 0.0f) || !std::isfinite(rms_norm_eps)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config key \"rms_norm_eps\" must be positive, got ", rms_norm_eps));
  }
  if (!(rope_theta > 0.0f) || !std::isfinite(rope_theta)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config key \"rope_theta\" must be positive, got ", rope_theta));
  }
  if (sliding_window < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config key \"sliding_window\" must be positive, got ",
                     sliding_window));
  }
  if (!windowed_layers.empty() &&
      static_cast<int>(windowed_layers.size()) != num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config key \"layer_types\" lists ", windowed_layers.size(),
        " layers, not num_hidden_layers (", num_layers, ")"));
  }
  const RopeScaling& rope = rope_scaling;
  if (rope.type != RopeScalingType::kNone) {
    const std::string_view type = RopeScalingName(rope.type);
    if (!(rope.factor > 0) || !std::isfinite(rope.factor)) {
      return absl::InvalidArgumentError(
          absl::StrCat("config key \"rope_scaling.factor\" must be positive "
                       "for rope type ",
                       ToAbsl(type), ", got ", rope.factor));
    }
    if (rope.original_max_position <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config key \"rope_scaling.original_max_position_embeddings\" must "
          "be positive for rope type ",
          ToAbsl(type)));
    }
    if (rope.type == RopeScalingType::kLlama3 &&
        !(rope.low_freq_factor > 0 &&
          rope.high_freq_factor > rope.low_freq_factor)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config keys \"rope_scaling.low_freq_factor\" (",
          rope.low_freq_factor, ") and \"rope_scaling.high_freq_factor\" (",
          rope.high_freq_factor, ") must satisfy 0 < low < high"));
    }
    if (rope.type == RopeScalingType::kFreqFactors) {
      if (rope.freq_factors.size() != static_cast<size_t>(head_dim / 2)) {
        return absl::InvalidArgumentError(
            absl::StrCat("rope frequency factors: ", rope.freq_factors.size(),
                         " values for head_dim / 2 = ", head_dim / 2));
      }
      for (float f : rope.freq_factors) {
        if (!(f > 0) || !std::isfinite(f)) {
          return absl::InvalidArgumentError(
              absl::StrCat("rope frequency factors must be positive, got ", f));
        }
      }
    }
    if (rope.type == RopeScalingType::kYarn) {
      if (!(rope.beta_fast > 0) || !(rope.beta_slow > 0)) {
        return absl::InvalidArgumentError(
            "config keys \"rope_scaling.beta_fast\" and "
            "\"rope_scaling.beta_slow\" must be positive");
      }
      if (!(rope.attention_factor > 0) ||
          !std::isfinite(rope.attention_factor)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "config key \"rope_scaling.attention_factor\" must be positive, "
            "got ",
            rope.attention_factor));
      }
    }
  }
  PDS_RETURN_IF_ERROR(ValidateExperts(*this));
  if (bos_token_id >= vocab_size || eos_token_id >= vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("config keys \"bos_token_id\" (", bos_token_id,
                     ") / \"eos_token_id\" (", eos_token_id,
                     ") must be below vocab_size (", vocab_size, ")"));
  }
  return absl::OkStatus();
}

std::string ModelConfig::Identity() const {
  // Only what changes the meaning of hidden states and KV entries. Left out
  // on purpose: max_position_embeddings (a GGUF and an HF copy of one model
  // often disagree on it), storage dtype (activations and KV have their own
  // precision), tie_word_embeddings and bos/eos (they affect only sampling
  // on the worker that holds lm_head). Floats are printed with enough digits
  // to round-trip, so one float value always gives one string.
  char eps[32];
  char theta[32];
  std::snprintf(eps, sizeof(eps), "%.9g", static_cast<double>(rms_norm_eps));
  std::snprintf(theta, sizeof(theta), "%.9g", static_cast<double>(rope_theta));
  std::string identity = absl::StrCat(
      architecture, ";hidden=", hidden_size,
      ";intermediate=", intermediate_size, ";layers=", num_layers,
      ";heads=", num_heads, ";kv_heads=", num_kv_heads, ";head_dim=", head_dim,
      ";vocab=", vocab_size, ";rms_eps=", eps, ";rope_theta=", theta);
  // The family flags: each changes hidden states or KV.
  absl::StrAppend(&identity, ";qkv_bias=", qkv_bias ? 1 : 0,
                  ";o_bias=", o_bias ? 1 : 0, ";qk_norm=", qk_norm ? 1 : 0,
                  ";window=", sliding_window);
  if (!windowed_layers.empty()) {
    // Which layers window: one digit per layer.
    absl::StrAppend(&identity, "(layers=");
    for (bool windowed : windowed_layers) {
      absl::StrAppend(&identity, windowed ? "1" : "0");
    }
    absl::StrAppend(&identity, ")");
  }
  if (num_experts > 0) {
    // The routing and the experts change every hidden state after a sparse
    // layer.
    absl::StrAppend(&identity, ";experts=", num_experts,
                    "(top=", experts_per_token,
                    ",width=", expert_intermediate_size,
                    ",normalized=", normalize_expert_weights ? 1 : 0,
                    ",shared=", shared_expert_intermediate_size);
    if (!dense_layers.empty()) {
      absl::StrAppend(&identity, ",dense=");
      for (bool dense : dense_layers) {
        absl::StrAppend(&identity, dense ? "1" : "0");
      }
    }
    absl::StrAppend(&identity, ")");
  }
  absl::StrAppend(&identity,
                  ";rope=", ToAbsl(RopeScalingName(rope_scaling.type)));
  const RopeScaling& r = rope_scaling;
  switch (r.type) {
    case RopeScalingType::kNone:
      break;
    case RopeScalingType::kLinear:
    case RopeScalingType::kDynamic:
      absl::StrAppend(&identity, "(factor=", FormatDouble(r.factor),
                      ",original=", r.original_max_position, ")");
      break;
    case RopeScalingType::kLlama3:
      absl::StrAppend(&identity, "(factor=", FormatDouble(r.factor),
                      ",low=", FormatDouble(r.low_freq_factor),
                      ",high=", FormatDouble(r.high_freq_factor),
                      ",original=", r.original_max_position, ")");
      break;
    case RopeScalingType::kYarn:
      absl::StrAppend(&identity, "(factor=", FormatDouble(r.factor),
                      ",original=", r.original_max_position,
                      ",beta_fast=", FormatDouble(r.beta_fast),
                      ",beta_slow=", FormatDouble(r.beta_slow),
                      ",truncate=", r.truncate ? 1 : 0,
                      ",attention=", FormatDouble(r.attention_factor), ")");
      break;
    case RopeScalingType::kFreqFactors: {
      std::string values;
      for (float f : r.freq_factors) {
        absl::StrAppend(&values, values.empty() ? "" : ",", FormatDouble(f));
      }
      absl::StrAppend(&identity, "(", values, ")");
      break;
    }
  }
  return identity;
}

absl::StatusOr<ModelConfig> ParseHfConfigJson(std::string_view json_text,
                                              std::string_view source_name) {
  Json root;
  try {
    root = Json::parse(json_text.begin(), json_text.end());
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(ToAbsl(source_name), ": invalid JSON: ", e.what()));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(ToAbsl(source_name), ": config must be a JSON object"));
  }

  ModelConfig config;
  PDS_ASSIGN_OR_RETURN(std::optional<std::string> model_type,
                       OptionalString(root, "model_type", source_name));
  config.architecture = model_type.value_or("llama");
  const std::string& family = config.architecture;
  if (!IsKnownArchitecture(family)) {
    return BadKey(source_name, "model_type",
                  absl::StrCat("has unsupported value \"", family, "\" (",
                               kKnownArchitectures, ")"));
  }
  // The mixtures of experts share their attention with a dense family:
  // Qwen3-MoE Qwen3's (q/k norms, attention_bias), Qwen2-MoE Qwen2's (q/k/v
  // biases), Mixtral Mistral's (a window in every layer, but none unless
  // sliding_window is set: MixtralConfig's default is null).
  const bool moe =
      family == "qwen3_moe" || family == "qwen2_moe" || family == "mixtral";
  const std::string_view attention_family = family == "qwen3_moe"   ? "qwen3"
                                            : family == "qwen2_moe" ? "qwen2"
                                            : family == "mixtral"
                                                ? "mistral"
                                                : std::string_view(family);
  const bool is_qwen =
      attention_family == "qwen2" || attention_family == "qwen3";
  PDS_ASSIGN_OR_RETURN(std::optional<std::string> hidden_act,
                       OptionalString(root, "hidden_act", source_name));
  if (hidden_act.has_value() && *hidden_act != "silu") {
    return BadKey(source_name, "hidden_act",
                  absl::StrCat("has unsupported value \"", *hidden_act,
                               "\" (only silu)"));
  }
  PDS_ASSIGN_OR_RETURN(std::optional<bool> mlp_bias,
                       OptionalBool(root, "mlp_bias", source_name));
  if (mlp_bias.value_or(false)) {
    return BadKey(source_name, "mlp_bias", "= true is not supported");
  }
  PDS_ASSIGN_OR_RETURN(
      std::optional<double> partial_rotary,
      OptionalNumber(root, "partial_rotary_factor", source_name));
  if (partial_rotary.value_or(1.0) != 1.0) {
    return BadKey(source_name, "partial_rotary_factor",
                  "other than 1 is not supported (RoPE rotates whole heads)");
  }
  // Which family carries which flag, as each transformers model class
  // builds its attention: Qwen2 always has q/k/v biases (no o_proj bias);
  // Llama and Qwen3 have q/k/v and o_proj biases with attention_bias;
  // Qwen3 always normalizes q and k per head; Mistral has neither.
  PDS_ASSIGN_OR_RETURN(std::optional<bool> attention_bias,
                       OptionalBool(root, "attention_bias", source_name));
  if (attention_family == "qwen2") {
    config.qkv_bias = true;
  } else if (attention_family == "llama" || attention_family == "qwen3") {
    config.qkv_bias = config.o_bias = attention_bias.value_or(false);
  }
  config.qk_norm = attention_family == "qwen3";

  PDS_ASSIGN_OR_RETURN(config.hidden_size,
                       RequiredInt(root, "hidden_size", source_name));
  PDS_ASSIGN_OR_RETURN(config.intermediate_size,
                       RequiredInt(root, "intermediate_size", source_name));
  PDS_ASSIGN_OR_RETURN(config.num_layers,
                       RequiredInt(root, "num_hidden_layers", source_name));
  PDS_ASSIGN_OR_RETURN(config.num_heads,
                       RequiredInt(root, "num_attention_heads", source_name));
  PDS_ASSIGN_OR_RETURN(config.vocab_size,
                       RequiredInt(root, "vocab_size", source_name));
  PDS_ASSIGN_OR_RETURN(
      config.max_position_embeddings,
      RequiredInt(root, "max_position_embeddings", source_name));
  // Sliding window: Mistral attends over the last sliding_window keys in
  // every layer (transformers' default 4096 when the key is absent; null
  // turns it off). Qwen2/Qwen3 window only with use_sliding_window (their
  // configs ship sliding_window set and the flag false: no window), and then
  // only some layers: as transformers' Qwen2Config derives layer_types,
  // layer i windows when i >= max_window_layers (default 28), unless the
  // config lists layer_types itself.
  PDS_ASSIGN_OR_RETURN(std::optional<int> window,
                       OptionalInt(root, "sliding_window", source_name));
  if (attention_family == "mistral") {
    config.sliding_window = root.contains("sliding_window") ? window.value_or(0)
                            : family == "mixtral"           ? 0
                                                            : 4096;
    if (root.contains("sliding_window") && window.has_value() && *window <= 0) {
      return BadKey(source_name, "sliding_window", "must be positive or null");
    }
  } else if (is_qwen) {
    PDS_ASSIGN_OR_RETURN(std::optional<bool> use_window,
                         OptionalBool(root, "use_sliding_window", source_name));
    if (moe && use_window.value_or(false)) {
      // Qwen3MoeConfig windows every layer, Qwen2MoeConfig from
      // max_window_layers on; no published MoE checkpoint windows.
      return BadKey(source_name, "use_sliding_window",
                    absl::StrCat("= true is not supported for ", family));
    }
    PDS_ASSIGN_OR_RETURN(std::optional<int> max_window_layers,
                         OptionalInt(root, "max_window_layers", source_name));
    if (max_window_layers.value_or(0) < 0) {
      return BadKey(source_name, "max_window_layers", "must not be negative");
    }
    if (use_window.value_or(false)) {
      // Qwen2Config / Qwen3Config default to 4096 when the key is absent.
      config.sliding_window =
          root.contains("sliding_window") ? window.value_or(0) : 4096;
      if (window.has_value() && *window <= 0) {
        return BadKey(source_name, "sliding_window",
                      "must be positive with use_sliding_window");
      }
      config.windowed_layers.assign(config.num_layers, false);
      for (int l = max_window_layers.value_or(28); l < config.num_layers; ++l) {
        config.windowed_layers[l] = true;
      }
    }
  }
  // transformers >= 4.53 writes the per-layer attention kinds. Qwen takes
  // them as they are; the other families window every layer or none, so
  // their list must agree with that one kind.
  if (auto it = root.find("layer_types"); it != root.end() && !it->is_null()) {
    if (!it->is_array())
      return BadKey(source_name, "layer_types", "must be a list");
    if (is_qwen) {
      if (static_cast<int>(it->size()) != config.num_layers) {
        return BadKey(source_name, "layer_types",
                      absl::StrCat("lists ", it->size(), " layers, not ",
                                   config.num_layers));
      }
      std::vector<bool> windowed;
      for (const Json& kind : *it) {
        const bool known = kind.is_string() &&
                           (kind.get<std::string>() == "sliding_attention" ||
                            kind.get<std::string>() == "full_attention");
        if (!known) {
          return BadKey(source_name, "layer_types",
                        "must list \"full_attention\" or "
                        "\"sliding_attention\" for each layer");
        }
        windowed.push_back(kind.get<std::string>() == "sliding_attention");
      }
      // Without use_sliding_window transformers' sliding_window is None:
      // "sliding_attention" layers then attend to everything.
      if (config.sliding_window > 0) config.windowed_layers = windowed;
    } else {
      const std::string want =
          config.sliding_window > 0 ? "sliding_attention" : "full_attention";
      for (const Json& kind : *it) {
        if (!kind.is_string() || kind.get<std::string>() != want) {
          return BadKey(
              source_name, "layer_types",
              absl::StrCat("must list \"", want, "\" for every layer (", family,
                           " has one attention kind for all layers)"));
        }
      }
    }
  }
  // One description per meaning: no windowed layer is no window, every layer
  // windowed is the Mistral form (an empty list).
  if (!config.windowed_layers.empty()) {
    bool any = false, all = true;
    for (bool windowed : config.windowed_layers) {
      any = any || windowed;
      all = all && windowed;
    }
    if (!any) config.sliding_window = 0;
    if (!any || all) config.windowed_layers.clear();
  }

  // RoPE: rope_theta and rope_scaling, or transformers v5's
  // rope_parameters holding both.
  PDS_ASSIGN_OR_RETURN(std::optional<double> theta,
                       OptionalNumber(root, "rope_theta", source_name));
  if (auto it = root.find("rope_parameters");
      it != root.end() && !it->is_null()) {
    if (!it->is_object()) {
      return BadKey(source_name, "rope_parameters", "must be an object");
    }
    PDS_ASSIGN_OR_RETURN(
        std::optional<double> nested_theta,
        NestedNumber(*it, "rope_parameters", "rope_theta", source_name));
    if (nested_theta.has_value()) theta = nested_theta;
    PDS_RETURN_IF_ERROR(
        ParseRopeScaling(*it, "rope_parameters", source_name, &config));
  }
  if (auto it = root.find("rope_scaling"); it != root.end() && !it->is_null()) {
    PDS_RETURN_IF_ERROR(
        ParseRopeScaling(*it, "rope_scaling", source_name, &config));
  }
  config.rope_theta = static_cast<float>(theta.value_or(10000.0));

  PDS_ASSIGN_OR_RETURN(std::optional<double> eps,
                       OptionalNumber(root, "rms_norm_eps", source_name));
  if (!eps.has_value())
    return BadKey(source_name, "rms_norm_eps", "is missing");
  config.rms_norm_eps = static_cast<float>(*eps);

  PDS_ASSIGN_OR_RETURN(std::optional<int> kv_heads,
                       OptionalInt(root, "num_key_value_heads", source_name));
  config.num_kv_heads = kv_heads.value_or(config.num_heads);
  PDS_ASSIGN_OR_RETURN(std::optional<int> head_dim,
                       OptionalInt(root, "head_dim", source_name));
  if (head_dim.has_value()) {
    config.head_dim = *head_dim;
  } else if (family == "qwen3") {
    // Qwen3Config's default (Qwen3MoeConfig has none: hidden / heads).
    config.head_dim = 128;
  } else if (config.num_heads > 0) {
    if (config.hidden_size % config.num_heads != 0) {
      return BadKey(source_name, "head_dim",
                    "is missing and hidden_size is not a multiple of "
                    "num_attention_heads");
    }
    config.head_dim = config.hidden_size / config.num_heads;
  }
  PDS_ASSIGN_OR_RETURN(std::optional<bool> tie,
                       OptionalBool(root, "tie_word_embeddings", source_name));
  config.tie_word_embeddings = tie.value_or(false);
  PDS_ASSIGN_OR_RETURN(std::optional<int> bos,
                       OptionalTokenId(root, "bos_token_id", source_name));
  config.bos_token_id = bos.value_or(config.bos_token_id);
  PDS_ASSIGN_OR_RETURN(std::optional<int> eos,
                       OptionalTokenId(root, "eos_token_id", source_name));
  config.eos_token_id = eos.value_or(config.eos_token_id);
  PDS_RETURN_IF_ERROR(
      ReadEosTokenIds(root, source_name, &config.eos_token_ids));
  PDS_ASSIGN_OR_RETURN(std::optional<std::string> torch_dtype,
                       OptionalString(root, "torch_dtype", source_name));
  if (torch_dtype.has_value()) {
    PDS_ASSIGN_OR_RETURN(config.dtype,
                         ParseTorchDtype(*torch_dtype, source_name));
  }

  if (moe) PDS_RETURN_IF_ERROR(ParseExperts(root, source_name, &config));

  absl::Status valid = config.Validate();
  if (!valid.ok()) {
    return absl::Status(
        valid.code(), absl::StrCat(ToAbsl(source_name), ": ", valid.message()));
  }
  config.max_position_embeddings = ScaledContext(config);
  return config;
}

absl::Status MergeGenerationConfigJson(std::string_view json_text,
                                       std::string_view source_name,
                                       ModelConfig* config) {
  const Json root = Json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(ToAbsl(source_name), ": not a JSON object"));
  }
  std::vector<int> ids;
  PDS_RETURN_IF_ERROR(ReadEosTokenIds(root, source_name, &ids));
  for (int id : ids) {
    if (id >= config->vocab_size) {
      return BadKey(source_name, "eos_token_id",
                    absl::StrCat("id ", id, " is outside the vocabulary (",
                                 config->vocab_size, ")"));
    }
    if (!config->IsEos(id)) config->eos_token_ids.push_back(id);
  }
  return absl::OkStatus();
}

}  // namespace pdserve::model
