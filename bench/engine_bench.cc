// Reference engine benchmark on a dummy-weight model shape (default
// llama-110m): decode tokens/s at several batch sizes and prefill tokens/s,
// measured side by side with the machine's own limits in the same run
// (multi-threaded memcpy bandwidth, OpenBLAS sgemm FLOP/s), printed as ratios.
//
//   build/bench/engine_bench [--config PATH] [--threads N] [--prompt 512]
//                            [--batches 1,8,32] [--context 128] [--steps 16]
//                            [--projection-batches 1,4,8,16,32,64,512]
//                            [--kv-dtypes f32[,bf16]] [--scatter-blocks 0|1]
//
// With several --kv-dtypes every decode batch runs once per KV element type,
// back to back (one engine per type, same weights), so the rows compare.
// --scatter-blocks 1 deals the pool's blocks to the sequences in a fixed
// random order, as a serving pool looks once requests have come and gone
// (the default gives each sequence consecutive blocks).
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/thread_pool.h"
#include "engine/backend_flags.h"
#include "engine/llama_engine.h"
#include "engine/matmul.h"
#include "kv/kv_pool.h"
#include "model/weight_source.h"
#include "stream_read.h"

namespace pdserve {
namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Bytes copied per second by `threads` threads each memcpy-ing its share of a
// 512 MiB buffer (far beyond any cache). Best of several repetitions.
double MemcpyBandwidth(int threads) {
  const size_t bytes = size_t{512} << 20;
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    auto start = Clock::now();
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] {
        size_t begin = bytes * t / threads, end = bytes * (t + 1) / threads;
        std::memcpy(dst.data() + begin, src.data() + begin, end - begin);
      });
    }
    for (auto& w : workers) w.join();
    best = std::max(best, bytes / Seconds(start));
  }
  return best;
}

// Read-only streaming bandwidth (what GEMV weight reads are bounded by).
double ReadBandwidth(int threads) {
  const size_t floats = size_t{128} << 20;  // 512 MiB
  std::vector<float> data(floats, 1.0f);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    best = std::max(best,
                    floats * sizeof(float) /
                        bench::StreamReadSeconds(data.data(), floats, threads));
  }
  return best;
}

// OpenBLAS sgemm FLOP/s on a prefill-like shape [m, k] x [k, n], with
// `threads` OpenBLAS threads (the engine has set BLAS to one thread by the time
// this runs; measuring that would halve the denominator on 2 cores).
double SgemmFlops(int m, int n, int k, int threads) {
  std::vector<float> a(size_t(m) * k, 0.5f), b(size_t(n) * k, 0.25f),
      c(size_t(m) * n);
  openblas_set_num_threads(threads);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    auto start = Clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f,
                a.data(), k, b.data(), k, 0.0f, c.data(), n);
    best = std::max(best, 2.0 * m * n * k / Seconds(start));
  }
  openblas_set_num_threads(1);
  return best;
}

// The engine's projection kernel (PackedMatMul on the pre-packed matrix)
// against OpenBLAS on the row-major matrix (single-threaded sgemm per slice
// of output columns in the same pool) at decode batch sizes: milliseconds per
// call, best of several, the two interleaved.
void CompareProjectionKernels(int64_t rows, int64_t cols,
                              const std::vector<int>& batches, int threads) {
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  std::vector<float> w(size_t(rows) * cols), x(size_t(max_batch) * cols),
      y(size_t(max_batch) * rows);
  for (size_t i = 0; i < w.size(); ++i)
    w[i] = static_cast<float>((i * 2654435761u) % 1000) * 1e-4f;
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = static_cast<float>(i % 97) * 1e-2f;
  absl::StatusOr<engine::PackedMatrix> packed =
      engine::PackedMatrix::Pack(w.data(), rows, cols);
  if (!packed.ok()) {
    std::fprintf(stderr, "%s\n", packed.status().ToString().c_str());
    return;
  }
  ThreadPool pool(threads);
  std::printf(
      "\n| projection %lldx%lld (%.0f MB), batch | pdserve packed | OpenBLAS "
      "slices (%d threads) | speed-up |\n"
      "|---|---|---|---|\n",
      static_cast<long long>(rows), static_cast<long long>(cols),
      rows * cols * 4 / 1e6, threads);
  for (int n : batches) {
    double ours = 1e30, blas = 1e30;
    for (int rep = 0; rep < 5; ++rep) {
      auto start = Clock::now();
      engine::PackedMatMul(x.data(), n, *packed, y.data(), pool);
      ours = std::min(ours, Seconds(start));
      start = Clock::now();
      engine::BlasMatMul(x.data(), n, cols, w.data(), rows, y.data(), pool);
      blas = std::min(blas, Seconds(start));
    }
    const double flops = 2.0 * n * rows * cols;
    std::printf(
        "| %d | %.2f ms (%.1f GFLOP/s) | %.2f ms (%.1f GFLOP/s) | %.2fx |\n", n,
        ours * 1e3, flops / ours / 1e9, blas * 1e3, flops / blas / 1e9,
        blas / ours);
  }
}

