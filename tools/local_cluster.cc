#include "tools/local_cluster.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "model/weight_source.h"
#include "process/dns_server.h"
#include "process/port_file.h"
#include "rpc/auth.h"

namespace pdserve::tools {
namespace {

// 32 random bytes, hex, in a file only this user can read.
absl::Status WriteRandomToken(const std::string& path) {
  unsigned char bytes[32];
  std::ifstream random("/dev/urandom", std::ios::binary);
  if (!random.read(reinterpret_cast<char*>(bytes), sizeof(bytes))) {
    return absl::UnavailableError("cannot read /dev/urandom");
  }
  std::string token;
  for (unsigned char b : bytes)
    absl::StrAppend(&token, absl::Hex(b, absl::kZeroPad2));
  const int fd =
      open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0 || fchmod(fd, 0600) != 0) {
    if (fd >= 0) close(fd);
    return absl::UnavailableError(
        absl::StrCat("cannot write ", path, ": ", std::strerror(errno)));
  }
  token.push_back('\n');
  const bool written = write(fd, token.data(), token.size()) ==
                       static_cast<ssize_t>(token.size());
  close(fd);
  if (!written) {
    return absl::UnavailableError(absl::StrCat("cannot write ", path));
  }
  return absl::OkStatus();
}

constexpr char kDecodeName[] = "decode.pdserve.local";
constexpr char kPrefillName[] = "prefill.pdserve.local";

}  // namespace

absl::StatusOr<std::unique_ptr<LocalCluster>> LocalCluster::Start(
    LocalClusterOptions options) {
  if (options.model_path.empty()) {
    return absl::InvalidArgumentError("a model path is required");
  }
  if (options.prefill_groups < 1 || options.stages < 1 ||
      options.decode_workers < 1 || options.tp < 1) {
    return absl::InvalidArgumentError(
        "prefill groups, stages, decode workers and TP must all be >= 1");
  }
  if (options.model_name.empty()) {
    options.model_name = model::DefaultModelName(options.model_path);
  }
  if (options.work_dir.empty()) {
    char pattern[] = "/tmp/pdserve-local.XXXXXX";
    if (mkdtemp(pattern) == nullptr) {
      return absl::UnavailableError("cannot create a work folder in /tmp");
    }
    options.work_dir = pattern;
  } else {
    std::error_code ec;
    std::filesystem::create_directories(options.work_dir, ec);
    if (ec) {
      return absl::UnavailableError(
          absl::StrCat("cannot create ", options.work_dir, ": ", ec.message()));
    }
  }
  if (options.internal_token_file.empty()) {
    options.internal_token_file =
        absl::StrCat(options.work_dir, "/internal.token");
    PDS_RETURN_IF_ERROR(WriteRandomToken(options.internal_token_file));
  }
  PDS_ASSIGN_OR_RETURN(
      rpc::BearerTokens internal_tokens,
      rpc::BearerTokens::FromFile(options.internal_token_file));
  auto cluster = std::unique_ptr<LocalCluster>(new LocalCluster(options));
  cluster->internal_token_ = internal_tokens.first();
  if (options.dns_discovery) {
    PDS_ASSIGN_OR_RETURN(cluster->decode_port_,
                         process::FreeLoopbackPort(SOCK_STREAM));
    PDS_ASSIGN_OR_RETURN(cluster->prefill_port_,
                         process::FreeLoopbackPort(SOCK_STREAM));
    PDS_ASSIGN_OR_RETURN(cluster->dns_, process::DnsServer::Start(
                                            options.work_dir, "pdserve.local"));
  }
  // Decode workers first (they take longest to load with large TP), then
  // the prefill groups, then the router that needs both.
  for (int w = 0; w < options.decode_workers; ++w) {
    PDS_RETURN_IF_ERROR(cluster->StartDecode(w, cluster->decode_port_));
    cluster->published_decode_.insert(w);
  }
  const int groups = options.colocated ? 0 : options.prefill_groups;
  cluster->groups_.resize(groups);
  cluster->prefill_addresses_.resize(groups);
  for (int g = 0; g < groups; ++g) {
    PDS_RETURN_IF_ERROR(cluster->StartPrefillGroup(g, cluster->prefill_port_));
    cluster->published_prefill_.insert(g);
  }
  if (options.dns_discovery) PDS_RETURN_IF_ERROR(cluster->PublishDns());
  PDS_RETURN_IF_ERROR(cluster->StartRouter());
  absl::Status serving = cluster->WaitRouterServing(options.start_timeout);
  if (!serving.ok()) {
    return absl::Status(serving.code(),
                        absl::StrCat(serving.message(), "; router log:\n",
                                     cluster->LogTail("router", 2048)));
  }
  return cluster;
}

