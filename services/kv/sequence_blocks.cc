#include "kv/sequence_blocks.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"

namespace pdserve::kv {

KvSequence::KvSequence(KvBlockManager* manager) : manager_(manager) {
  PDS_CHECK(manager != nullptr);
}

KvSequence::KvSequence(KvSequence&& other) noexcept
    : manager_(other.manager_),
      blocks_(std::move(other.blocks_)),
      num_tokens_(std::exchange(other.num_tokens_, 0)),
      num_immutable_blocks_(std::exchange(other.num_immutable_blocks_, 0)),
      num_released_blocks_(std::exchange(other.num_released_blocks_, 0)) {
  other.blocks_.clear();
}

KvSequence& KvSequence::operator=(KvSequence&& other) noexcept {
  if (this != &other) {
    Release();
    manager_ = other.manager_;
    blocks_ = std::move(other.blocks_);
    other.blocks_.clear();
    num_tokens_ = std::exchange(other.num_tokens_, 0);
    num_immutable_blocks_ = std::exchange(other.num_immutable_blocks_, 0);
    num_released_blocks_ = std::exchange(other.num_released_blocks_, 0);
  }
  return *this;
}

KvSequenceStart KvSequence::StartWithPrefix(
    KvBlockManager* manager, std::span<const int32_t> prompt_tokens) {
  KvSequenceStart start{KvSequence(manager), 0};
  if (prompt_tokens.empty()) return start;
  const int64_t block_size = manager->block_size();
  const int64_t reusable_blocks =
      (static_cast<int64_t>(prompt_tokens.size()) - 1) / block_size;
  std::vector<BlockId> matched =
      manager->MatchPrefix(prompt_tokens.first(reusable_blocks * block_size));
  KvSequence& seq = start.sequence;
  seq.num_immutable_blocks_ = static_cast<int64_t>(matched.size());
  seq.num_tokens_ = seq.num_immutable_blocks_ * block_size;
  seq.blocks_ = std::move(matched);
  start.cached_tokens = seq.num_tokens_;
  return start;
}

int64_t KvSequence::capacity_tokens() const {
  return num_blocks() * manager_->block_size();
}

absl::Status KvSequence::Reserve(int64_t total_tokens) {
  if (total_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot reserve ", total_tokens, " tokens"));
  }
  const int64_t block_size = manager_->block_size();
  const int64_t needed = (total_tokens + block_size - 1) / block_size;
  if (needed > num_blocks()) {
    PDS_ASSIGN_OR_RETURN(std::vector<BlockId> fresh,
                         manager_->Allocate(needed - num_blocks()));
    blocks_.insert(blocks_.end(), fresh.begin(), fresh.end());
  }
  num_tokens_ = std::max(num_tokens_, total_tokens);
  return absl::OkStatus();
}

absl::Status KvSequence::Truncate(int64_t num_tokens) {
  if (num_tokens < 0 || num_tokens > num_tokens_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot truncate a ", num_tokens_, "-token sequence to ", num_tokens));
  }
  const int64_t block_size = manager_->block_size();
  if (num_tokens < num_immutable_blocks_ * block_size &&
      num_tokens % block_size != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "truncating to ", num_tokens, " tokens would rewrite shared block ",
        num_tokens / block_size, "; the first ",
        num_immutable_blocks_ * block_size, " tokens are cached"));
  }
  const int64_t keep = (num_tokens + block_size - 1) / block_size;
  if (keep < num_released_blocks_) {
    return absl::FailedPreconditionError(
        absl::StrCat("truncating to ", num_tokens,
                     " tokens reaches blocks given back "
                     "outside the sliding window (the first ",
                     num_released_blocks_ * block_size, " tokens)"));
  }
  if (keep < num_blocks()) {
    // Tail first, so the blocks least likely to be shared are evicted first.
    std::vector<BlockId> dropped(blocks_.rbegin(),
                                 blocks_.rbegin() + (num_blocks() - keep));
    PDS_RETURN_IF_ERROR(manager_->Free(dropped));
    blocks_.resize(static_cast<size_t>(keep));
  }
  num_tokens_ = num_tokens;
  num_immutable_blocks_ = std::min(num_immutable_blocks_, keep);
  return absl::OkStatus();
}

absl::Status KvSequence::PublishFullBlocks(std::span<const int32_t> tokens) {
  if (static_cast<int64_t>(tokens.size()) > num_tokens_) {
    return absl::InvalidArgumentError(absl::StrCat("publishing ", tokens.size(),
                                                   " tokens of a ", num_tokens_,
                                                   "-token sequence"));
  }
  const int64_t block_size = manager_->block_size();
  const int64_t full = std::min<int64_t>(
      static_cast<int64_t>(tokens.size()) / block_size, num_blocks());
  for (int64_t k = num_immutable_blocks_; k < full; ++k) {
    PDS_RETURN_IF_ERROR(manager_->CommitFullBlock(
        blocks_[k], k == 0 ? kNoBlock : blocks_[k - 1],
        tokens.subspan(k * block_size, block_size)));
    num_immutable_blocks_ = k + 1;
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> KvSequence::ReleaseBlocksBefore(int64_t position) {
  const int64_t block_size = manager_->block_size();
  const int64_t before = std::min(position, num_tokens_) / block_size;
  const int64_t until = std::min(before, num_immutable_blocks_ - 1);
  if (until <= num_released_blocks_) return int64_t{0};
  const std::vector<BlockId> given_back(blocks_.begin() + num_released_blocks_,
                                        blocks_.begin() + until);
  PDS_RETURN_IF_ERROR(manager_->Free(given_back));
  num_released_blocks_ = until;
  std::fill(blocks_.begin(), blocks_.begin() + until, blocks_[until]);
  return static_cast<int64_t>(given_back.size());
}

void KvSequence::Release() {
  if (blocks_.size() <= static_cast<size_t>(num_released_blocks_)) {
    blocks_.clear();
    num_tokens_ = 0;
    num_immutable_blocks_ = 0;
    num_released_blocks_ = 0;
    return;
  }
  std::vector<BlockId> reversed(blocks_.rbegin(),
                                blocks_.rend() - num_released_blocks_);
  absl::Status status = manager_->Free(reversed);
  if (!status.ok()) {
    // Only reachable if someone else freed this sequence's references: a bug,
    // but not one worth crashing a serving process over.
    PDS_LOG(ERROR) << "KvSequence::Release: " << status;
  }
  blocks_.clear();
  num_tokens_ = 0;
  num_immutable_blocks_ = 0;
  num_released_blocks_ = 0;
}

}  // namespace pdserve::kv
