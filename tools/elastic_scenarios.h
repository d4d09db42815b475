// Membership changes under streaming load, as scenarios (issue 45): each
// starts a LocalCluster (DNS discovery through dnsmasq, workers on their own
// loopback addresses), records every request's undisturbed answer, runs
// closed-loop greedy streams (tools/churn_load.h), changes the cluster the
// way Kubernetes does — scale up / down, rolling update, drain, node loss —
// and returns what the clients saw. The elastic tests assert on the results
// (tests/e2e/elastic_test.cc, stories260K); bench/elastic_bench prints them
// as docs/PERFORMANCE.md's table (llama-110m shapes, longer streams).
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tools/churn_load.h"
#include "tools/local_cluster.h"

namespace pdserve::tools {

struct ScenarioOptions {
  // The cluster (dns_discovery is set by the scenarios that scale).
  LocalClusterOptions cluster;
  int clients = 6;
  // The requests (their expected answers are filled in by the scenario).
  std::vector<ChurnRequest> requests;
  // Requests that complete before the change starts (the "before" window),
  // and after each step of it.
  int warmup_requests = 18;
  int requests_per_step = 12;
};

struct ScenarioResult {
  std::string name;
  ChurnSummary before;  // requests started before the change
  ChurnSummary during;  // from the change's start to the end
  // Seconds from a new worker's start to its first served request.
  std::vector<double> time_to_traffic;
  // Seconds a removed worker took to drain and exit.
  std::vector<double> drain_seconds;
  // Router counters read at the end (before a router kill, for that one).
  double migrations = 0;
  double prefilled_by_decode_for_want_of_a_group = 0;
  // Router kill only: streams in flight that broke with it, requests
  // refused while it was down, seconds until it served again.
  int broken_by_router = 0;
  int refused_while_router_down = 0;
  double router_back_seconds = 0;
  // Every request that did not start and end on the router's other side of
  // its kill, and is not OK and identical to the undisturbed answer.
  int lost = 0;
  std::string first_loss;
  // Every live worker's KV back to no request's blocks at the end.
  bool kv_back_to_baseline = false;
  std::string kv_detail;
};

// Decode workers 1 -> 3 -> 1 (the two added leave by drain).
[[nodiscard]] absl::StatusOr<ScenarioResult> ScaleDecodeWorkers(
    ScenarioOptions options);
// Prefill groups 1 -> 2 -> 1 (the first group drains away).
[[nodiscard]] absl::StatusOr<ScenarioResult> ScalePrefillGroups(
    ScenarioOptions options);
// Every decode worker and the prefill group replaced one at a time (surge,
// then the old one drains within cluster.drain_timeout_s).
[[nodiscard]] absl::StatusOr<ScenarioResult> RollingRestart(
    ScenarioOptions options);
// SIGTERM to one of two decode workers: it drains (its streams finish or,
// past the drain timeout, migrate), and is not replaced.
[[nodiscard]] absl::StatusOr<ScenarioResult> DrainDecodeWorker(
    ScenarioOptions options);
// SIGKILL of one of two decode workers (a lost node): its streams migrate;
// the supervisor restarts it.
[[nodiscard]] absl::StatusOr<ScenarioResult> KillDecodeWorker(
    ScenarioOptions options);
// SIGKILL of stage 1 of the only prefill group: decode workers prefill
// until the group is back.
[[nodiscard]] absl::StatusOr<ScenarioResult> KillOnlyPrefillStage(
    ScenarioOptions options);
// SIGKILL of the router (restarted by the supervisor): its own streams
// break (counted), nothing else.
[[nodiscard]] absl::StatusOr<ScenarioResult> KillRouter(
    ScenarioOptions options);

// One line per figure, for logs and the bench's table.
std::string Describe(const ScenarioResult& result);

}  // namespace pdserve::tools
