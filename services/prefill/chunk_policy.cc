#include "prefill/chunk_policy.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace pdserve::prefill {

absl::Status ChunkPolicy::Validate() const {
  if (chunk_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk size must be >= 0 (0 = whole prompt), got ", chunk_tokens));
  }
  return absl::OkStatus();
}

std::string ChunkPolicy::DebugString() const {
  return absl::StrCat(
      kind == ChunkPolicyKind::kFixed ? "fixed" : "equal-cost", ":",
      chunk_tokens == 0 ? std::string("whole") : absl::StrCat(chunk_tokens));
}

absl::StatusOr<ChunkPolicy> ParseChunkPolicy(std::string_view kind,
                                             int chunk_tokens) {
  ChunkPolicy policy;
  if (kind == "fixed") {
    policy.kind = ChunkPolicyKind::kFixed;
  } else if (kind == "equal-cost") {
    policy.kind = ChunkPolicyKind::kEqualCost;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown chunk policy \"", absl::string_view(kind.data(), kind.size()),
        "\" (expected \"fixed\" or \"equal-cost\")"));
  }
  policy.chunk_tokens = chunk_tokens;
  if (absl::Status s = policy.Validate(); !s.ok()) return s;
  return policy;
}

std::vector<int> EqualCostChunks(int begin, int end, int num_chunks) {
  std::vector<int> lengths;
  const int n = end - begin;
  if (n <= 0) return lengths;
  const int m = std::clamp(num_chunks, 1, n);
  const double c2 = double{1.0} * begin * begin;
  const double t2 = double{1.0} * end * end;
  int previous = begin;
  for (int k = 1; k <= m; ++k) {
    int boundary =
        k == m
            ? end
            : static_cast<int>(std::lround(std::sqrt(c2 + (t2 - c2) * k / m)));
    // Every chunk keeps ≥ 1 token and leaves ≥ 1 for each chunk after it.
    boundary = std::clamp(boundary, previous + 1, end - (m - k));
    lengths.push_back(boundary - previous);
    previous = boundary;
  }
  return lengths;
}

std::vector<int> PlanChunks(const ChunkPolicy& policy, int begin, int end) {
  std::vector<int> lengths;
  const int n = end - begin;
  if (n <= 0) return lengths;
  if (policy.chunk_tokens <= 0 || policy.chunk_tokens >= n) return {n};
  if (policy.kind == ChunkPolicyKind::kEqualCost) {
    const int m = (n + policy.chunk_tokens - 1) / policy.chunk_tokens;
    return EqualCostChunks(begin, end, m);
  }
  for (int at = begin; at < end; at += policy.chunk_tokens) {
    lengths.push_back(std::min(policy.chunk_tokens, end - at));
  }
  return lengths;
}

}  // namespace pdserve::prefill
