// Decode worker benchmark (services/decode): end-to-end DecodeWorker tokens/s
// on a dummy-weight llama-110m at several batch sizes and TP degrees,
// speculation with an always-right proposer against speculation off, the
// verify-cost curve that sets the speculation-off rule, and the n-gram
// proposer's mean acceptance length on the stories260K golden prompts, and
// what asking for logprobs (and 20 alternatives) costs a decode step.
// Everything compared is measured side by side in one run, interleaved
// repetition by repetition (the dev machine is 2 shared, noisy cores).
//
//   build/bench/decode_bench [--config PATH] [--threads N] [--context 64]
//                            [--new-tokens 32] [--batches 1,8,32] [--tp 1,2]
//                            [--reps 3]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "decode/decode_worker.h"
#include "engine/llama_engine.h"
#include "kv/kv_pool.h"
#include "model/weight_source.h"
#include "nlohmann/json.hpp"

namespace pdserve {
namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

struct Options {
  std::string config =
      std::string(PDSERVE_MODELS_DIR) + "/bench-configs/llama-110m.json";
  std::string stories = std::string(PDSERVE_MODELS_DIR) + "/stories260K";
  int threads = 0;
  int context = 64;
  int new_tokens = 32;
  std::vector<int> batches = {1, 8, 32};
  std::vector<int> tp = {1, 2};
  int reps = 3;
};

// One batch run: every request is submitted at once (local prefill), and the
// rate counts only tokens emitted after the last request got its first token
// (pure decode, the whole batch running) up to the last final delta.
struct BatchRun {
  double decode_tps = 0;
  std::vector<std::vector<int32_t>> outputs;
};

class Runner {
 public:
  explicit Runner(std::unique_ptr<decode::DecodeWorker> worker)
      : worker_(std::move(worker)) {}
  decode::DecodeWorker& worker() { return *worker_; }

  absl::StatusOr<BatchRun> Run(const std::vector<std::vector<int32_t>>& prompts,
                               const decode::RequestParams& params) {
    struct Event {
      Clock::time_point time;
      size_t request;
      int tokens;
      bool first;
    };
    absl::Mutex mu;
    std::vector<Event> events;
    std::vector<std::vector<int32_t>> outputs(prompts.size());
    size_t finished = 0;
    absl::Status failure;
    for (size_t i = 0; i < prompts.size(); ++i) {
      auto callback = [&, i](const decode::TokenDelta& d) {
        // Runs on the scheduler thread: record and return.
        absl::MutexLock lock(&mu);
        const bool first = outputs[i].empty() && !d.tokens.empty();
        outputs[i].insert(outputs[i].end(), d.tokens.begin(), d.tokens.end());
        events.push_back(
            {Clock::now(), i, static_cast<int>(d.tokens.size()), first});
        if (d.finished) {
          ++finished;
          if (!d.status.ok()) failure = d.status;
        }
      };
      if (auto s = worker_->Submit(next_id_++, prompts[i], params, callback);
          !s.ok())
        return s;
    }
    {
      absl::MutexLock lock(&mu);
      auto all_done = [&] { return finished == prompts.size(); };
      if (!mu.AwaitWithTimeout(absl::Condition(&all_done), absl::Minutes(10)))
        return absl::DeadlineExceededError("batch did not finish");
      if (!failure.ok()) return failure;
    }
    // Every event was recorded under mu; the callbacks are all done now.
    Clock::time_point decode_start = events.front().time;
    for (const Event& e : events)
      if (e.first) decode_start = std::max(decode_start, e.time);
    int64_t tokens = 0;
    Clock::time_point end = decode_start;
    for (const Event& e : events) {
      if (e.time <= decode_start) continue;
      tokens += e.tokens;
      end = std::max(end, e.time);
    }
    BatchRun run;
    const double seconds =
        std::chrono::duration<double>(end - decode_start).count();
    run.decode_tps = seconds > 0 ? tokens / seconds : 0;
    run.outputs = std::move(outputs);
    return run;
  }

