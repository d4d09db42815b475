// KV cache transfer from prefill pipeline stages (sources: some layers, all
// KV heads) into decode tensor-parallel ranks (sinks: all layers, a head shard
// each), as one-sided UCX puts into the sink's registered pool.
//
// Flow (the control plane carries the blobs; tests use a socketpair):
//   decode rank:  sink = KvSink::Create(...)      -> sink.descriptor()
//   prefill:      source.Connect(descriptor)      (compatibility handshake)
//   decode rank:  grant = sink.Expect(req, tokens, blocks, lease)
//   prefill:      source.AddGrant(grant); source.Write(req, layers, tokens)...
//   decode rank:  sink.Wait(req, timeout)          (OK once every layer x token
//                                                   of the request arrived)
//
// Safety: a source checks every put against the sink's registered region and
// the blocks the sink granted for that request before issuing it; a grant
// naming blocks outside the sink's pool is refused. The sink refuses
// overlapping grants, only counts notices from handshaken sources, and fails a
// request (revoking it at every source, releasing its blocks) when its lease
// runs out without progress, when a source that wrote to it dies, or on
// Cancel. One-sided RMA cannot be checked at the target: puts already in
// flight when a revoke lands may still arrive (see README).
//
// Threads: both classes are thread-safe; their message handlers run on the
// worker's progress thread. One KvSink and/or one KvSource per UcxWorker.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kv/kv_layout.h"
#include "kv/kv_pool.h"
#include "transport/ucx_worker.h"

namespace pdserve::transport {

// What a source and a sink must agree on (the whole model, not a shard).
struct KvModelSpec {
  std::string model_id;  // model identity, e.g. name + weights hash
  kv::KvDType dtype = kv::KvDType::kF32;
  int block_size = 0;
  int head_dim = 0;
  int num_layers = 0;    // model layers
  int num_kv_heads = 0;  // model KV heads
};

// OK, or FAILED_PRECONDITION naming the first field that differs.
[[nodiscard]] absl::Status CheckCompatible(const KvModelSpec& local,
                                           const KvModelSpec& remote);

// Byte copies moving model layers [layer_begin, layer_end) of tokens
// [token_begin, token_end) from `src` blocks (token order) into the `dst`
// blocks, for the KV heads `dst` holds. Runs contiguous on both sides are
// merged into one segment. Offsets are bytes from each pool's base.
[[nodiscard]] absl::StatusOr<std::vector<PutSegment>> PlanKvCopy(
    const kv::KvCacheLayout& src, std::span<const int64_t> src_blocks,
    const kv::KvCacheLayout& dst, std::span<const int64_t> dst_blocks,
    int layer_begin, int layer_end, int64_t token_begin, int64_t token_end);

// A zeroed KV pool in UCX-allocated memory (UcxWorker::Allocate): same-host
// peers put into it through shared memory, which is the fast and safe path
// without RDMA (README: "Known hazard"). The pool owns the allocation;
// KvSink::Create(worker, pool, ...) picks up its registration. The pool must
// not outlive `worker`'s use of it by a sink.
[[nodiscard]] absl::StatusOr<std::unique_ptr<kv::KvPool>> AllocateKvPool(
    UcxWorker* worker, const kv::KvCacheLayout& layout, int64_t num_blocks);

// ---------------------------------------------------------------------------
// Sink (decode rank)
// ---------------------------------------------------------------------------

struct KvSinkOptions {
  absl::Duration default_lease = absl::Seconds(30);
  // A failed request's blocks stay reserved until every live source
  // confirmed the revoke (no write of it can still land), at most this long.
  absl::Duration revoke_quarantine = absl::Seconds(5);
  // Called (progress thread) with a failed or cancelled request's blocks once
  // their quarantine is over: the owner (block manager) frees them. Not
  // called for completed requests, whose blocks now hold live KV.
  std::function<void(uint64_t request_id, const std::vector<int64_t>& blocks,
                     const absl::Status& why)>
      release_blocks;
};

class KvSink {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<KvSink>> Create(
      UcxWorker* worker, kv::KvPool* pool, const KvModelSpec& spec,
      KvSinkOptions options = {});
  // Sink over `num_blocks` blocks laid out per `layout` in `region` (which
  // the sink then owns). With memory from UcxWorker::Allocate, same-host
  // peers reach it through shared memory, so one-sided puts are plain copies;
  // a pool in ordinary memory (the overload above) needs an RMA-capable
  // transport (verbs, cuda_ipc, CMA lanes) or UCX's slower software RMA.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<KvSink>> Create(
      UcxWorker* worker, const kv::KvCacheLayout& layout, int64_t num_blocks,
      std::unique_ptr<MemoryRegion> region, const KvModelSpec& spec,
      KvSinkOptions options = {});
  ~KvSink();
  KvSink(const KvSink&) = delete;
  KvSink& operator=(const KvSink&) = delete;

