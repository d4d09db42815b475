// Pipeline-parallel prefill: S = 1 vs S = 2 (and more with --stages) on the
// same queue of long prompts, one compute thread per stage, in one run.
//
//   prefill_bench [flags]   (`prefill_bench --help` lists every flag, its
//                            default and meaning)
//
// The whole queue is submitted at once (a full queue: every stage can have
// work). Reported per S: prefill tokens/s over the queue, TTFT of the first
// and last request, the auto layer split, every stage's busy seconds from the
// stage counters, and the bubble ratio = 1 - Σ busy / (S × wall). The issue's
// target: S = 2 tokens/s >= 1.6 x S = 1.
//
// With --prompt-logprobs N every S also runs the same queue scoring its
// prompts (echo + logprobs: logits at every position on the last stage, log
// p(next prompt token) and N alternatives per position), right after the
// plain run on the same group layout, and prints scored / plain tokens/s.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/command_line_flags.h"
#include "common/status_macros.h"
#include "engine/matmul.h"
#include "model/weight_source.h"
#include "prefill/chunk_policy.h"
#include "prefill/in_process_group.h"
#include "prefill/layer_split.h"

namespace pdserve::bench {
namespace {

struct Result {
  int stages = 0;
  std::vector<int> split;
  double wall = 0;
  double tokens_per_s = 0;
  double first_ttft = 0;
  double last_ttft = 0;
  std::vector<double> busy;
  double bubble = 0;
};

absl::StatusOr<Result> RunOnce(const model::WeightSource& weights, int stages,
                               int prompt_tokens, int requests,
                               const prefill::ChunkPolicy& policy,
                               int microbatch_tokens, int max_in_flight,
                               int prompt_logprobs, double scored_share) {
  const model::ModelConfig& config = weights.config();
  prefill::PrefillGroupOptions options;
  // The FLOP model: dummy weights, and measuring would add minutes here.
  PDS_ASSIGN_OR_RETURN(
      options.layer_split,
      prefill::AutoLayerSplit(
          prefill::EstimateLayerCosts(
              config, microbatch_tokens,
              std::max(1, static_cast<int>(scored_share * microbatch_tokens))),
          stages));
  options.threads_per_stage = 1;
  options.scheduler.chunk_policy = policy;
  options.scheduler.microbatch_token_budget = microbatch_tokens;
  options.scheduler.max_in_flight = max_in_flight;
  options.scheduler.block_size = 16;
  options.scheduler.num_blocks =
      int64_t{requests} * ((prompt_tokens + 15) / 16) + 16;
  options.scheduler.prefix_reuse = false;  // distinct prompts anyway
  PDS_ASSIGN_OR_RETURN(
      std::unique_ptr<prefill::InProcessPrefillGroup> group,
      prefill::InProcessPrefillGroup::Create(weights, options, nullptr));
  std::vector<std::shared_ptr<prefill::PrefillTicket>> tickets;
  const absl::Time start = absl::Now();
  for (int r = 0; r < requests; ++r) {
    prefill::PrefillRequest request;
    request.request_id = r + 1;
    request.prompt.push_back(1);
    for (int i = 1; i < prompt_tokens; ++i) {
      // Distinct prompts: no prefix is shared between requests.
      request.prompt.push_back(3 + (i * 7919 + r * 104729) %
                                       (config.vocab_size - 3));
    }
    request.prompt_logprobs = prompt_logprobs >= 0;
    request.top_logprobs = std::max(prompt_logprobs, 0);
    request.write_kv = false;  // no destination either way (kv_out is null)
    PDS_ASSIGN_OR_RETURN(auto ticket, group->Submit(std::move(request)));
    tickets.push_back(std::move(ticket));
  }
  Result result;
  result.stages = stages;
  result.split = options.layer_split;
  for (size_t r = 0; r < tickets.size(); ++r) {
    PDS_RETURN_IF_ERROR(tickets[r]->Wait(absl::Hours(1)).status());
    const double t = absl::ToDoubleSeconds(absl::Now() - start);
    if (r == 0) result.first_ttft = t;
    result.last_ttft = t;
  }
  result.wall = absl::ToDoubleSeconds(absl::Now() - start);
  result.tokens_per_s =
      static_cast<double>(prompt_tokens) * requests / result.wall;
  double busy_sum = 0;
  for (int s = 0; s < group->num_stages(); ++s) {
    result.busy.push_back(group->stage(s).stats().busy_seconds);
    busy_sum += result.busy.back();
  }
  result.bubble = 1.0 - busy_sum / (stages * result.wall);
  return result;
}

int Main(int argc, char** argv) {
  CommandLineFlags flags;
  if (auto s = flags.Parse(argc, argv); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 2;
  }
  flags.Group("Model");
  const std::string config_path =
      flags.Str("config", PDSERVE_MODELS_DIR "/bench-configs/llama-110m.json",
                "Model config JSON (random weights of that shape).");
  flags.Group("Workload");
  const int prompt =
      flags.Num<int>("prompt", 2048, "Prompt length of every request, tokens.");
  const int requests = flags.Num<int>(
      "requests", 4, "Requests in the queue, all submitted at once.");
  const int prompt_logprobs = flags.Num<int>(
      "prompt-logprobs", -1,
      "Also score the prompts (echo + logprobs) with N alternatives per "
      "position and compare; -1: off.");
  flags.Group("Pipeline");
  const std::string stages_text =
      flags.Str("stages", "1,2", "Stage counts S to compare, comma-separated.");
  const double scored_share = flags.Num<double>(
      "scored-share", 0.0,
      "S > 1 also reruns the scored queue with the auto split weighted for "
      "this share of scored prompt tokens (as prefill_worker's flag); 0: "
      "off.");
  flags.Group("Scheduling");
  const int chunk_tokens =
      flags.Num<int>("chunk-tokens", 512, "Average prompt tokens per chunk.");
  const int microbatch = flags.Num<int>(
      "microbatch-tokens", 512, "Token budget of one pipeline microbatch.");
  const std::string policy_name =
      flags.Str("policy", "equal-cost", "Chunk policy: equal-cost|fixed.");
  const int max_in_flight = flags.Num<int>(
      "max-in-flight", 0, "Microbatches in the pipeline at once (0: 2S).");
  if (flags.help_requested()) {
    std::fputs(flags
                   .Usage("prefill_bench [flags]\n"
                          "Pipeline-parallel prefill: S = 1 vs S = 2 (and "
                          "more with --stages) on the same queue of long "
                          "prompts, one compute thread per stage "
                          "(bench/prefill_bench.cc).\n")
                   .c_str(),
               stdout);
    return 0;
  }
  if (auto s = flags.Check(); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 2;
  }
  std::vector<int> stage_counts;
  for (absl::string_view part : absl::StrSplit(stages_text, ',')) {
    int s = 0;
    if (!absl::SimpleAtoi(part, &s) || s < 1) {
      std::fprintf(stderr, "--stages: bad list\n");
      return 2;
    }
    stage_counts.push_back(s);
  }
  prefill::ChunkPolicy policy;
  policy.kind = policy_name == "fixed" ? prefill::ChunkPolicyKind::kFixed
                                       : prefill::ChunkPolicyKind::kEqualCost;
  policy.chunk_tokens = chunk_tokens;
  engine::UseSingleThreadedBlas();
  auto weights = model::OpenModel(config_path, model::LoadFormat::kDummy);
  if (!weights.ok()) {
    std::fprintf(stderr, "%s\n", weights.status().ToString().c_str());
    return 1;
  }
  std::printf(
      "prefill_bench: %s, %d requests x %d tokens queued at once, chunks %s, "
      "microbatch %d tokens, %s microbatches in flight, 1 thread per stage, "
      "%u hardware threads\n",
      config_path.c_str(), requests, prompt, policy.DebugString().c_str(),
      microbatch, max_in_flight > 0 ? absl::StrCat(max_in_flight).c_str() : "S",
      std::thread::hardware_concurrency());
  std::printf("%-3s %-14s %9s %10s %10s %10s %8s %s\n", "S", "split", "wall",
              "tokens/s", "TTFT 1st", "TTFT last", "bubble", "busy per stage");
  double base = 0;
  auto print = [&](const Result& r, const char* what) {
    std::vector<std::string> busy;
    for (double b : r.busy) busy.push_back(absl::StrFormat("%.2fs", b));
    std::printf(
        "%-3d %-14s %8.2fs %10.1f %9.2fs %9.2fs %7.1f%% %s  (%.2fx S=%d)%s\n",
        r.stages, absl::StrJoin(r.split, ",").c_str(), r.wall, r.tokens_per_s,
        r.first_ttft, r.last_ttft, r.bubble * 100,
        absl::StrJoin(busy, " ").c_str(), r.tokens_per_s / base,
        stage_counts[0], what);
    std::fflush(stdout);
  };
  for (int stages : stage_counts) {
    absl::StatusOr<Result> r =
        RunOnce(**weights, stages, prompt, requests, policy, microbatch,
                max_in_flight, -1, 0.0);
    if (!r.ok()) {
      std::fprintf(stderr, "S=%d: %s\n", stages, r.status().ToString().c_str());
      return 1;
    }
    if (base == 0) base = r->tokens_per_s;
    print(*r, "");
    if (prompt_logprobs < 0) continue;
    absl::StatusOr<Result> scored =
        RunOnce(**weights, stages, prompt, requests, policy, microbatch,
                max_in_flight, prompt_logprobs, 0.0);
    if (!scored.ok()) {
      std::fprintf(stderr, "S=%d scored: %s\n", stages,
                   scored.status().ToString().c_str());
      return 1;
    }
    print(*scored, absl::StrFormat(
                       "  scoring prompts (%d alternatives): %.2fx plain",
                       prompt_logprobs, scored->tokens_per_s / r->tokens_per_s)
                       .c_str());
    if (scored_share <= 0 || stages == 1) continue;
    absl::StatusOr<Result> rebalanced =
        RunOnce(**weights, stages, prompt, requests, policy, microbatch,
                max_in_flight, prompt_logprobs, scored_share);
    if (!rebalanced.ok()) {
      std::fprintf(stderr, "S=%d rebalanced: %s\n", stages,
                   rebalanced.status().ToString().c_str());
      return 1;
    }
    print(*rebalanced,
          absl::StrFormat(
              "  scoring, split for --scored-share %.2f: %.2fx plain",
              scored_share, rebalanced->tokens_per_s / r->tokens_per_s)
              .c_str());
  }
  return 0;
}

}  // namespace
}  // namespace pdserve::bench

int main(int argc, char** argv) { return pdserve::bench::Main(argc, argv); }
