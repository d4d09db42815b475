// The layout planner, online: every `interval` the router reads what it
// served since the last look (rate, mean prompt and output tokens — its own
// counters), plans for that workload on the saved profile
// (services/planner, `pdserve plan --perf-model`), and exports the answer as
// metrics an operator, a dashboard or an autoscaler can act on:
//
//   pdserve_planner_recommended_layout{layout, local_flags}  1
//   pdserve_planner_observed_request_rate                    requests/s
//   pdserve_planner_observed_prompt_tokens_mean / _output_tokens_mean
//   pdserve_planner_predicted_ttft_p99_seconds / _tpot_p99_seconds
//   pdserve_planner_predicted_slo_attainment     share meeting both SLOs
//   pdserve_planner_capacity_requests_per_second the largest rate at which
//       the recommended layout keeps ≥ 95% of requests within the SLO
//   pdserve_planner_headroom_ratio               capacity / observed rate
//   pdserve_planner_desired_replicas             ⌈observed rate / capacity⌉
//   pdserve_planner_layout_nodes (nodes one copy of the layout spans)
//   pdserve_planner_evaluations_total
//
// The router only sees means, so the planned workload takes lengths uniform
// in [m/2, 3m/2] around each mean and Poisson arrivals at the observed rate.
// A window in which nothing finished leaves the last answer standing.
//
// Thread-safety: one background thread evaluates; EvaluateNow may be called
// from any thread (tests), serialised by a mutex.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "metrics/metrics.h"
#include "planner/planner.h"
#include "router/router_metrics.h"

namespace pdserve::router {

struct PlannerMonitorOptions {
  planner::PerfModel model;
  planner::Slo slo;
  planner::Resources resources;
  absl::Duration interval = absl::Seconds(30);
  int simulated_requests = 200;  // per simulation
  // Simulation runs per layout (planner::PlanRequest::replications). Fewer
  // than `pdserve plan`'s 15: the router evaluates on the cores it serves
  // from, 15 runs of 200 requests for every layout take 0.5 s of CPU on the
  // dev VM (5: 0.17 s), and a p99 over 200 requests moves less from run to
  // run than one over 60.
  int replications = 5;
  // Share of requests within the SLO that defines capacity.
  double capacity_attainment = 0.95;
  // The clock windows are measured with (tests set their own).
  std::function<absl::Time()> clock = [] { return absl::Now(); };
};

class PlannerMonitor {
 public:
  using TotalsSource = std::function<metrics::ServedTotals()>;
  // Registers the gauges and starts the thread (its first evaluation after
  // one interval). INVALID_ARGUMENT for a non-positive SLO, interval or
  // core count.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<PlannerMonitor>> Start(
      PlannerMonitorOptions options, TotalsSource totals,
      metrics::MetricsRegistry& registry);
  ~PlannerMonitor();  // stops and joins the thread
  PlannerMonitor(const PlannerMonitor&) = delete;
  PlannerMonitor& operator=(const PlannerMonitor&) = delete;

  // Evaluates the window since the last evaluation now. FAILED_PRECONDITION
  // when nothing finished in it (the gauges keep their values).
  absl::Status EvaluateNow();

 private:
  PlannerMonitor(PlannerMonitorOptions options, TotalsSource totals,
                 metrics::MetricsRegistry& registry);
  void Loop();
  // Largest Poisson rate at which `layout` keeps capacity_attainment of the
  // requests within the SLO (bisection on the simulation).
  double Capacity(const planner::Layout& layout,
                  const planner::WorkloadSpec& workload) const;

  const PlannerMonitorOptions options_;
  const TotalsSource totals_;
  absl::Mutex mu_;
  metrics::ServedTotals last_ ABSL_GUARDED_BY(mu_);
  absl::Time last_time_ ABSL_GUARDED_BY(mu_);
  prometheus::Family<prometheus::Gauge>& layout_family_;
  prometheus::Gauge* layout_gauge_ ABSL_GUARDED_BY(mu_) = nullptr;
  prometheus::Gauge& rate_;
  prometheus::Gauge& prompt_mean_;
  prometheus::Gauge& output_mean_;
  prometheus::Gauge& ttft_p99_;
  prometheus::Gauge& tpot_p99_;
  prometheus::Gauge& attainment_;
  prometheus::Gauge& capacity_;
  prometheus::Gauge& headroom_;
  prometheus::Gauge& replicas_;
  prometheus::Gauge& desired_decode_;
  prometheus::Gauge& desired_prefill_;
  prometheus::Gauge& layout_nodes_;
  prometheus::Counter& evaluations_;
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace pdserve::router
