// A real Prometheus (Debian's /usr/bin/prometheus on 127.0.0.1, temp config
// and TSDB) scrapes a real decode_worker (TP 2, n-gram speculation) and a
// real 2-stage prefill group while requests run through them the way the
// router drives them (DecodeWorker.Admit -> PrefillGroup.Prefill, which
// writes the KV over UCX and sends KvComplete -> StreamTokens). This test
// process plays the router: it measures each request with the real
// metrics::RouterMetrics and serves those families too. Then every PromQL
// expression of the shipped Grafana dashboards must return data through
// Prometheus' HTTP API; the test prints each expression it checked.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "metrics/cluster_util.h"
#include "metrics/metrics.h"
#include "nlohmann/json.hpp"
#include "pdserve/v1/decode.grpc.pb.h"
#include "prefill_worker/worker_test_util.h"
#include "router/planner_monitor.h"
#include "router/router_metrics.h"
#include "testing/golden.h"

namespace pdserve::metrics {
namespace {

namespace v1 = ::pdserve::v1;
namespace fs = std::filesystem;
using testing::Child;
using testing::FreePort;
using testing::MetricsAddress;
using testing::Query;
using testing::Slurp;

// Every "expr" of every panel target in the shipped dashboards.
std::vector<std::pair<std::string, std::string>> DashboardExpressions() {
  std::vector<std::pair<std::string, std::string>> out;
  const fs::path dir =
      fs::path(PDSERVE_SOURCE_DIR) / "deploy" / "grafana" / "dashboards";
  std::function<void(const nlohmann::json&, const std::string&)> walk =
      [&](const nlohmann::json& j, const std::string& file) {
        if (j.is_object()) {
          for (const auto& [k, v] : j.items()) {
            if (k == "expr" && v.is_string()) {
              out.emplace_back(file, v.get<std::string>());
            } else {
              walk(v, file);
            }
          }
        } else if (j.is_array()) {
          for (const auto& v : j) walk(v, file);
        }
      };
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != ".json") continue;
    auto json = nlohmann::json::parse(Slurp(entry.path()), nullptr, false);
    EXPECT_FALSE(json.is_discarded()) << entry.path();
    walk(json, entry.path().filename().string());
  }
  return out;
}

