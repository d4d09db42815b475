// The tiny checkpoints of every supported family (tests/model/reference/
// make_tiny_checkpoints.py) and what the independent float64 reference
// (hf_reference.py) says about them, generated at test time into a build
// folder by /usr/bin/python3 (Debian's, with numpy).
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "model/config_override.h"
#include "model/weight_source.h"
#include "nlohmann/json.hpp"
#include "testing/shell.h"

namespace pdserve::engine::testing_util {

struct FamilyReference {
  std::string name;
  std::string dir;  // the HF folder
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> greedy_ids;
  std::vector<double> logprobs;         // of each greedy token
  std::vector<double> prompt_logprobs;  // of prompt[k], k >= 1
  double min_margin = 0;                // smallest top-1/top-2 logit gap
  // Mixtures of experts: the smallest gap between a token's k-th and
  // (k+1)-th expert probability in any sparse layer.
  std::optional<double> min_route_margin;
};

inline std::map<std::string, FamilyReference> ReadFamilies(
    const std::string& dir);

inline constexpr char kReferenceScripts[] =
    PDSERVE_SOURCE_DIR "/tests/model/reference";

// Writes the checkpoints into `out_dir` (with --tokenizers, the text-*
// variants too) and runs the reference on each with `max_new` greedy
// tokens. Returns them by name; an empty map (and a test failure) if
// python or numpy is missing or a script fails.
inline std::map<std::string, FamilyReference> GenerateFamilies(
    const std::string& out_dir, int max_new,
    const std::string& tokenizers_dir = "") {
  std::map<std::string, FamilyReference> out;
  // ctest runs each test in its own process, several at once: one process
  // generates under an exclusive lock and the rest reuse its files, which
  // a marker ties to the scripts (size and time) and the arguments.
  std::string key = absl::StrCat(max_new, "|", tokenizers_dir);
  for (const char* script : {"make_tiny_checkpoints.py", "hf_reference.py"}) {
    const std::string path = absl::StrCat(kReferenceScripts, "/", script);
    std::error_code ec;
    const auto size = std::filesystem::file_size(path, ec);
    const auto time = std::filesystem::last_write_time(path, ec);
    absl::StrAppend(&key, "|", script, ":", ec ? 0 : size, ":",
                    ec ? 0 : time.time_since_epoch().count());
  }
  const std::string marker = out_dir + "/.generated";
  std::filesystem::create_directories(
      std::filesystem::path(out_dir).parent_path());
  const int lock_fd =
      ::open((out_dir + ".lock").c_str(), O_CREAT | O_RDWR, 0644);
  if (lock_fd >= 0) ::flock(lock_fd, LOCK_EX);
  if (pdserve::testing::ReadFileOrEmpty(marker) != key) {
    std::filesystem::remove_all(out_dir);
    std::string command =
        absl::StrCat("/usr/bin/python3 ", kReferenceScripts,
                     "/make_tiny_checkpoints.py '", out_dir, "'");
    if (!tokenizers_dir.empty()) {
      absl::StrAppend(&command, " --tokenizers '", tokenizers_dir, "'");
    }
    absl::StrAppend(
        &command, " && for f in $(/usr/bin/python3 -c 'import json,",
        "sys; print(\" \".join(json.load(open(sys.argv[1]))))' '", out_dir,
        "/families.json'); do /usr/bin/python3 ", kReferenceScripts,
        "/hf_reference.py '", out_dir, "'/$f --max-new ", max_new, " > '",
        out_dir, "'/$f/reference.json || exit 1; done");
    const pdserve::testing::CommandResult result =
        pdserve::testing::RunShell(command, PDSERVE_SOURCE_DIR);
    EXPECT_EQ(result.code, 0) << command << "\n" << result.output;
    if (result.code != 0) {
      if (lock_fd >= 0) ::close(lock_fd);
      return out;
    }
    std::ofstream(marker) << key;
  }
  if (lock_fd >= 0) ::close(lock_fd);  // releases the lock
  return ReadFamilies(out_dir);
}

// The checkpoints GenerateFamilies wrote into `dir` (families.json and each
// folder's reference.json). Empty (and a test failure) when missing.
inline std::map<std::string, FamilyReference> ReadFamilies(
    const std::string& dir) {
  std::map<std::string, FamilyReference> out;
  const std::string list =
      pdserve::testing::ReadFileOrEmpty(dir + "/families.json");
  EXPECT_FALSE(list.empty()) << "no " << dir << "/families.json";
  if (list.empty()) return out;
  const std::string out_dir = dir;
  const nlohmann::json names = nlohmann::json::parse(list);
  for (const auto& name : names) {
    FamilyReference f;
    f.name = name.get<std::string>();
    f.dir = absl::StrCat(out_dir, "/", f.name);
    const nlohmann::json r = nlohmann::json::parse(
        pdserve::testing::ReadFileOrEmpty(f.dir + "/reference.json"));
    f.prompt_ids = r["prompt_ids"].get<std::vector<int32_t>>();
    f.greedy_ids = r["greedy_ids"].get<std::vector<int32_t>>();
    f.logprobs = r["logprobs"].get<std::vector<double>>();
    f.prompt_logprobs = r["prompt_logprobs"].get<std::vector<double>>();
    f.min_margin = r["min_margin"].get<double>();
    if (r.contains("min_route_margin") && !r["min_route_margin"].is_null()) {
      f.min_route_margin = r["min_route_margin"].get<double>();
    }
    out[f.name] = std::move(f);
  }
  return out;
}

// The checkpoints generated where the test runs (into `out_dir`), or, where
// $PDSERVE_FAMILIES_DIR is set, those generated there beforehand (the
// device bundle: the device may lack numpy, so gpu_bundle.sh runs the
// scripts here with the same arguments).
inline std::map<std::string, FamilyReference> GeneratedOrBundledFamilies(
    const std::string& out_dir, int max_new) {
  if (const char* bundled = std::getenv("PDSERVE_FAMILIES_DIR");
      bundled != nullptr && *bundled != '\0') {
    return ReadFamilies(bundled);
  }
  return GenerateFamilies(out_dir, max_new);
}

// Greedy tokens the reference scripts are run with (engine_families_test and
// the CUDA family tests; gpu_bundle.sh passes the same).
inline constexpr int kFamilyMaxNew = 16;

// A checkpoint read with an edited config: what a family gives without one
// of its features (same weights; RoPE tables and windows follow the config).
using ConfigOverride = model::ConfigOverrideWeights;

// Each family feature and the config edit that drops it, with the checkpoint
// that has it: the CUDA family tests can fail only if dropping any of them
// moves the logits beyond their bf16 tolerance (checked on the CPU engine
// by engine_families_test).
struct FamilyFeature {
  std::string family;
  std::string feature;
  std::function<void(model::ModelConfig&)> drop;
};
inline std::vector<FamilyFeature> FamilyFeatures() {
  return {
      {"llama31", "llama3 RoPE", [](auto& c) { c.rope_scaling = {}; }},
      {"llama_linear", "q/k/v biases", [](auto& c) { c.qkv_bias = false; }},
      {"llama_linear", "o_proj bias", [](auto& c) { c.o_bias = false; }},
      {"qwen25", "q/k/v biases", [](auto& c) { c.qkv_bias = false; }},
      {"qwen3", "q/k norm", [](auto& c) { c.qk_norm = false; }},
      {"mistral", "sliding window", [](auto& c) { c.sliding_window = 0; }},
      {"qwen_windowed", "per-layer window (none)",
       [](auto& c) { c.sliding_window = 0; }},
      {"qwen_windowed", "per-layer window (every layer)",
       [](auto& c) { c.windowed_layers.clear(); }},
  };
}

// The CUDA backend's logits against the CPU engine's on the family
// checkpoints: max |error| / max |logit| per position (the bound of the
// stories260K comparisons in cuda_engine_test).
inline constexpr double kCudaFamilyLogitTolerance = 3e-2;

// log softmax(logits)[token], in double.
inline double LogProb(std::span<const float> logits, int32_t token) {
  double max = logits[0];
  for (float v : logits) max = std::max(max, double{v});
  double sum = 0;
  for (float v : logits) sum += std::exp(double{v} - max);
  return double{logits[token]} - max - std::log(sum);
}

}  // namespace pdserve::engine::testing_util
