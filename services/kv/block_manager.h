// Which KV block belongs to whom, and which blocks hold reusable prompt
// prefixes. KvPool owns the memory; KvBlockManager only hands out block ids
// (indices into that pool) and never touches KV data.
//
// Block states:
//   free      unreferenced, no cached content; Allocate takes these first.
//   used      ref_count >= 1 (Allocate, AddRef and MatchPrefix add one each).
//   evictable unreferenced but published in the prefix cache: MatchPrefix
//             revives it; Allocate reclaims it, least recently used first,
//             once no free block is left (dropping its cache entry).
// Free to ref_count 0 makes a published block evictable, any other free.
//
// Prefix cache: a FULL block whose KV is complete can be published under the
// chained hash hash_k = ChainHash(hash_{k-1}, tokens of block k), with
// hash_{-1} = kRootHash. The hash is deterministic across processes and
// builds, so a router can compute the same chain to route by prefix. The hash
// only narrows the search: every cache entry also stores its block's tokens and
// the identity of the entry it extends, and a lookup compares both, so a hash
// collision can never make a request reuse another prefix's KV.
//
// Published blocks are immutable: nobody may write their KV slots again while
// they stay cached. Only tokens the model has accepted may be published, never
// speculative ones (KvSequence enforces the block-granular part of this).
//
// Thread-safety: every method is internally synchronized by one absl::Mutex,
// so the manager may be shared by the scheduler, transport callbacks and
// metrics readers. Each operation costs O(blocks named or requested), never a
// scan of the pool.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kv/kv_layout.h"

namespace pdserve::kv {

// Index of a block in its KvPool.
using BlockId = int64_t;
inline constexpr BlockId kNoBlock = -1;

// Parent hash of the first block of every sequence.
inline constexpr uint64_t kRootHash = 0x6a09e667f3bcc908ULL;

// hash_k = ChainHash(hash_{k-1}, tokens of block k). Stable across processes.
uint64_t ChainHash(uint64_t parent_hash, std::span<const int32_t> tokens);

// Chain hashes of every full block of `tokens` (partial tail ignored).
std::vector<uint64_t> FullBlockHashes(std::span<const int32_t> tokens,
                                      int block_size);

// One consistent snapshot of the manager's counters (for metrics).
struct KvBlockManagerStats {
  int64_t total_blocks = 0;
  int64_t used_blocks = 0;    // referenced by at least one owner
  int64_t free_blocks = 0;    // unreferenced, not in the prefix cache
  int64_t cached_blocks = 0;  // unreferenced, in the prefix cache (evictable)
  int64_t published_blocks = 0;  // in the prefix cache, referenced or not
  int64_t prefix_queries = 0;
  int64_t prefix_query_blocks = 0;  // full blocks asked for by MatchPrefix
  int64_t prefix_hit_blocks = 0;    // of those, served from the cache
  int64_t evictions = 0;            // cached blocks reclaimed by Allocate
};

class KvBlockManager {
 public:
  using HashFn = std::function<uint64_t(uint64_t, std::span<const int32_t>)>;

  // Precondition: num_blocks > 0, block_size > 0 (Create() checks them and
  // returns a status instead).
  KvBlockManager(int64_t num_blocks, int block_size);

  [[nodiscard]] static absl::StatusOr<std::unique_ptr<KvBlockManager>> Create(
      int64_t num_blocks, int block_size);
  // As many blocks as `budget_bytes` of `layout` hold (budget /
  // layout.block_bytes()); the same count KvPool::BlocksForBudget gives, so a
  // pool and its manager created from one budget agree.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<KvBlockManager>>
  CreateForBudget(int64_t budget_bytes, const KvCacheLayout& layout);

  KvBlockManager(const KvBlockManager&) = delete;
  KvBlockManager& operator=(const KvBlockManager&) = delete;

  int64_t num_blocks() const { return num_blocks_; }
  int block_size() const { return block_size_; }

  // n blocks, each with ref_count 1, owned by the caller. Takes free blocks
  // first, then evicts unreferenced cached blocks least recently used first.
  // All-or-nothing: RESOURCE_EXHAUSTED (with the counts) and no change when
  // fewer than n blocks are free or evictable.
  [[nodiscard]] absl::StatusOr<std::vector<BlockId>> Allocate(int64_t n);

