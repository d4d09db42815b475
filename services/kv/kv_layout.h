// Where every KV element of a paged cache lives. Shared by the engine (which
// reads/writes it), the block manager (which hands out block ids) and the
// transport (which moves ranges of it between processes).
//
// Memory order of one pool: [block][layer][k|v][head][slot][head_dim].
//  - A block holds every layer the pool holds, so a block id names one unit of
//    prefix caching and transfer.
//  - For one (block, layer, k|v) the heads held are contiguous, so a TP rank's
//    head shard of a full-head source block is one contiguous run.
//  - Within a head, a block's slots are contiguous [slot][head_dim], which is
//    what attention streams over.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace pdserve::kv {

enum class KvDType { kF32 = 0, kBF16 = 1, kF16 = 2 };
size_t KvDTypeSize(KvDType dtype);
// "f32", "bf16", "f16": the spelling in ModelIdentity.kv_dtype.
const char* KvDTypeName(KvDType dtype);

struct KvCacheLayout {
  int num_layers = 0;  // layers held by this pool
  int layer_offset =
      0;  // model layer of pool layer 0 (a PP stage's first layer)
  int num_kv_heads = 0;  // KV heads held by this pool
  int kv_head_offset =
      0;               // model KV head of pool head 0 (a TP rank's first head)
  int block_size = 0;  // tokens per block
  int head_dim = 0;
  KvDType dtype = KvDType::kF32;

  [[nodiscard]] absl::Status Validate() const;
  std::string DebugString() const;

  // Elements of one (block, layer, k|v, head): block_size * head_dim.
  int64_t head_stride() const { return int64_t{block_size} * head_dim; }
  // Elements of one (block, layer, k|v).
  int64_t kv_stride() const { return head_stride() * num_kv_heads; }
  // Elements of one (block, layer).
  int64_t layer_stride() const { return kv_stride() * 2; }
  // Elements of one block.
  int64_t block_stride() const { return layer_stride() * num_layers; }
  int64_t block_bytes() const {
    return block_stride() * static_cast<int64_t>(KvDTypeSize(dtype));
  }

  // Element offset of (block, pool layer, kv = 0 for K / 1 for V, pool head,
  // slot, dim 0).
  int64_t Offset(int64_t block, int layer, int kv, int head, int slot) const {
    return block * block_stride() + layer * layer_stride() + kv * kv_stride() +
           head * head_stride() + int64_t{slot} * head_dim;
  }
};

// A strided byte copy between two pools of one layout: `rows` runs of
// `width` bytes, the first at byte `offset`, each `pitch` bytes after the
// previous (what cudaMemcpy2D takes).
struct StridedCopy {
  int64_t offset = 0;
  int64_t width = 0;
  int64_t rows = 0;
  int64_t pitch = 0;
};

// The copies that move the KV of token positions [token_begin, token_end) of
// one sequence (every layer, K and V, every head the layout holds) through
// its block table: one strided copy per block touched, covering exactly the
// slots of those positions, so concurrent copies of other positions of the
// same blocks never overlap it. The caller checks the block ids.
std::vector<StridedCopy> TokenRangeCopies(const KvCacheLayout& layout,
                                          std::span<const int32_t> block_table,
                                          int64_t token_begin,
                                          int64_t token_end);

}  // namespace pdserve::kv