LocalCluster::~LocalCluster() { Stop(); }

void LocalCluster::Stop() {
  if (router_ != nullptr) router_->Stop();
  for (Group& group : groups_) {
    // Stage 0 first: the others would otherwise see it vanish and wait out
    // their orphan timeout.
    for (auto& stage : group.stages) {
      if (stage != nullptr) stage->Stop();
    }
  }
  for (auto& decode : decodes_) {
    if (decode != nullptr) decode->Stop();
  }
  dns_.reset();
}

std::string LocalCluster::DecodeHost(int worker) const {
  return options_.dns_discovery ? absl::StrCat("127.0.2.", worker + 1)
                                : options_.host;
}

std::string LocalCluster::PrefillHost(int group) const {
  return options_.dns_discovery ? absl::StrCat("127.0.3.", group + 1)
                                : options_.host;
}

absl::Status LocalCluster::PublishDns() {
  std::map<std::string, std::set<std::string>> records;
  for (int w : published_decode_) records[kDecodeName].insert(DecodeHost(w));
  for (int g : published_prefill_) {
    records[kPrefillName].insert(PrefillHost(g));
  }
  return dns_->SetRecords(records);
}

absl::Status LocalCluster::CheckScaling() const {
  if (!options_.dns_discovery) {
    return absl::FailedPreconditionError(
        "scaling needs dns_discovery (the router's lists are fixed)");
  }
  return absl::OkStatus();
}

absl::StatusOr<int> LocalCluster::AddDecodeWorker() {
  PDS_RETURN_IF_ERROR(CheckScaling());
  const int worker = static_cast<int>(decodes_.size());
  PDS_RETURN_IF_ERROR(StartDecode(worker, decode_port_));
  published_decode_.insert(worker);
  PDS_RETURN_IF_ERROR(PublishDns());
  return worker;
}

absl::Status LocalCluster::RemoveDecodeWorker(int worker, bool drain,
                                              absl::Duration timeout) {
  PDS_RETURN_IF_ERROR(CheckScaling());
  if (worker < 0 || worker >= static_cast<int>(decodes_.size()) ||
      decodes_[worker] == nullptr) {
    return absl::NotFoundError(absl::StrCat("no decode worker ", worker));
  }
  if (drain) {
    published_decode_.erase(worker);
    PDS_RETURN_IF_ERROR(PublishDns());
  }
  decodes_[worker]->Signal(drain ? SIGTERM : SIGKILL);
  absl::Status exited = decodes_[worker]->Wait(timeout).status();
  decodes_[worker].reset();  // SIGKILL if it did not exit
  return exited;
}

absl::StatusOr<int> LocalCluster::AddPrefillGroup() {
  if (!options_.dns_discovery || options_.colocated) {
    return absl::FailedPreconditionError(
        "scaling prefill groups needs dns_discovery and groups");
  }
  const int group = static_cast<int>(groups_.size());
  groups_.emplace_back();
  prefill_addresses_.emplace_back();
  PDS_RETURN_IF_ERROR(StartPrefillGroup(group, prefill_port_));
  published_prefill_.insert(group);
  PDS_RETURN_IF_ERROR(PublishDns());
  return group;
}

