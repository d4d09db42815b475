// The reference Llama forward pass on CPU (fp32, OpenBLAS GEMMs, a worker
// pool for attention), over a paged KV cache. One engine object is one shard
// of the model: a contiguous layer range (what a pipeline stage runs) and/or
// one tensor-parallel rank (what a decode TP rank runs). The unsharded,
// all-layers engine is the single-process reference every layout is compared
// against.
//
// A forward step takes a batch of sequences; each contributes any number of
// query tokens (a prefill chunk, one decode token, a multi-token speculative
// verify) at its own context length, reads/writes its KV through its own block
// table, and asks for logits at any subset of its query positions.
//
// Thread-safety: Forward is not reentrant (it uses per-engine scratch); run one
// step at a time per engine. TP ranks are separate engine objects, each driven
// by its own thread or process, meeting in the Communicator.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "kv/kv_layout.h"
#include "kv/kv_pool.h"
#include "model/model_config.h"
#include "model/weight_source.h"

namespace pdserve::engine {

struct ShardSpec {
  int layer_begin = 0;
  int layer_end = -1;  // -1: through the last layer
  int tp_rank = 0;
  int tp_size = 1;
};

struct EngineOptions {
  ShardSpec shard;
  // Threads for attention and element-wise work, counting the caller
  // (0 = hardware concurrency). GEMMs use OpenBLAS's own threads.
  int num_threads = 0;
  // Required when shard.tp_size > 1; not owned. Its rank/size must match.
  comm::Communicator* communicator = nullptr;
};

// One sequence's share of a forward step.
struct SequenceStep {
  // Query token ids; read only when the engine holds layer 0. When it does not,
  // only the count matters (its hidden states come in ForwardBatch).
  std::span<const int32_t> tokens;
  int num_tokens = 0;  // query tokens of this step (== tokens.size() if given)
  int start_position = 0;  // tokens of this sequence already in the KV cache
  // Block ids of this sequence, covering positions [0, start_position +
  // num_tokens).
  std::span<const int32_t> block_table;
  // Query indices (0-based within this step, ascending) that need logits;
  // ignored unless the engine holds the last layer.
  std::vector<int> logit_indices;
};

struct ForwardBatch {
  std::vector<SequenceStep> sequences;
  // Hidden states of every query token, sequences concatenated in order,
  // [total_tokens, hidden]; required iff the engine does not hold layer 0.
  std::span<const float> hidden_in;
};

struct ForwardResult {
  // [total_tokens, hidden]; filled iff the engine does not hold the last layer.
  std::vector<float> hidden_out;
  // [rows, vocab]: one row per requested logit index, sequences in order.
  std::vector<float> logits;
  int num_logit_rows = 0;
};

class LlamaEngine {
 public:
  // Loads this shard's weights from `weights` (only the slices it holds).
  // INVALID_ARGUMENT for an impossible shard (layer range, tp_size not
  // dividing the heads, missing communicator).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<LlamaEngine>> Create(
      const model::WeightSource& weights, const EngineOptions& options);
  ~LlamaEngine();
  LlamaEngine(const LlamaEngine&) = delete;
  LlamaEngine& operator=(const LlamaEngine&) = delete;

  const model::ModelConfig& config() const;
  const ShardSpec& shard() const;
  bool holds_first_layer() const;
  bool holds_last_layer() const;
  // KV layout of the cache this shard reads and writes (its layers, its KV
  // heads).
  kv::KvCacheLayout KvLayout(int block_size) const;
  // Bytes of weights this shard holds (sharded and replicated tensors).
  int64_t weight_bytes() const;

  // Runs one step. Validates the batch (token ids in vocab, block tables long
  // enough and inside the pool, positions inside the context, pool layout
  // matching KvLayout) and returns INVALID_ARGUMENT / OUT_OF_RANGE before
  // touching the cache. Writes this step's K/V into `pool`.
  [[nodiscard]] absl::Status Forward(const ForwardBatch& batch,
                                     kv::KvPool& pool, ForwardResult* result);

 private:
  struct Impl;
  explicit LlamaEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pdserve::engine
