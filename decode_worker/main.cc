// decode_worker: serves pdserve.v1.DecodeWorker (proto/pdserve/v1/decode.proto)
// plus grpc.health.v1 and reflection, with every TP rank's KV pool registered
// with the UCX transport. See decode_worker/README.md.
//
//   decode_worker --model PATH [flags]   (`decode_worker --help` lists
//                 every flag, its default and meaning)
//
// Listens on loopback unless --host says otherwise (0.0.0.0: every
// interface). --ucx-net-devices auto keeps UCX's network transports on
// --host's interface too (all: every interface; or UCX's own device list,
// e.g. mlx5_0:1 for RDMA). --internal-token-file: the cluster's shared token
// (see services/rpc/auth.h); every DecodeWorker RPC must carry it, so no
// unauthenticated peer can Admit, Abort or be granted KV blocks.
// Every rank's KV pool is allocated and registered by its UCX worker, so a
// prefill's puts land by shared memory on this host (or RDMA across hosts).
// With --backend cuda (a -DPDSERVE_CUDA=ON build) rank r runs on GPU
// cuda-devices[r % count] with its KV pool in GPU memory; prefills' puts land
// in a host mirror that the worker copies to the GPU when a request's KV is
// complete (Debian's UCX has no CUDA transports to write GPU memory directly).
// --kv-dtype bf16 halves a CPU worker's KV memory and the bytes prefills
// write into it (auto: f32 on CPUs, bf16 on GPUs); the prefill workers must
// send the same type (the transport spec check refuses a mismatch).
// --ucx-peer-errors 0 lets UCX use shared memory/CMA endpoints (same host;
// both sides must agree: pass it to the prefill workers too); 1 (default)
// keeps endpoints that report a dead peer at once (tcp here, verbs).
//
// Prints "metrics on HOST:PORT" (with --metrics-port) and then "listening on
// HOST:PORT" once serving; SIGINT/SIGTERM stop it.
#include <csignal>
#include <cstdio>
#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/command_line_flags.h"
#include "decode/decode_worker.h"
#include "decode_worker/decode_service.h"
#include "decode_worker/worker_metrics.h"
#include "engine/backend_flags.h"
#include "metrics/metrics.h"
#include "model/weight_source.h"
#include "planner/step_trace.h"
#include "process/port_file.h"
#include "rpc/auth.h"
#include "rpc/server.h"
#include "speculative/truncated_weights.h"
#include "tokenizer/tokenizer.h"
#include "transport/kv_transfer.h"
#include "transport/net_device.h"
#include "transport/ucx_worker.h"

namespace pdserve::decode_worker {
namespace {

constexpr char kSynopsis[] =
    "decode_worker --model PATH [flags]\n"
    "Serves pdserve.v1.DecodeWorker: admits requests, receives their prompt "
    "KV from prefill groups over UCX and decodes them in continuous "
    "batches.\n";

constexpr char kNotes[] =
    "Prints \"metrics on HOST:PORT\" (with --metrics-port) and then "
    "\"listening on HOST:PORT\" once serving; SIGINT/SIGTERM stop. See "
    "decode_worker/README.md.\n";

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "decode_worker: %s\n", s.ToString().c_str());
  return 1;
}

