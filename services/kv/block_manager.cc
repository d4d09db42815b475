#include "kv/block_manager.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"

namespace pdserve::kv {
namespace {

// wyhash's multiply-fold: a 64x64→128 multiply whose halves are xored, which
// mixes every input bit into every output bit in one step.
inline uint64_t MulFold(uint64_t a, uint64_t b) {
  __uint128_t r = static_cast<__uint128_t>(a) * b;
  return static_cast<uint64_t>(r) ^ static_cast<uint64_t>(r >> 64);
}

constexpr uint64_t kSecret0 = 0xa0761d6478bd642fULL;
constexpr uint64_t kSecret1 = 0xe7037ed1a0b428dbULL;
constexpr uint64_t kSecret2 = 0x8ebc6af09c88c6e3ULL;
constexpr uint64_t kSecret3 = 0x589965cc75374cc3ULL;

}  // namespace

// Deterministic by construction (no per-process seed, unlike absl::Hash), so
// the router and every worker agree on a prefix's hashes.
uint64_t ChainHash(uint64_t parent_hash, std::span<const int32_t> tokens) {
  uint64_t h = MulFold(parent_hash ^ kSecret0, tokens.size() ^ kSecret1);
  size_t i = 0;
  for (; i + 1 < tokens.size(); i += 2) {
    uint64_t word =
        static_cast<uint32_t>(tokens[i]) |
        (static_cast<uint64_t>(static_cast<uint32_t>(tokens[i + 1])) << 32);
    h = MulFold(h ^ kSecret2, word ^ kSecret3);
  }
  if (i < tokens.size()) {
    h = MulFold(
        h ^ kSecret2,
        static_cast<uint64_t>(static_cast<uint32_t>(tokens[i])) ^ kSecret0);
  }
  return MulFold(h ^ kSecret1, kSecret2 ^ parent_hash);
}

std::vector<uint64_t> FullBlockHashes(std::span<const int32_t> tokens,
                                      int block_size) {
  std::vector<uint64_t> hashes;
  if (block_size <= 0) return hashes;
  size_t full = tokens.size() / static_cast<size_t>(block_size);
  hashes.reserve(full);
  uint64_t parent = kRootHash;
  for (size_t k = 0; k < full; ++k) {
    parent = ChainHash(parent, tokens.subspan(k * block_size, block_size));
    hashes.push_back(parent);
  }
  return hashes;
}

KvBlockManager::KvBlockManager(int64_t num_blocks, int block_size)
    : num_blocks_(num_blocks), block_size_(block_size) {
  PDS_CHECK(num_blocks > 0 && block_size > 0)
      << "num_blocks=" << num_blocks << " block_size=" << block_size;
  absl::MutexLock lock(&mu_);
  blocks_.resize(static_cast<size_t>(num_blocks));
  free_list_.reserve(static_cast<size_t>(num_blocks));
  // Pushed in reverse so Allocate hands out 0, 1, 2, ... on a fresh pool,
  // which keeps early sequences' blocks adjacent in memory.
  for (BlockId id = num_blocks - 1; id >= 0; --id) free_list_.push_back(id);
  hash_fn_ = ChainHash;
}

absl::StatusOr<std::unique_ptr<KvBlockManager>> KvBlockManager::Create(
    int64_t num_blocks, int block_size) {
  if (num_blocks <= 0 || block_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV block manager needs num_blocks > 0 and block_size > 0,"
                     " got num_blocks=",
                     num_blocks, " block_size=", block_size));
  }
  return std::make_unique<KvBlockManager>(num_blocks, block_size);
}

absl::StatusOr<std::unique_ptr<KvBlockManager>> KvBlockManager::CreateForBudget(
    int64_t budget_bytes, const KvCacheLayout& layout) {
  PDS_RETURN_IF_ERROR(layout.Validate());
  int64_t per_block = layout.block_bytes();
  int64_t num_blocks = budget_bytes > 0 ? budget_bytes / per_block : 0;
  if (num_blocks <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV budget of ", budget_bytes, " bytes holds no block of ",
                     per_block, " bytes (", layout.DebugString(), ")"));
  }
  return Create(num_blocks, layout.block_size);
}

absl::Status KvBlockManager::ValidateId(BlockId block) const {
  if (block < 0 || block >= num_blocks_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown KV block id ", block, " (pool has ", num_blocks_, " blocks)"));
  }
  return absl::OkStatus();
}