TEST(ClusterMetricsTest, EveryDashboardExpressionReturnsDataFromRealWorkers) {
  char tmpl[] = "/tmp/cluster_metrics_test.XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const auto cases = pdserve::testing::LoadGoldenCases("golden.jsonl");
  ASSERT_FALSE(cases.empty());

  // ---- Workers ------------------------------------------------------------
  Child decode(
      {PDSERVE_DECODE_WORKER_BIN, "--model",
       pdserve::testing::Stories260KGguf(), "--host", "127.0.0.1", "--port",
       "0", "--tp", "2", "--speculation", "ngram", "--num-blocks", "256",
       "--metrics-port", "0", "--worker-id", "decode-0"},
      dir + "/decode.log");
  const std::string decode_metrics =
      decode.WaitFor("metrics on ([0-9.:]+)", absl::Seconds(60));
  const std::string decode_address =
      decode.WaitFor("listening on ([0-9.:]+)", absl::Seconds(60));
  ASSERT_FALSE(decode_address.empty());
  prefill::testing::WorkerGroup group(
      2, "3,2", {"--metrics-port", "0", "--worker-id", "prefill-0"});
  ASSERT_NE(group.stub(), nullptr) << group.Logs();
  std::vector<std::string> targets = {decode_metrics};
  for (int stage = 0; stage < 2; ++stage) {
    targets.push_back(MetricsAddress(group.Log(stage)));
    ASSERT_FALSE(targets.back().empty()) << group.Log(stage);
  }

  // This process is the router: the real RouterMetrics, served over HTTP.
  auto router_registry =
      std::make_shared<MetricsRegistry>(Layout{"router", "router-0", 0, 2, 2});
  RouterMetrics router(*router_registry);
  auto router_server = MetricsServer::Start("127.0.0.1", 0, router_registry);
  ASSERT_TRUE(router_server.ok()) << router_server.status();
  targets.push_back((*router_server)->address());
  // The router's online planner on the same registry (the dashboards' planner
  // row): a two-point step cost is enough to plan with; it evaluates once,
  // after the load.
  router::PlannerMonitorOptions planner_options;
  {
    auto step =
        planner::StepCost::Fit({{{1, 1, 16}, 0.002}, {{64, 1, 2080}, 0.01}});
    ASSERT_TRUE(step.ok()) << step.status();
    planner_options.model.model = "stories260K";
    planner_options.model.num_layers = 5;
    planner_options.model.steps[{1, 1}] = *step;
    planner_options.model.steps[{1, 2}] = *step;
  }
  planner_options.interval = absl::Hours(1);
  auto planner_monitor = router::PlannerMonitor::Start(
      planner_options, [&router] { return router.Served(); }, *router_registry);
  ASSERT_TRUE(planner_monitor.ok()) << planner_monitor.status();

  // ---- Prometheus -----------------------------------------------------------
  const int prom_port = FreePort();
  {
    std::ofstream config(dir + "/prometheus.yml");
    config << "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
           << "scrape_configs:\n  - job_name: pdserve\n"
           << "    static_configs:\n      - targets: ['"
           << absl::StrJoin(targets, "', '") << "']\n";
  }
  Child prometheus(
      {"/usr/bin/prometheus", "--config.file=" + dir + "/prometheus.yml",
       "--storage.tsdb.path=" + dir + "/tsdb",
       absl::StrCat("--web.listen-address=127.0.0.1:", prom_port),
       "--log.level=warn"},
      dir + "/prometheus.log");
  httplib::Client prom("127.0.0.1", prom_port);
  prom.set_read_timeout(10);
  {
    const absl::Time end = absl::Now() + absl::Seconds(60);
    bool ready = false;
    while (!ready && absl::Now() < end && prometheus.Alive()) {
      auto res = prom.Get("/-/ready");
      ready = res && res->status == 200;
      if (!ready) absl::SleepFor(absl::Milliseconds(100));
    }
    ASSERT_TRUE(ready) << prometheus.Log();
  }

  // ---- Load: requests through decode + prefill, two at a time --------------
  auto decode_stub = v1::DecodeWorker::NewStub(
      grpc::CreateChannel(decode_address, grpc::InsecureChannelCredentials()));
  std::atomic<int> in_flight{0};
  auto run = [&](uint64_t id, const pdserve::testing::GoldenCase& c) {
    router.SetInFlight(++in_flight);
    router.OnRouting("test_driver", "decode", decode_address);
    router.OnRouting("test_driver", "prefill", "prefill-0");
    testing::RequestTimes times;
    const std::vector<int32_t> tokens = testing::RunRequest(
        *decode_stub, decode_address,
        [&](const v1::PrefillSubmitRequest& r, v1::PrefillSubmitResponse* out) {
          return group.Prefill(r, out);
        },
        id, c.prompt_ids, c.max_new_tokens, &times);
    router.OnRequest("grpc_generate", tokens.empty() ? "ERROR" : "OK");
    router.ObserveTtft(times.ttft);
    for (double gap : times.gaps) router.ObserveItl(gap);
    router.ObserveE2e(times.e2e);
    if (tokens.size() > 1) {
      router.ObserveTpot((times.e2e - times.ttft) / (tokens.size() - 1));
    }
    router.OnTokens(c.prompt_ids.size(), tokens.size());
    router.SetInFlight(--in_flight);
    // The cluster is only worth measuring if it computes the right thing.
    EXPECT_EQ(tokens, c.greedy_ids) << c.prompt;
  };
  uint64_t next_id = 1;
  for (int round = 0; round < 2; ++round) {
    for (size_t i = 0; i + 1 < cases.size(); i += 2) {
      std::thread a(run, next_id++, cases[i]);
      std::thread b(run, next_id++, cases[i + 1]);
      a.join();
      b.join();
    }
  }
  {
    // One prompt scored (echo + logprobs, no KV destination): the last
    // stage's scored-token counter the prefill dashboard plots.
    v1::PrefillSubmitRequest score;
    score.set_request_id(next_id++);
    for (int32_t t : cases.front().prompt_ids) score.add_prompt_ids(t);
    score.set_prompt_logprobs(true);
    v1::PrefillSubmitResponse scored;
    grpc::Status s = group.Prefill(score, &scored);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(scored.prompt_logprobs_size(),
              static_cast<int>(cases.front().prompt_ids.size()) - 1);
  }

  ASSERT_TRUE((*planner_monitor)->EvaluateNow().ok());

  // ---- Wait for scrapes after the load, then check every expression --------
  {
    const absl::Time end = absl::Now() + absl::Seconds(30);
    bool seen = false;
    while (!seen && absl::Now() < end) {
      auto j = Query(prom, "sum(pdserve_decode_step_seconds_count)");
      seen =
          j.value("status", "") == "success" && !j["data"]["result"].empty() &&
          std::stod(j["data"]["result"][0]["value"][1].get<std::string>()) > 0;
      if (!seen) absl::SleepFor(absl::Milliseconds(200));
    }
    ASSERT_TRUE(seen) << prometheus.Log();
    absl::SleepFor(absl::Seconds(3));  // a few more scrapes for rate()
  }
  auto up = Query(prom, "up == 1");
  ASSERT_EQ(up["data"]["result"].size(), targets.size()) << up.dump();

  // The load really moved the counters the dashboards are built on.
  for (const std::string expr :
       {"sum(pdserve_prefill_scored_tokens_total)",
        "sum(pdserve_decode_spec_proposed_tokens_total)",
        "sum(pdserve_decode_allreduce_seconds_total)",
        "sum(pdserve_decode_output_tokens_total)",
        "min(pdserve_prefill_kv_bytes_written_total)",
        "min(pdserve_prefill_stage_busy_seconds_total)",
        "min(pdserve_prefill_stage_idle_seconds_total)",
        "sum(pdserve_prefill_requests_completed_total)",
        "sum(pdserve_router_ttft_seconds_count)"}) {
    auto j = Query(prom, expr);
    ASSERT_FALSE(j["data"]["result"].empty()) << expr;
    EXPECT_GT(std::stod(j["data"]["result"][0]["value"][1].get<std::string>()),
              0)
        << expr;
  }

  // The layout report tool over the same endpoints (totals since start).
  {
    std::vector<std::string> urls;
    for (const auto& t : targets) urls.push_back("http://" + t + "/metrics");
    const std::string out_path = dir + "/report.txt";
    const std::string cmd =
        absl::StrCat(LAYOUT_REPORT_BIN, " --interval 0 --metrics ",
                     absl::StrJoin(urls, ","), " > ", out_path, " 2>&1");
    EXPECT_EQ(std::system(cmd.c_str()), 0) << Slurp(out_path);
    const std::string report = Slurp(out_path);
    std::printf("%s", report.c_str());
    for (const char* topic :
         {"stage imbalance (prefill-0)", "bubble ratio (prefill-0)",
          "KV transfer share of TTFT", "prefill vs decode utilisation",
          "speculative acceptance", "decode batch size"}) {
      EXPECT_TRUE(absl::StrContains(report, topic)) << topic << "\n" << report;
    }
    // The same view through Prometheus' HTTP API (the window reaches back
    // before the first scrape: totals, like --interval 0).
    const std::string prom_cmd = absl::StrCat(
        LAYOUT_REPORT_BIN, " --prometheus http://127.0.0.1:", prom_port,
        " --window 1m > ", out_path, " 2>&1");
    EXPECT_EQ(std::system(prom_cmd.c_str()), 0) << Slurp(out_path);
    const std::string via_prometheus = Slurp(out_path);
    std::printf("%s", via_prometheus.c_str());
    EXPECT_TRUE(
        absl::StrContains(via_prometheus, "stage imbalance (prefill-0): 1."))
        << via_prometheus;
    EXPECT_TRUE(absl::StrContains(via_prometheus, "speculative acceptance: "))
        << via_prometheus;
    EXPECT_FALSE(absl::StrContains(via_prometheus, "no drafts in the window"))
        << via_prometheus;
  }

  const auto expressions = DashboardExpressions();
  ASSERT_GT(expressions.size(), 20u);
  std::vector<std::string> router_checked;
  for (const auto& [file, expr] : expressions) {
    // Grafana's rate interval; the test scrapes every second.
    const std::string promql =
        absl::StrReplaceAll(expr, {{"$__rate_interval", "30s"}});
    auto j = Query(prom, promql);
    EXPECT_EQ(j.value("status", ""), "success")
        << file << ": " << promql << "\n"
        << j.dump();
    EXPECT_FALSE(j["data"]["result"].empty())
        << file << ": no data for " << promql;
    std::printf("checked [%s] %s -> %zu series\n", file.c_str(), promql.c_str(),
                j["data"]["result"].size());
    if (absl::StrContains(expr, "pdserve_router_"))
      router_checked.push_back(expr);
  }
  // The router families came from RouterMetrics in this process (the router
  // binary is not part of this test); say so in the log.
  std::printf(
      "%zu expressions checked; %zu of them read router families exported by "
      "metrics::RouterMetrics driven by this test acting as the router\n",
      expressions.size(), router_checked.size());
  std::system(absl::StrCat("rm -rf ", dir).c_str());
}

}  // namespace
}  // namespace pdserve::metrics
