// A WeightSource that reads another's tensors under an edited config: a
// layer-truncated draft (speculative/truncated_weights.h), or a checkpoint
// without one of its family features (tests). Every tensor read — f32 or in
// place (quantized GGUF stays quantized) — goes to the base.
#pragma once

#include <string>

#include "model/weight_source.h"

namespace pdserve::model {

class ConfigOverrideWeights final : public WeightSource {
 public:
  // `base` must outlive this. An empty `description` keeps the base's.
  ConfigOverrideWeights(const WeightSource& base, ModelConfig config,
                        std::string description = "");

  const ModelConfig& config() const override { return config_; }
  const std::string& description() const override { return description_; }
  bool HasTensor(std::string_view name) const override;
  absl::StatusOr<TensorInfo> GetTensorInfo(
      std::string_view name) const override;
  absl::Status ReadF32(std::string_view name, const Slice2D& slice,
                       float* out) const override;
  absl::StatusOr<StoredTensor> GetStoredTensor(
      std::string_view name) const override;
  absl::StatusOr<TokenizerSpec> tokenizer_spec() const override;

 private:
  const WeightSource& base_;
  ModelConfig config_;
  std::string description_;
};

}  // namespace pdserve::model
