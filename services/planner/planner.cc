#include "planner/planner.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pdserve::planner {

std::vector<SimRequest> SimRequests(const WorkloadSpec& spec) {
  // Only the lengths matter here; the ids are drawn anyway so the random
  // sequence, hence the arrivals, equal load_bench's.
  std::vector<SimRequest> out;
  for (const Arrival& a : MakeArrivals(spec, /*vocab=*/32000)) {
    out.push_back({a.seconds, static_cast<int>(a.prompt.size()), a.max_tokens});
  }
  return out;
}

absl::StatusOr<std::vector<RankedLayout>> Plan(const PerfModel& model,
                                               const PlanRequest& request) {
  if (request.workload.requests < 1 || !(request.workload.rate > 0)) {
    return absl::InvalidArgumentError(
        "the workload needs ≥ 1 request and a positive rate");
  }
  std::vector<Layout> layouts =
      EnumerateLayouts(request.resources, model, request.ngram_acceptance);
  layouts.insert(layouts.end(), request.extra.begin(), request.extra.end());
  const std::vector<SimRequest> requests = SimRequests(request.workload);
  SimOptions options;
  options.cores = request.resources.cores;
  options.ngram_acceptance = request.ngram_acceptance;
  options.router_shares_cores = request.resources.router_shares_cores;
  options.seed = request.workload.seed;
  std::vector<RankedLayout> ranked;
  absl::Status last_error;
  for (const Layout& layout : layouts) {
    auto p = Simulate(model, layout, requests, request.slo, options);
    if (!p.ok()) {
      last_error = p.status();
      continue;
    }
    RankedLayout r{layout, *p, 0};
    r.headroom = std::min(
        (request.slo.ttft_seconds - p->ttft_p99) / request.slo.ttft_seconds,
        (request.slo.tpot_seconds - p->tpot_p99) / request.slo.tpot_seconds);
    ranked.push_back(r);
  }
  if (ranked.empty()) {
    return absl::NotFoundError(absl::StrCat(
        "no candidate layout could be simulated: ", last_error.message()));
  }
  double best = 0;
  for (const RankedLayout& r : ranked)
    best = std::max(best, r.prediction.goodput);
  std::stable_sort(
      ranked.begin(), ranked.end(),
      [best](const RankedLayout& a, const RankedLayout& b) {
        // Goodput within 2% of the best is a tie (simulation
        // noise is larger); ties go to headroom.
        const bool a_top = a.prediction.goodput >= 0.98 * best;
        const bool b_top = b.prediction.goodput >= 0.98 * best;
        if (a_top != b_top) return a_top;
        if (!a_top && a.prediction.goodput != b.prediction.goodput) {
          return a.prediction.goodput > b.prediction.goodput;
        }
        return a.headroom > b.headroom;
      });
  return ranked;
}

std::string FormatPlan(const std::vector<RankedLayout>& ranked, int rows) {
  std::string out =
      absl::StrFormat("%-4s %-44s %9s %9s %9s %9s %9s %9s %6s %6s\n", "rank",
                      "layout", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
                      "ITL p99", "goodput", "dec%", "pre%");
  for (int i = 0; i < static_cast<int>(ranked.size()) && i < rows; ++i) {
    const RankedLayout& r = ranked[i];
    const Prediction& p = r.prediction;
    absl::StrAppendFormat(
        &out,
        "%-4d %-44s %7.1fms %7.1fms %7.2fms %7.2fms %7.1fms %7.2f/s %5.0f%% "
        "%5.0f%%\n",
        i + 1, r.layout.Name(), p.ttft_p50 * 1e3, p.ttft_p99 * 1e3,
        p.tpot_p50 * 1e3, p.tpot_p99 * 1e3, p.itl_p99 * 1e3, p.goodput,
        p.decode_utilisation * 100, p.prefill_utilisation * 100);
  }
  return out;
}

}  // namespace pdserve::planner
