#include "metrics/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "httplib.h"
#include "process/port_file.h"
#include "prometheus/text_serializer.h"

namespace pdserve::metrics {

std::string DefaultWorkerId() {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "localhost");
  return absl::StrCat(host, "-", getpid());
}

prometheus::Labels LayoutLabels(const Layout& layout) {
  return {{"role", layout.role},
          {"worker_id", layout.worker_id},
          {"stage", absl::StrCat(layout.stage)},
          {"num_stages", absl::StrCat(layout.num_stages)},
          {"tp", absl::StrCat(layout.tp)}};
}

void SyncCounter(prometheus::Counter& counter, double total) {
  const double now = counter.Value();
  if (total > now) counter.Increment(total - now);
}

std::vector<double> LatencyBuckets() {
  std::vector<double> b;
  for (double v = 0.0005; v < 70; v *= 2) b.push_back(v);
  return b;
}

std::vector<double> CountBuckets(double max) {
  std::vector<double> b;
  for (double v = 1; v <= max; v *= 2) b.push_back(v);
  return b;
}

// ---- MetricsRegistry
// ---------------------------------------------------------

MetricsRegistry::MetricsRegistry(Layout layout)
    : layout_(std::move(layout)),
      labels_(LayoutLabels(layout_)),
      registry_(std::make_shared<prometheus::Registry>()) {
  uptime_ = &Gauge("pdserve_process_uptime_seconds",
                   "Seconds since the process's metrics registry was made");
}

MetricsRegistry::~MetricsRegistry() = default;

namespace {
// The Gateway API Inference Extension's model-server gauges under the names
// its endpoint picker reads by default (vLLM's): exported beside pdserve's
// own so gateways and autoscalers written for that protocol need no adapter.
// The only families outside the pdserve_ prefix.
constexpr const char* kModelServerProtocolNames[] = {
    "vllm:num_requests_waiting", "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"};

void CheckName(const std::string& name) {
  // A misnamed family is a programming error, caught by every test that
  // builds the registry.
  if (absl::StartsWith(name, "pdserve_")) return;
  for (const char* allowed : kModelServerProtocolNames) {
    if (name == allowed) return;
  }
  std::fprintf(stderr, "metric %s must start with pdserve_\n", name.c_str());
  std::abort();
}
}  // namespace

prometheus::Family<prometheus::Counter>& MetricsRegistry::CounterFamily(
    const std::string& name, const std::string& help) {
  CheckName(name);
  return prometheus::BuildCounter()
      .Name(name)
      .Help(help)
      .Labels(labels_)
      .Register(*registry_);
}

prometheus::Family<prometheus::Gauge>& MetricsRegistry::GaugeFamily(
    const std::string& name, const std::string& help) {
  CheckName(name);
  return prometheus::BuildGauge()
      .Name(name)
      .Help(help)
      .Labels(labels_)
      .Register(*registry_);
}

prometheus::Family<prometheus::Histogram>& MetricsRegistry::HistogramFamily(
    const std::string& name, const std::string& help) {
  CheckName(name);
  return prometheus::BuildHistogram()
      .Name(name)
      .Help(help)
      .Labels(labels_)
      .Register(*registry_);
}

prometheus::Counter& MetricsRegistry::Counter(const std::string& name,
                                              const std::string& help) {
  return CounterFamily(name, help).Add({});
}

prometheus::Gauge& MetricsRegistry::Gauge(const std::string& name,
                                          const std::string& help) {
  return GaugeFamily(name, help).Add({});
}

prometheus::Histogram& MetricsRegistry::Histogram(
    const std::string& name, const std::string& help,
    const std::vector<double>& buckets) {
  return HistogramFamily(name, help).Add({}, buckets);
}

MetricsRegistry::HookHandle MetricsRegistry::OnScrape(
    std::function<void()> hook) {
  absl::MutexLock lock(&hooks_mu_);
  hooks_.push_back(std::move(hook));
  return HookHandle(this, std::prev(hooks_.end()));
}

MetricsRegistry::HookHandle::HookHandle(HookHandle&& other) noexcept
    : registry_(std::exchange(other.registry_, nullptr)), it_(other.it_) {}

MetricsRegistry::HookHandle& MetricsRegistry::HookHandle::operator=(
    HookHandle&& other) noexcept {
  if (this != &other) {
    Reset();
    registry_ = std::exchange(other.registry_, nullptr);
    it_ = other.it_;
  }
  return *this;
}

MetricsRegistry::HookHandle::~HookHandle() { Reset(); }

void MetricsRegistry::HookHandle::Reset() {
  if (registry_ == nullptr) return;
  // Waits for a scrape running the hook: it never runs after this returns.
  absl::MutexLock lock(&registry_->hooks_mu_);
  registry_->hooks_.erase(it_);
  registry_ = nullptr;
}

std::vector<prometheus::MetricFamily> MetricsRegistry::Collect() const {
  uptime_->Set(absl::ToDoubleSeconds(absl::Now() - start_));
  {
    absl::MutexLock lock(&hooks_mu_);
    for (const auto& hook : hooks_) hook();
  }
  return registry_->Collect();
}

