#include "tools/elastic_scenarios.h"

#include <grpcpp/grpcpp.h>
#include <httplib.h>
#include <signal.h>

#include <functional>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "metrics/exposition.h"
#include "pdserve/v1/decode.grpc.pb.h"
#include "pdserve/v1/prefill.grpc.pb.h"
#include "rpc/auth.h"

namespace pdserve::tools {
namespace {

bool Eventually(const std::function<bool()>& condition,
                absl::Duration timeout) {
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

// The router's counter `name` summed over the series whose `label` is
// `value`; -1 when the router cannot be scraped.
double RouterCounter(const LocalCluster& cluster, const std::string& name,
                     const std::string& label, const std::string& value) {
  auto it = cluster.metrics_addresses().find("router");
  if (it == cluster.metrics_addresses().end()) return -1;
  const size_t colon = it->second.rfind(':');
  httplib::Client client(it->second.substr(0, colon),
                         std::stoi(it->second.substr(colon + 1)));
  auto res = client.Get("/metrics");
  if (!res || res->status != 200) return -1;
  auto samples = metrics::ParseExposition(res->body);
  if (!samples.ok()) return -1;
  double sum = 0;
  for (const metrics::Sample& s : *samples) {
    if (s.name == name && s.Label(label) == value) sum += s.value;
  }
  return sum;
}

// A scenario in progress: the cluster, its load, the result being filled.
struct Run {
  std::unique_ptr<LocalCluster> cluster;
  std::unique_ptr<ChurnLoad> load;
  ScenarioResult result;
  absl::Time change;  // the change's start
  int steps = 12;

  absl::Status Step() {
    if (!load->WaitForMore(steps, absl::Seconds(120))) {
      return absl::DeadlineExceededError(
          absl::StrCat(result.name, ": the load stalled"));
    }
    return absl::OkStatus();
  }
  // Seconds until decode worker `w` (started at `since`) served a request.
  absl::Status TakesTraffic(int w, absl::Time since) {
    if (!Eventually([&] { return DecodeLoadOf(*cluster, w).steps() > 0; },
                    absl::Seconds(60))) {
      return absl::DeadlineExceededError(
          absl::StrCat("decode worker ", w, " never took traffic"));
    }
    result.time_to_traffic.push_back(
        absl::ToDoubleSeconds(absl::Now() - since));
    return absl::OkStatus();
  }
  absl::Status GroupTakesTraffic(int g, absl::Time since) {
    if (!Eventually([&] { return PrefillLoadOf(*cluster, g).completed() > 0; },
                    absl::Seconds(60))) {
      return absl::DeadlineExceededError(
          absl::StrCat("prefill group ", g, " never took traffic"));
    }
    result.time_to_traffic.push_back(
        absl::ToDoubleSeconds(absl::Now() - since));
    return absl::OkStatus();
  }
  void ReadRouterCounters() {
    result.migrations = RouterCounter(
        *cluster, "pdserve_router_migrations_total", "outcome", "started");
    result.prefilled_by_decode_for_want_of_a_group =
        RouterCounter(*cluster, "pdserve_router_prefill_decisions_total",
                      "where", "decode_no_group");
  }
  // Stops the load and fills the summaries, the losses and the KV check.
  void Finish(absl::Time router_killed = absl::InfiniteFuture()) {
    load->Stop();
    const std::vector<ChurnOutcome> outcomes = load->outcomes();
    result.before = Summarize(outcomes, absl::InfinitePast(), change);
    result.during = Summarize(outcomes, change);
    for (const ChurnOutcome& o : outcomes) {
      const bool ok = o.code == 0 && o.matched;
      if (ok) continue;
      // The router's own kill: its streams then, and refusals while it was
      // down, are that scenario's counted figures, not losses.
      if (o.end >= router_killed && o.code != 0) {
        if (o.start < router_killed) {
          ++result.broken_by_router;
          continue;
        }
        if (o.code == grpc::StatusCode::UNAVAILABLE) {
          ++result.refused_while_router_down;
          continue;
        }
      }
      ++result.lost;
      if (result.first_loss.empty()) {
        result.first_loss = o.code != 0
                                ? absl::StrCat("code ", o.code, ": ", o.error)
                                : o.mismatch;
      }
    }
    bool back = true;
    for (int w : cluster->live_decode_workers()) {
      const bool idle = Eventually(
          [&] { return DecodeLoadOf(*cluster, w).kv_blocks_used() == 0; },
          absl::Seconds(20));
      if (!idle) {
        back = false;
        absl::StrAppend(&result.kv_detail, "decode worker ", w, ": ",
                        DecodeLoadOf(*cluster, w).kv_blocks_used(),
                        " blocks used; ");
      }
    }
    for (int g : cluster->live_prefill_groups()) {
      const bool idle = Eventually(
          [&] {
            const v1::PrefillLoad l = PrefillLoadOf(*cluster, g);
            return l.kv_blocks_used() == 0 && l.in_flight() == 0;
          },
          absl::Seconds(20));
      if (!idle) {
        back = false;
        absl::StrAppend(&result.kv_detail, "prefill group ", g, " busy; ");
      }
    }
    result.kv_back_to_baseline = back;
  }
};

// Starts the cluster, records the undisturbed answers, runs the load until
// `warmup_requests` completed.
absl::StatusOr<std::unique_ptr<Run>> Start(const std::string& name,
                                           ScenarioOptions options) {
  auto run = std::make_unique<Run>();
  run->result.name = name;
  run->steps = options.requests_per_step;
  options.cluster.metrics_port_base = 0;  // the router's counters
  PDS_ASSIGN_OR_RETURN(run->cluster, LocalCluster::Start(options.cluster));
  PDS_RETURN_IF_ERROR(Reference(run->cluster->grpc_address(),
                                run->cluster->model_name(), &options.requests));
  run->load = std::make_unique<ChurnLoad>(
      run->cluster->grpc_address(), run->cluster->model_name(),
      std::move(options.requests), options.clients);
  run->load->Start();
  if (!run->load->WaitForMore(options.warmup_requests, absl::Seconds(120))) {
    return absl::DeadlineExceededError(absl::StrCat(name, ": no warm-up"));
  }
  run->change = absl::Now();
  return run;
}

absl::Status RemoveDecode(Run& run, int worker, bool drain) {
  const absl::Time start = absl::Now();
  PDS_RETURN_IF_ERROR(
      run.cluster->RemoveDecodeWorker(worker, drain, absl::Seconds(90)));
  run.result.drain_seconds.push_back(
      absl::ToDoubleSeconds(absl::Now() - start));
  return absl::OkStatus();
}

absl::Status RemoveGroup(Run& run, int group) {
  const absl::Time start = absl::Now();
  PDS_RETURN_IF_ERROR(
      run.cluster->RemovePrefillGroup(group, true, absl::Seconds(90)));
  run.result.drain_seconds.push_back(
      absl::ToDoubleSeconds(absl::Now() - start));
  return absl::OkStatus();
}

// Waits (briefly) until decode worker `w` is streaming, so that a kill or a
// drain-less stop meets streams to migrate: on a loaded 2-core machine the
// short stories260K streams otherwise leave it idle now and then at the
// moment of the change, and the scenario checks nothing.
void WaitUntilStreaming(const LocalCluster& cluster, int w) {
  // One channel for the whole poll: the answer is then ~0.1 ms old when the
  // change follows, not a fresh connection's milliseconds.
  auto stub = v1::DecodeWorker::NewStub(rpc::CreateChannel(
      cluster.decode_addresses()[w], cluster.internal_token()));
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (absl::Now() < deadline) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
    v1::DecodeLoad load;
    if (stub->GetLoad(&context, v1::GetLoadRequest(), &load).ok() &&
        load.running() > 0) {
      return;
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
}

void SuperviseFor(LocalCluster& cluster, absl::Duration d) {
  const absl::Time until = absl::Now() + d;
  while (absl::Now() < until) {
    (void)cluster.Supervise();
    absl::SleepFor(absl::Milliseconds(50));
  }
}

}  // namespace

absl::StatusOr<ScenarioResult> ScaleDecodeWorkers(ScenarioOptions options) {
  options.cluster.dns_discovery = true;
  options.cluster.decode_workers = 1;
  PDS_ASSIGN_OR_RETURN(std::unique_ptr<Run> run,
                       Start("decode workers 1 -> 3 -> 1", options));
  std::vector<int> added;
  for (int i = 0; i < 2; ++i) {
    const absl::Time started = absl::Now();
    PDS_ASSIGN_OR_RETURN(int w, run->cluster->AddDecodeWorker());
    PDS_RETURN_IF_ERROR(run->TakesTraffic(w, started));
    added.push_back(w);
  }
  PDS_RETURN_IF_ERROR(run->Step());
  for (auto it = added.rbegin(); it != added.rend(); ++it) {
    PDS_RETURN_IF_ERROR(RemoveDecode(*run, *it, /*drain=*/true));
  }
  PDS_RETURN_IF_ERROR(run->Step());
  run->ReadRouterCounters();
  run->Finish();
  return run->result;
}

absl::StatusOr<ScenarioResult> ScalePrefillGroups(ScenarioOptions options) {
  options.cluster.dns_discovery = true;
  options.cluster.prefill_groups = 1;
  PDS_ASSIGN_OR_RETURN(std::unique_ptr<Run> run,
                       Start("prefill groups 1 -> 2 -> 1", options));
  const absl::Time started = absl::Now();
  PDS_ASSIGN_OR_RETURN(int g, run->cluster->AddPrefillGroup());
  PDS_RETURN_IF_ERROR(run->GroupTakesTraffic(g, started));
  PDS_RETURN_IF_ERROR(run->Step());
  PDS_RETURN_IF_ERROR(RemoveGroup(*run, 0));
  PDS_RETURN_IF_ERROR(run->Step());
  run->ReadRouterCounters();
  run->Finish();
  return run->result;
}

absl::StatusOr<ScenarioResult> RollingRestart(ScenarioOptions options) {
  options.cluster.dns_discovery = true;
  PDS_ASSIGN_OR_RETURN(std::unique_ptr<Run> run,
                       Start("rolling restart of every worker", options));
  for (int old_worker : run->cluster->live_decode_workers()) {
    const absl::Time started = absl::Now();
    PDS_ASSIGN_OR_RETURN(int fresh, run->cluster->AddDecodeWorker());
    PDS_RETURN_IF_ERROR(run->TakesTraffic(fresh, started));
    WaitUntilStreaming(*run->cluster, old_worker);
    PDS_RETURN_IF_ERROR(RemoveDecode(*run, old_worker, /*drain=*/true));
  }
  for (int old_group : run->cluster->live_prefill_groups()) {
    const absl::Time started = absl::Now();
    PDS_ASSIGN_OR_RETURN(int fresh, run->cluster->AddPrefillGroup());
    PDS_RETURN_IF_ERROR(run->GroupTakesTraffic(fresh, started));
    PDS_RETURN_IF_ERROR(RemoveGroup(*run, old_group));
  }
  PDS_RETURN_IF_ERROR(run->Step());
  run->ReadRouterCounters();
  run->Finish();
  return run->result;
}

absl::StatusOr<ScenarioResult> DrainDecodeWorker(ScenarioOptions options) {
  options.cluster.dns_discovery = true;
  options.cluster.decode_workers = 2;
  PDS_ASSIGN_OR_RETURN(std::unique_ptr<Run> run,
                       Start("SIGTERM a decode worker (drain)", options));
  PDS_RETURN_IF_ERROR(RemoveDecode(*run, 0, /*drain=*/true));
  PDS_RETURN_IF_ERROR(run->Step());
  run->ReadRouterCounters();
  run->Finish();
  return run->result;
}

absl::StatusOr<ScenarioResult> KillDecodeWorker(ScenarioOptions options) {
  options.cluster.decode_workers = 2;
  PDS_ASSIGN_OR_RETURN(std::unique_ptr<Run> run,
                       Start("SIGKILL a decode worker", options));
  WaitUntilStreaming(*run->cluster, 0);
  run->cluster->KillDecode(0);
  SuperviseFor(*run->cluster, absl::Seconds(2));
  PDS_RETURN_IF_ERROR(run->Step());
  run->ReadRouterCounters();
  run->Finish();
  return run->result;
}

absl::StatusOr<ScenarioResult> KillOnlyPrefillStage(ScenarioOptions options) {
  options.cluster.prefill_groups = 1;
  options.cluster.stages = std::max(2, options.cluster.stages);
  PDS_ASSIGN_OR_RETURN(
      std::unique_ptr<Run> run,
      Start("SIGKILL a stage of the only prefill group", options));
  const int64_t completed = PrefillLoadOf(*run->cluster, 0).completed();
  run->cluster->KillPrefillStage(0, 1);
  const absl::Time killed = absl::Now();
  // Supervised until the group prefills again.
  bool back = false;
  while (!back && absl::Now() - killed < absl::Seconds(60)) {
    (void)run->cluster->Supervise();
    const v1::PrefillLoad load = PrefillLoadOf(*run->cluster, 0);
    back =
        load.serving() && load.completed() > 0 && load.completed() != completed;
    absl::SleepFor(absl::Milliseconds(50));
  }
  if (!back) return absl::DeadlineExceededError("the group did not return");
  run->result.time_to_traffic.push_back(
      absl::ToDoubleSeconds(absl::Now() - killed));
  PDS_RETURN_IF_ERROR(run->Step());
  run->ReadRouterCounters();
  run->Finish();
  return run->result;
}

absl::StatusOr<ScenarioResult> KillRouter(ScenarioOptions options) {
  PDS_ASSIGN_OR_RETURN(std::unique_ptr<Run> run,
                       Start("SIGKILL the router", options));
  run->ReadRouterCounters();
  const absl::Time killed = absl::Now();
  run->cluster->KillRouter();
  SuperviseFor(*run->cluster, absl::Seconds(1));
  PDS_RETURN_IF_ERROR(run->cluster->WaitRouterServing(absl::Seconds(60)));
  run->result.router_back_seconds = absl::ToDoubleSeconds(absl::Now() - killed);
  PDS_RETURN_IF_ERROR(run->Step());
  run->Finish(killed);
  return run->result;
}

std::string Describe(const ScenarioResult& r) {
  std::string out = absl::StrFormat(
      "%s\n  before: %s\n  during: %s\n  lost %d; migrated %.0f; prefilled "
      "by decode for want of a group %.0f; KV %s",
      r.name, Describe(r.before), Describe(r.during), r.lost, r.migrations,
      r.prefilled_by_decode_for_want_of_a_group,
      r.kv_back_to_baseline ? "back to baseline" : r.kv_detail);
  if (!r.first_loss.empty()) {
    out = absl::StrCat(out, "\n  first loss: ", r.first_loss);
  }
  for (double t : r.time_to_traffic) {
    absl::StrAppend(&out, absl::StrFormat("\n  new worker took traffic after "
                                          "%.2f s",
                                          t));
  }
  for (double t : r.drain_seconds) {
    absl::StrAppend(
        &out, absl::StrFormat("\n  a worker drained and left in %.2f s", t));
  }
  if (r.router_back_seconds > 0) {
    absl::StrAppend(
        &out, absl::StrFormat("\n  router kill: %d streams broken with it, %d "
                              "requests refused while it was down; serving "
                              "again after %.2f s",
                              r.broken_by_router, r.refused_while_router_down,
                              r.router_back_seconds));
  }
  return out;
}

}  // namespace pdserve::tools