void KvBlockManager::LruPushBackLocked(BlockId id) {
  Block& b = blocks_[id];
  b.lru_prev = lru_tail_;
  b.lru_next = kNoBlock;
  if (lru_tail_ != kNoBlock) {
    blocks_[lru_tail_].lru_next = id;
  } else {
    lru_head_ = id;
  }
  lru_tail_ = id;
  ++lru_size_;
}

void KvBlockManager::LruRemoveLocked(BlockId id) {
  Block& b = blocks_[id];
  if (b.lru_prev != kNoBlock) {
    blocks_[b.lru_prev].lru_next = b.lru_next;
  } else {
    lru_head_ = b.lru_next;
  }
  if (b.lru_next != kNoBlock) {
    blocks_[b.lru_next].lru_prev = b.lru_prev;
  } else {
    lru_tail_ = b.lru_prev;
  }
  b.lru_prev = b.lru_next = kNoBlock;
  --lru_size_;
}

void KvBlockManager::ForgetContentLocked(Block& b) {
  if (b.published) hash_to_block_.erase(b.hash);
  b.committed = false;
  b.published = false;
  b.hash = 0;
  b.identity = 0;
  b.parent_identity = 0;
  b.tokens.clear();  // keeps capacity: the next commit reuses it
}

BlockId KvBlockManager::TakeOneLocked() {
  BlockId id;
  if (!free_list_.empty()) {
    id = free_list_.back();
    free_list_.pop_back();
  } else {
    id = lru_head_;
    LruRemoveLocked(id);
    ForgetContentLocked(blocks_[id]);
    ++evictions_;
  }
  Block& b = blocks_[id];
  b.ref_count = 1;
  b.state = State::kUsed;
  ++used_blocks_;
  return id;
}

absl::StatusOr<std::vector<BlockId>> KvBlockManager::Allocate(int64_t n) {
  if (n < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot allocate ", n, " KV blocks"));
  }
  absl::MutexLock lock(&mu_);
  int64_t free = static_cast<int64_t>(free_list_.size());
  if (n > free + lru_size_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache exhausted: need ", n, " blocks, ", free,
                     " free + ", lru_size_, " evictable of ", num_blocks_, " (",
                     used_blocks_, " in use)"));
  }
  std::vector<BlockId> out;
  out.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out.push_back(TakeOneLocked());
  return out;
}

absl::Status KvBlockManager::AddRef(std::span<const BlockId> blocks) {
  absl::MutexLock lock(&mu_);
  for (BlockId id : blocks) {
    PDS_RETURN_IF_ERROR(ValidateId(id));
    if (blocks_[id].ref_count <= 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("AddRef on unreferenced KV block ", id));
    }
  }
  for (BlockId id : blocks) {
    if (blocks_[id].ref_count == std::numeric_limits<int32_t>::max()) {
      return absl::FailedPreconditionError(
          absl::StrCat("reference count overflow on KV block ", id));
    }
  }
  for (BlockId id : blocks) ++blocks_[id].ref_count;
  return absl::OkStatus();
}

absl::Status KvBlockManager::Free(std::span<const BlockId> blocks) {
  absl::MutexLock lock(&mu_);
  // Validate the whole batch first (a block may appear several times) so a bad
  // id halfway through cannot leave the batch half applied.
  if (blocks.size() == 1) {
    PDS_RETURN_IF_ERROR(ValidateId(blocks[0]));
    if (blocks_[blocks[0]].ref_count <= 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "double free of KV block ", blocks[0], " (not referenced)"));
    }
  } else {
    absl::flat_hash_map<BlockId, int32_t> drops;
    drops.reserve(blocks.size());
    for (BlockId id : blocks) {
      PDS_RETURN_IF_ERROR(ValidateId(id));
      int32_t d = ++drops[id];
      if (d > blocks_[id].ref_count) {
        return absl::FailedPreconditionError(
            absl::StrCat("double free of KV block ", id, ": freeing ", d,
                         " references, holds ", blocks_[id].ref_count));
      }
    }
  }
  for (BlockId id : blocks) {
    Block& b = blocks_[id];
    if (--b.ref_count > 0) continue;
    --used_blocks_;
    if (b.published) {
      b.state = State::kEvictable;
      LruPushBackLocked(id);
    } else {
      // A committed but unpublished block (a duplicate or a hash collision)
      // can never be found again, so it is plain free memory.
      ForgetContentLocked(b);
      b.state = State::kFree;
      free_list_.push_back(id);
    }
  }
  return absl::OkStatus();
}