struct Options {
  std::string config =
      std::string(PDSERVE_MODELS_DIR) + "/bench-configs/llama-110m.json";
  int threads = 0;
  int prompt = 512;
  std::vector<int> batches = {1, 8, 32};
  std::vector<int> projection_batches = {1, 4, 8, 16, 32, 64, 512};
  int context = 128;
  int steps = 16;
  std::vector<kv::KvDType> kv_dtypes = {kv::KvDType::kF32};
  bool scatter_blocks = false;
};

int Run(const Options& opt) {
  const int threads =
      opt.threads > 0 ? opt.threads
                      : static_cast<int>(std::thread::hardware_concurrency());
  auto weights = model::OpenModel(opt.config, model::LoadFormat::kDummy);
  if (!weights.ok()) {
    std::fprintf(stderr, "%s\n", weights.status().ToString().c_str());
    return 1;
  }
  const auto& c = (*weights)->config();
  engine::EngineOptions options;
  options.num_threads = threads;
  auto load_start = Clock::now();
  auto llama = engine::LlamaEngine::Create(**weights, options);
  if (!llama.ok()) {
    std::fprintf(stderr, "%s\n", llama.status().ToString().c_str());
    return 1;
  }
  auto& engine = **llama;
  // Decode engines by KV dtype (the first is `engine` when it is f32).
  std::vector<std::unique_ptr<engine::LlamaEngine>> extra_engines;
  std::vector<engine::LlamaEngine*> decode_engines;
  for (kv::KvDType dtype : opt.kv_dtypes) {
    if (dtype == kv::KvDType::kF32) {
      decode_engines.push_back(&engine);
      continue;
    }
    engine::EngineOptions kv_options = options;
    kv_options.kv_dtype = dtype;
    auto other = engine::LlamaEngine::Create(**weights, kv_options);
    if (!other.ok()) {
      std::fprintf(stderr, "%s\n", other.status().ToString().c_str());
      return 1;
    }
    extra_engines.push_back(*std::move(other));
    decode_engines.push_back(extra_engines.back().get());
  }
  const double weight_bytes = static_cast<double>(engine.weight_bytes());
  // Bytes a decode step must stream: every matrix once, but only the embedding
  // rows it looks up (not the whole table).
  const double streamed_bytes =
      weight_bytes -
      (c.tie_word_embeddings
           ? 0.0
           : static_cast<double>(c.vocab_size) * c.hidden_size * 4);
  std::printf(
      "model %s: %.1f M params (%.0f MB f32), loaded in %.1f s; %d threads\n",
      opt.config.c_str(), weight_bytes / 4e6, weight_bytes / 1e6,
      Seconds(load_start), threads);

  const double memcpy_bw = MemcpyBandwidth(threads);
  const double read_bw = ReadBandwidth(threads);
  const double sgemm =
      SgemmFlops(opt.prompt, c.intermediate_size, c.hidden_size, threads);
  std::printf(
      "machine: memcpy %.2f GB/s, streaming read %.2f GB/s, sgemm %.1f GFLOP/s "
      "(%dx%dx%d)\n",
      memcpy_bw / 1e9, read_bw / 1e9, sgemm / 1e9, opt.prompt,
      c.intermediate_size, c.hidden_size);

  constexpr int kBlockSize = 16;
  auto blocks_for = [&](int tokens) {
    return (tokens + kBlockSize - 1) / kBlockSize;
  };

  // Prefill.
  std::vector<int32_t> prompt(opt.prompt);
  for (int i = 0; i < opt.prompt; ++i)
    prompt[i] = (i * 7919 + 13) % c.vocab_size;
  double prefill_tps = 0, prefill_flops = 0;
  {
    auto pool =
        kv::KvPool::Create(engine.KvLayout(kBlockSize), blocks_for(opt.prompt));
    std::vector<int32_t> table(blocks_for(opt.prompt));
    for (size_t b = 0; b < table.size(); ++b)
      table[b] = static_cast<int32_t>(b);
    double best = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
      engine::ForwardBatch batch;
      engine::SequenceStep step;
      step.tokens = prompt;
      step.num_tokens = opt.prompt;
      step.block_table = table;
      step.logit_indices = {opt.prompt - 1};
      batch.sequences.push_back(step);
      engine::ForwardResult result;
      auto start = Clock::now();
      if (auto s = engine.Forward(batch, **pool, &result); !s.ok()) {
        std::fprintf(stderr, "%s\n", s.ToString().c_str());
        return 1;
      }
      best = std::min(best, Seconds(start));
    }
    prefill_tps = opt.prompt / best;
    // Matmul FLOPs per token (all layers, one lm_head row) + causal attention.
    const double d = c.hidden_size, f = c.intermediate_size, q = c.q_dim(),
                 kv = c.kv_dim();
    const double per_token_layer =
        2 * d * (q + 2 * kv) + 2 * q * d + 2 * 3 * d * f;
    const double attention =
        2.0 * 2 * q * (double(opt.prompt) * (opt.prompt + 1) / 2);
    prefill_flops = (per_token_layer * opt.prompt + attention) * c.num_layers +
                    2 * d * c.vocab_size;
    prefill_flops /= best;
  }

  // Decode at each batch size: every sequence has `context` tokens of KV.
  std::printf(
      "\n| measurement | value | ratio | target |\n|---|---|---|---|\n");
  std::printf(
      "| prefill %d tokens | %.0f tokens/s, %.1f GFLOP/s | %.2f of sgemm | >= "
      "0.5 |\n",
      opt.prompt, prefill_tps, prefill_flops / 1e9, prefill_flops / sgemm);
  for (int batch_size : opt.batches) {
    for (engine::LlamaEngine* decode_engine : decode_engines) {
      engine::LlamaEngine& engine = *decode_engine;
      const kv::KvCacheLayout kv_layout = engine.KvLayout(kBlockSize);
      const int max_tokens = opt.context + opt.steps + 1;
      const int per_seq_blocks = blocks_for(max_tokens);
      auto pool =
          kv::KvPool::Create(kv_layout, int64_t{per_seq_blocks} * batch_size);
      std::vector<int32_t> block_ids(int64_t{per_seq_blocks} * batch_size);
      std::iota(block_ids.begin(), block_ids.end(), 0);
      if (opt.scatter_blocks) {
        std::mt19937 rng(1234);
        std::shuffle(block_ids.begin(), block_ids.end(), rng);
      }
      std::vector<std::vector<int32_t>> tables(batch_size);
      for (int s = 0; s < batch_size; ++s) {
        tables[s].assign(block_ids.begin() + int64_t{s} * per_seq_blocks,
                         block_ids.begin() + int64_t{s + 1} * per_seq_blocks);
      }
      // Fill each sequence's context (one batched prefill step; not timed).
      {
        engine::ForwardBatch batch;
        std::vector<int32_t> context(opt.context, 5);
        for (int s = 0; s < batch_size; ++s) {
          engine::SequenceStep step;
          step.tokens = context;
          step.num_tokens = opt.context;
          step.block_table = tables[s];
          batch.sequences.push_back(step);
        }
        engine::ForwardResult result;
        if (auto st = engine.Forward(batch, **pool, &result); !st.ok()) {
          std::fprintf(stderr, "%s\n", st.ToString().c_str());
          return 1;
        }
      }
      std::vector<int32_t> next(batch_size, 7);
      auto start = Clock::now();
      for (int step_index = 0; step_index < opt.steps; ++step_index) {
        engine::ForwardBatch batch;
        for (int s = 0; s < batch_size; ++s) {
          engine::SequenceStep step;
          step.tokens = std::span<const int32_t>(&next[s], 1);
          step.num_tokens = 1;
          step.start_position = opt.context + step_index;
          step.block_table = tables[s];
          step.logit_indices = {0};
          batch.sequences.push_back(step);
        }
        engine::ForwardResult result;
        if (auto st = engine.Forward(batch, **pool, &result); !st.ok()) {
          std::fprintf(stderr, "%s\n", st.ToString().c_str());
          return 1;
        }
      }
      const double seconds = Seconds(start);
      const double steps_per_second = opt.steps / seconds;
      const double tps = steps_per_second * batch_size;
      const double weight_rate = steps_per_second * streamed_bytes;
      // KV the step's attention reads: every sequence's K and V, every layer,
      // once (the mean context over the timed steps).
      const double kv_bytes = static_cast<double>(batch_size) * c.num_layers *
                              2 * (opt.context + opt.steps / 2.0) * c.kv_dim() *
                              kv::KvDTypeSize(kv_layout.dtype);
      std::printf(
          "| decode batch %d (context %d, KV %s%s) | %.1f tokens/s, %.1f "
          "ms/step "
          "| "
          "weights %.2f GB/s = %.2f of memcpy, %.2f of read bw; + KV %.0f "
          "MB/step "
          "| %s |\n",
          batch_size, opt.context, kv::KvDTypeName(kv_layout.dtype),
          opt.scatter_blocks ? ", scattered blocks" : "", tps,
          1e3 / steps_per_second, weight_rate / 1e9, weight_rate / memcpy_bw,
          weight_rate / read_bw, kv_bytes / 1e6,
          batch_size == 1 ? ">= 0.6 of memcpy" : "-");
    }
  }
  // The lm_head (beyond the last-level cache on small machines) and one
  // layer's fused gate/up projection (cache-resident on most).
  CompareProjectionKernels(c.vocab_size, c.hidden_size, opt.projection_batches,
                           threads);
  CompareProjectionKernels(2 * c.intermediate_size, c.hidden_size,
                           opt.projection_batches, threads);
  return 0;
}

}  // namespace
}  // namespace pdserve

