#include "kv/kv_layout.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace pdserve::kv {

size_t KvDTypeSize(KvDType dtype) {
  switch (dtype) {
    case KvDType::kF32:
      return 4;
    case KvDType::kBF16:
      return 2;
    case KvDType::kF16:
      return 2;
  }
  return 4;
}

const char* KvDTypeName(KvDType dtype) {
  switch (dtype) {
    case KvDType::kF32:
      return "f32";
    case KvDType::kBF16:
      return "bf16";
    case KvDType::kF16:
      return "f16";
  }
  return "f32";
}

std::vector<StridedCopy> TokenRangeCopies(const KvCacheLayout& layout,
                                          std::span<const int32_t> block_table,
                                          int64_t token_begin,
                                          int64_t token_end) {
  std::vector<StridedCopy> copies;
  const int64_t element = static_cast<int64_t>(KvDTypeSize(layout.dtype));
  const int64_t bs = layout.block_size;
  for (int64_t t = token_begin; t < token_end;) {
    const int64_t block_index = t / bs;
    const int64_t slot_begin = t % bs;
    const int64_t slot_end =
        std::min<int64_t>(bs, slot_begin + (token_end - t));
    StridedCopy copy;
    copy.offset = layout.Offset(block_table[block_index], 0, 0, 0,
                                static_cast<int>(slot_begin)) *
                  element;
    copy.width = (slot_end - slot_begin) * layout.head_dim * element;
    // (layer, k|v, head) rows are head_stride apart: [layer][kv][head] is
    // one regular sequence of num_layers * 2 * num_kv_heads rows.
    copy.rows = int64_t{layout.num_layers} * 2 * layout.num_kv_heads;
    copy.pitch = layout.head_stride() * element;
    copies.push_back(copy);
    t += slot_end - slot_begin;
  }
  return copies;
}

absl::Status KvCacheLayout::Validate() const {
  if (num_layers <= 0 || layer_offset < 0 || num_kv_heads <= 0 ||
      kv_head_offset < 0 || block_size <= 0 || head_dim <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid KV layout: ", DebugString()));
  }
  return absl::OkStatus();
}

std::string KvCacheLayout::DebugString() const {
  return absl::StrCat("layers=[", layer_offset, ",", layer_offset + num_layers,
                      ") kv_heads=[", kv_head_offset, ",",
                      kv_head_offset + num_kv_heads,
                      ") block_size=", block_size, " head_dim=", head_dim,
                      " dtype_bytes=", KvDTypeSize(dtype));
}

}  // namespace pdserve::kv
