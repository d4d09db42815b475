#include "router/assignment_policy.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace pdserve::router {
namespace {

absl::Status NothingEligible() {
  return absl::UnavailableError("no healthy worker is available");
}

// splitmix64 finalizer: spreads ring points and keys evenly.
uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// FNV-1a: stable across processes and builds (std::hash is not), so several
// router replicas place workers on the same ring points.
uint64_t StableHash(std::string_view s) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001B3ull;
  }
  return h;
}

class RoundRobinPolicy final : public AssignmentPolicy {
 public:
  std::string_view name() const override { return "round-robin"; }
  absl::StatusOr<size_t> Pick(std::span<const WorkerView> workers,
                              const AssignmentContext&) override {
    const size_t n = workers.size();
    if (n == 0) return NothingEligible();
    const size_t start = next_.fetch_add(1, std::memory_order_relaxed);
    for (size_t i = 0; i < n; ++i) {
      size_t index = (start + i) % n;
      if (workers[index].eligible) return index;
    }
    return NothingEligible();
  }

 private:
  std::atomic<size_t> next_{0};
};

class LeastLoadedPolicy final : public AssignmentPolicy {
 public:
  explicit LeastLoadedPolicy(double kv_weight) : kv_weight_(kv_weight) {}
  std::string_view name() const override { return "least-loaded"; }
  absl::StatusOr<size_t> Pick(std::span<const WorkerView> workers,
                              const AssignmentContext&) override {
    const size_t n = workers.size();
    if (n == 0) return NothingEligible();
    // Scanning from a rotating start breaks ties in turn, so equally loaded
    // workers share a burst that arrives before load reports catch up.
    const size_t start = next_.fetch_add(1, std::memory_order_relaxed);
    size_t best = n;
    double best_cost = std::numeric_limits<double>::infinity();
    for (size_t i = 0; i < n; ++i) {
      size_t index = (start + i) % n;
      const WorkerView& w = workers[index];
      if (!w.eligible) continue;
      double cost =
          static_cast<double>(w.Outstanding()) + kv_weight_ * w.load.KvUsage();
      if (cost < best_cost) {
        best_cost = cost;
        best = index;
      }
    }
    if (best == n) return NothingEligible();
    return best;
  }

 private:
  const double kv_weight_;
  std::atomic<size_t> next_{0};
};

class PrefixAwarePolicy final : public AssignmentPolicy {
 public:
  explicit PrefixAwarePolicy(const PolicyOptions& options)
      : options_(options), fallback_(options.kv_weight) {}
  std::string_view name() const override { return "prefix-aware"; }

  absl::StatusOr<size_t> Pick(std::span<const WorkerView> workers,
                              const AssignmentContext& context) override {
    if (context.block_hashes.empty()) {
      return fallback_.Pick(workers, context);
    }
    const size_t depth =
        std::min<size_t>(context.block_hashes.size(), options_.prefix_blocks);
    // The chained hash of block k already covers blocks 0..k.
    const uint64_t key = Mix(context.block_hashes[depth - 1]);

    int64_t total = 0;
    size_t eligible = 0;
    for (const WorkerView& w : workers) {
      if (!w.eligible) continue;
      ++eligible;
      total += w.Outstanding();
    }
    if (eligible == 0) return NothingEligible();
    const int64_t cap = static_cast<int64_t>(std::ceil(
        options_.load_bound * static_cast<double>(total + 1) / eligible));

    absl::MutexLock lock(&mu_);
    RebuildRingIfChanged(workers);
    // Walk clockwise from the key; the first eligible worker under the cap
    // wins. One always is: the cap exceeds the mean load.
    auto it = std::lower_bound(
        ring_.begin(), ring_.end(), key,
        [](const RingPoint& p, uint64_t k) { return p.position < k; });
    for (size_t step = 0; step < ring_.size(); ++step, ++it) {
      if (it == ring_.end()) it = ring_.begin();
      const WorkerView& w = workers[it->worker];
      if (w.eligible && w.Outstanding() + 1 <= cap) return it->worker;
    }
    return fallback_.Pick(workers, context);
  }

 private:
  struct RingPoint {
    uint64_t position;
    size_t worker;  // index into the snapshot the ring was built for
  };

  // Ring points depend only on worker ids, so the ring is rebuilt only when
  // the set (or order) of workers changes. Ineligible workers stay on the
  // ring and are skipped: a worker failing over moves only its own keys.
  void RebuildRingIfChanged(std::span<const WorkerView> workers)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    bool same = ring_ids_.size() == workers.size();
    for (size_t i = 0; same && i < workers.size(); ++i) {
      same = ring_ids_[i] == workers[i].id;
    }
    if (same) return;
    ring_ids_.clear();
    ring_.clear();
    for (size_t i = 0; i < workers.size(); ++i) {
      ring_ids_.push_back(workers[i].id);
      const uint64_t base = StableHash(workers[i].id);
      for (int v = 0; v < options_.virtual_nodes; ++v) {
        ring_.push_back({Mix(base ^ Mix(static_cast<uint64_t>(v))), i});
      }
    }
    std::sort(ring_.begin(), ring_.end(),
              [](const RingPoint& a, const RingPoint& b) {
                return a.position < b.position;
              });
  }

  const PolicyOptions options_;
  LeastLoadedPolicy fallback_;
  absl::Mutex mu_;
  std::vector<std::string> ring_ids_ ABSL_GUARDED_BY(mu_);
  std::vector<RingPoint> ring_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<AssignmentPolicy>> MakeAssignmentPolicy(
    std::string_view name, const PolicyOptions& options) {
  if (options.kv_weight < 0 || !std::isfinite(options.kv_weight)) {
    return absl::InvalidArgumentError("kv_weight must be >= 0");
  }
  if (name == "round-robin") return std::make_unique<RoundRobinPolicy>();
  if (name == "least-loaded") {
    return std::make_unique<LeastLoadedPolicy>(options.kv_weight);
  }
  if (name == "prefix-aware") {
    if (options.prefix_blocks < 1 || options.virtual_nodes < 1 ||
        !(options.load_bound > 1.0)) {
      return absl::InvalidArgumentError(
          "prefix-aware needs prefix_blocks >= 1, virtual_nodes >= 1 and "
          "load_bound > 1");
    }
    return std::make_unique<PrefixAwarePolicy>(options);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown assignment policy '",
                   absl::string_view(name.data(), name.size()),
                   "' (round-robin, least-loaded, prefix-aware)"));
}

}  // namespace pdserve::router
