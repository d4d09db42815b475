#include "model/gguf_writer.h"

#include <cstdio>
#include <cstring>
#include <memory>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/gguf_file.h"
#include "model/tensor_layout.h"

namespace pdserve::model {
namespace {

constexpr uint64_t kAlignment = 32;

void AppendU32(std::string* out, uint32_t value) {
  out->append(reinterpret_cast<const char*>(&value), 4);
}
void AppendU64(std::string* out, uint64_t value) {
  out->append(reinterpret_cast<const char*>(&value), 8);
}
void AppendString(std::string* out, const std::string& text) {
  AppendU64(out, text.size());
  *out += text;
}

class MetadataWriter {
 public:
  void U32(const std::string& key, uint32_t value) {
    Key(key, GgufValueType::kUint32);
    AppendU32(&bytes_, value);
  }
  void F32(const std::string& key, float value) {
    Key(key, GgufValueType::kFloat32);
    bytes_.append(reinterpret_cast<const char*>(&value), 4);
  }
  void Bool(const std::string& key, bool value) {
    Key(key, GgufValueType::kBool);
    bytes_.push_back(value ? 1 : 0);
  }
  void Str(const std::string& key, const std::string& value) {
    Key(key, GgufValueType::kString);
    AppendString(&bytes_, value);
  }
  void StrArray(const std::string& key, const std::vector<std::string>& v) {
    Key(key, GgufValueType::kArray);
    AppendU32(&bytes_, static_cast<uint32_t>(GgufValueType::kString));
    AppendU64(&bytes_, v.size());
    for (const std::string& s : v) AppendString(&bytes_, s);
  }
  void F32Array(const std::string& key, const std::vector<float>& v) {
    Key(key, GgufValueType::kArray);
    AppendU32(&bytes_, static_cast<uint32_t>(GgufValueType::kFloat32));
    AppendU64(&bytes_, v.size());
    bytes_.append(reinterpret_cast<const char*>(v.data()), 4 * v.size());
  }
  void I32Array(const std::string& key, const std::vector<int32_t>& v) {
    Key(key, GgufValueType::kArray);
    AppendU32(&bytes_, static_cast<uint32_t>(GgufValueType::kInt32));
    AppendU64(&bytes_, v.size());
    bytes_.append(reinterpret_cast<const char*>(v.data()), 4 * v.size());
  }
  int count() const { return count_; }
  const std::string& bytes() const { return bytes_; }

 private:
  void Key(const std::string& key, GgufValueType type) {
    AppendString(&bytes_, key);
    AppendU32(&bytes_, static_cast<uint32_t>(type));
    ++count_;
  }
  std::string bytes_;
  int count_ = 0;
};

// Meta interleaved layout: stored row h·d + 2j + p holds HF row
// h·d + p·d/2 + j.
std::vector<float> InterleaveRope(const std::vector<float>& hf, int64_t rows,
                                  int64_t cols, int64_t head_dim) {
  std::vector<float> stored(hf.size());
  for (int64_t head = 0; head < rows / head_dim; ++head) {
    for (int64_t p = 0; p < 2; ++p) {
      for (int64_t j = 0; j < head_dim / 2; ++j) {
        const int64_t stored_row = head * head_dim + 2 * j + p;
        const int64_t hf_row = head * head_dim + p * head_dim / 2 + j;
        std::memcpy(stored.data() + stored_row * cols,
                    hf.data() + hf_row * cols, cols * sizeof(float));
      }
    }
  }
  return stored;
}

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};

}  // namespace

std::string GgufNameFromCanonical(const std::string& name) {
  static const std::pair<const char*, const char*> kGlobal[] = {
      {"model.embed_tokens.weight", "token_embd.weight"},
      {"model.norm.weight", "output_norm.weight"},
      {"lm_head.weight", "output.weight"},
  };
  static const std::pair<const char*, const char*> kLayer[] = {
      {"input_layernorm", "attn_norm"},
      {"self_attn.q_proj", "attn_q"},
      {"self_attn.k_proj", "attn_k"},
      {"self_attn.v_proj", "attn_v"},
      {"self_attn.o_proj", "attn_output"},
      {"post_attention_layernorm", "ffn_norm"},
      {"mlp.gate_proj", "ffn_gate"},
      {"mlp.up_proj", "ffn_up"},
      {"mlp.down_proj", "ffn_down"},
  };
  for (const auto& [canonical, gguf] : kGlobal) {
    if (name == canonical) return gguf;
  }
  const std::string kPrefix = "model.layers.";
  if (!absl::StartsWith(name, kPrefix)) return name;
  const size_t dot = name.find('.', kPrefix.size());
  const size_t last = name.rfind('.');
  if (dot == std::string::npos || last <= dot) return name;
  const std::string layer = name.substr(kPrefix.size(), dot - kPrefix.size());
  const std::string stem = name.substr(dot + 1, last - dot - 1);
  for (const auto& [canonical, gguf] : kLayer) {
    if (stem == canonical) {
      return absl::StrCat("blk.", layer, ".", gguf, name.substr(last));
    }
  }
  return name;
}