int main(int argc, char** argv) {
  pdserve::Options opt;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i], value = argv[i + 1];
    bool ok = true;
    if (flag == "--config") {
      opt.config = value;
    } else if (flag == "--threads") {
      ok = absl::SimpleAtoi(value, &opt.threads);
    } else if (flag == "--prompt") {
      ok = absl::SimpleAtoi(value, &opt.prompt);
    } else if (flag == "--context") {
      ok = absl::SimpleAtoi(value, &opt.context);
    } else if (flag == "--steps") {
      ok = absl::SimpleAtoi(value, &opt.steps);
    } else if (flag == "--scatter-blocks") {
      ok = value == "0" || value == "1";
      opt.scatter_blocks = value == "1";
    } else if (flag == "--kv-dtypes") {
      opt.kv_dtypes.clear();
      for (auto part : absl::StrSplit(value, ',')) {
        auto dtype = pdserve::engine::ParseKvDTypeFlag(
            std::string_view(part.data(), part.size()));
        ok = ok && dtype.ok() && dtype->has_value();
        if (ok) opt.kv_dtypes.push_back(**dtype);
      }
    } else if (flag == "--batches" || flag == "--projection-batches") {
      auto& list = flag == "--batches" ? opt.batches : opt.projection_batches;
      list.clear();
      for (auto part : absl::StrSplit(value, ',')) {
        int b = 0;
        ok = ok && absl::SimpleAtoi(part, &b) && b > 0;
        list.push_back(b);
      }
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr, "bad flag %s %s\n", flag.c_str(), value.c_str());
      return 2;
    }
  }
  return pdserve::Run(opt);
}
