#include "test_util.h"

#include <fstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "tokenizer/sentencepiece_wrapper.h"

namespace pdserve::tokenizer::testing {

std::string ModelsDir() { return PDSERVE_MODELS_DIR; }
std::string Stories260KDir() { return ModelsDir() + "/stories260K"; }

std::vector<GoldenCase> LoadGoldens() {
  std::vector<GoldenCase> cases;
  for (const char* name : {"golden.jsonl", "golden_long.jsonl"}) {
    std::ifstream in(Stories260KDir() + "/" + name);
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      const nlohmann::json j = nlohmann::json::parse(line);
      GoldenCase c;
      c.prompt = j.at("prompt").get<std::string>();
      c.prompt_ids = j.at("prompt_ids").get<std::vector<int32_t>>();
      c.greedy_ids = j.at("greedy_ids").get<std::vector<int32_t>>();
      c.text = j.at("text").get<std::string>();
      cases.push_back(std::move(c));
    }
  }
  return cases;
}

absl::StatusOr<model::TokenizerSpec> SpecFromSentencePieceFile(
    const std::string& path) {
  internal::SentencePieceModel sp;
  const internal::SpStatus status = sp.Load(path);
  if (!status.ok()) return absl::InternalError(status.message);
  model::TokenizerSpec spec;
  spec.ggml_model = "llama";
  for (int id = 0; id < sp.GetPieceSize(); ++id) {
    spec.tokens.push_back(sp.IdToPiece(id));
    spec.scores.push_back(sp.GetScore(id));
    int type = 1;
    if (sp.IsUnknown(id)) type = 2;
    if (sp.IsControl(id)) type = 3;
    if (sp.IsUnused(id)) type = 5;
    if (sp.IsByte(id)) type = 6;
    spec.token_types.push_back(type);
  }
  spec.bos_token_id = sp.bos_id();
  spec.eos_token_id = sp.eos_id();
  spec.unk_token_id = sp.unk_id();
  spec.pad_token_id = sp.pad_id();
  return spec;
}

}  // namespace pdserve::tokenizer::testing

#ifdef PDSERVE_HAVE_MODEL_LIB
namespace pdserve::tokenizer::testing {
absl::StatusOr<model::TokenizerSpec> GgufSpec(bool* from_gguf) {
  *from_gguf = true;
  auto source = model::OpenModel(Stories260KDir() + "/stories260K.gguf");
  if (!source.ok()) return source.status();
  return (*source)->tokenizer_spec();
}
}  // namespace pdserve::tokenizer::testing
#else
namespace pdserve::tokenizer::testing {
absl::StatusOr<model::TokenizerSpec> GgufSpec(bool* from_gguf) {
  *from_gguf = false;
  return SpecFromSentencePieceFile(Stories260KDir() + "/tokenizer.model");
}
}  // namespace pdserve::tokenizer::testing
#endif