TensorFormat Q4KMFormatOf(const ModelConfig& config, const std::string& name) {
  if (!absl::EndsWith(name, "proj.weight") && name != "lm_head.weight" &&
      name != "model.embed_tokens.weight") {
    return TensorFormat::kF32;  // norms
  }
  if (name == "lm_head.weight") return TensorFormat::kQ6_K;
  if (absl::EndsWith(name, "v_proj.weight") ||
      absl::EndsWith(name, "down_proj.weight")) {
    // llama.cpp's use_more_bits(i, n).
    int layer = 0;
    const std::string rest = name.substr(std::string("model.layers.").size());
    if (absl::SimpleAtoi(rest.substr(0, rest.find('.')), &layer)) {
      const int n = config.num_layers;
      if (layer < n / 8 || layer >= 7 * n / 8 || (layer - n / 8) % 3 == 2) {
        return TensorFormat::kQ6_K;
      }
    }
  }
  return TensorFormat::kQ4_K;
}

namespace {

// <unk>, <s>, </s>, the 256 byte tokens, then "tok<i>".
void WritePlaceholderVocabulary(const ModelConfig& config,
                                MetadataWriter& meta) {
  meta.Str("tokenizer.ggml.model", "llama");
  std::vector<std::string> tokens;
  std::vector<float> scores;
  std::vector<int32_t> types;
  for (int i = 0; i < config.vocab_size; ++i) {
    if (i == 0) {
      tokens.push_back("<unk>");
      types.push_back(2);
    } else if (i == 1 || i == 2) {
      tokens.push_back(i == 1 ? "<s>" : "</s>");
      types.push_back(3);
    } else if (i < 3 + 256) {
      char text[8];
      std::snprintf(text, sizeof(text), "<0x%02X>", i - 3);
      tokens.push_back(text);
      types.push_back(6);
    } else {
      tokens.push_back(absl::StrCat("tok", i));
      types.push_back(1);
    }
    scores.push_back(-static_cast<float>(i));
  }
  meta.StrArray("tokenizer.ggml.tokens", tokens);
  meta.F32Array("tokenizer.ggml.scores", scores);
  meta.I32Array("tokenizer.ggml.token_type", types);
  meta.U32("tokenizer.ggml.bos_token_id", config.bos_token_id);
  meta.U32("tokenizer.ggml.eos_token_id", config.eos_token_id);
  meta.U32("tokenizer.ggml.unknown_token_id", 0);
  meta.Bool("tokenizer.ggml.add_bos_token", true);
}

// tokenizer.ggml.* from a GGUF vocabulary (what GgufWeightSource reads back
// as its tokenizer_spec()).
absl::Status WriteVocabulary(const TokenizerSpec& v, const ModelConfig& config,
                             MetadataWriter& meta) {
  if (v.ggml_model.empty() ||
      static_cast<int64_t>(v.tokens.size()) != config.vocab_size ||
      (!v.scores.empty() && v.scores.size() != v.tokens.size()) ||
      (!v.token_types.empty() && v.token_types.size() != v.tokens.size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the vocabulary to embed must be a GGUF one (tokenizer.ggml.model "
        "set) of exactly vocab_size (",
        config.vocab_size, ") tokens with as many scores and types; it has ",
        v.tokens.size(), " tokens, model \"", v.ggml_model, "\""));
  }
  meta.Str("tokenizer.ggml.model", v.ggml_model);
  if (!v.ggml_pre.empty()) meta.Str("tokenizer.ggml.pre", v.ggml_pre);
  meta.StrArray("tokenizer.ggml.tokens", v.tokens);
  if (!v.scores.empty()) meta.F32Array("tokenizer.ggml.scores", v.scores);
  if (!v.token_types.empty()) {
    meta.I32Array("tokenizer.ggml.token_type", v.token_types);
  }
  if (!v.merges.empty()) meta.StrArray("tokenizer.ggml.merges", v.merges);
  if (!v.chat_template.empty()) {
    meta.Str("tokenizer.chat_template", v.chat_template);
  }
  const std::pair<const char*, int32_t> ids[] = {
      {"tokenizer.ggml.bos_token_id", v.bos_token_id},
      {"tokenizer.ggml.eos_token_id", v.eos_token_id},
      {"tokenizer.ggml.unknown_token_id", v.unk_token_id},
      {"tokenizer.ggml.padding_token_id", v.pad_token_id}};
  for (const auto& [key, id] : ids) {
    if (id >= 0) meta.U32(key, static_cast<uint32_t>(id));
  }
  meta.Bool("tokenizer.ggml.add_bos_token", v.add_bos);
  meta.Bool("tokenizer.ggml.add_eos_token", v.add_eos);
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteLlamaGguf(const std::string& path, const ModelConfig& config,
                            const TensorValuesFn& values,
                            const TensorFormatFn& format_of,
                            const TokenizerSpec* vocabulary) {
  MetadataWriter meta;
  meta.Str("general.architecture", "llama");
  meta.Str("general.name", "pdserve-generated");
  meta.U32("general.alignment", kAlignment);
  meta.U32("llama.context_length", config.max_position_embeddings);
  meta.U32("llama.embedding_length", config.hidden_size);
  meta.U32("llama.feed_forward_length", config.intermediate_size);
  meta.U32("llama.block_count", config.num_layers);
  meta.U32("llama.attention.head_count", config.num_heads);
  meta.U32("llama.attention.head_count_kv", config.num_kv_heads);
  meta.U32("llama.attention.key_length", config.head_dim);
  meta.U32("llama.attention.value_length", config.head_dim);
  meta.U32("llama.rope.dimension_count", config.head_dim);
  meta.F32("llama.attention.layer_norm_rms_epsilon", config.rms_norm_eps);
  meta.F32("llama.rope.freq_base", config.rope_theta);
  if (config.sliding_window > 0) {
    if (!config.windowed_layers.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          path,
          ": a sliding window over some layers only cannot be written "
          "to a llama GGUF (its attention.sliding_window covers every "
          "layer)"));
    }
    meta.U32("llama.attention.sliding_window", config.sliding_window);
  }
  meta.U32("llama.vocab_size", config.vocab_size);
  if (vocabulary != nullptr) {
    PDS_RETURN_IF_ERROR(WriteVocabulary(*vocabulary, config, meta));
  } else {
    WritePlaceholderVocabulary(config, meta);
  }