int Main(int argc, char** argv) {
  CommandLineFlags flags;
  if (auto s = flags.Parse(argc, argv); !s.ok()) return Fail(s);
  decode::DecodeWorkerOptions wo;
  DecodeServiceOptions so;
  flags.Group("Model");
  const std::string model_path =
      flags.Str("model", "", "Model folder or file to serve (required).");
  const std::string format_name =
      flags.Str("format", "auto", "Model format: auto|gguf|safetensors|dummy.");
  so.model_name = flags.Str(
      "model-name", "",
      "Name this worker reports in its identity; must match the router's "
      "--model-name.",
      "the --model file or folder name");
  if (so.model_name.empty())
    so.model_name = model::DefaultModelName(model_path);
  wo.tp_size = flags.Num<int>(
      "tp", 1, "Tensor-parallel ranks (threads, or GPUs with --backend cuda).");
  wo.threads_per_rank =
      flags.Num<int>("threads-per-rank", 1, "Compute threads per TP rank.");
  const std::string backend_name =
      flags.Str("backend", "cpu",
                "Compute backend: cpu|cuda (cuda needs a "
                "-DPDSERVE_CUDA=ON build).");
  const std::string devices_text =
      flags.Str("cuda-devices", "0",
                "GPUs as a list (0,1,...): rank r runs on devices[r % count].");
  const std::string attention_name = flags.Str(
      "cuda-attention", "auto",
      "CUDA attention kernels: auto|legacy|tensor-core (legacy: to bisect a "
      "wrong GPU result).");
  wo.cuda.use_graphs = flags.Bool(
      "cuda-graphs", true,
      "Replay decode/verify steps from CUDA Graphs (0: eager launches).");
  wo.cuda.max_graph_batch = flags.Num<int>(
      "cuda-max-graph-batch", wo.cuda.max_graph_batch,
      "Largest batch (sequences) a CUDA Graph is captured for; bigger steps "
      "run eager.");
  flags.Group("KV cache");
  wo.block_size = flags.Num<int>(
      "block-size", 16, "KV block size in tokens (the router's must match).");
  const bool has_num_blocks = flags.Has("num-blocks");
  const int64_t num_blocks = flags.Num<int64_t>(
      "num-blocks", 512, "KV blocks in the pool (or give --kv-memory-mb).");
  const int64_t kv_memory_mb = flags.Num<int64_t>(
      "kv-memory-mb", 0,
      "Size the KV pool by memory instead: MiB for all layers and ranks "
      "together (0: use --num-blocks).");
  const std::string kv_dtype_name = flags.Str(
      "kv-dtype", "auto",
      "KV element type: auto|f32|bf16 (auto: f32 on CPUs, bf16 on GPUs); "
      "prefill workers must send the same.");
  const std::string moe_parallel_name = flags.Str(
      "moe-parallel", "tp",
      "How the --tp ranks share a mixture of experts' routed experts: tp "
      "(every expert's rows split over the ranks; one all-reduce as for a "
      "dense MLP) | ep (whole experts per rank, E/T each; the router runs on "
      "every rank and the same all-reduce combines). Attention and dense "
      "layers stay tensor parallel.");
  const std::string quantized_matmul_name = flags.Str(
      "quantized-matmul", "int8",
      "How quantized GGUF weights (Q8_0, Q4_K, Q6_K) multiply: int8 "
      "(activations rounded to int8 per block, like llama.cpp; several times "
      "faster) | exact (f32 products of the dequantized weights).");
  const double lease_s = flags.Num<double>(
      "kv-lease-seconds", 30.0,
      "Seconds an admitted request's KV may wait for its prefill's writes "
      "(restarted by each write) before its blocks are freed.");
  flags.Group("Scheduling");
  wo.max_running = flags.Num<int>(
      "max-running", wo.max_running,
      "Most requests decoding at once; more wait in FIFO order.");
  wo.max_step_tokens = flags.Num<int>(
      "max-step-tokens", wo.max_step_tokens,
      "Tokens one step may feed (decode tokens + drafts + prefill chunks).");
  flags.Group("Speculation");
  const std::string speculation = flags.Str(
      "speculation", "off",
      "Speculative decoding: off|ngram|draft (draft: the target's first "
      "--draft-layers layers).");
  const int draft_layers = flags.Num<int>(
      "draft-layers", 0,
      "Layers of the draft model with --speculation draft (required there).");
  wo.speculation.max_gamma = flags.Num<int>(
      "max-gamma", 4, "Most drafted tokens verified per request and step.");
  wo.speculation.max_batch = flags.Num<int>(
      "spec-max-batch", wo.speculation.max_batch,
      "Speculation is off for a step with more decoding requests than this.");
  flags.Group("Network");
  const std::string host =
      flags.Str("host", "127.0.0.1",
                "Interface to listen on (0.0.0.0: every interface).");
  const int port = flags.Num<int>("port", 0, "gRPC port; 0: any free port.");
  const std::string port_file = flags.Str(
      "port-file", "", "Write the bound HOST:PORT here once serving.");
  so.ucx.peer_error_handling = flags.Bool(
      "ucx-peer-errors", true,
      "Keep UCX endpoints that report a dead peer at once (tcp, verbs); 0 "
      "allows shared-memory/CMA endpoints (same host; prefill workers must "
      "agree).");
  const std::string ucx_net_devices = flags.Str(
      "ucx-net-devices", "auto",
      "UCX network devices: auto (--host's interface), all, or a UCX device "
      "list such as mlx5_0:1.");
  const double drain_s = flags.Num<double>(
      "drain-timeout-seconds", 25.0,
      "On SIGTERM: stop admitting (readiness NOT_SERVING, Admit "
      "UNAVAILABLE) and let streams finish for up to this long before "
      "stopping; what is left migrates to other workers through the router. "
      "Keep it below the pod's terminationGracePeriodSeconds. 0: stop at "
      "once.");
  flags.Group("Security");
  const std::string internal_token_file = flags.Str(
      "internal-token-file", "",
      "The cluster's shared token file: every DecodeWorker RPC must carry "
      "it.");
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
  const std::string step_trace_path = flags.Str(
      "step-trace", "",
      "Append one CSV line per forward step to this file (end time, seconds, "
      "sequences, tokens fed, logit rows, attended positions, output "
      "tokens): a loaded worker's steps, to set beside the layout planner's "
      "step costs.",
      "(none)");
  if (flags.help_requested()) {
    std::fputs(flags.Usage(kSynopsis, kNotes).c_str(), stdout);
    return 0;
  }
  if (auto s = flags.Check(); !s.ok()) return Fail(s);
  auto backend = engine::ParseBackend(backend_name);
  if (!backend.ok()) return Fail(backend.status());
  wo.backend = *backend;
  auto devices = engine::ParseDeviceList(devices_text);
  if (!devices.ok()) return Fail(devices.status());
  wo.cuda_devices = *devices;
  auto kv_dtype = engine::ParseKvDTypeFlag(kv_dtype_name);
  if (!kv_dtype.ok()) return Fail(kv_dtype.status());
  wo.kv_dtype = *kv_dtype;
  auto quantized_matmul = engine::ParseQuantizedMatmul(quantized_matmul_name);
  if (!quantized_matmul.ok()) return Fail(quantized_matmul.status());
  wo.quantized_matmul = *quantized_matmul;
  auto moe_parallel = engine::ParseExpertParallelism(moe_parallel_name);
  if (!moe_parallel.ok()) return Fail(moe_parallel.status());
  wo.expert_parallelism = *moe_parallel;
  auto attention = engine::ParseAttentionKernels(attention_name);
  if (!attention.ok()) return Fail(attention.status());
  wo.cuda.attention = *attention;
  if (!internal_token_file.empty()) {
    auto tokens = rpc::BearerTokens::FromFile(internal_token_file);
    if (!tokens.ok()) return Fail(tokens.status());
    so.internal_tokens = *std::move(tokens);
  }
  if (auto ucx_config = transport::UcxNetworkConfig(ucx_net_devices, host);
      ucx_config.ok()) {
    so.ucx.ucx_config = *std::move(ucx_config);
  } else {
    return Fail(ucx_config.status());
  }
  if (model_path.empty())
    return Fail(absl::InvalidArgumentError("--model is required"));
  if (has_num_blocks && kv_memory_mb > 0)
    return Fail(absl::InvalidArgumentError(
        "give --num-blocks or --kv-memory-mb, not both"));
  if (lease_s <= 0)
    return Fail(absl::InvalidArgumentError("--kv-lease-seconds must be > 0"));
  if (drain_s < 0)
    return Fail(
        absl::InvalidArgumentError("--drain-timeout-seconds must be >= 0"));

  auto format = model::ParseLoadFormat(format_name);
  if (!format.ok()) return Fail(format.status());
  auto weights = model::OpenModel(model_path, *format);
  if (!weights.ok()) return Fail(weights.status());
  const model::ModelConfig& config = (*weights)->config();
  if (kv_memory_mb > 0) {
    // Every rank together holds all layers x KV heads of a block.
    const int64_t element_bytes = static_cast<int64_t>(
        kv::KvDTypeSize(engine::ResolvedKvDType(wo.backend, wo.kv_dtype)));
    const int64_t block_bytes = int64_t{config.num_layers} * 2 * wo.block_size *
                                config.kv_dim() * element_bytes;
    wo.num_blocks = kv_memory_mb * (int64_t{1} << 20) / block_bytes;
  } else {
    wo.num_blocks = num_blocks;
  }
  // The sink's lease restarts with every write; the worker's own lease is a
  // backstop that must not fire first (it frees blocks a prefill may still be
  // writing), so it also covers the sinks' revoke quarantine.
  so.kv_lease = absl::Seconds(lease_s);
  wo.kv_lease = so.kv_lease * 2 + absl::Seconds(10);

  // Text deltas and stop strings need the model's tokenizer; a dummy-weight
  // model has none and streams token ids only. (libsentencepiece lives in the
  // tokenizer's dlopen'ed shim, so it no longer clashes with gRPC's protobuf.)
  std::unique_ptr<tokenizer::Tokenizer> loaded_tokenizer;
  if (auto spec = (*weights)->tokenizer_spec(); spec.ok()) {
    auto loaded = tokenizer::LoadTokenizerForModel(**weights);
    if (!loaded.ok()) return Fail(loaded.status());
    loaded_tokenizer = std::move(*loaded);
  }
  const tokenizer::Tokenizer* tok = loaded_tokenizer.get();
  std::unique_ptr<model::WeightSource> draft;
  if (speculation == "off") {
    wo.speculation.mode = decode::SpeculationMode::kOff;
  } else if (speculation == "ngram") {
    wo.speculation.mode = decode::SpeculationMode::kNgram;
  } else if (speculation == "draft") {
    if (draft_layers <= 0)
      return Fail(absl::InvalidArgumentError(
          "--speculation draft needs --draft-layers L (the target's first L "
          "layers are the draft)"));
    auto d = speculative::MakeLayerTruncatedWeights(**weights, draft_layers);
    if (!d.ok()) return Fail(d.status());
    draft = std::move(*d);
    wo.speculation.mode = decode::SpeculationMode::kDraft;
    wo.speculation.draft_weights = draft.get();
  } else {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        "--speculation must be off, ngram or draft, got '", speculation, "'")));
  }

  // Signals are taken by sigwait below, not by async handlers: block them
  // before any thread starts so every thread inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  // The ranks' UCX workers come first: each allocates and registers its
  // rank's KV pool, and they outlive the pools and the sinks.
  std::vector<std::unique_ptr<transport::UcxWorker>> rank_workers;
  for (int r = 0; r < wo.tp_size; ++r) {
    auto ucx = transport::UcxWorker::Create(so.ucx);
    if (!ucx.ok()) return Fail(ucx.status());
    so.rank_workers.push_back(ucx->get());
    rank_workers.push_back(std::move(*ucx));
  }
  wo.kv_pool_factory = [&rank_workers](int rank,
                                       const kv::KvCacheLayout& layout,
                                       int64_t blocks) {
    return transport::AllocateKvPool(rank_workers[rank].get(), layout, blocks);
  };
  // Metrics are off unless asked for: no step observer, no HTTP thread.
  std::shared_ptr<metrics::MetricsRegistry> registry;
  std::unique_ptr<DecodeWorkerMetrics> worker_metrics;
  if (metrics_port >= 0) {
    registry = std::make_shared<metrics::MetricsRegistry>(
        metrics::Layout{"decode", worker_id, 0, 1, wo.tp_size});
    worker_metrics = std::make_unique<DecodeWorkerMetrics>(*registry);
    wo.step_observer = worker_metrics->StepObserver();
  }
  std::unique_ptr<planner::StepTraceWriter> step_trace;
  if (!step_trace_path.empty()) {
    auto trace = planner::StepTraceWriter::Open(step_trace_path);
    if (!trace.ok()) return Fail(trace.status());
    step_trace = *std::move(trace);
    wo.step_observer = [metrics_observer = std::move(wo.step_observer),
                        trace = step_trace.get()](const decode::StepStats& s) {
      if (metrics_observer) metrics_observer(s);
      trace->Record({s.seconds, s.sequences, s.tokens_fed, s.logit_rows,
                     s.attended_positions, s.output_tokens});
    };
  }
  auto worker = decode::DecodeWorker::Create(**weights, tok, wo);
  if (!worker.ok()) return Fail(worker.status());
  std::fprintf(stderr, "decode_worker: backend %s, tp %d (all-reduce: %s)\n",
               engine::BackendName(wo.backend), (*worker)->tp_size(),
               (*worker)->tp_communicator().c_str());
  auto service = DecodeService::Create(worker->get(), config, so);
  if (!service.ok()) return Fail(service.status());
  std::unique_ptr<metrics::MetricsServer> metrics_server;
  if (worker_metrics != nullptr) {
    worker_metrics->Bind(worker->get(), service->get());
    auto started = metrics::MetricsServer::Start(metrics_host, metrics_port,
                                                 registry, metrics_port_file);
    if (!started.ok()) return Fail(started.status());
    metrics_server = std::move(*started);
    std::printf("metrics on %s\n", metrics_server->address().c_str());
  }
  auto server = rpc::RunningServer::Start(absl::StrCat(host, ":", port),
                                          {service->get()});
  if (!server.ok()) return Fail(server.status());
  (*server)->ReportHealthFor({v1::DecodeWorker::service_full_name()});
  (*server)->SetServing(true);
  std::printf("listening on %s\n", (*server)->address().c_str());
  std::fflush(stdout);
  // Written last: a launcher polling for it then finds a serving worker.
  if (auto s = process::WritePortFile(port_file, (*server)->address());
      !s.ok()) {
    return Fail(s);
  }

  int sig = 0;
  sigwait(&signals, &sig);
  // Drain: out of rotation at once (the router's probes and Kubernetes'
  // readiness see NOT_SERVING, new Admits are refused with UNAVAILABLE and
  // go elsewhere), the streams on this worker run to their end. A second
  // signal, or the timeout, cuts it short: the streams left are cut by the
  // server's stop and the router continues them on other workers.
  (*server)->SetServing(false);
  (*service)->StartDrain();
  std::fprintf(stderr,
               "decode_worker: signal %d, draining %lld streams (up to %.1f "
               "s)\n",
               sig, static_cast<long long>((*service)->live_streams()),
               drain_s);
  const absl::Time drain_deadline = absl::Now() + absl::Seconds(drain_s);
  while ((*service)->live_streams() > 0 && absl::Now() < drain_deadline) {
    const timespec poll{0, 20 * 1000 * 1000};
    if (sigtimedwait(&signals, nullptr, &poll) > 0) break;
  }
  std::fprintf(stderr, "decode_worker: stopping with %lld streams left\n",
               static_cast<long long>((*service)->live_streams()));
  // The drain had its time: the streams left end now with UNAVAILABLE, and
  // the router continues each on another worker from the tokens it has.
  if ((*service)->live_streams() > 0) {
    (*service)->CutStreams(absl::UnavailableError(
        "decode worker stopped before the stream ended (drain timeout): "
        "continue elsewhere"));
  }
  (*server)->Shutdown(2.0);
  server->reset();
  metrics_server.reset();
  if (worker_metrics != nullptr) worker_metrics->Unbind();
  service->reset();
  worker->reset();
  return 0;
}

}  // namespace
}  // namespace pdserve::decode_worker

int main(int argc, char** argv) {
  return pdserve::decode_worker::Main(argc, argv);
}
