// Mixture-of-experts benchmark (services/engine): a dummy-weight MoE shape
// (default ../shared/models/bench-configs/qwen3-moe-1b.json: 64 experts of
// 256, top 8, 16 layers) on the CPU engine, measured side by side in one
// run:
//   * batch-1 decode step time against the active-parameter roofline: the
//     bytes one token reads (attention, router, its k experts, lm_head) over
//     the step time, as a fraction of this machine's streaming-read
//     bandwidth with the same threads;
//   * the same decode step with every expert's weights read (a dense model
//     of the same total size: what reading only the chosen experts saves);
//   * tensor against expert parallelism at TP 2 (in-process ranks, one
//     thread each) for decode batches 1, 8 and 32 and a 512-token prefill,
//     with the expert load imbalance (max / mean tokens per expert) the
//     steps saw.
// Weights are dummy f32 (the quantized GGUF MoE formats are not read yet).
//
//   build/bench/moe_bench [--config PATH] [--threads 2] [--context 64]
//                         [--steps 8] [--prefill 512] [--reps 3]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "bench/stream_read.h"
#include "comm/communicator.h"
#include "engine/llama_engine.h"
#include "kv/kv_pool.h"
#include "model/config_override.h"
#include "model/weight_source.h"

namespace pdserve {
namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

struct Options {
  std::string config =
      std::string(PDSERVE_MODELS_DIR) + "/bench-configs/qwen3-moe-1b.json";
  int threads = 2;
  int context = 64;
  int steps = 8;
  int prefill = 512;
  int reps = 3;
};

constexpr int kBlockSize = 16;

// One engine group (1 rank, or TP ranks in lock step on threads) with a
// pool per rank holding `sequences` sequences of `capacity` tokens.
class Group {
 public:
  Group(const model::WeightSource& weights, int tp, int threads_per_rank,
        engine::ExpertParallelism mode, int sequences, int capacity)
      : sequences_(sequences) {
    if (tp > 1) comm_ = std::move(*comm::InProcessGroup::Create(tp));
    blocks_per_seq_ = (capacity + kBlockSize - 1) / kBlockSize;
    for (int r = 0; r < tp; ++r) {
      engine::EngineOptions o;
      o.shard = {0, -1, r, tp};
      o.num_threads = threads_per_rank;
      o.communicator = tp > 1 ? comm_->rank(r) : nullptr;
      o.expert_parallelism = mode;
      auto engine = engine::LlamaEngine::Create(weights, o);
      if (!engine.ok()) {
        std::fprintf(stderr, "%s\n", engine.status().ToString().c_str());
        std::exit(1);
      }
      auto pool = (*engine)->CreateKvPool(kBlockSize,
                                          int64_t{blocks_per_seq_} * sequences);
      if (!pool.ok()) std::exit(1);
      engines_.push_back(std::move(*engine));
      pools_.push_back(std::move(*pool));
    }
    tables_.resize(sequences);
    for (int s = 0; s < sequences; ++s) {
      tables_[s].resize(blocks_per_seq_);
      std::iota(tables_[s].begin(), tables_[s].end(), s * blocks_per_seq_);
    }
  }
  int64_t weight_bytes() const {
    int64_t total = 0;
    for (const auto& e : engines_) total += e->weight_bytes();
    return total;
  }
  const engine::LlamaEngine& rank0() const { return *engines_[0]; }

  // One step: `tokens` query tokens per sequence starting at `start`.
  double Step(int tokens, int start) {
    std::vector<std::vector<int32_t>> ids(sequences_);
    engine::ForwardBatch batch;
    for (int s = 0; s < sequences_; ++s) {
      ids[s].resize(tokens);
      for (int i = 0; i < tokens; ++i) ids[s][i] = 16 + (s * 131 + i * 7) % 900;
      engine::SequenceStep step;
      step.tokens = ids[s];
      step.num_tokens = tokens;
      step.start_position = start;
      step.block_table = tables_[s];
      step.logit_indices = {tokens - 1};
      batch.sequences.push_back(std::move(step));
    }
    const auto t0 = Clock::now();
    std::vector<std::thread> threads;
    for (size_t r = 1; r < engines_.size(); ++r) {
      threads.emplace_back([&, r] {
        engine::ForwardResult result;
        (void)engines_[r]->Forward(batch, *pools_[r], &result);
      });
    }
    engine::ForwardResult result;
    absl::Status status = engines_[0]->Forward(batch, *pools_[0], &result);
    for (auto& t : threads) t.join();
    if (!status.ok()) {
      std::fprintf(stderr, "%s\n", status.ToString().c_str());
      std::exit(1);
    }
    return Seconds(t0);
  }

