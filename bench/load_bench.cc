// Open-loop load generator for a pdserve cluster, plus the two comparisons
// the router issue asks for, each measured side by side in one run:
//
//   1. Router added latency: the same single-token requests, alternately
//      through the router (gRPC Generate) and straight down the decode path
//      (the router's own ClusterBackend, in this process, against the same
//      workers). p50 of the difference = what the router hop costs.
//   2. Disaggregated vs colocated on the same cores: one prefill stage + one
//      decode worker (one compute thread each) against one decode worker that
//      prefills itself (two compute threads), under the same Poisson load, at
//      short and at long prompts.
//
// Load: Poisson arrivals at --rate requests/s, prompt and output lengths
// uniform in the given ranges (token-id prompts: BOS + random ids), greedy.
// Reported per run: TTFT, TPOT, ITL (gap between streamed items) p50/p99,
// output tokens/s, and goodput = requests/s that met both SLOs.
//
//   load_bench [flags]   (`load_bench --help` lists every flag, its default
//                         and meaning)
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/command_line_flags.h"
#include "model/weight_source.h"
#include "pdserve/v1/generate.grpc.pb.h"
#include "router/cluster_backend.h"
#include "router/worker_registry.h"
#include "tools/local_cluster.h"

namespace pdserve::bench {
namespace {

struct Range {
  int lo = 0;
  int hi = 0;
};

bool ParseRange(const std::string& text, Range* out) {
  std::vector<std::string> parts = absl::StrSplit(text, ':');
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &out->lo) ||
      !absl::SimpleAtoi(parts[1], &out->hi) || out->lo < 1 ||
      out->hi < out->lo) {
    return false;
  }
  return true;
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * v.size()));
  return v[i];
}

struct RequestSpec {
  std::vector<int32_t> prompt;
  int max_tokens = 0;
  absl::Duration arrival;  // offset from the run's start
};

struct RequestResult {
  bool ok = false;
  std::string error;
  double ttft = 0;  // seconds
  double tpot = 0;
  double e2e = 0;
  int tokens = 0;
  std::vector<double> itl;
  absl::Time end;
};

std::vector<RequestSpec> MakeWorkload(int count, double rate, Range prompt,
                                      Range output, int vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::exponential_distribution<double> gap(rate);
  std::uniform_int_distribution<int> prompt_len(prompt.lo, prompt.hi);
  std::uniform_int_distribution<int> output_len(output.lo, output.hi);
  // Ids 3.. skip the special tokens (unk, bos, eos).
  std::uniform_int_distribution<int32_t> token(3, vocab - 1);
  std::vector<RequestSpec> specs(count);
  double t = 0;
  for (RequestSpec& s : specs) {
    t += gap(rng);
    s.arrival = absl::Seconds(t);
    s.prompt.push_back(1);  // BOS
    const int n = prompt_len(rng);
    for (int i = 1; i < n; ++i) s.prompt.push_back(token(rng));
    s.max_tokens = output_len(rng);
  }
  return specs;
}

RequestResult RunOne(v1::Generation::Stub& stub, const RequestSpec& spec) {
  v1::GenerateRequest request;
  request.mutable_token_ids()->mutable_ids()->Add(spec.prompt.begin(),
                                                  spec.prompt.end());
  request.set_max_tokens(spec.max_tokens);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(300)));
  RequestResult r;
  const absl::Time start = absl::Now();
  absl::Time first = absl::InfinitePast();
  absl::Time last = start;
  auto reader = stub.Generate(&context, request);
  v1::GenerateResponse item;
  while (reader->Read(&item)) {
    if (item.token_ids_size() == 0) continue;
    const absl::Time now = absl::Now();
    if (r.tokens == 0) {
      first = now;
    } else {
      r.itl.push_back(absl::ToDoubleSeconds(now - last));
    }
    last = now;
    r.tokens += item.token_ids_size();
  }
  grpc::Status status = reader->Finish();
  r.end = absl::Now();
  r.ok = status.ok() && r.tokens > 0;
  if (!r.ok) r.error = status.error_message();
  r.ttft = absl::ToDoubleSeconds(first - start);
  r.e2e = absl::ToDoubleSeconds(r.end - start);
  if (r.tokens > 1) {
    r.tpot = absl::ToDoubleSeconds(last - first) / (r.tokens - 1);
  }
  return r;
}

struct LoadReport {
  std::string name;
  int ok = 0;
  int failed = 0;
  double ttft_p50 = 0, ttft_p99 = 0, tpot_p50 = 0, tpot_p99 = 0, itl_p50 = 0,
         itl_p99 = 0, tokens_per_s = 0, goodput = 0, duration = 0;
};

