// A Llama forward pass over a paged KV cache: the fp32 CPU reference (OpenBLAS
// GEMMs, a worker pool for attention) or, with EngineOptions::backend = kCuda,
// the bf16 CUDA backend (services/engine_cuda). One engine object is one shard
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
#include "engine/engine_types.h"
#include "kv/kv_layout.h"
#include "kv/kv_pool.h"
#include "model/model_config.h"
#include "model/weight_source.h"

namespace pdserve::engine {

class EngineBackend;

class LlamaEngine {
 public:
  // Loads this shard's weights from `weights` (only the slices it holds).
  // INVALID_ARGUMENT for an impossible shard (layer range, tp_size not
  // dividing the heads, missing communicator); UNIMPLEMENTED for kCuda in a
  // build without CUDA, FAILED_PRECONDITION when no GPU is usable.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<LlamaEngine>> Create(
      const model::WeightSource& weights, const EngineOptions& options);
  ~LlamaEngine();
  LlamaEngine(const LlamaEngine&) = delete;
  LlamaEngine& operator=(const LlamaEngine&) = delete;

  const model::ModelConfig& config() const;
  const ShardSpec& shard() const;
  bool holds_first_layer() const;
  bool holds_last_layer() const;
  Backend backend() const;
  // KV layout of the cache this shard reads and writes (its layers, its KV
  // heads; f32 on CPU, bf16 on CUDA).
  kv::KvCacheLayout KvLayout(int block_size) const;
  // True when the KV pool lives in GPU memory (allocate it with CreateKvPool).
  bool kv_on_device() const;
  // A zeroed pool of `num_blocks` blocks of KvLayout(block_size), in the
  // memory this engine computes on.
  [[nodiscard]] absl::StatusOr<std::unique_ptr<kv::KvPool>> CreateKvPool(
      int block_size, int64_t num_blocks);
  // Copies whole blocks from a host pool that mirrors `pool` (same layout
  // and size) into `pool`: how KV that landed in host memory reaches a GPU
  // engine. INVALID_ARGUMENT for a pool that does not mirror, OUT_OF_RANGE
  // for a block id outside it. Not concurrent with Forward on this engine.
  [[nodiscard]] absl::Status CopyBlocksFromHost(const kv::KvPool& host,
                                                std::span<const int32_t> blocks,
                                                kv::KvPool& pool);
  // Copies the KV of positions [token_begin, token_end) of one sequence
  // (every layer and head of this shard) from `pool` to the host pool `host`
  // that mirrors it: how a GPU prefill stage exposes KV to the transport.
  // Touches only those positions' slots. Same errors as CopyBlocksFromHost,
  // plus INVALID_ARGUMENT for a range the block table does not cover.
  [[nodiscard]] absl::Status CopyTokensToHost(
      const kv::KvPool& pool, std::span<const int32_t> block_table,
      int64_t token_begin, int64_t token_end, kv::KvPool& host);
  // Bytes of weights this shard holds (sharded and replicated tensors).
  int64_t weight_bytes() const;
  // Tokens routed to each expert of each sparse layer of this shard since
  // load: [layer - shard.layer_begin][expert], rows of dense layers zero.
  // Every rank routes every token, so any rank's counts are the group's.
  // Not synchronized with Forward: call it from the thread that steps.
  std::vector<std::vector<int64_t>> ExpertLoad() const;

  // Runs one step. Validates the batch (token ids in vocab, block tables long
  // enough and inside the pool, positions inside the context, pool layout
  // matching KvLayout) and returns INVALID_ARGUMENT / OUT_OF_RANGE before
  // touching the cache. Writes this step's K/V into `pool`.
  [[nodiscard]] absl::Status Forward(const ForwardBatch& batch,
                                     kv::KvPool& pool, ForwardResult* result);

 private:
  LlamaEngine(std::unique_ptr<EngineBackend> backend, Backend kind);
  std::unique_ptr<EngineBackend> backend_;
  Backend kind_;
};

}  // namespace pdserve::engine
