// The elastic cluster (issue 45): workers join and leave a running cluster
// under streaming load, and no request is lost. Real processes on distinct
// loopback addresses, found by the router through a real DNS server
// (dnsmasq; LocalClusterOptions::dns_discovery), scaled the way Kubernetes
// does it: a new pod starts and enters the Service's records once it serves;
// a leaving pod leaves the records and gets SIGTERM (it drains); a lost node
// is a SIGKILL whose record lingers.
//
// Every scenario runs closed-loop greedy streams (tools/churn_load.h) and
// requires 0 failed requests and 0 answers differing from the undisturbed
// one (no token lost, repeated or changed), KV blocks back to baseline on
// every worker left, and the event's figures printed (requests, p99 TTFT /
// TPOT before and during, time for a new worker to take traffic). Only the
// router's own kill may break its clients' streams: those are counted.
// The figures go to bench/elastic_bench, not to assertions on time.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "metrics/exposition.h"
#include "pdserve/v1/decode.grpc.pb.h"
#include "pdserve/v1/prefill.grpc.pb.h"
#include "rpc/auth.h"
#include "testing/golden.h"
#include "tools/churn_load.h"
#include "tools/local_cluster.h"

namespace pdserve {
namespace {

using tools::ChurnLoad;
using tools::ChurnRequest;
using tools::ChurnSummary;
using tools::LocalCluster;
using tools::LocalClusterOptions;

LocalClusterOptions ElasticOptions() {
  LocalClusterOptions o;
  o.model_path = testing::Stories260KDir();
  o.bin_dir = PDSERVE_BINARY_DIR;
  o.model_name = "stories260K";
  o.dns_discovery = true;
  o.decode_blocks = 512;
  o.prefill_blocks = 256;
  o.refresh_ms = 100;
  o.decode_policy = "least-loaded";
  o.prefill_policy = "least-loaded";
  o.metrics_port_base = 0;
  return o;
}

// The router's counter `name`, summed over series whose `label` is `value`
// ("" = every series).
double RouterCounter(const LocalCluster& cluster, const std::string& name,
                     const std::string& label = "",
                     const std::string& value = "") {
  const std::string& address = cluster.metrics_addresses().at("router");
  const size_t colon = address.rfind(':');
  httplib::Client client(address.substr(0, colon),
                         std::stoi(address.substr(colon + 1)));
  auto res = client.Get("/metrics");
  if (!res || res->status != 200) return -1;
  auto samples = metrics::ParseExposition(res->body);
  if (!samples.ok()) return -1;
  double sum = 0;
  for (const metrics::Sample& s : *samples) {
    if (s.name == name && (label.empty() || s.Label(label) == value)) {
      sum += s.value;
    }
  }
  return sum;
}

std::string RouterDecisions(const LocalCluster& cluster) {
  return absl::StrFormat(
      "router: %.0f streams migrated; prefill on a group %.0f, on the decode "
      "worker for want of a group %.0f",
      RouterCounter(cluster, "pdserve_router_migrations_total", "outcome",
                    "started"),
      RouterCounter(cluster, "pdserve_router_prefill_decisions_total", "where",
                    "group"),
      RouterCounter(cluster, "pdserve_router_prefill_decisions_total", "where",
                    "decode_no_group"));
}

// Token-id prompts from the golden set, long answers (ignore_eos).
std::vector<ChurnRequest> Requests(int max_tokens) {
  std::vector<ChurnRequest> out;
  for (const auto& c : testing::LoadGoldenCases("golden.jsonl")) {
    ChurnRequest r;
    r.prompt_ids = c.prompt_ids;
    r.max_tokens = max_tokens;
    out.push_back(std::move(r));
    if (out.size() == 4) break;
  }
  return out;
}

template <typename F>
bool Eventually(F condition, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (condition()) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return condition();
}

v1::DecodeLoad DecodeLoadOf(const LocalCluster& cluster, int worker) {
  auto stub = v1::DecodeWorker::NewStub(rpc::CreateChannel(
      cluster.decode_addresses()[worker], cluster.internal_token()));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  v1::DecodeLoad load;
  if (!stub->GetLoad(&context, v1::GetLoadRequest(), &load).ok()) {
    load.set_kv_blocks_used(-1);
  }
  return load;
}

v1::PrefillLoad PrefillLoadOf(const LocalCluster& cluster, int group) {
  auto stub = v1::PrefillGroup::NewStub(rpc::CreateChannel(
      cluster.prefill_addresses()[group], cluster.internal_token()));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  v1::PrefillLoad load;
  if (!stub->GetLoad(&context, v1::PrefillLoadRequest(), &load).ok()) {
    load.set_kv_blocks_used(-1);
  }
  return load;
}

// Seconds until decode worker `worker` has decoded for someone.
double TimeToTraffic(const LocalCluster& cluster, int worker,
                     absl::Time since) {
  const bool took =
      Eventually([&] { return DecodeLoadOf(cluster, worker).steps() > 0; },
                 absl::Seconds(30));
  EXPECT_TRUE(took) << "decode worker " << worker << " never took traffic";
  return absl::ToDoubleSeconds(absl::Now() - since);
}

double TimeToPrefill(const LocalCluster& cluster, int group, absl::Time since) {
  const bool took =
      Eventually([&] { return PrefillLoadOf(cluster, group).completed() > 0; },
                 absl::Seconds(30));
  EXPECT_TRUE(took) << "prefill group " << group << " never took traffic";
  return absl::ToDoubleSeconds(absl::Now() - since);
}

// Every worker left has no request's KV: the prefix cache's blocks are
// free to take (not counted as used).
void ExpectKvBackToBaseline(const LocalCluster& cluster) {
  for (int w : cluster.live_decode_workers()) {
    EXPECT_TRUE(Eventually(
        [&] { return DecodeLoadOf(cluster, w).kv_blocks_used() == 0; },
        absl::Seconds(20)))
        << "decode worker " << w << ": "
        << DecodeLoadOf(cluster, w).kv_blocks_used() << " blocks used";
  }
  for (int g : cluster.live_prefill_groups()) {
    EXPECT_TRUE(Eventually(
        [&] {
          const v1::PrefillLoad load = PrefillLoadOf(cluster, g);
          return load.kv_blocks_used() == 0 && load.in_flight() == 0;
        },
        absl::Seconds(20)))
        << "prefill group " << g;
  }
}

void ExpectNothingLost(const ChurnSummary& s, const std::string& what) {
  EXPECT_GT(s.requests, 0) << what;
  EXPECT_EQ(s.failed, 0) << what << ": " << s.first_failure;
  EXPECT_EQ(s.mismatched, 0) << what << ": " << s.first_failure;
}

void Report(const std::string& scenario, const ChurnSummary& before,
            const ChurnSummary& during, const std::string& extra) {
  std::printf("elastic %s\n  before: %s\n  during: %s\n  %s\n",
              scenario.c_str(), tools::Describe(before).c_str(),
              tools::Describe(during).c_str(), extra.c_str());
  std::fflush(stdout);
}

struct Running {
  std::unique_ptr<LocalCluster> cluster;
  std::unique_ptr<ChurnLoad> load;
  absl::Time event;  // when the scenario's changes began
};

// A cluster, its requests' undisturbed answers, and the load running for a
// while before anything changes.
Running StartUnderLoad(const LocalClusterOptions& o, int clients,
                       int max_tokens) {
  Running r;
  absl::StatusOr<std::unique_ptr<LocalCluster>> started =
      LocalCluster::Start(o);
  EXPECT_TRUE(started.ok()) << started.status();
  if (!started.ok()) return r;
  r.cluster = *std::move(started);
  std::vector<ChurnRequest> requests = Requests(max_tokens);
  const absl::Status reference = tools::Reference(
      r.cluster->grpc_address(), r.cluster->model_name(), &requests);
  EXPECT_TRUE(reference.ok()) << reference;
  if (!reference.ok()) {
    r.cluster.reset();
    return r;
  }
  r.load = std::make_unique<ChurnLoad>(r.cluster->grpc_address(),
                                       r.cluster->model_name(),
                                       std::move(requests), clients);
  r.load->Start();
  EXPECT_TRUE(r.load->WaitForMore(3 * clients, absl::Seconds(60)));
  r.event = absl::Now();
  return r;
}

TEST(ElasticTest, DecodeWorkersScaleOneToThreeToOneUnderLoad) {
  LocalClusterOptions o = ElasticOptions();
  o.decode_workers = 1;
  Running r = StartUnderLoad(o, /*clients=*/6, /*max_tokens=*/160);
  ASSERT_NE(r.load, nullptr);
  LocalCluster& cluster = *r.cluster;
  absl::StatusOr<int> second = cluster.AddDecodeWorker();
  ASSERT_TRUE(second.ok()) << second.status();
  const double second_in = TimeToTraffic(cluster, *second, r.event);
  const absl::Time third_started = absl::Now();
  absl::StatusOr<int> third = cluster.AddDecodeWorker();
  ASSERT_TRUE(third.ok()) << third.status();
  const double third_in = TimeToTraffic(cluster, *third, third_started);
  ASSERT_TRUE(r.load->WaitForMore(12, absl::Seconds(60)));
  // Scale down: the two newest leave (Deployment scale-down), draining.
  const absl::Time down = absl::Now();
  ASSERT_TRUE(
      cluster.RemoveDecodeWorker(*third, /*drain=*/true, absl::Seconds(30))
          .ok());
  ASSERT_TRUE(
      cluster.RemoveDecodeWorker(*second, /*drain=*/true, absl::Seconds(30))
          .ok());
  const double drained = absl::ToDoubleSeconds(absl::Now() - down);
  ASSERT_TRUE(r.load->WaitForMore(12, absl::Seconds(60)));
  r.load->Stop();
  const auto outcomes = r.load->outcomes();
  const ChurnSummary before =
      tools::Summarize(outcomes, absl::InfinitePast(), r.event);
  const ChurnSummary during = tools::Summarize(outcomes, r.event);
  ExpectNothingLost(before, "before");
  ExpectNothingLost(during, "decode 1 -> 3 -> 1");
  ExpectKvBackToBaseline(cluster);
  Report(
      "decode workers 1 -> 3 -> 1", before, during,
      absl::StrFormat("new workers took traffic %.2f s and %.2f s after "
                      "they were started; two drained in %.2f s; %s",
                      second_in, third_in, drained, RouterDecisions(cluster)));
}

TEST(ElasticTest, PrefillGroupsScaleOneToTwoToOneUnderLoad) {
  LocalClusterOptions o = ElasticOptions();
  o.stages = 2;
  Running r = StartUnderLoad(o, /*clients=*/6, /*max_tokens=*/48);
  ASSERT_NE(r.load, nullptr);
  LocalCluster& cluster = *r.cluster;
  absl::StatusOr<int> added = cluster.AddPrefillGroup();
  ASSERT_TRUE(added.ok()) << added.status();
  const double took = TimeToPrefill(cluster, *added, r.event);
  ASSERT_TRUE(r.load->WaitForMore(12, absl::Seconds(60)));
  // The first group leaves (a LeaderWorkerSet scaled down): every stage
  // gets SIGTERM, stage 0 drains its pipeline.
  const absl::Time down = absl::Now();
  ASSERT_TRUE(
      cluster.RemovePrefillGroup(0, /*drain=*/true, absl::Seconds(30)).ok());
  const double drained = absl::ToDoubleSeconds(absl::Now() - down);
  ASSERT_TRUE(r.load->WaitForMore(12, absl::Seconds(60)));
  r.load->Stop();
  const auto outcomes = r.load->outcomes();
  const ChurnSummary before =
      tools::Summarize(outcomes, absl::InfinitePast(), r.event);
  const ChurnSummary during = tools::Summarize(outcomes, r.event);
  ExpectNothingLost(before, "before");
  ExpectNothingLost(during, "prefill groups 1 -> 2 -> 1");
  ExpectKvBackToBaseline(cluster);
  Report("prefill groups 1 -> 2 -> 1", before, during,
         absl::StrFormat("the new group prefilled %.2f s after it was "
                         "started; the old one drained in %.2f s; %s",
                         took, drained, RouterDecisions(cluster)));
}

// A rolling update of every worker: each is replaced by a new one (surge
// first, then the old one drains). The drain timeout is short on purpose,
// so decode workers are stopped with streams still on them: those migrate.
TEST(ElasticTest, RollingRestartOfEveryWorkerUnderLoad) {
  LocalClusterOptions o = ElasticOptions();
  o.decode_workers = 2;
  o.drain_timeout_s = 0.3;
  Running r = StartUnderLoad(o, /*clients=*/6, /*max_tokens=*/400);
  ASSERT_NE(r.load, nullptr);
  LocalCluster& cluster = *r.cluster;
  for (int old_worker : {0, 1}) {
    absl::StatusOr<int> fresh = cluster.AddDecodeWorker();
    ASSERT_TRUE(fresh.ok()) << fresh.status();
    (void)TimeToTraffic(cluster, *fresh, absl::Now());
    ASSERT_TRUE(
        cluster
            .RemoveDecodeWorker(old_worker, /*drain=*/true, absl::Seconds(30))
            .ok());
  }
  absl::StatusOr<int> group = cluster.AddPrefillGroup();
  ASSERT_TRUE(group.ok()) << group.status();
  (void)TimeToPrefill(cluster, *group, absl::Now());
  ASSERT_TRUE(
      cluster.RemovePrefillGroup(0, /*drain=*/true, absl::Seconds(30)).ok());
  ASSERT_TRUE(r.load->WaitForMore(12, absl::Seconds(60)));
  r.load->Stop();
  const auto outcomes = r.load->outcomes();
  const ChurnSummary before =
      tools::Summarize(outcomes, absl::InfinitePast(), r.event);
  const ChurnSummary during = tools::Summarize(outcomes, r.event);
  ExpectNothingLost(before, "before");
  ExpectNothingLost(during, "rolling restart");
  ExpectKvBackToBaseline(cluster);
  // 400-token streams outlive a 0.3 s drain: some were moved.
  EXPECT_GE(RouterCounter(cluster, "pdserve_router_migrations_total", "outcome",
                          "started"),
            1);
  Report("rolling restart (2 decode workers, 1 prefill group)", before, during,
         absl::StrCat("drain timeout 0.3 s; ", RouterDecisions(cluster)));
}

// The only prefill group down (a stage killed; the group restarts whole):
// its decode workers prefill the prompts themselves meanwhile, so nothing
// is refused (it used to be half of the requests answered 503).
TEST(ElasticTest, OnlyPrefillGroupDownFallsBackToDecodePrefill) {
  LocalClusterOptions o = ElasticOptions();
  o.stages = 2;
  Running r = StartUnderLoad(o, /*clients=*/6, /*max_tokens=*/64);
  ASSERT_NE(r.load, nullptr);
  LocalCluster& cluster = *r.cluster;
  cluster.KillPrefillStage(0, 1);
  // Supervise until the group prefills again.
  const int64_t completed_before = PrefillLoadOf(cluster, 0).completed();
  const absl::Time killed = absl::Now();
  bool back = false;
  while (absl::Now() - killed < absl::Seconds(40)) {
    (void)cluster.Supervise();
    const v1::PrefillLoad load = PrefillLoadOf(cluster, 0);
    if (load.serving() && load.completed() > 0 &&
        load.completed() != completed_before) {
      back = true;
      break;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(back) << "the group did not come back";
  const double down_for = absl::ToDoubleSeconds(absl::Now() - killed);
  ASSERT_TRUE(r.load->WaitForMore(12, absl::Seconds(60)));
  r.load->Stop();
  const auto outcomes = r.load->outcomes();
  const ChurnSummary before =
      tools::Summarize(outcomes, absl::InfinitePast(), r.event);
  const ChurnSummary during = tools::Summarize(outcomes, r.event);
  ExpectNothingLost(before, "before");
  ExpectNothingLost(during, "the only group down");
  EXPECT_GE(RouterCounter(cluster, "pdserve_router_prefill_decisions_total",
                          "where", "decode_no_group"),
            1);
  ExpectKvBackToBaseline(cluster);
  Report("only prefill group down (stage 1 SIGKILL)", before, during,
         absl::StrFormat("group back after %.2f s; %s", down_for,
                         RouterDecisions(cluster)));
}

// Lost nodes: a decode worker and a prefill stage SIGKILLed under load (the
// supervisor brings them back, as a Deployment / LeaderWorkerSet would),
// then the router itself.
TEST(ElasticTest, KilledWorkersLoseNothingAndTheRoutersKillIsCounted) {
  LocalClusterOptions o = ElasticOptions();
  o.decode_workers = 2;
  o.prefill_groups = 2;
  o.stages = 2;
  Running r = StartUnderLoad(o, /*clients=*/6, /*max_tokens=*/300);
  ASSERT_NE(r.load, nullptr);
  LocalCluster& cluster = *r.cluster;
  auto supervise_for = [&](absl::Duration d) {
    const absl::Time until = absl::Now() + d;
    while (absl::Now() < until) {
      (void)cluster.Supervise();
      absl::SleepFor(absl::Milliseconds(50));
    }
  };
  cluster.KillDecode(0);
  supervise_for(absl::Seconds(2));
  ASSERT_TRUE(r.load->WaitForMore(12, absl::Seconds(60)));
  cluster.KillPrefillStage(0, 1);
  supervise_for(absl::Seconds(4));
  ASSERT_TRUE(r.load->WaitForMore(12, absl::Seconds(60)));
  const double migrated = RouterCounter(
      cluster, "pdserve_router_migrations_total", "outcome", "started");
  EXPECT_GE(migrated, 1) << "no stream was on the killed decode worker";
  const std::string decisions = RouterDecisions(cluster);
  const absl::Time router_killed = absl::Now();
  cluster.KillRouter();
  supervise_for(absl::Seconds(1));
  ASSERT_TRUE(cluster.WaitRouterServing(absl::Seconds(30)).ok());
  const double router_back = absl::ToDoubleSeconds(absl::Now() - router_killed);
  ASSERT_TRUE(r.load->WaitForMore(12, absl::Seconds(60)));
  r.load->Stop();
  const auto outcomes = r.load->outcomes();
  const ChurnSummary before =
      tools::Summarize(outcomes, absl::InfinitePast(), r.event);
  const ChurnSummary workers =
      tools::Summarize(outcomes, r.event, router_killed);
  ExpectNothingLost(before, "before");
  // A request in flight when the router was killed ended with it, unless
  // it had just finished: all of those started before the kill.
  int broken_by_router = 0;
  int refused_while_down = 0;
  int other_failures = 0;
  for (const tools::ChurnOutcome& out : outcomes) {
    if (out.start < router_killed && out.end < router_killed) continue;
    if (out.code == 0) {
      EXPECT_TRUE(out.matched) << out.mismatch;
      continue;
    }
    if (out.start < router_killed) {
      ++broken_by_router;
    } else if (out.code == grpc::StatusCode::UNAVAILABLE) {
      ++refused_while_down;
    } else {
      ++other_failures;
    }
  }
  // The killed workers' requests (started before the router's kill and
  // ended before it) lost nothing.
  EXPECT_EQ(workers.mismatched, 0) << workers.first_failure;
  int failed_before_router = 0;
  for (const tools::ChurnOutcome& out : outcomes) {
    if (out.start >= r.event && out.end < router_killed && out.code != 0) {
      ++failed_before_router;
    }
  }
  EXPECT_EQ(failed_before_router, 0) << workers.first_failure;
  EXPECT_EQ(other_failures, 0);
  EXPECT_LE(broken_by_router, 6) << "more broken streams than clients";
  ExpectKvBackToBaseline(cluster);
  Report("SIGKILL decode worker, prefill stage, router", before, workers,
         absl::StrFormat("router kill: %d streams broken with it, %d "
                         "requests refused while it was down (%.2f s until "
                         "it served again); before it, %s",
                         broken_by_router, refused_while_down, router_back,
                         decisions));
}

}  // namespace
}  // namespace pdserve
