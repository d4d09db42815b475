#include "kv/kv_layout.h"

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
