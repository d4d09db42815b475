#include "model_test_util.h"

#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/float16.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace pdserve::model::testing {
namespace {

constexpr uint32_t kTypeUint32 = 4;
constexpr uint32_t kTypeFloat32 = 6;
constexpr uint32_t kTypeBool = 7;
constexpr uint32_t kTypeString = 8;
constexpr uint32_t kTypeArray = 9;
constexpr uint32_t kTypeInt32 = 5;

void AppendF32(std::string* out, float value) {
  out->append(reinterpret_cast<const char*>(&value), 4);
}

std::string EncodeValues(const std::vector<float>& values, DType dtype) {
  std::string bytes;
  for (float value : values) {
    uint16_t bits = 0;
    switch (dtype) {
      case DType::kF32:
        AppendF32(&bytes, value);
        continue;
      case DType::kF16:
        bits = FloatToF16(value);
        break;
      case DType::kBF16:
        bits = FloatToBf16(value);
        break;
    }
    bytes.append(reinterpret_cast<const char*>(&bits), 2);
  }
  return bytes;
}

float RoundThrough(float value, DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return value;
    case DType::kF16:
      return F16ToFloat(FloatToF16(value));
    case DType::kBF16:
      return Bf16ToFloat(FloatToBf16(value));
  }
  return value;
}

uint32_t GgmlType(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 0;
    case DType::kF16:
      return 1;
    case DType::kBF16:
      return 30;
  }
  return 0;
}

std::string SafetensorsDtype(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
  }
  return "F32";
}

// Canonical -> GGUF names, the inverse of the reader's mapping (written out
// independently so the test checks the reader rather than itself).
std::string GgufName(const std::string& canonical) {
  static const std::map<std::string, std::string> kGlobal = {
      {"model.embed_tokens.weight", "token_embd.weight"},
      {"model.norm.weight", "output_norm.weight"},
      {"lm_head.weight", "output.weight"},
  };
  static const std::map<std::string, std::string> kLayer = {
      {"input_layernorm.weight", "attn_norm.weight"},
      {"self_attn.q_proj.weight", "attn_q.weight"},
      {"self_attn.k_proj.weight", "attn_k.weight"},
      {"self_attn.v_proj.weight", "attn_v.weight"},
      {"self_attn.o_proj.weight", "attn_output.weight"},
      {"post_attention_layernorm.weight", "ffn_norm.weight"},
      {"mlp.gate_proj.weight", "ffn_gate.weight"},
      {"mlp.up_proj.weight", "ffn_up.weight"},
      {"mlp.down_proj.weight", "ffn_down.weight"},
  };
  if (auto it = kGlobal.find(canonical); it != kGlobal.end()) return it->second;
  // model.layers.N.suffix
  const std::string prefix = "model.layers.";
  size_t dot = canonical.find('.', prefix.size());
  std::string layer = canonical.substr(prefix.size(), dot - prefix.size());
  return "blk." + layer + "." + kLayer.at(canonical.substr(dot + 1));
}

}  // namespace

ScopedTempDir::ScopedTempDir() {
  char pattern[] = "/tmp/pdserve_model_test.XXXXXX";
  char* created = ::mkdtemp(pattern);
  if (created == nullptr) {
    ADD_FAILURE() << "mkdtemp failed";
    return;
  }
  path_ = created;
}

