// pdserve command line: `pdserve COMMAND [flags]`.
//
//   pdserve generate --model PATH --prompt TEXT [flags]
//   pdserve local [flags]
//   pdserve client --router HOST:PORT --prompt TEXT [flags]
//
// `generate` runs the single-process reference engine and streams the text of
// the continuation to stdout as it is produced. `local` starts a whole
// cluster (router, prefill group, decode worker) on this machine; `client`
// sends one request to a router's gRPC API (tools/local_command.cc,
// tools/client_command.cc). `pdserve`, `pdserve help`, `-h` or `--help` list
// the commands; `pdserve COMMAND --help` (or `pdserve help COMMAND`) lists a
// command's flags with their defaults and meanings.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/command_line_flags.h"
#include "common/status_macros.h"
#include "engine/backend_flags.h"
#include "engine/llama_engine.h"
#include "engine/sampler.h"
#include "kv/kv_pool.h"
#include "model/weight_source.h"
#include "process/child_process.h"
#include "tokenizer/detokenizer.h"
#include "tokenizer/tokenizer.h"

namespace pdserve {
namespace {

// One line per command; printed by `pdserve`, `pdserve help`, -h, --help.
constexpr char kCommands[] =
    "usage: pdserve COMMAND [flags]\n"
    "\n"
    "commands:\n"
    "  generate   run a model in this process and stream the continuation "
    "of --prompt\n"
    "  local      start a whole cluster (router, prefill groups, decode "
    "workers) here\n"
    "  client     send one request to a router's gRPC API and stream the "
    "answer\n"
    "  plan       rank cluster layouts for a workload and an SLO on these "
    "cores\n"
    "  help       this list; `pdserve help COMMAND` = `pdserve COMMAND "
    "--help`\n"
    "\n"
    "`pdserve COMMAND --help` lists the command's flags, their defaults and "
    "meanings.\n"
    "The servers are separate binaries with their own --help: router,\n"
    "prefill_worker, decode_worker (and layout_report).\n";

constexpr char kGenerateSynopsis[] =
    "pdserve generate --model PATH --prompt TEXT [flags]\n"
    "Runs the single-process reference engine and streams the continuation's "
    "text to stdout; a summary (tokens, time to first token, tokens/s) goes "
    "to stderr.\n";

absl::Status Generate(int argc, char** argv) {
  CommandLineFlags flags;
  PDS_RETURN_IF_ERROR(flags.Parse(argc, argv, /*first=*/2));
  flags.Group("Model");
  const std::string model_path = flags.Str(
      "model", "", "Model folder (safetensors) or .gguf file (required).");
  const std::string format_name =
      flags.Str("format", "auto", "Model format: auto|gguf|safetensors.");
  const std::string backend_name =
      flags.Str("backend", "cpu", "Compute backend: cpu|cuda.");
  const int cuda_device =
      flags.Num<int>("cuda-device", 0, "GPU to run on with --backend cuda.");
  const int threads =
      flags.Num<int>("threads", 0, "Compute threads; 0: the engine's default.");
  flags.Group("KV cache");
  const std::string kv_dtype_name = flags.Str(
      "kv-dtype", "auto",
      "KV element type: auto|f32|bf16 (auto: f32 on CPUs, bf16 on GPUs).");
  const std::string quantized_matmul_name = flags.Str(
      "quantized-matmul", "int8",
      "How quantized GGUF weights (Q8_0, Q4_K, Q6_K) multiply: int8 "
      "(activations rounded to int8 per block, like llama.cpp; several times "
      "faster) | exact (f32 products of the dequantized weights).");
  flags.Group("Request");
  const std::string prompt =
      flags.Str("prompt", "", "Prompt text to continue (required).");
  int max_tokens = flags.Num<int>(
      "max-tokens", 64,
      "Most tokens to generate (fewer if the context ends first).");
  const std::string output = flags.Str(
      "output", "text",
      "What stdout gets: text (the prompt and its continuation, streamed), "
      "ids (the generated token ids, one line), json (one object: prompt_ids, "
      "ids, text, finish_reason, timings) for scripts.");
  flags.Group("Sampling");
  engine::SamplingParams sampling;
  sampling.temperature =
      flags.Num<float>("temperature", 0.0f, "Sampling temperature; 0: greedy.");
  sampling.top_p =
      flags.Num<float>("top-p", 1.0f, "Nucleus sampling mass (0, 1].");
  sampling.top_k = flags.Num<int>(
      "top-k", 0, "Sample among the k most likely tokens; 0: all.");
  sampling.seed = static_cast<uint64_t>(
      flags.Num<int64_t>("seed", 0, "Sampling seed (same seed, same text)."));
  if (flags.help_requested()) {
    std::fputs(flags.Usage(kGenerateSynopsis).c_str(), stdout);
    return absl::OkStatus();
  }
  PDS_RETURN_IF_ERROR(flags.Check());
  if (model_path.empty()) {
    return absl::InvalidArgumentError("--model is required");
  }
  if (prompt.empty()) return absl::InvalidArgumentError("--prompt is required");
  PDS_ASSIGN_OR_RETURN(const model::LoadFormat format,
                       model::ParseLoadFormat(format_name));
  PDS_ASSIGN_OR_RETURN(const engine::Backend backend,
                       engine::ParseBackend(backend_name));
  PDS_ASSIGN_OR_RETURN(const std::optional<kv::KvDType> kv_dtype,
                       engine::ParseKvDTypeFlag(kv_dtype_name));
  PDS_ASSIGN_OR_RETURN(const engine::QuantizedMatmul quantized_matmul,
                       engine::ParseQuantizedMatmul(quantized_matmul_name));
  PDS_RETURN_IF_ERROR(sampling.Validate());
  if (output != "text" && output != "ids" && output != "json") {
    return absl::InvalidArgumentError(
        absl::StrCat("--output must be text, ids or json, not '", output, "'"));
  }
  const bool text_output = output == "text";
  if (max_tokens <= 0)
    return absl::InvalidArgumentError("--max-tokens must be positive");

  PDS_ASSIGN_OR_RETURN(auto weights, model::OpenModel(model_path, format));
  PDS_ASSIGN_OR_RETURN(auto tokenizer,
                       tokenizer::LoadTokenizerForModel(*weights));
  PDS_ASSIGN_OR_RETURN(std::vector<int32_t> prompt_ids,
                       tokenizer->Encode(prompt));
  const model::ModelConfig& config = weights->config();
  const int64_t context = config.max_position_embeddings;
  if (static_cast<int64_t>(prompt_ids.size()) >= context) {
    return absl::OutOfRangeError(
        absl::StrCat("prompt is ", prompt_ids.size(),
                     " tokens; the model's context is ", context, " tokens"));
  }
  max_tokens = static_cast<int>(std::min<int64_t>(
      max_tokens, context - static_cast<int64_t>(prompt_ids.size())));

  engine::EngineOptions options;
  options.num_threads = threads;
  options.backend = backend;
  options.kv_dtype = kv_dtype;
  options.quantized_matmul = quantized_matmul;
  options.cuda.device = cuda_device;
  options.cuda.max_sequences = 1;
  options.cuda.max_graph_batch = 1;
  options.cuda.max_tokens_per_step = std::max(
      options.cuda.max_tokens_per_step, static_cast<int>(prompt_ids.size()));
  PDS_ASSIGN_OR_RETURN(auto llama,
                       engine::LlamaEngine::Create(*weights, options));
  constexpr int kBlockSize = 16;
  const int64_t total = static_cast<int64_t>(prompt_ids.size()) + max_tokens;
  const int64_t blocks = (total + kBlockSize - 1) / kBlockSize;
  PDS_ASSIGN_OR_RETURN(auto pool, llama->CreateKvPool(kBlockSize, blocks));
  std::vector<int32_t> block_table(blocks);
  for (int64_t b = 0; b < blocks; ++b) block_table[b] = static_cast<int32_t>(b);

  tokenizer::IncrementalDetokenizer detokenizer(*tokenizer,
                                                /*at_text_start=*/false);
  if (text_output) std::cout << prompt << std::flush;
  std::vector<int32_t> generated_ids;
  std::string generated_text;
  const char* finish_reason = "length";
  auto start = std::chrono::steady_clock::now();
  double first_token_seconds = 0;
  std::vector<int32_t> step_tokens = prompt_ids;
  int position = 0;
  int generated = 0;
  while (generated < max_tokens) {
    engine::ForwardBatch batch;
    engine::SequenceStep step;
    step.tokens = step_tokens;
    step.num_tokens = static_cast<int>(step_tokens.size());
    step.start_position = position;
    step.block_table = block_table;
    step.logit_indices = {step.num_tokens - 1};
    batch.sequences.push_back(step);
    engine::ForwardResult result;
    PDS_RETURN_IF_ERROR(llama->Forward(batch, *pool, &result));
    position += step.num_tokens;
    const int32_t next = engine::DrawToken(result.logits, sampling, generated);
    if (generated == 0) {
      first_token_seconds = std::chrono::duration<double>(
                                std::chrono::steady_clock::now() - start)
                                .count();
    }
    ++generated;
    // Any of the model's end tokens (Llama 3 lists several).
    if (tokenizer->IsEos(next) || config.IsEos(next)) {
      finish_reason = "stop";
      break;
    }
    generated_ids.push_back(next);
    PDS_ASSIGN_OR_RETURN(std::string delta, detokenizer.Push(next));
    generated_text += delta;
    if (text_output) std::cout << delta << std::flush;
    step_tokens = {next};
  }
  const std::string tail = detokenizer.Finish();
  generated_text += tail;
  double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  if (output == "ids") {
    std::cout << absl::StrJoin(generated_ids, " ") << std::endl;
  } else if (output == "json") {
    nlohmann::json out = {{"prompt_ids", prompt_ids},
                          {"ids", generated_ids},
                          {"text", generated_text},
                          {"finish_reason", finish_reason},
                          {"first_token_ms", first_token_seconds * 1e3},
                          {"tokens_per_second", generated / seconds}};
    // Invalid UTF-8 cannot occur (the detokenizer replaces it), but a dump
    // must never throw in a tool people pipe into scripts.
    std::cout << out.dump(-1, ' ', false,
                          nlohmann::json::error_handler_t::replace)
              << std::endl;
    return absl::OkStatus();
  } else {
    std::cout << tail << std::endl;
  }
  std::fprintf(
      stderr,
      "[%d prompt tokens, %d generated, first token %.1f ms, %.1f tokens/s]\n",
      static_cast<int>(prompt_ids.size()), generated, first_token_seconds * 1e3,
      generated / seconds);
  return absl::OkStatus();
}

}  // namespace
}  // namespace pdserve

