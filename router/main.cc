// router: the public face of a pdserve cluster. Serves pdserve.v1.Generation
// (+ grpc.health.v1, reflection) over gRPC and the OpenAI API over HTTP, and
// runs every request through a prefill group and a decode worker.
//
//   router --model PATH (--prefill H:P,... --decode H:P,... | --config FILE)
//          [flags]   (`router --help` lists every flag, its default and
//                    meaning, from the same table that parses them)
//
// --tls-cert/--tls-key: HTTPS and gRPC over TLS on the public ports (with
// --tls-client-ca, clients must present a certificate that CA signed).
//
// --api-key-file: clients must send one of the file's keys (one per line) as
// `Authorization: Bearer <key>` (HTTP /v1/*, gRPC metadata); /health and gRPC
// health stay open for probes. --internal-token-file: the cluster's shared
// token, sent on every call to the workers (they take the same file).
//
// Overload: a request that finds no decode worker with KV room waits in the
// router's admission queue, in arrival order (router/admission_queue.h), up
// to --queue-timeout-seconds, instead of failing; 429 only when
// --max-queued requests already wait (or --max-in-flight, running + waiting,
// is reached), 503 only when no worker is healthy.
//
// --colocated 1: the decode workers prefill prompts themselves (no prefill
// groups; the layout disaggregation is measured against).
// --layout-stages / --layout-tp: labels only (num_stages, tp on the router's
// series): the layout of the cluster this router fronts, so its TTFT and
// TPOT can be compared across layouts on one dashboard.
//
// --stagger-choices 0: OpenAI n > 1 starts every choice at once (lower
// latency for choices 1.., but each prefills the whole prompt; with 1 they
// start at choice 0's first token and reuse its cached prompt blocks).
//
// The model path gives the tokenizer, the context length and the vocabulary;
// the workers load the same model. --model-name must match the workers'
// (--model-name of decode_worker and prefill_worker): the registry keeps a
// worker whose identity differs out of rotation. SIGINT/SIGTERM stop.
#include <signal.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/command_line_flags.h"
#include "metrics/metrics.h"
#include "model/weight_source.h"
#include "process/port_file.h"
#include "router/admission_limiter.h"
#include "router/cluster_backend.h"
#include "router/dns_resolver.h"
#include "router/generation_service.h"
#include "router/http_server.h"
#include "router/metered_backend.h"
#include "router/planner_monitor.h"
#include "router/router_metrics.h"
#include "router/worker_registry.h"
#include "rpc/auth.h"
#include "rpc/server.h"
#include "rpc/tls.h"
#include "tokenizer/tokenizer.h"