std::string MetricsRegistry::RenderText() const {
  return prometheus::TextSerializer().Serialize(Collect());
}

// ---- MetricsServer
// -----------------------------------------------------------
//
// /metrics is served by cpp-httplib (as the router's OpenAI API), not by
// prometheus-cpp's civetweb exposer: civetweb starts its threads with a fixed
// 100 KiB stack, and a binary that links the CUDA libraries carries more
// static TLS than that (cuBLASLt alone ~94 KiB), so pthread_create failed
// with EINVAL and no CUDA-enabled worker could export metrics. httplib's
// threads get the default stack.

namespace {

// httplib's bind only says "failed"; bind a probe socket first so the error
// names the reason (address in use, no such address, permission).
absl::Status ProbeBind(const std::string& host, int port) {
  sockaddr_storage addr{};
  socklen_t len = 0;
  int family = AF_INET;
  if (auto* a4 = reinterpret_cast<sockaddr_in*>(&addr);
      inet_pton(AF_INET, host.c_str(), &a4->sin_addr) == 1) {
    a4->sin_family = AF_INET;
    a4->sin_port = htons(static_cast<uint16_t>(port));
    len = sizeof(sockaddr_in);
  } else if (auto* a6 = reinterpret_cast<sockaddr_in6*>(&addr);
             inet_pton(AF_INET6, host.c_str(), &a6->sin6_addr) == 1) {
    family = AF_INET6;
    a6->sin6_family = AF_INET6;
    a6->sin6_port = htons(static_cast<uint16_t>(port));
    len = sizeof(sockaddr_in6);
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics host '", host, "' is not a numeric IPv4 or IPv6 address"));
  }
  const int fd = socket(family, SOCK_STREAM, 0);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("metrics: cannot listen on ", host, ":", port,
                     ": socket(): ", std::strerror(errno)));
  }
  // httplib sets SO_REUSEADDR too, so a port in TIME_WAIT is no error.
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const int rc = bind(fd, reinterpret_cast<sockaddr*>(&addr), len);
  const int err = errno;
  close(fd);
  if (rc != 0) {
    return absl::UnavailableError(absl::StrCat("metrics: cannot listen on ",
                                               host, ":", port, ": ",
                                               std::strerror(err)));
  }
  return absl::OkStatus();
}

// The Prometheus text exposition format's media type.
constexpr char kExpositionContentType[] =
    "text/plain; version=0.0.4; charset=utf-8";

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& host, int port,
    std::shared_ptr<MetricsRegistry> registry, const std::string& port_file) {
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics port ", port, " is not in [0, 65535]"));
  }
  if (registry == nullptr) {
    return absl::InvalidArgumentError("metrics server needs a registry");
  }
  if (absl::Status s = ProbeBind(host, port); !s.ok()) return s;
  auto server =
      std::unique_ptr<MetricsServer>(new MetricsServer(host, registry));
  httplib::Server& http = *server->http_;
  // Two HTTP threads: Prometheus plus one person or tool at a time (more
  // connections wait in httplib's queue).
  http.new_task_queue = [] { return new httplib::ThreadPool(2); };
  // A scraper that keeps its connection idle holds a thread only this long.
  http.set_keep_alive_timeout(1);
  http.Get("/metrics", [registry = registry.get()](const httplib::Request&,
                                                   httplib::Response& res) {
    res.set_content(registry->RenderText(), kExpositionContentType);
  });
  server->port_ = port == 0 ? http.bind_to_any_port(host)
                            : (http.bind_to_port(host, port) ? port : -1);
  if (server->port_ <= 0) {
    // The port was free a moment ago: someone took it in between.
    return absl::UnavailableError(
        absl::StrCat("metrics: cannot listen on ", host, ":", port,
                     ": the address was taken after the probe bind"));
  }
  server->listener_ = std::thread([&http] { http.listen_after_bind(); });
  // httplib's stop() is a no-op until the accept loop runs: wait for it, so
  // that destroying the server right after Start() cannot hang on a loop
  // that starts afterwards.
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (!http.is_running() && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  if (!http.is_running()) {
    return absl::InternalError(absl::StrCat("metrics: the HTTP accept loop on ",
                                            server->address(),
                                            " did not start within 10 s"));
  }
  if (absl::Status s = process::WritePortFile(port_file, server->address());
      !s.ok()) {
    return s;
  }
  return server;
}

MetricsServer::MetricsServer(std::string host,
                             std::shared_ptr<MetricsRegistry> registry)
    : host_(std::move(host)),
      registry_(std::move(registry)),
      http_(std::make_unique<httplib::Server>()) {}

MetricsServer::~MetricsServer() {
  // Stops the HTTP threads (no scrape runs after this) before the registry
  // reference goes. stop() closes the listening socket, so the accept loop
  // ends at once; a scrape in progress finishes first.
  http_->stop();
  if (listener_.joinable()) listener_.join();
}

std::string MetricsServer::address() const {
  return absl::StrContains(host_, ':') ? absl::StrCat("[", host_, "]:", port_)
                                       : absl::StrCat(host_, ":", port_);
}

}  // namespace pdserve::metrics
