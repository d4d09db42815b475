// WeightSource over a Hugging Face folder: config.json plus model.safetensors
// or a sharded model.safetensors.index.json. Tensor names are already
// canonical and q/k are already in rotate-half layout.
#include <filesystem>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/mapped_file.h"
#include "common/status_macros.h"
#include "model/mapped_weight_source.h"
#include "model/safetensors_file.h"
#include "nlohmann/json.hpp"

namespace pdserve::model {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr char kConfigName[] = "config.json";
constexpr char kSingleFileName[] = "model.safetensors";
constexpr char kIndexName[] = "model.safetensors.index.json";
constexpr char kTokenizerName[] = "tokenizer.model";

// Shard names come from the index file; they must stay inside the folder.
bool IsPlainFileName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." &&
         name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

// Reads weight_map of an index file: tensor name -> shard file name.
absl::StatusOr<std::map<std::string, std::string>> ReadWeightMap(
    const std::string& index_path) {
  PDS_ASSIGN_OR_RETURN(std::string text, ReadFileToString(index_path));
  Json index;
  try {
    index = Json::parse(text);
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(index_path, ": invalid JSON: ", e.what()));
  }
  auto weight_map = index.is_object() ? index.find("weight_map") : index.end();
  if (!index.is_object() || weight_map == index.end() ||
      !weight_map->is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(index_path, ": missing object \"weight_map\""));
  }
  std::map<std::string, std::string> result;
  for (const auto& [tensor, shard] : weight_map->items()) {
    if (!shard.is_string() || !IsPlainFileName(shard.get<std::string>())) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, ": weight_map entry for ", tensor,
                       " must be a file name in the same folder"));
    }
    result.emplace(tensor, shard.get<std::string>());
  }
  return result;
}

class SafetensorsWeightSource final : public MappedWeightSource {
 public:
  // `folder` holds config.json; `weights_file` is model.safetensors or the
  // index (which lists the shards).
  absl::Status Init(const fs::path& folder, const fs::path& weights_file) {
    folder_ = folder;
    description_ = folder.string();
    const std::string config_path = (folder / kConfigName).string();
    PDS_ASSIGN_OR_RETURN(std::string config_text,
                         ReadFileToString(config_path));
    PDS_ASSIGN_OR_RETURN(config_, ParseHfConfigJson(config_text, config_path));
    // Chat models list their end-of-turn tokens here (Llama 3's <|eot_id|>).
    const fs::path generation_config = folder / "generation_config.json";
    if (std::error_code ec; fs::exists(generation_config, ec)) {
      PDS_ASSIGN_OR_RETURN(std::string text,
                           ReadFileToString(generation_config.string()));
      PDS_RETURN_IF_ERROR(MergeGenerationConfigJson(
          text, generation_config.string(), &config_));
    }

    if (absl::EndsWith(weights_file.filename().string(), ".index.json")) {
      PDS_ASSIGN_OR_RETURN(auto weight_map,
                           ReadWeightMap(weights_file.string()));
      // Each shard is opened (and mapped) once, however many tensors it has.
      std::map<std::string, size_t> shard_index;
      for (const auto& [tensor, shard] : weight_map) {
        if (shard_index.contains(shard)) continue;
        PDS_ASSIGN_OR_RETURN(SafetensorsFile file,
                             SafetensorsFile::Open((folder / shard).string()));
        shard_index.emplace(shard, shards_.size());
        shards_.push_back(std::make_unique<SafetensorsFile>(std::move(file)));
      }
      for (const auto& [tensor, shard] : weight_map) {
        const SafetensorsFile& file = *shards_[shard_index[shard]];
        if (file.FindTensor(tensor) == nullptr) {
          return absl::InvalidArgumentError(
              absl::StrCat(weights_file.string(), ": weight_map puts ", tensor,
                           " in ", file.path(), " which does not hold it"));
        }
      }
    } else {
      PDS_ASSIGN_OR_RETURN(SafetensorsFile file,
                           SafetensorsFile::Open(weights_file.string()));
      shards_.push_back(std::make_unique<SafetensorsFile>(std::move(file)));
    }

    for (const auto& shard : shards_) {
      for (const SafetensorsTensor& stored : shard->tensors()) {
        MappedTensor tensor;
        tensor.info.name = stored.name;
        tensor.info.dtype = stored.dtype;
        tensor.info.format = stored.dtype == DType::kF16 ? TensorFormat::kF16
                             : stored.dtype == DType::kBF16
                                 ? TensorFormat::kBF16
                                 : TensorFormat::kF32;
        tensor.info.shape = stored.shape;
        tensor.data = shard->TensorData(stored);
        tensor.file_path = &shard->path();
        if (!tensors_.emplace(stored.name, std::move(tensor)).second) {
          return absl::InvalidArgumentError(
              absl::StrCat(shard->path(), ": tensor ", stored.name,
                           " is also in another shard"));
        }
      }
    }
    mapping_owner_ = shard_files_;
    return ValidateArchitecture(weights_file.string());
  }

