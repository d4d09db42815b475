#include "speculative/truncated_weights.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace pdserve::speculative {
namespace {

class LayerTruncatedWeights final : public model::WeightSource {
 public:
  LayerTruncatedWeights(const model::WeightSource& base, int num_layers)
      : base_(base),
        config_(base.config()),
        description_(absl::StrCat(base.description(), " (first ", num_layers,
                                  " layers)")) {
    config_.num_layers = num_layers;
    // Per-layer windows (Qwen) keep those of the layers kept, in the
    // parser's one form: none windowed is no window, all is the empty list.
    std::vector<bool>& windowed = config_.windowed_layers;
    if (!windowed.empty()) {
      windowed.resize(num_layers);
      const int count =
          static_cast<int>(std::count(windowed.begin(), windowed.end(), true));
      if (count == 0) config_.sliding_window = 0;
      if (count == 0 || count == num_layers) windowed.clear();
    }
  }
  const model::ModelConfig& config() const override { return config_; }
  const std::string& description() const override { return description_; }
  bool HasTensor(std::string_view name) const override {
    return base_.HasTensor(name);
  }
  absl::StatusOr<model::TensorInfo> GetTensorInfo(
      std::string_view name) const override {
    return base_.GetTensorInfo(name);
  }
  absl::Status ReadF32(std::string_view name, const model::Slice2D& slice,
                       float* out) const override {
    return base_.ReadF32(name, slice, out);
  }
  absl::StatusOr<model::TokenizerSpec> tokenizer_spec() const override {
    return base_.tokenizer_spec();
  }

 private:
  const model::WeightSource& base_;
  model::ModelConfig config_;
  std::string description_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<model::WeightSource>> MakeLayerTruncatedWeights(
    const model::WeightSource& base, int num_layers) {
  if (num_layers < 1 || num_layers > base.config().num_layers)
    return absl::InvalidArgumentError(
        absl::StrCat("draft layer count ", num_layers, " outside [1, ",
                     base.config().num_layers, "]"));
  return std::make_unique<LayerTruncatedWeights>(base, num_layers);
}

}  // namespace pdserve::speculative
