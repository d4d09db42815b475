// Where a pipeline stage sends the KV of its layers once a chunk is computed.
// The UCX implementation (a transport::KvSource writing into a decode
// worker's granted blocks) and the in-memory capture used by tests and the
// local CLI both sit behind StageKvOutput.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "kv/kv_pool.h"

namespace pdserve::prefill {

// KV of model layers [layer_begin, layer_end) for prompt positions
// [token_begin, token_end) of one request, read from `pool` through
// `block_table` (group-wide block ids; the pool holds exactly these layers).
struct KvWrite {
  uint64_t request_id = 0;
  int layer_begin = 0;
  int layer_end = 0;
  int token_begin = 0;
  int token_end = 0;
  bool final_chunk = false;
  // Prompt position of the destination's token 0 (see ChunkHeader); the
  // stage never asks for positions below it.
  int kv_dst_offset = 0;
  std::span<const int32_t> block_table;
  const kv::KvPool* pool = nullptr;
  // Destination grants, given with a request's first write only.
  std::span<const std::string> grants;
};

class StageKvOutput {
 public:
  virtual ~StageKvOutput() = default;
  // Starts moving the KV and calls `done` exactly once, on any thread, when
  // the bytes are at the destination (or failed). The pool slots must stay
  // unchanged until then. Must not block on the network.
  virtual void Write(const KvWrite& write,
                     std::function<void(absl::Status)> done) = 0;
};

// Copies every write into per-request host buffers, synchronously. Thread-safe
// (stages write concurrently). Records how often each (layer, position) was
// written, so tests can check every slot arrives exactly once.
class CapturingKvOutput : public StageKvOutput {
 public:
  void Write(const KvWrite& write,
             std::function<void(absl::Status)> done) override;

  // KV of one request as [layer][k|v][head][position][head_dim] over
  // `num_layers` model layers and `num_tokens` positions; NaN where nothing
  // arrived.
  std::vector<float> Collected(uint64_t request_id, int num_layers,
                               int num_tokens) const;
  // Writes of each (layer, position), [layer][position]; 0 where none.
  std::vector<int> WriteCounts(uint64_t request_id, int num_layers,
                               int num_tokens) const;
  int64_t bytes_written() const;
  void Forget(uint64_t request_id);

 private:
  struct Slot {
    std::vector<float> values;  // k then v, [head][head_dim] each
    int writes = 0;
  };
  struct Captured {
    int num_kv_heads = 0;
    int head_dim = 0;
    // (layer, position) -> slot
    absl::flat_hash_map<int64_t, Slot> slots;
  };
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Captured> requests_ ABSL_GUARDED_BY(mu_);
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pdserve::prefill
