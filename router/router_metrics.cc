#include "router/router_metrics.h"

#include "absl/strings/str_cat.h"

namespace pdserve::metrics {

RouterMetrics::RouterMetrics(MetricsRegistry& registry)
    : requests_(
          registry.CounterFamily("pdserve_router_requests_total",
                                 "Finished requests by API and status code")),
      ttft_(registry.Histogram(
          "pdserve_router_ttft_seconds",
          "Time to first token measured at the router (queue + prefill + KV "
          "transfer + first decode step)",
          LatencyBuckets())),
      ttft_phase_(
          registry.HistogramFamily("pdserve_router_ttft_phase_seconds",
                                   "Time to first token broken down by phase")),
      itl_(registry.Histogram("pdserve_router_itl_seconds",
                              "Gap between consecutive streamed tokens",
                              LatencyBuckets())),
      tpot_(registry.Histogram(
          "pdserve_router_tpot_seconds",
          "Time per output token after the first, per request",
          LatencyBuckets())),
      e2e_(registry.Histogram("pdserve_router_e2e_seconds",
                              "End-to-end request latency", LatencyBuckets())),
      in_flight_(registry.Gauge("pdserve_router_in_flight_requests",
                                "Requests between admission and finish")),
      queued_(registry.Gauge("pdserve_router_queued_requests",
                             "Requests waiting for a worker")),
      admission_queue_depth_(registry.Gauge(
          "pdserve_router_admission_queue_depth",
          "Requests waiting in line for KV room on a decode worker")),
      admission_wait_(registry.Histogram(
          "pdserve_router_admission_wait_seconds",
          "Time a request waited in the admission queue before it was "
          "admitted (or gave up)",
          LatencyBuckets())),
      routing_(registry.CounterFamily(
          "pdserve_router_routing_decisions_total",
          "Workers picked, by policy, side (prefill|decode) and worker")),
      retries_(registry.CounterFamily(
          "pdserve_router_retries_total",
          "Requests retried on another worker, by side")),
      prefill_decisions_(registry.CounterFamily(
          "pdserve_router_prefill_decisions_total",
          "Where requests were prefilled: a prefill group, or their decode "
          "worker and why (short prompt, no group, colocated, resumed "
          "stream)")),
      migrations_(registry.CounterFamily(
          "pdserve_router_migrations_total",
          "Streams moved to another decode worker mid-stream (started), or "
          "that could not move (spent, no_worker)")),
      // The Gateway API Inference Extension's model-server protocol, for a
      // gateway whose endpoint picker chooses among routers: the names its
      // picker reads by default (vLLM's).
      gateway_waiting_(registry.Gauge(
          "vllm:num_requests_waiting",
          "Requests not yet at their first token (inference-extension "
          "TotalQueuedRequests)")),
      gateway_running_(
          registry.Gauge("vllm:num_requests_running",
                         "Requests streaming tokens (inference-extension "
                         "TotalRunningRequests)")),
      gateway_kv_usage_(registry.Gauge(
          "vllm:kv_cache_usage_perc",
          "KV blocks used / capacity over the decode workers in rotation, "
          "0-1 (inference-extension KVCacheUtilization)")),
      gateway_kv_usage_legacy_(
          registry.Gauge("vllm:gpu_cache_usage_perc",
                         "Same as vllm:kv_cache_usage_perc (the older name)")),
      prompt_tokens_(registry.Counter("pdserve_router_prompt_tokens_total",
                                      "Prompt tokens of admitted requests")),
      output_tokens_(registry.Counter("pdserve_router_output_tokens_total",
                                      "Output tokens streamed to clients")) {
  // The four phases exist from the start, so dashboards show them at zero.
  phase_queue_ = &ttft_phase_.Add({{"phase", "queue"}}, LatencyBuckets());
  phase_prefill_ = &ttft_phase_.Add({{"phase", "prefill"}}, LatencyBuckets());
  phase_kv_ = &ttft_phase_.Add({{"phase", "kv_transfer"}}, LatencyBuckets());
  phase_first_step_ =
      &ttft_phase_.Add({{"phase", "first_step"}}, LatencyBuckets());
  absl::MutexLock lock(&mu_);
  for (const char* side : {"prefill", "decode"})
    retry_counters_[side] = &retries_.Add({{"side", side}});
  for (const char* where : {"group", "decode_short", "decode_no_group"})
    decision_counters_[where] = &prefill_decisions_.Add({{"where", where}});
  migration_counters_["started"] = &migrations_.Add({{"outcome", "started"}});
}

void RouterMetrics::OnRequest(const std::string& api, const std::string& code) {
  prometheus::Counter* c = nullptr;
  {
    absl::MutexLock lock(&mu_);
    auto [it, inserted] =
        request_counters_.try_emplace(absl::StrCat(api, "\x1f", code));
    if (inserted) it->second = &requests_.Add({{"api", api}, {"code", code}});
    c = it->second;
  }
  c->Increment();
}

void RouterMetrics::OnRequest(const std::string& api, int http_status) {
  OnRequest(api, absl::StrCat(http_status));
}

void RouterMetrics::OnRequest(const std::string& api, absl::StatusCode code) {
  OnRequest(api, absl::StatusCodeToString(code));
}

void RouterMetrics::ObserveTtft(double seconds) { ttft_.Observe(seconds); }

void RouterMetrics::ObserveTtftBreakdown(const TtftBreakdown& b) {
  phase_queue_->Observe(b.queue);
  phase_prefill_->Observe(b.prefill);
  phase_kv_->Observe(b.kv_transfer);
  phase_first_step_->Observe(b.first_step);
}

void RouterMetrics::ObserveItl(double seconds) { itl_.Observe(seconds); }
void RouterMetrics::ObserveTpot(double seconds) { tpot_.Observe(seconds); }
void RouterMetrics::ObserveE2e(double seconds) { e2e_.Observe(seconds); }
void RouterMetrics::SetInFlight(int64_t n) {
  in_flight_.Set(static_cast<double>(n));
  in_flight_now_.store(n);
  gateway_running_.Set(
      static_cast<double>(std::max<int64_t>(0, n - queued_now_.load())));
}
void RouterMetrics::SetQueued(int64_t n) {
  queued_.Set(static_cast<double>(n));
  queued_now_.store(n);
  gateway_waiting_.Set(static_cast<double>(n));
  gateway_running_.Set(
      static_cast<double>(std::max<int64_t>(0, in_flight_now_.load() - n)));
}
void RouterMetrics::SetClusterKvUsage(double fraction) {
  gateway_kv_usage_.Set(fraction);
  gateway_kv_usage_legacy_.Set(fraction);
}

void RouterMetrics::SetAdmissionQueueDepth(int64_t n) {
  admission_queue_depth_.Set(static_cast<double>(n));
}

void RouterMetrics::ObserveAdmissionWait(double seconds) {
  admission_wait_.Observe(seconds);
}

void RouterMetrics::OnRouting(const std::string& policy,
                              const std::string& side,
                              const std::string& worker) {
  prometheus::Counter* c = nullptr;
  {
    absl::MutexLock lock(&mu_);
    auto [it, inserted] = routing_counters_.try_emplace(
        absl::StrCat(policy, "\x1f", side, "\x1f", worker));
    if (inserted) {
      it->second = &routing_.Add(
          {{"policy", policy}, {"side", side}, {"worker", worker}});
    }
    c = it->second;
  }
  c->Increment();
}

prometheus::Counter* RouterMetrics::Labelled(
    prometheus::Family<prometheus::Counter>& family, const char* label,
    const std::string& value,
    absl::flat_hash_map<std::string, prometheus::Counter*>& cache) {
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = cache.try_emplace(value);
  if (inserted) it->second = &family.Add({{label, value}});
  return it->second;
}

void RouterMetrics::OnRetry(const std::string& side) {
  Labelled(retries_, "side", side, retry_counters_)->Increment();
}

void RouterMetrics::OnPrefillDecision(const std::string& where) {
  Labelled(prefill_decisions_, "where", where, decision_counters_)->Increment();
}

void RouterMetrics::OnMigration(const std::string& outcome) {
  Labelled(migrations_, "outcome", outcome, migration_counters_)->Increment();
}

void RouterMetrics::OnTokens(int64_t prompt_tokens, int64_t output_tokens) {
  if (prompt_tokens > 0) prompt_tokens_.Increment(prompt_tokens);
  if (output_tokens > 0) output_tokens_.Increment(output_tokens);
  served_requests_.fetch_add(1, std::memory_order_relaxed);
}

ServedTotals RouterMetrics::Served() const {
  return {served_requests_.load(std::memory_order_relaxed),
          prompt_tokens_.Value(), output_tokens_.Value()};
}

}  // namespace pdserve::metrics