absl::Status LocalCluster::RemovePrefillGroup(int group, bool drain,
                                              absl::Duration timeout) {
  PDS_RETURN_IF_ERROR(CheckScaling());
  if (group < 0 || group >= static_cast<int>(groups_.size()) ||
      groups_[group].stages.empty()) {
    return absl::NotFoundError(absl::StrCat("no prefill group ", group));
  }
  if (drain) {
    published_prefill_.erase(group);
    PDS_RETURN_IF_ERROR(PublishDns());
  }
  // Every stage at once, as a LeaderWorkerSet stops a group's pods.
  for (auto& stage : groups_[group].stages) {
    if (stage != nullptr) stage->Signal(drain ? SIGTERM : SIGKILL);
  }
  absl::Status exited = absl::OkStatus();
  const absl::Time deadline = absl::Now() + timeout;
  for (auto& stage : groups_[group].stages) {
    if (stage == nullptr) continue;
    absl::Status s =
        stage->Wait(std::max(absl::ZeroDuration(), deadline - absl::Now()))
            .status();
    if (!s.ok() && exited.ok()) exited = s;
  }
  groups_[group].stages.clear();  // SIGKILL what did not exit
  return exited;
}

std::vector<int> LocalCluster::live_decode_workers() const {
  std::vector<int> out;
  for (size_t w = 0; w < decodes_.size(); ++w) {
    if (decodes_[w] != nullptr) out.push_back(static_cast<int>(w));
  }
  return out;
}

std::vector<int> LocalCluster::live_prefill_groups() const {
  std::vector<int> out;
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (!groups_[g].stages.empty()) out.push_back(static_cast<int>(g));
  }
  return out;
}

absl::StatusOr<std::string> LocalCluster::Binary(
    const std::string& name) const {
  const std::string direct = absl::StrCat(options_.bin_dir, "/", name);
  if (process::IsExecutableFile(direct)) return direct;
  const std::string nested =
      absl::StrCat(options_.bin_dir, "/", name, "/", name);
  if (process::IsExecutableFile(nested)) return nested;
  return absl::NotFoundError(absl::StrCat("no ", name, " binary at ", direct,
                                          " or ", nested,
                                          " (build it, or set the bin dir)"));
}

absl::StatusOr<std::unique_ptr<process::ChildProcess>> LocalCluster::Launch(
    const std::string& binary, const std::string& name,
    std::vector<std::string> args) {
  PDS_ASSIGN_OR_RETURN(std::string path, Binary(binary));
  process::SpawnOptions spawn;
  spawn.binary = path;
  spawn.args = std::move(args);
  // Every process checks (and sends) the cluster's internal token.
  spawn.args.insert(spawn.args.end(),
                    {"--internal-token-file", options_.internal_token_file});
  spawn.log_path = absl::StrCat(options_.work_dir, "/", name, ".log");
  return process::ChildProcess::Spawn(std::move(spawn));
}

std::string LocalCluster::MetricsArgs(const std::string& name, int offset,
                                      std::vector<std::string>* args) const {
  if (options_.metrics_port_base < 0) return "";
  const std::string port_file =
      absl::StrCat(options_.work_dir, "/", name, ".metrics");
  std::remove(port_file.c_str());
  const int port =
      options_.metrics_port_base == 0 ? 0 : options_.metrics_port_base + offset;
  args->insert(
      args->end(),
      {"--metrics-port", absl::StrCat(port), "--metrics-host", options_.host,
       "--metrics-port-file", port_file, "--worker-id",
       // The stages of one group share a worker id (and differ by their
       // stage label), so the layout report sees them as one pipeline.
       name.substr(0, name.find("-stage-"))});
  return port_file;
}

