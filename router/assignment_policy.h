// Which worker of one side (prefill groups or decode workers) gets a request.
// A policy sees a snapshot of the side's workers (eligibility, the latest load
// report, the router's own in-flight count) and picks one index; ineligible
// (unhealthy or incompatible) workers are never picked, and with none
// eligible every policy answers UNAVAILABLE (HTTP 503).
//
// Policies (--prefill-policy / --decode-policy):
//   round-robin   eligible workers in turn.
//   least-loaded  lowest Outstanding() + kv_weight * KV usage; ties rotate.
//   prefix-aware  consistent hashing with bounded loads (Mirrokni, Thorup,
//                 Zadimoghaddam 2018) on the chained hash of the prompt's
//                 leading blocks (kv::FullBlockHashes, the hash the workers'
//                 prefix caches use), so requests sharing a prefix land where
//                 it is cached; a worker whose load would exceed
//                 ceil(load_bound * (total + 1) / n) is passed over for the
//                 next on the ring, so a hot prefix cannot pin one worker.
//                 Prompts shorter than one block fall back to least-loaded.
//
// Thread-safety: Pick() may be called concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace pdserve::router {

// The latest load report of a worker (decode: DecodeLoad; prefill:
// PrefillLoad), reduced to what policies weigh.
struct WorkerLoad {
  int32_t queued = 0;   // accepted, not yet running
  int32_t running = 0;  // in the batch / pipeline
  int64_t kv_blocks_used = 0;
  int64_t kv_blocks_total = 0;

  double KvUsage() const {
    return kv_blocks_total > 0
               ? static_cast<double>(kv_blocks_used) / kv_blocks_total
               : 0.0;
  }
};

// One worker as a policy sees it.
struct WorkerView {
  std::string id;  // stable across refreshes: the resolved "ip:port"
  bool eligible = true;
  WorkerLoad load;
  // Requests this router assigned and has not finished: fresher than the
  // report, which lags by up to one refresh interval.
  int32_t assigned = 0;

  // Requests at the worker: the report's count, or the router's own count
  // when that is higher (the report has not caught up yet). Taking the max
  // rather than the sum avoids counting the router's requests twice.
  int64_t Outstanding() const {
    return std::max<int64_t>(int64_t{load.queued} + load.running, assigned);
  }
};

struct AssignmentContext {
  // kv::FullBlockHashes(prompt ids, block size); may be empty.
  std::span<const uint64_t> block_hashes;
};

struct PolicyOptions {
  // least-loaded: how many outstanding requests a full KV pool weighs.
  double kv_weight = 8.0;
  // prefix-aware: the key is the chained hash of this many leading blocks
  // (fewer when the prompt is shorter): deep enough to tell system prompts
  // apart, shallow enough that requests sharing one still match.
  int prefix_blocks = 4;
  // prefix-aware: c in the bounded-loads cap ceil(c * (total + 1) / n), > 1.
  double load_bound = 1.25;
  int virtual_nodes = 64;  // ring points per worker
};

class AssignmentPolicy {
 public:
  virtual ~AssignmentPolicy() = default;
  virtual std::string_view name() const = 0;
  // Index into `workers`; UNAVAILABLE when none is eligible.
  [[nodiscard]] virtual absl::StatusOr<size_t> Pick(
      std::span<const WorkerView> workers,
      const AssignmentContext& context) = 0;
};

// "round-robin", "least-loaded" or "prefix-aware"; INVALID_ARGUMENT
// otherwise (or for options out of range).
[[nodiscard]] absl::StatusOr<std::unique_ptr<AssignmentPolicy>>
MakeAssignmentPolicy(std::string_view name, const PolicyOptions& options = {});

}  // namespace pdserve::router
