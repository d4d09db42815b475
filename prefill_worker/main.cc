// prefill_worker: one pipeline stage of a prefill group per process.
//
//   prefill_worker --model PATH --stage I --stages S [--peers ...] [flags]
//   (`prefill_worker --help` lists every flag, its default and meaning)
//
// Stage 0 serves pdserve.v1.PrefillGroup (+ health, reflection) on --port;
// stage i > 0 serves pdserve.v1.PrefillStageControl there. Start stages
// 1..S-1 first (any order), then stage 0 with their addresses: it wires the
// pipeline and only then listens. With --port-file the bound "host:port" is
// written there (atomically) once the process serves. A stage i > 0 that
// stage 0 stopped pinging for --orphan-seconds exits. With --metrics-port
// the stage serves /metrics and logs "metrics on HOST:PORT" (stderr).
// SIGINT/SIGTERM stop.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/command_line_flags.h"
#include "engine/backend_flags.h"
#include "grammar/structured_output.h"
#include "metrics/metrics.h"
#include "model/weight_source.h"
#include "planner/step_trace.h"
#include "prefill/chunk_policy.h"
#include "prefill/layer_split.h"
#include "prefill_worker/prefill_service.h"
#include "prefill_worker/stage_control_service.h"
#include "prefill_worker/stage_metrics.h"
#include "prefill_worker/stage_process.h"
#include "process/port_file.h"
#include "rpc/auth.h"
#include "rpc/server.h"
#include "transport/net_device.h"

namespace pdserve::prefill {
namespace {

constexpr char kSynopsis[] =
    "prefill_worker --model PATH --stage I --stages S [flags]\n"
    "       stage 0 also: --peers HOST:PORT,... (stages 1..S-1)\n"
    "One pipeline stage of a prefill group per process.\n";

constexpr char kNotes[] =
    "Stage 0 serves pdserve.v1.PrefillGroup on --port; stage i > 0 serves "
    "pdserve.v1.PrefillStageControl there. Start stages 1..S-1 first, then "
    "stage 0 with their addresses. SIGINT/SIGTERM stop.\n";

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "prefill_worker: %s\n", s.ToString().c_str());
  return 1;
}

// Waits for SIGINT/SIGTERM (blocked in every thread, see Main) up to
// `timeout`; true when one arrived.
bool WaitForSignal(absl::Duration timeout) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  timespec ts = absl::ToTimespec(timeout);
  return sigtimedwait(&set, nullptr, &ts) > 0;
}

// Teardown waits are bounded, but a peer that vanished mid-shutdown must not
// keep the process alive: exit hard if the orderly path takes too long.
void ArmExitWatchdog() {
  std::thread([] {
    absl::SleepFor(absl::Seconds(10));
    std::fprintf(stderr, "prefill_worker: shutdown took too long\n");
    std::_Exit(2);
  }).detach();
}

// Restarts this process in place (same pid, so a supervisor still tracks
// it; same port, so stage 0's peer list stays right) with fresh state:
// how a group recovers after one of its stages died and came back.
[[noreturn]] void ReExec(int argc, char** argv, const std::string& address) {
  const std::string port = address.substr(address.rfind(':') + 1);
  std::vector<std::string> args(argv, argv + argc);
  bool replaced = false;
  for (size_t i = 1; i < args.size(); ++i) {
    if (args[i] == "--port" && i + 1 < args.size()) {
      args[i + 1] = port;
      replaced = true;
    } else if (absl::StartsWith(args[i], "--port=")) {
      args[i] = absl::StrCat("--port=", port);
      replaced = true;
    }
  }
  if (!replaced) {
    args.push_back("--port");
    args.push_back(port);
  }
  std::vector<char*> exec_args;
  for (std::string& a : args) exec_args.push_back(a.data());
  exec_args.push_back(nullptr);
  std::fprintf(stderr, "prefill_worker: restarting in place on port %s\n",
               port.c_str());
  std::fflush(stderr);
  execv("/proc/self/exe", exec_args.data());
  std::perror("prefill_worker: re-exec failed");
  std::_Exit(1);
}

