// Shared test fixtures: where the shared models live and the golden files.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pdserve::testing {

// ../shared/models by default (compile-time), or $PDSERVE_MODELS_DIR.
std::string ModelsDir();
std::string Stories260KDir();
std::string Stories260KGguf();
std::string BenchConfig(const std::string& name);  // e.g. "llama-110m"

struct GoldenCase {
  std::string prompt;
  std::vector<int32_t> prompt_ids;
  int max_new_tokens = 0;
  std::vector<int32_t> greedy_ids;
  std::string text;
  double min_top2_margin = 0;
};

// Parses golden.jsonl / golden_long.jsonl (file name inside stories260K/).
// Aborts the test binary with a message if the file is missing or malformed.
std::vector<GoldenCase> LoadGoldenCases(
    const std::string& file_name = "golden.jsonl");

struct GoldenLogits {
  std::vector<int32_t> prompt_ids;
  std::vector<std::vector<double>> logits;  // [position][vocab]
};
GoldenLogits LoadGoldenLogits();

}  // namespace pdserve::testing
