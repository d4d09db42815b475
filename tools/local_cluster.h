// A whole pdserve cluster on this machine, as real processes: G prefill
// groups of S stages each (prefill_worker), W decode workers of T ranks each
// (decode_worker) and a router in front. `pdserve local` runs one for a
// person; the end-to-end tests run the same thing and then kill and restart
// parts of it.
//
// Every process binds port 0 (unless told otherwise) and reports its address
// through a port file in `work_dir`, so clusters never collide on ports; logs
// go to `work_dir/<name>.log`. Start() returns once the router reports
// SERVING over grpc.health.v1 (it does when its registry found a healthy
// prefill group and decode worker), or fails with the log tail of the process
// that did not come up. The destructor stops everything (router first, so no
// new work arrives; then the prefill groups; then the decode workers); if the
// launcher itself dies, its children die with it (PR_SET_PDEATHSIG).
//
// Supervise(), called now and then by the owner, restarts what died (with
// backoff) on the same ports, so the router's registry takes it back.
//
// Not thread-safe: one thread drives a LocalCluster (the one that started
// it — children are tied to the thread that forked them).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "process/child_process.h"
#include "process/dns_server.h"

namespace pdserve::tools {

struct LocalClusterOptions {
  std::string model_path;       // a GGUF file or a Hugging Face folder
  std::string format = "auto";  // auto|gguf|safetensors|dummy
  std::string model_name;       // "" = the file or folder name
  // Where the binaries are: `<bin_dir>/<name>` or `<bin_dir>/<name>/<name>`
  // (the build tree's layout) for prefill_worker, decode_worker and router.
  std::string bin_dir;
  std::string work_dir;  // logs and port files; "" = a fresh temp folder

  // No prefill groups: the decode workers prefill themselves (the router runs
  // with --colocated 1).
  bool colocated = false;
  int prefill_groups = 1;
  int stages = 1;  // S per group
  std::string layer_split = "auto";
  std::string chunk_policy = "equal-cost";
  int chunk_tokens = 256;
  int64_t prefill_blocks = 512;
  int prefill_threads = 1;  // compute threads per stage

  int decode_workers = 1;
  int tp = 1;                       // T per decode worker
  std::string speculation = "off";  // off|ngram|draft
  int draft_layers = 0;             // for draft: target's first L layers
  int64_t decode_blocks = 1024;
  int max_running = 64;
  // Tokens one decode step may feed (decodes + drafts + prefill chunks of a
  // colocated worker).
  int max_step_tokens = 512;
  int decode_threads = 1;  // compute threads per TP rank

  // "cuda" runs every prefill stage and decode rank on GPUs: decode worker w
  // gets --cuda-devices as given, prefill stage s of group g the device
  // cuda_devices[(g * stages + s) % count].
  std::string backend = "cpu";
  std::string cuda_devices = "0";
  // KV element type of every prefill stage and decode worker (auto|f32|bf16).
  std::string kv_dtype = "auto";
  // How every worker multiplies quantized GGUF weights (int8|exact).
  std::string quantized_matmul = "int8";
  // Decode workers' --moe-parallel (tp|ep).
  std::string moe_parallel = "tp";

  // Every process is on this host: KV goes by shared memory (UCX endpoints
  // without peer-failure mode; dead peers are found by leases, heartbeats
  // and gRPC instead). false = tcp endpoints that report a dead peer at once.
  bool shared_memory_kv = true;

