// The seam between LlamaEngine (what callers hold) and where its forward pass
// runs. LlamaEngine::Create picks a backend from EngineOptions::backend; every
// backend resolves its shard through ShardPlan and validates batches with the
// same ValidateBatch, so layouts and errors do not depend on the backend.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "engine/engine_types.h"
#include "engine/shard_plan.h"
#include "kv/kv_pool.h"
#include "model/weight_source.h"

namespace pdserve::engine {

class EngineBackend {
 public:
  virtual ~EngineBackend() = default;
  virtual const ShardPlan& plan() const = 0;
  // Element type of the KV cache this backend reads and writes.
  virtual kv::KvDType kv_dtype() const = 0;
  // True when the KV pool must live in device memory (CreateKvPool makes it).
  virtual bool kv_on_device() const = 0;
  virtual int64_t weight_bytes() const = 0;
  // Tokens routed to each expert of each sparse layer of this shard since
  // load ([local layer][expert]; dense layers all zero); empty for a
  // backend that does not count.
  virtual std::vector<std::vector<int64_t>> ExpertLoad() const { return {}; }
  [[nodiscard]] virtual absl::Status Forward(const ForwardBatch& batch,
                                             kv::KvPool& pool,
                                             ForwardResult* result) = 0;
  // Copies whole blocks (every layer, K and V) from a host pool of the same
  // layout into `pool`: the staging step when KV arrives in host memory (a
  // transport without device-memory support) but the backend computes on a
  // device. Layouts and block ids are checked by LlamaEngine.
  [[nodiscard]] virtual absl::Status CopyBlocksFromHost(
      const kv::KvPool& host, std::span<const int32_t> blocks,
      kv::KvPool& pool) = 0;
  // Copies `copies` (byte ranges of the shared layout) from `pool` into the
  // host pool `host`: how KV computed on a device reaches memory a transport
  // can read. Checked by LlamaEngine.
  [[nodiscard]] virtual absl::Status CopyToHost(
      const kv::KvPool& pool, std::span<const kv::StridedCopy> copies,
      kv::KvPool& host) = 0;
  // A zeroed pool of `num_blocks` in the memory this backend computes on.
  [[nodiscard]] virtual absl::StatusOr<std::unique_ptr<kv::KvPool>>
  CreateKvPool(const kv::KvCacheLayout& layout, int64_t num_blocks) = 0;
};

// Defined by the CUDA backend (services/engine_cuda) when built with
// -DPDSERVE_CUDA=ON; otherwise a stub that returns UNIMPLEMENTED.
[[nodiscard]] absl::StatusOr<std::unique_ptr<EngineBackend>> CreateCudaBackend(
    const model::WeightSource& weights, const EngineOptions& options,
    ShardPlan plan);
// Whether this binary carries the CUDA backend (a GPU may still be absent).
bool CudaBackendCompiled();

// Tensor-parallel ranks of one process on GPUs (rank r on
// devices[r % devices.size()]) reducing with NCCL, device memory to device
// memory and inside CUDA Graphs. UNIMPLEMENTED without -DPDSERVE_CUDA=ON;
// FAILED_PRECONDITION when two ranks would share a GPU (NCCL refuses that:
// such ranks reduce through a host comm::InProcessGroup instead) or a device
// is missing.
[[nodiscard]] absl::StatusOr<std::unique_ptr<comm::InProcessGroup>>
CreateNcclGroup(int size, const std::vector<int>& devices);

}  // namespace pdserve::engine
