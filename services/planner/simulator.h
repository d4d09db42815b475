// Predicts what a layout does under a workload: a discrete-event simulation
// of the router's assignment, each prefill group's pipeline and each decode
// worker's continuous batching, with every step's duration from the fitted
// step costs (perf_model.h).
//
// Why a simulation and not an M/G/c formula: a decode worker's service time
// depends on what else is in its batch (a step costs L(tokens) whether it
// carries 1 or 16 decodes), prefill chunks share steps with decodes in a
// colocated worker (oldest first within max_step_tokens: a long prompt
// starves younger decodes for a step — the ITL spikes a formula cannot
// show), and microbatches flow through a pipeline with a bounded number in
// flight. Closed forms assume independent service times and give means; the
// SLO is on p99. So the simulator runs the scheduling rules themselves —
// prefill's chunking and microbatching through the real code
// (prefill/chunk_policy.h, prefill/microbatch_former.h), the decode step
// planner's rule (decode/step_planner.h: oldest first, a request feeds
// min(left, budget), stop when the budget is spent) re-stated here — on the
// exact arrivals load_bench sends (workload.h).
//
// Cores: every busy compute job (a decode step, a stage's microbatch) holds
// its threads on its node (PlaceLayout); when a node has more busy threads
// than `cores`, its jobs slow down alike (processor sharing), as the OS
// would share the cores — but a job of g threads that wait for each other
// at every layer runs at share^(1 + (g − 1) · e) while the compute jobs
// alone oversubscribe the node, e the measured exponent at that share
// (PerfModel::GangExponentAt): time-sliced apart, one rank's wait stalls the
// others. While two or more compute jobs run at once on a node of ≥ 2
// cores, each takes the co-running slow-down measured for its kind beside
// the other's longer (PerfModel::co_running: neighbouring cores share the
// memory bus and the last-level cache; a decode step beside a decode loses
// most) — a gang the larger of that and its gang slow-down, whose exponent
// was measured with both at once.
// The router streams from node 0.
//
// Nodes: a stage's KV writes to a decode worker on another node, and its
// hidden states to a next stage on another node, are transfers over the
// nodes' links (full duplex, shared equally among the transfers leaving
// and arriving at a node); the decode worker admits a request once its
// last KV write has arrived (then PerfModel::handoff_seconds). On one node
// those bytes move through memory, inside the hand-off's measured costs.
//
// Not modelled (measured into the fitted per-request costs instead): router,
// gRPC and UCX CPU time; KV capacity and preemption (the planner sizes KV
// from the model; a layout that would preempt is flagged, not simulated).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/layout.h"
#include "planner/perf_model.h"

namespace pdserve::planner {

struct SimRequest {
  double arrival = 0;  // seconds from the start
  int prompt_tokens = 1;
  int output_tokens = 1;
};

struct Slo {
  double ttft_seconds = 2;
  double tpot_seconds = 0.06;
};

// Statistics as load_bench computes them (same percentile rule).
struct Prediction {
  double ttft_mean = 0, ttft_p50 = 0, ttft_p99 = 0;
  double tpot_p50 = 0, tpot_p99 = 0;
  double itl_p50 = 0, itl_p99 = 0;
  double goodput = 0;         // requests/s meeting both SLOs
  double slo_attainment = 0;  // share of the requests meeting both SLOs
  double tokens_per_s = 0;    // output tokens / duration
  double duration = 0;        // start to the last request's end
  // Busy share of the decode workers' and prefill stages' time.
  double decode_utilisation = 0;
  double prefill_utilisation = 0;
  // The same as seconds summed over the decode workers and the prefill
  // stages (what their busy-seconds metrics count).
  double decode_busy_seconds = 0;
  double prefill_busy_seconds = 0;
  // Over SimOptions::replications runs every figure above is the median of
  // the runs' figures; these are the lowest and highest goodput of a run
  // (equal to `goodput` for one run).
  double goodput_low = 0, goodput_high = 0;
  int replications = 1;
  // With SimOptions::per_request, each request's TTFT, TPOT (0 for one
  // token) and first gap between streamed items (0 for one item) in arrival
  // order, the median over the runs: to set beside a measured run's
  // requests one by one (the profile's calibrations, planner_bench
  // --requests-csv).
  std::vector<double> request_ttft, request_tpot, request_first_gap;
};

struct SimOptions {
  int nodes = 1;  // placed by PlaceLayout (layout.h)
  int cores = 2;  // per node
  // Each node's link, bytes/s each way: a stage's KV writes to a decode
  // worker and its hidden states to the next stage cross it when they are on
  // different nodes. Needed (> 0) only for a layout that spans nodes.
  double network_bytes_per_second = 0;
  // Probability that an n-gram draft token is accepted (layouts with γ > 0).
  double ngram_acceptance = 0;
  uint64_t seed = 1;  // of the acceptance and spread draws
  // Slow a step whose threads wait for each other (TP ranks, a thread
  // pool) more than processor sharing where the compute oversubscribes its
  // node (PerfModel::gang_sharing_exponent); off: processor sharing alone.
  bool gang_sharing = true;
  // Scale each step by a draw from its configuration's measured spread
  // (StepCost::SpreadAt); off, every step takes its fitted time.
  bool step_spread = true;
  // Add to each request's TTFT offset a draw from its measured scatter
  // (LinearCost::scatter); off, every request pays the fitted line. Off by
  // default: the calibrations' scatter rests on 12-19 requests, one of which
  // can sit 40-60 ms out, and with it drawn run 28's profile predicted runs
  // 21-28 worse (343 of 384 figures within 20% against 351 without; TTFT
  // p99's mean |log error| higher on 7 of the 8 runs; docs/PERFORMANCE.md).
  // Run 32's scatters, with cold prompt steps kept in them, drawn: 41 of 48
  // within 20% against 44 without.
  bool ttft_scatter = false;
  // The router (and client) stream on the same cores as the workers: each
  // streamed token's PerfModel::delivery_cpu_seconds competes with them.
  bool router_shares_cores = true;
  // Runs with different spread and acceptance draws (seeds seed, seed + 1,
  // ...), summarised by each figure's median — as planner_bench takes the
  // median of its measured rounds. One run's p99 over a few dozen requests
  // is its largest value or close to it, and another draw of step times
  // moves it by 10-30%: a single run predicts one sample of the p99, not
  // its typical value. Without draws (no spread, no speculation) one run is
  // all runs, and one is made.
  int replications = 1;
  // Fill Prediction::request_ttft, request_tpot and request_first_gap.
  bool per_request = false;
};

// INVALID_ARGUMENT for an empty request list or a layout with nothing in it;
// NOT_FOUND when the model has no step cost for one of its configurations.
absl::StatusOr<Prediction> Simulate(const PerfModel& model,
                                    const Layout& layout,
                                    const std::vector<SimRequest>& requests,
                                    const Slo& slo,
                                    const SimOptions& options = {});

// p-quantile as load_bench computes it: sorted[min(n − 1, ⌊p·n⌋)].
double Percentile(std::vector<double> values, double p);

// The middle value, or the mean of the middle two for an even count (how
// replications and planner_bench's measured rounds are summarised); 0 for
// none.
double Median(std::vector<double> values);

}  // namespace pdserve::planner