ScopedTempDir::~ScopedTempDir() {
  if (path_.empty()) return;
  std::error_code error;
  std::filesystem::remove_all(path_, error);
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << "cannot write " << path;
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

void AppendU32(std::string* out, uint32_t value) {
  out->append(reinterpret_cast<const char*>(&value), 4);
}

void AppendU64(std::string* out, uint64_t value) {
  out->append(reinterpret_cast<const char*>(&value), 8);
}

void AppendString(std::string* out, const std::string& text) {
  AppendU64(out, text.size());
  out->append(text);
}

void PutU32At(std::string* bytes, size_t offset, uint32_t value) {
  std::memcpy(bytes->data() + offset, &value, 4);
}

void PutU64At(std::string* bytes, size_t offset, uint64_t value) {
  std::memcpy(bytes->data() + offset, &value, 8);
}

void GgufBuilder::AddRaw(const std::string& key, uint32_t type,
                         std::string payload) {
  std::string encoded;
  AppendU32(&encoded, type);
  encoded += payload;
  metadata_.emplace_back(key, std::move(encoded));
}

void GgufBuilder::AddU32(const std::string& key, uint32_t value) {
  std::string payload;
  AppendU32(&payload, value);
  AddRaw(key, kTypeUint32, payload);
}

void GgufBuilder::AddF32(const std::string& key, float value) {
  std::string payload;
  AppendF32(&payload, value);
  AddRaw(key, kTypeFloat32, payload);
}

void GgufBuilder::AddBool(const std::string& key, bool value) {
  AddRaw(key, kTypeBool, std::string(1, value ? '\1' : '\0'));
}

void GgufBuilder::AddStr(const std::string& key, const std::string& value) {
  std::string payload;
  AppendString(&payload, value);
  AddRaw(key, kTypeString, payload);
}

void GgufBuilder::AddStrArray(const std::string& key,
                              const std::vector<std::string>& values) {
  std::string payload;
  AppendU32(&payload, kTypeString);
  AppendU64(&payload, values.size());
  for (const std::string& value : values) AppendString(&payload, value);
  AddRaw(key, kTypeArray, payload);
}

void GgufBuilder::AddF32Array(const std::string& key,
                              const std::vector<float>& values) {
  std::string payload;
  AppendU32(&payload, kTypeFloat32);
  AppendU64(&payload, values.size());
  for (float value : values) AppendF32(&payload, value);
  AddRaw(key, kTypeArray, payload);
}

void GgufBuilder::AddI32Array(const std::string& key,
                              const std::vector<int32_t>& values) {
  std::string payload;
  AppendU32(&payload, kTypeInt32);
  AppendU64(&payload, values.size());
  for (int32_t value : values)
    AppendU32(&payload, static_cast<uint32_t>(value));
  AddRaw(key, kTypeArray, payload);
}

bool GgufBuilder::RemoveMetadata(const std::string& key) {
  for (auto it = metadata_.begin(); it != metadata_.end(); ++it) {
    if (it->first == key) {
      metadata_.erase(it);
      return true;
    }
  }
  return false;
}

void GgufBuilder::RenameMetadataPrefix(const std::string& from,
                                       const std::string& to) {
  for (auto& entry : metadata_) {
    if (entry.first.rfind(from, 0) == 0) {
      entry.first = to + entry.first.substr(from.size());
    }
  }
}

std::string GgufBuilder::Build() const {
  auto align = [&](uint64_t value) {
    return (value + alignment - 1) / alignment * alignment;
  };
  std::string out = "GGUF";
  AppendU32(&out, version);
  AppendU64(&out, tensors_.size());
  AppendU64(&out, metadata_.size());
  for (const auto& [key, encoded] : metadata_) {
    AppendString(&out, key);
    out += encoded;
  }
  std::vector<uint64_t> offsets;
  uint64_t next = 0;
  for (const Tensor& tensor : tensors_) {
    offsets.push_back(next);
    next = align(next + tensor.data.size());
  }
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const Tensor& tensor = tensors_[i];
    AppendString(&out, tensor.name);
    AppendU32(&out, static_cast<uint32_t>(tensor.ne.size()));
    for (uint64_t dim : tensor.ne) AppendU64(&out, dim);
    AppendU32(&out, tensor.ggml_type);
    AppendU64(&out, tensor.offset_override.value_or(offsets[i]));
  }
  out.resize(align(out.size()), '\0');
  const size_t data_start = out.size();
  for (size_t i = 0; i < tensors_.size(); ++i) {
    out.resize(data_start + offsets[i], '\0');
    out += tensors_[i].data;
  }
  return out;
}

