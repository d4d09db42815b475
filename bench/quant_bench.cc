// pdserve's side of bench/quant_vs_llamacpp.sh: writes GGUF files of a model
// shape in f32 / f16 / Q8_0 / Q4_K_M (deterministic pseudo-random weights
// through the reference quantizer of model/quant_formats.h), and times the
// CPU engine on one of them: a 512-token prefill and batch-1 greedy decode.
//
//   build/bench/quant_bench make --config CONFIG.json --dir DIR
//       [--formats f32,f16,q8_0,q4_k_m]
//   build/bench/quant_bench run --model FILE.gguf [--threads 2]
//       [--prompt 512] [--decode 64] [--repeats 3]
//       [--quantized-matmul int8|exact]
//   build/bench/quant_bench kernels [--rows 2048] [--cols 768] [--threads 2]
//
// `run` prints one JSON line: {"format", "prefill_tok_s", "decode_tok_s",
// "weight_bytes"} with the best of --repeats runs of each.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/thread_pool.h"
#include "engine/llama_engine.h"
#include "engine/matmul.h"
#include "kv/kv_pool.h"
#include "model/gguf_writer.h"
#include "model/model_config.h"
#include "model/weight_source.h"

namespace pdserve {
namespace {

using model::TensorFormat;

std::string Flag(int argc, char** argv, const std::string& name,
                 const std::string& fallback) {
  for (int i = 2; i + 1 < argc; ++i) {
    if (argv[i] == "--" + name) return argv[i + 1];
  }
  return fallback;
}

int IntFlag(int argc, char** argv, const std::string& name, int fallback) {
  int value = fallback;
  const std::string text = Flag(argc, argv, name, "");
  if (!text.empty() && !absl::SimpleAtoi(text, &value)) {
    std::fprintf(stderr, "bad --%s %s\n", name.c_str(), text.c_str());
    std::exit(2);
  }
  return value;
}

// Weights a trained model's scale: N(0, 1/sqrt(cols)) for matrices, ~1 for
// norms; generated per tensor from its name, so every file holds the same
// values before quantization.
std::vector<float> BenchValues(const std::string& name,
                               const std::vector<int64_t>& shape) {
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  std::minstd_rand rng(static_cast<uint32_t>(std::hash<std::string>()(name)));
  const bool norm = shape.size() == 1;
  const float scale =
      norm ? 0.1f : 1.0f / std::sqrt(static_cast<float>(shape.back()));
  std::vector<float> values(count);
  // Sum of 4 uniforms: close enough to normal, and fast for 100M values.
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (float& v : values) {
    const float u = uniform(rng) + uniform(rng) + uniform(rng) + uniform(rng);
    v = (norm ? 1.0f : 0.0f) + scale * u * 0.866f;
  }
  return values;
}

int Make(int argc, char** argv) {
  const std::string config_path = Flag(argc, argv, "config", "");
  const std::string dir = Flag(argc, argv, "dir", "");
  if (config_path.empty() || dir.empty()) {
    std::fprintf(stderr, "make needs --config and --dir\n");
    return 2;
  }
  std::ifstream in(config_path);
  std::stringstream text;
  text << in.rdbuf();
  auto config = model::ParseHfConfigJson(text.str(), config_path);
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n",
                 std::string(config.status().message()).c_str());
    return 1;
  }
  const std::vector<std::string> formats =
      absl::StrSplit(Flag(argc, argv, "formats", "f32,f16,q8_0,q4_k_m"), ',');
  for (const std::string& name : formats) {
    model::TensorFormatFn format_of;
    const model::ModelConfig& c = *config;
    auto norm = [](const std::string& tensor) {
      return tensor.find("norm") != std::string::npos;
    };
    if (name == "f32") {
      format_of = [](const std::string&) { return TensorFormat::kF32; };
    } else if (name == "f16") {
      format_of = [&](const std::string& t) {
        return norm(t) ? TensorFormat::kF32 : TensorFormat::kF16;
      };
    } else if (name == "q8_0") {
      format_of = [&](const std::string& t) {
        return norm(t) ? TensorFormat::kF32 : TensorFormat::kQ8_0;
      };
    } else if (name == "q4_k_m") {
      format_of = [&](const std::string& t) {
        return model::Q4KMFormatOf(c, t);
      };
    } else {
      std::fprintf(stderr, "unknown format %s\n", name.c_str());
      return 2;
    }
    const std::string path = dir + "/bench-" + name + ".gguf";
    absl::Status written =
        model::WriteLlamaGguf(path, c, BenchValues, format_of);
    if (!written.ok()) {
      std::fprintf(stderr, "%s\n", std::string(written.message()).c_str());
      return 1;
    }
    std::printf("wrote %s\n", path.c_str());
  }
  return 0;
}

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since)
      .count();
}

