// How a prompt is cut into chunks for chunked prefill.
//
//  - Fixed: every chunk holds `chunk_tokens` tokens (the last one the rest).
//  - Equal-cost: attention makes later chunks dearer (a chunk ending at
//    position b attends over b positions), so earlier chunks are larger. With
//    m chunks over positions [c, T), chunk k ends where the attention work done
//    so far, ∝ b², reaches the fraction k/m of the whole:
//        b_k² = c² + (k/m)·(T² − c²)      (c = 0: b_k = T·√(k/m))
//    and m = ceil((T − c) / chunk_tokens), so the average chunk is still
//    `chunk_tokens`. Boundaries are rounded and every chunk keeps ≥ 1 token.
//
// Pure functions; thread-safe.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace pdserve::prefill {

enum class ChunkPolicyKind { kFixed, kEqualCost };

struct ChunkPolicy {
  ChunkPolicyKind kind = ChunkPolicyKind::kFixed;
  // Fixed: tokens per chunk. Equal-cost: average tokens per chunk. 0 = the
  // whole prompt in one chunk (both kinds).
  int chunk_tokens = 0;

  // INVALID_ARGUMENT when chunk_tokens < 0.
  [[nodiscard]] absl::Status Validate() const;
  std::string DebugString()
      const;  // "fixed:64", "equal-cost:64", "fixed:whole"
};

// Parses "fixed" | "equal-cost" with a chunk size, e.g. ("equal-cost", 64).
[[nodiscard]] absl::StatusOr<ChunkPolicy> ParseChunkPolicy(
    std::string_view kind, int chunk_tokens);

// Lengths of the chunks covering prompt positions [begin, end): each ≥ 1,
// summing to end − begin. Empty when begin >= end. Precondition: policy valid.
std::vector<int> PlanChunks(const ChunkPolicy& policy, int begin, int end);

// The equal-cost boundaries for exactly `num_chunks` chunks over [begin, end)
// (clamped to [1, end − begin]).
std::vector<int> EqualCostChunks(int begin, int end, int num_chunks);

}  // namespace pdserve::prefill