absl::StatusOr<std::string> LocalCluster::WaitUp(
    const std::string& name, const std::string& port_file,
    process::ChildProcess* child) const {
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + options_.start_timeout;
  constexpr absl::Duration kReportEvery = absl::Seconds(5);
  while (true) {
    const absl::Duration slice = std::min(
        kReportEvery, std::max(absl::ZeroDuration(), deadline - absl::Now()));
    absl::StatusOr<std::string> address =
        process::WaitForPortFile(port_file, slice, child);
    if (address.ok() || !absl::IsDeadlineExceeded(address.status()) ||
        absl::Now() >= deadline) {
      if (address.ok() && options_.progress) {
        options_.progress(
            absl::StrFormat("%s up on %s (%.1f s)", name, *address,
                            absl::ToDoubleSeconds(absl::Now() - start)));
      }
      if (!address.ok() && absl::IsDeadlineExceeded(address.status())) {
        return absl::DeadlineExceededError(absl::StrCat(
            name, " did not come up within ",
            absl::FormatDuration(options_.start_timeout), "; its log ends:\n",
            child != nullptr ? child->LogTail(2048) : ""));
      }
      return address;
    }
    if (options_.progress) {
      std::string last = child != nullptr ? child->LogTail(512) : "";
      while (!last.empty() && last.back() == '\n') last.pop_back();
      if (const size_t nl = last.rfind('\n'); nl != std::string::npos) {
        last = last.substr(nl + 1);
      }
      options_.progress(
          absl::StrFormat("still starting %s (%.0f s)%s%s", name,
                          absl::ToDoubleSeconds(absl::Now() - start),
                          last.empty() ? "" : ": ", last));
    }
  }
}

absl::Status LocalCluster::RecordMetrics(const std::string& name,
                                         const std::string& port_file,
                                         process::ChildProcess* child) {
  if (port_file.empty()) return absl::OkStatus();
  PDS_ASSIGN_OR_RETURN(
      std::string address,
      process::WaitForPortFile(port_file, options_.start_timeout, child));
  metrics_addresses_[name] = address;
  return absl::OkStatus();
}

absl::Status LocalCluster::StartDecode(int worker, int port) {
  const std::string name = absl::StrCat("decode-", worker);
  const std::string port_file =
      absl::StrCat(options_.work_dir, "/", name, ".port");
  std::remove(port_file.c_str());
  std::vector<std::string> args = {"--model",
                                   options_.model_path,
                                   "--format",
                                   options_.format,
                                   "--model-name",
                                   options_.model_name,
                                   "--tp",
                                   absl::StrCat(options_.tp),
                                   "--host",
                                   DecodeHost(worker),
                                   "--port",
                                   absl::StrCat(port),
                                   "--port-file",
                                   port_file,
                                   "--num-blocks",
                                   absl::StrCat(options_.decode_blocks),
                                   "--max-running",
                                   absl::StrCat(options_.max_running),
                                   "--max-step-tokens",
                                   absl::StrCat(options_.max_step_tokens),
                                   "--speculation",
                                   options_.speculation,
                                   "--threads-per-rank",
                                   absl::StrCat(options_.decode_threads),
                                   "--ucx-peer-errors",
                                   options_.shared_memory_kv ? "0" : "1",
                                   "--backend",
                                   options_.backend,
                                   "--cuda-devices",
                                   options_.cuda_devices,
                                   "--kv-dtype",
                                   options_.kv_dtype,
                                   "--quantized-matmul",
                                   options_.quantized_matmul,
                                   "--moe-parallel",
                                   options_.moe_parallel};
  if (options_.speculation == "draft") {
    args.insert(args.end(),
                {"--draft-layers", absl::StrCat(options_.draft_layers)});
  }
  if (options_.drain_timeout_s >= 0) {
    args.insert(args.end(), {"--drain-timeout-seconds",
                             absl::StrCat(options_.drain_timeout_s)});
  }
  if (!options_.step_trace_prefix.empty()) {
    args.insert(args.end(),
                {"--step-trace", absl::StrCat(options_.step_trace_prefix,
                                              "decode-", worker, ".csv")});
  }
  const std::string metrics_file = MetricsArgs(name, 20 + worker, &args);
  PDS_ASSIGN_OR_RETURN(auto child, Launch("decode_worker", name, args));
  PDS_ASSIGN_OR_RETURN(std::string address,
                       WaitUp(name, port_file, child.get()));
  PDS_RETURN_IF_ERROR(RecordMetrics(name, metrics_file, child.get()));
  if (static_cast<int>(decodes_.size()) <= worker) {
    decodes_.resize(worker + 1);
    decode_addresses_.resize(worker + 1);
  }
  decodes_[worker] = std::move(child);
  decode_addresses_[worker] = address;
  return absl::OkStatus();
}