  // One more reference to each block; every block must be referenced already.
  // Validated as a whole: on error nothing changes.
  [[nodiscard]] absl::Status AddRef(std::span<const BlockId> blocks);
  // Drops one reference to each block. At zero a cached block becomes
  // evictable (most recently used end), an uncached one free. Validated as a
  // whole: unknown ids are INVALID_ARGUMENT, freeing more references than held
  // (double free) is FAILED_PRECONDITION, and on error nothing changes.
  [[nodiscard]] absl::Status Free(std::span<const BlockId> blocks);
  [[nodiscard]] absl::Status Free(BlockId block) {
    return Free(std::span<const BlockId>(&block, 1));
  }

  // The cached blocks holding the longest prefix of `tokens` made of full
  // blocks (a partial tail never matches). Each returned block carries a new
  // reference the caller owns and must Free.
  std::vector<BlockId> MatchPrefix(std::span<const int32_t> tokens);

  // Publishes `block` (held by the caller, KV complete for exactly
  // block_size() `tokens`) as the block after `parent` (kNoBlock for a
  // sequence's first block; otherwise a block the caller holds and has
  // committed before). If the same prefix is cached already, or its hash
  // collides with a different cached block, `block` is not published but still
  // records its identity so its successors can be committed; this is not an
  // error. Committing a block again with the same content is a no-op.
  [[nodiscard]] absl::Status CommitFullBlock(BlockId block, BlockId parent,
                                             std::span<const int32_t> tokens);

  int64_t used_blocks() const;
  int64_t free_blocks() const;
  int64_t cached_blocks() const;
  // What Allocate can hand out right now: free + cached.
  int64_t available_blocks() const;
  int64_t ref_count(BlockId block) const;  // 0 for unknown ids
  KvBlockManagerStats stats() const;

  // Test-only: replaces ChainHash (e.g. with a constant to force collisions).
  // Call before any block is committed.
  void SetHashFunctionForTest(HashFn fn);
  // Test-only: checks every internal invariant with a full scan (counts agree
  // with states, lists are well-formed, the cache map points at published
  // blocks). Returns INTERNAL describing the first violation.
  [[nodiscard]] absl::Status CheckInvariantsForTest() const;

 private:
  enum class State : uint8_t { kFree, kUsed, kEvictable };

  struct Block {
    int32_t ref_count = 0;
    State state = State::kFree;
    // Set by CommitFullBlock: the block's content is identified.
    bool committed = false;
    // Owns the hash_to_block_ entry for `hash`.
    bool published = false;
    uint64_t hash = 0;
    // Identity of the exact prefix this block completes: unique per distinct
    // content ever committed, shared by duplicates of a published block, never
    // reused. Successors store it as parent_identity, so a chain matches only
    // through the very entries it was committed on, even if an ancestor's
    // block id has since been evicted and reused.
    uint64_t identity = 0;
    uint64_t parent_identity = 0;
    std::vector<int32_t> tokens;
    // Intrusive LRU links, valid while state == kEvictable.
    BlockId lru_prev = kNoBlock;
    BlockId lru_next = kNoBlock;
  };

  absl::Status ValidateId(BlockId block) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  BlockId TakeOneLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ForgetContentLocked(Block& b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void LruPushBackLocked(BlockId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void LruRemoveLocked(BlockId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The published block extending `parent_identity` with `tokens`, or kNoBlock.
  BlockId LookupLocked(uint64_t hash, uint64_t parent_identity,
                       std::span<const int32_t> tokens) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  uint64_t HashLocked(uint64_t parent_hash,
                      std::span<const int32_t> tokens) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const int64_t num_blocks_;
  const int block_size_;

  mutable absl::Mutex mu_;
  std::vector<Block> blocks_ ABSL_GUARDED_BY(mu_);
  // Unreferenced uncached blocks; a stack so recently freed (cache-warm) ids
  // are reused first.
  std::vector<BlockId> free_list_ ABSL_GUARDED_BY(mu_);
  // Evictable blocks, least recently used at the head.
  BlockId lru_head_ ABSL_GUARDED_BY(mu_) = kNoBlock;
  BlockId lru_tail_ ABSL_GUARDED_BY(mu_) = kNoBlock;
  int64_t lru_size_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t used_blocks_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<uint64_t, BlockId> hash_to_block_ ABSL_GUARDED_BY(mu_);
  uint64_t next_identity_ ABSL_GUARDED_BY(mu_) = 1;  // 0 is the root
  HashFn hash_fn_ ABSL_GUARDED_BY(mu_);

  int64_t prefix_queries_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t prefix_query_blocks_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t prefix_hit_blocks_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t evictions_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pdserve::kv
