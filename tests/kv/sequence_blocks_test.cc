#include "kv/sequence_blocks.h"

#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kv/block_manager.h"

namespace pdserve::kv {
namespace {

using ::testing::ElementsAreArray;
using ::testing::IsEmpty;

constexpr int kBlockSize = 4;

std::vector<int32_t> Tokens(int n, int32_t base = 100) {
  std::vector<int32_t> t(n);
  std::iota(t.begin(), t.end(), base);
  return t;
}

class KvSequenceTest : public ::testing::Test {
 protected:
  void TearDown() override {
    EXPECT_EQ(manager_.used_blocks(), 0) << "a test leaked KV blocks";
    EXPECT_TRUE(manager_.CheckInvariantsForTest().ok())
        << manager_.CheckInvariantsForTest();
  }

  KvBlockManager manager_{16, kBlockSize};
};

TEST_F(KvSequenceTest, ReserveCoversTokens) {
  KvSequence seq(&manager_);
  EXPECT_EQ(seq.num_blocks(), 0);
  ASSERT_TRUE(seq.Reserve(1).ok());
  EXPECT_EQ(seq.num_blocks(), 1);
  ASSERT_TRUE(seq.Reserve(4).ok());
  EXPECT_EQ(seq.num_blocks(), 1);
  ASSERT_TRUE(seq.Reserve(9).ok());
  EXPECT_EQ(seq.num_blocks(), 3);
  EXPECT_EQ(seq.num_tokens(), 9);
  EXPECT_EQ(seq.capacity_tokens(), 12);
  // Reserving less never shrinks.
  ASSERT_TRUE(seq.Reserve(2).ok());
  EXPECT_EQ(seq.num_tokens(), 9);
  EXPECT_EQ(seq.Reserve(-1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(manager_.used_blocks(), 3);
}

TEST_F(KvSequenceTest, ExhaustionChangesNothing) {
  KvSequence a(&manager_);
  ASSERT_TRUE(a.Reserve(13 * kBlockSize).ok());
  KvSequence b(&manager_);
  ASSERT_TRUE(b.Reserve(2).ok());
  auto table =
      std::vector<BlockId>(b.block_table().begin(), b.block_table().end());
  EXPECT_EQ(b.Reserve(4 * kBlockSize).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(b.num_tokens(), 2);
  EXPECT_THAT(b.block_table(), ElementsAreArray(table));
  EXPECT_EQ(manager_.used_blocks(), 14);
}

TEST_F(KvSequenceTest, ReleaseAndDestructorFreeEverything) {
  {
    KvSequence seq(&manager_);
    ASSERT_TRUE(seq.Reserve(10).ok());
    KvSequence moved = std::move(seq);
    EXPECT_EQ(moved.num_blocks(), 3);
    EXPECT_EQ(seq.num_blocks(), 0);  // NOLINT(bugprone-use-after-move)
    EXPECT_EQ(manager_.used_blocks(), 3);
    KvSequence other(&manager_);
    ASSERT_TRUE(other.Reserve(5).ok());
    other = std::move(moved);  // frees other's own blocks
    EXPECT_EQ(manager_.used_blocks(), 3);
  }
  EXPECT_EQ(manager_.used_blocks(), 0);
  KvSequence seq(&manager_);
  ASSERT_TRUE(seq.Reserve(3).ok());
  seq.Release();
  seq.Release();
  EXPECT_EQ(seq.num_tokens(), 0);
  EXPECT_EQ(manager_.used_blocks(), 0);
}

TEST_F(KvSequenceTest, TruncateRollsBackDraftTokens) {
  KvSequence seq(&manager_);
  ASSERT_TRUE(seq.Reserve(6).ok());  // 6 accepted tokens
  // Verify step: reserve 4 draft + 1 bonus position.
  ASSERT_TRUE(seq.Reserve(11).ok());
  EXPECT_EQ(seq.num_blocks(), 3);
  BlockId first = seq.block_table()[0];
  BlockId second = seq.block_table()[1];
  // One draft accepted: 6 + 1 + 1 bonus = 8 tokens, exactly two blocks.
  ASSERT_TRUE(seq.Truncate(8).ok());
  EXPECT_EQ(seq.num_tokens(), 8);
  EXPECT_EQ(seq.num_blocks(), 2);
  EXPECT_EQ(seq.block_table()[0], first);
  EXPECT_EQ(seq.block_table()[1], second);
  EXPECT_EQ(manager_.used_blocks(), 2);
  ASSERT_TRUE(seq.Truncate(5).ok());
  EXPECT_EQ(seq.num_blocks(), 2);
  EXPECT_EQ(seq.Truncate(6).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(seq.Truncate(-1).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(seq.Truncate(0).ok());
  EXPECT_EQ(seq.num_blocks(), 0);
  EXPECT_EQ(manager_.used_blocks(), 0);
}

TEST_F(KvSequenceTest, PrefixReuseBetweenSequencesSharingAPrompt) {
  auto system_prompt = Tokens(8);  // two full blocks shared
  auto prompt_a = system_prompt;
  prompt_a.insert(prompt_a.end(), {1, 2, 3});
  auto prompt_b = system_prompt;
  prompt_b.insert(prompt_b.end(), {7, 8, 9, 10, 11});

  auto start_a = KvSequence::StartWithPrefix(&manager_, prompt_a);
  EXPECT_EQ(start_a.cached_tokens, 0);
  KvSequence a = std::move(start_a.sequence);
  ASSERT_TRUE(a.Reserve(static_cast<int64_t>(prompt_a.size())).ok());
  // Prefill done: publish the prompt's full blocks.
  ASSERT_TRUE(a.PublishFullBlocks(prompt_a).ok());
  EXPECT_EQ(a.num_immutable_blocks(), 2);
  EXPECT_EQ(manager_.stats().published_blocks, 2);

  auto start_b = KvSequence::StartWithPrefix(&manager_, prompt_b);
  EXPECT_EQ(start_b.cached_tokens, 8);
  KvSequence& b = start_b.sequence;
  EXPECT_EQ(b.num_tokens(), 8);
  EXPECT_EQ(b.block_table()[0], a.block_table()[0]);
  EXPECT_EQ(b.block_table()[1], a.block_table()[1]);
  ASSERT_TRUE(b.Reserve(static_cast<int64_t>(prompt_b.size())).ok());
  EXPECT_EQ(b.num_blocks(), 4);
  EXPECT_NE(b.block_table()[2], a.block_table()[2]);
  // Two shared + a's tail + b's two own blocks.
  EXPECT_EQ(manager_.used_blocks(), 5);

  a.Release();
  EXPECT_EQ(manager_.used_blocks(), 4);
  b.Release();
  EXPECT_EQ(manager_.cached_blocks(), 2);
  KvBlockManagerStats s = manager_.stats();
  EXPECT_EQ(s.prefix_hit_blocks, 2);
}

TEST_F(KvSequenceTest, FullyCachedPromptRecomputesItsLastToken) {
  auto prompt = Tokens(8);
  {
    KvSequence seq(&manager_);
    ASSERT_TRUE(seq.Reserve(8).ok());
    ASSERT_TRUE(seq.PublishFullBlocks(prompt).ok());
  }
  EXPECT_EQ(manager_.cached_blocks(), 2);
  // Both blocks are cached, but only the first is reused: the last prompt
  // token must run through the model to produce logits.
  auto start = KvSequence::StartWithPrefix(&manager_, prompt);
  EXPECT_EQ(start.cached_tokens, 4);
  EXPECT_EQ(start.sequence.num_blocks(), 1);
  // One more token makes both blocks reusable.
  auto longer = prompt;
  longer.push_back(5);
  auto start2 = KvSequence::StartWithPrefix(&manager_, longer);
  EXPECT_EQ(start2.cached_tokens, 8);
  // Empty and one-token prompts reuse nothing.
  EXPECT_EQ(KvSequence::StartWithPrefix(&manager_, {}).cached_tokens, 0);
  EXPECT_EQ(KvSequence::StartWithPrefix(&manager_, std::span(prompt).first(1))
                .cached_tokens,
            0);
}

TEST_F(KvSequenceTest, OnlyAcceptedTokensArePublished) {
  auto accepted = Tokens(6);
  KvSequence seq(&manager_);
  ASSERT_TRUE(seq.Reserve(6).ok());
  ASSERT_TRUE(seq.PublishFullBlocks(accepted).ok());
  EXPECT_EQ(seq.num_immutable_blocks(), 1);  // the partial block waits
  // Drafts fill block 1 past a block boundary, then get rejected.
  ASSERT_TRUE(seq.Reserve(10).ok());
  ASSERT_TRUE(seq.Truncate(7).ok());
  auto more = accepted;
  more.push_back(99);
  ASSERT_TRUE(seq.PublishFullBlocks(more).ok());
  EXPECT_EQ(seq.num_immutable_blocks(), 1);
  EXPECT_EQ(manager_.stats().published_blocks, 1);
  // Publishing more tokens than the sequence holds is an error.
  EXPECT_EQ(seq.PublishFullBlocks(Tokens(20)).code(),
            absl::StatusCode::kInvalidArgument);
  // Rolling back into the published block would rewrite shared KV.
  EXPECT_EQ(seq.Truncate(3).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(seq.num_tokens(), 7);
  // Dropping whole blocks is fine.
  ASSERT_TRUE(seq.Truncate(4).ok());
  EXPECT_EQ(seq.num_blocks(), 1);
  ASSERT_TRUE(seq.Truncate(0).ok());
  EXPECT_EQ(seq.num_immutable_blocks(), 0);
}

// A sliding window: published blocks wholly before the window go back (the
// last published one stays as the parent of the next), the table keeps
// valid ids, publishing continues the chain, rollback into them is refused
// and Release frees only what is still held.
TEST_F(KvSequenceTest, BlocksBeforeTheWindowGoBackOncePublished) {
  const auto tokens = Tokens(18);
  KvSequence seq(&manager_);
  ASSERT_TRUE(seq.Reserve(14).ok());  // blocks 0..3
  // Nothing published yet: nothing goes back.
  EXPECT_EQ(*seq.ReleaseBlocksBefore(12), 0);
  ASSERT_TRUE(seq.PublishFullBlocks(std::span(tokens).first(14)).ok());
  ASSERT_EQ(seq.num_immutable_blocks(), 3);
  const auto table =
      std::vector<BlockId>(seq.block_table().begin(), seq.block_table().end());
  // Keys from 9 on are visible: blocks 0 and 1 are wholly before, but block
  // 2 (the last published) must stay, so 0 and 1 go.
  EXPECT_EQ(*seq.ReleaseBlocksBefore(9), 2);
  EXPECT_EQ(seq.num_released_blocks(), 2);
  EXPECT_EQ(manager_.used_blocks(), 2);
  EXPECT_THAT(seq.block_table(),
              ElementsAreArray({table[2], table[2], table[2], table[3]}));
  EXPECT_EQ(*seq.ReleaseBlocksBefore(9), 0);  // idempotent
  // Growing and publishing go on: block 3 chains to block 2.
  ASSERT_TRUE(seq.Reserve(18).ok());
  ASSERT_TRUE(seq.PublishFullBlocks(tokens).ok());
  EXPECT_EQ(seq.num_immutable_blocks(), 4);
  EXPECT_EQ(*seq.ReleaseBlocksBefore(17), 1);  // block 2; block 3 stays
  EXPECT_EQ(manager_.used_blocks(), 2);
  // Rollback may drop held blocks, not given-back ones.
  EXPECT_EQ(seq.Truncate(4).code(), absl::StatusCode::kFailedPrecondition);
  seq.Release();
  EXPECT_EQ(manager_.used_blocks(), 0);
}

TEST_F(KvSequenceTest, PublishAfterPrefixMatchExtendsTheChain) {
  auto prompt = Tokens(16);
  {
    KvSequence seq(&manager_);
    ASSERT_TRUE(seq.Reserve(8).ok());
    ASSERT_TRUE(seq.PublishFullBlocks(std::span(prompt).first(8)).ok());
  }
  // A longer request reuses 2 blocks, computes 2 more and publishes them.
  auto start = KvSequence::StartWithPrefix(&manager_, prompt);
  ASSERT_EQ(start.cached_tokens, 8);
  KvSequence& seq = start.sequence;
  EXPECT_EQ(seq.num_immutable_blocks(), 2);
  ASSERT_TRUE(seq.Reserve(16).ok());
  ASSERT_TRUE(seq.PublishFullBlocks(prompt).ok());
  EXPECT_EQ(seq.num_immutable_blocks(), 4);
  seq.Release();
  auto longer = prompt;
  longer.push_back(1);
  auto again = KvSequence::StartWithPrefix(&manager_, longer);
  EXPECT_EQ(again.cached_tokens, 16);
}

TEST_F(KvSequenceTest, EvictedPrefixIsRecomputed) {
  auto prompt = Tokens(9);
  {
    KvSequence seq(&manager_);
    ASSERT_TRUE(seq.Reserve(9).ok());
    ASSERT_TRUE(seq.PublishFullBlocks(prompt).ok());
  }
  {
    // Someone needs the whole pool: the cached prefix is evicted.
    KvSequence hog(&manager_);
    ASSERT_TRUE(hog.Reserve(16 * kBlockSize).ok());
    EXPECT_EQ(manager_.stats().evictions, 2);
  }
  auto start = KvSequence::StartWithPrefix(&manager_, prompt);
  EXPECT_EQ(start.cached_tokens, 0);
  EXPECT_THAT(start.sequence.block_table(), IsEmpty());
}

}  // namespace
}  // namespace pdserve::kv