absl::Status LocalCluster::StartPrefillGroup(int group, int port) {
  static int launch = 0;  // port files are never reused across restarts
  ++launch;
  Group& g = groups_[group];
  g.stages.clear();
  g.stages.resize(options_.stages);
  g.stage_args.assign(options_.stages, {});
  g.stage_addresses.assign(options_.stages, "");
  const int s_count = options_.stages;
  const std::vector<std::string> devices =
      absl::StrSplit(options_.cuda_devices, ',');
  auto common_args = [&](int stage, const std::string& port_file) {
    const std::string& device = devices[(group * s_count + stage) %
                                        std::max<size_t>(devices.size(), 1)];
    std::vector<std::string> args{
        "--backend",
        options_.backend,
        "--cuda-device",
        device,
        "--kv-dtype",
        options_.kv_dtype,
        "--quantized-matmul",
        options_.quantized_matmul,
        "--model",
        options_.model_path,
        "--format",
        options_.format,
        "--model-name",
        options_.model_name,
        "--stage",
        absl::StrCat(stage),
        "--stages",
        absl::StrCat(s_count),
        "--layer-split",
        options_.layer_split,
        "--chunk-policy",
        options_.chunk_policy,
        "--chunk-tokens",
        absl::StrCat(options_.chunk_tokens),
        "--num-blocks",
        absl::StrCat(options_.prefill_blocks),
        "--host",
        stage == 0 ? PrefillHost(group) : options_.host,
        "--port-file",
        port_file,
        "--threads",
        absl::StrCat(options_.prefill_threads),
        "--ucx-peer-errors",
        options_.shared_memory_kv ? "0" : "1"};
    if (!options_.step_trace_prefix.empty()) {
      args.insert(
          args.end(),
          {"--step-trace", absl::StrCat(options_.step_trace_prefix, "prefill-",
                                        group, "-stage-", stage, ".csv")});
    }
    if (options_.drain_timeout_s >= 0) {
      args.insert(args.end(), {"--drain-timeout-seconds",
                               absl::StrCat(options_.drain_timeout_s)});
    }
    return args;
  };
  // Stages 1..S-1 first: stage 0 wires the pipeline to them at start.
  std::vector<std::string> peers;
  for (int stage = 1; stage < s_count; ++stage) {
    const std::string name = absl::StrCat("prefill-", group, "-stage-", stage);
    const std::string port_file =
        absl::StrCat(options_.work_dir, "/", name, ".", launch, ".port");
    std::vector<std::string> args = common_args(stage, port_file);
    args.insert(args.end(), {"--port", "0"});
    const std::string metrics_file =
        MetricsArgs(name, 10 + group * s_count + stage, &args);
    g.stage_args[stage] = args;
    PDS_ASSIGN_OR_RETURN(g.stages[stage], Launch("prefill_worker", name, args));
    PDS_ASSIGN_OR_RETURN(std::string address,
                         WaitUp(name, port_file, g.stages[stage].get()));
    g.stage_addresses[stage] = address;
    PDS_RETURN_IF_ERROR(
        RecordMetrics(name, metrics_file, g.stages[stage].get()));
    peers.push_back(address);
  }
  const std::string name = absl::StrCat("prefill-", group, "-stage-0");
  const std::string port_file =
      absl::StrCat(options_.work_dir, "/", name, ".", launch, ".port");
  std::vector<std::string> args = common_args(0, port_file);
  args.insert(args.end(), {"--port", absl::StrCat(port)});
  if (!peers.empty()) {
    args.insert(args.end(), {"--peers", absl::StrJoin(peers, ",")});
  }
  const std::string metrics_file =
      MetricsArgs(name, 10 + group * s_count, &args);
  PDS_ASSIGN_OR_RETURN(g.stages[0], Launch("prefill_worker", name, args));
  PDS_ASSIGN_OR_RETURN(std::string address,
                       WaitUp(name, port_file, g.stages[0].get()));
  PDS_RETURN_IF_ERROR(RecordMetrics(name, metrics_file, g.stages[0].get()));
  prefill_addresses_[group] = address;
  const size_t colon = address.rfind(':');
  g.port = std::atoi(address.c_str() + colon + 1);
  return absl::OkStatus();
}

