// A prefill stage process's metric families (role "prefill"; the stages of
// one group share worker_id and differ in the stage label), fed two ways:
//   - per event, through StageObserver (microbatch tokens and compute
//     seconds on the stage thread; KV transfer bytes, seconds and failures
//     on the KV completion thread): atomic counters and histogram
//     observations, no new locks on those threads beyond prometheus-cpp's;
//   - per scrape, by a hook copying StageProcess::stats() (busy/idle seconds,
//     microbatches, tokens) and, on stage 0, PrefillService::Load() (queue
//     depth, in flight, blocks, completed/failed requests).
// See services/metrics/README.md for every family.
#pragma once

#include "metrics/metrics.h"
#include "prefill/pipeline_stage.h"
#include "prefill_worker/prefill_service.h"
#include "prefill_worker/stage_process.h"

namespace pdserve::prefill {

class PrefillStageMetrics {
 public:
  // Registers the families in `registry`, which must outlive this object.
  explicit PrefillStageMetrics(metrics::MetricsRegistry& registry);
  PrefillStageMetrics(const PrefillStageMetrics&) = delete;
  PrefillStageMetrics& operator=(const PrefillStageMetrics&) = delete;

  // For StageProcessOptions::observer; valid while this object lives.
  StageObserver Observer();
  // Reads `stage` (and, on stage 0, `service`; else null) on every scrape
  // from now on. Unbind() (or destroy this) before either is destroyed.
  void Bind(const StageProcess* stage, const PrefillService* service);
  void Unbind() { hook_ = {}; }

 private:
  void Refresh(const StageProcess& stage, const PrefillService* service);

  metrics::MetricsRegistry& registry_;
  prometheus::Histogram& microbatch_tokens_;
  prometheus::Histogram& chunk_seconds_;
  prometheus::Counter& kv_bytes_;
  prometheus::Histogram& kv_transfer_seconds_;
  prometheus::Counter& kv_failures_;
  prometheus::Counter& busy_seconds_;
  prometheus::Counter& idle_seconds_;
  prometheus::Counter& microbatches_;
  prometheus::Counter& chunks_;
  prometheus::Counter& tokens_;
  prometheus::Counter& scored_tokens_;
  prometheus::Counter& stage_failures_;
  prometheus::Counter& kv_mirror_bytes_;
  prometheus::Counter& kv_mirror_seconds_;
  // Stage 0 only (registered there, so other stages export no empty series).
  prometheus::Gauge* queue_depth_ = nullptr;
  prometheus::Gauge* in_flight_ = nullptr;
  prometheus::Gauge* blocks_used_ = nullptr;
  prometheus::Gauge* blocks_total_ = nullptr;
  prometheus::Counter* completed_ = nullptr;
  prometheus::Counter* failed_ = nullptr;
  prometheus::Counter* cached_tokens_ = nullptr;
  prometheus::Gauge* serving_ = nullptr;
  metrics::MetricsRegistry::HookHandle hook_;
};

}  // namespace pdserve::prefill
