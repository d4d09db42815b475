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
#include "planner/simulator.h"
#include "planner/workload.h"
#include "router/cluster_backend.h"
#include "router/worker_registry.h"
#include "tools/load_generator.h"
#include "tools/local_cluster.h"

namespace pdserve::bench {
namespace {

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
  planner::WorkloadSpec single;
  single.requests = requests;
  single.rate = 1.0;
  single.prompt = {16, 16};
  single.output = {1, 1};
  single.seed = 7;
  const std::vector<planner::Arrival> specs =
      planner::MakeArrivals(single, vocab);
  std::vector<double> via_router, direct, via_router_e2e, direct_e2e;
  for (int i = 0; i < requests; ++i) {
    // Alternate which path goes first so drift hits both alike.
    for (int leg = 0; leg < 2; ++leg) {
      const bool router_leg = (leg == 0) == (i % 2 == 0);
      if (router_leg) {
        tools::RequestResult r =
            tools::RunRequest(*stub, specs[i].prompt, specs[i].max_tokens);
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
  using planner::Percentile;
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
  auto short_prompt = planner::ParseLengthRange(short_text);
  auto long_prompt = planner::ParseLengthRange(long_text);
  auto output = planner::ParseLengthRange(output_text);
  for (const absl::Status& s : {flags.Check(), short_prompt.status(),
                                long_prompt.status(), output.status()}) {
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return 2;
    }
  }
  auto format = model::ParseLoadFormat(base.format);
  if (!format.ok()) {
    std::fprintf(stderr, "%s\n", format.status().ToString().c_str());
    return 2;
  }
  auto model = model::OpenModel(base.model_path, *format);
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
    return 1;
  }
  const int vocab = (*model)->config().vocab_size;
  const int context = (*model)->config().max_position_embeddings;
  if (long_prompt->hi + output->hi > context) {
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
      requests, rate, output->lo, output->hi, slo_ttft * 1e3, slo_tpot * 1e3);
  tools::PrintLoadHeader();
  for (const auto& [label, prompt] :
       {std::pair<const char*, planner::LengthRange>{"short", *short_prompt},
        std::pair<const char*, planner::LengthRange>{"long", *long_prompt}}) {
    const std::vector<planner::Arrival> specs =
        planner::MakeArrivals({requests, rate, prompt, *output, seed}, vocab);
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
      tools::PrintLoad(tools::RunLoad(absl::StrCat(label, " prompts, ", layout),
                                      (*cluster)->grpc_address(), specs,
                                      slo_ttft, slo_tpot));
    }
  }
  return 0;
}

}  // namespace
}  // namespace pdserve::bench

int main(int argc, char** argv) { return pdserve::bench::Main(argc, argv); }
