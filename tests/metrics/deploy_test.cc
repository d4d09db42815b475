// The shipped deployment files, checked offline: promtool accepts the
// Prometheus configurations; the dashboards are what their generator
// writes; the Kustomize overlays render (scripts/check_manifests.mjs,
// cross-checked with `kubectl kustomize` where installed) and validate
// against the Kubernetes schemas; and the decode and prefill containers of
// the cpu-demo overlay, started with exactly the commands, arguments and
// environment the manifests give (addresses mapped to loopback), serve a
// request with the golden output.
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "metrics/cluster_util.h"
#include "nlohmann/json.hpp"
#include "pdserve/v1/generate.grpc.pb.h"
#include "rpc/auth.h"
#include "testing/golden.h"
#include "testing/shell.h"

namespace pdserve::metrics {
namespace {

namespace fs = std::filesystem;
using testing::Child;
using testing::Slurp;

const std::string kSource = PDSERVE_SOURCE_DIR;

using ::pdserve::testing::CommandResult;
CommandResult Shell(const std::string& command) {
  return ::pdserve::testing::RunShell(command, kSource);
}

std::string TempDir() {
  char tmpl[] = "/tmp/deploy_test.XXXXXX";
  return mkdtemp(tmpl);
}

TEST(DeployTest, PromtoolAcceptsTheShippedConfigs) {
  for (const char* config : {"deploy/prometheus/prometheus-local.yml",
                             "deploy/prometheus/prometheus-kubernetes.yml"}) {
    const CommandResult r =
        Shell(absl::StrCat("promtool check config ", config));
    EXPECT_EQ(r.code, 0) << config << "\n" << r.output;
    EXPECT_TRUE(absl::StrContains(r.output, "SUCCESS")) << r.output;
  }
  // And promtool does reject a broken one (the check can fail).
  const std::string dir = TempDir();
  std::ofstream(dir + "/bad.yml")
      << "scrape_configs:\n  - job_name: x\n    scrape_interval: soon\n";
  const CommandResult bad =
      Shell(absl::StrCat("promtool check config ", dir, "/bad.yml"));
  EXPECT_NE(bad.code, 0) << bad.output;
  fs::remove_all(dir);
}

TEST(DeployTest, DashboardsAreWhatTheGeneratorWrites) {
  const std::string dir = TempDir();
  const CommandResult gen = Shell(
      absl::StrCat("python3 deploy/grafana/generate_dashboards.py ", dir));
  ASSERT_EQ(gen.code, 0) << gen.output;
  int files = 0;
  for (const auto& entry :
       fs::directory_iterator(kSource + "/deploy/grafana/dashboards")) {
    ++files;
    EXPECT_EQ(Slurp(entry.path()),
              Slurp(dir + "/" + entry.path().filename().string()))
        << entry.path() << " differs from generate_dashboards.py's output";
  }
  EXPECT_EQ(files, 4);
  fs::remove_all(dir);
}

TEST(DeployTest, DockerfilesCopyWhatTheBuildMakes) {
  // The images copy from the build stage's tree (scripts/setup.sh builds
  // into build/): every such path must be something this build makes too,
  // so a renamed binary cannot leave the image without it unnoticed. The
  // CUDA image (the gpu overlay's) copies the same set.
  for (const char* name : {"Dockerfile", "Dockerfile.cuda"}) {
    SCOPED_TRACE(name);
    const std::string dockerfile =
        Slurp(kSource + "/deploy/docker/" + std::string(name));
    ASSERT_FALSE(dockerfile.empty());
    std::regex path_re("/(?:src/)?build/([A-Za-z0-9_./-]+)");
    int checked = 0;
    for (auto it = std::sregex_iterator(dockerfile.begin(), dockerfile.end(),
                                        path_re);
         it != std::sregex_iterator(); ++it) {
      const std::string rel = (*it)[1].str();
      if (rel.empty() || rel.back() == '/') continue;
      EXPECT_TRUE(fs::exists(fs::path(PDSERVE_BINARY_DIR) / rel))
          << "the Dockerfile copies build/" << rel
          << ", which this build lacks";
      ++checked;
    }
    // pdserve, pdserve-cluster, the shim, prefill_worker, decode_worker,
    // router, layout_report.
    EXPECT_GE(checked, 7) << dockerfile;
    // The entry point the prefill LeaderWorkerSet runs is in the image.
    EXPECT_TRUE(absl::StrContains(
        dockerfile,
        "COPY deploy/docker/prefill-stage.sh /opt/pdserve/bin/prefill-stage"));
  }
  // The CUDA build is the one the gpu overlay's image holds.
  EXPECT_TRUE(absl::StrContains(
      Slurp(kSource + "/deploy/docker/Dockerfile.cuda"), "-DPDSERVE_CUDA=ON"));
  EXPECT_TRUE(absl::StrContains(
      Slurp(kSource + "/deploy/kubernetes/overlays/gpu/kustomization.yaml"),
      "Dockerfile.cuda"));
}

// Installs the npm packages (idempotent) and renders + validates overlays.
CommandResult CheckManifests(const std::string& overlays,
                             const std::string& out = "") {
  const CommandResult setup =
      Shell(absl::StrCat("scripts/setup_deploy_checks.sh '", PDSERVE_BINARY_DIR,
                         "/deploy-checks'"));
  if (setup.code != 0) return setup;
  return Shell(absl::StrCat("node scripts/check_manifests.mjs --modules '",
                            PDSERVE_BINARY_DIR,
                            "/deploy-checks' --compare-kubectl ",
                            out.empty() ? "" : "--out " + out, " ", overlays));
}

TEST(DeployTest, ManifestsRenderAndValidateOffline) {
  const CommandResult r = CheckManifests(
      "deploy/kubernetes/overlays/cpu-demo deploy/kubernetes/overlays/gpu");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(absl::StrContains(r.output, "manifests valid")) << r.output;
  std::printf("%s", r.output.c_str());

  // A schema error in a copy of the tree is caught.
  const std::string dir = TempDir();
  fs::copy(kSource + "/deploy", dir + "/deploy", fs::copy_options::recursive);
  const std::string decode = dir + "/deploy/kubernetes/base/decode.yaml";
  std::string text = Slurp(decode);
  ASSERT_TRUE(absl::StrContains(text, "replicas: 1"));
  std::ofstream(decode) << absl::StrReplaceAll(
      text, {{"replicas: 1", "replicas: \"one\""}});
  const CommandResult bad =
      CheckManifests(absl::StrCat(dir, "/deploy/kubernetes/overlays/cpu-demo"));
  EXPECT_NE(bad.code, 0) << bad.output;
  EXPECT_TRUE(absl::StrContains(bad.output, "replicas")) << bad.output;
  std::ofstream(decode) << text;

  // The CRDs' schemas: a KEDA field of the wrong type, a LeaderWorkerSet
  // field that does not exist, an enum value it does not take.
  const std::string scaling = dir + "/deploy/kubernetes/base/autoscaling.yaml";
  const std::string scaling_text = Slurp(scaling);
  ASSERT_TRUE(absl::StrContains(scaling_text, "maxReplicaCount: 16"));
  std::ofstream(scaling) << absl::StrReplaceAll(
      scaling_text, {{"maxReplicaCount: 16", "maxReplicaCount: lots"}});
  const std::string groups = dir + "/deploy/kubernetes/base/prefill.yaml";
  const std::string groups_text = Slurp(groups);
  ASSERT_TRUE(absl::StrContains(groups_text, "startupPolicy: LeaderCreated"));
  std::ofstream(groups) << absl::StrReplaceAll(
      groups_text, {{"startupPolicy: LeaderCreated",
                     "startupPolicy: WhenReady\n  groupsPerNode: 2"}});
  const CommandResult bad_crds =
      CheckManifests(absl::StrCat(dir, "/deploy/kubernetes/overlays/cpu-demo"));
  EXPECT_NE(bad_crds.code, 0) << bad_crds.output;
  EXPECT_TRUE(absl::StrContains(bad_crds.output, "maxReplicaCount"))
      << bad_crds.output;
  EXPECT_TRUE(absl::StrContains(bad_crds.output, "spec.startupPolicy must be"))
      << bad_crds.output;
  EXPECT_TRUE(absl::StrContains(bad_crds.output, "no field spec.groupsPerNode"))
      << bad_crds.output;
  std::ofstream(scaling) << scaling_text;
  std::ofstream(groups) << groups_text;

  // A drain longer than the pod's grace period would be cut by SIGKILL.
  std::ofstream(decode) << absl::StrReplaceAll(
      text, {{"terminationGracePeriodSeconds: 60",
              "terminationGracePeriodSeconds: 30"}});
  const CommandResult short_grace =
      CheckManifests(absl::StrCat(dir, "/deploy/kubernetes/overlays/cpu-demo"));
  EXPECT_NE(short_grace.code, 0) << short_grace.output;
  EXPECT_TRUE(absl::StrContains(short_grace.output,
                                "terminationGracePeriodSeconds 30 < preStop"))
      << short_grace.output;
  std::ofstream(decode) << text;

  // GPUs requested with the CPU backend are caught too.
  const std::string gpu_layout =
      dir + "/deploy/kubernetes/overlays/gpu/layout.yaml";
  const std::string layout_text = Slurp(gpu_layout);
  ASSERT_TRUE(absl::StrContains(layout_text, "value: cuda}"));
  std::ofstream(gpu_layout)
      << absl::StrReplaceAll(layout_text, {{"value: cuda}", "value: cpu}"}});
  const CommandResult cpu_on_gpus =
      CheckManifests(absl::StrCat(dir, "/deploy/kubernetes/overlays/gpu"));
  EXPECT_NE(cpu_on_gpus.code, 0) << cpu_on_gpus.output;
  EXPECT_TRUE(absl::StrContains(cpu_on_gpus.output,
                                "requests nvidia.com/gpu but BACKEND is cpu"))
      << cpu_on_gpus.output;
  std::ofstream(gpu_layout) << layout_text;

  // And a KV dtype the GPU backend does not keep.
  const std::string base_layout = dir + "/deploy/kubernetes/base/layout.yaml";
  const std::string base_text = Slurp(base_layout);
  ASSERT_TRUE(absl::StrContains(base_text, "KV_DTYPE: auto"));
  std::ofstream(base_layout)
      << absl::StrReplaceAll(base_text, {{"KV_DTYPE: auto", "KV_DTYPE: f32"}});
  const CommandResult f32_on_gpus =
      CheckManifests(absl::StrCat(dir, "/deploy/kubernetes/overlays/gpu"));
  EXPECT_NE(f32_on_gpus.code, 0) << f32_on_gpus.output;
  EXPECT_TRUE(absl::StrContains(f32_on_gpus.output,
                                "KV_DTYPE f32 is not one the cuda backend"))
      << f32_on_gpus.output;
  fs::remove_all(dir);
}

// ---- The cpu-demo containers as processes ---------------------------------

struct Container {
  std::vector<std::string> argv;
  std::vector<std::string> env;  // NAME=value
};

// The container of workload `kind/name` in a rendered overlay, with $(VAR)
// expanded as the kubelet does, /opt/pdserve/bin mapped to the build tree,
// /models to the shared models, 0.0.0.0 to loopback and the fixed ports to
// `port` (gRPC) and 0 (metrics: the process reports what it bound).
Container FromManifest(
    const nlohmann::json& objects, const std::string& kind,
    const std::string& name, int port,
    const std::map<std::string, std::string>& extra_env,
    const std::map<std::string, std::string>& addresses = {}) {
  const nlohmann::json* layout = nullptr;
  const nlohmann::json* workload = nullptr;
  for (const auto& o : objects) {
    if (o["kind"] == "ConfigMap" && o["metadata"]["name"] == "pdserve-layout")
      layout = &o;
    if (o["kind"] == kind && o["metadata"]["name"] == name) workload = &o;
  }
  EXPECT_NE(layout, nullptr);
  EXPECT_NE(workload, nullptr) << kind << "/" << name;
  if (layout == nullptr || workload == nullptr) return {};
  const nlohmann::json& pod =
      kind == "LeaderWorkerSet"
          ? (*workload)["spec"]["leaderWorkerTemplate"]["workerTemplate"]
          : (*workload)["spec"]["template"];
  const auto& c = pod["spec"]["containers"][0];
  std::map<std::string, std::string> env;
  for (const auto& [k, v] : (*layout)["data"].items()) env[k] = v;
  for (const auto& e : c.value("env", nlohmann::json::array())) {
    // valueFrom (the downward API's pod name): the test gives it.
    if (e.contains("value")) env[e["name"]] = e["value"];
  }
  const std::string models = pdserve::testing::ModelsDir() + "/";
  auto map = [&](std::string s) {
    for (const auto& [k, v] : env)
      s = absl::StrReplaceAll(s, {{"$(" + k + ")", v}});
    s = absl::StrReplaceAll(s, {{"/models/", models}});
    if (s == "--host=0.0.0.0") return std::string("--host=127.0.0.1");
    if (s == "--port=50051" || s == "--grpc-port=50051")
      return absl::StrCat(s.substr(0, s.find('=') + 1), port);
    if (s == "--metrics-port=9100") return std::string("--metrics-port=0");
    // Cluster DNS names and fixed ports, mapped to loopback.
    for (const auto& [from, to] : addresses) {
      s = absl::StrReplaceAll(s, {{from, to}});
    }
    return s;
  };
  Container out;
  const std::string command = c["command"][0];
  if (command == "/opt/pdserve/bin/decode_worker") {
    out.argv.push_back(PDSERVE_DECODE_WORKER_BIN);
  } else if (command == "/opt/pdserve/bin/router") {
    out.argv.push_back(ROUTER_BIN);
  } else if (command == "/opt/pdserve/bin/prefill-stage") {
    out.argv.push_back(kSource + "/deploy/docker/prefill-stage.sh");
    env["PDSERVE_BIN_DIR"] = fs::path(PREFILL_WORKER).parent_path();
  } else {
    ADD_FAILURE() << "unexpected command " << command;
  }
  // The downward API's values and the controller's (LWS_*), which $(VAR)
  // in the args may name, as the kubelet expands them.
  for (const auto& [k, v] : extra_env) env[k] = v;
  for (const auto& a : c["args"]) out.argv.push_back(map(a));
  env["PATH"] = "/usr/bin:/bin";
  for (const auto& [k, v] : env) out.env.push_back(k + "=" + map(v));
  return out;
}

TEST(DeployTest, CpuDemoContainersServeARequestAsTheManifestsStartThem) {
  const std::string dir = TempDir();
  const CommandResult r =
      CheckManifests("deploy/kubernetes/overlays/cpu-demo", dir);
  ASSERT_EQ(r.code, 0) << r.output;
  const auto objects = nlohmann::json::parse(Slurp(dir + "/cpu-demo.json"));
  const int decode_port = testing::FreePort();
  const int stage1_port = testing::FreePort();
  const int stage0_port = testing::FreePort();
  // The pdserve-auth Secret, as the kubelet would mount it.
  const std::string internal_token = "test-internal-token-0123456789";
  const std::string api_key = "test-api-key-0123456789";
  fs::create_directories(dir + "/auth");
  std::ofstream(dir + "/auth/internal-token") << internal_token << "\n";
  std::ofstream(dir + "/auth/api-keys") << api_key << "\n";
  const std::map<std::string, std::string> secrets = {
      {"/etc/pdserve/auth/", dir + "/auth/"}};

  const Container decode_spec =
      FromManifest(objects, "Deployment", "decode", decode_port,
                   {{"POD_NAME", "decode-5d9c7-x2x4q"}}, secrets);
  Child decode(decode_spec.argv, dir + "/decode.log", decode_spec.env);
  // As the LeaderWorkerSet's controller starts group 0: its worker 1 ...
  const Container stage1_spec =
      FromManifest(objects, "LeaderWorkerSet", "prefill", stage1_port,
                   {{"POD_NAME", "prefill-0-1"},
                    {"LWS_WORKER_INDEX", "1"},
                    {"LWS_LEADER_ADDRESS", "prefill-0.prefill.pdserve"}},
                   secrets);
  Child stage1(stage1_spec.argv, dir + "/stage1.log", stage1_spec.env);
  ASSERT_FALSE(
      stage1.WaitFor("stage control on ([0-9.:]+)", absl::Seconds(60)).empty());
  // ... and its leader, stage 0 (prefill-0-1.prefill:50051, mapped to
  // loopback).
  const Container stage0_spec =
      FromManifest(objects, "LeaderWorkerSet", "prefill", stage0_port,
                   {{"POD_NAME", "prefill-0"},
                    {"LWS_WORKER_INDEX", "0"},
                    {"LWS_LEADER_ADDRESS", "prefill-0.prefill.pdserve"},
                    {"PDSERVE_PEERS", absl::StrCat("127.0.0.1:", stage1_port)}},
                   secrets);
  Child stage0(stage0_spec.argv, dir + "/stage0.log", stage0_spec.env);
  const std::string decode_address =
      decode.WaitFor("listening on ([0-9.:]+)", absl::Seconds(60));
  const std::string stage0_address =
      stage0.WaitFor("listening on ([0-9.:]+)", absl::Seconds(60));
  ASSERT_FALSE(decode_address.empty());
  ASSERT_FALSE(stage0_address.empty());

  auto decode_stub = pdserve::v1::DecodeWorker::NewStub(
      rpc::CreateChannel(decode_address, internal_token));
  auto prefill_stub = pdserve::v1::PrefillGroup::NewStub(
      rpc::CreateChannel(stage0_address, internal_token));
  const auto cases = pdserve::testing::LoadGoldenCases("golden.jsonl");
  const auto tokens = testing::RunRequest(
      *decode_stub, decode_address,
      [&](const pdserve::v1::PrefillSubmitRequest& req,
          pdserve::v1::PrefillSubmitResponse* out) {
        grpc::ClientContext ctx;
        ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
        return prefill_stub->Prefill(&ctx, req, out);
      },
      1, cases[0].prompt_ids, cases[0].max_new_tokens);
  EXPECT_EQ(tokens, cases[0].greedy_ids)
      << decode.Log() << stage0.Log() << stage1.Log();

  // The layout the ConfigMap gives is the one the metrics carry.
  const std::string metrics = testing::MetricsAddress(decode.Log());
  ASSERT_FALSE(metrics.empty()) << decode.Log();
  httplib::Client client("http://" + metrics);
  auto res = client.Get("/metrics");
  ASSERT_TRUE(res);
  std::string tp;
  for (const auto& o : objects) {
    if (o["metadata"]["name"] == "pdserve-layout") tp = o["data"]["DECODE_TP"];
  }
  EXPECT_TRUE(absl::StrContains(res->body, "tp=\"" + tp + "\"")) << tp;
  EXPECT_TRUE(absl::StrContains(res->body, "worker_id=\"decode-5d9c7-x2x4q\""));
  // The router, as its Deployment starts it, in front of the same workers.
  const int router_port = testing::FreePort();
  const int http_port = testing::FreePort();
  const Container router_spec = FromManifest(
      objects, "Deployment", "router", router_port, {},
      {{"prefill-leaders:50051", stage0_address},
       {"decode:50051", decode_address},
       {"/etc/pdserve/auth/", dir + "/auth/"},
       {"--http-port=8080", absl::StrCat("--http-port=", http_port)}});
  Child router(router_spec.argv, dir + "/router.log", router_spec.env);
  ASSERT_FALSE(
      router.WaitFor("router: gRPC on ([0-9.:]+)", absl::Seconds(60)).empty());
  auto generation = pdserve::v1::Generation::NewStub(
      rpc::CreateChannel(absl::StrCat("127.0.0.1:", router_port), api_key));
  pdserve::v1::GenerateRequest request;
  request.mutable_token_ids()->mutable_ids()->Add(cases[1].prompt_ids.begin(),
                                                  cases[1].prompt_ids.end());
  request.set_max_tokens(cases[1].max_new_tokens);
  pdserve::v1::GenerateResponse response;
  grpc::Status status;
  // The router's registry picks the workers up within --refresh-ms.
  for (int attempt = 0; attempt < 50; ++attempt) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    status = generation->GenerateUnary(&ctx, request, &response);
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(status.ok()) << status.error_message() << router.Log();
  EXPECT_EQ(std::vector<int32_t>(response.token_ids().begin(),
                                 response.token_ids().end()),
            cases[1].greedy_ids);
  const std::string router_metrics = testing::MetricsAddress(router.Log());
  EXPECT_FALSE(router_metrics.empty()) << router.Log();
  // Every metric the autoscalers' queries read is one these processes
  // export (the planner's when the router runs it: planner_monitor.cc).
  std::string exported;
  for (const std::string& address :
       {metrics, router_metrics, testing::MetricsAddress(stage0.Log())}) {
    httplib::Client scrape("http://" + address);
    if (auto got = scrape.Get("/metrics")) exported += got->body;
  }
  const std::string planner = Slurp(kSource + "/router/planner_monitor.cc");
  int queried = 0;
  for (const auto& o : objects) {
    if (o["kind"] != "ScaledObject") continue;
    for (const auto& t : o["spec"]["triggers"]) {
      const std::string query = t["metadata"]["query"];
      std::regex name_re("pdserve_[a-z_]+");
      for (auto it = std::sregex_iterator(query.begin(), query.end(), name_re);
           it != std::sregex_iterator(); ++it) {
        const std::string name = it->str();
        ++queried;
        EXPECT_TRUE(absl::StrContains(exported, "\n" + name + "{") ||
                    absl::StrContains(planner, "\"" + name + "\""))
            << "ScaledObject " << o["metadata"]["name"] << " reads " << name
            << ", which nothing exports";
      }
    }
  }
  EXPECT_GE(queried, 6);
  // The gauges the Gateway API Inference Extension's endpoint picker reads.
  for (const char* name :
       {"vllm:num_requests_waiting", "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"}) {
    EXPECT_TRUE(absl::StrContains(exported, absl::StrCat("\n", name, "{")))
        << name;
  }
  std::printf(
      "started from the cpu-demo manifests: a decode worker, prefill group 0's "
      "leader and worker, and the router\n");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace pdserve::metrics
