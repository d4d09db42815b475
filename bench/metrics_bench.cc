// Metrics overhead (services/metrics, decode_worker/worker_metrics): decode
// tokens/s of a DecodeWorker with metrics off vs on (step observer feeding
// the histograms + a scraper rendering /metrics every 100 ms, 10x faster
// than a real Prometheus), measured side by side in one run, interleaved
// repetition by repetition; plus the cost of one step observation and of one
// scrape. stories260K (real weights, sub-millisecond steps: where a fixed
// per-step cost shows most).
//
//   build/bench/metrics_bench [--reps 5] [--new-tokens 200] [--batches 1,8]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "decode/decode_worker.h"
#include "decode_worker/worker_metrics.h"
#include "metrics/metrics.h"
#include "model/weight_source.h"

namespace pdserve {
namespace {

using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Decode tokens/s of one batch submitted at once: tokens after the last
// request's first token, up to the last final delta.
double RunBatch(decode::DecodeWorker& worker, uint64_t* next_id, int batch,
                int new_tokens, int vocab) {
  absl::Mutex mu;
  int finished = 0;
  int64_t tokens_after = 0;
  int firsts = 0;
  Clock::time_point decode_start, end;
  decode::RequestParams params;
  params.max_new_tokens = new_tokens;
  params.ignore_eos = true;
  for (int b = 0; b < batch; ++b) {
    std::vector<int32_t> prompt;
    for (int i = 0; i < 32; ++i) prompt.push_back((i * 31 + b * 7 + 3) % vocab);
    auto seen_first = std::make_shared<bool>(false);
    auto cb = [&, seen_first](const decode::TokenDelta& d) {
      absl::MutexLock lock(&mu);
      const auto now = Clock::now();
      if (!*seen_first && !d.tokens.empty()) {
        *seen_first = true;
        if (++firsts == batch) decode_start = now;
      } else if (firsts == batch) {
        tokens_after += static_cast<int64_t>(d.tokens.size());
        end = now;
      }
      if (d.finished) ++finished;
    };
    if (!worker.Submit((*next_id)++, prompt, params, cb).ok()) return 0;
  }
  absl::MutexLock lock(&mu);
  auto done = [&] { return finished == batch; };
  mu.Await(absl::Condition(&done));
  const double s = std::chrono::duration<double>(end - decode_start).count();
  return s > 0 ? tokens_after / s : 0;
}

int Main(int argc, char** argv) {
  int reps = 5, new_tokens = 200;
  std::vector<int> batches = {1, 8};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--reps") (void)absl::SimpleAtoi(argv[i + 1], &reps);
    if (flag == "--new-tokens")
      (void)absl::SimpleAtoi(argv[i + 1], &new_tokens);
    if (flag == "--batches") {
      batches.clear();
      for (auto p : absl::StrSplit(argv[i + 1], ',')) {
        int b = 0;
        if (absl::SimpleAtoi(p, &b)) batches.push_back(b);
      }
    }
  }
  auto weights = model::OpenModel(std::string(PDSERVE_MODELS_DIR) +
                                  "/stories260K/stories260K.gguf");
  if (!weights.ok()) {
    std::fprintf(stderr, "%s\n", weights.status().ToString().c_str());
    return 1;
  }
  const int vocab = (*weights)->config().vocab_size;
  decode::DecodeWorkerOptions wo;
  wo.num_blocks = 512;
  wo.max_running = 64;

  // Off: no observer, no registry. On: observer + bound scrape hook + a
  // scraper thread.
  auto off = decode::DecodeWorker::Create(**weights, nullptr, wo);
  auto registry = std::make_shared<metrics::MetricsRegistry>(
      metrics::Layout{"decode", "bench", 0, 1, 1});
  decode_worker::DecodeWorkerMetrics m(*registry);
  decode::DecodeWorkerOptions wo_on = wo;
  wo_on.step_observer = m.StepObserver();
  auto on = decode::DecodeWorker::Create(**weights, nullptr, wo_on);
  if (!off.ok() || !on.ok()) return 1;
  m.Bind(on->get(), nullptr);
  std::atomic<bool> stop{false};
  std::atomic<int64_t> scrapes{0};
  std::thread scraper([&] {
    while (!stop) {
      (void)registry->RenderText();
      ++scrapes;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });

  std::printf(
      "stories260K, TP 1, 1 thread, 32-token prompts, %d new tokens, median "
      "of %d interleaved reps\n\n"
      "| batch | metrics off (tok/s) | metrics on (tok/s) | on / off | "
      "per-rep on/off |\n|---:|---:|---:|---:|---|\n",
      new_tokens, reps);
  uint64_t id = 1;
  for (int batch : batches) {
    std::vector<double> a, b, ratio;
    for (int r = 0; r < reps; ++r) {
      a.push_back(RunBatch(**off, &id, batch, new_tokens, vocab));
      b.push_back(RunBatch(**on, &id, batch, new_tokens, vocab));
      ratio.push_back(b.back() / a.back());
    }
    std::string per;
    for (double x : ratio) per += absl::StrFormat("%.3f ", x);
    std::printf("| %d | %.0f | %.0f | %.3f | %s|\n", batch, Median(a),
                Median(b), Median(b) / Median(a), per.c_str());
  }
  stop = true;
  scraper.join();

  // Per-call costs.
  auto observer = m.StepObserver();
  decode::StepStats s;
  s.sequences = 8;
  s.tokens_fed = 8;
  s.output_tokens = 8;
  s.seconds = 0.001;
  constexpr int kCalls = 200000;
  auto t0 = Clock::now();
  for (int i = 0; i < kCalls; ++i) observer(s);
  const double ns_per_step =
      std::chrono::duration<double, std::nano>(Clock::now() - t0).count() /
      kCalls;
  constexpr int kScrapes = 200;
  t0 = Clock::now();
  size_t bytes = 0;
  for (int i = 0; i < kScrapes; ++i) bytes = registry->RenderText().size();
  const double us_per_scrape =
      std::chrono::duration<double, std::micro>(Clock::now() - t0).count() /
      kScrapes;
  std::printf(
      "\nstep observation (3 histograms + 1 counter): %.0f ns; one scrape "
      "(hook + render, %zu bytes): %.0f us; background scrapes during the "
      "runs: %lld\n",
      ns_per_step, bytes, us_per_scrape,
      static_cast<long long>(scrapes.load()));
  m.Unbind();
  return 0;
}

}  // namespace
}  // namespace pdserve

int main(int argc, char** argv) { return pdserve::Main(argc, argv); }