  absl::StatusOr<TokenizerSpec> tokenizer_spec() const override {
    // tokenizer.json first, as transformers loads the fast tokenizer when a
    // folder has both.
    const fs::path json_path = folder_ / "tokenizer.json";
    const fs::path config_path = folder_ / "tokenizer_config.json";
    const fs::path tokenizer_path = folder_ / kTokenizerName;
    std::error_code error;
    TokenizerSpec spec;
    if (fs::is_regular_file(json_path, error)) {
      spec.hf_tokenizer_json_path = json_path.string();
      if (fs::is_regular_file(config_path, error)) {
        spec.hf_tokenizer_config_path = config_path.string();
      }
    } else if (fs::is_regular_file(tokenizer_path, error)) {
      spec.sentencepiece_model_path = tokenizer_path.string();
    } else {
      return absl::NotFoundError(absl::StrCat(
          folder_.string(), ": no tokenizer: neither ", json_path.string(),
          " (Hugging Face tokenizer.json) nor ", tokenizer_path.string(),
          " (SentencePiece tokenizer.model) exists"));
    }
    spec.bos_token_id = config_.bos_token_id;
    spec.eos_token_id = config_.eos_token_id;
    return spec;
  }

 private:
  fs::path folder_;
  // unique_ptr keeps each file's path() address stable for MappedTensor.
  // Shared so that StoredTensor views can keep the mappings alive.
  std::shared_ptr<std::vector<std::unique_ptr<SafetensorsFile>>> shard_files_ =
      std::make_shared<std::vector<std::unique_ptr<SafetensorsFile>>>();
  std::vector<std::unique_ptr<SafetensorsFile>>& shards_ = *shard_files_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<WeightSource>> OpenSafetensorsModel(
    const std::string& path) {
  std::error_code error;
  fs::path folder;
  fs::path weights_file;
  if (fs::is_directory(path, error)) {
    folder = path;
    if (fs::exists(folder / kIndexName, error)) {
      weights_file = folder / kIndexName;
    } else if (fs::exists(folder / kSingleFileName, error)) {
      weights_file = folder / kSingleFileName;
    } else {
      return absl::NotFoundError(
          absl::StrCat(path, ": no ", kSingleFileName, " or ", kIndexName));
    }
  } else if (fs::is_regular_file(path, error)) {
    // A .safetensors file or an index inside a model folder.
    weights_file = path;
    folder = weights_file.parent_path();
    if (folder.empty()) folder = ".";
  } else {
    return absl::NotFoundError(absl::StrCat(path, ": no such file or folder"));
  }
  auto source = std::make_unique<SafetensorsWeightSource>();
  PDS_RETURN_IF_ERROR(source->Init(folder, weights_file));
  return source;
}

}  // namespace pdserve::model
