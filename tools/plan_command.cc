// pdserve plan: which layout to run for a workload and an SLO on these
// cores. Profiles the machine (or loads a saved profile), predicts every
// candidate layout by simulation and prints them ranked, then the best
// one's `pdserve local` flags and Kubernetes values (services/planner).
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/command_line_flags.h"
#include "metrics/exposition.h"
#include "planner/planner.h"
#include "process/child_process.h"
#include "router/router_metrics.h"
#include "tools/commands.h"
#include "tools/planner_profile.h"

namespace pdserve::tools {
namespace {

// The router's served totals in one scrape of its /metrics.
absl::StatusOr<metrics::ServedTotals> ScrapeServed(const std::string& url) {
  auto samples = metrics::Scrape(url);
  if (!samples.ok()) {
    return absl::Status(
        samples.status().code(),
        absl::StrCat("--router-metrics: ", samples.status().message()));
  }
  metrics::ServedTotals totals;
  bool seen = false;
  for (const metrics::Sample& s : *samples) {
    // Successful requests: the router observes e2e once for each.
    if (s.name == "pdserve_router_e2e_seconds_count") {
      totals.requests += static_cast<int64_t>(s.value);
      seen = true;
    } else if (s.name == "pdserve_router_prompt_tokens_total") {
      totals.prompt_tokens += s.value;
    } else if (s.name == "pdserve_router_output_tokens_total") {
      totals.output_tokens += s.value;
    }
  }
  if (!seen) {
    return absl::InvalidArgumentError(absl::StrCat(
        url, " has no pdserve_router_e2e_seconds_count: not a pdserve router"));
  }
  return totals;
}

// Rate and mean lengths the router served over `window_s`.
absl::StatusOr<planner::WorkloadSpec> WorkloadFromRouter(const std::string& url,
                                                         double window_s,
                                                         int requests) {
  auto before = ScrapeServed(url);
  if (!before.ok()) return before.status();
  const absl::Time start = absl::Now();
  absl::SleepFor(absl::Seconds(window_s));
  auto after = ScrapeServed(url);
  if (!after.ok()) return after.status();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  const int64_t served = after->requests - before->requests;
  if (served <= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("the router finished no request in the ", window_s,
                     " s window: nothing to plan for (lengthen --window-s)"));
  }
  planner::WorkloadSpec spec = planner::WorkloadFromMeans(
      requests, served / seconds,
      (after->prompt_tokens - before->prompt_tokens) / served,
      (after->output_tokens - before->output_tokens) / served);
  std::fprintf(stderr,
               "router served %lld requests in %.1f s: %.2f req/s, prompt "
               "%d..%d, output %d..%d tokens (uniform around the means)\n",
               static_cast<long long>(served), seconds, spec.rate,
               spec.prompt.lo, spec.prompt.hi, spec.output.lo, spec.output.hi);
  return spec;
}

}  // namespace