int Run(int argc, char** argv) {
  const std::string path = Flag(argc, argv, "model", "");
  const int threads = IntFlag(argc, argv, "threads", 2);
  const int prompt_len = IntFlag(argc, argv, "prompt", 512);
  const int decode_steps = IntFlag(argc, argv, "decode", 64);
  const int repeats = IntFlag(argc, argv, "repeats", 3);
  const std::string matmul = Flag(argc, argv, "quantized-matmul", "int8");
  if (matmul != "int8" && matmul != "exact") {
    std::fprintf(stderr, "--quantized-matmul is int8 or exact, not %s\n",
                 matmul.c_str());
    return 2;
  }
  auto weights = model::OpenModel(path);
  if (!weights.ok()) {
    std::fprintf(stderr, "%s\n",
                 std::string(weights.status().message()).c_str());
    return 1;
  }
  engine::EngineOptions options;
  options.num_threads = threads;
  options.quantized_matmul = matmul == "int8"
                                 ? engine::QuantizedMatmul::kInt8Activations
                                 : engine::QuantizedMatmul::kExact;
  auto engine = engine::LlamaEngine::Create(**weights, options);
  if (!engine.ok()) {
    std::fprintf(stderr, "%s\n",
                 std::string(engine.status().message()).c_str());
    return 1;
  }
  const model::ModelConfig& config = (*engine)->config();
  constexpr int kBlock = 16;
  const int blocks = (prompt_len + decode_steps + kBlock) / kBlock + 1;
  auto pool = (*engine)->CreateKvPool(kBlock, blocks);
  if (!pool.ok()) return 1;
  std::vector<int32_t> table(blocks);
  for (int b = 0; b < blocks; ++b) table[b] = b;
  std::vector<int32_t> prompt(prompt_len);
  std::minstd_rand rng(5);
  for (int32_t& t : prompt) t = 259 + rng() % (config.vocab_size - 259);

  double best_prefill = 0, best_decode = 0;
  engine::ForwardResult result;
  for (int rep = 0; rep < repeats; ++rep) {
    engine::ForwardBatch batch;
    engine::SequenceStep step;
    step.tokens = prompt;
    step.num_tokens = prompt_len;
    step.block_table = table;
    step.logit_indices = {prompt_len - 1};
    batch.sequences.push_back(step);
    auto start = std::chrono::steady_clock::now();
    if (!(*engine)->Forward(batch, **pool, &result).ok()) return 1;
    best_prefill = std::max(best_prefill, prompt_len / Seconds(start));
    int32_t next = result.argmax[0];
    start = std::chrono::steady_clock::now();
    for (int i = 0; i < decode_steps; ++i) {
      engine::ForwardBatch one;
      engine::SequenceStep s;
      s.tokens = std::span<const int32_t>(&next, 1);
      s.num_tokens = 1;
      s.start_position = prompt_len + i;
      s.block_table = table;
      s.logit_indices = {0};
      one.sequences.push_back(s);
      if (!(*engine)->Forward(one, **pool, &result).ok()) return 1;
      next = result.argmax[0];
    }
    best_decode = std::max(best_decode, decode_steps / Seconds(start));
  }
  std::printf(
      "{\"engine\": \"pdserve\", \"model\": \"%s\", \"threads\": %d, "
      "\"quantized_matmul\": \"%s\", \"prefill_tok_s\": %.1f, "
      "\"decode_tok_s\": %.1f, \"weight_bytes\": %lld}\n",
      path.c_str(), threads, matmul.c_str(), best_prefill, best_decode,
      static_cast<long long>((*engine)->weight_bytes()));
  return 0;
}

// MatMul alone on one projection shape per format: microseconds per call
// at n activation rows (best of 20), single-threaded and on --threads.
int Kernels(int argc, char** argv) {
  const int rows = IntFlag(argc, argv, "rows", 2048);
  const int cols = IntFlag(argc, argv, "cols", 768);
  const int threads = IntFlag(argc, argv, "threads", 2);
  const std::vector<float> w = BenchValues("kernel", {rows, cols});
  for (TensorFormat format :
       {TensorFormat::kF32, TensorFormat::kF16, TensorFormat::kQ8_0,
        TensorFormat::kQ4_K, TensorFormat::kQ6_K}) {
    const int64_t row_bytes = model::RowBytes(format, cols);
    std::vector<uint8_t> stored(rows * row_bytes);
    for (int r = 0; r < rows; ++r) {
      model::QuantizeRow(format, w.data() + int64_t{r} * cols, cols,
                         stored.data() + r * row_bytes);
    }
    engine::WeightMatrix matrix;
    if (!matrix
             .AppendStored(format, stored.data(), row_bytes, rows, cols, 0,
                           nullptr)
             .ok()) {
      return 1;
    }
    // Quantized formats both ways: exact f32 products, int8 activations.
    for (bool int8 : {false, true}) {
      if (int8 && !model::IsQuantized(format)) continue;
      matrix.set_int8_activations(int8);
      for (int n : {1, 4, 16, 512}) {
        std::vector<float> x(int64_t{n} * cols), y(int64_t{n} * rows);
        for (size_t i = 0; i < x.size(); ++i)
          x[i] = 0.01f * std::sin(0.37f * i);
        for (int t : {1, threads}) {
          ThreadPool pool(t);
          double best = 1e9;
          for (int rep = 0; rep < (n >= 512 ? 3 : 20); ++rep) {
            auto start = std::chrono::steady_clock::now();
            engine::MatMul(x.data(), n, matrix, y.data(), pool);
            best = std::min(best, Seconds(start));
          }
          std::printf(
              "%-5s %-5s %dx%d n=%-4d threads=%d  %9.1f us  %6.1f GB/s  %6.1f "
              "GFLOP/s\n",
              std::string(model::TensorFormatName(format)).c_str(),
              int8 ? "int8" : "f32", rows, cols, n, t, best * 1e6,
              rows * row_bytes / best / 1e9,
              2.0 * n * rows * cols / best / 1e9);
        }
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace pdserve

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "kernels") return pdserve::Kernels(argc, argv);
  if (mode == "make") return pdserve::Make(argc, argv);
  if (mode == "run") return pdserve::Run(argc, argv);
  std::fprintf(stderr, "usage: quant_bench make|run ... (see the source)\n");
  return 2;
}
