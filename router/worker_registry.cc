#include "router/worker_registry.h"

#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/logging.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "pdserve/v1/decode.grpc.pb.h"
#include "pdserve/v1/prefill.grpc.pb.h"
#include "rpc/auth.h"

namespace pdserve::router {
namespace {

using json = nlohmann::json;

absl::string_view AbslView(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

absl::Status ReadTargets(const json& body, const char* field,
                         std::vector<std::string>* out) {
  auto it = body.find(field);
  if (it == body.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", field, "' must be an array of \"host:port\""));
  }
  for (const json& target : *it) {
    std::string host;
    int port = 0;
    if (!target.is_string() ||
        !SplitHostPort(target.get<std::string>(), &host, &port).ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", field, "' entries must be \"host:port\" strings"));
    }
    out->push_back(target.get<std::string>());
  }
  return absl::OkStatus();
}

absl::Status ReadMillis(const json& body, const char* field,
                        absl::Duration* out) {
  auto it = body.find(field);
  if (it == body.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_number_integer() || it->get<int64_t>() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", field, "' must be a positive integer"));
  }
  *out = absl::Milliseconds(it->get<int64_t>());
  return absl::OkStatus();
}

absl::StatusOr<v1::ModelIdentity> ReadIdentity(const json& model) {
  if (!model.is_object()) {
    return absl::InvalidArgumentError("'model' must be an object");
  }
  v1::ModelIdentity identity;
  for (const char* field : {"name", "config_identity", "kv_dtype"}) {
    auto it = model.find(field);
    if (it == model.end()) continue;
    if (!it->is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat("'model.", field, "' must be a string"));
    }
    std::string value = it->get<std::string>();
    if (std::string_view(field) == "name") identity.set_name(value);
    if (std::string_view(field) == "config_identity") {
      identity.set_config_identity(value);
    }
    if (std::string_view(field) == "kv_dtype") identity.set_kv_dtype(value);
  }
  for (const char* field :
       {"num_layers", "num_kv_heads", "head_dim", "block_size"}) {
    auto it = model.find(field);
    if (it == model.end()) continue;
    if (!it->is_number_integer() || it->get<int64_t>() < 0 ||
        it->get<int64_t>() > (1 << 20)) {
      return absl::InvalidArgumentError(
          absl::StrCat("'model.", field, "' must be a small integer"));
    }
    int32_t value = static_cast<int32_t>(it->get<int64_t>());
    std::string_view f = field;
    if (f == "num_layers") identity.set_num_layers(value);
    if (f == "num_kv_heads") identity.set_num_kv_heads(value);
    if (f == "head_dim") identity.set_head_dim(value);
    if (f == "block_size") identity.set_block_size(value);
  }
  return identity;
}

class SystemResolver final : public Resolver {
 public:
  absl::StatusOr<std::vector<std::string>> Resolve(const std::string& host,
                                                   int port) override {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* result = nullptr;
    const std::string service = std::to_string(port);
    int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &result);
    if (rc != 0) {
      return absl::UnavailableError(
          absl::StrCat("cannot resolve ", host, ": ", gai_strerror(rc)));
    }
    std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> owned(result,
                                                             &freeaddrinfo);
    std::set<std::string> addresses;
    for (addrinfo* ai = result; ai != nullptr; ai = ai->ai_next) {
      char text[INET6_ADDRSTRLEN] = {};
      if (ai->ai_family == AF_INET) {
        auto* in = reinterpret_cast<sockaddr_in*>(ai->ai_addr);
        inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text));
        addresses.insert(absl::StrCat(text, ":", port));
      } else if (ai->ai_family == AF_INET6) {
        auto* in6 = reinterpret_cast<sockaddr_in6*>(ai->ai_addr);
        inet_ntop(AF_INET6, &in6->sin6_addr, text, sizeof(text));
        addresses.insert(absl::StrCat("[", text, "]:", port));
      }
    }
    if (addresses.empty()) {
      return absl::UnavailableError(absl::StrCat(host, " has no address"));
    }
    return std::vector<std::string>(addresses.begin(), addresses.end());
  }
};

