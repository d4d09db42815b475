// layout_report: the layout tuning view of a running pdserve cluster.
//
//   layout_report --metrics http://H:P/metrics,http://H:P/metrics,...
//                 [--interval 10]      scrape twice, analyse the window
//   layout_report --prometheus http://H:9090 [--window 5m]
//                                      query every pdserve_ series now and
//                                      one window ago, analyse the change
//
// Prints each finding (stage imbalance, bubble ratio, KV transfer share of
// TTFT, prefill vs decode utilisation, speculative acceptance, decode batch
// size) with the knob it suggests turning and why (metrics/layout_report.h).
// `--interval 0` analyses totals since the processes started; `layout_report
// --help` lists every flag with its default and meaning.
#include "metrics/layout_report.h"

#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/command_line_flags.h"
#include "httplib.h"
#include "metrics/exposition.h"
#include "nlohmann/json.hpp"

namespace pdserve {
namespace {

absl::StatusOr<std::vector<metrics::Sample>> ScrapeAll(
    const std::vector<std::string>& urls) {
  std::vector<metrics::Sample> all;
  for (const std::string& url : urls) {
    auto samples = metrics::Scrape(url);
    if (!samples.ok()) return samples.status();
    all.insert(all.end(), samples->begin(), samples->end());
  }
  return all;
}

// Every pdserve_ series at `time` through the Prometheus HTTP API.
absl::StatusOr<std::vector<metrics::Sample>> QueryPrometheus(
    const std::string& base, absl::Time time) {
  const std::string url = absl::StrCat(
      base, "/api/v1/query?query=",
      httplib::detail::encode_query_param("{__name__=~\"pdserve_.+\"}"),
      "&time=", absl::StrCat(absl::ToUnixSeconds(time)));
  auto body = metrics::HttpGet(url);
  if (!body.ok()) return body.status();
  auto json = nlohmann::json::parse(*body, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || json.value("status", "") != "success") {
    return absl::UnavailableError(
        absl::StrCat("Prometheus query failed: ", body->substr(0, 200)));
  }
  std::vector<metrics::Sample> samples;
  for (const auto& r : json["data"]["result"]) {
    metrics::Sample s;
    for (const auto& [k, v] : r["metric"].items()) {
      if (k == "__name__") {
        s.name = v.get<std::string>();
      } else {
        s.labels[k] = v.get<std::string>();
      }
    }
    if (!absl::SimpleAtod(r["value"][1].get<std::string>(), &s.value)) continue;
    samples.push_back(std::move(s));
  }
  return samples;
}

constexpr char kSynopsis[] =
    "layout_report --metrics http://H:P/metrics,... [--interval 10]\n"
    "       layout_report --prometheus http://H:9090 [--window 5m]\n"
    "The layout tuning view of a running pdserve cluster: each finding (stage "
    "imbalance, bubble ratio, KV transfer share of TTFT, prefill vs decode "
    "utilisation, speculative acceptance, decode batch size) with the knob "
    "it suggests turning and why.\n";

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "layout_report: %s\n", s.ToString().c_str());
  return 1;
}

int Main(int argc, char** argv) {
  CommandLineFlags flags;
  if (auto s = flags.Parse(argc, argv); !s.ok()) return Fail(s);
  flags.Group("Scrape");
  const std::string urls_text =
      flags.Str("metrics", "",
                "/metrics URLs of the cluster's processes, comma-separated "
                "(http://H:P/metrics,...).");
  const double interval_s = flags.Num<double>(
      "interval", 10,
      "With --metrics: seconds between the two scrapes analysed; 0: totals "
      "since the processes started.");
  flags.Group("Prometheus");
  const std::string prometheus = flags.Str(
      "prometheus", "",
      "Prometheus base URL (http://H:9090) to query instead of --metrics.");
  const std::string window_text = flags.Str(
      "window", "5m",
      "With --prometheus: the window analysed, ending now (5m, 1h, 30s).");
  if (flags.help_requested()) {
    std::fputs(flags.Usage(kSynopsis).c_str(), stdout);
    return 0;
  }
  if (auto s = flags.Check(); !s.ok()) return Fail(s);
  if (urls_text.empty() == prometheus.empty()) {
    return Fail(absl::InvalidArgumentError(
        "give --metrics URL,... or --prometheus URL (one of them)"));
  }
  std::vector<metrics::Sample> before, after;
  if (!prometheus.empty()) {
    absl::Duration window;
    if (!absl::ParseDuration(window_text, &window) ||
        window <= absl::ZeroDuration())
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("--window '", window_text, "' is not a duration")));
    const absl::Time now = absl::Now();
    auto a = QueryPrometheus(prometheus, now);
    if (!a.ok()) return Fail(a.status());
    auto b = QueryPrometheus(prometheus, now - window);
    if (!b.ok()) return Fail(b.status());
    after = std::move(*a);
    before = std::move(*b);
    std::printf("window: %s (Prometheus %s)\n\n", window_text.c_str(),
                prometheus.c_str());
  } else {
    std::vector<std::string> urls = absl::StrSplit(urls_text, ',');
    if (interval_s > 0) {
      auto b = ScrapeAll(urls);
      if (!b.ok()) return Fail(b.status());
      before = std::move(*b);
      absl::SleepFor(absl::Seconds(interval_s));
    }
    auto a = ScrapeAll(urls);
    if (!a.ok()) return Fail(a.status());
    after = std::move(*a);
    if (interval_s > 0) {
      std::printf("window: %gs over %zu endpoints\n\n", interval_s,
                  urls.size());
    } else {
      std::printf("totals since start over %zu endpoints\n\n", urls.size());
    }
  }
  std::printf("%s", metrics::AnalyzeLayout(after, before).ToText().c_str());
  return 0;
}

}  // namespace
}  // namespace pdserve

int main(int argc, char** argv) { return pdserve::Main(argc, argv); }