absl::Status LocalCluster::StartRouter() {
  const std::string grpc_file = absl::StrCat(options_.work_dir, "/router.grpc");
  const std::string http_file = absl::StrCat(options_.work_dir, "/router.http");
  std::remove(grpc_file.c_str());
  std::remove(http_file.c_str());
  std::vector<std::string> args = {
      "--model",
      options_.model_path,
      "--format",
      options_.format,
      "--model-name",
      options_.model_name,
      "--prefill",
      options_.dns_discovery ? absl::StrCat(kPrefillName, ":", prefill_port_)
                             : absl::StrJoin(prefill_addresses_, ","),
      "--decode",
      options_.dns_discovery ? absl::StrCat(kDecodeName, ":", decode_port_)
                             : absl::StrJoin(decode_addresses_, ","),
      "--prefill-policy",
      options_.prefill_policy,
      "--decode-policy",
      options_.decode_policy,
      "--max-in-flight",
      absl::StrCat(options_.max_in_flight),
      "--host",
      options_.host,
      "--grpc-port",
      absl::StrCat(options_.grpc_port),
      "--http-port",
      absl::StrCat(options_.http_port),
      "--grpc-port-file",
      grpc_file,
      "--http-port-file",
      http_file,
      "--refresh-ms",
      absl::StrCat(options_.refresh_ms),
      "--colocated",
      options_.colocated ? "1" : "0",
      "--layout-stages",
      absl::StrCat(options_.stages),
      "--layout-tp",
      absl::StrCat(options_.tp)};
  if (!options_.api_key_file.empty()) {
    args.insert(args.end(), {"--api-key-file", options_.api_key_file});
  }
  if (options_.dns_discovery) {
    args.insert(args.end(), {"--dns-server", dns_->address()});
  }
  if (options_.drain_timeout_s >= 0) {
    args.insert(args.end(), {"--drain-timeout-seconds",
                             absl::StrCat(options_.drain_timeout_s)});
  }
  if (options_.max_migrations >= 0) {
    args.insert(args.end(),
                {"--max-migrations", absl::StrCat(options_.max_migrations)});
  }
  if (options_.local_prefill_max_tokens > 0) {
    args.insert(args.end(), {"--local-prefill-max-tokens",
                             absl::StrCat(options_.local_prefill_max_tokens)});
  }
  const std::string metrics_file = MetricsArgs("router", 0, &args);
  PDS_ASSIGN_OR_RETURN(router_, Launch("router", "router", args));
  PDS_ASSIGN_OR_RETURN(grpc_address_,
                       WaitUp("router", grpc_file, router_.get()));
  PDS_ASSIGN_OR_RETURN(
      http_address_, process::WaitForPortFile(http_file, options_.start_timeout,
                                              router_.get()));
  PDS_RETURN_IF_ERROR(RecordMetrics("router", metrics_file, router_.get()));
  return absl::OkStatus();
}

