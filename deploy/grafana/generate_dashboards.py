#!/usr/bin/env python3
"""Writes the Grafana dashboards in dashboards/ (the JSON is what ships;
edit this file and rerun it rather than editing the JSON by hand).

Every expression reads only families pdserve exports (services/metrics/
README.md); tests/metrics/cluster_metrics_test.cc runs each one against a
real Prometheus scraping real workers. $__rate_interval is Grafana's.
"""
import json
import os
import sys

DS = {"type": "prometheus", "uid": "prometheus"}
R = "$__rate_interval"
KV_SEL = '{phase="kv_transfer"}'


def rate(m, by=None):
    s = f"rate({m}[{R}])"
    return f"sum by ({by}) ({s})" if by else f"sum({s})"


def quantile(q, hist, by="", sel=""):
    by_le = f"le, {by}" if by else "le"
    return (f"histogram_quantile({q}, sum by ({by_le}) "
            f"(rate({hist}_bucket{sel}[{R}])))")


def mean(hist, by=None):
    return f"{rate(hist + '_sum', by)} / {rate(hist + '_count', by)}"


class Dashboard:
    def __init__(self, uid, title, description):
        self.uid, self.title, self.description = uid, title, description
        self.panels = []
        self.y = 0
        self.x = 0

    def row(self, title):
        if self.x:
            self.y += 8
            self.x = 0
        self.panels.append({"type": "row", "title": title, "collapsed": False,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
                            "id": len(self.panels) + 1, "panels": []})
        self.y += 1

    def panel(self, title, targets, unit="short", kind="timeseries",
              description="", stack=False, w=12):
        if self.x + w > 24:
            self.y += 8
            self.x = 0
        p = {
            "type": kind, "title": title, "description": description,
            "datasource": DS, "id": len(self.panels) + 1,
            "gridPos": {"h": 8, "w": w, "x": self.x, "y": self.y},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "table",
                                   "placement": "bottom"}},
            "targets": [{"datasource": DS, "expr": e, "legendFormat": l,
                         "refId": chr(ord("A") + i)}
                        for i, (e, l) in enumerate(targets)],
        }
        if stack:
            p["fieldConfig"]["defaults"]["custom"] = {
                "stacking": {"mode": "normal"}, "fillOpacity": 40}
        self.panels.append(p)
        self.x += w

    def write(self, path):
        doc = {
            "uid": self.uid, "title": self.title,
            "description": self.description, "tags": ["pdserve"],
            "schemaVersion": 38, "version": 1, "editable": True,
            "time": {"from": "now-30m", "to": "now"}, "refresh": "10s",
            "templating": {"list": []}, "annotations": {"list": []},
            "panels": self.panels,
        }
        with open(path, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")


def overview():
    d = Dashboard("pdserve-overview", "pdserve / Overview",
                  "SLOs, throughput and time to first token broken down")
    d.row("SLOs (router)")
    d.panel("Time to first token", [
        (quantile(0.5, "pdserve_router_ttft_seconds"), "p50"),
        (quantile(0.95, "pdserve_router_ttft_seconds"), "p95"),
        (quantile(0.99, "pdserve_router_ttft_seconds"), "p99")], "s")
    d.panel("Time per output token", [
        (quantile(0.5, "pdserve_router_tpot_seconds"), "TPOT p50"),
        (quantile(0.95, "pdserve_router_tpot_seconds"), "TPOT p95"),
        (quantile(0.95, "pdserve_router_itl_seconds"), "inter-token p95")],
        "s")
    d.panel("End-to-end latency", [
        (quantile(0.5, "pdserve_router_e2e_seconds"), "p50"),
        (quantile(0.95, "pdserve_router_e2e_seconds"), "p95")], "s")
    d.panel("Requests by API and status", [
        (rate("pdserve_router_requests_total", "api, code"),
         "{{api}} {{code}}")], "reqps")
    d.row("Time to first token, broken down")
    d.panel("Mean TTFT by phase (stacked)", [
        (mean("pdserve_router_ttft_phase_seconds", "phase"), "{{phase}}")],
        "s", stack=True,
        description="queue: until a prefill group was picked; prefill: "
        "chunked prefill to the first token; kv_transfer: KV writes landed "
        "and KvComplete accepted; first_step: token 0 reaching the router")
    d.panel("KV transfer share of TTFT", [
        (rate("pdserve_router_ttft_phase_seconds_sum" + KV_SEL) + " / " +
         rate("pdserve_router_ttft_seconds_sum"), "share")],
        "percentunit")
    d.row("Throughput and load")
    d.panel("Tokens per second", [
        (rate("pdserve_router_output_tokens_total"), "output (router)"),
        (rate("pdserve_router_prompt_tokens_total"), "prompt (router)"),
        (rate("pdserve_decode_output_tokens_total"), "output (decode steps)"),
        (f"sum(rate(pdserve_prefill_tokens_total{{stage=\"0\"}}[{R}]))",
         "prefilled (stage 0)")], "short")
    d.panel("In flight and queued", [
        ("sum(pdserve_router_in_flight_requests)", "router in flight"),
        ("sum(pdserve_router_queued_requests)", "router queued"),
        ("sum(pdserve_router_admission_queue_depth)",
         "waiting for KV room (router)"),
        ("sum(pdserve_prefill_queue_depth)", "prefill queued"),
        ("sum(pdserve_decode_running_requests)", "decode running")])
    d.panel("Admission queue wait", [
        (quantile(0.5, "pdserve_router_admission_wait_seconds"), "p50"),
        (quantile(0.99, "pdserve_router_admission_wait_seconds"), "p99")],
        "s",
        description="Time requests waited in the router's line for KV room "
        "on a decode worker (arrival order): decode KV is the bottleneck "
        "when this grows")
    d.panel("Routing decisions", [
        (rate("pdserve_router_routing_decisions_total", "policy, side, worker"),
         "{{side}} {{worker}} ({{policy}})")], "ops")
    d.panel("Retries", [
        (rate("pdserve_router_retries_total", "side"), "{{side}}")], "ops")
    d.panel("Utilisation by role and layout", [
        (f"sum by (worker_id, num_stages) (rate(pdserve_prefill_stage_busy_seconds_total[{R}])) / "
         f"count by (worker_id, num_stages) (pdserve_prefill_stage_busy_seconds_total)",
         "prefill {{worker_id}} (S={{num_stages}})"),
        (f"sum by (worker_id, tp) (rate(pdserve_decode_step_seconds_sum[{R}]))",
         "decode {{worker_id}} (TP={{tp}})")], "percentunit",
        description="Mean busy share of a prefill group's stages vs the "
        "share of wall time a decode worker spends in steps: the P:D view")
    d.row("Layout planner (router --planner-perf-model)")
    d.panel("Recommended layout", [
        ("max by (layout, local_flags) (pdserve_planner_recommended_layout)",
         "{{layout}}")],
        description="The layout the planner predicts serves the observed "
        "workload best under its SLO (the series' local_flags label holds "
        "the pdserve local flags; pdserve plan prints the Kubernetes values)")
    d.panel("Predicted p99 of the recommended layout", [
        ("max(pdserve_planner_predicted_ttft_p99_seconds)", "TTFT p99"),
        ("max(pdserve_planner_predicted_tpot_p99_seconds)", "TPOT p99")],
        "s")
    d.panel("Capacity vs observed rate", [
        ("max(pdserve_planner_capacity_requests_per_second)",
         "capacity (95% within SLO)"),
        ("max(pdserve_planner_observed_request_rate)", "observed")], "reqps")
    d.panel("Headroom and desired replicas", [
        ("max(pdserve_planner_headroom_ratio)", "headroom (capacity / rate)"),
        ("max(pdserve_planner_desired_replicas)", "desired replicas"),
        ("max(pdserve_planner_layout_nodes)", "nodes per replica")],
        description="desired replicas = ceil(rate / capacity): what an HPA "
        "on this External metric with averageValue 1 scales to "
        "(deploy/README.md); each replica of the layout spans the nodes "
        "shown (router --planner-nodes)")
    return d


def prefill():
    d = Dashboard("pdserve-prefill", "pdserve / Prefill pipeline",
                  "Per-stage busy and bubble time, chunks, queue")
    d.row("Stages")
    d.panel("Busy share per stage", [
        (rate("pdserve_prefill_stage_busy_seconds_total", "worker_id, stage"),
         "{{worker_id}} stage {{stage}}")], "percentunit")
    d.panel("Bubble (idle) share per stage", [
        (f"{rate('pdserve_prefill_stage_idle_seconds_total', 'worker_id, stage')} / "
         f"({rate('pdserve_prefill_stage_idle_seconds_total', 'worker_id, stage')} + "
         f"{rate('pdserve_prefill_stage_busy_seconds_total', 'worker_id, stage')})",
         "{{worker_id}} stage {{stage}}")], "percentunit")
    d.panel("Stage imbalance (max / mean busy)", [
        (f"max by (worker_id) (rate(pdserve_prefill_stage_busy_seconds_total[{R}])) / "
         f"avg by (worker_id) (rate(pdserve_prefill_stage_busy_seconds_total[{R}]))",
         "{{worker_id}}")], "short",
        description="1 = balanced; above ~1.15 move a layer off the busiest "
        "stage (--layer-split)")
    d.panel("Chunk compute seconds per stage", [
        (quantile(0.5, "pdserve_prefill_chunk_seconds", "worker_id, stage"),
         "p50 {{worker_id}} stage {{stage}}"),
        (quantile(0.95, "pdserve_prefill_chunk_seconds", "worker_id, stage"),
         "p95 {{worker_id}} stage {{stage}}")], "s")
    d.panel("Microbatch tokens", [
        (mean("pdserve_prefill_microbatch_tokens", "worker_id, stage"),
         "mean {{worker_id}} stage {{stage}}"),
        (quantile(0.95, "pdserve_prefill_microbatch_tokens", "worker_id"),
         "p95 {{worker_id}}")])
    d.panel("Prefill tokens per second per stage", [
        (rate("pdserve_prefill_tokens_total", "worker_id, stage"),
         "{{worker_id}} stage {{stage}}"),
        # Scored prompt tokens (echo + logprobs) on the last stage: their
        # share of the tokens is the --scored-share to split the layers for.
        (rate("pdserve_prefill_scored_tokens_total", "worker_id"),
         "scored (echo + logprobs) {{worker_id}}")])
    d.row("Group (stage 0)")
    d.panel("Queue depth and in flight", [
        ("sum by (worker_id) (pdserve_prefill_queue_depth)", "queued {{worker_id}}"),
        ("sum by (worker_id) (pdserve_prefill_in_flight_requests)",
         "in flight {{worker_id}}")])
    d.panel("Requests", [
        (rate("pdserve_prefill_requests_completed_total", "worker_id"),
         "completed {{worker_id}}"),
        (rate("pdserve_prefill_requests_failed_total", "worker_id"),
         "failed {{worker_id}}"),
        (rate("pdserve_prefill_stage_failures_total", "worker_id, stage"),
         "failed microbatches {{worker_id}} stage {{stage}}")], "reqps")
    d.panel("KV blocks (group-wide)", [
        ("sum by (worker_id) (pdserve_prefill_kv_blocks_used)", "used {{worker_id}}"),
        ("sum by (worker_id) (pdserve_prefill_kv_blocks_capacity)", "total {{worker_id}}")])
    d.panel("Prefix reuse and health", [
        (rate("pdserve_prefill_cached_tokens_total", "worker_id"),
         "cached tokens/s {{worker_id}}"),
        ("min by (worker_id) (pdserve_prefill_group_serving)",
         "serving {{worker_id}}")])
    return d


def decode():
    d = Dashboard("pdserve-decode", "pdserve / Decode",
                  "Batching, TP and speculation")
    d.row("Batching")
    d.panel("Batch size", [
        (mean("pdserve_decode_batch_size", "worker_id, tp"),
         "mean {{worker_id}} (TP={{tp}})"),
        (quantile(0.95, "pdserve_decode_batch_size", "worker_id"),
         "p95 {{worker_id}}")])
    d.panel("Step seconds", [
        (quantile(0.5, "pdserve_decode_step_seconds", "worker_id, tp"),
         "p50 {{worker_id}} (TP={{tp}})"),
        (quantile(0.95, "pdserve_decode_step_seconds", "worker_id, tp"),
         "p95 {{worker_id}} (TP={{tp}})")], "s")
    d.panel("Tokens per step", [
        (mean("pdserve_decode_step_tokens", "worker_id"), "{{worker_id}}")])
    d.panel("Requests", [
        ("sum by (worker_id) (pdserve_decode_running_requests)", "running {{worker_id}}"),
        ("sum by (worker_id) (pdserve_decode_waiting_requests)", "waiting {{worker_id}}"),
        ("sum by (worker_id) (pdserve_decode_awaiting_kv_requests)",
         "awaiting KV {{worker_id}}")])
    d.panel("Output tokens per second", [
        (rate("pdserve_decode_output_tokens_total", "worker_id, tp"),
         "{{worker_id}} (TP={{tp}})")])
    d.row("KV and prefix cache")
    d.panel("KV blocks", [
        ("sum by (worker_id) (pdserve_decode_kv_blocks_used)", "used {{worker_id}}"),
        ("sum by (worker_id) (pdserve_decode_kv_blocks_cached)", "cached {{worker_id}}"),
        ("sum by (worker_id) (pdserve_decode_kv_blocks_capacity)", "total {{worker_id}}")])
    d.panel("Prefix cache hit ratio (blocks)", [
        (f"{rate('pdserve_decode_prefix_cache_hit_blocks_total', 'worker_id')} / "
         f"{rate('pdserve_decode_prefix_cache_query_blocks_total', 'worker_id')}",
         "{{worker_id}}"),
        (rate("pdserve_decode_prefix_cache_queries_total", "worker_id"),
         "lookups/s {{worker_id}}")], "percentunit")
    d.panel("Preemptions and lease expiries", [
        (rate("pdserve_decode_preemptions_total", "worker_id"),
         "preemptions {{worker_id}}"),
        (rate("pdserve_decode_lease_expiries_total", "worker_id"),
         "lease expiries {{worker_id}}")], "ops")
    d.row("Tensor parallelism and speculation")
    d.panel("All-reduce share of step time", [
        (f"{rate('pdserve_decode_allreduce_seconds_total', 'worker_id, tp')} / "
         f"{rate('pdserve_decode_step_seconds_sum', 'worker_id, tp')}",
         "{{worker_id}} (TP={{tp}})")], "percentunit")
    d.panel("Speculative acceptance rate", [
        (f"{rate('pdserve_decode_spec_accepted_tokens_total', 'worker_id')} / "
         f"{rate('pdserve_decode_spec_proposed_tokens_total', 'worker_id')}",
         "{{worker_id}}")], "percentunit")
    d.panel("Acceptance length (tokens per verify)", [
        (mean("pdserve_decode_spec_acceptance_length", "worker_id"),
         "mean {{worker_id}}"),
        (f"{rate('pdserve_decode_spec_emitted_tokens_total', 'worker_id')} / "
         f"{rate('pdserve_decode_spec_verify_steps_total', 'worker_id')}",
         "emitted per verify {{worker_id}}")])
    d.panel("Draft tokens per second", [
        (rate("pdserve_decode_spec_proposed_tokens_total", "worker_id"),
         "proposed {{worker_id}}"),
        (rate("pdserve_decode_spec_accepted_tokens_total", "worker_id"),
         "accepted {{worker_id}}")])
    return d


def kv_transfer():
    d = Dashboard("pdserve-kv-transfer", "pdserve / KV transfer",
                  "Prefill stages writing KV into decode workers over UCX")
    d.row("Transfers")
    d.panel("KV bytes per second by stage", [
        (rate("pdserve_prefill_kv_bytes_written_total", "worker_id, stage"),
         "{{worker_id}} stage {{stage}}")], "Bps")
    d.panel("KV write seconds (issue to landed)", [
        (quantile(0.5, "pdserve_prefill_kv_transfer_seconds", "worker_id, stage"),
         "p50 {{worker_id}} stage {{stage}}"),
        (quantile(0.95, "pdserve_prefill_kv_transfer_seconds", "worker_id, stage"),
         "p95 {{worker_id}} stage {{stage}}")], "s")
    d.panel("Failed KV writes", [
        (rate("pdserve_prefill_kv_transfer_failures_total", "worker_id, stage"),
         "{{worker_id}} stage {{stage}}")], "ops")
    d.panel("Writes per second", [
        (rate("pdserve_prefill_kv_transfer_seconds_count", "worker_id, stage"),
         "{{worker_id}} stage {{stage}}")], "ops")
    d.row("Effect on requests")
    d.panel("KV transfer phase of TTFT (router)", [
        (quantile(0.5, "pdserve_router_ttft_phase_seconds", sel=KV_SEL), "p50"),
        (quantile(0.95, "pdserve_router_ttft_phase_seconds", sel=KV_SEL),
         "p95")],
        "s")
    d.panel("Decode side: waiting for KV, lease expiries", [
        ("sum by (worker_id) (pdserve_decode_awaiting_kv_requests)",
         "awaiting KV {{worker_id}}"),
        (rate("pdserve_decode_lease_expiries_total", "worker_id"),
         "lease expiries/s {{worker_id}}")])
    d.row("Host staging on GPU workers (UCX without CUDA transports)")
    d.panel("KV staged through host memory, bytes per second", [
        (rate("pdserve_prefill_kv_mirror_bytes_total", "worker_id, stage"),
         "prefill GPU->host {{worker_id}} stage {{stage}}"),
        (rate("pdserve_decode_kv_staged_bytes_total", "worker_id"),
         "decode host->GPU {{worker_id}}")], "Bps")
    d.panel("Share of time spent staging", [
        (f"{rate('pdserve_prefill_kv_mirror_seconds_total', 'worker_id, stage')} / "
         f"{rate('pdserve_prefill_stage_busy_seconds_total', 'worker_id, stage')}",
         "prefill {{worker_id}} stage {{stage}} (of busy)"),
        (f"{rate('pdserve_decode_kv_staging_seconds_total', 'worker_id')} / "
         f"{rate('pdserve_decode_step_seconds_sum', 'worker_id')}",
         "decode {{worker_id}} (vs step time)")], "percentunit")
    return d


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    # An output folder other than dashboards/ lets a test compare the two.
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "dashboards")
    os.makedirs(out, exist_ok=True)
    for name, d in [("overview", overview()), ("prefill", prefill()),
                    ("decode", decode()), ("kv-transfer", kv_transfer())]:
        d.write(os.path.join(out, f"pdserve-{name}.json"))


if __name__ == "__main__":
    main()
