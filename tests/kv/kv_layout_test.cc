#include "kv/kv_layout.h"

#include <cstdint>
#include <cstring>
#include <set>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kv/block_manager.h"
#include "kv/kv_pool.h"

namespace pdserve::kv {
namespace {

KvCacheLayout SmallLayout() {
  KvCacheLayout layout;
  layout.num_layers = 3;
  layout.num_kv_heads = 2;
  layout.block_size = 4;
  layout.head_dim = 5;
  layout.dtype = KvDType::kF32;
  return layout;
}

TEST(KvCacheLayoutTest, StridesAndBytes) {
  KvCacheLayout l = SmallLayout();
  ASSERT_TRUE(l.Validate().ok());
  EXPECT_EQ(l.head_stride(), 4 * 5);
  EXPECT_EQ(l.kv_stride(), 4 * 5 * 2);
  EXPECT_EQ(l.layer_stride(), 4 * 5 * 2 * 2);
  EXPECT_EQ(l.block_stride(), 4 * 5 * 2 * 2 * 3);
  EXPECT_EQ(l.block_bytes(), l.block_stride() * 4);
  l.dtype = KvDType::kBF16;
  EXPECT_EQ(l.block_bytes(), l.block_stride() * 2);
}

TEST(KvCacheLayoutTest, OffsetsTileTheBlockExactly) {
  // Every (layer, k|v, head, slot, dim) of a block maps to a distinct element
  // inside that block: the layout neither overlaps nor leaves holes.
  KvCacheLayout l = SmallLayout();
  std::set<int64_t> seen;
  for (int layer = 0; layer < l.num_layers; ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int head = 0; head < l.num_kv_heads; ++head) {
        for (int slot = 0; slot < l.block_size; ++slot) {
          for (int d = 0; d < l.head_dim; ++d) {
            int64_t off = l.Offset(2, layer, kv, head, slot) + d;
            EXPECT_GE(off, 2 * l.block_stride());
            EXPECT_LT(off, 3 * l.block_stride());
            EXPECT_TRUE(seen.insert(off).second) << off;
          }
        }
      }
    }
  }
  EXPECT_EQ(static_cast<int64_t>(seen.size()), l.block_stride());
  // Memory order [block][layer][k|v][head][slot][head_dim].
  EXPECT_EQ(l.Offset(0, 0, 0, 0, 1), l.head_dim);
  EXPECT_EQ(l.Offset(0, 0, 0, 1, 0), l.head_stride());
  EXPECT_EQ(l.Offset(0, 0, 1, 0, 0), l.kv_stride());
  EXPECT_EQ(l.Offset(0, 1, 0, 0, 0), l.layer_stride());
  EXPECT_EQ(l.Offset(1, 0, 0, 0, 0), l.block_stride());
}

TEST(KvCacheLayoutTest, ValidateRejectsEmptyDimensions) {
  KvCacheLayout l = SmallLayout();
  l.block_size = 0;
  EXPECT_EQ(l.Validate().code(), absl::StatusCode::kInvalidArgument);
  l = SmallLayout();
  l.layer_offset = -1;
  EXPECT_EQ(l.Validate().code(), absl::StatusCode::kInvalidArgument);
}

TEST(KvPoolTest, ZeroedAndSized) {
  KvCacheLayout l = SmallLayout();
  auto pool = KvPool::Create(l, 7);
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ((*pool)->num_blocks(), 7);
  EXPECT_EQ((*pool)->size_bytes(), 7 * l.block_bytes());
  const float* data = (*pool)->f32();
  for (int64_t i = 0; i < 7 * l.block_stride(); ++i) {
    ASSERT_EQ(data[i], 0.0f) << i;
  }
  // Page-aligned so it can be registered for RDMA.
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*pool)->data()) % 4096, 0u);
  // Writable end to end.
  std::memset((*pool)->data(), 0xab,
              static_cast<size_t>((*pool)->size_bytes()));
}

