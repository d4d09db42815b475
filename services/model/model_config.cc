#include "model/model_config.h"

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

absl::Status Positive(int value, std::string_view key) {
  if (value <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config key \"", ToAbsl(key), "\" must be positive, got ", value));
  }
  return absl::OkStatus();
}

}  // namespace

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
  if (architecture != "llama") {
    return absl::InvalidArgumentError(
        absl::StrCat("config key \"model_type\": unsupported architecture \"",
                     architecture, "\" (only llama)"));
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
  return absl::StrCat(
      architecture, ";hidden=", hidden_size,
      ";intermediate=", intermediate_size, ";layers=", num_layers,
      ";heads=", num_heads, ";kv_heads=", num_kv_heads, ";head_dim=", head_dim,
      ";vocab=", vocab_size, ";rms_eps=", eps, ";rope_theta=", theta);
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
  if (model_type.has_value() && *model_type != "llama") {
    return BadKey(source_name, "model_type",
                  absl::StrCat("has unsupported value \"", *model_type,
                               "\" (only llama)"));
  }
  // Llama variants the engine does not implement must not load silently with
  // wrong numerics.
  if (auto it = root.find("rope_scaling"); it != root.end() && !it->is_null()) {
    return BadKey(source_name, "rope_scaling",
                  "is not supported (must be null)");
  }
  PDS_ASSIGN_OR_RETURN(std::optional<std::string> hidden_act,
                       OptionalString(root, "hidden_act", source_name));
  if (hidden_act.has_value() && *hidden_act != "silu") {
    return BadKey(source_name, "hidden_act",
                  absl::StrCat("has unsupported value \"", *hidden_act,
                               "\" (only silu)"));
  }
  for (const char* bias_key : {"attention_bias", "mlp_bias"}) {
    PDS_ASSIGN_OR_RETURN(std::optional<bool> has_bias,
                         OptionalBool(root, bias_key, source_name));
    if (has_bias.value_or(false)) {
      return BadKey(source_name, bias_key, "= true is not supported");
    }
  }

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
  } else if (config.num_heads > 0) {
    if (config.hidden_size % config.num_heads != 0) {
      return BadKey(source_name, "head_dim",
                    "is missing and hidden_size is not a multiple of "
                    "num_attention_heads");
    }
    config.head_dim = config.hidden_size / config.num_heads;
  }
  PDS_ASSIGN_OR_RETURN(std::optional<double> theta,
                       OptionalNumber(root, "rope_theta", source_name));
  config.rope_theta = static_cast<float>(theta.value_or(10000.0));
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

  absl::Status valid = config.Validate();
  if (!valid.ok()) {
    return absl::Status(
        valid.code(), absl::StrCat(ToAbsl(source_name), ": ", valid.message()));
  }
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