// grpc.health.v1 Check, then the worker's own GetLoad (DecodeWorker or
// PrefillGroup) over one cached channel per address.
class GrpcWorkerProber final : public WorkerProber {
 public:
  explicit GrpcWorkerProber(std::string internal_token)
      : internal_token_(std::move(internal_token)) {}
  ProbeResult Probe(WorkerRole role, const std::string& address,
                    absl::Duration timeout) override {
    std::shared_ptr<Stubs> stubs = StubsFor(address);
    const auto deadline = absl::ToChronoTime(absl::Now() + timeout);
    ProbeResult result;
    {
      grpc::ClientContext context;
      context.set_deadline(deadline);
      grpc::health::v1::HealthCheckResponse response;
      grpc::Status status = stubs->health->Check(
          &context, grpc::health::v1::HealthCheckRequest(), &response);
      if (!status.ok()) {
        result.error =
            absl::StrCat("health check failed: ", status.error_message());
        return result;
      }
      if (response.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
        result.error = "health: not serving";
        return result;
      }
    }
    result.serving = true;
    // The load report is best effort: a worker without it (UNIMPLEMENTED,
    // or a slow answer) stays in rotation with the router's own counts.
    grpc::ClientContext context;
    context.set_deadline(deadline);
    if (role == WorkerRole::kDecode) {
      v1::DecodeLoad load;
      if (stubs->decode->GetLoad(&context, v1::GetLoadRequest(), &load).ok()) {
        result.load =
            WorkerLoad{load.waiting() + load.awaiting_kv(), load.running(),
                       load.kv_blocks_used(), load.kv_blocks_total()};
        if (load.has_model()) result.identity = load.model();
      }
    } else {
      v1::PrefillLoad load;
      if (stubs->prefill->GetLoad(&context, v1::PrefillLoadRequest(), &load)
              .ok()) {
        result.load = WorkerLoad{load.queued(), load.in_flight(),
                                 load.kv_blocks_used(), load.kv_blocks_total()};
        if (load.has_model()) result.identity = load.model();
        // A group with a stage down reports itself not serving.
        if (!load.serving()) {
          result.serving = false;
          result.error = "prefill group: a stage is down";
        }
      }
    }
    return result;
  }

  void Forget(const std::string& address) override {
    absl::MutexLock lock(&mu_);
    stubs_.erase(address);
  }

 private:
  struct Stubs {
    std::unique_ptr<grpc::health::v1::Health::Stub> health;
    std::unique_ptr<v1::DecodeWorker::Stub> decode;
    std::unique_ptr<v1::PrefillGroup::Stub> prefill;
  };

  std::shared_ptr<Stubs> StubsFor(const std::string& address) {
    absl::MutexLock lock(&mu_);
    std::shared_ptr<Stubs>& stubs = stubs_[address];
    if (stubs == nullptr) {
      auto channel = rpc::CreateChannel(address, internal_token_);
      stubs = std::make_shared<Stubs>();
      stubs->health = grpc::health::v1::Health::NewStub(channel);
      stubs->decode = v1::DecodeWorker::NewStub(channel);
      stubs->prefill = v1::PrefillGroup::NewStub(channel);
    }
    return stubs;
  }