  std::string host = "127.0.0.1";
  // The token every internal RPC carries (services/rpc/auth.h): "" = a fresh
  // random one, written to work_dir/internal.token (mode 0600).
  std::string internal_token_file;
  // The router's API keys (one per line); "" = the public API is open.
  std::string api_key_file;
  int grpc_port = 0;  // router; 0 = any free port
  int http_port = 0;
  std::string prefill_policy = "least-loaded";
  std::string decode_policy = "prefix-aware";
  int max_in_flight = 1024;  // router: running + queued requests
  int refresh_ms = 250;      // router's probe interval
  absl::Duration start_timeout = absl::Seconds(120);
  // Told how the start goes, a line at a time ("decode-0 up on ... (2.1 s)",
  // every 5 s "still starting decode-0 (10 s): <its log's last line>"), so a
  // large model's minutes of loading are not silence. Optional.
  std::function<void(const std::string&)> progress;
  // /metrics on every process: -1 off; 0 any free port (read back through
  // port files); B > 0 the ports of deploy/prometheus/prometheus-local.yml:
  // router B, prefill group g stage i B + 10 + g * stages + i, decode worker
  // w B + 20 + w.
  int metrics_port_base = -1;
  // Decode worker w appends a CSV line per forward step to
  // `<step_trace_prefix>decode-<w>.csv` (decode_worker --step-trace), stage s
  // of prefill group g one per microbatch to
  // `<step_trace_prefix>prefill-<g>-stage-<s>.csv`; "" = no trace.
  std::string step_trace_prefix;
  // Supervise(): the wait before restarting a process that died, doubling
  // with each death in a row up to the max; a process that stayed up for
  // `restart_reset` starts again from the initial wait.
  absl::Duration restart_backoff = absl::Milliseconds(500);
  // Membership by DNS, as Kubernetes' headless Services give it: the cluster
  // runs a DNS server (Debian's dnsmasq) on a loopback port, decode worker w
  // listens on 127.0.2.(w+1) and prefill group g's stage 0 on
  // 127.0.3.(g+1) (one port for all decode workers, one for all groups),
  // and the router resolves `decode.pdserve.local` and
  // `prefill.pdserve.local` there (--dns-server). AddDecodeWorker /
  // RemoveDecodeWorker (and the prefill pair) then scale the cluster under
  // the router's feet. false: the router gets the address lists.
  bool dns_discovery = false;
  // --drain-timeout-seconds of every process; < 0: the binaries' default.
  double drain_timeout_s = -1;
  // --max-migrations of the router; < 0: its default.
  int max_migrations = -1;
  // --local-prefill-max-tokens of the router (0: every prompt to a group).
  int local_prefill_max_tokens = 0;
  absl::Duration max_restart_backoff = absl::Seconds(30);
  absl::Duration restart_reset = absl::Seconds(60);
};

// One restart Supervise() made (or tried).
struct RestartEvent {
  std::string name;     // "decode-0", "prefill-0" (a group), "router"
  std::string reason;   // how it ended: "signal 9", "exit 1"
  absl::Status status;  // of the restart
  int attempt = 0;      // deaths in a row
};

class LocalCluster {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<LocalCluster>> Start(
      LocalClusterOptions options);
  ~LocalCluster();  // Stop()
  LocalCluster(const LocalCluster&) = delete;
  LocalCluster& operator=(const LocalCluster&) = delete;

  const LocalClusterOptions& options() const { return options_; }
  const std::string& grpc_address() const { return grpc_address_; }
  const std::string& http_address() const { return http_address_; }
  const std::string& model_name() const { return options_.model_name; }
  // What a caller of the workers' internal APIs must send (tests, benches).
  const std::string& internal_token() const { return internal_token_; }
  // Stage 0 of each group / each decode worker: gRPC "host:port".
  const std::vector<std::string>& prefill_addresses() const {
    return prefill_addresses_;
  }
  // Group `group`'s stages' control addresses (stage 0: the group's own).
  const std::vector<std::string>& stage_addresses(int group) const {
    return groups_.at(group).stage_addresses;
  }
  const std::vector<std::string>& decode_addresses() const {
    return decode_addresses_;
  }

  // SIGKILL, as a crash would.
  void KillDecode(int worker);
  // Any signal (SIGSTOP / SIGCONT: a frozen worker and its thaw).
  void SignalDecode(int worker, int signal);
  void KillPrefillStage(int group, int stage);
  void KillRouter();
  // Scaling (dns_discovery only; FAILED_PRECONDITION otherwise). Add starts
  // one more decode worker (prefill group) and publishes its DNS record once
  // it serves, returning its index. Remove takes the record away first (a
  // terminating pod leaves its Service's endpoints), then SIGTERM — the
  // process drains — or, with `drain` false, SIGKILL (a lost node, whose
  // record would linger: it is left in place), and waits up to `timeout` for
  // the exit. A removed slot stays empty (Supervise leaves it alone).
  [[nodiscard]] absl::StatusOr<int> AddDecodeWorker();
  [[nodiscard]] absl::Status RemoveDecodeWorker(int worker, bool drain,
                                                absl::Duration timeout);
  [[nodiscard]] absl::StatusOr<int> AddPrefillGroup();
  [[nodiscard]] absl::Status RemovePrefillGroup(int group, bool drain,
                                                absl::Duration timeout);
  // Indices of the decode workers / groups not removed.
  std::vector<int> live_decode_workers() const;
  std::vector<int> live_prefill_groups() const;
  // The DNS server (dns_discovery; null otherwise).
  const process::DnsServer* dns() const { return dns_.get(); }
  // Stops what is left of the group and starts all its stages again, stage 0
  // on its old port (the router's registry knows the group by it).
  [[nodiscard]] absl::Status RestartPrefillGroup(int group);
  // Starts one stage i > 0 again on its old port (after KillPrefillStage):
  // the group's stage 0 notices every stage answering, restarts the group in
  // place and serves again (prefill_worker's recovery). Returns once the
  // stage serves its control API; the group needs a few seconds more.
  [[nodiscard]] absl::Status RestartPrefillStage(int group, int stage);
  // Restarts every process that exited, on its old port, once its backoff
  // passed: a decode worker or the router alone; a prefill group whole when
  // its stage 0 died, else the dead stage (stage 0 then rewires the group).
  // A stopped (SIGSTOP) process is alive: not restarted. Returns what it did
  // (also logged to stderr); restarts() counts every restart per name.
  std::vector<RestartEvent> Supervise();
  const std::map<std::string, int>& restarts() const { return restarts_; }
  // Until the router answers SERVING (DEADLINE_EXCEEDED otherwise).
  [[nodiscard]] absl::Status WaitRouterServing(absl::Duration timeout) const;
  // Stops every process. Idempotent.
  void Stop();
  // Process name ("router", "decode-0", "prefill-1-stage-0") -> its
  // /metrics address, for every process that serves one.
  const std::map<std::string, std::string>& metrics_addresses() const {
    return metrics_addresses_;
  }
  // Every running process, the router first (then the stages, then the
  // decode workers): for reading their CPU time (the layout planner's
  // calibration).
  std::vector<pid_t> pids() const;
  // The endpoints, for people.
  std::string Describe() const;
  // A process's log, for test failures ("router", "decode-0",
  // "prefill-1-stage-0").
  std::string LogTail(const std::string& name, size_t max_bytes = 4096) const;