absl::Status LocalCluster::WaitRouterServing(absl::Duration timeout) const {
  auto channel =
      grpc::CreateChannel(grpc_address_, grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  const absl::Time deadline = absl::Now() + timeout;
  std::string last = "no answer";
  while (absl::Now() < deadline) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
    grpc::health::v1::HealthCheckResponse response;
    grpc::Status s = health->Check(
        &context, grpc::health::v1::HealthCheckRequest(), &response);
    if (s.ok() &&
        response.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
      return absl::OkStatus();
    }
    last = s.ok() ? "NOT_SERVING" : s.error_message();
    if (router_ != nullptr && !router_->Running()) {
      return absl::FailedPreconditionError("the router exited");
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("router at ", grpc_address_, " not serving after ",
                   absl::FormatDuration(timeout), " (", last, ")"));
}

void LocalCluster::KillDecode(int worker) {
  if (worker < static_cast<int>(decodes_.size()) && decodes_[worker]) {
    decodes_[worker]->Signal(SIGKILL);
    (void)decodes_[worker]->Wait(absl::Seconds(10));
  }
}

void LocalCluster::KillRouter() {
  if (router_ != nullptr) {
    router_->Signal(SIGKILL);
    (void)router_->Wait(absl::Seconds(10));
  }
}

void LocalCluster::SignalDecode(int worker, int signal) {
  if (worker < static_cast<int>(decodes_.size()) && decodes_[worker]) {
    decodes_[worker]->Signal(signal);
  }
}

void LocalCluster::KillPrefillStage(int group, int stage) {
  if (group < static_cast<int>(groups_.size()) &&
      stage < static_cast<int>(groups_[group].stages.size()) &&
      groups_[group].stages[stage]) {
    groups_[group].stages[stage]->Signal(SIGKILL);
    (void)groups_[group].stages[stage]->Wait(absl::Seconds(10));
  }
}

absl::Status LocalCluster::RestartPrefillStage(int group, int stage) {
  if (group < 0 || group >= static_cast<int>(groups_.size()) || stage < 1 ||
      stage >= options_.stages) {
    return absl::InvalidArgumentError(
        absl::StrCat("no prefill stage ", stage, " > 0 in group ", group));
  }
  Group& g = groups_[group];
  if (g.stages[stage] != nullptr) g.stages[stage]->Stop();
  static int restart = 0;
  const std::string name = absl::StrCat("prefill-", group, "-stage-", stage);
  const std::string port_file = absl::StrCat(options_.work_dir, "/", name,
                                             ".restart", ++restart, ".port");
  std::vector<std::string> args = g.stage_args[stage];
  const std::string& address = g.stage_addresses[stage];
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i] == "--port")
      args[i + 1] = address.substr(address.rfind(':') + 1);
    if (args[i] == "--port-file") args[i + 1] = port_file;
  }
  PDS_ASSIGN_OR_RETURN(g.stages[stage], Launch("prefill_worker", name, args));
  return process::WaitForPortFile(port_file, options_.start_timeout,
                                  g.stages[stage].get())
      .status();
}

absl::Status LocalCluster::RestartPrefillGroup(int group) {
  if (group < 0 || group >= static_cast<int>(groups_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("no prefill group ", group));
  }
  for (auto& stage : groups_[group].stages) {
    if (stage != nullptr) stage->Stop();
  }
  return StartPrefillGroup(group, groups_[group].port);
}

namespace {

int PortOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  return colon == std::string::npos ? 0
                                    : std::atoi(address.c_str() + colon + 1);
}

// Whether `child` exited; its wait status described in `reason`.
bool Exited(process::ChildProcess* child, std::string* reason) {
  if (child == nullptr) return false;
  const std::optional<int> status = child->ExitStatus();
  if (!status.has_value()) return false;
  *reason = process::ChildProcess::DescribeStatus(*status);
  return true;
}

}  // namespace

bool LocalCluster::RestartDue(const std::string& name) {
  Backoff& b = backoff_[name];
  const absl::Time now = absl::Now();
  if (b.next_try == absl::InfinitePast()) {
    // A death not seen before: a process that stayed up long enough starts
    // the backoff over.
    if (now - b.started >= options_.restart_reset) b.deaths_in_a_row = 0;
    ++b.deaths_in_a_row;
    absl::Duration wait = options_.restart_backoff;
    for (int i = 1;
         i < b.deaths_in_a_row && wait < options_.max_restart_backoff; ++i) {
      wait *= 2;
    }
    b.next_try = now + std::min(wait, options_.max_restart_backoff);
  }
  return now >= b.next_try;
}

