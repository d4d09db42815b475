#include "prefill_worker/stage_metrics.h"

namespace pdserve::prefill {

using metrics::CountBuckets;
using metrics::LatencyBuckets;
using metrics::SyncCounter;

PrefillStageMetrics::PrefillStageMetrics(metrics::MetricsRegistry& r)
    : registry_(r),
      microbatch_tokens_(r.Histogram("pdserve_prefill_microbatch_tokens",
                                     "Prompt tokens in one microbatch",
                                     CountBuckets(8192))),
      chunk_seconds_(r.Histogram(
          "pdserve_prefill_chunk_seconds",
          "Compute seconds of one microbatch (its chunks) on this stage",
          LatencyBuckets())),
      kv_bytes_(r.Counter("pdserve_prefill_kv_bytes_written_total",
                          "KV payload bytes of this stage's layers written "
                          "to decode workers (each KV head once)")),
      kv_transfer_seconds_(r.Histogram(
          "pdserve_prefill_kv_transfer_seconds",
          "From issuing one chunk's KV write until it landed at every rank",
          LatencyBuckets())),
      kv_failures_(r.Counter("pdserve_prefill_kv_transfer_failures_total",
                             "KV writes that failed or timed out")),
      busy_seconds_(r.Counter("pdserve_prefill_stage_busy_seconds_total",
                              "Seconds the stage spent computing")),
      idle_seconds_(
          r.Counter("pdserve_prefill_stage_idle_seconds_total",
                    "Seconds since the stage started that it was not computing "
                    "(the pipeline bubble under load)")),
      microbatches_(r.Counter("pdserve_prefill_microbatches_total",
                              "Microbatches the stage computed")),
      chunks_(r.Counter("pdserve_prefill_chunks_total",
                        "Request chunks the stage computed")),
      tokens_(r.Counter("pdserve_prefill_tokens_total",
                        "Prompt tokens the stage computed")),
      scored_tokens_(r.Counter(
          "pdserve_prefill_scored_tokens_total",
          "Last stage: prompt tokens whose logits it computed to score the "
          "prompt (echo + logprobs); / tokens_total = --scored-share")),
      stage_failures_(r.Counter("pdserve_prefill_stage_failures_total",
                                "Microbatches whose forward failed")),
      kv_mirror_bytes_(r.Counter(
          "pdserve_prefill_kv_mirror_bytes_total",
          "GPU stages: KV copied from the GPU to the host mirror the UCX "
          "writes read")),
      kv_mirror_seconds_(
          r.Counter("pdserve_prefill_kv_mirror_seconds_total",
                    "GPU stages: stage-thread seconds spent on that copy")) {
  if (r.layout().stage == 0) {
    queue_depth_ = &r.Gauge(
        "pdserve_prefill_queue_depth",
        "Requests accepted by the group and not yet running (stage 0)");
    in_flight_ = &r.Gauge("pdserve_prefill_in_flight_requests",
                          "Requests in the group's scheduler (stage 0)");
    blocks_used_ = &r.Gauge("pdserve_prefill_kv_blocks_used",
                            "Group-wide KV blocks in use (stage 0)");
    blocks_total_ = &r.Gauge("pdserve_prefill_kv_blocks_capacity",
                             "Group-wide KV blocks (stage 0)");
    completed_ = &r.Counter("pdserve_prefill_requests_completed_total",
                            "Requests prefilled (stage 0)");
    failed_ = &r.Counter("pdserve_prefill_requests_failed_total",
                         "Requests whose prefill failed (stage 0)");
    cached_tokens_ =
        &r.Counter("pdserve_prefill_cached_tokens_total",
                   "Prompt tokens the prefill prefix cache skipped (stage 0)");
    serving_ = &r.Gauge("pdserve_prefill_group_serving",
                        "1 while every stage of the group answers (stage 0)");
  }
}

StageObserver PrefillStageMetrics::Observer() {
  StageObserver o;
  o.on_microbatch = [this](int64_t tokens, int, double seconds) {
    microbatch_tokens_.Observe(static_cast<double>(tokens));
    chunk_seconds_.Observe(seconds);
  };
  o.on_kv_transfer = [this](int64_t bytes, double seconds, bool ok) {
    kv_transfer_seconds_.Observe(seconds);
    if (ok) {
      kv_bytes_.Increment(static_cast<double>(bytes));
    } else {
      kv_failures_.Increment();
    }
  };
  return o;
}

void PrefillStageMetrics::Bind(const StageProcess* stage,
                               const PrefillService* service) {
  hook_ =
      registry_.OnScrape([this, stage, service] { Refresh(*stage, service); });
}

void PrefillStageMetrics::Refresh(const StageProcess& stage,
                                  const PrefillService* service) {
  const StageStats s = stage.stats();
  SyncCounter(busy_seconds_, s.busy_seconds);
  SyncCounter(idle_seconds_, s.idle_seconds);
  SyncCounter(microbatches_, static_cast<double>(s.microbatches));
  SyncCounter(chunks_, static_cast<double>(s.chunks));
  SyncCounter(tokens_, static_cast<double>(s.tokens));
  SyncCounter(scored_tokens_, static_cast<double>(s.scored_tokens));
  SyncCounter(stage_failures_, static_cast<double>(s.failures));
  SyncCounter(kv_mirror_bytes_, static_cast<double>(s.kv_mirror_bytes));
  SyncCounter(kv_mirror_seconds_, s.kv_mirror_seconds);
  if (service == nullptr || queue_depth_ == nullptr) return;
  const pdserve::v1::PrefillLoad load = service->Load();
  queue_depth_->Set(load.queued());
  in_flight_->Set(load.in_flight());
  blocks_used_->Set(static_cast<double>(load.kv_blocks_used()));
  blocks_total_->Set(static_cast<double>(load.kv_blocks_total()));
  SyncCounter(*completed_, static_cast<double>(load.completed()));
  SyncCounter(*failed_, static_cast<double>(load.failed()));
  SyncCounter(*cached_tokens_, static_cast<double>(load.cached_tokens()));
  serving_->Set(load.serving() ? 1 : 0);
}

}  // namespace pdserve::prefill
