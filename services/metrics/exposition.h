// Parsing the Prometheus text exposition format (what /metrics serves, and
// what MetricsRegistry::RenderText produces) into samples, and scraping it
// over HTTP, for tools that read a scrape (tools/layout_report, `pdserve
// plan`, the planner's profile) and for tests.
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

// The body of GET `url` (http://HOST:PORT[/PATH?QUERY], "/" without a path;
// 5 s to connect, 10 s to read). INVALID_ARGUMENT for a URL that is not
// http://; UNAVAILABLE when the GET fails or answers other than 200.
[[nodiscard]] absl::StatusOr<std::string> HttpGet(const std::string& url);

// HttpGet(url) parsed: also INVALID_ARGUMENT (naming the URL) for a body
// that is not exposition text.
[[nodiscard]] absl::StatusOr<std::vector<Sample>> Scrape(
    const std::string& url);

}  // namespace pdserve::metrics
