// The router's view of its workers: prefill groups (addressed by their stage
// 0) and decode workers, each side a list of targets "host:port" from flags or
// a JSON config file. A host may resolve to several addresses (a Kubernetes
// headless service); every address is one worker. Refresh() re-resolves every
// target (workers appear and disappear), then probes each worker for health
// (grpc.health.v1), its load report and its model identity; a worker whose
// identity differs from the cluster's (model, KV layout: the fields of
// pdserve.v1.ModelIdentity) is kept out of rotation as incompatible, since
// KV written by a prefill in one layout cannot be read by a decode in another.
//
// Threads: an optional background thread calls Refresh() every
// refresh_interval; Snapshot()/Assign()/Workers() may be called from any
// thread concurrently with it. Probes run outside the lock.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "pdserve/v1/common.pb.h"
#include "router/assignment_policy.h"

namespace pdserve::router {

enum class WorkerRole { kPrefill, kDecode };
const char* WorkerRoleName(WorkerRole role);

struct RegistryConfig {
  std::vector<std::string> prefill;  // "host:port" each
  std::vector<std::string> decode;
  absl::Duration refresh_interval = absl::Seconds(2);
  absl::Duration probe_timeout = absl::Milliseconds(500);
  // The cluster's model; when unset, the first identity a worker reports.
  std::optional<v1::ModelIdentity> model;
};

// {"prefill": ["host:port", ...], "decode": [...],
//  "refresh_interval_ms": 2000, "probe_timeout_ms": 500,
//  "model": {"name": ..., "config_identity": ..., "num_layers": ...,
//            "num_kv_heads": ..., "head_dim": ..., "block_size": ...,
//            "kv_dtype": ...}}   ("model" optional)
// INVALID_ARGUMENT naming the field for malformed input.
[[nodiscard]] absl::StatusOr<RegistryConfig> ParseRegistryConfig(
    std::string_view json_text);
// A flag value "a:1,b:2" -> {"a:1", "b:2"}; each must be host:port.
[[nodiscard]] absl::StatusOr<std::vector<std::string>> ParseTargetList(
    std::string_view flag_value);
// Splits "host:port" / "[v6]:port"; INVALID_ARGUMENT otherwise.
[[nodiscard]] absl::Status SplitHostPort(std::string_view target,
                                         std::string* host, int* port);

// FAILED_PRECONDITION naming the first field in which `worker` differs from
// `cluster`. Fields `cluster` leaves unset ("" / 0) match anything.
[[nodiscard]] absl::Status CheckCompatible(const v1::ModelIdentity& cluster,
                                           const v1::ModelIdentity& worker);

// Name -> addresses ("ip:port", sorted, unique).
class Resolver {
 public:
  virtual ~Resolver() = default;
  [[nodiscard]] virtual absl::StatusOr<std::vector<std::string>> Resolve(
      const std::string& host, int port) = 0;
};
// getaddrinfo (TCP); UNAVAILABLE when the name does not resolve.
std::unique_ptr<Resolver> MakeSystemResolver();

struct ProbeResult {
  bool serving = false;
  std::string error;  // why not serving
  std::optional<WorkerLoad> load;
  std::optional<v1::ModelIdentity> identity;
};

// Asks one worker how it is. Blocking, bounded by `timeout`; called from the
// refresh thread only.
class WorkerProber {
 public:
  virtual ~WorkerProber() = default;
  virtual ProbeResult Probe(WorkerRole role, const std::string& address,
                            absl::Duration timeout) = 0;
  // The address left the registry (drop cached channels).
  virtual void Forget(const std::string& address) {}
};
// grpc.health.v1 Check ("" service), then the load report:
// DecodeWorker.GetLoad (queued = waiting + awaiting_kv) or PrefillGroup.GetLoad
// (queued, in_flight; `serving` false = a stage is down = not serving). A
// worker answering health but not GetLoad stays in rotation without a report.
// Both load reports carry the worker's ModelIdentity, which the registry
// checks against the cluster's.
// `internal_token`: sent on the probes' GetLoad calls (workers started with
// an internal token refuse them otherwise); empty: none.
std::unique_ptr<WorkerProber> MakeGrpcWorkerProber(
    std::string internal_token = "");

// One worker's state, for /health, metrics and tests.
struct WorkerStatus {
  WorkerRole role;
  std::string target;   // as configured
  std::string address;  // resolved
  bool serving = false;
  bool compatible = true;
  std::string error;  // why unhealthy or incompatible
  WorkerLoad load;
  int32_t assigned = 0;
};

// A request's hold on a worker: counts in the worker's `assigned` until
// destroyed. Move-only; may outlive the worker's registry entry.
class WorkerLease {
 public:
  WorkerLease() = default;
  WorkerLease(std::string address, std::shared_ptr<std::atomic<int32_t>> count);
  ~WorkerLease() { Release(); }
  WorkerLease(WorkerLease&& other) noexcept;
  WorkerLease& operator=(WorkerLease&& other) noexcept;
  WorkerLease(const WorkerLease&) = delete;
  WorkerLease& operator=(const WorkerLease&) = delete;

  const std::string& address() const { return address_; }
  void Release();

 private:
  std::string address_;
  std::shared_ptr<std::atomic<int32_t>> count_;
};

class WorkerRegistry {
 public:
  WorkerRegistry(RegistryConfig config, std::unique_ptr<Resolver> resolver,
                 std::unique_ptr<WorkerProber> prober);
  ~WorkerRegistry();  // stops the background thread
  WorkerRegistry(const WorkerRegistry&) = delete;
  WorkerRegistry& operator=(const WorkerRegistry&) = delete;

  // Re-resolves every target and probes every worker once. Calls are
  // serialized; a target that fails to resolve keeps its previous addresses
  // (a DNS hiccup must not empty the cluster).
  void Refresh();
  // Refresh() now and then every refresh_interval on a thread of its own.
  void StartBackgroundRefresh();

  // Policy's pick among the side's workers, as a lease. UNAVAILABLE when no
  // worker of that side is serving and compatible.
  [[nodiscard]] absl::StatusOr<WorkerLease> Assign(
      WorkerRole role, AssignmentPolicy& policy,
      const AssignmentContext& context);

  // The router saw `address` fail (e.g. UNAVAILABLE on a call): out of
  // rotation until a probe finds it serving again.
  void MarkUnhealthy(const std::string& address, std::string_view why);

  std::vector<WorkerView> Snapshot(WorkerRole role) const;
  std::vector<WorkerStatus> Workers() const;
  // The cluster's identity (configured, or adopted from the first worker
  // that reported one).
  std::optional<v1::ModelIdentity> model() const;

 private:
  struct Entry {
    WorkerStatus status;
    std::shared_ptr<std::atomic<int32_t>> assigned =
        std::make_shared<std::atomic<int32_t>>(0);
  };

  void RefreshLoop();

  const RegistryConfig config_;
  const std::unique_ptr<Resolver> resolver_;
  const std::unique_ptr<WorkerProber> prober_;
  absl::Mutex refresh_mu_;  // serializes Refresh()
  mutable absl::Mutex mu_;
  // Ordered by (role, target, address) so snapshots are stable for the
  // policies' rings.
  std::vector<Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::optional<v1::ModelIdentity> model_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread refresher_;
};

}  // namespace pdserve::router