LoadReport RunLoad(const std::string& name, const std::string& router,
                   const std::vector<RequestSpec>& specs, double slo_ttft,
                   double slo_tpot) {
  auto channel =
      grpc::CreateChannel(router, grpc::InsecureChannelCredentials());
  auto stub = v1::Generation::NewStub(channel);
  std::vector<RequestResult> results(specs.size());
  std::vector<std::thread> threads;
  threads.reserve(specs.size());
  const absl::Time start = absl::Now();
  for (size_t i = 0; i < specs.size(); ++i) {
    // Open loop: arrivals follow the schedule whatever the latencies.
    const absl::Time due = start + specs[i].arrival;
    if (absl::Now() < due) absl::SleepFor(due - absl::Now());
    threads.emplace_back([&, i] { results[i] = RunOne(*stub, specs[i]); });
  }
  for (auto& t : threads) t.join();
  LoadReport report;
  report.name = name;
  std::vector<double> ttft, tpot, itl;
  int64_t tokens = 0;
  int good = 0;
  absl::Time end = start;
  for (const RequestResult& r : results) {
    if (!r.ok) {
      ++report.failed;
      if (report.failed == 1) {
        std::fprintf(stderr, "%s: request failed: %s\n", name.c_str(),
                     r.error.c_str());
      }
      continue;
    }
    ++report.ok;
    ttft.push_back(r.ttft);
    if (r.tokens > 1) tpot.push_back(r.tpot);
    itl.insert(itl.end(), r.itl.begin(), r.itl.end());
    tokens += r.tokens;
    end = std::max(end, r.end);
    if (r.ttft <= slo_ttft && (r.tokens <= 1 || r.tpot <= slo_tpot)) ++good;
  }
  report.duration = absl::ToDoubleSeconds(end - start);
  report.ttft_p50 = Percentile(ttft, 0.5);
  report.ttft_p99 = Percentile(ttft, 0.99);
  report.tpot_p50 = Percentile(tpot, 0.5);
  report.tpot_p99 = Percentile(tpot, 0.99);
  report.itl_p50 = Percentile(itl, 0.5);
  report.itl_p99 = Percentile(itl, 0.99);
  report.tokens_per_s = report.duration > 0 ? tokens / report.duration : 0;
  report.goodput = report.duration > 0 ? good / report.duration : 0;
  return report;
}

void PrintLoadHeader() {
  std::printf("%-34s %5s %5s %9s %9s %9s %9s %8s %8s %9s %9s\n", "run", "ok",
              "fail", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50",
              "ITL p99", "tok/s", "goodput");
}

void PrintLoad(const LoadReport& r) {
  std::printf(
      "%-34s %5d %5d %7.1fms %7.1fms %7.2fms %7.2fms %6.2fms %6.2fms %9.0f "
      "%7.2f/s\n",
      r.name.c_str(), r.ok, r.failed, r.ttft_p50 * 1e3, r.ttft_p99 * 1e3,
      r.tpot_p50 * 1e3, r.tpot_p99 * 1e3, r.itl_p50 * 1e3, r.itl_p99 * 1e3,
      r.tokens_per_s, r.goodput);
  std::fflush(stdout);
}

// ---- Router added latency ---------------------------------------------------

// Observer that records the first token's time and waits for the end.
class TimingObserver : public router::GenerationObserver {
 public:
  void OnDelta(router::GenerationDelta delta) override {
    absl::MutexLock lock(&mu_);
    if (first_ == absl::InfinitePast() && !delta.token_ids.empty()) {
      first_ = absl::Now();
    }
  }
  void OnDone(absl::Status status) override {
    absl::MutexLock lock(&mu_);
    status_ = std::move(status);
    end_ = absl::Now();
    done_.Notify();
  }
  void Wait() { done_.WaitForNotification(); }
  absl::Time first() {
    absl::MutexLock lock(&mu_);
    return first_;
  }
  absl::Time end() {
    absl::MutexLock lock(&mu_);
    return end_;
  }
  absl::Status status() {
    absl::MutexLock lock(&mu_);
    return status_;
  }

 private:
  absl::Mutex mu_;
  absl::Time first_ = absl::InfinitePast();
  absl::Time end_;
  absl::Status status_;
  absl::Notification done_;
};

