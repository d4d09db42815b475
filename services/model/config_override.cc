#include "model/config_override.h"

namespace pdserve::model {

ConfigOverrideWeights::ConfigOverrideWeights(const WeightSource& base,
                                             ModelConfig config,
                                             std::string description)
    : base_(base),
      config_(std::move(config)),
      description_(description.empty() ? base.description()
                                       : std::move(description)) {}

bool ConfigOverrideWeights::HasTensor(std::string_view name) const {
  return base_.HasTensor(name);
}

absl::StatusOr<TensorInfo> ConfigOverrideWeights::GetTensorInfo(
    std::string_view name) const {
  return base_.GetTensorInfo(name);
}

absl::Status ConfigOverrideWeights::ReadF32(std::string_view name,
                                            const Slice2D& slice,
                                            float* out) const {
  return base_.ReadF32(name, slice, out);
}

absl::StatusOr<StoredTensor> ConfigOverrideWeights::GetStoredTensor(
    std::string_view name) const {
  return base_.GetStoredTensor(name);
}

absl::StatusOr<TokenizerSpec> ConfigOverrideWeights::tokenizer_spec() const {
  return base_.tokenizer_spec();
}

}  // namespace pdserve::model
