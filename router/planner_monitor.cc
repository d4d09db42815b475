#include "router/planner_monitor.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace pdserve::router {

absl::StatusOr<std::unique_ptr<PlannerMonitor>> PlannerMonitor::Start(
    PlannerMonitorOptions options, TotalsSource totals,
    metrics::MetricsRegistry& registry) {
  if (!(options.slo.ttft_seconds > 0) || !(options.slo.tpot_seconds > 0) ||
      options.interval <= absl::ZeroDuration() || options.resources.cores < 1 ||
      options.simulated_requests < 1 || options.replications < 1 ||
      !(options.capacity_attainment > 0) || options.capacity_attainment > 1) {
    return absl::InvalidArgumentError(
        "planner monitor: the SLOs, interval, cores, simulated requests and "
        "replications must be positive and the capacity attainment in (0, "
        "1]");
  }
  if (options.resources.nodes < 1 ||
      options.resources.nodes > planner::kMaxPlannedNodes ||
      (options.resources.nodes > 1 &&
       !(options.resources.network_bytes_per_second > 0))) {
    return absl::InvalidArgumentError(
        absl::StrCat("planner monitor: ", options.resources.nodes,
                     " node(s): needs 1..", planner::kMaxPlannedNodes,
                     ", and the nodes' link bandwidth for more than one"));
  }
  if (options.resources.nodes == 1 &&
      options.resources.network_bytes_per_second != 0) {
    return absl::InvalidArgumentError(
        "planner monitor: a link bandwidth is for a layout spanning nodes; "
        "it needs more than one node");
  }
  if (options.resources.nodes > 1 &&
      (!(options.model.kv_bytes_per_token > 0) ||
       !(options.model.activation_bytes_per_token > 0))) {
    return absl::FailedPreconditionError(
        "planner monitor: planning across nodes needs the KV and "
        "hidden-state bytes per token, which this perf model predates: "
        "profile again");
  }
  std::unique_ptr<PlannerMonitor> monitor(
      new PlannerMonitor(std::move(options), std::move(totals), registry));
  monitor->thread_ = std::thread([m = monitor.get()] { m->Loop(); });
  return monitor;
}

PlannerMonitor::PlannerMonitor(PlannerMonitorOptions options,
                               TotalsSource totals,
                               metrics::MetricsRegistry& registry)
    : options_(std::move(options)),
      totals_(std::move(totals)),
      last_(totals_()),
      last_time_(options_.clock()),
      layout_family_(registry.GaugeFamily(
          "pdserve_planner_recommended_layout",
          "1 for the layout the planner recommends for the observed "
          "workload (labels: layout, local_flags).")),
      rate_(registry.Gauge("pdserve_planner_observed_request_rate",
                           "Requests/s the router finished in the last "
                           "planner window.")),
      prompt_mean_(registry.Gauge("pdserve_planner_observed_prompt_tokens_mean",
                                  "Mean prompt tokens in the last window.")),
      output_mean_(registry.Gauge("pdserve_planner_observed_output_tokens_mean",
                                  "Mean output tokens in the last window.")),
      ttft_p99_(registry.Gauge("pdserve_planner_predicted_ttft_p99_seconds",
                               "Predicted TTFT p99 of the recommended layout "
                               "at the observed workload.")),
      tpot_p99_(registry.Gauge("pdserve_planner_predicted_tpot_p99_seconds",
                               "Predicted TPOT p99 of the recommended layout "
                               "at the observed workload.")),
      attainment_(registry.Gauge(
          "pdserve_planner_predicted_slo_attainment",
          "Predicted share of requests meeting both SLOs on the recommended "
          "layout at the observed workload.")),
      capacity_(registry.Gauge(
          "pdserve_planner_capacity_requests_per_second",
          "Largest request rate at which the recommended layout keeps the "
          "capacity share of requests within the SLO.")),
      headroom_(registry.Gauge("pdserve_planner_headroom_ratio",
                               "Capacity of the recommended layout divided "
                               "by the observed request rate.")),
      replicas_(registry.Gauge(
          "pdserve_planner_desired_replicas",
          "Copies of the recommended layout the observed rate needs: "
          "ceil(rate / capacity), at least 1.")),
      // What the autoscalers read (deploy/kubernetes/base/autoscaling.yaml):
      // the recommended layout's workers times its desired copies.
      desired_decode_(registry.Gauge(
          "pdserve_planner_desired_decode_workers",
          "Decode workers the observed rate needs: the recommended layout's "
          "decode workers times pdserve_planner_desired_replicas.")),
      desired_prefill_(registry.Gauge(
          "pdserve_planner_desired_prefill_groups",
          "Prefill groups the observed rate needs (0 when colocated serving "
          "is recommended): the layout's groups times the desired copies.")),
      layout_nodes_(registry.Gauge(
          "pdserve_planner_layout_nodes",
          "Nodes one copy of the recommended layout spans (its placement; "
          "nodes needed = this times the desired replicas).")),
      evaluations_(registry.Counter("pdserve_planner_evaluations_total",
                                    "Planner evaluations that planned.")) {}