  const std::string internal_token_;
  absl::Mutex mu_;
  // shared_ptr: a probe keeps its stubs even if Forget() runs meanwhile.
  absl::flat_hash_map<std::string, std::shared_ptr<Stubs>> stubs_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace

const char* WorkerRoleName(WorkerRole role) {
  return role == WorkerRole::kPrefill ? "prefill" : "decode";
}

absl::Status SplitHostPort(std::string_view target, std::string* host,
                           int* port) {
  absl::string_view t = AbslView(target);
  size_t colon = t.rfind(':');
  if (colon == absl::string_view::npos || colon == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", t, "' is not host:port"));
  }
  absl::string_view h = t.substr(0, colon);
  if (absl::ConsumePrefix(&h, "[") && !absl::ConsumeSuffix(&h, "]")) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", t, "' is not host:port"));
  }
  int p = 0;
  if (h.empty() || !absl::SimpleAtoi(t.substr(colon + 1), &p) || p <= 0 ||
      p > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", t, "' is not host:port (port 1..65535)"));
  }
  *host = std::string(h);
  *port = p;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> ParseTargetList(
    std::string_view flag_value) {
  std::vector<std::string> targets;
  for (absl::string_view part :
       absl::StrSplit(AbslView(flag_value), ',', absl::SkipWhitespace())) {
    std::string target(absl::StripAsciiWhitespace(part));
    std::string host;
    int port = 0;
    if (absl::Status s = SplitHostPort(target, &host, &port); !s.ok()) {
      return s;
    }
    targets.push_back(std::move(target));
  }
  return targets;
}

absl::StatusOr<RegistryConfig> ParseRegistryConfig(std::string_view json_text) {
  json body = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded() || !body.is_object()) {
    return absl::InvalidArgumentError("router config must be a JSON object");
  }
  RegistryConfig config;
  if (absl::Status s = ReadTargets(body, "prefill", &config.prefill); !s.ok()) {
    return s;
  }
  if (absl::Status s = ReadTargets(body, "decode", &config.decode); !s.ok()) {
    return s;
  }
  if (absl::Status s =
          ReadMillis(body, "refresh_interval_ms", &config.refresh_interval);
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          ReadMillis(body, "probe_timeout_ms", &config.probe_timeout);
      !s.ok()) {
    return s;
  }
  if (auto it = body.find("model"); it != body.end() && !it->is_null()) {
    absl::StatusOr<v1::ModelIdentity> identity = ReadIdentity(*it);
    if (!identity.ok()) return identity.status();
    config.model = *std::move(identity);
  }
  return config;
}

absl::Status CheckCompatible(const v1::ModelIdentity& cluster,
                             const v1::ModelIdentity& worker) {
  auto mismatch = [](const char* field, const auto& want, const auto& got) {
    return absl::FailedPreconditionError(
        absl::StrCat("incompatible worker: ", field, " is ", got,
                     ", the cluster's is ", want));
  };
  // A field the cluster's identity leaves unset ("" or 0: a config file that
  // names only the model and block size) accepts any value.
  if (!cluster.name().empty() && cluster.name() != worker.name()) {
    return mismatch("model name", cluster.name(), worker.name());
  }
  if (!cluster.config_identity().empty() &&
      cluster.config_identity() != worker.config_identity()) {
    return mismatch("model config", cluster.config_identity(),
                    worker.config_identity());
  }
  if (cluster.num_layers() != 0 &&
      cluster.num_layers() != worker.num_layers()) {
    return mismatch("num_layers", cluster.num_layers(), worker.num_layers());
  }
  if (cluster.num_kv_heads() != 0 &&
      cluster.num_kv_heads() != worker.num_kv_heads()) {
    return mismatch("num_kv_heads", cluster.num_kv_heads(),
                    worker.num_kv_heads());
  }
  if (cluster.head_dim() != 0 && cluster.head_dim() != worker.head_dim()) {
    return mismatch("head_dim", cluster.head_dim(), worker.head_dim());
  }
  if (cluster.block_size() != 0 &&
      cluster.block_size() != worker.block_size()) {
    return mismatch("block_size", cluster.block_size(), worker.block_size());
  }
  if (!cluster.kv_dtype().empty() && cluster.kv_dtype() != worker.kv_dtype()) {
    return mismatch("kv_dtype", cluster.kv_dtype(), worker.kv_dtype());
  }
  return absl::OkStatus();
}

std::unique_ptr<Resolver> MakeSystemResolver() {
  return std::make_unique<SystemResolver>();
}

std::unique_ptr<WorkerProber> MakeGrpcWorkerProber(std::string internal_token) {
  return std::make_unique<GrpcWorkerProber>(std::move(internal_token));
}

// ---------------------------------------------------------------------------
// WorkerLease
// ---------------------------------------------------------------------------

WorkerLease::WorkerLease(std::string address,
                         std::shared_ptr<std::atomic<int32_t>> count)
    : address_(std::move(address)), count_(std::move(count)) {
  count_->fetch_add(1);
}