 private:
  std::unique_ptr<decode::DecodeWorker> worker_;
  uint64_t next_id_ = 1;
};

std::vector<std::vector<int32_t>> Prompts(int count, int length, int vocab) {
  std::vector<std::vector<int32_t>> prompts(count);
  for (int p = 0; p < count; ++p) {
    for (int i = 0; i < length; ++i)
      prompts[p].push_back((i * 7919 + p * 104729 + 13) % vocab);
  }
  return prompts;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

decode::DecodeWorkerOptions WorkerOptions(const Options& opt, int tp,
                                          int threads) {
  decode::DecodeWorkerOptions o;
  o.tp_size = tp;
  // The same cores in total whatever T is: T ranks split them.
  o.threads_per_rank = std::max(1, threads / tp);
  o.block_size = 16;
  const int per_seq = (opt.context + opt.new_tokens + 8) / 16 + 1;
  o.num_blocks = int64_t{per_seq} * 32 + 64;
  o.max_running = 64;
  o.max_step_tokens = 512;
  return o;
}

absl::StatusOr<std::unique_ptr<Runner>> MakeRunner(
    const model::WeightSource& weights,
    const decode::DecodeWorkerOptions& options) {
  auto worker = decode::DecodeWorker::Create(weights, nullptr, options);
  if (!worker.ok()) return worker.status();
  return std::make_unique<Runner>(std::move(*worker));
}

// Seconds of one engine forward with `batch` sequences of `context` cached
// tokens each feeding `tokens` query tokens with logits at all of them (a
// verify step when tokens > 1). Best of `reps`.
double ForwardSeconds(engine::LlamaEngine& engine, kv::KvPool& pool, int batch,
                      int context, int tokens, int reps) {
  const int per_seq = (context + tokens) / 16 + 1;
  std::vector<std::vector<int32_t>> tables(batch);
  for (int s = 0; s < batch; ++s)
    for (int b = 0; b < per_seq; ++b) tables[s].push_back(s * per_seq + b);
  std::vector<int32_t> ids(context + tokens, 5);
  auto step = [&](bool fill) {
    engine::ForwardBatch fb;
    for (int s = 0; s < batch; ++s) {
      engine::SequenceStep st;
      st.tokens = fill ? std::span<const int32_t>(ids.data(), context)
                       : std::span<const int32_t>(ids.data(), tokens);
      st.num_tokens = fill ? context : tokens;
      st.start_position = fill ? 0 : context;
      st.block_table = tables[s];
      if (!fill)
        for (int i = 0; i < tokens; ++i) st.logit_indices.push_back(i);
      fb.sequences.push_back(st);
    }
    engine::ForwardResult result;
    auto start = Clock::now();
    auto s = engine.Forward(fb, pool, &result);
    if (!s.ok()) std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return Seconds(start);
  };
  step(true);
  double best = 1e30;
  for (int r = 0; r < reps; ++r) best = std::min(best, step(false));
  return best;
}

int VerifyCostCurve(const model::WeightSource& weights, int threads) {
  engine::EngineOptions eo;
  eo.num_threads = threads;
  auto engine = engine::LlamaEngine::Create(weights, eo);
  if (!engine.ok()) {
    std::fprintf(stderr, "%s\n", engine.status().ToString().c_str());
    return 1;
  }
  constexpr int kContext = 96, kGamma = 4, kMaxBatch = 32;
  auto pool = kv::KvPool::Create(
      (*engine)->KvLayout(16), int64_t{kMaxBatch} * ((kContext + 8) / 16 + 1));
  if (!pool.ok()) return 1;
  std::printf(
      "\n### Verify cost (engine forward, context %d, logits at every query "
      "position)\n\n"
      "c(b) = (t(b, 1+γ) / t(b, 1) − 1) / γ: the marginal cost of one more "
      "verified token per request, in decode steps at that batch.\n\n"
      "| batch b | t(b,1) ms | t(b,2) ms | t(b,5) ms | c(b) at γ=1 | c(b) at "
      "γ=4 |\n|---:|---:|---:|---:|---:|---:|\n",
      kContext);
  for (int b : {1, 2, 4, 8, 16, 32}) {
    double t1 = 1e30, t2 = 1e30, t5 = 1e30;
    // Interleaved best-of: the three shapes see the same noise.
    for (int rep = 0; rep < 5; ++rep) {
      t1 = std::min(t1, ForwardSeconds(**engine, **pool, b, kContext, 1, 2));
      t2 = std::min(t2, ForwardSeconds(**engine, **pool, b, kContext, 2, 2));
      t5 = std::min(
          t5, ForwardSeconds(**engine, **pool, b, kContext, 1 + kGamma, 2));
    }
    std::printf("| %d | %.1f | %.1f | %.1f | %.3f | %.3f |\n", b, t1 * 1e3,
                t2 * 1e3, t5 * 1e3, t2 / t1 - 1, (t5 / t1 - 1) / kGamma);
  }
  return 0;
}

// Greedy n-gram speculation over the stories260K golden prompts, one request
// at a time (batch 1: where speculation is on).
int NgramAcceptance(const Options& opt) {
  auto weights = model::OpenModel(opt.stories + "/stories260K.gguf");
  if (!weights.ok()) {
    std::fprintf(stderr, "%s\n", weights.status().ToString().c_str());
    return 1;
  }
  struct Case {
    std::vector<int32_t> prompt, greedy;
  };
  std::vector<Case> cases;
  for (const char* file : {"golden.jsonl", "golden_long.jsonl"}) {
    std::ifstream in(opt.stories + "/" + file);
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_discarded()) return 1;
      cases.push_back({j["prompt_ids"].get<std::vector<int32_t>>(),
                       j["greedy_ids"].get<std::vector<int32_t>>()});
    }
  }
  std::printf(
      "\n### n-gram speculation, stories260K golden prompts (%zu, greedy)\n\n"
      "| γ max | verify steps | drafted | accepted | acceptance rate | mean "
      "acceptance length (tokens per verify) | outputs == golden |\n"
      "|---:|---:|---:|---:|---:|---:|---|\n",
      cases.size());
  for (int gamma : {2, 4}) {
    decode::DecodeWorkerOptions o;
    o.threads_per_rank = 1;
    o.num_blocks = 256;
    o.speculation.mode = decode::SpeculationMode::kNgram;
    o.speculation.max_gamma = gamma;
    auto runner = MakeRunner(**weights, o);
    if (!runner.ok()) return 1;
    bool golden = true;
    for (const Case& c : cases) {
      decode::RequestParams p;
      p.max_new_tokens = static_cast<int>(c.greedy.size());
      auto run = (*runner)->Run({c.prompt}, p);
      if (!run.ok()) {
        std::fprintf(stderr, "%s\n", run.status().ToString().c_str());
        return 1;
      }
      golden = golden && run->outputs[0] == c.greedy;
    }
    const auto load = (*runner)->worker().Load();
    std::printf("| %d | %lld | %lld | %lld | %.2f | **%.2f** | %s |\n", gamma,
                static_cast<long long>(load.spec_steps),
                static_cast<long long>(load.drafted_tokens),
                static_cast<long long>(load.accepted_tokens),
                load.drafted_tokens
                    ? double(load.accepted_tokens) / load.drafted_tokens
                    : 0.0,
                load.mean_acceptance_length(), golden ? "yes" : "NO");
  }
  return 0;
}