TEST(KvPoolTest, RejectsBadArguments) {
  EXPECT_EQ(KvPool::Create(SmallLayout(), 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  KvCacheLayout bad = SmallLayout();
  bad.head_dim = 0;
  EXPECT_EQ(KvPool::Create(bad, 4).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(KvPoolTest, BlocksForBudget) {
  KvCacheLayout l = SmallLayout();
  const int64_t bb = l.block_bytes();
  EXPECT_EQ(KvPool::BlocksForBudget(l, 0), 0);
  EXPECT_EQ(KvPool::BlocksForBudget(l, -5), 0);
  EXPECT_EQ(KvPool::BlocksForBudget(l, bb - 1), 0);
  EXPECT_EQ(KvPool::BlocksForBudget(l, bb), 1);
  EXPECT_EQ(KvPool::BlocksForBudget(l, 10 * bb + bb / 2), 10);
}

TEST(KvPoolTest, ManagerFromBudgetMatchesPool) {
  KvCacheLayout l = SmallLayout();
  const int64_t budget = 13 * l.block_bytes() + 17;
  auto manager = KvBlockManager::CreateForBudget(budget, l);
  ASSERT_TRUE(manager.ok()) << manager.status();
  EXPECT_EQ((*manager)->num_blocks(), KvPool::BlocksForBudget(l, budget));
  EXPECT_EQ((*manager)->block_size(), l.block_size);
  EXPECT_EQ(
      KvBlockManager::CreateForBudget(l.block_bytes() - 1, l).status().code(),
      absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdserve::kv

namespace pdserve::kv {
namespace {

TEST(KvPoolTest, WrapsExternalMemoryAndReleasesIt) {
  KvCacheLayout layout;
  layout.num_layers = 2;
  layout.num_kv_heads = 2;
  layout.block_size = 4;
  layout.head_dim = 8;
  const int64_t bytes = layout.block_bytes() * 3;
  std::vector<float> memory(bytes / sizeof(float));
  bool released = false;
  {
    auto pool =
        KvPool::Wrap(layout, 3, memory.data(), bytes, [&] { released = true; });
    ASSERT_TRUE(pool.ok()) << pool.status();
    EXPECT_EQ((*pool)->data(), memory.data());
    EXPECT_EQ((*pool)->num_blocks(), 3);
    EXPECT_FALSE(released);
  }
  EXPECT_TRUE(released);
  auto too_small = KvPool::Wrap(layout, 4, memory.data(), bytes, nullptr);
  EXPECT_EQ(too_small.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(KvPool::Wrap(layout, 1, nullptr, bytes, nullptr).ok());
}

// TokenRangeCopies covers exactly the slots of the positions asked for, in
// every (layer, k|v, head), through a scattered block table, for each dtype.
TEST(KvLayoutTest, TokenRangeCopiesCoverExactlyThosePositions) {
  for (KvDType dtype : {KvDType::kF32, KvDType::kBF16}) {
    KvCacheLayout layout = SmallLayout();
    layout.dtype = dtype;
    const int64_t element = static_cast<int64_t>(KvDTypeSize(dtype));
    const std::vector<int32_t> table = {5, 1, 3, 0};  // 4 slots per block
    const int64_t pool_bytes = 6 * layout.block_bytes();
    for (auto [begin, end] :
         {std::pair<int64_t, int64_t>{0, 16}, {3, 9}, {5, 6}, {4, 8}, {7, 7}}) {
      std::vector<int> covered(pool_bytes, 0);
      for (const StridedCopy& c : TokenRangeCopies(layout, table, begin, end)) {
        for (int64_t row = 0; row < c.rows; ++row) {
          for (int64_t i = 0; i < c.width; ++i) {
            ASSERT_LT(c.offset + row * c.pitch + i, pool_bytes);
            ++covered[c.offset + row * c.pitch + i];
          }
        }
      }
      std::vector<int> want(pool_bytes, 0);
      for (int64_t t = begin; t < end; ++t) {
        for (int layer = 0; layer < layout.num_layers; ++layer) {
          for (int kv = 0; kv < 2; ++kv) {
            for (int head = 0; head < layout.num_kv_heads; ++head) {
              const int64_t at =
                  layout.Offset(table[t / layout.block_size], layer, kv, head,
                                static_cast<int>(t % layout.block_size)) *
                  element;
              for (int64_t i = 0; i < layout.head_dim * element; ++i) {
                ++want[at + i];
              }
            }
          }
        }
      }
      EXPECT_EQ(covered, want) << "tokens [" << begin << ", " << end << ")";
    }
  }
  EXPECT_STREQ(KvDTypeName(KvDType::kBF16), "bf16");
  EXPECT_STREQ(KvDTypeName(KvDType::kF32), "f32");
}

}  // namespace
}  // namespace pdserve::kv