WorkerLease::WorkerLease(WorkerLease&& other) noexcept
    : address_(std::move(other.address_)), count_(std::move(other.count_)) {}

WorkerLease& WorkerLease::operator=(WorkerLease&& other) noexcept {
  if (this != &other) {
    Release();
    address_ = std::move(other.address_);
    count_ = std::move(other.count_);
  }
  return *this;
}

void WorkerLease::Release() {
  if (count_ != nullptr) count_->fetch_sub(1);
  count_.reset();
}

// ---------------------------------------------------------------------------
// WorkerRegistry
// ---------------------------------------------------------------------------

WorkerRegistry::WorkerRegistry(RegistryConfig config,
                               std::unique_ptr<Resolver> resolver,
                               std::unique_ptr<WorkerProber> prober)
    : config_(std::move(config)),
      resolver_(std::move(resolver)),
      prober_(std::move(prober)),
      model_(config_.model) {}

WorkerRegistry::~WorkerRegistry() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (refresher_.joinable()) refresher_.join();
}

void WorkerRegistry::StartBackgroundRefresh() {
  if (refresher_.joinable()) return;
  refresher_ = std::thread([this] { RefreshLoop(); });
}

void WorkerRegistry::RefreshLoop() {
  while (true) {
    Refresh();
    absl::MutexLock lock(&mu_);
    auto stopping = [this]()
                        ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_; };
    if (mu_.AwaitWithTimeout(absl::Condition(&stopping),
                             config_.refresh_interval)) {
      return;
    }
  }
}

void WorkerRegistry::Refresh() {
  absl::MutexLock refresh_lock(&refresh_mu_);
  // 1. Resolve (outside mu_: getaddrinfo may block on DNS).
  struct Resolved {
    WorkerRole role;
    std::string target;
    std::vector<std::string> addresses;
    bool ok;
  };
  std::vector<Resolved> resolved;
  for (WorkerRole role : {WorkerRole::kPrefill, WorkerRole::kDecode}) {
    const auto& targets =
        role == WorkerRole::kPrefill ? config_.prefill : config_.decode;
    for (const std::string& target : targets) {
      std::string host;
      int port = 0;
      Resolved r{role, target, {}, false};
      if (SplitHostPort(target, &host, &port).ok()) {
        absl::StatusOr<std::vector<std::string>> addresses =
            resolver_->Resolve(host, port);
        if (addresses.ok()) {
          r.addresses = *std::move(addresses);
          r.ok = true;
        } else {
          PDS_LOG(WARNING) << WorkerRoleName(role) << " target " << target
                           << ": " << addresses.status();
        }
      }
      resolved.push_back(std::move(r));
    }
  }

  // 2. Reconcile entries: keep existing ones (their counters and reports),
  // add new addresses, drop vanished ones.
  std::vector<std::string> forgotten;
  {
    absl::MutexLock lock(&mu_);
    std::vector<Entry> next;
    for (const Resolved& r : resolved) {
      std::vector<std::string> addresses = r.addresses;
      if (!r.ok) {
        // Keep what we had for this target.
        for (const Entry& e : entries_) {
          if (e.status.role == r.role && e.status.target == r.target) {
            addresses.push_back(e.status.address);
          }
        }
      }
      for (const std::string& address : addresses) {
        auto it =
            std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) {
              return e.status.role == r.role && e.status.target == r.target &&
                     e.status.address == address;
            });
        if (it != entries_.end()) {
          next.push_back(std::move(*it));
          entries_.erase(it);
        } else {
          Entry entry;
          entry.status.role = r.role;
          entry.status.target = r.target;
          entry.status.address = address;
          entry.status.error = "not probed yet";
          next.push_back(std::move(entry));
        }
      }
    }
    for (const Entry& e : entries_) forgotten.push_back(e.status.address);
    entries_ = std::move(next);
  }
  for (const std::string& address : forgotten) prober_->Forget(address);

  // 3. Probe every worker (outside mu_: probes block up to probe_timeout).
  std::vector<std::pair<WorkerRole, std::string>> to_probe;
  {
    absl::MutexLock lock(&mu_);
    for (const Entry& e : entries_) {
      to_probe.emplace_back(e.status.role, e.status.address);
    }
  }
  std::vector<ProbeResult> results;
  results.reserve(to_probe.size());
  for (const auto& [role, address] : to_probe) {
    results.push_back(prober_->Probe(role, address, config_.probe_timeout));
  }

  // 4. Apply the results (entries may not have changed: Refresh is
  // serialized and only Refresh adds or removes entries).
  absl::MutexLock lock(&mu_);
  // An identity without a KV dtype takes the first compatible prefill
  // group's: prefill groups send the KV, so a decode worker keeping another
  // element type could never receive it (every Admit would fail the
  // transport's handshake), and neither could a prefill group sending
  // another one reach the decode workers that match the first.
  if (model_.has_value() && model_->kv_dtype().empty()) {
    for (size_t i = 0; i < to_probe.size() && i < entries_.size(); ++i) {
      const ProbeResult& result = results[i];
      if (entries_[i].status.role != WorkerRole::kPrefill || !result.serving ||
          !result.identity.has_value() || result.identity->kv_dtype().empty() ||
          !CheckCompatible(*model_, *result.identity).ok()) {
        continue;
      }
      model_->set_kv_dtype(result.identity->kv_dtype());
      break;
    }
  }
  for (size_t i = 0; i < to_probe.size() && i < entries_.size(); ++i) {
    WorkerStatus& status = entries_[i].status;
    const ProbeResult& result = results[i];
    status.serving = result.serving;
    status.error = result.error;
    if (result.load.has_value()) status.load = *result.load;
    status.compatible = true;
    if (result.identity.has_value()) {
      if (!model_.has_value()) model_ = *result.identity;
      if (absl::Status s = CheckCompatible(*model_, *result.identity);
          !s.ok()) {
        status.compatible = false;
        status.error = std::string(s.message());
      }
    }
  }
}