  // Blob for KvSource::Connect: spec, layout, worker address, region.
  const std::string& descriptor() const;

  // Advertises `blocks` (token order) as the destination of the first
  // `num_tokens` tokens of `request_id`; returns the grant for sources. The
  // lease (`lease` or the default when zero) restarts at every write notice.
  [[nodiscard]] absl::StatusOr<std::string> Expect(uint64_t request_id,
                                                   int64_t num_tokens,
                                                   std::vector<int64_t> blocks,
                                                   absl::Duration lease = {});

  // OK once every layer x token of the request has arrived (the request then
  // leaves the sink); the failure otherwise; DEADLINE_EXCEEDED if still in
  // progress after `timeout`. NOT_FOUND for an unknown request.
  [[nodiscard]] absl::Status Wait(uint64_t request_id, absl::Duration timeout);

  // Fails the request with CANCELLED, revokes it at its sources, releases its
  // blocks. `settled` (optional) tells whether the request had already
  // settled — its KV landed, or its failure's blocks were released: then no
  // release_blocks callback follows this Cancel; otherwise one does, once
  // the sources confirmed (or the quarantine ran out).
  [[nodiscard]] absl::Status Cancel(uint64_t request_id,
                                    bool* settled = nullptr);

  // Requests granted and not yet completed or failed.
  int64_t active_requests() const;
  // Sources whose handshake was accepted.
  int64_t accepted_sources() const;

  struct Impl;

 private:
  explicit KvSink(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

// ---------------------------------------------------------------------------
// Source (prefill stage)
// ---------------------------------------------------------------------------

struct KvSourceOptions {
  absl::Duration handshake_timeout = absl::Seconds(10);
  // Test hook: skip the local compatibility check so the sink's own check is
  // exercised.
  bool skip_local_compat_check_for_test = false;
};

class KvSource {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<KvSource>> Create(
      UcxWorker* worker, kv::KvPool* pool, const KvModelSpec& spec,
      KvSourceOptions options = {});
  ~KvSource();
  KvSource(const KvSource&) = delete;
  KvSource& operator=(const KvSource&) = delete;

  // Connects to a sink and runs the compatibility handshake. Returns the
  // sink's id. FAILED_PRECONDITION naming the difference when incompatible,
  // UNAVAILABLE when the sink does not answer within the handshake timeout.
  [[nodiscard]] absl::StatusOr<uint64_t> Connect(
      const std::string& sink_descriptor);

  // Adds one sink's grant for a request. INVALID_ARGUMENT / OUT_OF_RANGE for a
  // grant from an unknown sink or naming blocks outside its pool.
  [[nodiscard]] absl::Status AddGrant(const std::string& grant);

  // Writes model layers [layer_begin, layer_end) of tokens [token_begin,
  // token_end) of `request_id`, read from this pool's `src_blocks` (token
  // order), into every sink that granted blocks for the request. The handle
  // succeeds once the bytes are in each sink's memory and each sink was told.
  [[nodiscard]] absl::StatusOr<std::shared_ptr<OpHandle>> Write(
      uint64_t request_id, std::span<const int64_t> src_blocks, int layer_begin,
      int layer_end, int64_t token_begin, int64_t token_end);

  // Stops the request here and tells its sinks (they release its blocks).
  [[nodiscard]] absl::Status Cancel(uint64_t request_id);
  // Drops the request's grants once its transfers completed.
  void Forget(uint64_t request_id);

  // Test-only: stay connected but never answer a sink's revoke, the way a
  // stuck source would (exercises the sink's quarantine).
  void IgnoreRevokesForTest();

  struct Impl;

 private:
  explicit KvSource(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

}  // namespace pdserve::transport
