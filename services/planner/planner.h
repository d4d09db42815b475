// The layout planner: for a workload, an SLO and the cores at hand, predicts
// every candidate layout (layout.h) by simulation (simulator.h) on the
// fitted performance model (perf_model.h) and ranks them — most goodput
// first (the median over simulation replications); among layouts within 2%
// of the best goodput, first those whose worst replication is within 2% of
// the best worst one (the layouts a slow stretch of steps hurts least), then
// those on the fewest nodes, then the one with the most SLO headroom (the
// smaller of TTFT-p99 and TPOT-p99 slack, relative).
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/layout.h"
#include "planner/perf_model.h"
#include "planner/simulator.h"
#include "planner/workload.h"

namespace pdserve::planner {

struct PlanRequest {
  WorkloadSpec workload;
  Slo slo;
  Resources resources;
  // Probability an n-gram draft is accepted; > 0 adds γ = 1..4 candidates.
  double ngram_acceptance = 0;
  // Layouts to predict besides the enumerated ones (e.g. today's default).
  std::vector<Layout> extra;
  // Simulation runs per layout (SimOptions::replications); ≥ 1.
  int replications = 15;
  // Draw each request's TTFT offset from the profile's measured scatter
  // (SimOptions::ttft_scatter, which says why it is off by default).
  bool ttft_scatter = false;
};

struct RankedLayout {
  Layout layout;
  Prediction prediction;
  // min over TTFT and TPOT of (SLO − p99) / SLO: > 0 meets both at p99.
  double headroom = 0;
  // Nodes its placement (PlaceLayout) puts compute threads on.
  int nodes_used = 1;
  // Layouts predicted identically to this one, figure for figure (the
  // simulation is deterministic per seed, so the same events gave the same
  // numbers): knobs the workload never reaches, like chunk sizes above
  // every prompt. Folded into this row, which ranked first among them.
  std::vector<Layout> same_prediction;
};

// Ranked best first, layouts with identical predictions folded into one
// row (RankedLayout::same_prediction). INVALID_ARGUMENT for an empty workload;
// NOT_FOUND when no candidate can be simulated with the profiled
// configurations.
absl::StatusOr<std::vector<RankedLayout>> Plan(const PerfModel& model,
                                               const PlanRequest& request);

// The workload's requests as the simulator takes them (same arrivals as
// load_bench for the same spec).
std::vector<SimRequest> SimRequests(const WorkloadSpec& spec);
// The same for arrivals already made (MakeArrivals): their times and lengths.
std::vector<SimRequest> SimRequests(const std::vector<Arrival>& arrivals);

// A table of the ranked layouts (the first `rows`).
std::string FormatPlan(const std::vector<RankedLayout>& ranked, int rows);

}  // namespace pdserve::planner
