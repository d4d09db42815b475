// The elastic cluster's figures (issue 45, docs/PERFORMANCE.md "Elastic
// cluster"): each membership change of tools/elastic_scenarios.h run under
// closed-loop streaming load on a model slow enough that streams last
// seconds (llama-110m shapes, dummy weights: token ids, greedy), and one
// table row per scenario — requests during the change, how many were lost
// (failed, or any token different from the undisturbed answer), p99 TTFT
// and TPOT before vs during, the longest stall a client saw, the time a new
// worker took to serve, streams migrated, prompts prefilled by decode
// workers while no group served.
//
//   elastic_bench [--scenarios all|decode-scale,prefill-scale,rolling,
//                  drain,kill-decode,kill-stage,kill-router]
//                 [--clients 8] [--max-tokens 160] [--prompt-tokens 64]
#include <cstdio>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/command_line_flags.h"
#include "tools/elastic_scenarios.h"

namespace pdserve::bench {
namespace {

using tools::ScenarioOptions;
using tools::ScenarioResult;

int Main(int argc, char** argv) {
  CommandLineFlags flags;
  if (auto s = flags.Parse(argc, argv); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  const std::string model =
      flags.Str("model", PDSERVE_MODELS_DIR "/bench-configs/llama-110m.json",
                "Model (a config for --format dummy).");
  const std::string format = flags.Str("format", "dummy", "Model format.");
  const std::string which =
      flags.Str("scenarios", "all",
                "Comma-separated: decode-scale, prefill-scale, rolling, drain, "
                "kill-decode, kill-stage, kill-router (or all).");
  const int clients = flags.Num<int>("clients", 8, "Streaming clients.");
  const int max_tokens =
      flags.Num<int>("max-tokens", 160, "Tokens per answer (ignore_eos).");
  const int prompt_tokens =
      flags.Num<int>("prompt-tokens", 64, "Tokens per prompt.");
  const double drain_s = flags.Num<double>(
      "drain-timeout-seconds", 25,
      "Every process's --drain-timeout-seconds (the rolling restart uses "
      "it: 0 stops decode workers with streams on them).");
  if (flags.help_requested()) {
    std::fputs(flags.Usage("elastic_bench [flags]\n", "").c_str(), stdout);
    return 0;
  }
  if (auto s = flags.Check(); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  ScenarioOptions o;
  o.cluster.model_path = model;
  o.cluster.format = format;
  o.cluster.model_name = "bench";
  o.cluster.bin_dir = PDSERVE_BINARY_DIR;
  o.cluster.decode_blocks = 512;
  o.cluster.prefill_blocks = 256;
  o.cluster.refresh_ms = 250;
  o.cluster.decode_policy = "least-loaded";
  o.cluster.prefill_policy = "least-loaded";
  o.cluster.drain_timeout_s = drain_s;
  o.cluster.start_timeout = absl::Seconds(300);
  o.clients = clients;
  o.warmup_requests = 2 * clients;
  o.requests_per_step = clients;
  for (int r = 0; r < 4; ++r) {
    tools::ChurnRequest request;
    request.prompt_ids.push_back(1);
    for (int t = 1; t < prompt_tokens; ++t) {
      request.prompt_ids.push_back(100 + (r * 131 + t * 17) % 20000);
    }
    request.max_tokens = max_tokens;
    o.requests.push_back(request);
  }
  const std::vector<
      std::pair<std::string,
                std::function<absl::StatusOr<ScenarioResult>(ScenarioOptions)>>>
      all = {{"decode-scale", tools::ScaleDecodeWorkers},
             {"prefill-scale", tools::ScalePrefillGroups},
             {"rolling", tools::RollingRestart},
             {"drain", tools::DrainDecodeWorker},
             {"kill-decode", tools::KillDecodeWorker},
             {"kill-stage", tools::KillOnlyPrefillStage},
             {"kill-router", tools::KillRouter}};
  std::set<std::string> chosen;
  for (absl::string_view s : absl::StrSplit(which, ',')) {
    chosen.insert(std::string(s));
  }
  std::vector<ScenarioResult> results;
  for (const auto& [name, scenario] : all) {
    if (!chosen.contains("all") && !chosen.contains(name)) continue;
    absl::StatusOr<ScenarioResult> r = scenario(o);
    if (!r.ok()) {
      std::fprintf(stderr, "%s: %s\n", name.c_str(),
                   r.status().ToString().c_str());
      return 1;
    }
    std::printf("%s\n", tools::Describe(*r).c_str());
    std::fflush(stdout);
    results.push_back(*std::move(r));
  }
  std::printf(
      "\n| scenario | requests during | lost | TTFT p99 before → during | "
      "TPOT p99 before → during | longest stall | new worker serves after | "
      "migrated | prefilled on decode | KV back |\n|---|---|---|---|---|---|"
      "---|---|---|---|\n");
  for (const ScenarioResult& r : results) {
    std::string serves;
    for (double t : r.time_to_traffic) {
      serves += absl::StrFormat("%s%.2f s", serves.empty() ? "" : ", ", t);
    }
    std::string lost = absl::StrFormat("%d", r.lost);
    if (r.router_back_seconds > 0) {
      lost += absl::StrFormat(
          " (+%d broken with the router, %d refused "
          "in its %.1f s down)",
          r.broken_by_router, r.refused_while_router_down,
          r.router_back_seconds);
    }
    std::printf(
        "| %s | %d | %s | %.0f → %.0f ms | %.1f → %.1f ms | %.0f ms | %s | "
        "%.0f | %.0f | %s |\n",
        r.name.c_str(), r.during.requests, lost.c_str(),
        r.before.ttft_p99 * 1e3, r.during.ttft_p99 * 1e3,
        r.before.tpot_p99 * 1e3, r.during.tpot_p99 * 1e3,
        r.during.longest_gap * 1e3, serves.empty() ? "—" : serves.c_str(),
        r.migrations, r.prefilled_by_decode_for_want_of_a_group,
        r.kv_back_to_baseline ? "yes" : "no");
  }
  return 0;
}

}  // namespace
}  // namespace pdserve::bench

int main(int argc, char** argv) { return pdserve::bench::Main(argc, argv); }
