// The CUDA backend on a dummy-weight model shape (default llama-8b), against
// what the GPU itself measures in the same run:
//   - decode TPOT at batch 1/32/128 vs the HBM roofline: (weight bytes + KV
//     bytes read) / device-to-device copy bandwidth (read + write traffic);
//   - prefill tokens/s as achieved GEMM FLOP/s vs cuBLAS bf16 on 8192^3;
//   - CUDA Graph replay vs eager launches, and the fused residual+RMSNorm vs
//     unfused, on the same decode steps;
//   - speculation with an always-right proposer at batch 1 (a γ+1-token
//     verify step vs γ+1 decode steps; the proposer itself costs nothing);
//   - the attention kernels (flash-decoding, tensor-core prefill) against
//     the legacy kernel on the same steps;
//   - with --peer-command, a peer (../shared/peers/torch_decode_peer.py) run
//     after this process has freed the GPU, its rows echoed, and pdserve ÷
//     peer printed for each row both measured.
// Prints a markdown table (docs/PERFORMANCE.md, CUDA). Needs a GPU.
//
//   build-cuda/bench/cuda_engine_bench [--config PATH] [--context 1024]
//       [--batches 1,32,128] [--prompt 2048] [--steps 20] [--gamma 4]
//       [--attention auto|legacy|tensor-core] [--compare-legacy 1]
//       [--compare-fusion 1] [--compare-gemv 1]
//       [--peer-command "python3 torch_decode_peer.py CONFIG ..."]
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "engine/backend_flags.h"
#include "engine/llama_engine.h"
#include "model/weight_source.h"

namespace pdserve {
namespace {

using Clock = std::chrono::steady_clock;
double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

struct Options {
  std::string config =
      std::string(PDSERVE_MODELS_DIR) + "/bench-configs/llama-8b.json";
  int context = 1024;
  std::vector<int> batches = {1, 32, 128};
  int prompt = 2048;
  int steps = 20;
  int gamma = 4;
  engine::AttentionKernels attention = engine::AttentionKernels::kAuto;
  bool compare_legacy = true;
  bool compare_fusion = true;
  bool compare_gemv = true;
  bool skip_reference = false;
  bool decode = true;  // --decode 0: prefill rows only (for a profiler)
  std::string peer_command;
};

// pdserve's figures that a peer row can be set against.
struct OwnRows {
  std::map<int, double> decode_ms;  // batch -> TPOT
  double prefill_tokens_per_second = 0;
  int prompt = 0;
};

#define CHECK_CUDA(expr)                                              \
  do {                                                                \
    cudaError_t e = (expr);                                           \
    if (e != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #expr, cudaGetErrorString(e)); \
      std::exit(1);                                                   \
    }                                                                 \
  } while (0)

// HBM traffic of a device-to-device copy (bytes read + written per second).
double CopyBandwidth() {
  const size_t bytes = size_t{2} << 30;
  void *a = nullptr, *b = nullptr;
  CHECK_CUDA(cudaMalloc(&a, bytes));
  CHECK_CUDA(cudaMalloc(&b, bytes));
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  CHECK_CUDA(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
  const int iterations = 10;
  cudaEventRecord(start);
  for (int i = 0; i < iterations; ++i) {
    cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice);
  }
  cudaEventRecord(stop);
  CHECK_CUDA(cudaEventSynchronize(stop));
  float ms = 0;
  cudaEventElapsedTime(&ms, start, stop);
  cudaFree(a);
  cudaFree(b);
  return 2.0 * bytes * iterations / (ms / 1e3);
}

// cuBLAS bf16 x bf16 -> f32 GEMM FLOP/s, m = n = k = 8192 (the engine's GEMM
// configuration).
double GemmRate() {
  const int n = 8192;
  void *a, *b, *c;
  CHECK_CUDA(cudaMalloc(&a, size_t{2} * n * n));
  CHECK_CUDA(cudaMalloc(&b, size_t{2} * n * n));
  CHECK_CUDA(cudaMalloc(&c, size_t{4} * n * n));
  cudaMemset(a, 0x3c, size_t{2} * n * n);  // bf16 ~0.011: finite products
  cudaMemset(b, 0x3c, size_t{2} * n * n);
  cublasHandle_t handle;
  cublasCreate(&handle);
  const float alpha = 1, beta = 0;
  auto run = [&] {
    cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &alpha, a,
                 CUDA_R_16BF, n, b, CUDA_R_16BF, n, &beta, c, CUDA_R_32F, n,
                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  };
  run();
  CHECK_CUDA(cudaDeviceSynchronize());
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  const int iterations = 10;
  cudaEventRecord(start);
  for (int i = 0; i < iterations; ++i) run();
  cudaEventRecord(stop);
  CHECK_CUDA(cudaEventSynchronize(stop));
  float ms = 0;
  cudaEventElapsedTime(&ms, start, stop);
  cublasDestroy(handle);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  return 2.0 * n * n * double{n} * iterations / (ms / 1e3);
}

struct Bench {
  const Options& opt;
  const model::ModelConfig& c;
  engine::LlamaEngine& engine;
  kv::KvPool& pool;
  static constexpr int kBlockSize = 16;
  int blocks_per_sequence = 0;