int RouterOverhead(const tools::LocalClusterOptions& base, int requests,
                   int vocab, int context) {
  tools::LocalClusterOptions o = base;
  auto cluster = tools::LocalCluster::Start(o);
  if (!cluster.ok()) {
    std::fprintf(stderr, "cluster: %s\n", cluster.status().ToString().c_str());
    return 1;
  }
  router::RegistryConfig config;
  config.prefill = (*cluster)->prefill_addresses();
  config.decode = (*cluster)->decode_addresses();
  router::WorkerRegistry registry(
      config, router::MakeSystemResolver(),
      router::MakeGrpcWorkerProber((*cluster)->internal_token()));
  registry.Refresh();
  router::ClusterBackendOptions bo;
  bo.model = {(*cluster)->model_name(), context, vocab};
  bo.internal_token = (*cluster)->internal_token();
  auto backend = router::ClusterBackend::Create(
      bo, nullptr, &registry, *router::MakeAssignmentPolicy("round-robin"),
      *router::MakeAssignmentPolicy("round-robin"));
  if (!backend.ok()) {
    std::fprintf(stderr, "backend: %s\n", backend.status().ToString().c_str());
    return 1;
  }
  auto stub = v1::Generation::NewStub(grpc::CreateChannel(
      (*cluster)->grpc_address(), grpc::InsecureChannelCredentials()));
  const std::vector<RequestSpec> specs =
      MakeWorkload(requests, 1.0, {16, 16}, {1, 1}, vocab, 7);
  std::vector<double> via_router, direct, via_router_e2e, direct_e2e;
  for (int i = 0; i < requests; ++i) {
    // Alternate which path goes first so drift hits both alike.
    for (int leg = 0; leg < 2; ++leg) {
      const bool router_leg = (leg == 0) == (i % 2 == 0);
      if (router_leg) {
        RequestResult r = RunOne(*stub, specs[i]);
        if (!r.ok) {
          std::fprintf(stderr, "router request: %s\n", r.error.c_str());
          return 1;
        }
        if (i >= 5) {  // warm-up
          via_router.push_back(r.ttft);
          via_router_e2e.push_back(r.e2e);
        }
      } else {
        router::GenerationRequest request;
        request.model = (*cluster)->model_name();
        request.prompt_ids = specs[i].prompt;
        request.max_tokens = specs[i].max_tokens;
        TimingObserver observer;
        const absl::Time start = absl::Now();
        auto call = (*backend)->Start(request, &observer);
        if (!call.ok()) {
          std::fprintf(stderr, "direct: %s\n",
                       call.status().ToString().c_str());
          return 1;
        }
        observer.Wait();
        if (!observer.status().ok()) {
          std::fprintf(stderr, "direct: %s\n",
                       observer.status().ToString().c_str());
          return 1;
        }
        if (i >= 5) {
          direct.push_back(absl::ToDoubleSeconds(observer.first() - start));
          direct_e2e.push_back(absl::ToDoubleSeconds(observer.end() - start));
        }
      }
    }
  }
  const double r50 = Percentile(via_router, 0.5);
  const double d50 = Percentile(direct, 0.5);
  std::printf(
      "router added latency (%zu pairs, 16-token prompt, 1 output token):\n"
      "  TTFT p50 via router %.3f ms, direct %.3f ms -> added %.3f ms "
      "(target <= 1 ms)\n"
      "  TTFT p99 via router %.3f ms, direct %.3f ms\n"
      "  end-to-end p50 via router %.3f ms, direct %.3f ms -> added %.3f ms\n",
      via_router.size(), r50 * 1e3, d50 * 1e3, (r50 - d50) * 1e3,
      Percentile(via_router, 0.99) * 1e3, Percentile(direct, 0.99) * 1e3,
      Percentile(via_router_e2e, 0.5) * 1e3, Percentile(direct_e2e, 0.5) * 1e3,
      (Percentile(via_router_e2e, 0.5) - Percentile(direct_e2e, 0.5)) * 1e3);
  std::fflush(stdout);
  return 0;
}