int Run(const Options& opt) {
  const int threads =
      opt.threads > 0 ? opt.threads
                      : static_cast<int>(std::thread::hardware_concurrency());
  auto weights = model::OpenModel(opt.config, model::LoadFormat::kDummy);
  if (!weights.ok()) {
    std::fprintf(stderr, "%s\n", weights.status().ToString().c_str());
    return 1;
  }
  const int vocab = (*weights)->config().vocab_size;
  std::printf("model %s (dummy), %d threads, context %d, %d new tokens\n",
              opt.config.c_str(), threads, opt.context, opt.new_tokens);
  decode::RequestParams params;
  params.max_new_tokens = opt.new_tokens;
  params.ignore_eos = true;

  // ---- Throughput by batch and T (speculation off) ------------------------
  std::vector<std::unique_ptr<Runner>> off;  // by tp index
  for (int tp : opt.tp) {
    auto r = MakeRunner(**weights, WorkerOptions(opt, tp, threads));
    if (!r.ok()) {
      std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
      return 1;
    }
    off.push_back(std::move(*r));
  }
  std::printf(
      "\n### Throughput, speculation off (decode tokens/s, median of %d)\n\n"
      "| batch |",
      opt.reps);
  for (int tp : opt.tp) std::printf(" T=%d |", tp);
  std::printf(" T=%d / T=%d |\n|---:|", opt.tp.back(), opt.tp.front());
  for (size_t i = 0; i <= opt.tp.size(); ++i) std::printf("---:|");
  std::printf("\n");
  std::vector<std::vector<int32_t>> batch1_output;
  for (int batch : opt.batches) {
    auto prompts = Prompts(batch, opt.context, vocab);
    std::vector<std::vector<double>> tps(opt.tp.size());
    for (int rep = 0; rep < opt.reps; ++rep) {
      for (size_t t = 0; t < opt.tp.size(); ++t) {
        auto run = off[t]->Run(prompts, params);
        if (!run.ok()) {
          std::fprintf(stderr, "%s\n", run.status().ToString().c_str());
          return 1;
        }
        tps[t].push_back(run->decode_tps);
        if (batch == 1 && t == 0) batch1_output = run->outputs;
      }
    }
    std::printf("| %d |", batch);
    for (auto& v : tps) std::printf(" %.1f |", Median(v));
    std::printf(" %.2f |\n", Median(tps.back()) / Median(tps.front()));
  }

  // ---- Logprobs: the same worker with and without them --------------------
  // A request asking for logprobs makes its step download logits rows (not
  // only argmaxes) and costs a log-softmax (+ a top-N heap) per token on the
  // scheduler thread.
  {
    decode::RequestParams with = params;
    with.logprobs = true;
    decode::RequestParams with_top = with;
    with_top.top_logprobs = 20;
    std::printf(
        "\n### Logprobs cost, T=%d (decode tokens/s, median of %d; ratios "
        "median of per-rep ratios)\n\n"
        "| batch | off | logprobs | logprobs + 20 alternatives | logprobs / "
        "off | + 20 alternatives / off | outputs equal |\n"
        "|---:|---:|---:|---:|---:|---:|---|\n",
        opt.tp.front(), opt.reps);
    for (int batch : opt.batches) {
      auto prompts = Prompts(batch, opt.context, vocab);
      std::vector<double> a, b, c, rb, rc;
      bool same = true;
      for (int rep = 0; rep < opt.reps; ++rep) {
        auto x = off[0]->Run(prompts, params);
        auto y = off[0]->Run(prompts, with);
        auto z = off[0]->Run(prompts, with_top);
        if (!x.ok() || !y.ok() || !z.ok()) return 1;
        a.push_back(x->decode_tps);
        b.push_back(y->decode_tps);
        c.push_back(z->decode_tps);
        rb.push_back(y->decode_tps / x->decode_tps);
        rc.push_back(z->decode_tps / x->decode_tps);
        same = same && x->outputs == y->outputs && x->outputs == z->outputs;
      }
      std::printf("| %d | %.1f | %.1f | %.1f | %.3f | %.3f | %s |\n", batch,
                  Median(a), Median(b), Median(c), Median(rb), Median(rc),
                  same ? "yes" : "NO");
    }
  }

  // ---- Speculation at batch 1: always-right proposer vs off ---------------
  // The scripted proposer gets the target's own greedy continuation (what the
  // off run just produced), so every draft is accepted.
  {
    auto prompts = Prompts(1, opt.context, vocab);
    if (batch1_output.empty()) {
      auto run = off[0]->Run(prompts, params);
      if (!run.ok()) return 1;
      batch1_output = run->outputs;
    }
    decode::DecodeWorkerOptions so =
        WorkerOptions(opt, opt.tp.front(), threads);
    so.speculation.mode = decode::SpeculationMode::kScripted;
    so.speculation.max_gamma = 4;
    std::vector<int32_t> script = prompts[0];
    script.insert(script.end(), batch1_output[0].begin(),
                  batch1_output[0].end());
    so.speculation.scripted = {script};
    auto spec = MakeRunner(**weights, so);
    if (!spec.ok()) {
      std::fprintf(stderr, "%s\n", spec.status().ToString().c_str());
      return 1;
    }
    std::vector<double> off_tps, spec_tps, ratios;
    bool same = true;
    for (int rep = 0; rep < opt.reps; ++rep) {
      auto a = off[0]->Run(prompts, params);
      auto b = (*spec)->Run(prompts, params);
      if (!a.ok() || !b.ok()) return 1;
      off_tps.push_back(a->decode_tps);
      spec_tps.push_back(b->decode_tps);
      ratios.push_back(b->decode_tps / a->decode_tps);
      same = same && b->outputs == batch1_output;
    }
    const auto load = (*spec)->worker().Load();
    std::printf(
        "\n### Speculation at batch 1, T=%d, γ=4, always-right proposer\n\n"
        "| speculation off | always-right γ=4 | speed-up (median of per-rep "
        "ratios) | target | tokens per verify | output == off |\n"
        "|---:|---:|---:|---|---:|---|\n"
        "| %.1f tokens/s | %.1f tokens/s | **%.2fx** | >= 2.5x | %.2f | %s |\n",
        opt.tp.front(), Median(off_tps), Median(spec_tps), Median(ratios),
        load.mean_acceptance_length(), same ? "yes" : "NO");
  }

  // ---- Large batch: speculation on (n-gram, default max_batch) vs off -----
  {
    decode::DecodeWorkerOptions no =
        WorkerOptions(opt, opt.tp.front(), threads);
    no.speculation.mode = decode::SpeculationMode::kNgram;
    auto ngram = MakeRunner(**weights, no);
    if (!ngram.ok()) return 1;
    std::printf(
        "\n### Speculation on (n-gram, max_batch %d) vs off, T=%d\n\n"
        "| batch | off tokens/s | n-gram tokens/s | n-gram / off (median of "
        "per-rep ratios) |\n|---:|---:|---:|---:|\n",
        no.speculation.max_batch, opt.tp.front());
    for (int batch : opt.batches) {
      auto prompts = Prompts(batch, opt.context, vocab);
      std::vector<double> a_tps, b_tps, ratios;
      for (int rep = 0; rep < opt.reps; ++rep) {
        auto a = off[0]->Run(prompts, params);
        auto b = (*ngram)->Run(prompts, params);
        if (!a.ok() || !b.ok()) return 1;
        a_tps.push_back(a->decode_tps);
        b_tps.push_back(b->decode_tps);
        ratios.push_back(b->decode_tps / a->decode_tps);
      }
      std::printf("| %d | %.1f | %.1f | %.2f |\n", batch, Median(a_tps),
                  Median(b_tps), Median(ratios));
    }
  }
  off.clear();

  if (int rc = VerifyCostCurve(**weights, threads); rc != 0) return rc;
  return NgramAcceptance(opt);
}

bool ParseList(const std::string& value, std::vector<int>* out) {
  out->clear();
  for (auto part : absl::StrSplit(value, ',')) {
    int v;
    if (!absl::SimpleAtoi(part, &v)) return false;
    out->push_back(v);
  }
  return !out->empty();
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
    } else if (flag == "--context") {
      ok = absl::SimpleAtoi(value, &opt.context);
    } else if (flag == "--new-tokens") {
      ok = absl::SimpleAtoi(value, &opt.new_tokens);
    } else if (flag == "--reps") {
      ok = absl::SimpleAtoi(value, &opt.reps) && opt.reps > 0;
    } else if (flag == "--batches") {
      ok = pdserve::ParseList(value, &opt.batches);
    } else if (flag == "--tp") {
      ok = pdserve::ParseList(value, &opt.tp);
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
