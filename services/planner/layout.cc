#include "planner/layout.h"

#include <algorithm>

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
  // What deploy/kubernetes/base needs set (deploy/README.md): the layout
  // ConfigMap, the decode Deployment's replicas, the prefill
  // LeaderWorkerSet's groups (replicas) and group size (stages), the KEDA
  // ScaledObjects' lower bounds at those counts (the autoscalers add
  // replicas from there), and cpu requests equal to each pod's compute
  // threads, so the scheduler places them as PlaceLayout assumes.
  std::string out = absl::StrCat("ConfigMap pdserve-layout:\n  DECODE_TP: \"",
                                 tp, "\"\n  DECODE_THREADS_PER_RANK: \"",
                                 decode_threads, "\"\n  MAX_STEP_TOKENS: \"",
                                 max_step_tokens, "\"\n  SPECULATION: \"",
                                 gamma > 0 ? "ngram" : "off", "\"\n");
  if (!colocated) {
    absl::StrAppend(&out, "  PREFILL_STAGES: \"", stages,
                    "\"\n  PREFILL_THREADS: \"", prefill_threads,
                    "\"\n  CHUNK_TOKENS: \"", chunk_tokens, "\"\n");
  }
  absl::StrAppend(
      &out, "Deployment decode: replicas ", decode_workers,
      "; containers[0].resources.requests.cpu \"", tp * decode_threads,
      "\"\nScaledObject decode: minReplicaCount ", decode_workers, "\n");
  if (colocated) {
    absl::StrAppend(&out,
                    "LeaderWorkerSet prefill: none (router --colocated=1; "
                    "leave out prefill.yaml and its ScaledObject)\n");
    return out;
  }
  absl::StrAppend(&out, "LeaderWorkerSet prefill: replicas ", prefill_groups,
                  " (groups), leaderWorkerTemplate.size ", stages,
                  " (= PREFILL_STAGES); containers[0].resources.requests.cpu "
                  "\"",
                  prefill_threads, "\"\nScaledObject prefill: minReplicaCount ",
                  prefill_groups, "\n");
  return out;
}

bool Placement::CrossesNodes() const {
  for (const std::vector<int>& stages : stage_node) {
    for (size_t s = 0; s < stages.size(); ++s) {
      if (s + 1 < stages.size() && stages[s + 1] != stages[s]) return true;
      for (int d : decode_node) {
        if (d != stages[s]) return true;
      }
    }
  }
  return false;
}

Placement PlaceLayout(const Layout& layout, int nodes) {
  Placement p;
  p.node_threads.assign(std::max(nodes, 1), 0);
  // The least-loaded node, `prefer` on a tie (-1: none), else the lowest.
  auto place = [&p](int threads, int prefer) {
    int best = 0;
    for (int n = 1; n < static_cast<int>(p.node_threads.size()); ++n) {
      if (p.node_threads[n] < p.node_threads[best]) best = n;
    }
    if (prefer >= 0 && p.node_threads[prefer] == p.node_threads[best]) {
      best = prefer;
    }
    p.node_threads[best] += threads;
    return best;
  };
  for (int w = 0; w < layout.decode_workers; ++w) {
    p.decode_node.push_back(place(layout.tp * layout.decode_threads, -1));
  }
  if (layout.colocated) return p;
  for (int g = 0; g < layout.prefill_groups; ++g) {
    std::vector<int> stages;
    for (int s = 0; s < layout.stages; ++s) {
      stages.push_back(
          place(layout.prefill_threads, s > 0 ? stages.back() : -1));
    }
    p.stage_node.push_back(std::move(stages));
  }
  return p;
}

std::string FormatPlacement(const Layout& layout, const Placement& placement) {
  std::vector<std::string> nodes(placement.node_threads.size());
  for (size_t w = 0; w < placement.decode_node.size(); ++w) {
    std::string& n = nodes[placement.decode_node[w]];
    absl::StrAppend(&n, n.empty() ? "" : ", ", "decode ", w, " (tp", layout.tp,
                    "×", layout.decode_threads, "t)");
  }
  for (size_t g = 0; g < placement.stage_node.size(); ++g) {
    for (size_t s = 0; s < placement.stage_node[g].size(); ++s) {
      std::string& n = nodes[placement.stage_node[g][s]];
      absl::StrAppend(&n, n.empty() ? "" : ", ", "group ", g, " stage ", s,
                      " (", layout.prefill_threads, "t)");
    }
  }
  std::string out;
  for (size_t i = 0; i < nodes.size(); ++i) {
    absl::StrAppend(&out, out.empty() ? "" : "; ", "node ", i, ": ",
                    nodes[i].empty() ? "idle" : nodes[i], " — ",
                    placement.node_threads[i], " thread(s)");
  }
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
  //
  // Across nodes: every process on one node (PlaceLayout), each node within
  // its cores (or twice them, as above).
  const int nodes = std::max(resources.nodes, 1);
  const int per_node =
      resources.allow_oversubscription ? 2 * resources.cores : resources.cores;
  const int cores = nodes * per_node;
  auto fits = [&](const Layout& l) {
    const bool one_thread_each =
        l.decode_threads == 1 && (l.colocated || l.prefill_threads == 1);
    const Placement placement = PlaceLayout(l, nodes);
    for (int threads : placement.node_threads) {
      if (threads > resources.cores &&
          (threads > per_node || !one_thread_each)) {
        return false;
      }
    }
    return true;
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
