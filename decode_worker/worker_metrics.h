// The decode worker's metric families (role "decode"), fed two ways:
//   - per step, through DecodeWorkerOptions::step_observer (batch size, step
//     seconds, acceptance length, output tokens): histogram observations on
//     the scheduler thread, no new locks beyond prometheus-cpp's own;
//   - per scrape, by a hook copying what the worker and service already
//     count (DecodeWorker::Load, the block manager's prefix-cache stats, the
//     service's lease expiries) into gauges and counters.
// See services/metrics/README.md for every family.
#pragma once

#include <functional>

#include "decode/decode_worker.h"
#include "decode_worker/decode_service.h"
#include "metrics/metrics.h"

namespace pdserve::decode_worker {

class DecodeWorkerMetrics {
 public:
  // Registers the families in `registry`, which must outlive this object.
  explicit DecodeWorkerMetrics(metrics::MetricsRegistry& registry);
  DecodeWorkerMetrics(const DecodeWorkerMetrics&) = delete;
  DecodeWorkerMetrics& operator=(const DecodeWorkerMetrics&) = delete;

  // For DecodeWorkerOptions::step_observer; valid while this object lives.
  std::function<void(const decode::StepStats&)> StepObserver();
  // Reads `worker` and `service` (may be null) on every scrape from now on.
  // Call Unbind() (or destroy this) before either is destroyed.
  void Bind(const decode::DecodeWorker* worker, const DecodeService* service);
  void Unbind() { hook_ = {}; }

 private:
  void Refresh(const decode::DecodeWorker& worker,
               const DecodeService* service);

  metrics::MetricsRegistry& registry_;
  prometheus::Histogram& batch_size_;
  prometheus::Histogram& step_seconds_;
  prometheus::Histogram& step_tokens_;
  prometheus::Histogram& acceptance_length_;
  prometheus::Counter& output_tokens_;
  prometheus::Gauge& running_;
  prometheus::Gauge& waiting_;
  prometheus::Gauge& awaiting_kv_;
  prometheus::Gauge& blocks_used_;
  prometheus::Gauge& blocks_total_;
  prometheus::Gauge& gateway_waiting_;
  prometheus::Gauge& gateway_running_;
  prometheus::Gauge& gateway_kv_usage_;
  prometheus::Gauge& gateway_kv_usage_legacy_;
  prometheus::Gauge& draining_;
  prometheus::Gauge& live_streams_;
  prometheus::Gauge& blocks_cached_;
  prometheus::Counter& prefix_queries_;
  prometheus::Counter& prefix_query_blocks_;
  prometheus::Counter& prefix_hit_blocks_;
  prometheus::Counter& spec_verify_steps_;
  prometheus::Counter& spec_proposed_;
  prometheus::Counter& spec_accepted_;
  prometheus::Counter& spec_emitted_;
  prometheus::Counter& allreduce_seconds_;
  prometheus::Counter& kv_staged_bytes_;
  prometheus::Counter& kv_staging_seconds_;
  prometheus::Counter& preemptions_;
  prometheus::Counter& lease_expiries_;
  // Mixtures of experts, one series per sparse layer (label "layer").
  prometheus::Family<prometheus::Counter>& expert_routed_;
  prometheus::Family<prometheus::Gauge>& expert_imbalance_;
  metrics::MetricsRegistry::HookHandle hook_;
};

}  // namespace pdserve::decode_worker