  const std::vector<ExpectedTensor> layout = LlamaTensorLayout(config);
  std::vector<TensorFormat> formats;
  std::vector<uint64_t> offsets, sizes;
  uint64_t next = 0;
  for (const ExpectedTensor& tensor : layout) {
    const TensorFormat format = format_of(tensor.name);
    const int64_t cols = tensor.shape.back();
    if (cols % BlockElements(format) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor ", tensor.name, " has rows of ", cols,
                       " values, not a whole number of ",
                       std::string(TensorFormatName(format)), " blocks of ",
                       BlockElements(format)));
    }
    int64_t rows = 1;
    for (size_t d = 0; d + 1 < tensor.shape.size(); ++d)
      rows *= tensor.shape[d];
    formats.push_back(format);
    offsets.push_back(next);
    sizes.push_back(rows * RowBytes(format, cols));
    next = (next + sizes.back() + kAlignment - 1) / kAlignment * kAlignment;
  }

  std::string header = "GGUF";
  AppendU32(&header, 3);
  AppendU64(&header, layout.size());
  AppendU64(&header, meta.count());
  header += meta.bytes();
  for (size_t i = 0; i < layout.size(); ++i) {
    AppendString(&header, GgufNameFromCanonical(layout[i].name));
    AppendU32(&header, static_cast<uint32_t>(layout[i].shape.size()));
    for (auto d = layout[i].shape.rbegin(); d != layout[i].shape.rend(); ++d) {
      AppendU64(&header, static_cast<uint64_t>(*d));
    }
    AppendU32(&header, GgmlTypeOf(formats[i]));
    AppendU64(&header, offsets[i]);
  }
  header.resize((header.size() + kAlignment - 1) / kAlignment * kAlignment,
                '\0');

  std::unique_ptr<std::FILE, FileCloser> file(std::fopen(path.c_str(), "wb"));
  if (file == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("cannot create ", path));
  }
  bool ok =
      std::fwrite(header.data(), 1, header.size(), file.get()) == header.size();
  uint64_t written = 0;
  std::vector<uint8_t> encoded;
  for (size_t i = 0; ok && i < layout.size(); ++i) {
    const ExpectedTensor& tensor = layout[i];
    std::vector<float> data = values(tensor.name, tensor.shape);
    const int64_t cols = tensor.shape.back();
    const int64_t rows = static_cast<int64_t>(data.size()) / cols;
    if (absl::EndsWith(tensor.name, "q_proj.weight") ||
        absl::EndsWith(tensor.name, "k_proj.weight")) {
      data = InterleaveRope(data, rows, cols, config.head_dim);
    }
    encoded.assign(sizes[i], 0);
    const int64_t row_bytes = RowBytes(formats[i], cols);
    for (int64_t r = 0; r < rows; ++r) {
      QuantizeRow(formats[i], data.data() + r * cols, cols,
                  encoded.data() + r * row_bytes);
    }
    const std::string padding(offsets[i] - written, '\0');
    ok = std::fwrite(padding.data(), 1, padding.size(), file.get()) ==
             padding.size() &&
         std::fwrite(encoded.data(), 1, encoded.size(), file.get()) ==
             encoded.size();
    written = offsets[i] + encoded.size();
  }
  if (!ok || std::fflush(file.get()) != 0) {
    return absl::InternalError(absl::StrCat("cannot write ", path));
  }
  return absl::OkStatus();
}

}  // namespace pdserve::model
