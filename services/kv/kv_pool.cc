#include "kv/kv_pool.h"

#include <cstdlib>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/large_buffer.h"
#include "common/status_macros.h"

namespace pdserve::kv {

absl::StatusOr<std::unique_ptr<KvPool>> KvPool::Create(
    const KvCacheLayout& layout, int64_t num_blocks) {
  PDS_RETURN_IF_ERROR(layout.Validate());
  if (num_blocks <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV pool needs at least one block, got ", num_blocks));
  }
  int64_t bytes = layout.block_bytes() * num_blocks;
  // Anonymous memory: page-aligned, zeroed, returned to the OS on free, and
  // on huge pages (a decode step reads every running sequence's blocks).
  auto buffer = LargeBuffer::Allocate(static_cast<size_t>(bytes));
  if (!buffer.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate KV pool of ", bytes,
                     " bytes: ", buffer.status().message()));
  }
  void* data = buffer->data();
  auto owner = std::make_shared<LargeBuffer>(*std::move(buffer));
  return std::unique_ptr<KvPool>(new KvPool(
      layout, num_blocks, data, bytes, [owner]() mutable { owner.reset(); }));
}

int64_t KvPool::BlocksForBudget(const KvCacheLayout& layout,
                                int64_t budget_bytes) {
  int64_t per_block = layout.block_bytes();
  if (per_block <= 0 || budget_bytes <= 0) return 0;
  return budget_bytes / per_block;
}

absl::StatusOr<std::unique_ptr<KvPool>> KvPool::Wrap(
    const KvCacheLayout& layout, int64_t num_blocks, void* data,
    int64_t size_bytes, std::function<void()> release) {
  PDS_RETURN_IF_ERROR(layout.Validate());
  if (num_blocks <= 0 || data == nullptr ||
      size_bytes < layout.block_bytes() * num_blocks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot place ", num_blocks, " KV blocks of ", layout.block_bytes(),
        " bytes in ", size_bytes, " bytes of external memory"));
  }
  return std::unique_ptr<KvPool>(
      new KvPool(layout, num_blocks, data, size_bytes, std::move(release)));
}

KvPool::~KvPool() {
  if (release_) release_();
}

}  // namespace pdserve::kv
