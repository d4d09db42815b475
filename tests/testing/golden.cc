#include "golden.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace pdserve::testing {
namespace {

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "test fixture error: %s\n", message.c_str());
  std::abort();
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  if (!in) Die("cannot open " + path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

}  // namespace

std::string ModelsDir() {
  if (const char* env = std::getenv("PDSERVE_MODELS_DIR");
      env != nullptr && *env != '\0') {
    return env;
  }
  return PDSERVE_MODELS_DIR;
}

std::string Stories260KDir() { return ModelsDir() + "/stories260K"; }
std::string Stories260KGguf() { return Stories260KDir() + "/stories260K.gguf"; }
std::string BenchConfig(const std::string& name) {
  return ModelsDir() + "/bench-configs/" + name + ".json";
}

std::vector<GoldenCase> LoadGoldenCases(const std::string& file_name) {
  std::ifstream in(Stories260KDir() + "/" + file_name);
  if (!in) Die("cannot open golden file " + file_name);
  std::vector<GoldenCase> cases;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    auto json =
        nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (json.is_discarded()) Die("bad JSON line in " + file_name);
    GoldenCase c;
    c.prompt = json.value("prompt", "");
    c.prompt_ids = json.at("prompt_ids").get<std::vector<int32_t>>();
    c.max_new_tokens = json.at("max_new_tokens").get<int>();
    c.greedy_ids = json.at("greedy_ids").get<std::vector<int32_t>>();
    c.text = json.value("text", "");
    c.min_top2_margin = json.value("min_top2_margin", 0.0);
    cases.push_back(std::move(c));
  }
  if (cases.empty()) Die("no golden cases in " + file_name);
  return cases;
}

GoldenLogits LoadGoldenLogits() {
  auto json = nlohmann::json::parse(
      ReadAll(Stories260KDir() + "/golden_logits.json"), nullptr,
      /*allow_exceptions=*/false);
  if (json.is_discarded()) Die("bad golden_logits.json");
  GoldenLogits out;
  out.prompt_ids = json.at("prompt_ids").get<std::vector<int32_t>>();
  out.logits = json.at("logits").get<std::vector<std::vector<double>>>();
  return out;
}

}  // namespace pdserve::testing