 private:
  int sequences_;
  int blocks_per_seq_ = 0;
  std::unique_ptr<comm::InProcessGroup> comm_;
  std::vector<std::unique_ptr<engine::LlamaEngine>> engines_;
  std::vector<std::unique_ptr<kv::KvPool>> pools_;
  std::vector<std::vector<int32_t>> tables_;
};

// Max / mean tokens per expert over every sparse layer's counts.
double Imbalance(const engine::LlamaEngine& engine) {
  double worst = 0;
  for (const auto& layer : engine.ExpertLoad()) {
    int64_t total = 0, most = 0;
    for (int64_t n : layer) {
      total += n;
      most = std::max(most, n);
    }
    if (total > 0) {
      worst = std::max(worst, most * static_cast<double>(layer.size()) / total);
    }
  }
  return worst;
}

// Bytes one decode token reads: attention, router, k experts (and the
// shared expert), lm_head; dense layers' MLP; f32 weights.
double ActiveBytesPerToken(const model::ModelConfig& c) {
  const double h = c.hidden_size;
  double params = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    params += (c.q_dim() + 2.0 * c.kv_dim()) * h + h * c.q_dim();
    if (c.IsMoeLayer(l)) {
      params += c.num_experts * h +
                c.experts_per_token * 3.0 * c.expert_intermediate_size * h +
                3.0 * c.shared_expert_intermediate_size * h;
    } else {
      params += 3.0 * c.intermediate_size * h;
    }
  }
  params += double{c.vocab_size} * h;
  return params * 4;
}

// Median over reps of the mean step time of `steps` decode steps.
double DecodeSeconds(Group& g, const Options& opt, int steps) {
  std::vector<double> reps;
  for (int rep = 0; rep < opt.reps; ++rep) {
    double total = 0;
    for (int i = 0; i < steps; ++i) total += g.Step(1, opt.context + i);
    reps.push_back(total / steps);
  }
  std::sort(reps.begin(), reps.end());
  return reps[reps.size() / 2];
}

