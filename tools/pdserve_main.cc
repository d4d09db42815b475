// pdserve command line.
//
//   pdserve generate --model PATH --prompt TEXT [--max-tokens N]
//                    [--temperature T] [--top-p P] [--top-k K] [--seed S]
//                    [--format auto|gguf|safetensors] [--threads N]
//
//   pdserve local  [--model PATH] [--stages S] [--tp T] [--speculation X] ...
//   pdserve client --router HOST:PORT --prompt TEXT [--max-tokens N] ...
//
// `generate` runs the single-process reference engine and streams the text of
// the continuation to stdout as it is produced. `local` starts a whole
// cluster (router, prefill group, decode worker) on this machine; `client`
// sends one request to a router's gRPC API (tools/local_command.cc,
// tools/client_command.cc).
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
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
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

constexpr char kUsage[] =
    "usage: pdserve generate --model PATH --prompt TEXT [--max-tokens N] "
    "[--temperature T]\n"
    "                        [--top-p P] [--top-k K] [--seed S] [--format F] "
    "[--threads N]\n"
    "                        [--backend cpu|cuda] [--cuda-device D] "
    "[--kv-dtype auto|f32|bf16]\n"
    "       pdserve local [--model PATH] [--prefill-groups G] [--stages S] "
    "[--tp T]\n"
    "                     [--decode-workers W] [--speculation off|ngram|draft] "
    "[--draft-layers L]\n"
    "                     [--grpc-port P] [--http-port P] [--work-dir DIR]\n"
    "                     [--backend cpu|cuda] [--cuda-devices 0,1] "
    "[--kv-dtype auto|f32|bf16]\n"
    "       pdserve client --router HOST:PORT (--prompt TEXT | --ids 1,2,3) "
    "[--max-tokens N]\n"
    "                      [--temperature T] [--seed S] [--stop S] "
    "[--show-ids 1]\n"
    "                      [--logprobs N] [--echo 1] (--echo 1 --logprobs 0 "
    "--max-tokens 0: score the prompt)\n";

absl::Status Generate(int argc, char** argv) {
  CommandLineFlags flags;
  PDS_RETURN_IF_ERROR(flags.Parse(argc, argv, /*first=*/2));
  if (!flags.Has("model"))
    return absl::InvalidArgumentError("--model is required");
  if (!flags.Has("prompt")) {
    return absl::InvalidArgumentError("--prompt is required");
  }
  const std::string model_path = flags.Str("model", "");
  const std::string prompt = flags.Str("prompt", "");
  model::LoadFormat format = model::LoadFormat::kAuto;
  if (flags.Has("format")) {
    PDS_ASSIGN_OR_RETURN(format,
                         model::ParseLoadFormat(flags.Str("format", "auto")));
  }
  int max_tokens = flags.Num<int>("max-tokens", 64);
  const int threads = flags.Num<int>("threads", 0);
  PDS_ASSIGN_OR_RETURN(const engine::Backend backend,
                       engine::ParseBackend(flags.Str("backend", "cpu")));
  const int cuda_device = flags.Num<int>("cuda-device", 0);
  PDS_ASSIGN_OR_RETURN(const std::optional<kv::KvDType> kv_dtype,
                       engine::ParseKvDTypeFlag(flags.Str("kv-dtype", "auto")));
  engine::SamplingParams sampling;
  sampling.temperature = flags.Num<float>("temperature", 0.0f);
  sampling.top_p = flags.Num<float>("top-p", 1.0f);
  sampling.top_k = flags.Num<int>("top-k", 0);
  sampling.seed = static_cast<uint64_t>(flags.Num<int64_t>("seed", 0));
  PDS_RETURN_IF_ERROR(flags.Check());
  PDS_RETURN_IF_ERROR(sampling.Validate());
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
  std::cout << prompt << std::flush;
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
    if (tokenizer->IsEos(next)) break;
    PDS_ASSIGN_OR_RETURN(std::string delta, detokenizer.Push(next));
    std::cout << delta << std::flush;
    step_tokens = {next};
  }
  std::cout << detokenizer.Finish() << std::endl;
  double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
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
  if (argc < 2 || std::string(argv[1]) == "--help" ||
      std::string(argv[1]) == "help") {
    std::fputs(pdserve::kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string command = argv[1];
  absl::Status status;
  if (command == "generate") {
    status = pdserve::Generate(argc, argv);
  } else if (command == "local" || command == "client") {
    // These live in pdserve-cluster (next to this binary): they need gRPC and
    // its libprotobuf, which this process must not load — the tokenizer's
    // SentencePiece carries an older embedded protobuf (see
    // services/tokenizer/README.md).
    const std::string cluster_tool =
        std::filesystem::path(pdserve::process::ExecutableDir()) /
        "pdserve-cluster";
    std::vector<char*> args(argv, argv + argc);
    args[0] = const_cast<char*>(cluster_tool.c_str());
    args.push_back(nullptr);
    execv(cluster_tool.c_str(), args.data());
    std::fprintf(stderr, "pdserve: cannot run %s: %s\n", cluster_tool.c_str(),
                 std::strerror(errno));
    return 1;
  } else {
    std::fprintf(stderr, "pdserve: unknown command '%s'\n%s", command.c_str(),
                 pdserve::kUsage);
    return 2;
  }
  if (!status.ok()) {
    std::fprintf(stderr, "pdserve %s: %s\n", command.c_str(),
                 status.ToString().c_str());
    return 1;
  }
  return 0;
}
