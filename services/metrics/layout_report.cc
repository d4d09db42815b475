#include "metrics/layout_report.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pdserve::metrics {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

std::string Key(const Sample& s) {
  std::string key = s.name;
  for (const auto& [k, v] : s.labels) absl::StrAppend(&key, "\x1f", k, "=", v);
  return key;
}

// Gauges are read as they are now; everything cumulative (counters,
// histogram parts, uptime) as the change over the window.
bool IsCumulative(const std::string& name) {
  return absl::EndsWith(name, "_total") || absl::EndsWith(name, "_sum") ||
         absl::EndsWith(name, "_count") || absl::EndsWith(name, "_bucket") ||
         name == "pdserve_process_uptime_seconds";
}

class Window {
 public:
  Window(const std::vector<Sample>& after, const std::vector<Sample>& before) {
    std::map<std::string, double> old;
    for (const Sample& s : before) old[Key(s)] = s.value;
    for (Sample s : after) {
      if (IsCumulative(s.name)) {
        auto it = old.find(Key(s));
        // A counter that went down restarted: the new total is the window.
        if (it != old.end() && s.value >= it->second) s.value -= it->second;
      }
      samples_.push_back(std::move(s));
    }
  }
  using Filter = std::function<bool(const Sample&)>;
  double Sum(const std::string& name, const Filter& f = nullptr) const {
    double sum = 0;
    for (const Sample& s : samples_) {
      if (s.name == name && (!f || f(s))) sum += s.value;
    }
    return sum;
  }
  bool Has(const std::string& name) const {
    for (const Sample& s : samples_) {
      if (s.name == name) return true;
    }
    return false;
  }
  const std::vector<Sample>& samples() const { return samples_; }

 private:
  std::vector<Sample> samples_;
};

Window::Filter Where(std::string key, std::string value) {
  return [key, value](const Sample& s) { return s.Label(key) == value; };
}

std::string Pct(double v) {
  return std::isnan(v) ? "n/a" : absl::StrFormat("%.1f%%", 100 * v);
}

void PrefillFindings(const Window& w, LayoutReport* report) {
  // Stages per group (worker_id), busy and idle seconds in the window.
  std::map<std::string, std::map<int, std::pair<double, double>>> groups;
  for (const Sample& s : w.samples()) {
    if (s.Label("role") != "prefill") continue;
    const bool busy = s.name == "pdserve_prefill_stage_busy_seconds_total";
    const bool idle = s.name == "pdserve_prefill_stage_idle_seconds_total";
    if (!busy && !idle) continue;
    auto& stage =
        groups[s.Label("worker_id")][std::atoi(s.Label("stage").c_str())];
    (busy ? stage.first : stage.second) += s.value;
  }
  for (const auto& [group, stages] : groups) {
    double max_busy = 0, sum_busy = 0, sum_idle = 0;
    int busiest = 0, idlest = 0;
    double min_busy = std::numeric_limits<double>::infinity();
    for (const auto& [index, bi] : stages) {
      sum_busy += bi.first;
      sum_idle += bi.second;
      if (bi.first > max_busy) {
        max_busy = bi.first;
        busiest = index;
      }
      if (bi.first < min_busy) {
        min_busy = bi.first;
        idlest = index;
      }
    }
    const double n = static_cast<double>(stages.size());
    const double mean = sum_busy / n;
    Finding imbalance;
    imbalance.topic = absl::StrCat("stage imbalance (", group, ")");
    imbalance.value = mean > 0 ? max_busy / mean : kNaN;
    imbalance.shown =
        mean > 0 ? absl::StrFormat("%.2f (max/mean busy over %d stages)",
                                   imbalance.value, stages.size())
                 : "n/a (no prefill work in the window)";
    if (stages.size() < 2) {
      imbalance.why = "one stage: nothing to balance";
    } else if (mean > 0 && imbalance.value > 1.15) {
      imbalance.knob = "layer split (--layer-split)";
      imbalance.why = absl::StrCat(
          "stage ", busiest, " is ", Pct(imbalance.value - 1),
          " busier than the mean and sets the pipeline's pace; move a layer "
          "from it towards stage ",
          idlest, " (the least busy)");
    } else {
      imbalance.why = "stages are within 15% of each other";
    }
    report->findings.push_back(imbalance);

    const double queue =
        w.Sum("pdserve_prefill_queue_depth", Where("worker_id", group));
    Finding bubble;
    bubble.topic = absl::StrCat("bubble ratio (", group, ")");
    bubble.value =
        sum_busy + sum_idle > 0 ? sum_idle / (sum_busy + sum_idle) : kNaN;
    bubble.shown = absl::StrCat(Pct(bubble.value), " of stage time idle, ",
                                queue, " queued now");
    if (std::isnan(bubble.value)) {
      bubble.why = "no stage time in the window";
    } else if (bubble.value > 0.3 && queue > 0) {
      bubble.knob = "chunk size (--chunk-tokens) / depth (--max-in-flight)";
      bubble.why =
          "stages sit idle while requests queue: smaller chunks (or more "
          "microbatches in flight) fill the pipeline";
    } else if (bubble.value > 0.3) {
      bubble.knob = "P:D ratio";
      bubble.why =
          "stages are idle with nothing queued: the group is under-loaded "
          "(fewer prefill groups would do)";
    } else {
      bubble.why = "stages are busy most of the time";
    }
    report->findings.push_back(bubble);
  }
}

