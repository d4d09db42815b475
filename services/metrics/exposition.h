// Parsing the Prometheus text exposition format (what /metrics serves, and
// what MetricsRegistry::RenderText produces) into samples, for tools that
// read a scrape (tools/layout_report) and for tests.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pdserve::metrics {

struct Sample {
  std::string name;  // with any _bucket/_sum/_count suffix
  std::map<std::string, std::string> labels;
  double value = 0;

  // The label's value, or "" when absent.
  std::string Label(const std::string& key) const;
};

// INVALID_ARGUMENT naming the line for a malformed sample line; comments
// (# HELP, # TYPE) and blank lines are skipped.
[[nodiscard]] absl::StatusOr<std::vector<Sample>> ParseExposition(
    absl::string_view text);

}  // namespace pdserve::metrics
