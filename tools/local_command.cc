// pdserve local [--model PATH] [--format F] [--model-name NAME]
//               [--prefill-groups 1] [--stages 2] [--layer-split auto]
//               [--chunk-tokens 256] [--decode-workers 1] [--tp 2]
//               [--speculation ngram|off|draft] [--draft-layers L]
//               [--grpc-port 50051] [--http-port 8000] [--host 127.0.0.1]
//               [--prefill-policy least-loaded] [--decode-policy prefix-aware]
//               [--work-dir DIR] [--bin-dir DIR] [--colocated 0|1]
//               [--metrics-port-base 9100 (-1 = off, 0 = any free ports)]
//               [--backend cpu|cuda] [--cuda-devices 0[,1,...]]
//               [--kv-dtype auto|f32|bf16] (every worker's KV element type)
//               [--api-key-file PATH] (the router then wants one of its keys)
//               [--internal-token-file PATH] (default: a fresh random token
//               in the work folder, mode 0600)
//               [--supervise 1] (restart a process that dies: backoff from
//               0.5 s doubling to 30 s, on its old port; logged)
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

absl::Status RunLocalCluster(int argc, char** argv) {
  CommandLineFlags flags;
  PDS_RETURN_IF_ERROR(flags.Parse(argc, argv, /*first=*/2));
  LocalClusterOptions o;
  o.model_path = flags.Str("model", "../shared/models/stories260K");
  o.format = flags.Str("format", "auto");
  o.model_name = flags.Str("model-name", "");
  o.prefill_groups = flags.Num<int>("prefill-groups", 1);
  o.colocated = flags.Num<int>("colocated", 0) != 0;
  o.stages = flags.Num<int>("stages", 2);
  o.layer_split = flags.Str("layer-split", "auto");
  o.chunk_tokens = flags.Num<int>("chunk-tokens", 256);
  o.decode_workers = flags.Num<int>("decode-workers", 1);
  o.tp = flags.Num<int>("tp", 2);
  o.speculation = flags.Str("speculation", "ngram");
  o.draft_layers = flags.Num<int>("draft-layers", 0);
  o.grpc_port = flags.Num<int>("grpc-port", 50051);
  o.http_port = flags.Num<int>("http-port", 8000);
  o.host = flags.Str("host", "127.0.0.1");
  o.prefill_policy = flags.Str("prefill-policy", o.prefill_policy);
  o.decode_policy = flags.Str("decode-policy", o.decode_policy);
  o.work_dir = flags.Str("work-dir", "");
  // The ports deploy/prometheus/prometheus-local.yml scrapes; -1 = off.
  o.metrics_port_base = flags.Num<int>("metrics-port-base", 9100);
  o.bin_dir = flags.Str("bin-dir", process::ExecutableDir());
  o.backend = flags.Str("backend", o.backend);
  o.cuda_devices = flags.Str("cuda-devices", o.cuda_devices);
  o.kv_dtype = flags.Str("kv-dtype", o.kv_dtype);
  o.api_key_file = flags.Str("api-key-file", "");
  o.internal_token_file = flags.Str("internal-token-file", "");
  const bool supervise = flags.Num<int>("supervise", 1) != 0;
  // Refuse bad spellings here, before any process starts.
  PDS_RETURN_IF_ERROR(engine::ParseBackend(o.backend).status());
  PDS_RETURN_IF_ERROR(engine::ParseDeviceList(o.cuda_devices).status());
  PDS_RETURN_IF_ERROR(engine::ParseKvDTypeFlag(o.kv_dtype).status());
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
  PDS_ASSIGN_OR_RETURN(std::unique_ptr<LocalCluster> cluster,
                       LocalCluster::Start(o));
  std::printf("%s", cluster->Describe().c_str());
  // The examples carry the key when the router wants one.
  std::string key_flag, key_header;
  if (!o.api_key_file.empty()) {
    key_flag = absl::StrCat(" --api-key-file ", o.api_key_file);
    key_header = absl::StrCat("-H \"Authorization: Bearer $(grep -v '^#' ",
                              o.api_key_file, " | head -1)\" ");
  }
  std::printf(
      "\ntry:\n  %s/pdserve client --router %s --prompt \"Once upon a time\" "
      "--max-tokens 32%s\n"
      "  curl -s http://%s/v1/completions -H 'Content-Type: application/json' "
      "%s-d '{\"prompt\": \"Once upon a time\", \"max_tokens\": 32}'\n"
      "\nCtrl-C stops the cluster.\n",
      process::ExecutableDir().c_str(), cluster->grpc_address().c_str(),
      key_flag.c_str(), cluster->http_address().c_str(), key_header.c_str());
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
