// A candidate cluster layout, how the planner enumerates them for a budget of
// cores, and how a chosen one is written out: `pdserve local` flags and the
// Kubernetes layout ConfigMap / replica values (deploy/kubernetes/base).
#pragma once

#include <string>
#include <vector>

#include "planner/perf_model.h"

namespace pdserve::planner {

struct Layout {
  // No prefill groups: the decode workers prefill themselves (chunked into
  // their steps, max_step_tokens at a time).
  bool colocated = false;
  int prefill_groups = 1;
  int stages = 1;
  int prefill_threads = 1;  // per stage
  int chunk_tokens = 256;   // equal-cost chunks (the prefill default)
  int microbatch_tokens = 512;

  int decode_workers = 1;
  int tp = 1;
  int decode_threads = 1;  // per TP rank
  int max_step_tokens = 512;
  int max_running = 64;
  // n-gram speculation with up to `gamma` drafts; 0 = off.
  int gamma = 0;

  int PrefillThreads() const {
    return colocated ? 0 : prefill_groups * stages * prefill_threads;
  }
  int DecodeThreads() const { return decode_workers * tp * decode_threads; }
  int Threads() const { return PrefillThreads() + DecodeThreads(); }

  // "colocated 1D(tp1×2t) step 512", "1P(1s×1t, chunk 256)+1D(tp1×1t)".
  std::string Name() const;
  // Flags of `pdserve local` that build this layout.
  std::string LocalFlags() const;
  // The deploy/kubernetes/base values that build it: the layout ConfigMap,
  // the decode Deployment's and prefill LeaderWorkerSet's replica counts and
  // group size, and the KEDA ScaledObjects' lower bounds at those counts.
  std::string KubernetesValues() const;
};

// The most nodes one layout is planned across: the candidates grow
// combinatorially with them (8 nodes of 2 cores: ~3 s per simulation run of
// every layout), and a larger cluster runs copies of a smaller layout
// (the online monitor's desired replicas).
inline constexpr int kMaxPlannedNodes = 16;

// What the cluster may use.
struct Resources {
  int cores = 2;  // per node: compute threads it runs without sharing cores
  // Also enumerate layouts with up to twice as many compute threads as
  // cores (they share them), each decode rank and prefill stage on one
  // thread.
  bool allow_oversubscription = false;
  // The router (and, on one machine, the clients) run on these cores too.
  bool router_shares_cores = true;
  int nodes = 1;  // machines, each with `cores`
  // Each node's network link, bytes/s each way (a stage's KV writes and
  // hidden states to a process on another node cross it). Needed where a
  // layout spans nodes; 0: not given.
  double network_bytes_per_second = 0;
};

// Where a layout's processes run: a node per decode worker (its TP ranks
// stay on one node) and per prefill stage. Placed one by one, decode
// workers first, each on the node with the fewest compute threads so far —
// what Kubernetes' default scoring (least allocated) does with cpu requests
// equal to each pod's threads — and on a tie on the node of the previous
// stage of the same group (a pipeline kept on one node sends its hidden
// states through memory), else the lowest-numbered. With one node
// everything is on node 0.
struct Placement {
  std::vector<int> decode_node;              // [worker]
  std::vector<std::vector<int>> stage_node;  // [group][stage]
  std::vector<int> node_threads;             // compute threads per node
  // Any stage on another node than a decode worker or than its next stage:
  // the layout sends over the network.
  bool CrossesNodes() const;
};
Placement PlaceLayout(const Layout& layout, int nodes);
// "node 0: decode 0 (tp2×1t); node 1: group 0 stages 0-1 (2 threads)".
std::string FormatPlacement(const Layout& layout, const Placement& placement);

// Every layout within `resources` whose compute configurations `model`
// profiled, placed by PlaceLayout within each node's cores: colocated (W
// workers × TP × threads; max_step_tokens 128/256/512) and disaggregated (G
// groups × S stages × threads + W decode workers × TP × threads; chunk
// 128/256/512). With `ngram_acceptance` > 0 each also comes with γ = 1..4
// n-gram speculation.
std::vector<Layout> EnumerateLayouts(const Resources& resources,
                                     const PerfModel& model,
                                     double ngram_acceptance);

}  // namespace pdserve::planner
