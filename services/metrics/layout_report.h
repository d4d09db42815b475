// The layout tuning view: reads pdserve metrics (samples of one or more
// processes, e.g. scrapes of every /metrics endpoint or a Prometheus query)
// and derives what the layout knobs act on, each with the knob it suggests
// turning and why:
//   stage imbalance (max/mean busy per prefill group)   -> layer split
//   bubble ratio (idle share of prefill stages)         -> chunk size / depth
//   share of TTFT spent in KV transfer                  -> transport, TP
//   prefill vs decode utilisation                       -> P:D ratio
//   speculative acceptance                              -> gamma
//   decode batch size, all-reduce share, KV use         -> TP degree
// Counters are cumulative: give two snapshots (`before`, `after`) to analyse
// the window between them, or an empty `before` for totals since start.
#pragma once

#include <string>
#include <vector>

#include "metrics/exposition.h"

namespace pdserve::metrics {

struct Finding {
  std::string topic;  // e.g. "stage imbalance (prefill-0)"
  double value = 0;   // the number behind the finding (NaN when unknown)
  std::string shown;  // the value as printed, with units
  std::string knob;   // the knob to turn ("" = leave the layout as is)
  std::string why;
};

struct LayoutReport {
  std::vector<Finding> findings;
  // Human-readable, one block per finding.
  std::string ToText() const;
  // The finding whose topic starts with `prefix`, or null.
  const Finding* Find(const std::string& prefix) const;
};

LayoutReport AnalyzeLayout(const std::vector<Sample>& after,
                           const std::vector<Sample>& before = {});

}  // namespace pdserve::metrics
