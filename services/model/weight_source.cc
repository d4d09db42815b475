#include "model/weight_source.h"

#include <filesystem>
#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "model/absl_compat.h"
#include "model/mapped_weight_source.h"

namespace pdserve::model {
namespace {

namespace fs = std::filesystem;

bool StartsWithGgufMagic(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return in.read(magic, 4) && std::string_view(magic, 4) == "GGUF";
}

absl::StatusOr<LoadFormat> DetectFormat(const std::string& path) {
  std::error_code error;
  if (fs::is_directory(path, error)) {
    const fs::path folder(path);
    if (fs::exists(folder / "config.json", error) &&
        (fs::exists(folder / "model.safetensors", error) ||
         fs::exists(folder / "model.safetensors.index.json", error))) {
      return LoadFormat::kSafetensors;
    }
    return absl::InvalidArgumentError(absl::StrCat(
        path,
        ": folder has no config.json with model.safetensors or "
        "model.safetensors.index.json (use the dummy load format for "
        "random weights from a config)"));
  }
  if (fs::is_regular_file(path, error)) {
    // The extension wins over the magic so that a damaged .gguf file gets
    // the GGUF parser's precise error rather than "unknown format".
    if (absl::EndsWith(path, ".gguf") || StartsWithGgufMagic(path)) {
      return LoadFormat::kGguf;
    }
    if (absl::EndsWith(path, ".safetensors") ||
        absl::EndsWith(path, ".safetensors.index.json")) {
      return LoadFormat::kSafetensors;
    }
    return absl::InvalidArgumentError(absl::StrCat(
        path,
        ": cannot tell the model format (expected a .gguf file or a "
        "Hugging Face folder)"));
  }
  return absl::NotFoundError(absl::StrCat(path, ": no such file or folder"));
}

}  // namespace

std::string DefaultModelName(const std::string& path) {
  std::filesystem::path p(path);
  while (!p.empty() && p.filename().empty()) p = p.parent_path();
  return p.stem().string();
}

absl::StatusOr<std::unique_ptr<WeightSource>> OpenModel(const std::string& path,
                                                        LoadFormat format) {
  if (format == LoadFormat::kAuto) {
    absl::StatusOr<LoadFormat> detected = DetectFormat(path);
    if (!detected.ok()) return detected.status();
    format = *detected;
  }
  switch (format) {
    case LoadFormat::kGguf:
      return OpenGgufModel(path);
    case LoadFormat::kSafetensors:
      return OpenSafetensorsModel(path);
    case LoadFormat::kDummy:
      return OpenDummyModel(path);
    case LoadFormat::kAuto:
      break;
  }
  return absl::InternalError("unreachable load format");
}

absl::StatusOr<LoadFormat> ParseLoadFormat(std::string_view text) {
  const std::string lower = absl::AsciiStrToLower(ToAbsl(text));
  if (lower == "auto") return LoadFormat::kAuto;
  if (lower == "gguf") return LoadFormat::kGguf;
  if (lower == "safetensors") return LoadFormat::kSafetensors;
  if (lower == "dummy") return LoadFormat::kDummy;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown load format \"", ToAbsl(text),
                   "\" (auto, gguf, safetensors or dummy)"));
}

std::string LayerTensorName(int layer, std::string_view suffix) {
  return absl::StrCat("model.layers.", layer, ".", ToAbsl(suffix));
}

}  // namespace pdserve::model

namespace pdserve::model {

absl::StatusOr<StoredTensor> WeightSource::GetStoredTensor(
    std::string_view name) const {
  if (!HasTensor(name)) {
    return absl::NotFoundError(
        absl::StrCat(description(), ": no tensor ", ToAbsl(name)));
  }
  return absl::UnimplementedError(
      absl::StrCat(description(), ": weights have no stored bytes"));
}

}  // namespace pdserve::model