void TransferFinding(const Window& w, LayoutReport* report) {
  Finding f;
  f.topic = "KV transfer share of TTFT";
  const double ttft = w.Sum("pdserve_router_ttft_seconds_sum");
  // A router that measures TTFT but not its phases cannot split it.
  const double phased = w.Sum("pdserve_router_ttft_phase_seconds_count",
                              Where("phase", "kv_transfer"));
  if (ttft > 0 && phased > 0) {
    f.value = w.Sum("pdserve_router_ttft_phase_seconds_sum",
                    Where("phase", "kv_transfer")) /
              ttft;
    f.shown = absl::StrCat(Pct(f.value), " (router TTFT breakdown)");
  } else {
    // No router: compare transfer time with prefill compute time.
    const double xfer = w.Sum("pdserve_prefill_kv_transfer_seconds_sum");
    const double busy = w.Sum("pdserve_prefill_stage_busy_seconds_total");
    f.value = xfer + busy > 0 ? xfer / (xfer + busy) : kNaN;
    f.shown = absl::StrCat(Pct(f.value),
                           " of prefill stage time (no router metrics)");
  }
  const double failures = w.Sum("pdserve_prefill_kv_transfer_failures_total");
  if (failures > 0) absl::StrAppend(&f.shown, ", ", failures, " failed writes");
  if (!std::isnan(f.value) && f.value > 0.2) {
    f.knob = "TP degree / transport";
    f.why =
        "KV writes take a large share of the time to first token (without "
        "router metrics: next to prefill compute): a decode TP "
        "degree above the KV head count replicates heads (more bytes), and a "
        "faster UCX transport (shared memory, RDMA) or per-layer writes "
        "overlap more";
  } else {
    f.why = std::isnan(f.value) ? "no transfers in the window"
                                : "transfer overlaps compute well";
  }
  report->findings.push_back(f);
}

// Requests that waited in the router's admission queue for KV room on a
// decode worker: decode KV is what limits the cluster then.
void AdmissionFinding(const Window& w, LayoutReport* report) {
  const double waited = w.Sum("pdserve_router_admission_wait_seconds_count");
  if (waited <= 0 && !w.Has("pdserve_router_admission_queue_depth")) return;
  Finding f;
  f.topic = "admission queue (decode KV room)";
  const double seconds = w.Sum("pdserve_router_admission_wait_seconds_sum");
  const double e2e = w.Sum("pdserve_router_e2e_seconds_sum");
  f.value = e2e > 0 ? seconds / e2e : kNaN;
  const double depth = w.Sum("pdserve_router_admission_queue_depth");
  f.shown = absl::StrCat(
      waited > 0 ? absl::StrCat(seconds / waited, " s mean wait") : "no waits",
      ", ", depth, " waiting now",
      std::isnan(f.value) ? "" : absl::StrCat(", ", Pct(f.value), " of e2e"));
  if (!std::isnan(f.value) && f.value > 0.1) {
    f.knob = "decode workers / KV memory (--num-blocks) / TP degree";
    f.why =
        "requests spend a large share of their latency waiting for KV room on "
        "a decode worker: more decode workers, more KV blocks per worker "
        "(a larger --num-blocks or a higher TP degree, which spreads the heads "
        "over more memory), or shorter outputs";
  } else {
    f.why = "decode KV is not the bottleneck";
  }
  report->findings.push_back(f);
}

void UtilisationFinding(const Window& w, LayoutReport* report) {
  const double p_busy = w.Sum("pdserve_prefill_stage_busy_seconds_total");
  const double p_idle = w.Sum("pdserve_prefill_stage_idle_seconds_total");
  const double prefill =
      p_busy + p_idle > 0 ? p_busy / (p_busy + p_idle) : kNaN;
  const double d_step = w.Sum("pdserve_decode_step_seconds_sum");
  const double d_up =
      w.Sum("pdserve_process_uptime_seconds", Where("role", "decode"));
  const double decode = d_up > 0 ? std::min(1.0, d_step / d_up) : kNaN;
  Finding f;
  f.topic = "prefill vs decode utilisation (P:D)";
  f.value = prefill / decode;
  f.shown = absl::StrCat("prefill ", Pct(prefill), ", decode ", Pct(decode));
  if (std::isnan(prefill) || std::isnan(decode)) {
    f.why = "needs both prefill and decode metrics";
  } else if (prefill > 0.8 && decode < 0.5) {
    f.knob = "P:D ratio";
    f.why = "prefill is saturated while decode waits: add prefill groups";
  } else if (decode > 0.8 && prefill < 0.5) {
    f.knob = "P:D ratio";
    f.why = "decode is saturated while prefill idles: add decode workers";
  } else {
    f.why = "neither side is saturated while the other idles";
  }
  report->findings.push_back(f);
}

