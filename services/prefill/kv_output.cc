#include "prefill/kv_output.h"

#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/float16.h"

namespace pdserve::prefill {
namespace {

int64_t SlotKey(int layer, int position) {
  return (int64_t{layer} << 32) | static_cast<uint32_t>(position);
}

}  // namespace

void CapturingKvOutput::Write(const KvWrite& write,
                              std::function<void(absl::Status)> done) {
  const kv::KvCacheLayout& layout = write.pool->layout();
  if (layout.dtype != kv::KvDType::kF32 && layout.dtype != kv::KvDType::kBF16) {
    done(absl::UnimplementedError(
        "CapturingKvOutput reads f32 and bf16 pools only"));
    return;
  }
  const int64_t needed_blocks =
      (int64_t{write.token_end} + layout.block_size - 1) / layout.block_size;
  if (static_cast<int64_t>(write.block_table.size()) < needed_blocks ||
      write.layer_begin < layout.layer_offset ||
      write.layer_end > layout.layer_offset + layout.num_layers) {
    done(absl::InvalidArgumentError(absl::StrCat(
        "KV write of layers [", write.layer_begin, ", ", write.layer_end,
        ") tokens [", write.token_begin, ", ", write.token_end,
        ") does not fit the source pool ", layout.DebugString())));
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    Captured& captured = requests_[write.request_id];
    captured.num_kv_heads = layout.num_kv_heads;
    captured.head_dim = layout.head_dim;
    const int64_t head_elems = layout.head_dim;
    for (int layer = write.layer_begin; layer < write.layer_end; ++layer) {
      const int pool_layer = layer - layout.layer_offset;
      for (int pos = write.token_begin; pos < write.token_end; ++pos) {
        Slot& slot = captured.slots[SlotKey(layer, pos)];
        slot.values.resize(2 * layout.num_kv_heads * head_elems);
        ++slot.writes;
        const int64_t block = write.block_table[pos / layout.block_size];
        for (int kv = 0; kv < 2; ++kv) {
          for (int head = 0; head < layout.num_kv_heads; ++head) {
            const int64_t at = layout.Offset(block, pool_layer, kv, head,
                                             pos % layout.block_size);
            float* dst =
                slot.values.data() +
                (int64_t{kv} * layout.num_kv_heads + head) * head_elems;
            if (layout.dtype == kv::KvDType::kF32) {
              std::memcpy(dst, write.pool->f32() + at,
                          head_elems * sizeof(float));
            } else {
              // A GPU stage's bf16 KV, widened (exactly) for comparison.
              const auto* src =
                  static_cast<const uint16_t*>(write.pool->data()) + at;
              for (int64_t i = 0; i < head_elems; ++i) {
                dst[i] = Bf16ToFloat(src[i]);
              }
            }
          }
        }
        bytes_ += 2 * layout.num_kv_heads * head_elems *
                  static_cast<int64_t>(kv::KvDTypeSize(layout.dtype));
      }
    }
  }
  done(absl::OkStatus());
}

std::vector<float> CapturingKvOutput::Collected(uint64_t request_id,
                                                int num_layers,
                                                int num_tokens) const {
  absl::MutexLock lock(&mu_);
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return {};
  const Captured& c = it->second;
  const int64_t d = c.head_dim;
  std::vector<float> out(
      int64_t{num_layers} * 2 * c.num_kv_heads * num_tokens * d,
      std::numeric_limits<float>::quiet_NaN());
  for (int layer = 0; layer < num_layers; ++layer) {
    for (int pos = 0; pos < num_tokens; ++pos) {
      auto slot = c.slots.find(SlotKey(layer, pos));
      if (slot == c.slots.end()) continue;
      for (int kv = 0; kv < 2; ++kv) {
        for (int head = 0; head < c.num_kv_heads; ++head) {
          const int64_t dst =
              (((int64_t{layer} * 2 + kv) * c.num_kv_heads + head) *
                   num_tokens +
               pos) *
              d;
          std::memcpy(out.data() + dst,
                      slot->second.values.data() +
                          (int64_t{kv} * c.num_kv_heads + head) * d,
                      d * sizeof(float));
        }
      }
    }
  }
  return out;
}

std::vector<int> CapturingKvOutput::WriteCounts(uint64_t request_id,
                                                int num_layers,
                                                int num_tokens) const {
  absl::MutexLock lock(&mu_);
  std::vector<int> counts(int64_t{num_layers} * num_tokens, 0);
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return counts;
  for (int layer = 0; layer < num_layers; ++layer) {
    for (int pos = 0; pos < num_tokens; ++pos) {
      auto slot = it->second.slots.find(SlotKey(layer, pos));
      if (slot != it->second.slots.end()) {
        counts[int64_t{layer} * num_tokens + pos] = slot->second.writes;
      }
    }
  }
  return counts;
}

int64_t CapturingKvOutput::bytes_written() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

void CapturingKvOutput::Forget(uint64_t request_id) {
  absl::MutexLock lock(&mu_);
  requests_.erase(request_id);
}

}  // namespace pdserve::prefill