  // Mean seconds per step of `batch` sequences with `q` query tokens each
  // (every row wanting logits), starting at `context`, after 3 warm-ups.
  double StepSeconds(int batch, int q, bool argmax_only) {
    std::vector<std::vector<int32_t>> tables(batch), tokens(batch);
    for (int s = 0; s < batch; ++s) {
      tables[s].resize(blocks_per_sequence);
      std::iota(tables[s].begin(), tables[s].end(), s * blocks_per_sequence);
      tokens[s].assign(q, (s * 7919 + 13) % c.vocab_size);
    }
    auto step = [&](int position) {
      engine::ForwardBatch fb;
      fb.argmax_only = argmax_only;
      for (int s = 0; s < batch; ++s) {
        engine::SequenceStep seq;
        seq.tokens = tokens[s];
        seq.num_tokens = q;
        seq.start_position = position;
        seq.block_table = tables[s];
        for (int i = 0; i < q; ++i) seq.logit_indices.push_back(i);
        fb.sequences.push_back(std::move(seq));
      }
      engine::ForwardResult result;
      const absl::Status status = engine.Forward(fb, pool, &result);
      if (!status.ok()) {
        std::fprintf(stderr, "step: %s\n", status.ToString().c_str());
        std::exit(1);
      }
    };
    for (int i = 0; i < 3; ++i) step(opt.context);
    const auto start = Clock::now();
    for (int i = 0; i < opt.steps; ++i) step(opt.context);
    return SecondsSince(start) / opt.steps;
  }

