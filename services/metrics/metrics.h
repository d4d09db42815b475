// Prometheus metrics for every pdserve process: one MetricsRegistry per
// process whose families all carry the process's layout labels (role,
// worker_id, stage, num_stages, tp), so dashboards can compare layouts, and
// an RAII MetricsServer that serves it as /metrics over HTTP.
//
// Values a component already keeps (a worker's load counters) are copied in
// by scrape hooks, which run on the HTTP thread just before each scrape;
// per-event values (step times, transfer times) are observed directly on
// prometheus-cpp counters/histograms (atomic or a short per-metric lock).
//
// Thread-safety: every method may be called from any thread. Scrape hooks run
// on the MetricsServer's HTTP threads with the registry's hook lock held.
#pragma once

#include <functional>
#include <list>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace httplib {
class Server;
}  // namespace httplib

namespace pdserve::metrics {

// Where a process sits in the cluster layout; stamped on every series. The
// stages of one prefill group share worker_id (the group's name) and differ
// in stage, so (role, worker_id, stage) names one process.
struct Layout {
  std::string role;       // "router", "prefill" or "decode"
  std::string worker_id;  // unique per process within its role
  int stage = 0;          // pipeline stage index (prefill), else 0
  int num_stages = 1;     // pipeline depth of the process's prefill group
  int tp = 1;             // tensor-parallel degree (decode), else 1
};

// "<hostname>-<pid>": unique on one machine, for processes started without
// --worker-id (deployments pass a stable one, e.g. the pod name).
std::string DefaultWorkerId();

// The labels a Layout becomes: role, worker_id, stage, num_stages, tp.
prometheus::Labels LayoutLabels(const Layout& layout);

// Raises a counter to a running total a component keeps itself. A total
// below the counter is ignored: counters never go down (the components'
// totals only grow within a process's life).
void SyncCounter(prometheus::Counter& counter, double total);

class MetricsRegistry : public prometheus::Collectable {
 public:
  explicit MetricsRegistry(Layout layout);
  ~MetricsRegistry() override;
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  const Layout& layout() const { return layout_; }

  // Families named `name` (must start with "pdserve_") carrying the layout
  // labels. Call Add() on a family once per label set and keep the reference:
  // Add() looks the label set up under a lock.
  prometheus::Family<prometheus::Counter>& CounterFamily(
      const std::string& name, const std::string& help);
  prometheus::Family<prometheus::Gauge>& GaugeFamily(const std::string& name,
                                                     const std::string& help);
  prometheus::Family<prometheus::Histogram>& HistogramFamily(
      const std::string& name, const std::string& help);
  // The common case: one unlabelled (beyond the layout) metric.
  prometheus::Counter& Counter(const std::string& name,
                               const std::string& help);
  prometheus::Gauge& Gauge(const std::string& name, const std::string& help);
  prometheus::Histogram& Histogram(const std::string& name,
                                   const std::string& help,
                                   const std::vector<double>& buckets);

  // A hook that runs before every scrape (copies counters a component keeps
  // into gauges/counters). It stays registered while the handle lives; drop
  // the handle before whatever the hook reads is destroyed.
  class HookHandle {
   public:
    HookHandle() = default;
    HookHandle(HookHandle&& other) noexcept;
    HookHandle& operator=(HookHandle&& other) noexcept;
    ~HookHandle();

   private:
    friend class MetricsRegistry;
    using Hooks = std::list<std::function<void()>>;
    HookHandle(MetricsRegistry* registry, Hooks::iterator it)
        : registry_(registry), it_(it) {}
    void Reset();
    MetricsRegistry* registry_ = nullptr;
    Hooks::iterator it_;
  };
  [[nodiscard]] HookHandle OnScrape(std::function<void()> hook);

  // prometheus::Collectable: runs the hooks, then collects every family.
  std::vector<prometheus::MetricFamily> Collect() const override;

  // Runs the hooks and renders the text exposition format (what /metrics
  // serves); for tools and tests that need no HTTP.
  std::string RenderText() const;

 private:
  const Layout layout_;
  const prometheus::Labels labels_;
  const std::shared_ptr<prometheus::Registry> registry_;
  const absl::Time start_ = absl::Now();
  // pdserve_process_uptime_seconds: the wall clock every rate is relative to
  // (the layout report divides busy seconds by it).
  prometheus::Gauge* uptime_ = nullptr;
  mutable absl::Mutex hooks_mu_;
  HookHandle::Hooks hooks_ ABSL_GUARDED_BY(hooks_mu_);
};

// Buckets used across pdserve (fixed at creation, so series stay comparable
// between processes and layouts).
// Latencies from 0.5 ms to ~65 s, doubling.
std::vector<double> LatencyBuckets();
// Counts 1, 2, 4, ... 4096 (batch sizes, tokens per microbatch).
std::vector<double> CountBuckets(double max = 4096);

// Serves a registry on http://host:port/metrics. Port 0 picks a free port
// (port() tells which). The registry must outlive the server.
class MetricsServer {
 public:
  // `host` is a numeric IPv4 or IPv6 address (0.0.0.0 or :: = every
  // interface). INVALID_ARGUMENT for a bad host or port, UNAVAILABLE naming
  // the address and the reason (e.g. "Address already in use") when it
  // cannot listen. With a `port_file`, the bound "host:port" is written there
  // (atomically) once serving, for launchers that started it on port 0.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const std::string& host, int port,
      std::shared_ptr<MetricsRegistry> registry,
      const std::string& port_file = "");
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  int port() const { return port_; }
  // "host:port" as bound, "[host]:port" for IPv6 (the URL is
  // http://<address>/metrics).
  std::string address() const;

 private:
  MetricsServer(std::string host, std::shared_ptr<MetricsRegistry> registry);
  const std::string host_;
  int port_ = 0;
  const std::shared_ptr<MetricsRegistry> registry_;
  std::unique_ptr<httplib::Server> http_;
  std::thread listener_;  // runs http_'s accept loop
};

}  // namespace pdserve::metrics