void SpeculationFinding(const Window& w, LayoutReport* report) {
  const double proposed = w.Sum("pdserve_decode_spec_proposed_tokens_total");
  const double accepted = w.Sum("pdserve_decode_spec_accepted_tokens_total");
  const double len_sum = w.Sum("pdserve_decode_spec_acceptance_length_sum");
  const double len_count = w.Sum("pdserve_decode_spec_acceptance_length_count");
  Finding f;
  f.topic = "speculative acceptance";
  f.value = proposed > 0 ? accepted / proposed : kNaN;
  f.shown = proposed > 0
                ? absl::StrFormat("%s of %.0f drafts, %.2f tokens per verify",
                                  Pct(f.value), proposed,
                                  len_count > 0 ? len_sum / len_count : 0.0)
                : "no drafts in the window";
  if (proposed == 0) {
    f.why =
        "speculation is off or every step had more decoding requests than "
        "--spec-max-batch";
  } else if (f.value < 0.3) {
    f.knob = "gamma (--max-gamma) / --speculation";
    f.why = "most drafts are rejected: a verify step costs more than it saves";
  } else if (f.value > 0.7) {
    f.knob = "gamma (--max-gamma)";
    f.why =
        "drafts are mostly accepted: longer drafts would emit more per step";
  } else {
    f.why = "acceptance is in the range the adaptive gamma handles";
  }
  report->findings.push_back(f);
}

void BatchFinding(const Window& w, LayoutReport* report) {
  const double count = w.Sum("pdserve_decode_batch_size_count");
  const double batch =
      count > 0 ? w.Sum("pdserve_decode_batch_size_sum") / count : kNaN;
  const double step_sum = w.Sum("pdserve_decode_step_seconds_sum");
  const double step_n = w.Sum("pdserve_decode_step_seconds_count");
  const double allreduce = w.Sum("pdserve_decode_allreduce_seconds_total");
  const double used = w.Sum("pdserve_decode_kv_blocks_used");
  const double total = w.Sum("pdserve_decode_kv_blocks_capacity");
  const double preempt = w.Sum("pdserve_decode_preemptions_total");
  double tp = 1;
  for (const Sample& s : w.samples()) {
    if (s.Label("role") == "decode")
      tp = std::max(tp, std::atof(s.Label("tp").c_str()));
  }
  Finding f;
  f.topic = "decode batch size";
  f.value = batch;
  const double ar_share = step_sum > 0 ? allreduce / step_sum : 0;
  f.shown = std::isnan(batch)
                ? "no decode steps in the window"
                : absl::StrFormat(
                      "%.2f requests per step, %.2f ms per step, all-reduce "
                      "%s of steps, KV %s used, %.0f preemptions (tp %.0f)",
                      batch, step_n > 0 ? 1000 * step_sum / step_n : 0.0,
                      Pct(ar_share), Pct(total > 0 ? used / total : kNaN),
                      preempt, tp);
  if (std::isnan(batch)) {
    f.why = "no decode traffic";
  } else if (tp > 1 && ar_share > 0.3) {
    f.knob = "TP degree (--tp)";
    f.why =
        "all-reduces take a large share of each step: a lower TP degree with "
        "more decode workers serves the same load with less communication";
  } else if (preempt > 0 || (total > 0 && used / total > 0.9)) {
    f.knob = "TP degree (--tp) / KV memory";
    f.why =
        "KV is nearly full (requests get preempted): a higher TP degree "
        "spreads KV heads over more ranks, or give more --kv-memory-mb";
  } else {
    f.why =
        "batches fit in KV and collectives are cheap; raise --tp only if "
        "TPOT misses its target";
  }
  report->findings.push_back(f);
}

}  // namespace

const Finding* LayoutReport::Find(const std::string& prefix) const {
  for (const Finding& f : findings) {
    if (absl::StartsWith(f.topic, prefix)) return &f;
  }
  return nullptr;
}

std::string LayoutReport::ToText() const {
  std::string out;
  for (const Finding& f : findings) {
    absl::StrAppend(&out, f.topic, ": ", f.shown, "\n");
    absl::StrAppend(&out, "  knob: ", f.knob.empty() ? "none" : f.knob, "\n");
    absl::StrAppend(&out, "  why:  ", f.why, "\n");
  }
  return out;
}

LayoutReport AnalyzeLayout(const std::vector<Sample>& after,
                           const std::vector<Sample>& before) {
  Window w(after, before);
  LayoutReport report;
  PrefillFindings(w, &report);
  TransferFinding(w, &report);
  AdmissionFinding(w, &report);
  UtilisationFinding(w, &report);
  SpeculationFinding(w, &report);
  BatchFinding(w, &report);
  return report;
}

}  // namespace pdserve::metrics
