// Internal to services/model: the shared part of the file-backed weight
// sources (GGUF and safetensors) and the per-format factories OpenModel()
// dispatches to. Not part of the public API.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/weight_source.h"

namespace pdserve::model {

// One tensor's bytes inside a mapped file, under its canonical name.
struct MappedTensor {
  TensorInfo info;                // canonical name, storage dtype, HF shape
  std::span<const uint8_t> data;  // row-major, bounds checked at open
  const std::string* file_path = nullptr;  // the file holding it, for errors
  // Non-zero for GGUF q/k projections stored in Meta's interleaved RoPE
  // layout: rows are permuted on read into HF rotate-half order.
  int interleaved_rope_head_dim = 0;
};

// Converts `count` consecutive elements of `dtype` at `src` to f32.
void ConvertToF32(const uint8_t* src, DType dtype, size_t count, float* out);

// Within one head of `head_dim` rows, HF rotate-half row p*d/2 + j is stored
// as interleaved row 2j + p. Maps an HF row index to the stored row index.
inline int64_t InterleavedRopeRow(int64_t hf_row, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  const int64_t head = hf_row / head_dim;
  const int64_t within = hf_row % head_dim;
  return head * head_dim + 2 * (within % half) + within / half;
}

// Resolves -1 ends and checks `slice` against a tensor viewed as rows x cols
// (a 1-D tensor is one row). OUT_OF_RANGE names the tensor and shape.
struct ResolvedSlice {
  int64_t rows = 0;  // of the whole tensor
  int64_t cols = 0;
  int64_t row_begin = 0, row_end = 0, col_begin = 0, col_end = 0;
};
[[nodiscard]] absl::StatusOr<ResolvedSlice> ResolveSlice(const TensorInfo& info,
                                                         const Slice2D& slice);

// Base of the mapped sources: owns the canonical tensor table and does the
// conversion. Subclasses keep the mapped files alive and describe tokenizers.
class MappedWeightSource : public WeightSource {
 public:
  const ModelConfig& config() const override { return config_; }
  const std::string& description() const override { return description_; }
  bool HasTensor(std::string_view name) const override;
  absl::StatusOr<TensorInfo> GetTensorInfo(
      std::string_view name) const override;
  absl::Status ReadF32(std::string_view name, const Slice2D& slice,
                       float* out) const override;
  absl::StatusOr<StoredTensor> GetStoredTensor(
      std::string_view name) const override;

 protected:
  // Checks every tensor of LlamaTensorLayout(config_) is present with the
  // expected shape. `missing_file` names the file blamed for absent tensors.
  [[nodiscard]] absl::Status ValidateArchitecture(
      std::string_view missing_file) const;

  ModelConfig config_;
  std::string description_;
  // What keeps the mapped files alive for StoredTensor views.
  std::shared_ptr<const void> mapping_owner_;
  absl::flat_hash_map<std::string, MappedTensor> tensors_;
};

[[nodiscard]] absl::StatusOr<std::unique_ptr<WeightSource>> OpenGgufModel(
    const std::string& path);
[[nodiscard]] absl::StatusOr<std::unique_ptr<WeightSource>>
OpenSafetensorsModel(const std::string& path);
[[nodiscard]] absl::StatusOr<std::unique_ptr<WeightSource>> OpenDummyModel(
    const std::string& path);

}  // namespace pdserve::model
