// The router's metric families (role "router"), as one object the router
// calls at the natural points of a request's life. Every method is cheap
// (atomic counters; a histogram observation takes a per-histogram lock) and
// thread-safe. Label sets (api/code, policy/side/worker, side) are looked up
// under a lock on first use and cached, so a handful of distinct values is
// the intended use, never per-request ids.
//
// Families (all carry the layout labels role, worker_id, stage, num_stages,
// tp; the router sets num_stages/tp to the layout of the cluster it fronts,
// --layout-stages/--layout-tp, so its latency series can be compared across
// layouts):
//   pdserve_router_requests_total{api,code}        OnRequest
//   pdserve_router_ttft_seconds                   ObserveTtft (end to end)
//   pdserve_router_ttft_phase_seconds{phase}      ObserveTtftBreakdown
//       phase = queue | prefill | kv_transfer | first_step
//   pdserve_router_itl_seconds                    ObserveItl (per token gap)
//   pdserve_router_tpot_seconds                   ObserveTpot (per request)
//   pdserve_router_e2e_seconds                    ObserveE2e
//   pdserve_router_in_flight_requests             SetInFlight / InFlightGauge
//   pdserve_router_queued_requests                SetQueued
//   pdserve_router_admission_queue_depth          SetAdmissionQueueDepth
//   pdserve_router_admission_wait_seconds         ObserveAdmissionWait
//   pdserve_router_routing_decisions_total{policy,side,worker}  OnRouting
//   pdserve_router_retries_total{side}            OnRetry
//   pdserve_router_prefill_decisions_total{where}  OnPrefillDecision
//       where = group | decode_short (short prompt) | decode_no_group
//       (fallback: no group in rotation) | decode_colocated | decode_resume
//   vllm:num_requests_waiting / vllm:num_requests_running /
//   vllm:kv_cache_usage_perc (and vllm:gpu_cache_usage_perc): the Gateway
//       API Inference Extension's model-server gauges (SetQueued,
//       SetInFlight, SetClusterKvUsage)
//   pdserve_router_migrations_total{outcome}      OnMigration
//       outcome = started | spent (max_migrations reached) | no_worker
//   pdserve_router_prompt_tokens_total            OnTokens
//   pdserve_router_output_tokens_total            OnTokens
#pragma once

#include <atomic>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "metrics/metrics.h"

namespace pdserve::metrics {

// Where a request spent its time to first token (seconds). `first_step` is
// from KvComplete accepted to the first token reaching the router.
// What the router served since it started (successful requests only): the
// layout planner's view of the workload (router/planner_monitor.h).
struct ServedTotals {
  int64_t requests = 0;
  double prompt_tokens = 0;
  double output_tokens = 0;
};

struct TtftBreakdown {
  double queue = 0;        // accepted until a prefill group was picked
  double prefill = 0;      // prefill submitted until its first token
  double kv_transfer = 0;  // KV writes landed + KvComplete notice
  double first_step = 0;   // decode's token 0 reaching the router
};

class RouterMetrics {
 public:
  // Registers the families in `registry` (whose layout role should be
  // "router"); `registry` must outlive this object.
  explicit RouterMetrics(MetricsRegistry& registry);
  RouterMetrics(const RouterMetrics&) = delete;
  RouterMetrics& operator=(const RouterMetrics&) = delete;

  // One finished request: `api` is "openai_completions", "openai_chat",
  // "grpc_generate", ...; `code` the HTTP status or gRPC code name.
  void OnRequest(const std::string& api, const std::string& code);
  // HTTP status (code="200", "429", ...) and gRPC/absl codes (code="OK",
  // "INVALID_ARGUMENT", ...: gRPC's code numbers are absl's).
  void OnRequest(const std::string& api, int http_status);
  void OnRequest(const std::string& api, absl::StatusCode code);
  void ObserveTtft(double seconds);
  void ObserveTtftBreakdown(const TtftBreakdown& breakdown);
  // Gap between two consecutive streamed tokens of one request.
  void ObserveItl(double seconds);
  // (e2e - ttft) / (output tokens - 1), once per request with >= 2 tokens.
  void ObserveTpot(double seconds);
  void ObserveE2e(double seconds);
  void SetInFlight(int64_t n);
  void SetQueued(int64_t n);
  // The admission queue (router/admission_queue.h): requests waiting in line
  // for KV room, and how long each waited before it was admitted or gave up.
  void SetAdmissionQueueDepth(int64_t n);
  // KV blocks used / capacity summed over the decode workers in rotation.
  void SetClusterKvUsage(double fraction);
  void ObserveAdmissionWait(double seconds);
  // `policy` e.g. "round_robin", "least_load", "prefix"; `side` "prefill"
  // or "decode"; `worker` the chosen worker's address or id.
  void OnRouting(const std::string& policy, const std::string& side,
                 const std::string& worker);
  void OnRetry(const std::string& side);
  void OnPrefillDecision(const std::string& where);
  void OnMigration(const std::string& outcome);
  // Once per successfully finished request.
  void OnTokens(int64_t prompt_tokens, int64_t output_tokens);
  ServedTotals Served() const;

 private:
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Histogram& ttft_;
  prometheus::Family<prometheus::Histogram>& ttft_phase_;
  prometheus::Histogram* phase_queue_;
  prometheus::Histogram* phase_prefill_;
  prometheus::Histogram* phase_kv_;
  prometheus::Histogram* phase_first_step_;
  prometheus::Histogram& itl_;
  prometheus::Histogram& tpot_;
  prometheus::Histogram& e2e_;
  prometheus::Gauge& in_flight_;
  prometheus::Gauge& queued_;
  prometheus::Gauge& admission_queue_depth_;
  prometheus::Histogram& admission_wait_;
  prometheus::Family<prometheus::Counter>& routing_;
  prometheus::Family<prometheus::Counter>& retries_;
  prometheus::Family<prometheus::Counter>& prefill_decisions_;
  prometheus::Family<prometheus::Counter>& migrations_;
  prometheus::Gauge& gateway_waiting_;
  prometheus::Gauge& gateway_running_;
  prometheus::Gauge& gateway_kv_usage_;
  prometheus::Gauge& gateway_kv_usage_legacy_;
  std::atomic<int64_t> in_flight_now_{0};
  std::atomic<int64_t> queued_now_{0};
  prometheus::Counter& prompt_tokens_;
  prometheus::Counter& output_tokens_;
  std::atomic<int64_t> served_requests_{0};

  // Cached label sets (Family::Add hashes and locks on every call).
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, prometheus::Counter*> request_counters_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, prometheus::Counter*> routing_counters_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, prometheus::Counter*> retry_counters_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, prometheus::Counter*> decision_counters_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, prometheus::Counter*> migration_counters_
      ABSL_GUARDED_BY(mu_);

  // The counter of `family` labelled {label=value}, cached in `cache`.
  prometheus::Counter* Labelled(
      prometheus::Family<prometheus::Counter>& family, const char* label,
      const std::string& value,
      absl::flat_hash_map<std::string, prometheus::Counter*>& cache);
};

}  // namespace pdserve::metrics
