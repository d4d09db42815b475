// decode_worker: serves pdserve.v1.DecodeWorker (proto/pdserve/v1/decode.proto)
// plus grpc.health.v1 and reflection, with every TP rank's KV pool registered
// with the UCX transport. See decode_worker/README.md.
//
//   decode_worker --model PATH [--format auto|gguf|safetensors|dummy]
//                 [--tp T] [--host 127.0.0.1] [--port 0] [--block-size 16]
//                 [--num-blocks N | --kv-memory-mb M] [--max-running 64]
//                 [--max-step-tokens 512] [--threads-per-rank 1]
//                 [--speculation off|ngram|draft] [--draft-layers L]
//                 [--max-gamma 4] [--spec-max-batch B]
//                 [--kv-lease-seconds 30] [--model-name NAME]
//                 [--port-file PATH] [--ucx-peer-errors 1]
//                 [--metrics-port -1 (off; 0 = any free port)]
//                 [--metrics-host HOST (default --host)] [--worker-id ID]
//                 [--metrics-port-file PATH]
//                 [--backend cpu|cuda] [--cuda-devices 0[,1..]]
//                 [--cuda-graphs 1] [--cuda-max-graph-batch 128]
//                 [--cuda-attention auto|legacy|tensor-core] (the legacy
//                 kernel: to bisect a wrong GPU result to the new ones)
//                 [--kv-dtype auto|f32|bf16]
//                 [--internal-token-file PATH] [--ucx-net-devices auto]
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

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/command_line_flags.h"
#include "decode/decode_worker.h"
#include "decode_worker/decode_service.h"
#include "decode_worker/worker_metrics.h"
#include "engine/backend_flags.h"
#include "metrics/metrics.h"
#include "model/weight_source.h"
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

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "decode_worker: %s\n", s.ToString().c_str());
  return 1;
}

int Main(int argc, char** argv) {
  CommandLineFlags flags;
  if (auto s = flags.Parse(argc, argv); !s.ok()) return Fail(s);
  const std::string model_path = flags.Str("model", "");
  const std::string format_name = flags.Str("format", "auto");
  const std::string host = flags.Str("host", "127.0.0.1");
  const int port = flags.Num<int>("port", 0);
  const std::string port_file = flags.Str("port-file", "");
  const std::string speculation = flags.Str("speculation", "off");
  const int draft_layers = flags.Num<int>("draft-layers", 0);
  const bool has_num_blocks = flags.Has("num-blocks");
  const int64_t num_blocks = flags.Num<int64_t>("num-blocks", 512);
  const int64_t kv_memory_mb = flags.Num<int64_t>("kv-memory-mb", 0);
  const double lease_s = flags.Num<double>("kv-lease-seconds", 30.0);
  decode::DecodeWorkerOptions wo;
  auto backend = engine::ParseBackend(flags.Str("backend", "cpu"));
  if (!backend.ok()) return Fail(backend.status());
  wo.backend = *backend;
  auto devices = engine::ParseDeviceList(flags.Str("cuda-devices", "0"));
  if (!devices.ok()) return Fail(devices.status());
  wo.cuda_devices = *devices;
  auto kv_dtype = engine::ParseKvDTypeFlag(flags.Str("kv-dtype", "auto"));
  if (!kv_dtype.ok()) return Fail(kv_dtype.status());
  wo.kv_dtype = *kv_dtype;
  auto attention =
      engine::ParseAttentionKernels(flags.Str("cuda-attention", "auto"));
  if (!attention.ok()) return Fail(attention.status());
  wo.cuda.attention = *attention;
  wo.cuda.use_graphs = flags.Num<int>("cuda-graphs", 1) != 0;
  wo.cuda.max_graph_batch =
      flags.Num<int>("cuda-max-graph-batch", wo.cuda.max_graph_batch);
  wo.tp_size = flags.Num<int>("tp", 1);
  wo.threads_per_rank = flags.Num<int>("threads-per-rank", 1);
  wo.block_size = flags.Num<int>("block-size", 16);
  wo.max_running = flags.Num<int>("max-running", wo.max_running);
  wo.max_step_tokens = flags.Num<int>("max-step-tokens", wo.max_step_tokens);
  wo.speculation.max_gamma = flags.Num<int>("max-gamma", 4);
  wo.speculation.max_batch =
      flags.Num<int>("spec-max-batch", wo.speculation.max_batch);
  DecodeServiceOptions so;
  so.model_name = flags.Str("model-name", "model");
  so.ucx.peer_error_handling = flags.Num<int>("ucx-peer-errors", 1) != 0;
  const int metrics_port = flags.Num<int>("metrics-port", -1);
  const std::string metrics_port_file = flags.Str("metrics-port-file", "");
  const std::string metrics_host = flags.Str("metrics-host", host);
  const std::string worker_id =
      flags.Str("worker-id", metrics::DefaultWorkerId());
  const std::string internal_token_file = flags.Str("internal-token-file", "");
  const std::string ucx_net_devices = flags.Str("ucx-net-devices", "auto");
  if (auto s = flags.Check(); !s.ok()) return Fail(s);
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
  std::fprintf(stderr, "decode_worker: signal %d, stopping\n", sig);
  (*server)->SetServing(false);
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
