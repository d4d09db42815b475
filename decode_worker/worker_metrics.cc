#include "decode_worker/worker_metrics.h"

namespace pdserve::decode_worker {

using metrics::CountBuckets;
using metrics::LatencyBuckets;
using metrics::SyncCounter;

DecodeWorkerMetrics::DecodeWorkerMetrics(metrics::MetricsRegistry& r)
    : registry_(r),
      batch_size_(r.Histogram("pdserve_decode_batch_size",
                              "Requests in one decode step's batch",
                              CountBuckets(1024))),
      step_seconds_(
          r.Histogram("pdserve_decode_step_seconds",
                      "Wall time of one forward step over every TP rank",
                      LatencyBuckets())),
      step_tokens_(r.Histogram("pdserve_decode_step_tokens",
                               "Tokens fed through the model in one step "
                               "(decode tokens, drafts, prefill chunks)",
                               CountBuckets(8192))),
      acceptance_length_(r.Histogram(
          "pdserve_decode_spec_acceptance_length",
          "Tokens one speculative verify emitted (accepted drafts + 1)",
          {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16})),
      output_tokens_(r.Counter("pdserve_decode_output_tokens_total",
                               "Output tokens emitted by decode steps")),
      running_(r.Gauge("pdserve_decode_running_requests",
                       "Requests in the running batch")),
      waiting_(r.Gauge("pdserve_decode_waiting_requests",
                       "Requests waiting for (re)admission to the batch")),
      awaiting_kv_(r.Gauge("pdserve_decode_awaiting_kv_requests",
                           "Admitted requests whose prefill KV is in flight")),
      blocks_used_(r.Gauge("pdserve_decode_kv_blocks_used",
                           "KV blocks referenced by requests")),
      blocks_total_(r.Gauge("pdserve_decode_kv_blocks_capacity",
                            "KV blocks of the worker's pool")),
      // The Gateway API Inference Extension's model-server protocol, under
      // the names its endpoint picker (and llm-d's, and KEDA setups written
      // for vLLM) read by default: TotalQueuedRequests, TotalRunningRequests,
      // KVCacheUtilization (0-1; both the current and the older name).
      gateway_waiting_(r.Gauge("vllm:num_requests_waiting",
                               "Requests queued on this worker: waiting for "
                               "the batch or for their prefill's KV "
                               "(inference-extension TotalQueuedRequests)")),
      gateway_running_(r.Gauge("vllm:num_requests_running",
                               "Requests in the running batch "
                               "(inference-extension TotalRunningRequests)")),
      gateway_kv_usage_(r.Gauge("vllm:kv_cache_usage_perc",
                                "KV blocks used / capacity, 0-1 "
                                "(inference-extension KVCacheUtilization)")),
      gateway_kv_usage_legacy_(
          r.Gauge("vllm:gpu_cache_usage_perc",
                  "Same as vllm:kv_cache_usage_perc (the older name)")),
      draining_(r.Gauge("pdserve_decode_draining",
                        "1 while the worker drains (SIGTERM): out of "
                        "rotation, finishing its streams")),
      live_streams_(r.Gauge("pdserve_decode_live_streams",
                            "Streams a client still waits on")),
      blocks_cached_(r.Gauge(
          "pdserve_decode_kv_blocks_cached",
          "Unreferenced KV blocks kept for the prefix cache (evictable)")),
      prefix_queries_(r.Counter("pdserve_decode_prefix_cache_queries_total",
                                "Prefix cache lookups (one per admission)")),
      prefix_query_blocks_(
          r.Counter("pdserve_decode_prefix_cache_query_blocks_total",
                    "Full prompt blocks looked up in the prefix cache")),
      prefix_hit_blocks_(
          r.Counter("pdserve_decode_prefix_cache_hit_blocks_total",
                    "Looked-up blocks served from the prefix cache")),
      spec_verify_steps_(
          r.Counter("pdserve_decode_spec_verify_steps_total",
                    "Per-request verifies of speculative drafts")),
      spec_proposed_(r.Counter("pdserve_decode_spec_proposed_tokens_total",
                               "Draft tokens proposed")),
      spec_accepted_(r.Counter("pdserve_decode_spec_accepted_tokens_total",
                               "Draft tokens accepted by the verifier")),
      spec_emitted_(r.Counter(
          "pdserve_decode_spec_emitted_tokens_total",
          "Tokens emitted by verify steps (accepted drafts + one each)")),
      allreduce_seconds_(r.Counter(
          "pdserve_decode_allreduce_seconds_total",
          "Seconds inside tensor-parallel all-reduces, mean over ranks")),
      kv_staged_bytes_(r.Counter(
          "pdserve_decode_kv_staged_bytes_total",
          "Bytes of prefilled KV copied from host landing pools to the GPUs "
          "(GPU workers; UCX here cannot write GPU memory)")),
      kv_staging_seconds_(r.Counter(
          "pdserve_decode_kv_staging_seconds_total",
          "Seconds the scheduler spent copying prefilled KV to the GPUs")),
      preemptions_(
          r.Counter("pdserve_decode_preemptions_total",
                    "Requests preempted (KV freed, recomputed later)")),
      lease_expiries_(
          r.Counter("pdserve_decode_lease_expiries_total",
                    "Requests freed because their KV did not arrive within the "
                    "lease")),
      expert_routed_(r.CounterFamily(
          "pdserve_decode_expert_routed_tokens_total",
          "Mixtures of experts: (token, expert) pairs routed in this sparse "
          "layer (k per token)")),
      expert_imbalance_(r.GaugeFamily(
          "pdserve_decode_expert_imbalance",
          "Mixtures of experts: the busiest expert's tokens over the mean in "
          "this sparse layer since start (1 = even; what slows expert "
          "parallelism)")) {}

std::function<void(const decode::StepStats&)>
DecodeWorkerMetrics::StepObserver() {
  return [this](const decode::StepStats& s) {
    batch_size_.Observe(s.sequences);
    step_seconds_.Observe(s.seconds);
    step_tokens_.Observe(s.tokens_fed);
    if (s.output_tokens > 0) output_tokens_.Increment(s.output_tokens);
    for (int len : s.acceptance_lengths) acceptance_length_.Observe(len);
  };
}

void DecodeWorkerMetrics::Bind(const decode::DecodeWorker* worker,
                               const DecodeService* service) {
  hook_ = registry_.OnScrape(
      [this, worker, service] { Refresh(*worker, service); });
}

void DecodeWorkerMetrics::Refresh(const decode::DecodeWorker& worker,
                                  const DecodeService* service) {
  const decode::LoadReport load = worker.Load();
  const kv::KvBlockManagerStats kv = worker.block_manager().stats();
  running_.Set(load.running);
  waiting_.Set(load.waiting);
  awaiting_kv_.Set(load.awaiting_kv);
  blocks_used_.Set(static_cast<double>(kv.used_blocks));
  blocks_total_.Set(static_cast<double>(kv.total_blocks));
  blocks_cached_.Set(static_cast<double>(kv.cached_blocks));
  gateway_waiting_.Set(load.waiting + load.awaiting_kv);
  gateway_running_.Set(load.running);
  const double usage = kv.total_blocks > 0
                           ? static_cast<double>(kv.used_blocks) /
                                 static_cast<double>(kv.total_blocks)
                           : 0.0;
  gateway_kv_usage_.Set(usage);
  gateway_kv_usage_legacy_.Set(usage);
  if (service != nullptr) {
    draining_.Set(service->draining() ? 1 : 0);
    live_streams_.Set(static_cast<double>(service->live_streams()));
  }
  SyncCounter(prefix_queries_, static_cast<double>(kv.prefix_queries));
  SyncCounter(prefix_query_blocks_,
              static_cast<double>(kv.prefix_query_blocks));
  SyncCounter(prefix_hit_blocks_, static_cast<double>(kv.prefix_hit_blocks));
  SyncCounter(spec_verify_steps_, static_cast<double>(load.spec_steps));
  SyncCounter(spec_proposed_, static_cast<double>(load.drafted_tokens));
  SyncCounter(spec_accepted_, static_cast<double>(load.accepted_tokens));
  SyncCounter(spec_emitted_, static_cast<double>(load.spec_emitted_tokens));
  SyncCounter(allreduce_seconds_, load.allreduce_seconds);
  SyncCounter(kv_staged_bytes_, static_cast<double>(load.kv_staged_bytes));
  SyncCounter(kv_staging_seconds_, load.kv_staging_seconds);
  SyncCounter(preemptions_, static_cast<double>(load.preemptions));
  for (size_t i = 0; i < load.expert_layers.size(); ++i) {
    const prometheus::Labels layer = {
        {"layer", std::to_string(load.expert_layers[i])}};
    SyncCounter(expert_routed_.Add(layer),
                static_cast<double>(load.expert_routed_tokens[i]));
    expert_imbalance_.Add(layer).Set(load.expert_imbalance[i]);
  }
  // The sink's lease is the one that fires in practice; the worker's own is
  // a backstop. A request is counted by whichever freed it.
  SyncCounter(lease_expiries_,
              static_cast<double>(load.lease_expiries +
                                  (service ? service->lease_expiries() : 0)));
}

}  // namespace pdserve::decode_worker