std::string BuildSafetensorsRaw(const std::string& header_json,
                                const std::string& data) {
  std::string out;
  AppendU64(&out, header_json.size());
  out += header_json;
  out += data;
  return out;
}

std::string BuildSafetensors(const std::vector<SafetensorsEntry>& entries) {
  nlohmann::json header = nlohmann::json::object();
  header["__metadata__"] = {{"format", "pt"}};
  std::string data;
  for (const SafetensorsEntry& entry : entries) {
    header[entry.name] = {
        {"dtype", entry.dtype},
        {"shape", entry.shape},
        {"data_offsets", {data.size(), data.size() + entry.data.size()}}};
    data += entry.data;
  }
  std::string text = header.dump();
  // Real writers pad the header to 8 bytes; keep that so data stays aligned.
  text.resize((text.size() + 7) / 8 * 8, ' ');
  return BuildSafetensorsRaw(text, data);
}

TinyModel MakeTinyModel(DType dtype) {
  TinyModel model;
  model.dtype = dtype;
  ModelConfig& config = model.config;
  config.hidden_size = 8;
  config.intermediate_size = 12;
  config.num_layers = 2;
  config.num_heads = 2;
  config.num_kv_heads = 1;
  config.head_dim = 4;
  config.vocab_size = 16;
  config.max_position_embeddings = 32;
  config.rms_norm_eps = 1e-5f;
  config.rope_theta = 10000.0f;
  config.dtype = dtype;

  const int64_t hidden = 8, inter = 12, q_dim = 8, kv_dim = 4, vocab = 16;
  auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    int64_t count = 1;
    for (int64_t dim : shape) count *= dim;
    std::vector<float> values(count);
    // Distinct, sign-varying values so any row/column mix-up shows.
    uint32_t state = static_cast<uint32_t>(std::hash<std::string>()(name));
    for (int64_t i = 0; i < count; ++i) {
      state = state * 1664525u + 1013904223u;
      float value = static_cast<float>(static_cast<int32_t>(state >> 8)) /
                    static_cast<float>(1 << 24);
      values[i] = RoundThrough(value * 3.0f, dtype);
    }
    model.values[name] = std::move(values);
    model.shapes[name] = std::move(shape);
  };
  add("model.embed_tokens.weight", {vocab, hidden});
  for (int layer = 0; layer < config.num_layers; ++layer) {
    const std::string prefix = "model.layers." + std::to_string(layer) + ".";
    add(prefix + "input_layernorm.weight", {hidden});
    add(prefix + "self_attn.q_proj.weight", {q_dim, hidden});
    add(prefix + "self_attn.k_proj.weight", {kv_dim, hidden});
    add(prefix + "self_attn.v_proj.weight", {kv_dim, hidden});
    add(prefix + "self_attn.o_proj.weight", {hidden, q_dim});
    add(prefix + "post_attention_layernorm.weight", {hidden});
    add(prefix + "mlp.gate_proj.weight", {inter, hidden});
    add(prefix + "mlp.up_proj.weight", {inter, hidden});
    add(prefix + "mlp.down_proj.weight", {hidden, inter});
  }
  add("model.norm.weight", {hidden});
  add("lm_head.weight", {vocab, hidden});
  return model;
}

std::string TinyConfigJson(const ModelConfig& config, DType dtype) {
  nlohmann::json json = {
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"hidden_size", config.hidden_size},
      {"intermediate_size", config.intermediate_size},
      {"num_hidden_layers", config.num_layers},
      {"num_attention_heads", config.num_heads},
      {"num_key_value_heads", config.num_kv_heads},
      {"head_dim", config.head_dim},
      {"rms_norm_eps", config.rms_norm_eps},
      {"rope_theta", config.rope_theta},
      {"max_position_embeddings", config.max_position_embeddings},
      {"vocab_size", config.vocab_size},
      {"bos_token_id", 1},
      {"eos_token_id", 2},
      {"hidden_act", "silu"},
      {"tie_word_embeddings", false},
      {"torch_dtype", dtype == DType::kF32   ? "float32"
                      : dtype == DType::kF16 ? "float16"
                                             : "bfloat16"},
  };
  return json.dump(2);
}

