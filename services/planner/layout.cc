#include "planner/layout.h"

#include "absl/strings/str_cat.h"

namespace pdserve::planner {

std::string Layout::Name() const {
  const std::string spec = gamma > 0 ? absl::StrCat(" ngram γ", gamma) : "";
  const std::string decode =
      absl::StrCat(decode_workers, "D(tp", tp, "×", decode_threads, "t)");
  if (colocated) {
    return absl::StrCat("colocated ", decode, " step ", max_step_tokens, spec);
  }
  return absl::StrCat(prefill_groups, "P(", stages, "s×", prefill_threads,
                      "t, chunk ", chunk_tokens, ")+", decode, spec);
}

std::string Layout::LocalFlags() const {
  std::string flags = absl::StrCat(
      "--decode-workers ", decode_workers, " --tp ", tp, " --decode-threads ",
      decode_threads, " --max-step-tokens ", max_step_tokens, " --max-running ",
      max_running, " --speculation ", gamma > 0 ? "ngram" : "off");
  if (colocated) return absl::StrCat("--colocated 1 ", flags);
  return absl::StrCat("--prefill-groups ", prefill_groups, " --stages ", stages,
                      " --prefill-threads ", prefill_threads,
                      " --chunk-tokens ", chunk_tokens, " ", flags);
}

std::string Layout::KubernetesValues() const {
  std::string out = absl::StrCat(
      "ConfigMap pdserve-layout:\n"
      "  DECODE_TP: \"",
      tp,
      "\"\n"
      "  DECODE_THREADS_PER_RANK: \"",
      decode_threads,
      "\"\n"
      "  MAX_STEP_TOKENS: \"",
      max_step_tokens,
      "\"\n"
      "  SPECULATION: \"",
      gamma > 0 ? "ngram" : "off", "\"\n");
  if (colocated) {
    absl::StrAppend(&out,
                    "StatefulSet prefill: replicas 0 (router --colocated=1)\n"
                    "StatefulSet decode: replicas ",
                    decode_workers, "\n");
    return out;
  }
  absl::StrAppend(&out, "  PREFILL_STAGES: \"", stages,
                  "\"\n"
                  "  PREFILL_THREADS: \"",
                  prefill_threads,
                  "\"\n"
                  "  CHUNK_TOKENS: \"",
                  chunk_tokens,
                  "\"\n"
                  "StatefulSet prefill: replicas ",
                  stages, " per group (", prefill_groups,
                  " group(s))\n"
                  "StatefulSet decode: replicas ",
                  decode_workers, "\n");
  return out;
}

std::vector<Layout> EnumerateLayouts(const Resources& resources,
                                     const PerfModel& model,
                                     double ngram_acceptance) {
  std::vector<Layout> out;
  // Compute threads a layout may have: the cores, or twice as many when
  // layouts may share them (the simulator shares the cores among the
  // threads' measured demand). Sharing layouts keep one thread per decode
  // rank and prefill stage: a rank with a thread pool waits at every loop
  // for its slowest thread, and one descheduled for an OS time slice stalls
  // the step, which processor sharing does not model (planner_bench: such
  // layouts measured 2.1-2.4x below their predicted goodput, while the
  // single-threaded default was within 13%).
  const int cores =
      resources.allow_oversubscription ? 2 * resources.cores : resources.cores;
  auto fits = [&](const Layout& l) {
    if (l.Threads() <= resources.cores) return true;
    return l.Threads() <= cores && l.decode_threads == 1 &&
           (l.colocated || l.prefill_threads == 1);
  };
  auto profiled = [&](int tp, int threads) {
    return model.steps.count(ComputeConfig{tp, threads}) > 0;
  };
  std::vector<int> gammas = {0};
  if (ngram_acceptance > 0) gammas = {0, 1, 2, 3, 4};
  for (const auto& [decode, _] : model.steps) {
    for (int workers = 1; workers * decode.threads() <= cores; ++workers) {
      for (int step : {128, 256, 512}) {
        for (int gamma : gammas) {
          Layout l;
          l.colocated = true;
          l.decode_workers = workers;
          l.tp = decode.tp;
          l.decode_threads = decode.threads_per_rank;
          l.max_step_tokens = step;
          l.gamma = gamma;
          if (fits(l)) out.push_back(l);
        }
      }
    }
    // Disaggregated: prefill stages run the tp-1 step cost of their threads.
    for (int workers = 1; workers * decode.threads() < cores; ++workers) {
      const int left = cores - workers * decode.threads();
      for (int prefill_threads = 1; prefill_threads <= left;
           ++prefill_threads) {
        if (!profiled(1, prefill_threads)) continue;
        for (int stages = 1;
             stages * prefill_threads <= left && stages <= model.num_layers;
             ++stages) {
          for (int groups = 1; groups * stages * prefill_threads <= left;
               ++groups) {
            for (int chunk : {128, 256, 512}) {
              for (int gamma : gammas) {
                Layout l;
                l.prefill_groups = groups;
                l.stages = stages;
                l.prefill_threads = prefill_threads;
                l.chunk_tokens = chunk;
                l.decode_workers = workers;
                l.tp = decode.tp;
                l.decode_threads = decode.threads_per_rank;
                l.gamma = gamma;
                if (fits(l)) out.push_back(l);
              }
            }
          }
        }
      }
    }
  }
  return out;
}

}  // namespace pdserve::planner