int Run(const Options& opt) {
  auto weights = model::OpenModel(opt.config, model::LoadFormat::kDummy);
  if (!weights.ok()) {
    std::fprintf(stderr, "%s\n", weights.status().ToString().c_str());
    return 1;
  }
  const model::ModelConfig& c = (*weights)->config();
  std::printf("# moe_bench: %s, %d experts top %d of width %d, %d layers\n\n",
              opt.config.c_str(), c.num_experts, c.experts_per_token,
              c.expert_intermediate_size, c.num_layers);

  // ---- Batch-1 decode against the active-parameter roofline -------------
  {
    Group single(**weights, 1, opt.threads, engine::ExpertParallelism::kTensor,
                 1, opt.context + opt.steps * opt.reps + 8);
    single.Step(opt.context, 0);  // the context's KV
    // Every expert read: the same model with k = num_experts (a dense MLP of
    // the total size; routing weights change, bytes are what is compared).
    model::ModelConfig all = c;
    all.experts_per_token = c.num_experts;
    model::ConfigOverrideWeights every(**weights, all);
    Group dense(every, 1, opt.threads, engine::ExpertParallelism::kTensor, 1,
                opt.context + opt.steps * opt.reps + 8);
    dense.Step(opt.context, 0);
    const size_t floats = size_t{128} << 20;
    std::vector<float> buffer(floats, 1.0f);
    double bandwidth = 0;
    double moe = 0, every_expert = 0;
    for (int round = 0; round < 2; ++round) {  // interleaved
      bandwidth = std::max(
          bandwidth,
          floats * 4.0 /
              bench::StreamReadSeconds(buffer.data(), floats, opt.threads));
      moe = DecodeSeconds(single, opt, opt.steps);
      every_expert = DecodeSeconds(dense, opt, opt.steps);
    }
    const double active = ActiveBytesPerToken(c);
    std::printf(
        "| batch-1 decode (%d threads, context %d) | step ms | bytes/token "
        "(GB) | GB/s | of read bandwidth (%.1f GB/s) |\n|---|---:|---:|---:|"
        "---:|\n",
        opt.threads, opt.context, bandwidth / 1e9);
    std::printf("| top-%d experts read | %.2f | %.3f | %.1f | %.2f |\n",
                c.experts_per_token, moe * 1e3, active / 1e9,
                active / moe / 1e9, active / moe / bandwidth);
    const double all_bytes = ActiveBytesPerToken(all);
    std::printf(
        "| every expert read (same weights) | %.2f | %.3f | %.1f | "
        "%.2f |\n",
        every_expert * 1e3, all_bytes / 1e9, all_bytes / every_expert / 1e9,
        all_bytes / every_expert / bandwidth);
    std::printf("\nreading only the routed experts: %.2fx faster per token\n\n",
                every_expert / moe);
  }

  // ---- TP against EP at TP 2 ---------------------------------------------
  std::printf(
      "| TP 2 (1 thread per rank) | tp ms | ep ms | ep / tp speed | "
      "imbalance (max/mean) |\n|---|---:|---:|---:|---:|\n");
  for (int batch : {1, 8, 32}) {
    const int capacity = opt.context + opt.steps * opt.reps + 8;
    Group tp(**weights, 2, 1, engine::ExpertParallelism::kTensor, batch,
             capacity);
    Group ep(**weights, 2, 1, engine::ExpertParallelism::kExpert, batch,
             capacity);
    tp.Step(opt.context, 0);
    ep.Step(opt.context, 0);
    const double tp_s = DecodeSeconds(tp, opt, opt.steps);
    const double ep_s = DecodeSeconds(ep, opt, opt.steps);
    std::printf("| decode batch %d | %.2f | %.2f | %.2fx | %.2f |\n", batch,
                tp_s * 1e3, ep_s * 1e3, tp_s / ep_s, Imbalance(ep.rank0()));
  }
  {
    Group tp(**weights, 2, 1, engine::ExpertParallelism::kTensor, 1,
             opt.prefill);
    Group ep(**weights, 2, 1, engine::ExpertParallelism::kExpert, 1,
             opt.prefill);
    std::vector<double> tp_s, ep_s;
    for (int rep = 0; rep < opt.reps; ++rep) {
      tp_s.push_back(tp.Step(opt.prefill, 0));
      ep_s.push_back(ep.Step(opt.prefill, 0));
    }
    std::sort(tp_s.begin(), tp_s.end());
    std::sort(ep_s.begin(), ep_s.end());
    const double a = tp_s[tp_s.size() / 2], b = ep_s[ep_s.size() / 2];
    std::printf("| prefill %d tokens | %.1f | %.1f | %.2fx | %.2f |\n",
                opt.prefill, a * 1e3, b * 1e3, a / b, Imbalance(ep.rank0()));
  }
  return 0;
}

}  // namespace
}  // namespace pdserve

int main(int argc, char** argv) {
  pdserve::Options opt;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--config") {
      opt.config = value;
    } else if (flag == "--threads") {
      opt.threads = std::stoi(value);
    } else if (flag == "--context") {
      opt.context = std::stoi(value);
    } else if (flag == "--steps") {
      opt.steps = std::stoi(value);
    } else if (flag == "--prefill") {
      opt.prefill = std::stoi(value);
    } else if (flag == "--reps") {
      opt.reps = std::stoi(value);
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  return pdserve::Run(opt);
}