int main(int argc, char** argv) {
  // No command: the list, on stderr, exit 2 (a usage error). Asked for
  // help: the list on stdout, exit 0.
  if (argc < 2) {
    std::fputs(pdserve::kCommands, stderr);
    return 2;
  }
  std::vector<char*> args(argv, argv + argc);
  std::string first = argv[1];
  if (first == "help" || first == "-h" || first == "--help") {
    if (argc < 3) {
      std::fputs(pdserve::kCommands, stdout);
      return 0;
    }
    // `pdserve help COMMAND` is `pdserve COMMAND --help`.
    static char help_flag[] = "--help";
    args = {argv[0], argv[2], help_flag};
    argc = static_cast<int>(args.size());
    argv = args.data();
  }
  const std::string command = argv[1];
  absl::Status status;
  if (command == "generate") {
    status = pdserve::Generate(argc, argv);
  } else if (command == "local" || command == "client" || command == "plan") {
    // These live in pdserve-cluster (next to this binary): they need gRPC and
    // its libprotobuf, which this process must not load — the tokenizer's
    // SentencePiece carries an older embedded protobuf (see
    // services/tokenizer/README.md).
    const std::string cluster_tool =
        std::filesystem::path(pdserve::process::ExecutableDir()) /
        "pdserve-cluster";
    std::vector<char*> exec_args(argv, argv + argc);
    exec_args[0] = const_cast<char*>(cluster_tool.c_str());
    exec_args.push_back(nullptr);
    execv(cluster_tool.c_str(), exec_args.data());
    std::fprintf(stderr, "pdserve: cannot run %s: %s\n", cluster_tool.c_str(),
                 std::strerror(errno));
    return 1;
  } else {
    std::fprintf(stderr, "pdserve: unknown command '%s'\n%s", command.c_str(),
                 pdserve::kCommands);
    return 2;
  }
  if (!status.ok()) {
    std::fprintf(stderr, "pdserve %s: %s\n", command.c_str(),
                 status.ToString().c_str());
    return 1;
  }
  return 0;
}