absl::StatusOr<WorkerLease> WorkerRegistry::Assign(
    WorkerRole role, AssignmentPolicy& policy,
    const AssignmentContext& context) {
  // Snapshot and pick under the lock: the view and the counters the lease
  // takes must belong to the same entries.
  absl::MutexLock lock(&mu_);
  std::vector<WorkerView> views;
  std::vector<const Entry*> entries;
  for (const Entry& e : entries_) {
    if (e.status.role != role) continue;
    views.push_back({e.status.address, e.status.serving && e.status.compatible,
                     e.status.load, e.assigned->load()});
    entries.push_back(&e);
  }
  absl::StatusOr<size_t> pick = policy.Pick(views, context);
  if (!pick.ok()) {
    return absl::UnavailableError(
        absl::StrCat("no healthy ", WorkerRoleName(role),
                     " worker: ", pick.status().message()));
  }
  const Entry& chosen = *entries[*pick];
  return WorkerLease(chosen.status.address, chosen.assigned);
}

void WorkerRegistry::MarkUnhealthy(const std::string& address,
                                   std::string_view why) {
  absl::MutexLock lock(&mu_);
  for (Entry& e : entries_) {
    if (e.status.address != address) continue;
    e.status.serving = false;
    e.status.error = std::string(why);
  }
}

std::vector<WorkerView> WorkerRegistry::Snapshot(WorkerRole role) const {
  absl::MutexLock lock(&mu_);
  std::vector<WorkerView> views;
  for (const Entry& e : entries_) {
    if (e.status.role != role) continue;
    views.push_back({e.status.address, e.status.serving && e.status.compatible,
                     e.status.load, e.assigned->load()});
  }
  return views;
}

std::vector<WorkerStatus> WorkerRegistry::Workers() const {
  absl::MutexLock lock(&mu_);
  std::vector<WorkerStatus> out;
  for (const Entry& e : entries_) {
    WorkerStatus status = e.status;
    status.assigned = e.assigned->load();
    out.push_back(std::move(status));
  }
  return out;
}

std::optional<v1::ModelIdentity> WorkerRegistry::model() const {
  absl::MutexLock lock(&mu_);
  return model_;
}

}  // namespace pdserve::router
