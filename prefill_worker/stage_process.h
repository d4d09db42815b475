// One pipeline stage as a process runs it: the engine shard and KV pool
// (PipelineStage), a UCX worker for the pipeline links (microbatches in from
// the previous stage, out to the next, events to stage 0's coordinator) and a
// second UCX worker for the stage's transport::KvSource, which writes the
// stage's KV into decode ranks' granted blocks.
//
// Life: Create (before the group is wired: the link worker's address is what
// stage 0 asks for), then Wire (stage i > 0: connect next stage and
// coordinator, build and start the stage) or WireFirst (stage 0: the
// coordinator's in-process link in, the coordinator as event sink), then
// ConnectSinks / Cancel while serving.
//
// Threads: every method is thread-safe. ConnectSinks blocks for the transport
// handshake (bounded); call it from a thread that may block, never from a
// gRPC reactor. The stage thread, the KV completion thread and the UCX
// progress threads are owned here.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/llama_engine.h"
#include "model/weight_source.h"
#include "prefill/pipeline_stage.h"
#include "prefill/stage_link.h"
#include "prefill_worker/ucx_kv_output.h"
#include "prefill_worker/ucx_stage_link.h"
#include "transport/kv_transfer.h"
#include "transport/ucx_worker.h"

namespace pdserve::prefill {

struct StageProcessOptions {
  int stage = 0;
  int num_stages = 1;
  engine::ShardSpec shard;  // this stage's layers
  int block_size = 16;
  int64_t num_blocks = 512;  // group-wide; the same on every stage
  int threads = 1;           // engine threads of the stage
  absl::Duration kv_write_timeout = absl::Seconds(30);
  transport::UcxWorkerOptions ucx;
  StageObserver observer;                           // metrics hooks (optional)
  engine::Backend backend = engine::Backend::kCpu;  // see PipelineStageOptions
  engine::CudaOptions cuda;
  std::optional<kv::KvDType> kv_dtype;  // unset = the backend's own
  engine::QuantizedMatmul quantized_matmul =
      engine::QuantizedMatmul::kInt8Activations;
  // The last stage's structured-output grammars (not owned; may be null).
  grammar::StructuredOutputCompiler* structured_output = nullptr;
};

class StageProcess {
 public:
  // `weights` must outlive the object.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<StageProcess>> Create(
      const model::WeightSource& weights, const StageProcessOptions& options);
  // Ends the stage (its input is closed; stage 0's caller closes its link
  // first), waits for KV writes in flight (bounded), releases UCX.
  ~StageProcess();
  StageProcess(const StageProcess&) = delete;
  StageProcess& operator=(const StageProcess&) = delete;

  const StageProcessOptions& options() const { return options_; }
  // The KV dtype this stage computes and sends: --kv-dtype, else bf16 on
  // GPUs and f32 on CPUs (what ModelIdentity.kv_dtype reports; decode
  // workers must match it).
  kv::KvDType kv_dtype() const {
    return engine::ResolvedKvDType(options_.backend, options_.kv_dtype);
  }
  // Blob for UcxWorker::Connect: microbatches into this stage (i > 0) and
  // events into the coordinator (stage 0) arrive on this worker.
  const std::string& link_address() const { return link_worker_->address(); }
  transport::UcxWorker* link_worker() { return link_worker_.get(); }

  // Stage i > 0. `next` is empty for the last stage. FAILED_PRECONDITION if
  // already wired.
  [[nodiscard]] absl::Status Wire(const std::string& next,
                                  const std::string& coordinator);
  // Stage 0: `in` is the coordinator's link, `events` the coordinator (both
  // outlive this object until Shutdown).
  [[nodiscard]] absl::Status WireFirst(StageReceiver* in,
                                       const std::string& next,
                                       StageEventSink* events);
  bool wired() const;

  // Connects the KV source to each sink not connected yet (handshake).
  [[nodiscard]] absl::Status ConnectSinks(
      const std::vector<std::string>& descriptors);
  // See UcxKvOutput::AddGrants. FAILED_PRECONDITION before wiring.
  [[nodiscard]] absl::Status AddGrants(const std::vector<std::string>& grants);
  void ForgetGrants(uint64_t request_id);
  // Revokes the requests' KV at their sinks; unknown ids are skipped.
  void CancelKv(const std::vector<uint64_t>& request_ids);
  // One request, telling its sinks even if this source no longer holds its
  // grants (see UcxKvOutput::Cancel).
  void CancelKvWithGrants(uint64_t request_id,
                          const std::vector<std::string>& grants);

  // Counters (zero before wiring).
  StageStats stats() const;

  // Closes the stage's input (i > 0) and waits for the stage thread.
  void Shutdown();

 private:
  StageProcess(const model::WeightSource& weights,
               const StageProcessOptions& options)
      : weights_(weights), options_(options) {}
  absl::Status Build(StageReceiver* in, const std::string& next,
                     StageEventSink* events);

  const model::WeightSource& weights_;
  const StageProcessOptions options_;
  std::unique_ptr<transport::UcxWorker> link_worker_;
  std::unique_ptr<transport::UcxWorker> kv_worker_;
  std::unique_ptr<UcxStageReceiver> receiver_;  // i > 0

  mutable absl::Mutex mu_;
  // Set once by Wire/WireFirst, then immutable until destruction.
  std::unique_ptr<UcxStageSender> sender_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<UcxEventSender> event_sender_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<PipelineStage> stage_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<transport::KvSource> source_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<UcxKvOutput> kv_output_ ABSL_GUARDED_BY(mu_);
  bool wired_ ABSL_GUARDED_BY(mu_) = false;

  // Serializes handshakes; descriptors already connected.
  absl::Mutex connect_mu_;
  absl::flat_hash_set<std::string> connected_ ABSL_GUARDED_BY(connect_mu_);
};

}  // namespace pdserve::prefill
