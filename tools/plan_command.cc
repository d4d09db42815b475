// pdserve plan: which layout to run for a workload and an SLO on these
// cores. Profiles the machine (or loads a saved profile), predicts every
// candidate layout by simulation and prints them ranked, then the best
// one's `pdserve local` flags and Kubernetes values (services/planner).
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/command_line_flags.h"
#include "planner/planner.h"
#include "process/child_process.h"
#include "tools/commands.h"
#include "tools/planner_profile.h"

namespace pdserve::tools {

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
      "cores", 2, "Cores the cluster may use (compute threads in all).");
  request.resources.allow_oversubscription = flags.Bool(
      "oversubscribe", false,
      "1: also consider layouts with more compute threads than cores.");
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
  if (request.resources.cores < 1 || request.workload.requests < 1 ||
      !(request.workload.rate > 0) || !(request.slo.ttft_seconds > 0) ||
      !(request.slo.tpot_seconds > 0) || request.ngram_acceptance < 0 ||
      request.ngram_acceptance >= 1 || profile.max_prompt < 32) {
    return absl::InvalidArgumentError(
        "--cores, --requests, --rate and the SLOs must be positive, "
        "--acceptance in [0, 1), --profile-max-prompt ≥ 32");
  }
  request.workload.prompt = *prompt;
  request.workload.output = *output;
  profile.cores = request.resources.cores;

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
      "TTFT ≤ %.0f ms, TPOT ≤ %.0f ms; %d cores\n\n%s\n",
      request.workload.rate, prompt->lo, prompt->hi, output->lo, output->hi,
      request.slo.ttft_seconds * 1e3, request.slo.tpot_seconds * 1e3,
      request.resources.cores, planner::FormatPlan(*ranked, rows).c_str());
  const planner::Layout& best = ranked->front().layout;
  std::printf("best: %s\n  pdserve local --model %s %s\n\nKubernetes:\n%s",
              best.Name().c_str(), profile.model_path.c_str(),
              best.LocalFlags().c_str(), best.KubernetesValues().c_str());
  return absl::OkStatus();
}

}  // namespace pdserve::tools
