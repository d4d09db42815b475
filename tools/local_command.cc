// pdserve local [flags]   (`pdserve local --help` lists every flag, its
//                         default and meaning)
//
// Starts the router, the prefill groups and the decode workers as separate
// processes, waits until the router serves, prints the endpoints and example
// requests, and runs until Ctrl-C (then stops everything).
#include <signal.h>

#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/command_line_flags.h"
#include "common/status_macros.h"
#include "engine/backend_flags.h"
#include "process/child_process.h"
#include "tools/commands.h"
#include "tools/local_cluster.h"

namespace pdserve::tools {

namespace {

constexpr char kLocalSynopsis[] =
    "pdserve local [flags]\n"
    "Starts a whole cluster on this machine (router, prefill groups, decode "
    "workers, each a process), prints its endpoints and example requests, "
    "and runs until Ctrl-C.\n";

}  // namespace

absl::Status RunLocalCluster(int argc, char** argv) {
  CommandLineFlags flags;
  PDS_RETURN_IF_ERROR(flags.Parse(argc, argv, /*first=*/2));
  LocalClusterOptions o;
  flags.Group("Model");
  o.model_path = flags.Str("model", "../shared/models/stories260K",
                           "Model folder (safetensors) or .gguf file that "
                           "every process loads.");
  o.format =
      flags.Str("format", "auto", "Model format: auto|gguf|safetensors|dummy.");
  o.model_name =
      flags.Str("model-name", "", "Name the router serves (the `model` field).",
                "(none: the model's file or folder name)");
  o.backend = flags.Str("backend", o.backend,
                        "Compute backend of every worker: cpu|cuda.");
  o.cuda_devices = flags.Str(
      "cuda-devices", o.cuda_devices,
      "GPUs (0,1,...): decode workers get the list, prefill stages one "
      "each in turn.");
  flags.Group("Layout");
  o.prefill_groups = flags.Num<int>("prefill-groups", 1,
                                    "Prefill groups (pipelines) to start.");
  o.stages =
      flags.Num<int>("stages", 2, "Pipeline stages (processes) per group.");
  o.layer_split =
      flags.Str("layer-split", "auto",
                "Layers per stage, e.g. 3,2; auto balances estimated FLOPs.");
  o.chunk_tokens = flags.Num<int>("chunk-tokens", 256,
                                  "Average prompt tokens per prefill chunk.");
  o.prefill_threads = flags.Num<int>("prefill-threads", o.prefill_threads,
                                     "Compute threads of each prefill stage.");
  o.decode_workers =
      flags.Num<int>("decode-workers", 1, "Decode workers to start.");
  o.tp = flags.Num<int>("tp", 2, "Tensor-parallel ranks per decode worker.");
  o.decode_threads =
      flags.Num<int>("decode-threads", o.decode_threads,
                     "Compute threads of each decode worker's TP rank.");
  o.max_step_tokens = flags.Num<int>(
      "max-step-tokens", o.max_step_tokens,
      "Tokens one decode step may feed (decodes, drafts and, colocated, "
      "prefill chunks).");
  o.max_running =
      flags.Num<int>("max-running", o.max_running,
                     "Requests each decode worker batches at once.");
  o.colocated = flags.Bool(
      "colocated", false,
      "1: no prefill groups; the decode workers prefill prompts themselves.");
  flags.Group("KV cache");
  o.kv_dtype =
      flags.Str("kv-dtype", o.kv_dtype,
                "Every worker's KV element type: auto|f32|bf16 (auto: f32 on "
                "CPUs, bf16 on GPUs).");
  o.quantized_matmul = flags.Str(
      "quantized-matmul", o.quantized_matmul,
      "How every worker multiplies quantized GGUF weights: int8 "
      "(activations rounded to int8 per block, like llama.cpp) | exact (f32 "
      "products of the dequantized weights).");
  o.moe_parallel = flags.Str(
      "moe-parallel", o.moe_parallel,
      "How each decode worker's --tp ranks share a mixture of "
      "experts' routed experts: tp (rows of every expert) | ep (whole "
      "experts per rank).");
  flags.Group("Scheduling");
  o.prefill_policy = flags.Str(
      "prefill-policy", o.prefill_policy,
      "Router's prefill group choice: round-robin|least-loaded|prefix-aware.");
  o.decode_policy = flags.Str(
      "decode-policy", o.decode_policy,
      "Router's decode worker choice: round-robin|least-loaded|prefix-aware.");
  flags.Group("Speculation");
  o.speculation = flags.Str("speculation", "ngram",
                            "Decode workers' speculative decoding: "
                            "off|ngram|draft.");
  o.draft_layers = flags.Num<int>(
      "draft-layers", 0,
      "With --speculation draft: the target's first L layers are the draft.");
  flags.Group("Network");
  o.host =
      flags.Str("host", "127.0.0.1", "Interface every process listens on.");
  o.grpc_port = flags.Num<int>("grpc-port", 50051,
                               "Router's gRPC port (0: any free port).");
  o.http_port = flags.Num<int>(
      "http-port", 8000, "Router's HTTP (OpenAI API) port (0: any free port).");
  flags.Group("Security");
  o.api_key_file = flags.Str(
      "api-key-file", "",
      "API keys, one per line: the router then wants one as a bearer token.");
  o.internal_token_file = flags.Str(
      "internal-token-file", "",
      "The cluster's shared internal token file (none: a fresh random token "
      "written to the work folder, mode 0600).",
      "(none: a fresh token)");
  flags.Group("Metrics");
  // The ports deploy/prometheus/prometheus-local.yml scrapes; -1 = off.
  o.metrics_port_base = flags.Num<int>(
      "metrics-port-base", 9100,
      "/metrics ports: router B, prefill stage B+10+g*stages+i, decode "
      "worker B+20+w (as deploy/prometheus/prometheus-local.yml scrapes); "
      "-1: off, 0: any free ports.");
  flags.Group("Processes");
  o.work_dir = flags.Str("work-dir", "", "Folder for logs and port files.",
                         "(none: a fresh temporary folder)");
  o.bin_dir =
      flags.Str("bin-dir", process::ExecutableDir(),
                "Folder holding router, prefill_worker and decode_worker.",
                "(this binary's folder)");
  const bool supervise = flags.Bool(
      "supervise", true,
      "Restart a process that dies, on its old port, after a backoff of 0.5 "
      "s doubling to 30 s (logged).");
  if (flags.help_requested()) {
    std::fputs(flags.Usage(kLocalSynopsis).c_str(), stdout);
    return absl::OkStatus();
  }
  // Refuse bad spellings here, before any process starts.
  PDS_RETURN_IF_ERROR(engine::ParseBackend(o.backend).status());
  PDS_RETURN_IF_ERROR(engine::ParseDeviceList(o.cuda_devices).status());
  PDS_RETURN_IF_ERROR(engine::ParseKvDTypeFlag(o.kv_dtype).status());
  PDS_RETURN_IF_ERROR(
      engine::ParseQuantizedMatmul(o.quantized_matmul).status());
  PDS_RETURN_IF_ERROR(engine::ParseExpertParallelism(o.moe_parallel).status());
  PDS_RETURN_IF_ERROR(flags.Check());

  // Ctrl-C is for us: block it before the children start (they reset their
  // masks) so sigwait below receives it.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  std::fprintf(stderr,
               "pdserve local: starting %d prefill group(s) of %d "
               "stage(s), %d decode worker(s) of TP %d, router...\n",
               o.prefill_groups, o.stages, o.decode_workers, o.tp);
  o.progress = [](const std::string& line) {
    std::fprintf(stderr, "pdserve local: %s\n", line.c_str());
  };
  PDS_ASSIGN_OR_RETURN(std::unique_ptr<LocalCluster> cluster,
                       LocalCluster::Start(o));
  std::printf("\npdserve local: ready\n%s", cluster->Describe().c_str());
  // The examples carry the key when the router wants one.
  std::string key_flag, key_header;
  if (!o.api_key_file.empty()) {
    key_flag = absl::StrCat(" --api-key-file ", o.api_key_file);
    key_header = absl::StrCat("-H \"Authorization: Bearer $(grep -v '^#' ",
                              o.api_key_file, " | head -1)\" ");
  }
  // A dummy model has random weights and no tokenizer: its examples send
  // token ids (text would be refused).
  const bool ids_only = o.format == "dummy";
  std::printf(
      "\ntry:\n  %s/pdserve client --router %s %s --max-tokens 32%s\n"
      "  curl -s http://%s/v1/completions -H 'Content-Type: application/json' "
      "%s-d '{\"prompt\": %s, \"max_tokens\": 32}'\n"
      "\nCtrl-C stops the cluster.\n",
      process::ExecutableDir().c_str(), cluster->grpc_address().c_str(),
      ids_only ? "--ids 1,450,4996" : "--prompt \"Once upon a time\"",
      key_flag.c_str(), cluster->http_address().c_str(), key_header.c_str(),
      ids_only ? "[1, 450, 4996]" : "\"Once upon a time\"");
  std::fflush(stdout);
  // Until Ctrl-C: restart what dies (LocalCluster::Supervise: backoff, same
  // ports, so the router takes it back into rotation by itself).
  const timespec tick = {0, 250 * 1000 * 1000};
  while (sigtimedwait(&signals, nullptr, &tick) < 0) {
    if (supervise) (void)cluster->Supervise();
  }
  int total = 0;
  for (const auto& [name, count] : cluster->restarts()) total += count;
  std::fprintf(stderr, "pdserve local: stopping (%d restart(s))\n", total);
  cluster->Stop();
  return absl::OkStatus();
}

}  // namespace pdserve::tools