void LocalCluster::Restarted(const std::string& name, const std::string& reason,
                             absl::Status status,
                             std::vector<RestartEvent>* events) {
  Backoff& b = backoff_[name];
  b.started = absl::Now();
  // A failed restart counts as another death (its backoff grows).
  b.next_try = absl::InfinitePast();
  if (status.ok()) ++restarts_[name];
  std::fprintf(stderr, "pdserve local: %s ended (%s); restart #%d %s\n",
               name.c_str(), reason.c_str(), b.deaths_in_a_row,
               status.ok()
                   ? "serving again"
                   : absl::StrCat("failed: ", status.message()).c_str());
  events->push_back({name, reason, std::move(status), b.deaths_in_a_row});
}

std::vector<RestartEvent> LocalCluster::Supervise() {
  std::vector<RestartEvent> events;
  std::string reason;
  for (size_t w = 0; w < decodes_.size(); ++w) {
    const std::string name = absl::StrCat("decode-", w);
    if (!Exited(decodes_[w].get(), &reason) || !RestartDue(name)) continue;
    // Same port: the router knows the worker by its address.
    Restarted(name, reason,
              StartDecode(static_cast<int>(w), PortOf(decode_addresses_[w])),
              &events);
  }
  for (size_t g = 0; g < groups_.size(); ++g) {
    Group& group = groups_[g];
    const std::string name = absl::StrCat("prefill-", g);
    if (!group.stages.empty() && Exited(group.stages[0].get(), &reason)) {
      // Stage 0 holds the group's state: the whole group starts again.
      if (RestartDue(name)) {
        Restarted(name, absl::StrCat("stage 0: ", reason),
                  RestartPrefillGroup(static_cast<int>(g)), &events);
      }
      continue;
    }
    for (size_t i = 1; i < group.stages.size(); ++i) {
      const std::string stage_name = absl::StrCat(name, "-stage-", i);
      if (!Exited(group.stages[i].get(), &reason) || !RestartDue(stage_name)) {
        continue;
      }
      // Stage 0 notices every stage answering again and rewires the group.
      Restarted(stage_name, reason,
                RestartPrefillStage(static_cast<int>(g), static_cast<int>(i)),
                &events);
    }
  }
  if (Exited(router_.get(), &reason) && RestartDue("router")) {
    options_.grpc_port = PortOf(grpc_address_);
    options_.http_port = PortOf(http_address_);
    Restarted("router", reason, StartRouter(), &events);
  }
  return events;
}

std::vector<pid_t> LocalCluster::pids() const {
  std::vector<pid_t> out;
  auto add = [&out](const std::unique_ptr<process::ChildProcess>& child) {
    if (child != nullptr && child->pid() > 0) out.push_back(child->pid());
  };
  add(router_);
  for (const Group& g : groups_) {
    for (const auto& stage : g.stages) add(stage);
  }
  for (const auto& d : decodes_) add(d);
  return out;
}

std::string LocalCluster::Describe() const {
  std::string out = absl::StrCat(
      "pdserve local cluster: model '", options_.model_name, "' (",
      options_.model_path, ")\n", "  router gRPC   ", grpc_address_, "\n",
      "  router HTTP   http://", http_address_, "\n");
  if (options_.colocated) {
    absl::StrAppend(&out, "  colocated     decode workers prefill\n");
  }
  for (size_t g = 0; g < prefill_addresses_.size(); ++g) {
    absl::StrAppend(&out, "  prefill group ", g, "  ", prefill_addresses_[g],
                    "  (", options_.stages, " stages, split ",
                    options_.layer_split, ")\n");
  }
  for (size_t w = 0; w < decode_addresses_.size(); ++w) {
    absl::StrAppend(&out, "  decode worker ", w, "  ", decode_addresses_[w],
                    "  (TP ", options_.tp, ", speculation ",
                    options_.speculation, ")\n");
  }
  for (const auto& [name, address] : metrics_addresses_) {
    absl::StrAppend(&out, "  metrics       http://", address, "/metrics  (",
                    name, ")\n");
  }
  absl::StrAppend(&out, "  logs          ", options_.work_dir, "\n");
  return out;
}

std::string LocalCluster::LogTail(const std::string& name,
                                  size_t max_bytes) const {
  return process::ReadFileTail(
      absl::StrCat(options_.work_dir, "/", name, ".log"), max_bytes);
}

}  // namespace pdserve::tools
