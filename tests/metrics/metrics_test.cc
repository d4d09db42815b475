// services/metrics over real HTTP on loopback: the server serves what the
// registry holds with the layout labels, scrape hooks run per scrape, port
// errors are precise; the router families; the exposition parser.
#include "metrics/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "metrics/exposition.h"
#include "router/router_metrics.h"

namespace pdserve::metrics {
namespace {

std::string Scrape(int port, const std::string& host = "127.0.0.1") {
  httplib::Client client(host, port);
  client.set_connection_timeout(5);
  client.set_read_timeout(5);
  auto res = client.Get("/metrics");
  if (!res) return "";
  EXPECT_EQ(res->status, 200);
  // Prometheus picks the text parser by this media type.
  EXPECT_EQ(res->get_header_value("Content-Type"),
            "text/plain; version=0.0.4; charset=utf-8");
  return res->body;
}

std::vector<Sample> ScrapeSamples(int port) {
  auto samples = ParseExposition(Scrape(port));
  EXPECT_TRUE(samples.ok()) << samples.status();
  return samples.ok() ? *samples : std::vector<Sample>{};
}

const Sample* FindSample(
    const std::vector<Sample>& samples, const std::string& name,
    const std::map<std::string, std::string>& labels = {}) {
  for (const Sample& s : samples) {
    if (s.name != name) continue;
    bool match = true;
    for (const auto& [k, v] : labels) match = match && s.Label(k) == v;
    if (match) return &s;
  }
  return nullptr;
}

TEST(MetricsServerTest, ServesFamiliesWithLayoutLabelsOverHttp) {
  auto registry =
      std::make_shared<MetricsRegistry>(Layout{"prefill", "group-a", 2, 3, 1});
  prometheus::Counter& tokens =
      registry->Counter("pdserve_test_tokens_total", "tokens");
  prometheus::Histogram& seconds =
      registry->Histogram("pdserve_test_seconds", "seconds", {0.1, 1});
  tokens.Increment(41);
  tokens.Increment();
  seconds.Observe(0.5);
  auto server = MetricsServer::Start("127.0.0.1", 0, registry);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_GT((*server)->port(), 0);
  EXPECT_EQ((*server)->address(),
            absl::StrCat("127.0.0.1:", (*server)->port()));

  const std::vector<Sample> samples = ScrapeSamples((*server)->port());
  const Sample* counter = FindSample(samples, "pdserve_test_tokens_total");
  ASSERT_NE(counter, nullptr);
  EXPECT_EQ(counter->value, 42);
  EXPECT_EQ(counter->Label("role"), "prefill");
  EXPECT_EQ(counter->Label("worker_id"), "group-a");
  EXPECT_EQ(counter->Label("stage"), "2");
  EXPECT_EQ(counter->Label("num_stages"), "3");
  EXPECT_EQ(counter->Label("tp"), "1");
  const Sample* bucket =
      FindSample(samples, "pdserve_test_seconds_bucket", {{"le", "1"}});
  ASSERT_NE(bucket, nullptr);
  EXPECT_EQ(bucket->value, 1);
  EXPECT_EQ(bucket->Label("role"), "prefill");
  const Sample* below =
      FindSample(samples, "pdserve_test_seconds_bucket", {{"le", "0.1"}});
  ASSERT_NE(below, nullptr);
  EXPECT_EQ(below->value, 0);
  // Every registry reports its uptime, the clock rates are read against.
  const Sample* uptime = FindSample(samples, "pdserve_process_uptime_seconds");
  ASSERT_NE(uptime, nullptr);
  EXPECT_GE(uptime->value, 0);
}

TEST(MetricsServerTest, ScrapeHooksRunPerScrapeUntilTheHandleGoes) {
  auto registry =
      std::make_shared<MetricsRegistry>(Layout{"decode", "d0", 0, 1, 2});
  prometheus::Gauge& depth = registry->Gauge("pdserve_test_depth", "depth");
  prometheus::Counter& total =
      registry->Counter("pdserve_test_kept_total", "kept elsewhere");
  int kept = 0;  // a count some component keeps itself
  auto hook = registry->OnScrape([&] {
    depth.Set(kept * 10);
    SyncCounter(total, kept);
  });
  auto server = MetricsServer::Start("127.0.0.1", 0, registry);
  ASSERT_TRUE(server.ok()) << server.status();
  kept = 3;
  auto samples = ScrapeSamples((*server)->port());
  ASSERT_NE(FindSample(samples, "pdserve_test_depth"), nullptr);
  EXPECT_EQ(FindSample(samples, "pdserve_test_depth")->value, 30);
  EXPECT_EQ(FindSample(samples, "pdserve_test_kept_total")->value, 3);
  EXPECT_EQ(FindSample(samples, "pdserve_test_kept_total")->Label("tp"), "2");
  kept = 7;
  samples = ScrapeSamples((*server)->port());
  EXPECT_EQ(FindSample(samples, "pdserve_test_kept_total")->value, 7);
  // Counters never go down.
  kept = 2;
  samples = ScrapeSamples((*server)->port());
  EXPECT_EQ(FindSample(samples, "pdserve_test_kept_total")->value, 7);
  EXPECT_EQ(FindSample(samples, "pdserve_test_depth")->value, 20);
  hook = {};
  kept = 9;
  samples = ScrapeSamples((*server)->port());
  EXPECT_EQ(FindSample(samples, "pdserve_test_kept_total")->value, 7);
  EXPECT_EQ(FindSample(samples, "pdserve_test_depth")->value, 20);
}

TEST(MetricsServerTest, PortInUseIsAPreciseError) {
  // Hold a listening socket on an ephemeral port.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const int port = ntohs(addr.sin_port);

  auto registry = std::make_shared<MetricsRegistry>(Layout{"router", "r"});
  auto server = MetricsServer::Start("127.0.0.1", port, registry);
  close(fd);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(server.status().message(),
                                absl::StrCat("127.0.0.1:", port)))
      << server.status();
  EXPECT_TRUE(
      absl::StrContains(server.status().message(), "Address already in use"))
      << server.status();
}

TEST(MetricsServerTest, BadHostAndPortAreInvalidArgument) {
  auto registry = std::make_shared<MetricsRegistry>(Layout{"router", "r"});
  EXPECT_EQ(MetricsServer::Start("127.0.0.1", 70000, registry).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MetricsServer::Start("not-an-ip", 0, registry).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MetricsServerTest, ServesOnIpv6WhereTheMachineHasIt) {
  // Whether this machine has an IPv6 loopback decides the right answer:
  // serving on [::1], or a precise UNAVAILABLE naming the address.
  const bool has_ipv6_loopback = [] {
    const int fd = socket(AF_INET6, SOCK_STREAM, 0);
    if (fd < 0) return false;
    sockaddr_in6 addr{};
    addr.sin6_family = AF_INET6;
    addr.sin6_addr = in6addr_loopback;
    const bool ok =
        bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    close(fd);
    return ok;
  }();
  auto registry = std::make_shared<MetricsRegistry>(Layout{"decode", "d6"});
  registry->Counter("pdserve_test_ipv6_total", "ipv6").Increment(3);
  auto server = MetricsServer::Start("::1", 0, registry);
  if (!has_ipv6_loopback) {
    ASSERT_FALSE(server.ok());
    EXPECT_EQ(server.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_TRUE(
        absl::StrContains(server.status().message(), "cannot listen on ::1:0"))
        << server.status();
    return;
  }
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  EXPECT_EQ((*server)->address(), absl::StrCat("[::1]:", port));
  auto samples = ParseExposition(Scrape(port, "::1"));
  ASSERT_TRUE(samples.ok()) << samples.status();
  const Sample* total = FindSample(*samples, "pdserve_test_ipv6_total",
                                   {{"role", "decode"}, {"worker_id", "d6"}});
  ASSERT_NE(total, nullptr);
  EXPECT_EQ(total->value, 3);
}

// More static TLS than civetweb's 100 KiB thread stacks hold, as in a binary
// that links the CUDA libraries (cuBLASLt alone carries ~94 KiB): the exposer
// prometheus-cpp ships could not start a thread in such a process.
thread_local std::array<char, 256 * 1024> static_tls_ballast;

TEST(MetricsServerTest, ServesInAProcessWithLargeStaticTls) {
  static_tls_ballast[0] = 1;  // the binary keeps the ballast
  auto registry = std::make_shared<MetricsRegistry>(Layout{"decode", "tls"});
  registry->Counter("pdserve_test_tls_total", "tls").Increment(5);
  auto server = MetricsServer::Start("127.0.0.1", 0, registry);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::vector<Sample> samples = ScrapeSamples((*server)->port());
  const Sample* total = FindSample(samples, "pdserve_test_tls_total");
  ASSERT_NE(total, nullptr);
  EXPECT_EQ(total->value, 5);
  EXPECT_EQ(static_tls_ballast[0], 1);
}

TEST(MetricsServerTest, StopsPromptly) {
  // A worker's SIGTERM path must not wait on the HTTP accept loop.
  auto registry = std::make_shared<MetricsRegistry>(Layout{"router", "r"});
  auto server = MetricsServer::Start("127.0.0.1", 0, registry);
  ASSERT_TRUE(server.ok()) << server.status();
  const absl::Time start = absl::Now();
  server->reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
}

TEST(RouterMetricsTest, EveryFamilyIsExportedWithItsLabels) {
  auto registry =
      std::make_shared<MetricsRegistry>(Layout{"router", "router-0", 0, 3, 2});
  RouterMetrics m(*registry);
  m.OnRequest("openai_completions", "200");
  m.OnRequest("openai_completions", "200");
  m.OnRequest("grpc_generate", absl::StatusCode::kInvalidArgument);
  m.OnRequest("openai_chat", 429);
  m.ObserveTtft(0.25);
  m.ObserveTtftBreakdown({0.01, 0.2, 0.03, 0.01});
  m.ObserveItl(0.02);
  m.ObserveTpot(0.021);
  m.ObserveE2e(1.5);
  m.SetInFlight(4);
  m.SetQueued(1);
  m.OnRouting("least_load", "decode", "10.0.0.7:50051");
  m.OnRetry("prefill");
  m.OnTokens(12, 30);
  auto server = MetricsServer::Start("127.0.0.1", 0, registry);
  ASSERT_TRUE(server.ok()) << server.status();
  const auto samples = ScrapeSamples((*server)->port());

  const Sample* ok =
      FindSample(samples, "pdserve_router_requests_total",
                 {{"api", "openai_completions"}, {"code", "200"}});
  ASSERT_NE(ok, nullptr);
  EXPECT_EQ(ok->value, 2);
  EXPECT_EQ(ok->Label("num_stages"), "3");
  ASSERT_NE(
      FindSample(samples, "pdserve_router_requests_total",
                 {{"api", "grpc_generate"}, {"code", "INVALID_ARGUMENT"}}),
      nullptr);
  ASSERT_NE(FindSample(samples, "pdserve_router_requests_total",
                       {{"api", "openai_chat"}, {"code", "429"}}),
            nullptr);
  EXPECT_EQ(FindSample(samples, "pdserve_router_ttft_seconds_count")->value, 1);
  EXPECT_DOUBLE_EQ(
      FindSample(samples, "pdserve_router_ttft_seconds_sum")->value, 0.25);
  for (const char* phase : {"queue", "prefill", "kv_transfer", "first_step"}) {
    EXPECT_NE(FindSample(samples, "pdserve_router_ttft_phase_seconds_count",
                         {{"phase", phase}}),
              nullptr)
        << phase;
  }
  EXPECT_DOUBLE_EQ(FindSample(samples, "pdserve_router_ttft_phase_seconds_sum",
                              {{"phase", "prefill"}})
                       ->value,
                   0.2);
  EXPECT_EQ(FindSample(samples, "pdserve_router_itl_seconds_count")->value, 1);
  EXPECT_EQ(FindSample(samples, "pdserve_router_tpot_seconds_count")->value, 1);
  EXPECT_EQ(FindSample(samples, "pdserve_router_e2e_seconds_count")->value, 1);
  EXPECT_EQ(FindSample(samples, "pdserve_router_in_flight_requests")->value, 4);
  EXPECT_EQ(FindSample(samples, "pdserve_router_queued_requests")->value, 1);
  const Sample* routed =
      FindSample(samples, "pdserve_router_routing_decisions_total",
                 {{"policy", "least_load"},
                  {"side", "decode"},
                  {"worker", "10.0.0.7:50051"}});
  ASSERT_NE(routed, nullptr);
  EXPECT_EQ(routed->value, 1);
  EXPECT_EQ(
      FindSample(samples, "pdserve_router_retries_total", {{"side", "prefill"}})
          ->value,
      1);
  // Both sides exist from the start (dashboards show a zero, not no data).
  EXPECT_EQ(
      FindSample(samples, "pdserve_router_retries_total", {{"side", "decode"}})
          ->value,
      0);
  EXPECT_EQ(FindSample(samples, "pdserve_router_prompt_tokens_total")->value,
            12);
  EXPECT_EQ(FindSample(samples, "pdserve_router_output_tokens_total")->value,
            30);
}

TEST(ExpositionTest, ParsesLabelsEscapesAndSpecialValues) {
  const std::string text =
      "# HELP pdserve_x_total help\n"
      "# TYPE pdserve_x_total counter\n"
      "pdserve_x_total{role=\"decode\",worker_id=\"a \\\"b\\\" \\\\c\"} 3\n"
      "pdserve_y{le=\"+Inf\"} +Inf\n"
      "pdserve_z NaN 1700000000000\n"
      "\n"
      "pdserve_w{} -2.5e-3\n";
  auto samples = ParseExposition(text);
  ASSERT_TRUE(samples.ok()) << samples.status();
  ASSERT_EQ(samples->size(), 4u);
  EXPECT_EQ((*samples)[0].name, "pdserve_x_total");
  EXPECT_EQ((*samples)[0].Label("worker_id"), "a \"b\" \\c");
  EXPECT_EQ((*samples)[0].value, 3);
  EXPECT_TRUE(std::isinf((*samples)[1].value));
  EXPECT_TRUE(std::isnan((*samples)[2].value));
  EXPECT_DOUBLE_EQ((*samples)[3].value, -0.0025);
}

TEST(ExpositionTest, MalformedLinesNameTheLine) {
  for (const std::string bad :
       {"pdserve_x{role=\"a\" 1\n", "pdserve_x{role=a} 1\n", "pdserve_x\n",
        "ok 1\npdserve_x abc\n"}) {
    auto samples = ParseExposition(bad);
    ASSERT_FALSE(samples.ok()) << bad;
    EXPECT_EQ(samples.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(samples.status().message(), "line"));
  }
}

TEST(ExpositionTest, RoundTripsARegistryRendering) {
  MetricsRegistry registry(Layout{"decode", "w", 0, 1, 4});
  registry.Counter("pdserve_a_total", "a").Increment(5);
  registry.Histogram("pdserve_b_seconds", "b", {1, 2}).Observe(1.5);
  auto samples = ParseExposition(registry.RenderText());
  ASSERT_TRUE(samples.ok()) << samples.status();
  const Sample* a = FindSample(*samples, "pdserve_a_total");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->value, 5);
  EXPECT_EQ(a->Label("tp"), "4");
  EXPECT_EQ(
      FindSample(*samples, "pdserve_b_seconds_bucket", {{"le", "2"}})->value,
      1);
  EXPECT_EQ(
      FindSample(*samples, "pdserve_b_seconds_bucket", {{"le", "1"}})->value,
      0);
}

}  // namespace
}  // namespace pdserve::metrics