 private:
  struct Group {
    std::vector<std::unique_ptr<process::ChildProcess>> stages;
    std::vector<std::vector<std::string>> stage_args;  // as launched
    std::vector<std::string> stage_addresses;          // as bound
    int port = 0;
  };
  explicit LocalCluster(LocalClusterOptions options)
      : options_(std::move(options)) {}

  absl::StatusOr<std::string> Binary(const std::string& name) const;
  absl::StatusOr<std::unique_ptr<process::ChildProcess>> Launch(
      const std::string& binary, const std::string& name,
      std::vector<std::string> args);
  // Appends the metrics flags for process `name` (port `offset` from the
  // base) and returns its metrics port file ("" when metrics are off).
  std::string MetricsArgs(const std::string& name, int offset,
                          std::vector<std::string>* args) const;
  // Reads the metrics port file once the process serves.
  // WaitForPortFile with progress reports (options_.progress).
  absl::StatusOr<std::string> WaitUp(const std::string& name,
                                     const std::string& port_file,
                                     process::ChildProcess* child) const;
  absl::Status RecordMetrics(const std::string& name,
                             const std::string& port_file,
                             process::ChildProcess* child);
  absl::Status StartPrefillGroup(int group, int port);
  absl::Status StartDecode(int worker, int port = 0);
  absl::Status StartRouter();
  // FAILED_PRECONDITION unless dns_discovery (the router's lists are fixed).
  absl::Status CheckScaling() const;
  // Sets the DNS server's records to the published workers'.
  absl::Status PublishDns();
  // The host decode worker w / group g's stage 0 listens on.
  std::string DecodeHost(int worker) const;
  std::string PrefillHost(int group) const;
  // Supervise()'s bookkeeping for one name.
  struct Backoff {
    int deaths_in_a_row = 0;
    absl::Time started = absl::Now();
    absl::Time next_try = absl::InfinitePast();
  };
  // Whether `name` (dead, described by `reason`) may be restarted now;
  // records the death once.
  bool RestartDue(const std::string& name);
  void Restarted(const std::string& name, const std::string& reason,
                 absl::Status status, std::vector<RestartEvent>* events);

  LocalClusterOptions options_;
  std::vector<Group> groups_;
  std::vector<std::unique_ptr<process::ChildProcess>> decodes_;
  std::unique_ptr<process::ChildProcess> router_;
  std::vector<std::string> prefill_addresses_;
  std::vector<std::string> decode_addresses_;
  std::string internal_token_;
  std::string grpc_address_;
  std::string http_address_;
  std::map<std::string, std::string> metrics_addresses_;
  std::map<std::string, Backoff> backoff_;
  std::map<std::string, int> restarts_;
  // dns_discovery.
  std::unique_ptr<process::DnsServer> dns_;
  int decode_port_ = 0;   // every decode worker's, on its own address
  int prefill_port_ = 0;  // every group's stage 0's
  // Workers whose record is published (added and serving, not removed).
  std::set<int> published_decode_;
  std::set<int> published_prefill_;
};

}  // namespace pdserve::tools