absl::Status RunPlan(int argc, char** argv) {
  CommandLineFlags flags;
  if (auto s = flags.Parse(argc, argv, /*first=*/2); !s.ok()) return s;
  PlannerProfileOptions profile;
  flags.Group("Model and profile");
  profile.model_path = flags.Str("model", "../shared/models/stories260K",
                                 "Model to plan for (GGUF file, HF folder, or "
                                 "a config.json with --format dummy).");
  profile.format =
      flags.Str("format", "auto", "Model format: auto|gguf|safetensors|dummy.");
  const std::string perf_path = flags.Str(
      "perf-model", "",
      "Saved profile (JSON) to plan with; with --profile 1, where to save "
      "the new one.",
      "(none)");
  const bool run_profile = flags.Bool(
      "profile", true,
      "1: profile this machine now (in-process decode worker steps, then "
      "idle requests on real clusters); 0: use --perf-model.");
  profile.max_prompt = flags.Num<int>("profile-max-prompt", 512,
                                      "Largest prompt the profile measures.");
  profile.bin_dir =
      flags.Str("bin-dir", process::ExecutableDir(),
                "Where router, prefill_worker and decode_worker are.");
  flags.Group("Workload");
  planner::PlanRequest request;
  request.workload.requests = flags.Num<int>(
      "requests", 200, "Requests the simulation runs (more: steadier p99).");
  request.workload.rate =
      flags.Num<double>("rate", 1.5, "Poisson arrival rate, requests/s.");
  const std::string prompt_text =
      flags.Str("prompt", "16:64", "Prompt length range LO:HI, tokens.");
  const std::string output_text =
      flags.Str("output", "16:64", "Output length range LO:HI, tokens.");
  request.workload.seed =
      flags.Num<uint64_t>("seed", 1, "Seed of the simulated arrivals.");
  request.replications = flags.Num<int>(
      "replications", 15,
      "Simulation runs per layout with different step-time draws; figures "
      "are their medians (the goodput column shows the runs' range).");
  request.ttft_scatter = flags.Bool(
      "ttft-scatter", false,
      "1: draw each request's TTFT offset from the scatter the profile "
      "measured around it (off by default: from a dozen requests per "
      "calibration it predicted past runs worse, docs/PERFORMANCE.md run 28).");
  const std::string router_metrics = flags.Str(
      "router-metrics", "",
      "http://H:P/metrics of a running router: take the rate and mean "
      "prompt/output lengths from its counters over --window-s instead of "
      "--rate/--prompt/--output.",
      "(none)");
  const double window_s = flags.Num<double>(
      "window-s", 30, "With --router-metrics: seconds between the scrapes.");
  request.ngram_acceptance = flags.Num<double>(
      "acceptance", 0,
      "n-gram draft acceptance to plan speculation with (read it off "
      "pdserve_decode_spec_accepted_tokens_total / _proposed_tokens_total); "
      "0 plans without speculation.");
  flags.Group("SLO and resources");
  request.slo.ttft_seconds =
      flags.Num<double>("slo-ttft-ms", 2000,
                        "p99 time-to-first-token SLO, ms.") /
      1e3;
  request.slo.tpot_seconds =
      flags.Num<double>("slo-tpot-ms", 60,
                        "p99 time-per-output-token SLO, ms.") /
      1e3;
  request.resources.cores = flags.Num<int>(
      "cores", 2,
      "Cores per node the cluster may use (compute threads); the profile "
      "runs on this machine with as many.");
  request.resources.nodes = flags.Num<int>(
      "nodes", 1,
      "Nodes (each of --cores, like this machine) a layout may span; its "
      "pods are placed as Kubernetes' least-allocated scoring would.");
  const double network_gbps = flags.Num<double>(
      "network-gbps", 0,
      "With --nodes > 1: each node's link, Gbit/s each way, which a stage's "
      "KV writes and hidden states to another node cross (measure it with "
      "ucx_perftest between two nodes).",
      "(none)");
  request.resources.allow_oversubscription = flags.Bool(
      "oversubscribe", false,
      "1: also consider layouts with up to twice as many compute threads "
      "as cores, one thread per decode rank and prefill stage (the cores "
      "are shared by each step's measured CPU demand).");
  request.resources.router_shares_cores = flags.Bool(
      "router-on-cores", true,
      "1: the router (and clients) stream on the same cores as the workers "
      "(pdserve local, one machine); 0: they have their own (Kubernetes).");
  const int rows = flags.Num<int>("show", 10, "Ranked layouts to print.");
  if (flags.help_requested()) {
    std::fputs(
        flags
            .Usage("pdserve plan [flags]\n"
                   "Predicts TTFT/TPOT p50/p99 and goodput of every layout "
                   "that fits the cores, for a workload and an SLO, and "
                   "prints the best one's flags (services/planner/README.md)."
                   "\n")
            .c_str(),
        stdout);
    return absl::OkStatus();
  }
  auto prompt = planner::ParseLengthRange(prompt_text);
  if (!prompt.ok()) return prompt.status();
  auto output = planner::ParseLengthRange(output_text);
  if (!output.ok()) return output.status();
  if (auto s = flags.Check(); !s.ok()) return s;
  // Checked before the minutes of profiling.
  if (request.resources.nodes < 1 ||
      request.resources.nodes > planner::kMaxPlannedNodes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--nodes must be in 1..", planner::kMaxPlannedNodes, ", got ",
        request.resources.nodes,
        " (plan one copy of the layout on fewer nodes and run several)"));
  }
  if (request.resources.nodes > 1 && !(network_gbps > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--nodes ", request.resources.nodes,
        " > 1 needs --network-gbps > 0 (the nodes' link bandwidth; "
        "ucx_perftest between two nodes measures it)"));
  }
  if (request.resources.nodes == 1 && network_gbps != 0) {
    return absl::InvalidArgumentError(
        "--network-gbps is the link between nodes: it needs --nodes > 1");
  }
  request.resources.network_bytes_per_second = network_gbps * 1e9 / 8;
  if (request.resources.cores < 1 || request.workload.requests < 1 ||
      !(request.workload.rate > 0) || !(request.slo.ttft_seconds > 0) ||
      !(request.slo.tpot_seconds > 0) || request.ngram_acceptance < 0 ||
      !(window_s > 0) || request.ngram_acceptance >= 1 ||
      profile.max_prompt < 32 || request.replications < 1) {
    return absl::InvalidArgumentError(
        "--cores, --requests, --replications, --rate, --window-s and the SLOs "
        "must be positive, --acceptance in [0, 1), --profile-max-prompt ≥ 32");
  }
  request.workload.prompt = *prompt;
  request.workload.output = *output;
  if (!router_metrics.empty()) {
    auto observed =
        WorkloadFromRouter(router_metrics, window_s, request.workload.requests);
    if (!observed.ok()) return observed.status();
    request.workload = *observed;
  }
  profile.cores = request.resources.cores;
  profile.rate = request.workload.rate;

  planner::PerfModel model;
  if (run_profile) {
    profile.progress = [](const std::string& line) {
      std::fprintf(stderr, "%s\n", line.c_str());
    };
    auto m = ProfileForPlanner(profile);
    if (!m.ok()) return m.status();
    model = *std::move(m);
    if (!perf_path.empty()) {
      if (auto s = model.Save(perf_path); !s.ok()) return s;
      std::fprintf(stderr, "profile saved to %s\n", perf_path.c_str());
    }
  } else {
    if (perf_path.empty()) {
      return absl::InvalidArgumentError(
          "--profile 0 needs --perf-model FILE (a saved profile)");
    }
    auto m = planner::PerfModel::Load(perf_path);
    if (!m.ok()) return m.status();
    model = *std::move(m);
  }
  auto ranked = planner::Plan(model, request);
  if (!ranked.ok()) return ranked.status();
  std::printf(
      "workload: %.2f req/s, prompt %d..%d, output %d..%d tokens; SLO p99 "
      "TTFT ≤ %.0f ms, TPOT ≤ %.0f ms; %s; figures are medians of %d "
      "simulation run(s) per layout\n\n%s\n",
      request.workload.rate, request.workload.prompt.lo,
      request.workload.prompt.hi, request.workload.output.lo,
      request.workload.output.hi, request.slo.ttft_seconds * 1e3,
      request.slo.tpot_seconds * 1e3,
      request.resources.nodes > 1
          ? absl::StrFormat("%d nodes × %d cores, links %g Gbit/s",
                            request.resources.nodes, request.resources.cores,
                            network_gbps)
                .c_str()
          : absl::StrFormat("%d cores", request.resources.cores).c_str(),
      ranked->front().prediction.replications,
      planner::FormatPlan(*ranked, rows).c_str());
  const planner::Layout& best = ranked->front().layout;
  // The per-request disaggregation threshold for this layout's workers.
  if (!best.colocated) {
    const int crossover = model.LocalPrefillCrossover(
        {best.tp, best.decode_threads}, {1, best.prefill_threads},
        best.max_step_tokens);
    std::printf(
        "per-request disaggregation: %s (idle TTFT, this profile)\n  router "
        "--local-prefill-max-tokens=%d\n\n",
        crossover > 0
            ? absl::StrFormat("prompts of up to %d tokens reach their first "
                              "token sooner prefilled by their decode worker",
                              crossover)
                  .c_str()
            : "a prefill group is faster from the shortest prompt on",
        crossover);
  }
  if (request.resources.nodes > 1) {
    // `pdserve local` runs one machine; across nodes only the manifests
    // build the layout.
    std::printf("best: %s\n  placement: %s\n\nKubernetes:\n%s",
                best.Name().c_str(),
                planner::FormatPlacement(
                    best, planner::PlaceLayout(best, request.resources.nodes))
                    .c_str(),
                best.KubernetesValues().c_str());
    return absl::OkStatus();
  }
  std::printf("best: %s\n  pdserve local --model %s %s\n\nKubernetes:\n%s",
              best.Name().c_str(), profile.model_path.c_str(),
              best.LocalFlags().c_str(), best.KubernetesValues().c_str());
  return absl::OkStatus();
}

}  // namespace pdserve::tools
