// Packs the chunks of queued prefill requests into microbatches under a token
// budget. A microbatch may hold chunks of several requests but at most one
// chunk of each, so a request's chunks run in order at every stage (stages
// process microbatches in FIFO order) while its later chunks can already be in
// earlier stages. Requests are scanned in arrival order, first fit; a chunk
// larger than the whole budget runs alone.
//
// Not thread-safe: owned by the coordinator thread.
#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <vector>

namespace pdserve::prefill {

// One request's share of a microbatch.
struct ChunkWork {
  uint64_t request_id = 0;
  int chunk_index = 0;
  int token_begin = 0;  // first prompt position computed by this chunk
  int token_end = 0;    // one past the last
  // First position whose KV the stages send after this chunk: token_begin,
  // except for a request's first chunk, which also sends the prefix that
  // prefix reuse skipped (already in the stages' pools).
  int kv_begin = 0;
  bool final_chunk = false;
  int num_tokens() const { return token_end - token_begin; }
};

struct Microbatch {
  uint64_t id = 0;
  std::vector<ChunkWork> chunks;
  int num_tokens() const;
};

class MicrobatchFormer {
 public:
  // token_budget ≥ 1 (smaller values are treated as 1).
  explicit MicrobatchFormer(int token_budget);

  // Queues a request whose positions [begin, begin + Σ lengths) are to be
  // computed in chunks of `chunk_lengths` (each ≥ 1). Its first chunk sends
  // KV from position 0.
  void Add(uint64_t request_id, int begin,
           const std::vector<int>& chunk_lengths);
  // Drops a request's chunks not yet handed out; false if none were queued.
  bool Remove(uint64_t request_id);

  // The next microbatch, or nullopt when nothing is queued.
  std::optional<Microbatch> Next();

  bool empty() const { return queue_.empty(); }
  int64_t queued_tokens() const { return queued_tokens_; }
  int64_t queued_requests() const {
    return static_cast<int64_t>(queue_.size());
  }
  int token_budget() const { return token_budget_; }

 private:
  struct Pending {
    uint64_t request_id;
    std::vector<ChunkWork> chunks;
    size_t next = 0;
  };
  const int token_budget_;
  std::list<Pending> queue_;
  int64_t queued_tokens_ = 0;
  uint64_t next_id_ = 1;
};

}  // namespace pdserve::prefill
