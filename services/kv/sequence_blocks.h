// KvSequence: the block table of one request's KV cache and the RAII owner of
// its block references.
//
// Token positions [0, num_tokens()) live in block_table()[pos / block_size] at
// slot pos % block_size. Blocks [0, num_immutable_blocks()) are shared with the
// prefix cache (matched from it or published to it) and must never be written
// again; everything after them is private to this sequence.
//
// Speculative decoding: Reserve(n + draft + 1) before a verify step, then
// Truncate(n + accepted) to roll the rejected tokens back; publish only the
// accepted tokens with PublishFullBlocks.
//
// Not thread-safe: a sequence belongs to one scheduler thread. Its manager is
// (see block_manager.h) and must outlive it.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "kv/block_manager.h"

namespace pdserve::kv {

struct KvSequenceStart;

class KvSequence {
 public:
  // An empty sequence (no blocks, no tokens) drawing from `manager`.
  explicit KvSequence(KvBlockManager* manager);
  ~KvSequence() { Release(); }

  KvSequence(KvSequence&& other) noexcept;
  KvSequence& operator=(KvSequence&& other) noexcept;
  KvSequence(const KvSequence&) = delete;
  KvSequence& operator=(const KvSequence&) = delete;

  // A sequence holding the longest cached prefix of `prompt_tokens`, and how
  // many tokens that is. At most floor((n - 1) / block_size) blocks are reused
  // so the last prompt token is always recomputed: even a fully cached prompt
  // needs that token's logits to sample the first output token.
  static KvSequenceStart StartWithPrefix(
      KvBlockManager* manager, std::span<const int32_t> prompt_tokens);

  // Grows the table to cover `total_tokens` positions; num_tokens() becomes
  // max(num_tokens(), total_tokens). RESOURCE_EXHAUSTED (nothing changed) when
  // the manager lacks the blocks.
  [[nodiscard]] absl::Status Reserve(int64_t total_tokens);

  // Rolls back to `num_tokens` positions (e.g. rejected draft tokens), freeing
  // blocks no longer needed. Cutting into a shared (immutable) block is
  // FAILED_PRECONDITION, since the positions after the cut would be written
  // again; truncating to a block boundary is always allowed. Growing is
  // INVALID_ARGUMENT (use Reserve).
  [[nodiscard]] absl::Status Truncate(int64_t num_tokens);

  // Publishes every full block not yet shared, given the sequence's tokens
  // from position 0 whose KV is complete and accepted (never draft tokens). A
  // partial last block is left for a later call. INVALID_ARGUMENT if more
  // tokens are given than the sequence holds.
  [[nodiscard]] absl::Status PublishFullBlocks(std::span<const int32_t> tokens);

  // Sliding windows: gives back the blocks wholly before `position` (keys no
  // query of this sequence will read again, when every layer windows) that
  // are already shared with the prefix cache — they stay there, evictable —
  // keeping the last shared one, the parent the next published block
  // chains to. Their table entries then name the first block still held:
  // valid ids, never read or written. Returns how many blocks went back.
  // Truncating into them afterwards is FAILED_PRECONDITION.
  [[nodiscard]] absl::StatusOr<int64_t> ReleaseBlocksBefore(int64_t position);

  // Frees every block; the sequence becomes empty. Idempotent.
  void Release();

  KvBlockManager* manager() const { return manager_; }
  std::span<const BlockId> block_table() const { return blocks_; }
  int64_t num_blocks() const { return static_cast<int64_t>(blocks_.size()); }
  int64_t num_tokens() const { return num_tokens_; }
  // Positions the table can hold without another Reserve.
  int64_t capacity_tokens() const;
  int64_t num_immutable_blocks() const { return num_immutable_blocks_; }
  // Table entries [0, num_released_blocks()) were given back
  // (ReleaseBlocksBefore); the sequence holds the rest.
  int64_t num_released_blocks() const { return num_released_blocks_; }

 private:
  KvBlockManager* manager_;
  std::vector<BlockId> blocks_;
  int64_t num_tokens_ = 0;
  // Prefix of blocks_ shared with the prefix cache (matched or published).
  int64_t num_immutable_blocks_ = 0;
  // Prefix of blocks_ given back by ReleaseBlocksBefore.
  int64_t num_released_blocks_ = 0;
};

struct KvSequenceStart {
  KvSequence sequence;
  int64_t cached_tokens = 0;
};

}  // namespace pdserve::kv
