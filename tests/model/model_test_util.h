// Test-only helpers for services/model: a temp folder, byte-level GGUF and
// safetensors writers, and a tiny synthetic Llama model that can be written
// in either format and any supported dtype.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "model/model_config.h"

namespace pdserve::model::testing {

inline const std::string kModelsDir = PDSERVE_MODELS_DIR;
inline const std::string kStoriesDir = kModelsDir + "/stories260K";
inline const std::string kStoriesGguf = kStoriesDir + "/stories260K.gguf";

// A fresh folder under /tmp, removed with everything in it on destruction.
class ScopedTempDir {
 public:
  ScopedTempDir();
  ~ScopedTempDir();
  ScopedTempDir(const ScopedTempDir&) = delete;
  ScopedTempDir& operator=(const ScopedTempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

void WriteBytes(const std::string& path, const std::string& bytes);
std::string ReadBytes(const std::string& path);

// Little-endian appends.
void AppendU32(std::string* out, uint32_t value);
void AppendU64(std::string* out, uint64_t value);
void AppendString(std::string* out, const std::string& text);  // u64 + bytes
void PutU32At(std::string* bytes, size_t offset, uint32_t value);
void PutU64At(std::string* bytes, size_t offset, uint64_t value);

// Serializes GGUF files value by value. Metadata values are given already
// encoded (type + payload) so tests can write any type, nested arrays
// included, or deliberately broken encodings.
class GgufBuilder {
 public:
  struct Tensor {
    std::string name;
    std::vector<uint64_t> ne;  // ggml order, innermost first
    uint32_t ggml_type = 0;
    std::string data;
    std::optional<uint64_t> offset_override;
  };

  uint32_t version = 3;
  uint64_t alignment = 32;  // used for layout; add general.alignment yourself

  void AddRaw(const std::string& key, uint32_t type, std::string payload);
  void AddU32(const std::string& key, uint32_t value);
  void AddF32(const std::string& key, float value);
  void AddBool(const std::string& key, bool value);
  void AddStr(const std::string& key, const std::string& value);
  void AddStrArray(const std::string& key,
                   const std::vector<std::string>& values);
  void AddF32Array(const std::string& key, const std::vector<float>& values);
  void AddI32Array(const std::string& key, const std::vector<int32_t>& values);
  bool RemoveMetadata(const std::string& key);
  // Every key starting with `from` starts with `to` instead ("llama." ->
  // "qwen2.", to turn the tiny llama file into another architecture's).
  void RenameMetadataPrefix(const std::string& from, const std::string& to);

  void AddTensor(Tensor tensor) { tensors_.push_back(std::move(tensor)); }
  std::vector<Tensor>& tensors() { return tensors_; }

  std::string Build() const;

 private:
  std::vector<std::pair<std::string, std::string>>
      metadata_;  // key, type+payload
  std::vector<Tensor> tensors_;
};

struct SafetensorsEntry {
  std::string name;
  std::string dtype;  // "F32", "F16", "BF16", ...
  std::vector<int64_t> shape;
  std::string data;
};
// A well-formed file from entries (data laid out in order).
std::string BuildSafetensors(const std::vector<SafetensorsEntry>& entries);
// A file from an arbitrary header text and data section.
std::string BuildSafetensorsRaw(const std::string& header_json,
                                const std::string& data);

// A tiny Llama (hidden 8, 2 layers, 2 heads, 1 KV head, head_dim 4, vocab
// 16) with deterministic values, stored in `dtype`. `values` holds, per
// canonical tensor, the exact f32 values a reader must return (already
// rounded through the storage dtype), HF layout.
struct TinyModel {
  ModelConfig config;
  DType dtype = DType::kF32;
  std::map<std::string, std::vector<float>> values;
  std::map<std::string, std::vector<int64_t>> shapes;
};
TinyModel MakeTinyModel(DType dtype);

// config.json text for `config` (keys as transformers writes them).
std::string TinyConfigJson(const ModelConfig& config, DType dtype);
// A GGUF builder holding the whole tiny model (llama.* metadata, a
// tokenizer.ggml vocabulary, q/k permuted to the interleaved layout).
GgufBuilder TinyGguf(const TinyModel& model);
// Writes config.json + model.safetensors into `folder`.
void WriteTinySafetensors(const TinyModel& model, const std::string& folder);

}  // namespace pdserve::model::testing