PlannerMonitor::~PlannerMonitor() {
  stop_.Notify();
  if (thread_.joinable()) thread_.join();
}

void PlannerMonitor::Loop() {
  while (!stop_.WaitForNotificationWithTimeout(options_.interval)) {
    // A quiet window is not an error worth a log line every interval.
    (void)EvaluateNow();
  }
}

double PlannerMonitor::Capacity(const planner::Layout& layout,
                                const planner::WorkloadSpec& workload) const {
  planner::SimOptions sim;
  sim.nodes = options_.resources.nodes;
  sim.cores = options_.resources.cores;
  sim.network_bytes_per_second = options_.resources.network_bytes_per_second;
  sim.router_shares_cores = options_.resources.router_shares_cores;
  auto holds = [&](double rate) {
    planner::WorkloadSpec w = workload;
    w.rate = rate;
    auto p = planner::Simulate(options_.model, layout, planner::SimRequests(w),
                               options_.slo, sim);
    return p.ok() && p->slo_attainment >= options_.capacity_attainment;
  };
  double lo = 0, hi = std::max(workload.rate, 0.01);
  // Grow until the layout fails (or a rate no single layout would see).
  while (holds(hi) && hi < 1e4) {
    lo = hi;
    hi *= 2;
  }
  for (int i = 0; i < 12 && hi - lo > 0.01 * hi; ++i) {
    const double mid = (lo + hi) / 2;
    (holds(mid) ? lo : hi) = mid;
  }
  return lo;
}

absl::Status PlannerMonitor::EvaluateNow() {
  absl::MutexLock lock(&mu_);
  const metrics::ServedTotals now = totals_();
  const absl::Time time = options_.clock();
  const int64_t requests = now.requests - last_.requests;
  const double seconds = absl::ToDoubleSeconds(time - last_time_);
  if (requests <= 0 || seconds <= 0) {
    last_time_ = time;
    return absl::FailedPreconditionError(
        "no request finished since the last evaluation");
  }
  const double rate = requests / seconds;
  const double prompt_mean =
      (now.prompt_tokens - last_.prompt_tokens) / requests;
  const double output_mean =
      (now.output_tokens - last_.output_tokens) / requests;
  last_ = now;
  last_time_ = time;
  rate_.Set(rate);
  prompt_mean_.Set(prompt_mean);
  output_mean_.Set(output_mean);

  planner::PlanRequest request;
  request.workload = planner::WorkloadFromMeans(options_.simulated_requests,
                                                rate, prompt_mean, output_mean);
  request.slo = options_.slo;
  request.resources = options_.resources;
  request.replications = options_.replications;
  auto ranked = planner::Plan(options_.model, request);
  if (!ranked.ok()) return ranked.status();
  const planner::RankedLayout& best = ranked->front();
  if (layout_gauge_ != nullptr) layout_family_.Remove(layout_gauge_);
  layout_gauge_ =
      &layout_family_.Add({{"layout", best.layout.Name()},
                           {"local_flags", best.layout.LocalFlags()}});
  layout_gauge_->Set(1);
  ttft_p99_.Set(best.prediction.ttft_p99);
  tpot_p99_.Set(best.prediction.tpot_p99);
  attainment_.Set(best.prediction.slo_attainment);
  const double capacity = Capacity(best.layout, request.workload);
  capacity_.Set(capacity);
  headroom_.Set(capacity > 0 ? capacity / rate : 0);
  const double copies = capacity > 0 ? std::max(1.0, std::ceil(rate / capacity))
                                     : std::ceil(rate / 0.01);
  replicas_.Set(copies);
  desired_decode_.Set(copies * best.layout.decode_workers);
  desired_prefill_.Set(
      best.layout.colocated ? 0 : copies * best.layout.prefill_groups);
  layout_nodes_.Set(best.nodes_used);
  evaluations_.Increment();
  return absl::OkStatus();
}

}  // namespace pdserve::router
