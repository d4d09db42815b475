// The memory of a paged KV cache: num_blocks blocks laid out per KvCacheLayout,
// page-aligned so it can be registered with UCX (or replaced by GPU memory).
// It knows nothing about which block belongs to whom; KvBlockManager does.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>

#include "absl/status/statusor.h"
#include "kv/kv_layout.h"

namespace pdserve::kv {

class KvPool {
 public:
  // Allocates num_blocks zeroed blocks. RESOURCE_EXHAUSTED if the memory
  // cannot be had.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<KvPool>> Create(
      const KvCacheLayout& layout, int64_t num_blocks);
  // A pool over memory someone else allocated (UCX-allocated shared memory so
  // peers can put into it directly, or GPU memory). `release` runs when the
  // pool is destroyed (may be empty when the owner outlives the pool).
  // INVALID_ARGUMENT if `size_bytes` cannot hold num_blocks blocks.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<KvPool>> Wrap(
      const KvCacheLayout& layout, int64_t num_blocks, void* data,
      int64_t size_bytes, std::function<void()> release);
  // How many blocks of `layout` fit in `budget_bytes` (at least 0).
  static int64_t BlocksForBudget(const KvCacheLayout& layout,
                                 int64_t budget_bytes);

  ~KvPool();
  KvPool(const KvPool&) = delete;
  KvPool& operator=(const KvPool&) = delete;

  const KvCacheLayout& layout() const { return layout_; }
  int64_t num_blocks() const { return num_blocks_; }
  int64_t size_bytes() const { return size_bytes_; }
  void* data() { return data_; }
  const void* data() const { return data_; }
  // f32 views (layout().dtype must be kF32).
  float* f32() { return static_cast<float*>(data_); }
  const float* f32() const { return static_cast<const float*>(data_); }

 private:
  KvPool(const KvCacheLayout& layout, int64_t num_blocks, void* data,
         int64_t size_bytes, std::function<void()> release)
      : layout_(layout),
        num_blocks_(num_blocks),
        data_(data),
        size_bytes_(size_bytes),
        release_(std::move(release)) {}

  KvCacheLayout layout_;
  int64_t num_blocks_;
  void* data_;
  int64_t size_bytes_;
  std::function<void()> release_;  // frees data_
};

}  // namespace pdserve::kv
