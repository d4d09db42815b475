// WeightSource with no weight file: every element is a pure function of
// (tensor name, element index), so any slice can be generated on its own,
// two processes that open the same config get identical weights, and nothing
// is materialized beyond what the caller asks for.
#include <cmath>
#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/float16.h"
#include "common/mapped_file.h"
#include "common/status_macros.h"
#include "model/absl_compat.h"
#include "model/mapped_weight_source.h"
#include "model/tensor_layout.h"

namespace pdserve::model {
namespace {

namespace fs = std::filesystem;

// FNV-1a: a fixed, platform-independent hash (std::hash may differ between
// builds, and every process of a cluster must agree on the weights).
uint64_t Fnv1a64(std::string_view text) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (char c : text) {
    hash ^= static_cast<uint8_t>(c);
    hash *= 0x100000001b3ull;
  }
  return hash;
}

// splitmix64's finalizer applied to a counter: a good, cheap counter-based
// generator.
inline uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

struct DummyTensor {
  TensorInfo info;
  uint64_t seed = 0;
  // Values are uniform in [-scale, scale], or exactly `scale` when constant.
  float scale = 0.0f;
  bool constant = false;
};

class DummyWeightSource final : public WeightSource {
 public:
  absl::Status Init(const std::string& config_path) {
    description_ = absl::StrCat("dummy:", config_path);
    PDS_ASSIGN_OR_RETURN(std::string text, ReadFileToString(config_path));
    PDS_ASSIGN_OR_RETURN(config_, ParseHfConfigJson(text, config_path));
    for (ExpectedTensor& expected : LlamaTensorLayout(config_)) {
      DummyTensor tensor;
      tensor.seed = Fnv1a64(expected.name);
      if (expected.name.ends_with(".bias")) {
        tensor.scale = 0.05f;
      } else if (expected.shape.size() == 1) {
        tensor.constant = true;  // RMSNorm weights: identity scaling
        tensor.scale = 1.0f;
      } else if (expected.name == "model.embed_tokens.weight") {
        tensor.scale = 0.05f;
      } else {
        // Keeps activations O(1) through each projection, like common
        // initializations.
        tensor.scale =
            1.0f / std::sqrt(static_cast<float>(expected.shape.back()));
      }
      tensor.info.name = expected.name;
      tensor.info.dtype = config_.dtype;
      tensor.info.shape = std::move(expected.shape);
      std::string name = tensor.info.name;
      tensors_.emplace(std::move(name), std::move(tensor));
    }
    return absl::OkStatus();
  }

  const ModelConfig& config() const override { return config_; }
  const std::string& description() const override { return description_; }

  bool HasTensor(std::string_view name) const override {
    return tensors_.contains(ToAbsl(name));
  }

  absl::StatusOr<TensorInfo> GetTensorInfo(
      std::string_view name) const override {
    auto it = tensors_.find(ToAbsl(name));
    if (it == tensors_.end()) {
      return absl::NotFoundError(
          absl::StrCat(description_, ": no tensor ", ToAbsl(name)));
    }
    return it->second.info;
  }

  absl::Status ReadF32(std::string_view name, const Slice2D& slice,
                       float* out) const override {
    auto it = tensors_.find(ToAbsl(name));
    if (it == tensors_.end()) {
      return absl::NotFoundError(
          absl::StrCat(description_, ": no tensor ", ToAbsl(name)));
    }
    const DummyTensor& tensor = it->second;
    absl::StatusOr<ResolvedSlice> resolved = ResolveSlice(tensor.info, slice);
    if (!resolved.ok()) {
      return absl::OutOfRangeError(
          absl::StrCat(description_, ": ", resolved.status().message()));
    }
    const int64_t out_cols = resolved->col_end - resolved->col_begin;
    for (int64_t row = resolved->row_begin; row < resolved->row_end; ++row) {
      float* out_row = out + (row - resolved->row_begin) * out_cols;
      if (tensor.constant) {
        std::fill(out_row, out_row + out_cols, tensor.scale);
        continue;
      }
      const uint64_t first =
          static_cast<uint64_t>(row * resolved->cols + resolved->col_begin);
      GenerateRun(tensor, first, out_cols, out_row);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<TokenizerSpec> tokenizer_spec() const override {
    return absl::FailedPreconditionError(
        absl::StrCat(description_, ": dummy weights have no tokenizer"));
  }

 private:
  // Fills out[i] with element first + i of `tensor`. The dtype rounding is
  // a separate pass so the generating loop stays branch-free.
  static void GenerateRun(const DummyTensor& tensor, uint64_t first,
                          int64_t count, float* out) {
    for (int64_t i = 0; i < count; ++i) {
      const uint64_t index = first + static_cast<uint64_t>(i);
      const uint64_t bits =
          Mix64(tensor.seed + (index + 1) * 0x9e3779b97f4a7c15ull);
      // Top 24 bits -> [0, 1) exactly representable, then [-scale, scale).
      const float unit = static_cast<float>(bits >> 40) * 0x1.0p-24f;
      out[i] = (2.0f * unit - 1.0f) * tensor.scale;
    }
    // Round to the declared storage dtype so a dummy bf16 model reads like a
    // real bf16 file would.
    if (tensor.info.dtype == DType::kF16) {
      for (int64_t i = 0; i < count; ++i) {
        out[i] = F16ToFloat(FloatToF16(out[i]));
      }
    } else if (tensor.info.dtype == DType::kBF16) {
      for (int64_t i = 0; i < count; ++i) {
        out[i] = Bf16ToFloat(FloatToBf16(out[i]));
      }
    }
  }

  ModelConfig config_;
  std::string description_;
  absl::flat_hash_map<std::string, DummyTensor> tensors_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<WeightSource>> OpenDummyModel(
    const std::string& path) {
  std::error_code error;
  std::string config_path = path;
  if (fs::is_directory(path, error)) {
    config_path = (fs::path(path) / "config.json").string();
  }
  auto source = std::make_unique<DummyWeightSource>();
  PDS_RETURN_IF_ERROR(source->Init(config_path));
  return source;
}

}  // namespace pdserve::model
