// The worker registry: config parsing, re-resolution (a name with several
// addresses), health and load from probes, P/D compatibility, leases, and a
// real grpc.health.v1 probe.
#include "router/worker_registry.h"

#include <gtest/gtest.h>

#include <map>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "pdserve/v1/decode.grpc.pb.h"
#include "pdserve/v1/prefill.grpc.pb.h"
#include "rpc/server.h"

namespace pdserve::router {
namespace {

class FakeResolver : public Resolver {
 public:
  void Set(const std::string& host,
           absl::StatusOr<std::vector<std::string>> a) {
    absl::MutexLock lock(&mu_);
    answers_.insert_or_assign(host, std::move(a));
  }
  absl::StatusOr<std::vector<std::string>> Resolve(const std::string& host,
                                                   int port) override {
    absl::MutexLock lock(&mu_);
    auto it = answers_.find(host);
    if (it == answers_.end()) return absl::UnavailableError("unknown host");
    return it->second;
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, absl::StatusOr<std::vector<std::string>>> answers_;
};

class FakeProber : public WorkerProber {
 public:
  void Set(const std::string& address, ProbeResult result) {
    absl::MutexLock lock(&mu_);
    results_[address] = std::move(result);
  }
  ProbeResult Probe(WorkerRole, const std::string& address,
                    absl::Duration) override {
    absl::MutexLock lock(&mu_);
    auto it = results_.find(address);
    if (it == results_.end()) return {false, "no answer", {}, {}};
    return it->second;
  }
  void Forget(const std::string& address) override {
    absl::MutexLock lock(&mu_);
    forgotten_.push_back(address);
  }
  std::vector<std::string> forgotten() {
    absl::MutexLock lock(&mu_);
    return forgotten_;
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, ProbeResult> results_;
  std::vector<std::string> forgotten_;
};

v1::ModelIdentity Identity() {
  v1::ModelIdentity id;
  id.set_name("stories260K");
  id.set_config_identity("llama:5x64");
  id.set_num_layers(5);
  id.set_num_kv_heads(4);
  id.set_head_dim(8);
  id.set_block_size(16);
  id.set_kv_dtype("f32");
  return id;
}

ProbeResult Serving(std::optional<v1::ModelIdentity> id = Identity(),
                    WorkerLoad load = {}) {
  return {true, "", load, std::move(id)};
}

struct Fixture {
  FakeResolver* resolver;
  FakeProber* prober;
  std::unique_ptr<WorkerRegistry> registry;
};

Fixture MakeRegistry(RegistryConfig config) {
  auto resolver = std::make_unique<FakeResolver>();
  auto prober = std::make_unique<FakeProber>();
  Fixture f{resolver.get(), prober.get(), nullptr};
  f.registry = std::make_unique<WorkerRegistry>(
      std::move(config), std::move(resolver), std::move(prober));
  return f;
}

TEST(WorkerRegistryTest, ParsesConfigFile) {
  absl::StatusOr<RegistryConfig> config = ParseRegistryConfig(R"({
      "prefill": ["prefill.pd.svc:50051"],
      "decode": ["decode-0:6000", "[::1]:6001"],
      "refresh_interval_ms": 250,
      "model": {"name": "stories260K", "block_size": 16, "kv_dtype": "f32"}})");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->prefill, std::vector<std::string>{"prefill.pd.svc:50051"});
  EXPECT_EQ(config->decode.size(), 2u);
  EXPECT_EQ(config->refresh_interval, absl::Milliseconds(250));
  ASSERT_TRUE(config->model.has_value());
  EXPECT_EQ(config->model->block_size(), 16);
}

TEST(WorkerRegistryTest, BadConfigIsInvalidArgument) {
  for (const char* bad :
       {"", "[]", "{\"prefill\": \"a:1\"}", "{\"decode\": [\"nohost\"]}",
        "{\"decode\": [\"a:0\"]}", "{\"decode\": [\"a:99999\"]}",
        "{\"decode\": [7]}", "{\"refresh_interval_ms\": -1}",
        "{\"model\": {\"block_size\": \"16\"}}", "{\"model\": 3}",
        "{\"prefill\": [\"a:1\"],"}) {
    EXPECT_EQ(ParseRegistryConfig(bad).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  EXPECT_EQ(ParseTargetList("a:1, b:2").value(),
            (std::vector<std::string>{"a:1", "b:2"}));
  EXPECT_FALSE(ParseTargetList("a:1,b").ok());
  EXPECT_TRUE(ParseTargetList("").value().empty());
}

TEST(WorkerRegistryTest, HeadlessNameBecomesSeveralWorkersAndIsReResolved) {
  RegistryConfig config;
  config.decode = {"decode.svc:6000"};
  config.prefill = {"prefill.svc:7000"};
  Fixture f = MakeRegistry(config);
  f.resolver->Set("decode.svc",
                  std::vector<std::string>{"10.0.0.1:6000", "10.0.0.2:6000"});
  f.resolver->Set("prefill.svc", std::vector<std::string>{"10.0.1.1:7000"});
  for (auto a :
       {"10.0.0.1:6000", "10.0.0.2:6000", "10.0.0.3:6000", "10.0.1.1:7000"}) {
    f.prober->Set(a, Serving());
  }
  f.registry->Refresh();
  EXPECT_EQ(f.registry->Snapshot(WorkerRole::kDecode).size(), 2u);
  EXPECT_EQ(f.registry->Snapshot(WorkerRole::kPrefill).size(), 1u);

  // A pod comes, a pod goes.
  f.resolver->Set("decode.svc",
                  std::vector<std::string>{"10.0.0.2:6000", "10.0.0.3:6000"});
  f.registry->Refresh();
  std::vector<WorkerView> decode = f.registry->Snapshot(WorkerRole::kDecode);
  ASSERT_EQ(decode.size(), 2u);
  EXPECT_EQ(decode[0].id, "10.0.0.2:6000");
  EXPECT_EQ(decode[1].id, "10.0.0.3:6000");
  EXPECT_EQ(f.prober->forgotten(), std::vector<std::string>{"10.0.0.1:6000"});

  // A DNS failure keeps the last known addresses.
  f.resolver->Set("decode.svc", absl::UnavailableError("SERVFAIL"));
  f.registry->Refresh();
  EXPECT_EQ(f.registry->Snapshot(WorkerRole::kDecode).size(), 2u);
}

TEST(WorkerRegistryTest, HealthAndLoadComeFromProbes) {
  RegistryConfig config;
  config.decode = {"d:1"};
  Fixture f = MakeRegistry(config);
  f.resolver->Set("d", std::vector<std::string>{"10.0.0.1:1", "10.0.0.2:1"});
  f.prober->Set("10.0.0.1:1", Serving(Identity(), {3, 4, 50, 100}));
  f.prober->Set("10.0.0.2:1", {false, "health: not serving", {}, {}});
  f.registry->Refresh();
  std::vector<WorkerView> views = f.registry->Snapshot(WorkerRole::kDecode);
  ASSERT_EQ(views.size(), 2u);
  EXPECT_TRUE(views[0].eligible);
  EXPECT_EQ(views[0].load.running, 4);
  EXPECT_DOUBLE_EQ(views[0].load.KvUsage(), 0.5);
  EXPECT_FALSE(views[1].eligible);

  auto policy = MakeAssignmentPolicy("round-robin").value();
  for (int i = 0; i < 5; ++i) {
    absl::StatusOr<WorkerLease> lease =
        f.registry->Assign(WorkerRole::kDecode, *policy, {});
    ASSERT_TRUE(lease.ok());
    EXPECT_EQ(lease->address(), "10.0.0.1:1");
  }
  // Failover: the router saw it fail; nothing healthy is left.
  f.registry->MarkUnhealthy("10.0.0.1:1", "UNAVAILABLE on StreamTokens");
  absl::StatusOr<WorkerLease> none =
      f.registry->Assign(WorkerRole::kDecode, *policy, {});
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(
      f.registry->Assign(WorkerRole::kPrefill, *policy, {}).status().code(),
      absl::StatusCode::kUnavailable);
  // The next probe restores both.
  f.prober->Set("10.0.0.2:1", Serving());
  f.registry->Refresh();
  EXPECT_TRUE(f.registry->Assign(WorkerRole::kDecode, *policy, {}).ok());
  EXPECT_EQ(f.registry->Snapshot(WorkerRole::kDecode)[1].eligible, true);
}

TEST(WorkerRegistryTest, LeasesCountAssignedRequests) {
  RegistryConfig config;
  config.decode = {"d:1"};
  Fixture f = MakeRegistry(config);
  f.resolver->Set("d", std::vector<std::string>{"10.0.0.1:1"});
  f.prober->Set("10.0.0.1:1", Serving());
  f.registry->Refresh();
  auto policy = MakeAssignmentPolicy("least-loaded").value();
  {
    WorkerLease a =
        f.registry->Assign(WorkerRole::kDecode, *policy, {}).value();
    WorkerLease b =
        f.registry->Assign(WorkerRole::kDecode, *policy, {}).value();
    EXPECT_EQ(f.registry->Snapshot(WorkerRole::kDecode)[0].assigned, 2);
    WorkerLease moved = std::move(a);
    EXPECT_EQ(f.registry->Snapshot(WorkerRole::kDecode)[0].assigned, 2);
    b.Release();
    EXPECT_EQ(f.registry->Snapshot(WorkerRole::kDecode)[0].assigned, 1);
  }
  EXPECT_EQ(f.registry->Snapshot(WorkerRole::kDecode)[0].assigned, 0);
  // A lease may outlive its worker's entry.
  WorkerLease late =
      f.registry->Assign(WorkerRole::kDecode, *policy, {}).value();
  f.resolver->Set("d", std::vector<std::string>{"10.0.0.9:1"});
  f.registry->Refresh();
  late.Release();
}

TEST(WorkerRegistryTest, IncompatibleWorkersStayOutOfRotation) {
  RegistryConfig config;
  config.prefill = {"p:1"};
  config.decode = {"d:1"};
  Fixture f = MakeRegistry(config);
  f.resolver->Set("p", std::vector<std::string>{"10.0.1.1:1", "10.0.1.2:1"});
  f.resolver->Set("d", std::vector<std::string>{"10.0.0.1:1"});
  v1::ModelIdentity other_layout = Identity();
  other_layout.set_block_size(32);
  f.prober->Set("10.0.1.1:1", Serving());
  f.prober->Set("10.0.1.2:1", Serving(other_layout));
  f.prober->Set("10.0.0.1:1", Serving());
  f.registry->Refresh();
  ASSERT_TRUE(f.registry->model().has_value());
  std::vector<WorkerStatus> workers = f.registry->Workers();
  ASSERT_EQ(workers.size(), 3u);
  EXPECT_TRUE(workers[0].compatible);
  EXPECT_FALSE(workers[1].compatible);
  EXPECT_NE(workers[1].error.find("block_size"), std::string::npos)
      << workers[1].error;
  EXPECT_FALSE(f.registry->Snapshot(WorkerRole::kPrefill)[1].eligible);

  EXPECT_TRUE(CheckCompatible(Identity(), Identity()).ok());
  v1::ModelIdentity dtype = Identity();
  dtype.set_kv_dtype("bf16");
  EXPECT_EQ(CheckCompatible(Identity(), dtype).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(WorkerRegistryTest, ConfiguredModelIsTheReference) {
  RegistryConfig config;
  config.decode = {"d:1"};
  v1::ModelIdentity configured = Identity();
  configured.set_name("other-model");
  config.model = configured;
  Fixture f = MakeRegistry(config);
  f.resolver->Set("d", std::vector<std::string>{"10.0.0.1:1"});
  f.prober->Set("10.0.0.1:1", Serving());
  f.registry->Refresh();
  EXPECT_FALSE(f.registry->Workers()[0].compatible);
}

TEST(WorkerRegistryTest, KvDTypeIsPinnedByThePrefillGroups) {
  // What the router knows from its model file: no KV dtype.
  RegistryConfig config;
  config.prefill = {"p:1"};
  config.decode = {"d:1"};
  v1::ModelIdentity from_model = Identity();
  from_model.clear_kv_dtype();
  config.model = from_model;
  Fixture f = MakeRegistry(config);
  f.resolver->Set("p", std::vector<std::string>{"10.0.1.1:1"});
  f.resolver->Set("d", std::vector<std::string>{"10.0.0.1:1", "10.0.0.2:1"});
  v1::ModelIdentity bf16 = Identity();
  bf16.set_kv_dtype("bf16");
  f.prober->Set("10.0.1.1:1", Serving());  // sends f32
  f.prober->Set("10.0.0.1:1", Serving(bf16));
  f.prober->Set("10.0.0.2:1", Serving());
  f.registry->Refresh();
  ASSERT_TRUE(f.registry->model().has_value());
  EXPECT_EQ(f.registry->model()->kv_dtype(), "f32");
  for (const WorkerStatus& w : f.registry->Workers()) {
    const bool stranger = w.address == "10.0.0.1:1";
    EXPECT_EQ(w.compatible, !stranger) << w.address << ": " << w.error;
    if (stranger) {
      EXPECT_NE(w.error.find("kv_dtype is bf16"), std::string::npos) << w.error;
    }
  }
}

TEST(WorkerRegistryTest, FieldsTheClusterLeavesUnsetMatchAnything) {
  // A config file naming only the model and the block size.
  v1::ModelIdentity partial;
  partial.set_name(Identity().name());
  partial.set_block_size(Identity().block_size());
  EXPECT_TRUE(CheckCompatible(partial, Identity()).ok());
  v1::ModelIdentity other_block = Identity();
  other_block.set_block_size(Identity().block_size() * 2);
  absl::Status s = CheckCompatible(partial, other_block);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("block_size"), absl::string_view::npos);
  v1::ModelIdentity other_name = Identity();
  other_name.set_name("another");
  EXPECT_FALSE(CheckCompatible(partial, other_name).ok());
}

TEST(WorkerRegistryTest, RealHealthProbeAndSystemResolver) {
  absl::StatusOr<std::unique_ptr<rpc::RunningServer>> server =
      rpc::RunningServer::Start("127.0.0.1:0", {});
  ASSERT_TRUE(server.ok()) << server.status();
  RegistryConfig config;
  config.decode = {absl::StrCat("localhost:", (*server)->port())};
  config.refresh_interval = absl::Milliseconds(50);
  WorkerRegistry registry(config, MakeSystemResolver(), MakeGrpcWorkerProber());
  registry.Refresh();
  std::vector<WorkerStatus> workers = registry.Workers();
  ASSERT_GE(workers.size(), 1u);  // localhost: 127.0.0.1 and maybe ::1
  bool any_serving = false;
  for (const WorkerStatus& w : workers) any_serving |= w.serving;
  EXPECT_TRUE(any_serving);

  // NOT_SERVING is noticed by the background refresh.
  registry.StartBackgroundRefresh();
  (*server)->SetServing(false);
  absl::Time until = absl::Now() + absl::Seconds(5);
  bool all_down = false;
  while (!all_down && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(20));
    all_down = true;
    for (const WorkerStatus& w : registry.Workers()) all_down &= !w.serving;
  }
  EXPECT_TRUE(all_down);
}

// Stand-ins for the workers' GetLoad (the rest of their APIs is unused).
class FakeDecodeWorker final : public v1::DecodeWorker::Service {
  grpc::Status GetLoad(grpc::ServerContext*, const v1::GetLoadRequest*,
                       v1::DecodeLoad* load) override {
    load->set_running(3);
    load->set_waiting(1);
    load->set_awaiting_kv(2);
    load->set_kv_blocks_used(30);
    load->set_kv_blocks_total(120);
    return grpc::Status::OK;
  }
};

class FakePrefillGroup final : public v1::PrefillGroup::Service {
 public:
  std::atomic<bool> serving{true};
  grpc::Status GetLoad(grpc::ServerContext*, const v1::PrefillLoadRequest*,
                       v1::PrefillLoad* load) override {
    load->set_serving(serving.load());
    load->set_queued(4);
    load->set_in_flight(2);
    load->set_kv_blocks_used(10);
    load->set_kv_blocks_total(40);
    return grpc::Status::OK;
  }
};

TEST(WorkerRegistryTest, RealProbeReadsTheWorkersLoadReports) {
  FakeDecodeWorker decode;
  FakePrefillGroup prefill;
  auto decode_server = rpc::RunningServer::Start("127.0.0.1:0", {&decode});
  auto prefill_server = rpc::RunningServer::Start("127.0.0.1:0", {&prefill});
  ASSERT_TRUE(decode_server.ok() && prefill_server.ok());
  RegistryConfig config;
  config.decode = {(*decode_server)->address()};
  config.prefill = {(*prefill_server)->address()};
  WorkerRegistry registry(config, MakeSystemResolver(), MakeGrpcWorkerProber());
  registry.Refresh();
  std::vector<WorkerView> d = registry.Snapshot(WorkerRole::kDecode);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_TRUE(d[0].eligible);
  EXPECT_EQ(d[0].load.queued, 3);  // waiting + awaiting_kv
  EXPECT_EQ(d[0].load.running, 3);
  EXPECT_DOUBLE_EQ(d[0].load.KvUsage(), 0.25);
  std::vector<WorkerView> p = registry.Snapshot(WorkerRole::kPrefill);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_TRUE(p[0].eligible);
  EXPECT_EQ(p[0].load.queued, 4);
  EXPECT_EQ(p[0].load.running, 2);

  // A prefill group with a stage down leaves the rotation, and rejoins.
  prefill.serving = false;
  registry.Refresh();
  EXPECT_FALSE(registry.Snapshot(WorkerRole::kPrefill)[0].eligible);
  prefill.serving = true;
  registry.Refresh();
  EXPECT_TRUE(registry.Snapshot(WorkerRole::kPrefill)[0].eligible);

  // A worker that is gone is unhealthy within one probe timeout.
  decode_server->reset();
  registry.Refresh();
  EXPECT_FALSE(registry.Snapshot(WorkerRole::kDecode)[0].eligible);
}

}  // namespace
}  // namespace pdserve::router
