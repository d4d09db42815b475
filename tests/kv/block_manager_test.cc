#include "kv/block_manager.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pdserve::kv {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

constexpr int kBlockSize = 4;

// Tokens 0..n-1 offset by `base`, so distinct bases give distinct prompts.
std::vector<int32_t> Tokens(int n, int32_t base = 100) {
  std::vector<int32_t> t(n);
  std::iota(t.begin(), t.end(), base);
  return t;
}

std::span<const int32_t> BlockTokens(const std::vector<int32_t>& t, int k) {
  return std::span<const int32_t>(t).subspan(k * kBlockSize, kBlockSize);
}

class KvBlockManagerTest : public ::testing::Test {
 protected:
  void TearDown() override {
    // Every test gives back what it took: nothing stays referenced, and the
    // bookkeeping is consistent.
    EXPECT_EQ(manager_.used_blocks(), 0);
    EXPECT_EQ(manager_.free_blocks() + manager_.cached_blocks(),
              manager_.num_blocks());
    EXPECT_TRUE(manager_.CheckInvariantsForTest().ok())
        << manager_.CheckInvariantsForTest();
  }

  // Allocates blocks for `tokens` and publishes every full one, as a sequence
  // would after prefill. Returns the blocks (still referenced).
  std::vector<BlockId> AllocateAndPublish(const std::vector<int32_t>& tokens) {
    int n = static_cast<int>(tokens.size()) / kBlockSize;
    auto blocks = manager_.Allocate(n);
    EXPECT_TRUE(blocks.ok()) << blocks.status();
    for (int k = 0; k < n; ++k) {
      EXPECT_TRUE(manager_
                      .CommitFullBlock((*blocks)[k],
                                       k == 0 ? kNoBlock : (*blocks)[k - 1],
                                       BlockTokens(tokens, k))
                      .ok());
    }
    return *blocks;
  }

  KvBlockManager manager_{8, kBlockSize};
};

TEST(ChainHashTest, DeterministicAndChained) {
  auto a = Tokens(8);
  auto hashes = FullBlockHashes(a, kBlockSize);
  ASSERT_THAT(hashes, SizeIs(2));
  EXPECT_EQ(hashes[0], ChainHash(kRootHash, std::span(a).first(4)));
  EXPECT_EQ(hashes[1], ChainHash(hashes[0], std::span(a).subspan(4, 4)));
  // Same block tokens after a different prefix hash differently.
  auto b = a;
  b[0] = 7;
  EXPECT_NE(FullBlockHashes(b, kBlockSize)[1], hashes[1]);
  // A partial tail is not hashed.
  EXPECT_THAT(FullBlockHashes(Tokens(11), kBlockSize), SizeIs(2));
  // Pinned values: the hash must be stable across builds and processes (the
  // router computes it too). Change them only with a deliberate format change.
  std::vector<int32_t> t = {100, 101, 102, 103};
  EXPECT_EQ(ChainHash(kRootHash, t), 7284217214540650272ULL);
  EXPECT_EQ(ChainHash(kRootHash, std::span(t).first(3)),
            16095136932710751594ULL);
}