namespace pdserve::router {
namespace {

constexpr char kSynopsis[] =
    "router --model PATH (--prefill H:P,... --decode H:P,... | --config "
    "FILE) [flags]\n"
    "The public face of a pdserve cluster: the OpenAI API over HTTP and "
    "pdserve.v1.Generation over gRPC, each request run through a prefill "
    "group and a decode worker.\n";

constexpr char kNotes[] =
    "A request that finds no decode worker with KV room waits in the "
    "admission queue, in arrival order, up to --queue-timeout-seconds; 429 "
    "only when --max-queued requests wait (or --max-in-flight is reached), "
    "503 only when no worker is healthy. SIGINT/SIGTERM stop.\n";

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "router: %s\n", s.ToString().c_str());
  return 1;
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

int Main(int argc, char** argv) {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  // A client that disconnects mid-write must not kill the process.
  signal(SIGPIPE, SIG_IGN);

  CommandLineFlags flags;
  if (auto s = flags.Parse(argc, argv); !s.ok()) return Fail(s);
  flags.Group("Model");
  const std::string model_path = flags.Str(
      "model", "",
      "Model folder or file (required): gives the tokenizer, context length "
      "and vocabulary; the workers load the same model.");
  const std::string format_name =
      flags.Str("format", "auto", "Model format: auto|gguf|safetensors|dummy.");
  std::string model_name = flags.Str(
      "model-name", "",
      "Name served to clients (/v1/models, the `model` field); must match "
      "the workers' --model-name or they stay out of rotation.",
      "the --model file or folder name");
  if (model_name.empty()) model_name = model::DefaultModelName(model_path);
  flags.Group("Workers");
  const std::string prefill_list =
      flags.Str("prefill", "",
                "Prefill groups as HOST:PORT,... (each group's stage 0); a "
                "host may resolve to several addresses.");
  const std::string decode_list =
      flags.Str("decode", "", "Decode workers as HOST:PORT,...");
  const std::string config_path = flags.Str(
      "config", "",
      "JSON file with the prefill and decode targets, refresh and probe "
      "intervals and the model identity (router/worker_registry.h); instead "
      "of --prefill/--decode.");
  const std::string dns_server = flags.Str(
      "dns-server", "",
      "Resolve the worker names at this DNS server (HOST:PORT,...; DNS "
      "only, no /etc/hosts) instead of the system resolver. On Kubernetes "
      "leave it empty: the system resolver asks the cluster DNS, whose "
      "headless-Service answers list the Ready pods.",
      "(system resolver)");
  const int refresh_ms = flags.Num<int>(
      "refresh-ms", 1000,
      "Milliseconds between re-resolving and health-probing the workers "
      "(>= 10; with --config the file's refresh_interval_ms).");
  const bool colocated = flags.Bool(
      "colocated", false,
      "1: no prefill groups; decode workers prefill prompts themselves.");
  const int block_size = flags.Num<int>(
      "block-size", 16,
      "KV block size in tokens; must match the workers' (prefix-aware "
      "hashing and the model identity).");
  flags.Group("Scheduling");
  const std::string prefill_policy_name =
      flags.Str("prefill-policy", "least-loaded",
                "How a request picks its prefill group: "
                "round-robin|least-loaded|prefix-aware.");
  const std::string decode_policy_name = flags.Str(
      "decode-policy", "prefix-aware",
      "How a request picks its decode worker: "
      "round-robin|least-loaded|prefix-aware (prefix-aware reuses cached "
      "prompt blocks).");
  const int max_in_flight = flags.Num<int>(
      "max-in-flight", 1024,
      "Most requests admitted at once, running plus waiting; more get 429.");
  const int max_queued =
      flags.Num<int>("max-queued", 0,
                     "Most requests waiting for KV room on a decode worker (0: "
                     "--max-in-flight); more get 429.");
  const double queue_timeout_s = flags.Num<double>(
      "queue-timeout-seconds", 60,
      "Seconds a request may wait in the admission queue before it fails.");
  const int max_attempts = flags.Num<int>(
      "max-attempts", 3,
      "Tries per request before its first token, each on a fresh "
      "prefill/decode pair.");
  const int max_migrations = flags.Num<int>(
      "max-migrations", 3,
      "Times a stream may move to another decode worker after its worker "
      "died, froze or drained mid-stream (0: such a stream fails).");
  const double migration_wait_s = flags.Num<double>(
      "migration-worker-wait-seconds", 10,
      "A migrating stream that finds no decode worker in rotation waits this "
      "long for one.");
  const bool prefill_fallback = flags.Bool(
      "prefill-fallback", true,
      "With no prefill group in rotation, decode workers prefill prompts "
      "themselves instead of the request failing with 503.");
  const int local_prefill_max_tokens = flags.Num<int>(
      "local-prefill-max-tokens", 0,
      "Prompts of at most this many tokens are prefilled by their decode "
      "worker, longer ones by a group (`pdserve plan` prints the crossover "
      "of a profile); 0: every prompt goes to a group.");
  const double drain_s = flags.Num<double>(
      "drain-timeout-seconds", 25.0,
      "On SIGTERM: NOT_SERVING and new requests refused with 503 at once, "
      "streams in flight run for up to this long. Keep it below the pod's "
      "terminationGracePeriodSeconds.");
  const double request_timeout_s = flags.Num<double>(
      "request-timeout-seconds", 600,
      "Each HTTP request's deadline in seconds (504 when it passes).");
  const bool stagger_choices = flags.Bool(
      "stagger-choices", true,
      "OpenAI n > 1: start choices 1.. at choice 0's first token, reusing "
      "its cached prompt blocks (0: all at once, lower latency, more "
      "prefill).");
  flags.Group("Network");
  const std::string host = flags.Str(
      "host", "0.0.0.0", "Interface the gRPC and HTTP servers listen on.");
  const int grpc_port = flags.Num<int>(
      "grpc-port", 0,
      "gRPC port (pdserve.v1.Generation, health, reflection); 0: any free "
      "port.");
  const int http_port = flags.Num<int>(
      "http-port", 0, "HTTP port of the OpenAI API; 0: any free port.");
  const std::string grpc_port_file =
      flags.Str("grpc-port-file", "",
                "Write the bound gRPC HOST:PORT here once serving.");
  const std::string http_port_file =
      flags.Str("http-port-file", "",
                "Write the bound HTTP HOST:PORT here once serving.");
  const int http_threads = flags.Num<int>(
      "http-threads", 0,
      "HTTP connection threads, the most concurrent HTTP requests (0: "
      "--max-in-flight + 16).");
  const double http_keep_alive_s = flags.Num<double>(
      "http-keep-alive-seconds", 60,
      "Seconds an idle HTTP keep-alive connection stays open; clients reuse "
      "pooled connections after their own pauses, and a shorter timeout "
      "races their next request (a broken pipe). >= 1.");
  flags.Group("Security");
  const std::string api_key_file = flags.Str(
      "api-key-file", "",
      "File of API keys, one per line: clients must send one as "
      "`Authorization: Bearer KEY` (HTTP /v1/*, gRPC); health stays open.");
  const std::string internal_token_file = flags.Str(
      "internal-token-file", "",
      "The cluster's shared token file, sent on every call to the workers "
      "(they take the same file).");
  rpc::TlsFiles tls;
  tls.cert_file = flags.Str(
      "tls-cert", "",
      "PEM certificate: HTTPS and gRPC over TLS on the public ports (with "
      "--tls-key).");
  tls.key_file = flags.Str("tls-key", "", "PEM private key of --tls-cert.");
  tls.client_ca_file = flags.Str(
      "tls-client-ca", "",
      "PEM CA: clients must present a certificate it signed (mutual TLS).");
  flags.Group("Metrics");
  const int metrics_port = flags.Num<int>(
      "metrics-port", -1,
      "Port of the Prometheus /metrics endpoint; -1: off, 0: any free port.");
  const std::string metrics_host = flags.Str(
      "metrics-host", host, "Interface /metrics listens on.", "--host");
  const std::string worker_id =
      flags.Str("worker-id", metrics::DefaultWorkerId(),
                "worker_id label on the metrics.", "HOSTNAME-PID");
  const std::string metrics_port_file =
      flags.Str("metrics-port-file", "",
                "Write the bound metrics HOST:PORT here once serving.");
  const int layout_stages = flags.Num<int>(
      "layout-stages", 1,
      "Label only: pipeline stages of the cluster this router fronts (to "
      "compare layouts on one dashboard).");
  const int layout_tp = flags.Num<int>(
      "layout-tp", 1,
      "Label only: tensor-parallel degree of the cluster's decode workers.");
  flags.Group("Layout planner");
  const std::string planner_perf_model = flags.Str(
      "planner-perf-model", "",
      "A profile saved by `pdserve plan --perf-model FILE`: plan for the "
      "observed workload every --planner-interval-s and export "
      "pdserve_planner_* (router/planner_monitor.h).",
      "(off)");
  const double planner_slo_ttft_ms = flags.Num<double>(
      "planner-slo-ttft-ms", 2000, "The planner's TTFT p99 SLO, ms.");
  const double planner_slo_tpot_ms = flags.Num<double>(
      "planner-slo-tpot-ms", 60, "The planner's TPOT p99 SLO, ms.");
  const int planner_cores =
      flags.Num<int>("planner-cores", 2,
                     "Cores (compute threads) per node one layout may use.");
  const int planner_nodes =
      flags.Num<int>("planner-nodes", 1,
                     "Nodes one layout may span, each of --planner-cores.");
  const double planner_network_gbps = flags.Num<double>(
      "planner-network-gbps", 0,
      "With --planner-nodes > 1: each node's link, Gbit/s each way (measure "
      "it with ucx_perftest between two nodes).",
      "(none)");
  const double planner_interval_s = flags.Num<double>(
      "planner-interval-s", 30, "Seconds between planner evaluations.");
  const bool planner_router_on_cores = flags.Bool(
      "planner-router-on-cores", false,
      "1: this router streams on the workers' cores (one machine); 0: it has "
      "its own (a pod of its own).");
  if (flags.help_requested()) {
    std::fputs(flags.Usage(kSynopsis, kNotes).c_str(), stdout);
    return 0;
  }
  if (auto s = flags.Check(); !s.ok()) return Fail(s);
  if (max_migrations < 0 || migration_wait_s < 0 ||
      local_prefill_max_tokens < 0 || drain_s < 0 || http_keep_alive_s < 1) {
    return Fail(absl::InvalidArgumentError(
        "--max-migrations, --migration-worker-wait-seconds, "
        "--local-prefill-max-tokens and --drain-timeout-seconds must be >= "
        "0, --http-keep-alive-seconds >= 1"));
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> grpc_credentials =
      rpc::ServerCredentialsFor(tls);
  if (!grpc_credentials.ok()) return Fail(grpc_credentials.status());
  rpc::BearerTokens api_keys;
  if (!api_key_file.empty()) {
    absl::StatusOr<rpc::BearerTokens> loaded =
        rpc::BearerTokens::FromFile(api_key_file);
    if (!loaded.ok()) return Fail(loaded.status());
    api_keys = *std::move(loaded);
  }
  std::string internal_token;
  if (!internal_token_file.empty()) {
    absl::StatusOr<rpc::BearerTokens> loaded =
        rpc::BearerTokens::FromFile(internal_token_file);
    if (!loaded.ok()) return Fail(loaded.status());
    internal_token = loaded->first();
  }
  if (layout_stages < 1 || layout_tp < 1) {
    return Fail(absl::InvalidArgumentError(
        "--layout-stages and --layout-tp must be >= 1"));
  }
  if (model_path.empty()) {
    return Fail(absl::InvalidArgumentError("--model is required"));
  }
  if (max_in_flight < 1 || request_timeout_s <= 0 || refresh_ms < 10 ||
      max_queued < 0 || queue_timeout_s <= 0) {
    return Fail(absl::InvalidArgumentError(
        "--max-in-flight >= 1, --max-queued >= 0, --queue-timeout-seconds > "
        "0, --request-timeout-seconds > 0 and --refresh-ms >= 10 are "
        "required"));
  }

  // Workers.
  RegistryConfig registry_config;
  if (!config_path.empty()) {
    if (!prefill_list.empty() || !decode_list.empty()) {
      return Fail(absl::InvalidArgumentError(
          "give --config or --prefill/--decode, not both"));
    }
    absl::StatusOr<std::string> text = ReadFile(config_path);
    if (!text.ok()) return Fail(text.status());
    absl::StatusOr<RegistryConfig> parsed = ParseRegistryConfig(*text);
    if (!parsed.ok()) return Fail(parsed.status());
    registry_config = *std::move(parsed);
  } else {
    absl::StatusOr<std::vector<std::string>> prefill =
        ParseTargetList(prefill_list);
    if (!prefill.ok()) return Fail(prefill.status());
    absl::StatusOr<std::vector<std::string>> decode =
        ParseTargetList(decode_list);
    if (!decode.ok()) return Fail(decode.status());
    registry_config.prefill = *std::move(prefill);
    registry_config.decode = *std::move(decode);
    registry_config.refresh_interval = absl::Milliseconds(refresh_ms);
  }
  if ((registry_config.prefill.empty() && !colocated) ||
      registry_config.decode.empty()) {
    return Fail(absl::InvalidArgumentError(
        "at least one prefill group (unless --colocated 1) and one decode "
        "worker are required (--prefill, --decode or --config)"));
  }

  // The model: tokenizer and limits.
  absl::StatusOr<model::LoadFormat> format =
      model::ParseLoadFormat(format_name);
  if (!format.ok()) return Fail(format.status());
  absl::StatusOr<std::unique_ptr<model::WeightSource>> weights =
      model::OpenModel(model_path, *format);
  if (!weights.ok()) return Fail(weights.status());
  std::unique_ptr<tokenizer::Tokenizer> tokenizer;
  if (*format != model::LoadFormat::kDummy) {
    absl::StatusOr<std::unique_ptr<tokenizer::Tokenizer>> loaded =
        tokenizer::LoadTokenizerForModel(**weights);
    if (!loaded.ok()) return Fail(loaded.status());
    tokenizer = *std::move(loaded);
  }
  // Chat prompts: the model's own template where it ships one (a template
  // that cannot be read stops the router: serving a made-up prompt format
  // would quietly degrade every answer).
  std::unique_ptr<ChatPrompt> chat_prompt = ChatPrompt::Fallback();
  if (*format != model::LoadFormat::kDummy) {
    absl::StatusOr<model::TokenizerSpec> spec = (*weights)->tokenizer_spec();
    absl::StatusOr<std::unique_ptr<ChatPrompt>> loaded =
        spec.ok() && !spec->chat_template.empty()
            ? ChatPrompt::ForGguf(model_path, *spec)
            : ChatPrompt::ForModel(model_path);
    if (!loaded.ok()) return Fail(loaded.status());
    chat_prompt = *std::move(loaded);
  }
  std::fprintf(stderr, "router: chat prompts: %s\n",
               chat_prompt->Describe().c_str());

  // The cluster's identity, as far as the router knows it from the model it
  // loaded: a worker serving another model, name or KV block size stays out
  // of rotation. (A config file's "model" wins.)
  if (!registry_config.model.has_value()) {
    const model::ModelConfig& c = (*weights)->config();
    v1::ModelIdentity identity;
    identity.set_name(model_name);
    identity.set_config_identity(c.Identity());
    identity.set_num_layers(c.num_layers);
    identity.set_num_kv_heads(c.num_kv_heads);
    identity.set_head_dim(c.head_dim);
    identity.set_block_size(block_size);
    registry_config.model = identity;
  }

  absl::StatusOr<std::unique_ptr<AssignmentPolicy>> prefill_policy =
      MakeAssignmentPolicy(prefill_policy_name);
  if (!prefill_policy.ok()) return Fail(prefill_policy.status());
  absl::StatusOr<std::unique_ptr<AssignmentPolicy>> decode_policy =
      MakeAssignmentPolicy(decode_policy_name);
  if (!decode_policy.ok()) return Fail(decode_policy.status());

  std::unique_ptr<Resolver> resolver;
  if (dns_server.empty()) {
    resolver = MakeSystemResolver();
  } else {
    absl::StatusOr<std::unique_ptr<Resolver>> made =
        MakeDnsResolver(dns_server);
    if (!made.ok()) return Fail(made.status());
    resolver = *std::move(made);
  }
  WorkerRegistry registry(registry_config, std::move(resolver),
                          MakeGrpcWorkerProber(internal_token));
  registry.StartBackgroundRefresh();

  ClusterBackendOptions backend_options;
  backend_options.model.name = model_name;
  backend_options.model.context_length =
      (*weights)->config().max_position_embeddings;
  backend_options.model.vocab_size = (*weights)->config().vocab_size;
  backend_options.block_size = block_size;
  backend_options.max_attempts = max_attempts;
  backend_options.max_migrations = max_migrations;
  backend_options.migration_worker_wait = absl::Seconds(migration_wait_s);
  backend_options.prefill_fallback = prefill_fallback;
  backend_options.local_prefill_max_tokens = local_prefill_max_tokens;
  backend_options.colocated = colocated;
  backend_options.internal_token = internal_token;
  backend_options.queue.max_waiting =
      max_queued > 0 ? max_queued : max_in_flight;
  backend_options.queue.max_wait = absl::Seconds(queue_timeout_s);
  // Metrics are always collected (cheap); served only with --metrics-port.
  auto metrics_registry = std::make_shared<metrics::MetricsRegistry>(
      metrics::Layout{"router", worker_id, 0, layout_stages, layout_tp});
  metrics::RouterMetrics router_metrics(*metrics_registry);
  backend_options.metrics = &router_metrics;
  absl::StatusOr<std::unique_ptr<ClusterBackend>> backend =
      ClusterBackend::Create(backend_options, tokenizer.get(), &registry,
                             *std::move(prefill_policy),
                             *std::move(decode_policy));
  if (!backend.ok()) return Fail(backend.status());
  AdmissionLimiter limiter(backend->get(), max_in_flight);
  // Outside the limiter: its refusals (429) are counted too.
  MeteredBackend metered(&limiter, &router_metrics);
  RejectionHook on_rejected = [&metered](const std::string& api,
                                         absl::StatusCode code) {
    metered.OnRejected(api, code);
  };
  std::unique_ptr<PlannerMonitor> planner_monitor;
  if (!planner_perf_model.empty()) {
    absl::StatusOr<planner::PerfModel> perf =
        planner::PerfModel::Load(planner_perf_model);
    if (!perf.ok()) return Fail(perf.status());
    PlannerMonitorOptions po;
    po.model = *std::move(perf);
    po.slo = {planner_slo_ttft_ms / 1e3, planner_slo_tpot_ms / 1e3};
    po.resources.nodes = planner_nodes;
    po.resources.cores = planner_cores;
    po.resources.network_bytes_per_second = planner_network_gbps * 1e9 / 8;
    po.resources.router_shares_cores = planner_router_on_cores;
    po.interval = absl::Seconds(planner_interval_s);
    absl::StatusOr<std::unique_ptr<PlannerMonitor>> started =
        PlannerMonitor::Start(
            std::move(po),
            [&router_metrics] { return router_metrics.Served(); },
            *metrics_registry);
    if (!started.ok()) return Fail(started.status());
    planner_monitor = *std::move(started);
  }
  std::unique_ptr<metrics::MetricsServer> metrics_server;
  if (metrics_port >= 0) {
    auto started = metrics::MetricsServer::Start(
        metrics_host, metrics_port, metrics_registry, metrics_port_file);
    if (!started.ok()) return Fail(started.status());
    metrics_server = std::move(*started);
    std::printf("metrics on %s\n", metrics_server->address().c_str());
  }

  GenerationService generation(&metered, on_rejected, &api_keys);
  absl::StatusOr<std::unique_ptr<rpc::RunningServer>> grpc_server =
      rpc::RunningServer::Start(absl::StrCat(host, ":", grpc_port),
                                {&generation}, *grpc_credentials);
  if (!grpc_server.ok()) return Fail(grpc_server.status());
  (*grpc_server)->ReportHealthFor({v1::Generation::service_full_name()});

  HttpServerOptions http_options;
  http_options.host = host;
  http_options.port = http_port;
  http_options.threads = http_threads > 0 ? http_threads : max_in_flight + 16;
  http_options.request_timeout = absl::Seconds(request_timeout_s);
  http_options.stagger_choices = stagger_choices;
  http_options.on_rejected = on_rejected;
  http_options.api_keys = &api_keys;
  http_options.tls = tls;
  http_options.tokenizer = tokenizer.get();
  http_options.chat_prompt = chat_prompt.get();
  http_options.keep_alive = absl::Seconds(http_keep_alive_s);
  http_options.draining = [&limiter] { return limiter.draining(); };
  absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> http_server =
      OpenAiHttpServer::Start(http_options, &metered);
  if (!http_server.ok()) return Fail(http_server.status());
  const std::string http_address =
      absl::StrCat(host, ":", (*http_server)->port());

  // gRPC health follows the cluster: serving while at least one prefill
  // group and one decode worker are (what /health says over HTTP).
  absl::Notification stop_health;
  std::thread health_thread([&] {
    do {
      (*grpc_server)->SetServing(limiter.Health().ok());
      int64_t used = 0;
      int64_t total = 0;
      for (const WorkerView& w : registry.Snapshot(WorkerRole::kDecode)) {
        if (!w.eligible) continue;
        used += w.load.kv_blocks_used;
        total += w.load.kv_blocks_total;
      }
      router_metrics.SetClusterKvUsage(
          total > 0 ? static_cast<double>(used) / static_cast<double>(total)
                    : 0.0);
    } while (
        !stop_health.WaitForNotificationWithTimeout(absl::Milliseconds(250)));
  });

  std::printf("router: gRPC on %s, HTTP%s on %s, model '%s'%s\n",
              (*grpc_server)->address().c_str(), tls.enabled() ? "S" : "",
              http_address.c_str(), model_name.c_str(),
              tls.enabled() ? " (TLS)" : "");
  std::fflush(stdout);
  if (auto s =
          process::WritePortFile(grpc_port_file, (*grpc_server)->address());
      !s.ok()) {
    return Fail(s);
  }
  if (auto s = process::WritePortFile(http_port_file, http_address); !s.ok()) {
    return Fail(s);
  }

  int sig = 0;
  sigwait(&signals, &sig);
  // Drain: NOT_SERVING and new requests refused (503 / UNAVAILABLE) at
  // once, the streams in flight run to their end (a second signal or the
  // timeout cuts them short).
  limiter.StartDrain();
  (*grpc_server)->SetServing(false);
  std::fprintf(stderr,
               "router: signal %d, draining %d requests (up to %.1f s)\n", sig,
               limiter.in_flight(), drain_s);
  const absl::Time drain_deadline = absl::Now() + absl::Seconds(drain_s);
  while (limiter.in_flight() > 0 && absl::Now() < drain_deadline) {
    const timespec poll{0, 20 * 1000 * 1000};
    if (sigtimedwait(&signals, nullptr, &poll) > 0) break;
  }
  std::fprintf(stderr, "router: stopping with %d requests in flight\n",
               limiter.in_flight());
  stop_health.Notify();
  health_thread.join();
  (*grpc_server)->SetServing(false);
  (*http_server)->Stop();
  (*grpc_server)->Shutdown(2.0);
  backend->reset();
  return 0;
}

}  // namespace
}  // namespace pdserve::router

int main(int argc, char** argv) { return pdserve::router::Main(argc, argv); }
