// Assignment policies over fake load reports: distribution, stickiness, the
// load bound, failover.
#include "router/assignment_policy.h"

#include <gtest/gtest.h>

#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kv/block_manager.h"

namespace pdserve::router {
namespace {

std::vector<WorkerView> Workers(int n) {
  std::vector<WorkerView> workers;
  for (int i = 0; i < n; ++i) {
    workers.push_back({absl::StrCat("10.0.0.", i + 1, ":50051"), true, {}, 0});
  }
  return workers;
}

std::unique_ptr<AssignmentPolicy> Make(std::string_view name,
                                       const PolicyOptions& options = {}) {
  auto policy = MakeAssignmentPolicy(name, options);
  EXPECT_TRUE(policy.ok()) << policy.status();
  return std::move(policy).value();
}

// Block hashes of a prompt: `prefix_id` picks a shared prefix of 4 blocks,
// `suffix` makes the rest differ.
std::vector<uint64_t> Hashes(int prefix_id, int suffix, int block_size = 16) {
  std::vector<int32_t> tokens;
  for (int i = 0; i < 4 * block_size; ++i)
    tokens.push_back(prefix_id * 1000 + i);
  for (int i = 0; i < 2 * block_size; ++i) tokens.push_back(suffix * 7 + i);
  return kv::FullBlockHashes(tokens, block_size);
}

TEST(AssignmentPolicyTest, UnknownNameIsInvalid) {
  EXPECT_EQ(MakeAssignmentPolicy("random").status().code(),
            absl::StatusCode::kInvalidArgument);
  PolicyOptions bad;
  bad.load_bound = 1.0;
  EXPECT_EQ(MakeAssignmentPolicy("prefix-aware", bad).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(AssignmentPolicyTest, NothingEligibleIsUnavailable) {
  for (const char* name : {"round-robin", "least-loaded", "prefix-aware"}) {
    auto policy = Make(name);
    std::vector<WorkerView> none;
    EXPECT_EQ(policy->Pick(none, {}).status().code(),
              absl::StatusCode::kUnavailable)
        << name;
    std::vector<WorkerView> sick = Workers(3);
    for (WorkerView& w : sick) w.eligible = false;
    std::vector<uint64_t> hashes = Hashes(1, 1);
    EXPECT_EQ(policy->Pick(sick, {hashes}).status().code(),
              absl::StatusCode::kUnavailable)
        << name;
  }
}

TEST(AssignmentPolicyTest, RoundRobinCyclesAndSkipsUnhealthy) {
  auto policy = Make("round-robin");
  std::vector<WorkerView> workers = Workers(3);
  std::map<size_t, int> counts;
  for (int i = 0; i < 300; ++i) counts[*policy->Pick(workers, {})]++;
  EXPECT_EQ(counts[0], 100);
  EXPECT_EQ(counts[1], 100);
  EXPECT_EQ(counts[2], 100);
  workers[1].eligible = false;
  for (int i = 0; i < 50; ++i) EXPECT_NE(*policy->Pick(workers, {}), 1u);
}

TEST(AssignmentPolicyTest, LeastLoadedPrefersShortQueuesAndFreeKv) {
  auto policy = Make("least-loaded");
  std::vector<WorkerView> workers = Workers(3);
  workers[0].load = {4, 8, 10, 100};
  workers[1].load = {0, 2, 10, 100};
  workers[2].load = {1, 8, 10, 100};
  EXPECT_EQ(*policy->Pick(workers, {}), 1u);
  // Equal queues: the one with free KV wins.
  workers[1].load = {1, 8, 95, 100};
  EXPECT_EQ(*policy->Pick(workers, {}), 2u);
  // The router's own assignments count before the report catches up.
  // (0: 12 + 0.8, 1: 9 + 7.6, 2: 20 + 0.8.)
  workers[2].assigned = 20;
  EXPECT_EQ(*policy->Pick(workers, {}), 0u);
  workers[0].eligible = false;
  EXPECT_EQ(*policy->Pick(workers, {}), 1u);
}

TEST(AssignmentPolicyTest, LeastLoadedSpreadsTiesAndBalancesLoad) {
  auto policy = Make("least-loaded");
  std::vector<WorkerView> workers = Workers(4);
  std::map<size_t, int> counts;
  // Each pick adds to the picked worker's count, like real leases.
  for (int i = 0; i < 400; ++i) {
    size_t pick = *policy->Pick(workers, {});
    workers[pick].assigned++;
    counts[pick]++;
  }
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(counts[i], 100) << i;
}

TEST(AssignmentPolicyTest, PrefixAwareIsStickyAndDistributes) {
  auto policy = Make("prefix-aware");
  std::vector<WorkerView> workers = Workers(4);
  std::map<size_t, int> per_worker;
  for (int prefix = 0; prefix < 200; ++prefix) {
    std::vector<uint64_t> first = Hashes(prefix, 1);
    size_t pick = *policy->Pick(workers, {first});
    per_worker[pick]++;
    // The same leading blocks with a different tail go to the same worker.
    for (int suffix = 2; suffix < 5; ++suffix) {
      std::vector<uint64_t> other = Hashes(prefix, suffix);
      EXPECT_EQ(*policy->Pick(workers, {other}), pick) << prefix;
    }
  }
  // 200 prefixes over 4 workers with 64 ring points each: none is starved.
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_GT(per_worker[i], 20) << i;
    EXPECT_LT(per_worker[i], 100) << i;
  }
}

TEST(AssignmentPolicyTest, PrefixAwareMatchesTheWorkersBlockHashes) {
  // The key must be kv::FullBlockHashes' chain (what the prefix caches
  // store): computing it twice in different ways gives the same pick.
  auto policy = Make("prefix-aware");
  std::vector<WorkerView> workers = Workers(5);
  std::vector<int32_t> tokens(64);
  for (int i = 0; i < 64; ++i) tokens[i] = i * 3;
  std::vector<uint64_t> hashes = kv::FullBlockHashes(tokens, 16);
  uint64_t chained = kv::kRootHash;
  std::vector<uint64_t> manual;
  for (int b = 0; b < 4; ++b) {
    chained = kv::ChainHash(
        chained, std::span<const int32_t>(tokens).subspan(b * 16, 16));
    manual.push_back(chained);
  }
  EXPECT_EQ(hashes, manual);
  EXPECT_EQ(*policy->Pick(workers, {hashes}), *policy->Pick(workers, {manual}));
}

TEST(AssignmentPolicyTest, PrefixAwareLoadBoundSpillsAHotPrefix) {
  PolicyOptions options;
  options.load_bound = 1.25;
  auto policy = Make("prefix-aware", options);
  std::vector<WorkerView> workers = Workers(4);
  std::vector<uint64_t> hot = Hashes(7, 1);
  const size_t home = *policy->Pick(workers, {hot});
  std::map<size_t, int> counts;
  for (int i = 0; i < 400; ++i) {
    size_t pick = *policy->Pick(workers, {hot});
    workers[pick].assigned++;
    counts[pick]++;
    // The bound: no worker above ceil(1.25 * (total + 1) / n).
    int64_t total = 0;
    for (const WorkerView& w : workers) total += w.Outstanding();
    for (const WorkerView& w : workers) {
      EXPECT_LE(w.Outstanding(), static_cast<int64_t>(std::ceil(
                                     1.25 * static_cast<double>(total) / 4)) +
                                     1);
    }
  }
  // The home worker takes the most (its cap, ~1.25 / 4 of all), the next
  // ones on the ring share the overflow.
  EXPECT_LE(counts[home], 130);
  for (size_t i = 0; i < 4; ++i) EXPECT_GT(counts[i], 10) << i;
  for (size_t i = 0; i < 4; ++i) EXPECT_GE(counts[home], counts[i]);
}

TEST(AssignmentPolicyTest, PrefixAwareFailoverMovesOnlyTheDeadWorkersKeys) {
  auto policy = Make("prefix-aware");
  std::vector<WorkerView> workers = Workers(5);
  std::vector<size_t> before;
  for (int prefix = 0; prefix < 100; ++prefix) {
    std::vector<uint64_t> h = Hashes(prefix, 0);
    before.push_back(*policy->Pick(workers, {h}));
  }
  workers[2].eligible = false;
  int moved = 0;
  for (int prefix = 0; prefix < 100; ++prefix) {
    std::vector<uint64_t> h = Hashes(prefix, 0);
    size_t pick = *policy->Pick(workers, {h});
    EXPECT_NE(pick, 2u);
    if (before[prefix] != 2) {
      EXPECT_EQ(pick, before[prefix]) << prefix;
    } else {
      ++moved;
    }
  }
  EXPECT_GT(moved, 0);
  // Back in rotation: the old placement returns.
  workers[2].eligible = true;
  for (int prefix = 0; prefix < 100; ++prefix) {
    std::vector<uint64_t> h = Hashes(prefix, 0);
    EXPECT_EQ(*policy->Pick(workers, {h}), before[prefix]);
  }
}

TEST(AssignmentPolicyTest, PrefixAwareShortPromptFallsBackToLeastLoaded) {
  auto policy = Make("prefix-aware");
  std::vector<WorkerView> workers = Workers(3);
  workers[0].assigned = 5;
  workers[1].assigned = 0;
  workers[2].assigned = 5;
  EXPECT_EQ(*policy->Pick(workers, {}), 1u);
}

}  // namespace
}  // namespace pdserve::router