int Main(int argc, char** argv) {
  // Signals are taken with sigtimedwait on this thread only.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);

  CommandLineFlags flags;
  if (auto s = flags.Parse(argc, argv); !s.ok()) return Fail(s);
  flags.Group("Model");
  const std::string model_path =
      flags.Str("model", "", "Model folder or file (required).");
  const std::string format_name =
      flags.Str("format", "auto", "Model format: auto|gguf|safetensors|dummy.");
  std::string model_name = flags.Str(
      "model-name", "",
      "Name reported in the group's identity; must match the router's and "
      "the decode workers'.",
      "the --model file or folder name");
  if (model_name.empty()) model_name = model::DefaultModelName(model_path);
  const std::string backend_name = flags.Str(
      "backend", "cpu",
      "Compute backend: cpu|cuda (cuda: a -DPDSERVE_CUDA=ON build; KV is "
      "mirrored to host memory for the UCX puts).");
  const int cuda_device = static_cast<int>(
      flags.Num<int64_t>("cuda-device", 0, "GPU this stage runs on."));
  const std::string attention_name =
      flags.Str("cuda-attention", "auto",
                "CUDA attention kernels: auto|legacy|tensor-core.");
  const int threads = static_cast<int>(
      flags.Num<int64_t>("threads", 1, "Compute threads of this stage."));
  flags.Group("Pipeline");
  const int stage = static_cast<int>(flags.Num<int64_t>(
      "stage", 0, "This process's stage index, 0..--stages - 1."));
  const int stages = static_cast<int>(
      flags.Num<int64_t>("stages", 1, "Pipeline stages in the group."));
  const std::string split_text = flags.Str(
      "layer-split", "auto",
      "Layers per stage, e.g. 2,2,1; auto balances estimated FLOPs (every "
      "stage must get the same value).");
  // Share of prompt tokens expected to be scored (echo + logprobs): their
  // logits rows weigh on the last stage, which `auto` then gives fewer layers.
  const double scored_share = flags.Num<double>(
      "scored-share", 0.0,
      "Share (0-1) of prompt tokens expected to be scored with echo + "
      "logprobs: `auto` then gives the last stage fewer layers. Same on "
      "every stage.");
  const std::string peers_text = flags.Str(
      "peers", "",
      "Stage 0 only: the control HOST:PORT of stages 1..S-1, in order.");
  const int64_t heartbeat_ms = flags.Num<int64_t>(
      "heartbeat-ms", 200, "Stage 0 only: milliseconds between pings.");
  const int64_t heartbeat_timeout_ms = flags.Num<int64_t>(
      "heartbeat-timeout-ms", 2000,
      "Stage 0 only: a ping unanswered this long (ms) marks the group "
      "down.");
  const int64_t peer_wait_s = flags.Num<int64_t>(
      "peer-wait-seconds", 60,
      "Stage 0 only: seconds start-up waits for every peer to answer.");
  const int64_t orphan_s = flags.Num<int64_t>(
      "orphan-seconds", 30,
      "Stage > 0 only: exit when stage 0 stopped pinging this many "
      "seconds.");
  const double drain_s = flags.Num<double>(
      "drain-timeout-seconds", 25.0,
      "On SIGTERM: stage 0 stops taking prompts (readiness NOT_SERVING, "
      "Prefill UNAVAILABLE) and finishes those in the pipeline for up to "
      "this long; a later stage keeps serving until stage 0 stops pinging "
      "it (or this long). Keep it below terminationGracePeriodSeconds. 0: "
      "stop at once.");
  flags.Group("Scheduling");
  const std::string policy_name = flags.Str(
      "chunk-policy", "equal-cost",
      "How prompts are cut into chunks: equal-cost (earlier chunks larger, "
      "equal attention work) or fixed.");
  const int chunk_tokens = static_cast<int>(flags.Num<int64_t>(
      "chunk-tokens", 256,
      "Average tokens per chunk (fixed: exact); 0: whole prompt in one."));
  const int microbatch_tokens = static_cast<int>(flags.Num<int64_t>(
      "microbatch-tokens", 512, "Token budget of one pipeline microbatch."));
  const int max_in_flight = static_cast<int>(flags.Num<int64_t>(
      "max-in-flight", 0,
      "Microbatches in the pipeline at once (0: twice --stages)."));
  flags.Group("KV cache");
  const int block_size = static_cast<int>(flags.Num<int64_t>(
      "block-size", 16, "KV block size in tokens (the decode workers')."));
  const int64_t num_blocks = flags.Num<int64_t>(
      "num-blocks", 512,
      "KV blocks in the group (each stage's pool holds them all).");
  const bool prefix_reuse =
      flags.Bool("prefix-reuse", true,
                 "Reuse cached KV blocks of a prompt prefix seen before.");
  const std::string kv_dtype_name = flags.Str(
      "kv-dtype", "auto",
      "KV element type computed and sent: auto|f32|bf16 (auto: f32 on CPUs, "
      "bf16 on GPUs); decode workers must keep the same.");
  const std::string quantized_matmul_name = flags.Str(
      "quantized-matmul", "int8",
      "How quantized GGUF weights (Q8_0, Q4_K, Q6_K) multiply: int8 "
      "(activations rounded to int8 per block, like llama.cpp; several times "
      "faster) | exact (f32 products of the dequantized weights).");
  flags.Group("Network");
  const std::string host =
      flags.Str("host", "127.0.0.1",
                "Interface to listen on (0.0.0.0: every interface).");
  const int64_t port = flags.Num<int64_t>(
      "port", 0,
      "gRPC port (stage 0: PrefillGroup; others: stage control); 0: any "
      "free port.");
  const std::string port_file = flags.Str(
      "port-file", "", "Write the bound HOST:PORT here once serving.");
  const bool ucx_peer_errors = flags.Bool(
      "ucx-peer-errors", true,
      "Keep UCX endpoints that report a dead peer at once; 0 allows "
      "shared-memory endpoints (same host; decode workers must agree).");
  const std::string ucx_net_devices = flags.Str(
      "ucx-net-devices", "auto",
      "UCX network devices: auto (--host's interface), all, or a UCX device "
      "list.");
  flags.Group("Security");
  const std::string internal_token_file = flags.Str(
      "internal-token-file", "",
      "The cluster's shared token file: checked on this stage's RPCs and "
      "sent to its peers and the decode workers.");
  flags.Group("Metrics");
  const int metrics_port = static_cast<int>(flags.Num<int64_t>(
      "metrics-port", -1,
      "Port of the Prometheus /metrics endpoint; -1: off, 0: any free "
      "port."));
  const std::string metrics_host = flags.Str(
      "metrics-host", host, "Interface /metrics listens on.", "--host");
  const std::string metrics_port_file =
      flags.Str("metrics-port-file", "",
                "Write the bound metrics HOST:PORT here once serving.");
  const std::string worker_id = flags.Str(
      "worker-id", "prefill",
      "worker_id label on the metrics, shared by the group's stages.");
  const std::string step_trace_path = flags.Str(
      "step-trace", "",
      "Append one CSV line per microbatch to this file (end time, seconds, "
      "chunks, tokens fed, logit rows, attended positions, first tokens "
      "sampled): a loaded stage's steps, to set beside the layout planner's "
      "step costs.",
      "(none)");
  if (flags.help_requested()) {
    std::fputs(flags.Usage(kSynopsis, kNotes).c_str(), stdout);
    return 0;
  }
  if (auto s = flags.Check(); !s.ok()) return Fail(s);
  auto backend = engine::ParseBackend(backend_name);
  if (!backend.ok()) return Fail(backend.status());
  auto kv_dtype = engine::ParseKvDTypeFlag(kv_dtype_name);
  if (!kv_dtype.ok()) return Fail(kv_dtype.status());
  auto quantized_matmul = engine::ParseQuantizedMatmul(quantized_matmul_name);
  if (!quantized_matmul.ok()) return Fail(quantized_matmul.status());
  auto attention = engine::ParseAttentionKernels(attention_name);
  if (!attention.ok()) return Fail(attention.status());
  rpc::BearerTokens internal_tokens;
  if (!internal_token_file.empty()) {
    auto tokens = rpc::BearerTokens::FromFile(internal_token_file);
    if (!tokens.ok()) return Fail(tokens.status());
    internal_tokens = *std::move(tokens);
  }
  auto ucx_config = transport::UcxNetworkConfig(ucx_net_devices, host);
  if (!ucx_config.ok()) return Fail(ucx_config.status());
  if (model_path.empty()) {
    return Fail(absl::InvalidArgumentError("--model is required"));
  }
  if (stages < 1 || stage < 0 || stage >= stages) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        "--stage ", stage, " is not in [0, --stages ", stages, ")")));
  }
  if (threads < 1) {
    return Fail(absl::InvalidArgumentError("--threads must be >= 1"));
  }
  if (!(scored_share >= 0.0 && scored_share <= 1.0)) {
    return Fail(absl::InvalidArgumentError("--scored-share must be in [0, 1]"));
  }
  std::vector<std::string> peers;
  if (!peers_text.empty()) peers = absl::StrSplit(peers_text, ',');
  if (stage == 0 && static_cast<int>(peers.size()) != stages - 1) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("stage 0 of ", stages, " stages needs --peers with ",
                     stages - 1, " addresses, got ", peers.size())));
  }
  if (stage != 0 && !peers.empty()) {
    return Fail(absl::InvalidArgumentError("--peers is for stage 0 only"));
  }
  auto policy = ParseChunkPolicy(policy_name, chunk_tokens);
  if (!policy.ok()) return Fail(policy.status());

  auto format = model::ParseLoadFormat(format_name);
  if (!format.ok()) return Fail(format.status());
  auto weights = model::OpenModel(model_path, *format);
  if (!weights.ok()) return Fail(weights.status());
  const model::ModelConfig& config = (*weights)->config();
  // `auto` uses the FLOP model, not timings: every stage process computes
  // the split on its own and all must get the same answer.
  const int logit_rows = std::max(
      1, static_cast<int>(std::lround(scored_share * microbatch_tokens)));
  auto split = ResolveLayerSplit(
      split_text, stages,
      EstimateLayerCosts(config, microbatch_tokens, logit_rows));
  if (!split.ok()) return Fail(split.status());

  StageProcessOptions stage_options;
  stage_options.stage = stage;
  stage_options.num_stages = stages;
  stage_options.shard = SplitToShards(*split)[stage];
  stage_options.block_size = block_size;
  stage_options.num_blocks = num_blocks;
  stage_options.threads = threads;
  stage_options.ucx.peer_error_handling = ucx_peer_errors;
  stage_options.ucx.ucx_config = *ucx_config;
  stage_options.backend = *backend;
  stage_options.kv_dtype = *kv_dtype;
  stage_options.quantized_matmul = *quantized_matmul;
  stage_options.cuda.device = cuda_device;
  stage_options.cuda.attention = *attention;
  // A microbatch is at most the token budget (or one chunk, if larger).
  stage_options.cuda.max_tokens_per_step =
      std::max({stage_options.cuda.max_tokens_per_step, microbatch_tokens,
                chunk_tokens});
  // A microbatch of requests scoring their prompts asks for a logits row per
  // token (the last stage's buffer: 512 x 128k vocab x 4 B = 262 MB).
  stage_options.cuda.max_logit_rows = std::max(microbatch_tokens, chunk_tokens);
  // Metrics are off unless asked for: no observers, no HTTP thread.
  std::shared_ptr<metrics::MetricsRegistry> registry;
  std::unique_ptr<PrefillStageMetrics> stage_metrics;
  std::unique_ptr<metrics::MetricsServer> metrics_server;
  if (metrics_port >= 0) {
    registry = std::make_shared<metrics::MetricsRegistry>(
        metrics::Layout{"prefill", worker_id, stage, stages, 1});
    stage_metrics = std::make_unique<PrefillStageMetrics>(*registry);
    stage_options.observer = stage_metrics->Observer();
  }
  std::unique_ptr<planner::StepTraceWriter> step_trace;
  if (!step_trace_path.empty()) {
    auto trace = planner::StepTraceWriter::Open(step_trace_path);
    if (!trace.ok()) return Fail(trace.status());
    step_trace = *std::move(trace);
    stage_options.observer.on_step = [trace = step_trace.get()](
                                         const prefill::MicrobatchShape& shape,
                                         double seconds) {
      trace->Record({seconds, shape.chunks, static_cast<int>(shape.tokens),
                     shape.logit_rows, shape.attended_positions,
                     shape.first_tokens});
    };
  }
  // The last stage samples first tokens, under a grammar for structured
  // output: the model's tokenizer is loaded on the first such request (none:
  // those requests fail with a precise error; plain ones are served).
  std::unique_ptr<grammar::StructuredOutputCompiler> structured_output;
  if (stage + 1 == stages) {
    structured_output = std::make_unique<grammar::StructuredOutputCompiler>(
        **weights, config.EndTokenIds());
    stage_options.structured_output = structured_output.get();
  }
  auto process = StageProcess::Create(**weights, stage_options);
  if (!process.ok()) return Fail(process.status());
  // Serves before wiring (zeros until the stage runs), so Prometheus sees
  // the stage as soon as it exists.
  auto start_metrics = [&](const PrefillService* service) -> absl::Status {
    if (stage_metrics == nullptr) return absl::OkStatus();
    stage_metrics->Bind(process->get(), service);
    if (metrics_server != nullptr) return absl::OkStatus();
    auto started = metrics::MetricsServer::Start(metrics_host, metrics_port,
                                                 registry, metrics_port_file);
    if (!started.ok()) return started.status();
    metrics_server = std::move(*started);
    std::fprintf(stderr, "prefill_worker: metrics on %s\n",
                 metrics_server->address().c_str());
    return absl::OkStatus();
  };
  auto stop_metrics = [&] {
    metrics_server.reset();
    if (stage_metrics != nullptr) stage_metrics->Unbind();
  };
  const std::string address = absl::StrCat(host, ":", port);
  std::fprintf(stderr, "prefill_worker: stage %d/%d layers [%d, %d)\n", stage,
               stages, stage_options.shard.layer_begin,
               stage_options.shard.layer_end);

  if (stage == 0) {
    PrefillServiceOptions options;
    options.model_name = model_name;
    options.scheduler.chunk_policy = *policy;
    options.scheduler.microbatch_token_budget = microbatch_tokens;
    options.scheduler.max_in_flight = max_in_flight;
    options.scheduler.block_size = block_size;
    options.scheduler.num_blocks = num_blocks;
    options.scheduler.prefix_reuse = prefix_reuse;
    options.peers = peers;
    options.peer_wait = absl::Seconds(peer_wait_s);
    options.heartbeat_period = absl::Milliseconds(heartbeat_ms);
    options.heartbeat_timeout = absl::Milliseconds(heartbeat_timeout_ms);
    options.internal_tokens = internal_tokens;
    auto service = PrefillService::Create(**weights, process->get(), options);
    if (!service.ok()) return Fail(service.status());
    if (auto s = start_metrics(service->get()); !s.ok()) return Fail(s);
    auto server = rpc::RunningServer::Start(address, {service->get()});
    if (!server.ok()) return Fail(server.status());
    (*server)->ReportHealthFor({v1::PrefillGroup::service_full_name()});
    (*service)->Start(server->get());
    if (auto s = process::WritePortFile(port_file, (*server)->address());
        !s.ok()) {
      return Fail(s);
    }
    std::fprintf(stderr, "prefill_worker: listening on %s\n",
                 (*server)->address().c_str());
    while (!WaitForSignal(absl::Milliseconds(200))) {
      if ((*service)->recovery_requested()) {
        // Every stage answers again after a death: restart whole (the
        // peers were told to restart too) and wire the group anew.
        const std::string bound = (*server)->address();
        (*server)->Shutdown();
        ReExec(argc, argv, bound);
      }
    }
    // Drain: out of rotation, the prompts already taken run to their end
    // (a second signal or the timeout cuts it short: the router retries
    // those elsewhere).
    (*service)->StartDrain();
    std::fprintf(stderr,
                 "prefill_worker: draining %lld prompts (up to %.1f s)\n",
                 static_cast<long long>((*service)->in_flight()), drain_s);
    const absl::Time drain_deadline = absl::Now() + absl::Seconds(drain_s);
    while ((*service)->in_flight() > 0 && absl::Now() < drain_deadline) {
      if (WaitForSignal(absl::Milliseconds(20))) break;
    }
    ArmExitWatchdog();
    (*server)->Shutdown();
    stop_metrics();
    service->reset();
    process->reset();
    return 0;
  }

  if (auto s = start_metrics(nullptr); !s.ok()) return Fail(s);
  StageControlService control(process->get(), config.Identity(),
                              internal_tokens);
  auto server = rpc::RunningServer::Start(address, {&control});
  if (!server.ok()) return Fail(server.status());
  (*server)->ReportHealthFor({v1::PrefillStageControl::service_full_name()});
  if (auto s = process::WritePortFile(port_file, (*server)->address());
      !s.ok()) {
    return Fail(s);
  }
  std::fprintf(stderr, "prefill_worker: stage control on %s\n",
               (*server)->address().c_str());
  int code = 0;
  // Stage 0 pinged within this: still using this stage.
  const auto pinged_recently = [&control](absl::Duration within) {
    const absl::Time last = control.last_ping();
    return last != absl::InfinitePast() && absl::Now() - last < within;
  };
  while (!WaitForSignal(absl::Milliseconds(200))) {
    if (control.restart_requested()) {
      const std::string bound = (*server)->address();
      (*server)->Shutdown();  // lets the Restart reply go out first
      ReExec(argc, argv, bound);
    }
    const absl::Time last = control.last_ping();
    if ((*process)->wired() && last != absl::InfinitePast() &&
        absl::Now() - last > absl::Seconds(orphan_s)) {
      std::fprintf(stderr,
                   "prefill_worker: stage 0 stopped pinging; exiting\n");
      code = 3;
      break;
    }
  }
  if (code == 0) {
    // Drain: a group's stages are stopped together (a LeaderWorkerSet, a
    // rolling update); stage 0 finishes the prompts in the pipeline, which
    // need every later stage, then stops pinging. Keep serving until then.
    std::fprintf(stderr, "prefill_worker: draining until stage 0 stops\n");
    const absl::Time drain_deadline = absl::Now() + absl::Seconds(drain_s);
    while (pinged_recently(absl::Seconds(1)) && absl::Now() < drain_deadline) {
      if (WaitForSignal(absl::Milliseconds(50))) break;
    }
  }
  ArmExitWatchdog();
  (*server)->Shutdown();
  stop_metrics();
  (*process)->Shutdown();
  process->reset();
  return code;
}

}  // namespace
}  // namespace pdserve::prefill

int main(int argc, char** argv) { return pdserve::prefill::Main(argc, argv); }