  double PrefillSeconds(int sequences, int tokens) {
    std::vector<int32_t> prompt(tokens);
    for (int i = 0; i < tokens; ++i) prompt[i] = (i * 7919 + 13) % c.vocab_size;
    std::vector<std::vector<int32_t>> tables(sequences);
    for (int s = 0; s < sequences; ++s) {
      tables[s].resize(blocks_per_sequence);
      std::iota(tables[s].begin(), tables[s].end(), s * blocks_per_sequence);
    }
    auto run = [&] {
      engine::ForwardBatch fb;
      for (int s = 0; s < sequences; ++s) {
        engine::SequenceStep seq;
        seq.tokens = prompt;
        seq.num_tokens = tokens;
        seq.block_table = tables[s];
        seq.logit_indices = {tokens - 1};
        fb.sequences.push_back(std::move(seq));
      }
      engine::ForwardResult result;
      const absl::Status status = engine.Forward(fb, pool, &result);
      if (!status.ok()) {
        std::fprintf(stderr, "prefill: %s\n", status.ToString().c_str());
        std::exit(1);
      }
    };
    run();
    const auto start = Clock::now();
    const int repeats = 3;
    for (int i = 0; i < repeats; ++i) run();
    return SecondsSince(start) / repeats;
  }
};

std::unique_ptr<engine::LlamaEngine> Load(const model::WeightSource& weights,
                                          engine::CudaOptions cuda,
                                          double* seconds) {
  engine::EngineOptions options;
  options.backend = engine::Backend::kCuda;
  options.cuda = cuda;
  const auto start = Clock::now();
  auto engine = engine::LlamaEngine::Create(weights, options);
  if (!engine.ok()) {
    std::fprintf(stderr, "engine: %s\n", engine.status().ToString().c_str());
    std::exit(1);
  }
  *seconds = SecondsSince(start);
  return std::move(engine).value();
}

// Runs the peer, echoes its output, and prints pdserve ÷ peer per row: the
// peer's TPOT over ours (>1 = pdserve faster) and our prefill tokens/s over
// its.
void RunPeer(const Options& opt, const OwnRows& own) {
  std::printf("\n== peer: %s\n", opt.peer_command.c_str());
  std::fflush(stdout);
  FILE* pipe = popen((opt.peer_command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) {
    std::printf("peer: cannot start\n");
    return;
  }
  std::map<int, double> peer_decode;
  double peer_prefill = 0;
  char line[4096];
  while (std::fgets(line, sizeof(line), pipe) != nullptr) {
    std::fputs(line, stdout);
    // "| torch graph decode TPOT batch 32, context 1024 | 9.42 ms | ..."
    // "| torch eager prefill 1 x 2048 tokens | 30900 tokens/s (...) | ..."
    const std::vector<std::string> cells = absl::StrSplit(line, '|');
    if (cells.size() < 3) continue;
    const std::string name(absl::StripAsciiWhitespace(cells[1]));
    const std::string value(absl::StripAsciiWhitespace(cells[2]));
    const std::vector<std::string> words = absl::StrSplit(value, ' ');
    double number = 0;
    if (words.empty() || !absl::SimpleAtod(words[0], &number)) continue;
    if (const size_t at = name.find("decode TPOT batch ");
        at != std::string::npos) {
      int batch = 0;
      const std::vector<std::string> rest =
          absl::StrSplit(name.substr(at + 18), ',');
      if (!rest.empty() && absl::SimpleAtoi(rest[0], &batch)) {
        peer_decode[batch] = number;
      }
    } else if (name.find("prefill 1 x") != std::string::npos) {
      peer_prefill = number;
    }
  }
  const int rc = pclose(pipe);
  if (rc != 0) std::printf("peer exited with status %d\n", rc);
  std::printf(
      "\n| row | pdserve | peer | pdserve ÷ peer (>1: pdserve faster) "
      "|\n|---|---|---|---|\n");
  for (const auto& [batch, ms] : own.decode_ms) {
    if (!peer_decode.count(batch)) continue;
    std::printf("| decode TPOT batch %d | %.3f ms | %.3f ms | %.2f |\n", batch,
                ms, peer_decode[batch], peer_decode[batch] / ms);
  }
  if (peer_prefill > 0 && own.prefill_tokens_per_second > 0) {
    std::printf(
        "| prefill 1 x %d tokens | %.0f tokens/s | %.0f tokens/s | "
        "%.2f |\n",
        own.prompt, own.prefill_tokens_per_second, peer_prefill,
        own.prefill_tokens_per_second / peer_prefill);
  }
}

int Run(const Options& opt) {
  auto weights = model::OpenModel(opt.config, model::LoadFormat::kDummy);
  if (!weights.ok()) {
    std::fprintf(stderr, "%s\n", weights.status().ToString().c_str());
    return 1;
  }
  const model::ModelConfig& c = (*weights)->config();
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  // --skip-reference: the engine's kernels come first (a profiler counting
  // launches then sees the first decode step from the start).
  const double copy_bw = opt.skip_reference ? NAN : CopyBandwidth();
  const double gemm = opt.skip_reference ? NAN : GemmRate();
  std::printf(
      "device: %s; copy %.0f GB/s (read+write), bf16 GEMM %.0f "
      "TFLOP/s (8192^3); attention kernels: %s\n",
      prop.name, copy_bw / 1e9, gemm / 1e12,
      engine::AttentionKernelsName(opt.attention));

  const int max_batch =
      *std::max_element(opt.batches.begin(), opt.batches.end());
  engine::CudaOptions cuda;
  cuda.attention = opt.attention;
  cuda.max_graph_batch = std::max(max_batch, 1);
  cuda.max_sequences = std::max(max_batch, 4);
  cuda.max_tokens_per_step =
      std::max(4 * opt.prompt, max_batch * (opt.gamma + 1));
  cuda.max_graph_tokens_per_sequence = opt.gamma + 1;

  const int tokens_per_sequence =
      std::max(opt.context + opt.gamma + 1, opt.prompt);
  const int blocks_per_sequence =
      (tokens_per_sequence + Bench::kBlockSize - 1) / Bench::kBlockSize;
  const int sequences = std::max(max_batch, 4);
  const double kv_bytes_per_token =
      2.0 * c.num_layers * c.num_kv_heads * c.head_dim * 2;  // bf16 K and V

  std::printf(
      "\n| measurement | value | reference | ratio |\n|---|---|---|---|\n");
  std::vector<double> graph_tpot;
  double decode_batch1 = 0, prefill_one = 0;
  OwnRows own;
  own.prompt = opt.prompt;
  const bool legacy_variant =
      opt.compare_legacy && opt.attention != engine::AttentionKernels::kLegacy;
  for (int variant = 0; variant < 5; ++variant) {
    // 0: graphs + fused (production); 1: eager; 2: graphs, unfused norm;
    // 3: graphs + fused with the legacy attention kernel; 4: production with
    // cuBLAS instead of the small-batch GEMV.
    if (variant == 3 && !legacy_variant) continue;
    if (variant == 4 && !opt.compare_gemv) continue;
    engine::CudaOptions o = cuda;
    o.use_graphs = variant != 1;
    o.fuse_residual_norm = variant != 2;
    if (variant == 3) o.attention = engine::AttentionKernels::kLegacy;
    if (variant == 2 && !opt.compare_fusion) continue;
    if (variant == 4) o.small_batch_gemv = false;
    double load_seconds = 0;
    auto engine = Load(**weights, o, &load_seconds);
    auto pool = engine->CreateKvPool(Bench::kBlockSize,
                                     int64_t{sequences} * blocks_per_sequence);
    if (!pool.ok()) {
      std::fprintf(stderr, "pool: %s\n", pool.status().ToString().c_str());
      return 1;
    }
    Bench bench{opt, c, *engine, **pool, blocks_per_sequence};
    if (variant == 0) {
      std::printf("| load %s (bf16 %.1f GB) | %.1f s | | |\n",
                  opt.config.c_str(), engine->weight_bytes() / 1e9,
                  load_seconds);
    }
    for (size_t i = 0; opt.decode && i < opt.batches.size(); ++i) {
      const int b = opt.batches[i];
      const double t = bench.StepSeconds(b, 1, /*argmax_only=*/true);
      if (variant == 0) {
        graph_tpot.push_back(t);
        own.decode_ms[b] = t * 1e3;
        if (b == 1) decode_batch1 = t;
        const double bytes = engine->weight_bytes() +
                             b * (opt.context + 1.0) * kv_bytes_per_token;
        const double roofline = bytes / copy_bw;
        std::printf(
            "| decode TPOT batch %d, context %d (graph) | %.3f ms | "
            "roofline %.3f ms | %.2f |\n",
            b, opt.context, t * 1e3, roofline * 1e3, roofline / t);
        const double with_logits = bench.StepSeconds(b, 1, false);
        std::printf(
            "| same, logits copied to host | %.3f ms | argmax-only "
            "%.3f ms | %.2f |\n",
            with_logits * 1e3, t * 1e3, t / with_logits);
      } else if (variant == 4) {
        std::printf(
            "| decode TPOT batch %d, cuBLAS for every GEMM | %.3f ms | "
            "small-batch GEMV %.3f ms | GEMV speedup %.2f |\n",
            b, t * 1e3, graph_tpot[i] * 1e3, t / graph_tpot[i]);
      } else if (variant == 3) {
        std::printf(
            "| decode TPOT batch %d, legacy attention kernel | %.3f ms | "
            "%s %.3f ms | new kernels' speedup %.2f |\n",
            b, t * 1e3, engine::AttentionKernelsName(opt.attention),
            graph_tpot[i] * 1e3, t / graph_tpot[i]);
      } else if (variant == 1) {
        std::printf(
            "| decode step batch %d eager | %.3f ms | graph %.3f ms "
            "| graph speedup %.2f |\n",
            b, t * 1e3, graph_tpot[i] * 1e3, t / graph_tpot[i]);
      } else {
        std::printf(
            "| decode step batch %d unfused add+norm | %.3f ms | "
            "fused %.3f ms | fusion speedup %.2f |\n",
            b, t * 1e3, graph_tpot[i] * 1e3, t / graph_tpot[i]);
      }
    }
    if (variant == 4) continue;
    if (variant == 3) {
      const double t = bench.PrefillSeconds(1, opt.prompt);
      std::printf(
          "| prefill 1 x %d tokens, legacy attention kernel | %.0f tokens/s "
          "| %s %.0f tokens/s | new kernels' speedup %.2f |\n",
          opt.prompt, opt.prompt / t,
          engine::AttentionKernelsName(opt.attention), opt.prompt / prefill_one,
          t / prefill_one);
    }
    if (variant != 0) continue;
    // Prefill: one and four prompts in one step.
    const double matmul_params =
        static_cast<double>(c.num_layers) *
        (static_cast<double>(c.hidden_size) *
             (c.num_heads + 2 * c.num_kv_heads) * c.head_dim +
         static_cast<double>(c.num_heads) * c.head_dim * c.hidden_size +
         3.0 * c.hidden_size * c.intermediate_size);
    for (int n : {1, 4}) {
      const double t = bench.PrefillSeconds(n, opt.prompt);
      const double tokens = static_cast<double>(n) * opt.prompt;
      const double attention_flops = 2.0 * 2.0 * c.num_layers * c.num_heads *
                                     c.head_dim * 0.5 * opt.prompt *
                                     static_cast<double>(opt.prompt) * n;
      const double flops = 2.0 * matmul_params * tokens + attention_flops;
      std::printf(
          "| prefill %d x %d tokens | %.0f tokens/s (%.0f TFLOP/s) | "
          "GEMM %.0f TFLOP/s | %.2f |\n",
          n, opt.prompt, tokens / t, flops / t / 1e12, gemm / 1e12,
          flops / t / gemm);
      if (n == 1) {
        prefill_one = t;
        own.prefill_tokens_per_second = tokens / t;
      }
    }
    // Speculation, always-right proposer, batch 1: a verify step emits γ+1.
    const double verify = bench.StepSeconds(1, opt.gamma + 1, true);
    std::printf(
        "| verify step γ=%d, batch 1 (graph) | %.3f ms | decode %.3f "
        "ms | always-right speedup %.2f |\n",
        opt.gamma, verify * 1e3, decode_batch1 * 1e3,
        (opt.gamma + 1) * decode_batch1 / verify);
  }
  std::fflush(stdout);
  if (!opt.peer_command.empty()) RunPeer(opt, own);
  return 0;
}

}  // namespace
}  // namespace pdserve

int main(int argc, char** argv) {
  pdserve::Options opt;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    int number = 0;
    if (flag == "--config") {
      opt.config = value;
    } else if (flag == "--peer-command") {
      opt.peer_command = value;
    } else if (flag == "--attention") {
      auto kernels = pdserve::engine::ParseAttentionKernels(value);
      if (!kernels.ok()) {
        std::fprintf(stderr, "%s\n", kernels.status().ToString().c_str());
        return 2;
      }
      opt.attention = *kernels;
    } else if (flag == "--compare-legacy") {
      opt.compare_legacy = value != "0";
    } else if (flag == "--decode") {
      opt.decode = value != "0";
    } else if (flag == "--skip-reference") {
      opt.skip_reference = value != "0";
    } else if (flag == "--compare-gemv") {
      opt.compare_gemv = value != "0";
    } else if (flag == "--compare-fusion") {
      opt.compare_fusion = value != "0";
    } else if (flag == "--batches") {
      opt.batches.clear();
      for (absl::string_view part : absl::StrSplit(value, ',')) {
        if (absl::SimpleAtoi(part, &number) && number > 0) {
          opt.batches.push_back(number);
        }
      }
    } else if (absl::SimpleAtoi(value, &number) && number > 0) {
      if (flag == "--context")
        opt.context = number;
      else if (flag == "--prompt")
        opt.prompt = number;
      else if (flag == "--steps")
        opt.steps = number;
      else if (flag == "--gamma")
        opt.gamma = number;
    }
  }
  if (opt.batches.empty()) opt.batches = {1};
  return pdserve::Run(opt);
}