GgufBuilder TinyGguf(const TinyModel& model) {
  const ModelConfig& config = model.config;
  GgufBuilder builder;
  builder.AddStr("general.architecture", "llama");
  builder.AddStr("general.name", "tiny");
  builder.AddU32("llama.context_length", config.max_position_embeddings);
  builder.AddU32("llama.embedding_length", config.hidden_size);
  builder.AddU32("llama.feed_forward_length", config.intermediate_size);
  builder.AddU32("llama.block_count", config.num_layers);
  builder.AddU32("llama.attention.head_count", config.num_heads);
  builder.AddU32("llama.attention.head_count_kv", config.num_kv_heads);
  builder.AddU32("llama.rope.dimension_count", config.head_dim);
  builder.AddF32("llama.attention.layer_norm_rms_epsilon", config.rms_norm_eps);
  builder.AddF32("llama.rope.freq_base", config.rope_theta);
  builder.AddStr("tokenizer.ggml.model", "llama");
  std::vector<std::string> tokens;
  std::vector<float> scores;
  std::vector<int32_t> types;
  for (int i = 0; i < config.vocab_size; ++i) {
    tokens.push_back("tok" + std::to_string(i));
    scores.push_back(-static_cast<float>(i));
    types.push_back(1);
  }
  builder.AddStrArray("tokenizer.ggml.tokens", tokens);
  builder.AddF32Array("tokenizer.ggml.scores", scores);
  builder.AddI32Array("tokenizer.ggml.token_type", types);
  builder.AddU32("tokenizer.ggml.bos_token_id", 1);
  builder.AddU32("tokenizer.ggml.eos_token_id", 2);
  builder.AddU32("tokenizer.ggml.unknown_token_id", 0);
  builder.AddBool("tokenizer.ggml.add_bos_token", true);

  const int64_t head_dim = config.head_dim;
  for (const auto& [name, values] : model.values) {
    const std::vector<int64_t>& shape = model.shapes.at(name);
    std::vector<float> stored = values;
    const bool is_qk = name.find("q_proj") != std::string::npos ||
                       name.find("k_proj") != std::string::npos;
    if (is_qk) {
      // Meta interleaved layout: GGUF row h*d + 2j + p holds HF row
      // h*d + p*d/2 + j.
      const int64_t cols = shape[1];
      for (int64_t head = 0; head < shape[0] / head_dim; ++head) {
        for (int64_t p = 0; p < 2; ++p) {
          for (int64_t j = 0; j < head_dim / 2; ++j) {
            const int64_t gguf_row = head * head_dim + 2 * j + p;
            const int64_t hf_row = head * head_dim + p * head_dim / 2 + j;
            std::copy_n(values.begin() + hf_row * cols, cols,
                        stored.begin() + gguf_row * cols);
          }
        }
      }
    }
    GgufBuilder::Tensor tensor;
    tensor.name = GgufName(name);
    tensor.ne.assign(shape.rbegin(), shape.rend());
    tensor.ggml_type = GgmlType(model.dtype);
    tensor.data = EncodeValues(stored, model.dtype);
    builder.AddTensor(std::move(tensor));
  }
  return builder;
}

void WriteTinySafetensors(const TinyModel& model, const std::string& folder) {
  std::vector<SafetensorsEntry> entries;
  for (const auto& [name, values] : model.values) {
    entries.push_back({name, SafetensorsDtype(model.dtype),
                       model.shapes.at(name),
                       EncodeValues(values, model.dtype)});
  }
  WriteBytes(folder + "/model.safetensors", BuildSafetensors(entries));
  WriteBytes(folder + "/config.json",
             TinyConfigJson(model.config, model.dtype));
}

}  // namespace pdserve::model::testing