uint64_t KvBlockManager::HashLocked(uint64_t parent_hash,
                                    std::span<const int32_t> tokens) const {
  return hash_fn_(parent_hash, tokens);
}

BlockId KvBlockManager::LookupLocked(uint64_t hash, uint64_t parent_identity,
                                     std::span<const int32_t> tokens) const {
  auto it = hash_to_block_.find(hash);
  if (it == hash_to_block_.end()) return kNoBlock;
  const Block& b = blocks_[it->second];
  if (b.parent_identity != parent_identity ||
      !std::equal(b.tokens.begin(), b.tokens.end(), tokens.begin(),
                  tokens.end())) {
    return kNoBlock;  // hash collision: a different prefix owns this hash
  }
  return it->second;
}

std::vector<BlockId> KvBlockManager::MatchPrefix(
    std::span<const int32_t> tokens) {
  absl::MutexLock lock(&mu_);
  const size_t query_blocks = tokens.size() / static_cast<size_t>(block_size_);
  ++prefix_queries_;
  prefix_query_blocks_ += static_cast<int64_t>(query_blocks);
  std::vector<BlockId> matched;
  uint64_t parent_hash = kRootHash;
  uint64_t parent_identity = 0;
  for (size_t k = 0; k < query_blocks; ++k) {
    auto block_tokens = tokens.subspan(k * block_size_, block_size_);
    uint64_t hash = HashLocked(parent_hash, block_tokens);
    BlockId id = LookupLocked(hash, parent_identity, block_tokens);
    if (id == kNoBlock) break;
    Block& b = blocks_[id];
    if (b.ref_count == 0) {
      LruRemoveLocked(id);
      b.state = State::kUsed;
      ++used_blocks_;
    }
    ++b.ref_count;
    matched.push_back(id);
    parent_hash = hash;
    parent_identity = b.identity;
  }
  prefix_hit_blocks_ += static_cast<int64_t>(matched.size());
  return matched;
}

absl::Status KvBlockManager::CommitFullBlock(BlockId block, BlockId parent,
                                             std::span<const int32_t> tokens) {
  absl::MutexLock lock(&mu_);
  PDS_RETURN_IF_ERROR(ValidateId(block));
  if (static_cast<int64_t>(tokens.size()) != block_size_) {
    return absl::InvalidArgumentError(
        absl::StrCat("only full blocks are cached: block ", block, " got ",
                     tokens.size(), " tokens, block size ", block_size_));
  }
  Block& b = blocks_[block];
  if (b.ref_count <= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("commit of unreferenced KV block ", block));
  }
  uint64_t parent_hash = kRootHash;
  uint64_t parent_identity = 0;
  if (parent != kNoBlock) {
    PDS_RETURN_IF_ERROR(ValidateId(parent));
    const Block& p = blocks_[parent];
    if (parent == block || p.ref_count <= 0 || !p.committed) {
      return absl::FailedPreconditionError(
          absl::StrCat("parent KV block ", parent, " of block ", block,
                       " must be held and committed first"));
    }
    parent_hash = p.hash;
    parent_identity = p.identity;
  }
  if (b.committed) {
    if (b.parent_identity == parent_identity &&
        std::equal(b.tokens.begin(), b.tokens.end(), tokens.begin(),
                   tokens.end())) {
      return absl::OkStatus();
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "KV block ", block, " is already committed with other content"));
  }
  uint64_t hash = HashLocked(parent_hash, tokens);
  b.committed = true;
  b.hash = hash;
  b.parent_identity = parent_identity;
  b.tokens.assign(tokens.begin(), tokens.end());
  if (BlockId canonical = LookupLocked(hash, parent_identity, tokens);
      canonical != kNoBlock) {
    // Same prefix computed twice (e.g. two requests prefilled concurrently):
    // share the canonical identity so successors still chain onto the cache.
    b.identity = blocks_[canonical].identity;
    return absl::OkStatus();
  }
  b.identity = next_identity_++;
  if (hash_to_block_.try_emplace(hash, block).second) b.published = true;
  // Otherwise a different prefix already owns this hash; the block stays
  // private, which costs only a missed reuse.
  return absl::OkStatus();
}