TEST(KvBlockManagerCreateTest, RejectsBadSizes) {
  EXPECT_EQ(KvBlockManager::Create(0, 4).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(KvBlockManager::Create(4, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(KvBlockManager::Create(4, 16).ok());
}

TEST_F(KvBlockManagerTest, AllocateFreeRefcount) {
  auto blocks = manager_.Allocate(3);
  ASSERT_TRUE(blocks.ok());
  ASSERT_THAT(*blocks, SizeIs(3));
  EXPECT_EQ(std::set<BlockId>(blocks->begin(), blocks->end()).size(), 3u);
  EXPECT_EQ(manager_.used_blocks(), 3);
  EXPECT_EQ(manager_.free_blocks(), 5);
  for (BlockId b : *blocks) EXPECT_EQ(manager_.ref_count(b), 1);

  ASSERT_TRUE(manager_.AddRef(std::span(*blocks).first(1)).ok());
  EXPECT_EQ(manager_.ref_count((*blocks)[0]), 2);
  ASSERT_TRUE(manager_.Free(*blocks).ok());
  EXPECT_EQ(manager_.ref_count((*blocks)[0]), 1);
  EXPECT_EQ(manager_.used_blocks(), 1);
  ASSERT_TRUE(manager_.Free((*blocks)[0]).ok());
  EXPECT_EQ(manager_.used_blocks(), 0);

  auto none = manager_.Allocate(0);
  ASSERT_TRUE(none.ok());
  EXPECT_THAT(*none, IsEmpty());
  EXPECT_EQ(manager_.Allocate(-1).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(KvBlockManagerTest, ExhaustionIsAllOrNothing) {
  auto held = manager_.Allocate(6);
  ASSERT_TRUE(held.ok());
  auto too_many = manager_.Allocate(3);
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(too_many.status().message(), HasSubstr("need 3 blocks, 2 free"));
  EXPECT_EQ(manager_.used_blocks(), 6);
  EXPECT_EQ(manager_.free_blocks(), 2);
  auto rest = manager_.Allocate(2);
  ASSERT_TRUE(rest.ok());
  EXPECT_EQ(manager_.Allocate(1).status().code(),
            absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(manager_.Free(*held).ok());
  ASSERT_TRUE(manager_.Free(*rest).ok());
}

TEST_F(KvBlockManagerTest, DoubleFreeAndUnknownIdsAreErrors) {
  auto blocks = manager_.Allocate(2);
  ASSERT_TRUE(blocks.ok());
  BlockId a = (*blocks)[0], b = (*blocks)[1];
  ASSERT_TRUE(manager_.Free(a).ok());
  EXPECT_EQ(manager_.Free(a).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(manager_.Free(-1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(manager_.Free(8).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(manager_.AddRef(std::vector<BlockId>{a}).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(manager_.AddRef(std::vector<BlockId>{99}).code(),
            absl::StatusCode::kInvalidArgument);
  // A batch naming b twice while b holds one reference fails as a whole.
  EXPECT_EQ(manager_.Free(std::vector<BlockId>{b, b}).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(manager_.ref_count(b), 1);
  // A bad id at the end of a batch leaves the valid ones untouched.
  EXPECT_EQ(manager_.Free(std::vector<BlockId>{b, 1234}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(manager_.ref_count(b), 1);
  EXPECT_TRUE(manager_.CheckInvariantsForTest().ok());
  ASSERT_TRUE(manager_.Free(b).ok());
  EXPECT_EQ(manager_.ref_count(12345), 0);
}

TEST_F(KvBlockManagerTest, CommitRejectsMisuse) {
  auto blocks = manager_.Allocate(2);
  ASSERT_TRUE(blocks.ok());
  auto t = Tokens(8);
  // Partial blocks are never cached.
  EXPECT_EQ(
      manager_.CommitFullBlock((*blocks)[0], kNoBlock, std::span(t).first(3))
          .code(),
      absl::StatusCode::kInvalidArgument);
  // The parent must be committed first.
  EXPECT_EQ(
      manager_.CommitFullBlock((*blocks)[1], (*blocks)[0], BlockTokens(t, 1))
          .code(),
      absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(
      manager_.CommitFullBlock((*blocks)[0], kNoBlock, BlockTokens(t, 0)).ok());
  // Same content again: no-op. Other content: error.
  EXPECT_TRUE(
      manager_.CommitFullBlock((*blocks)[0], kNoBlock, BlockTokens(t, 0)).ok());
  EXPECT_EQ(manager_.CommitFullBlock((*blocks)[0], kNoBlock, BlockTokens(t, 1))
                .code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(manager_.CommitFullBlock(77, kNoBlock, BlockTokens(t, 0)).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(manager_.Free(*blocks).ok());
  // Unreferenced blocks cannot be committed.
  EXPECT_EQ(manager_.CommitFullBlock((*blocks)[1], kNoBlock, BlockTokens(t, 1))
                .code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(KvBlockManagerTest, PrefixReuseAcrossSequences) {
  auto prompt = Tokens(12);
  std::vector<BlockId> first = AllocateAndPublish(prompt);
  EXPECT_EQ(manager_.stats().published_blocks, 3);

  // A second request sharing the first 8 tokens, then diverging.
  auto other = prompt;
  other[9] = 5;
  std::vector<BlockId> hit = manager_.MatchPrefix(other);
  EXPECT_THAT(hit, ElementsAre(first[0], first[1]));
  EXPECT_EQ(manager_.ref_count(first[0]), 2);
  EXPECT_EQ(manager_.ref_count(first[2]), 1);

  KvBlockManagerStats s = manager_.stats();
  EXPECT_EQ(s.prefix_queries, 1);
  EXPECT_EQ(s.prefix_query_blocks, 3);
  EXPECT_EQ(s.prefix_hit_blocks, 2);

  // The first request finishes: its blocks stay cached, the shared ones used.
  ASSERT_TRUE(manager_.Free(first).ok());
  EXPECT_EQ(manager_.used_blocks(), 2);
  EXPECT_EQ(manager_.cached_blocks(), 1);
  ASSERT_TRUE(manager_.Free(hit).ok());
  EXPECT_EQ(manager_.cached_blocks(), 3);

  // A third request finds the whole prompt, from the evictable list.
  std::vector<BlockId> again = manager_.MatchPrefix(prompt);
  EXPECT_EQ(again, first);
  EXPECT_EQ(manager_.cached_blocks(), 0);
  EXPECT_EQ(manager_.used_blocks(), 3);
  ASSERT_TRUE(manager_.Free(again).ok());

  // A prompt differing in its first block matches nothing.
  auto unrelated = prompt;
  unrelated[0] = -3;
  EXPECT_THAT(manager_.MatchPrefix(unrelated), IsEmpty());
  // Nor does a prefix shorter than one block.
  EXPECT_THAT(manager_.MatchPrefix(std::span(prompt).first(3)), IsEmpty());
}

TEST_F(KvBlockManagerTest, LruEvictionOrder) {
  // Three one-block prompts, released in order a, b, c: a is least recent.
  auto ta = Tokens(4, 0), tb = Tokens(4, 10), tc = Tokens(4, 20);
  BlockId a = AllocateAndPublish(ta)[0];
  BlockId b = AllocateAndPublish(tb)[0];
  BlockId c = AllocateAndPublish(tc)[0];
  ASSERT_TRUE(manager_.Free(a).ok());
  ASSERT_TRUE(manager_.Free(b).ok());
  ASSERT_TRUE(manager_.Free(c).ok());
  // Touching a makes it most recent: order is now b, c, a.
  ASSERT_THAT(manager_.MatchPrefix(ta), ElementsAre(a));
  ASSERT_TRUE(manager_.Free(a).ok());
  EXPECT_EQ(manager_.cached_blocks(), 3);

  // Free blocks go first: 5 allocations evict nothing.
  auto fresh = manager_.Allocate(5);
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ(manager_.stats().evictions, 0);
  // The next one evicts b, then c.
  auto one = manager_.Allocate(1);
  ASSERT_TRUE(one.ok());
  EXPECT_THAT(*one, ElementsAre(b));
  EXPECT_EQ(manager_.stats().evictions, 1);
  auto two = manager_.Allocate(1);
  ASSERT_TRUE(two.ok());
  EXPECT_THAT(*two, ElementsAre(c));

  // Evicted prefixes no longer match; the survivor does.
  EXPECT_THAT(manager_.MatchPrefix(tb), IsEmpty());
  EXPECT_THAT(manager_.MatchPrefix(tc), IsEmpty());
  auto still = manager_.MatchPrefix(ta);
  EXPECT_THAT(still, ElementsAre(a));
  EXPECT_EQ(manager_.stats().published_blocks, 1);

  ASSERT_TRUE(manager_.Free(*fresh).ok());
  ASSERT_TRUE(manager_.Free(*one).ok());
  ASSERT_TRUE(manager_.Free(*two).ok());
  ASSERT_TRUE(manager_.Free(still).ok());
}

TEST_F(KvBlockManagerTest, EvictedParentBreaksTheChain) {
  // Evicting a chain's head makes its (still cached) tail unreachable, and a
  // reused head id with new content must not resurrect the old tail.
  auto prompt = Tokens(8);
  std::vector<BlockId> blocks = AllocateAndPublish(prompt);
  // Release head first so it is the least recently used.
  ASSERT_TRUE(manager_.Free(blocks[0]).ok());
  ASSERT_TRUE(manager_.Free(blocks[1]).ok());
  auto fill = manager_.Allocate(7);  // 6 free + evicts the head
  ASSERT_TRUE(fill.ok());
  EXPECT_EQ(manager_.stats().evictions, 1);
  EXPECT_THAT(manager_.MatchPrefix(prompt), IsEmpty());
  ASSERT_TRUE(manager_.Free(*fill).ok());
}

TEST_F(KvBlockManagerTest, HashCollisionNeverFalselyMatches) {
  // Every block hashes alike: only token comparison tells them apart.
  manager_.SetHashFunctionForTest(
      [](uint64_t, std::span<const int32_t>) { return uint64_t{42}; });
  auto ta = Tokens(4, 0), tb = Tokens(4, 50);
  std::vector<BlockId> a = AllocateAndPublish(ta);
  EXPECT_THAT(manager_.MatchPrefix(tb), IsEmpty());
  // The colliding block commits fine but is not published.
  std::vector<BlockId> b = AllocateAndPublish(tb);
  EXPECT_EQ(manager_.stats().published_blocks, 1);
  EXPECT_THAT(manager_.MatchPrefix(tb), IsEmpty());
  auto hit = manager_.MatchPrefix(ta);
  EXPECT_THAT(hit, ElementsAre(a[0]));
  ASSERT_TRUE(manager_.Free(hit).ok());
  ASSERT_TRUE(manager_.Free(a).ok());
  ASSERT_TRUE(manager_.Free(b).ok());
  // The unpublished block went straight back to the free list.
  EXPECT_EQ(manager_.cached_blocks(), 1);
}

TEST_F(KvBlockManagerTest, ChainCollisionComparesTheWholePrefix) {
  // Same second block after different first blocks, with every hash equal:
  // the second block's tokens match but its prefix does not.
  manager_.SetHashFunctionForTest(
      [](uint64_t, std::span<const int32_t>) { return uint64_t{7}; });
  auto x = Tokens(8, 0);
  std::vector<BlockId> a = AllocateAndPublish(x);
  auto y = x;
  y[0] = 999;  // differs only in block 0
  EXPECT_THAT(manager_.MatchPrefix(y), IsEmpty());
  ASSERT_TRUE(manager_.Free(a).ok());
}

TEST_F(KvBlockManagerTest, DuplicateCommitSharesIdentity) {
  // Two requests prefill the same prompt concurrently; both commit. The second
  // copy is not published but its successor chains onto the cached prefix.
  auto prompt = Tokens(8);
  std::vector<BlockId> first = AllocateAndPublish(
      std::vector<int32_t>(prompt.begin(), prompt.begin() + 4));
  auto second = manager_.Allocate(2);
  ASSERT_TRUE(second.ok());
  ASSERT_TRUE(
      manager_.CommitFullBlock((*second)[0], kNoBlock, BlockTokens(prompt, 0))
          .ok());
  ASSERT_TRUE(
      manager_
          .CommitFullBlock((*second)[1], (*second)[0], BlockTokens(prompt, 1))
          .ok());
  EXPECT_EQ(manager_.stats().published_blocks, 2);
  auto hit = manager_.MatchPrefix(prompt);
  EXPECT_THAT(hit, ElementsAre(first[0], (*second)[1]));
  ASSERT_TRUE(manager_.Free(hit).ok());
  ASSERT_TRUE(manager_.Free(first).ok());
  ASSERT_TRUE(manager_.Free(*second).ok());
}

TEST_F(KvBlockManagerTest, ConcurrentUseIsSafe) {
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([this, t] {
      std::mt19937 rng(t);
      auto prompt = Tokens(8, t % 2);
      for (int i = 0; i < 2000; ++i) {
        std::vector<BlockId> hit = manager_.MatchPrefix(prompt);
        auto more = manager_.Allocate(static_cast<int64_t>(rng() % 2));
        if (more.ok()) {
          hit.insert(hit.end(), more->begin(), more->end());
        }
        for (size_t k = 0; k < hit.size() && k < 2; ++k) {
          (void)manager_.CommitFullBlock(hit[k], k == 0 ? kNoBlock : hit[k - 1],
                                         BlockTokens(prompt, k));
        }
        EXPECT_TRUE(manager_.Free(hit).ok());
      }
    });
  }
  for (auto& th : threads) th.join();
}

// Randomized operations against a plain reference model of reference counts
// and block contents. With `weak_hash` most hashes collide, so correctness
// rests entirely on the token and chain comparison.
void RunStress(bool weak_hash, uint64_t seed) {
  constexpr int kBlocks = 32;
  KvBlockManager manager(kBlocks, kBlockSize);
  if (weak_hash) {
    manager.SetHashFunctionForTest(
        [](uint64_t parent, std::span<const int32_t> tokens) {
          uint64_t sum = parent;
          for (int32_t t : tokens) sum += static_cast<uint64_t>(t);
          return sum % 4;
        });
  }
  std::mt19937_64 rng(seed);
  // A small token alphabet and few prompts so prefixes repeat and collide.
  std::vector<std::vector<int32_t>> prompts;
  for (int p = 0; p < 16; ++p) {
    std::vector<int32_t> t(kBlockSize * (1 + rng() % 5));
    for (auto& x : t) x = static_cast<int32_t>(rng() % 3);
    prompts.push_back(t);
  }
  struct Holder {
    std::vector<BlockId> blocks;
    const std::vector<int32_t>* prompt;
  };
  std::vector<Holder> holders;
  int exhausted = 0;
  std::map<BlockId, int> refs;  // reference model
  // The exact token prefix each committed block's KV represents.
  std::map<BlockId, std::vector<int32_t>> content;
  auto add_refs = [&](const std::vector<BlockId>& bs) {
    for (BlockId b : bs) ++refs[b];
  };
  for (int step = 0; step < 20000; ++step) {
    int op = static_cast<int>(rng() % 10);
    if (op < 4) {
      const auto& prompt = prompts[rng() % prompts.size()];
      Holder h{manager.MatchPrefix(prompt), &prompt};
      add_refs(h.blocks);
      for (size_t k = 0; k < h.blocks.size(); ++k) {
        // A hit must hold exactly this prompt's prefix, never a lookalike.
        ASSERT_EQ(content[h.blocks[k]],
                  std::vector<int32_t>(prompt.begin(),
                                       prompt.begin() + (k + 1) * kBlockSize))
            << "step " << step;
      }
      int64_t want = static_cast<int64_t>(prompt.size()) / kBlockSize -
                     static_cast<int64_t>(h.blocks.size());
      int64_t available = kBlocks - static_cast<int64_t>(refs.size());
      auto more = manager.Allocate(want);
      ASSERT_EQ(more.ok(), want <= available) << more.status();
      if (!more.ok()) {
        ASSERT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted);
        ++exhausted;
      }
      if (more.ok()) {
        for (BlockId b : *more) {
          ASSERT_EQ(refs.count(b), 0u) << b;
          content.erase(b);
        }
        add_refs(*more);
        size_t matched = h.blocks.size();
        h.blocks.insert(h.blocks.end(), more->begin(), more->end());
        // Publish some of the new blocks, as if prefill finished them.
        size_t publish = matched + rng() % (more->size() + 1);
        for (size_t k = matched; k < publish; ++k) {
          ASSERT_TRUE(manager
                          .CommitFullBlock(h.blocks[k],
                                           k == 0 ? kNoBlock : h.blocks[k - 1],
                                           BlockTokens(prompt, k))
                          .ok());
          content[h.blocks[k]] = std::vector<int32_t>(
              prompt.begin(), prompt.begin() + (k + 1) * kBlockSize);
        }
      }
      holders.push_back(std::move(h));
    } else if (op < 8 && !holders.empty()) {
      size_t i = rng() % holders.size();
      ASSERT_TRUE(manager.Free(holders[i].blocks).ok());
      for (BlockId b : holders[i].blocks) {
        if (--refs[b] == 0) refs.erase(b);
      }
      holders.erase(holders.begin() + i);
    } else if (op == 8 && !holders.empty()) {
      // Share a holder's blocks (like a forked sequence).
      size_t i = rng() % holders.size();
      Holder copy = holders[i];
      ASSERT_TRUE(manager.AddRef(copy.blocks).ok());
      add_refs(copy.blocks);
      holders.push_back(std::move(copy));
    } else {
      // Bad frees never change anything.
      BlockId b = static_cast<BlockId>(rng() % (kBlocks + 4)) - 2;
      if (refs.count(b) == 0) {
        ASSERT_FALSE(manager.Free(b).ok());
      }
    }
    KvBlockManagerStats s = manager.stats();
    ASSERT_EQ(s.used_blocks + s.free_blocks + s.cached_blocks, kBlocks);
    ASSERT_EQ(s.used_blocks, static_cast<int64_t>(refs.size()));
    for (const auto& [b, r] : refs) ASSERT_EQ(manager.ref_count(b), r);
    if (step % 97 == 0) {
      ASSERT_TRUE(manager.CheckInvariantsForTest().ok())
          << manager.CheckInvariantsForTest();
    }
  }
  for (auto& h : holders) ASSERT_TRUE(manager.Free(h.blocks).ok());
  EXPECT_EQ(manager.used_blocks(), 0);
  EXPECT_TRUE(manager.CheckInvariantsForTest().ok());
  KvBlockManagerStats s = manager.stats();
  EXPECT_GT(s.prefix_hit_blocks, 0);
  EXPECT_GT(s.evictions, 0);
  EXPECT_GT(exhausted, 0);
}

TEST(KvBlockManagerStressTest, MatchesReferenceModel) {
  RunStress(/*weak_hash=*/false, 20240611);
}

TEST(KvBlockManagerStressTest, MatchesReferenceModelUnderHashCollisions) {
  RunStress(/*weak_hash=*/true, 7);
}

}  // namespace
}  // namespace pdserve::kv
