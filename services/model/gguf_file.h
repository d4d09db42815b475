// A validated, memory-mapped GGUF v3 file: header, metadata key/values and
// tensor directory. Usable on its own to read metadata (e.g. the tokenizer
// vocabulary) without building a WeightSource.
//
// Every length, count and offset is checked against the file size before it
// is used, so a truncated or hostile file gives an error, never a crash.
//
// Thread-safety: immutable after Open(); const methods may run concurrently.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/mapped_file.h"
#include "model/model_config.h"
#include "model/quant_formats.h"
#include "model/weight_source.h"

namespace pdserve::model {

// On-disk metadata value types (gguf_type in ggml).
enum class GgufValueType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};
std::string_view GgufValueTypeName(GgufValueType type);

// Tensor types this reader supports (ggml_type values).
inline constexpr uint32_t kGgmlTypeF32 = 0;
inline constexpr uint32_t kGgmlTypeF16 = 1;
inline constexpr uint32_t kGgmlTypeQ8_0 = 8;
inline constexpr uint32_t kGgmlTypeQ4_K = 12;
inline constexpr uint32_t kGgmlTypeQ6_K = 14;
inline constexpr uint32_t kGgmlTypeBF16 = 30;
// "Q4_K", "F16", ... or "ggml type N".
std::string GgmlTypeName(uint32_t type);
// The ggml type id of a format (for writers).
uint32_t GgmlTypeOf(TensorFormat format);

// One metadata value. Integers keep their signedness; floats are widened to
// double; arrays hold elements of one type (`array_type`), possibly arrays.
struct GgufValue {
  GgufValueType type = GgufValueType::kUint8;
  GgufValueType array_type = GgufValueType::kUint8;  // when type == kArray
  std::variant<uint64_t, int64_t, double, bool, std::string,
               std::vector<GgufValue>>
      data;

  bool is_integer() const;
  bool is_float() const;
  // Integer value if this is an integer type and it fits int64.
  std::optional<int64_t> AsInt64() const;
  // Numeric value of any integer or float type.
  std::optional<double> AsDouble() const;
  const std::string* AsString() const;
  const std::vector<GgufValue>* AsArray() const;
};

struct GgufTensorInfo {
  std::string name;          // as stored in the file (GGUF naming)
  std::vector<uint64_t> ne;  // ggml order: ne[0] is the innermost dimension
  uint32_t ggml_type = 0;
  uint64_t offset = 0;  // relative to the data section
  uint64_t num_elements = 0;
  uint64_t num_bytes = 0;  // 0 for unsupported types (see GgufOpenOptions)
  bool supported = false;  // F32, F16, BF16, Q8_0, Q4_K or Q6_K
  TensorFormat format = TensorFormat::kF32;  // when `supported`

  // Row-major shape, outermost first: `ne` reversed.
  std::vector<int64_t> Shape() const;
  // The element dtype ReadF32 widens from: the storage dtype of F32/F16/
  // BF16 tensors, kF32 for block-quantized ones (see `format`).
  DType dtype() const;
};

struct GgufOpenOptions {
  // When false (the default), a tensor of a type other than F32/F16/BF16/
  // Q8_0/Q4_K/Q6_K is an error naming the tensor and type. When true such
  // tensors are listed (supported == false, num_bytes == 0) so callers can
  // still read metadata of quantized files; their data ranges cannot be
  // checked.
  bool allow_unsupported_tensor_types = false;
};

class GgufFile {
 public:
  [[nodiscard]] static absl::StatusOr<GgufFile> Open(
      const std::string& path, const GgufOpenOptions& options = {});

  GgufFile(GgufFile&&) = default;
  GgufFile& operator=(GgufFile&&) = default;

  const std::string& path() const { return file_.path(); }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  // Absolute file offset where tensor data begins.
  uint64_t data_offset() const { return data_offset_; }

  // Metadata in file order.
  const std::vector<std::pair<std::string, GgufValue>>& metadata() const {
    return metadata_;
  }
  const GgufValue* FindMetadata(std::string_view key) const;

  // Typed getters. NOT_FOUND if the key is absent, INVALID_ARGUMENT if it
  // has the wrong type; messages name the file and the key.
  [[nodiscard]] absl::StatusOr<int64_t> GetInt(std::string_view key) const;
  [[nodiscard]] absl::StatusOr<double> GetFloat(std::string_view key) const;
  [[nodiscard]] absl::StatusOr<bool> GetBool(std::string_view key) const;
  [[nodiscard]] absl::StatusOr<std::string> GetString(
      std::string_view key) const;
  [[nodiscard]] absl::StatusOr<std::vector<std::string>> GetStringArray(
      std::string_view key) const;
  [[nodiscard]] absl::StatusOr<std::vector<double>> GetFloatArray(
      std::string_view key) const;
  [[nodiscard]] absl::StatusOr<std::vector<int64_t>> GetIntArray(
      std::string_view key) const;

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* FindTensor(std::string_view name) const;
  // The bytes of a supported tensor (bounds were checked at Open()).
  std::span<const uint8_t> TensorData(const GgufTensorInfo& tensor) const;

 private:
  GgufFile() = default;
  absl::Status Parse(const GgufOpenOptions& options);

  MappedFile file_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::vector<std::pair<std::string, GgufValue>> metadata_;
  absl::flat_hash_map<std::string, size_t> metadata_index_;
  std::vector<GgufTensorInfo> tensors_;
  absl::flat_hash_map<std::string, size_t> tensor_index_;
};

// Maps a llama.cpp tensor name to the canonical (HF) one, e.g.
// "blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight". Names
// it does not know are returned unchanged.
std::string CanonicalNameFromGguf(std::string_view gguf_name);

// The architecture of a Llama GGUF (general.architecture == "llama") from its
// llama.* metadata, validated. Tied embeddings iff output.weight is absent.
[[nodiscard]] absl::StatusOr<ModelConfig> LlamaConfigFromGguf(
    const GgufFile& gguf);

// The tokenizer.ggml.* vocabulary. FAILED_PRECONDITION if the file has no
// tokenizer.ggml.tokens.
[[nodiscard]] absl::StatusOr<TokenizerSpec> TokenizerSpecFromGguf(
    const GgufFile& gguf);

}  // namespace pdserve::model