int64_t KvBlockManager::used_blocks() const {
  absl::MutexLock lock(&mu_);
  return used_blocks_;
}

int64_t KvBlockManager::free_blocks() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(free_list_.size());
}

int64_t KvBlockManager::cached_blocks() const {
  absl::MutexLock lock(&mu_);
  return lru_size_;
}

int64_t KvBlockManager::available_blocks() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(free_list_.size()) + lru_size_;
}

int64_t KvBlockManager::ref_count(BlockId block) const {
  absl::MutexLock lock(&mu_);
  if (!ValidateId(block).ok()) return 0;
  return blocks_[block].ref_count;
}

KvBlockManagerStats KvBlockManager::stats() const {
  absl::MutexLock lock(&mu_);
  KvBlockManagerStats s;
  s.total_blocks = num_blocks_;
  s.used_blocks = used_blocks_;
  s.free_blocks = static_cast<int64_t>(free_list_.size());
  s.cached_blocks = lru_size_;
  s.published_blocks = static_cast<int64_t>(hash_to_block_.size());
  s.prefix_queries = prefix_queries_;
  s.prefix_query_blocks = prefix_query_blocks_;
  s.prefix_hit_blocks = prefix_hit_blocks_;
  s.evictions = evictions_;
  return s;
}

void KvBlockManager::SetHashFunctionForTest(HashFn fn) {
  absl::MutexLock lock(&mu_);
  hash_fn_ = std::move(fn);
}

absl::Status KvBlockManager::CheckInvariantsForTest() const {
  absl::MutexLock lock(&mu_);
  auto fail = [](auto&&... args) {
    return absl::InternalError(absl::StrCat(args...));
  };
  int64_t used = 0, free = 0, evictable = 0, published = 0;
  for (BlockId id = 0; id < num_blocks_; ++id) {
    const Block& b = blocks_[id];
    switch (b.state) {
      case State::kUsed:
        ++used;
        if (b.ref_count <= 0) return fail("used block ", id, " has ref 0");
        break;
      case State::kFree:
        ++free;
        if (b.ref_count != 0 || b.committed || b.published) {
          return fail("free block ", id, " has ref or content");
        }
        break;
      case State::kEvictable:
        ++evictable;
        if (b.ref_count != 0 || !b.published) {
          return fail("evictable block ", id, " is referenced or unpublished");
        }
        break;
    }
    if (b.published) {
      ++published;
      auto it = hash_to_block_.find(b.hash);
      if (it == hash_to_block_.end() || it->second != id) {
        return fail("published block ", id, " not in the cache map");
      }
      if (!b.committed) return fail("published block ", id, " uncommitted");
    }
    if (b.committed && static_cast<int>(b.tokens.size()) != block_size_) {
      return fail("committed block ", id, " holds ", b.tokens.size(),
                  " tokens");
    }
  }
  if (used != used_blocks_)
    return fail("used count ", used_blocks_, " vs ", used);
  if (free != static_cast<int64_t>(free_list_.size())) {
    return fail("free list size ", free_list_.size(), " vs ", free);
  }
  if (evictable != lru_size_)
    return fail("lru size ", lru_size_, " vs ", evictable);
  if (used + free + evictable != num_blocks_)
    return fail("counts do not add up");
  if (published != static_cast<int64_t>(hash_to_block_.size())) {
    return fail("cache map has ", hash_to_block_.size(), " entries, ",
                published, " published blocks");
  }
  for (BlockId id : free_list_) {
    if (blocks_[id].state != State::kFree) {
      return fail("free list holds non-free block ", id);
    }
  }
  int64_t walked = 0;
  BlockId prev = kNoBlock;
  for (BlockId id = lru_head_; id != kNoBlock; id = blocks_[id].lru_next) {
    if (blocks_[id].state != State::kEvictable ||
        blocks_[id].lru_prev != prev) {
      return fail("LRU list broken at block ", id);
    }
    prev = id;
    if (++walked > num_blocks_) return fail("LRU list has a cycle");
  }
  if (prev != lru_tail_ || walked != lru_size_)
    return fail("LRU tail/size off");
  return absl::OkStatus();
}

}  // namespace pdserve::kv