int Main(int argc, char** argv) {
  CommandLineFlags flags;
  if (auto s = flags.Parse(argc, argv); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 2;
  }
  tools::LocalClusterOptions base;
  flags.Group("Model");
  base.model_path =
      flags.Str("model", PDSERVE_MODELS_DIR "/stories260K",
                "Model every process of the benchmark clusters loads.");
  base.format =
      flags.Str("format", "auto", "Model format: auto|gguf|safetensors.");
  base.bin_dir = PDSERVE_BINARY_DIR;
  base.refresh_ms = 100;
  base.decode_blocks = 2048;
  base.prefill_blocks = 1024;
  base.max_running = 128;
  flags.Group("Load");
  const int requests = flags.Num<int>(
      "requests", 200, "Requests per open-loop run (short and long prompts).");
  const double rate = flags.Num<double>(
      "rate", 20, "Poisson arrival rate of the open-loop runs, requests/s.");
  const std::string short_text = flags.Str(
      "short-prompt", "16:64", "Short prompts' length range LO:HI, tokens.");
  const std::string long_text = flags.Str(
      "long-prompt", "256:400", "Long prompts' length range LO:HI, tokens.");
  const std::string output_text = flags.Str(
      "output", "16:64", "Output length range LO:HI, tokens (greedy).");
  const uint64_t seed =
      flags.Num<uint64_t>("seed", 1, "Seed of the arrivals and lengths.");
  const int overhead_requests = flags.Num<int>(
      "overhead-requests", 200,
      "Single-token requests of the router added-latency comparison.");
  const std::string only = flags.Str(
      "only", "", "Run one part only: overhead|load.", "(none: both)");
  flags.Group("SLO");
  const double slo_ttft =
      flags.Num<double>("slo-ttft-ms", 200,
                        "Time-to-first-token SLO for goodput, ms.") /
      1e3;
  const double slo_tpot =
      flags.Num<double>("slo-tpot-ms", 20,
                        "Time-per-output-token SLO for goodput, ms.") /
      1e3;
  if (flags.help_requested()) {
    std::fputs(
        flags
            .Usage(
                "load_bench [flags]\n"
                "Open-loop load on local clusters: router added latency, and "
                "disaggregated vs colocated on the same cores at short and "
                "long prompts (bench/load_bench.cc).\n")
            .c_str(),
        stdout);
    return 0;
  }
  Range short_prompt, long_prompt, output;
  const bool ranges_ok = ParseRange(short_text, &short_prompt) &&
                         ParseRange(long_text, &long_prompt) &&
                         ParseRange(output_text, &output);
  if (auto s = flags.Check(); !s.ok() || !ranges_ok) {
    std::fprintf(stderr, "%s\n",
                 s.ok() ? "ranges are LO:HI" : s.ToString().c_str());
    return 2;
  }
  auto model =
      model::OpenModel(base.model_path, *model::ParseLoadFormat(base.format));
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
    return 1;
  }
  const int vocab = (*model)->config().vocab_size;
  const int context = (*model)->config().max_position_embeddings;
  if (long_prompt.hi + output.hi > context) {
    std::fprintf(stderr, "prompt + output exceed the context (%d)\n", context);
    return 2;
  }
  std::printf("load_bench: model %s, %u hardware threads\n",
              base.model_path.c_str(), std::thread::hardware_concurrency());

  if (only.empty() || only == "overhead") {
    if (int rc = RouterOverhead(base, overhead_requests, vocab, context)) {
      return rc;
    }
  }
  if (!only.empty() && only != "load") return 0;

  std::printf(
      "\nopen loop: %d requests at %.1f req/s (Poisson), output %d..%d tokens, "
      "SLO TTFT <= %.0f ms and TPOT <= %.0f ms\n",
      requests, rate, output.lo, output.hi, slo_ttft * 1e3, slo_tpot * 1e3);
  PrintLoadHeader();
  for (const auto& [label, prompt] :
       {std::pair<const char*, Range>{"short", short_prompt},
        std::pair<const char*, Range>{"long", long_prompt}}) {
    const std::vector<RequestSpec> specs =
        MakeWorkload(requests, rate, prompt, output, vocab, seed);
    // Same cores: 2 compute threads either way.
    tools::LocalClusterOptions disagg = base;
    disagg.stages = 1;
    disagg.prefill_threads = 1;
    disagg.decode_threads = 1;
    tools::LocalClusterOptions coloc = base;
    coloc.colocated = true;
    coloc.decode_threads = 2;
    for (const auto& [layout, options] :
         {std::pair<const char*, tools::LocalClusterOptions>{
              "disaggregated 1P(1t)+1D(1t)", disagg},
          std::pair<const char*, tools::LocalClusterOptions>{"colocated 1D(2t)",
                                                             coloc}}) {
      auto cluster = tools::LocalCluster::Start(options);
      if (!cluster.ok()) {
        std::fprintf(stderr, "cluster: %s\n",
                     cluster.status().ToString().c_str());
        return 1;
      }
      PrintLoad(RunLoad(absl::StrCat(label, " prompts, ", layout),
                        (*cluster)->grpc_address(), specs, slo_ttft, slo_tpot));
    }
  }
  return 0;
}

}  // namespace
}  // namespace pdserve::bench

int main(int argc, char** argv) { return pdserve::bench::Main(argc, argv); }
