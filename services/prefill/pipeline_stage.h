// One pipeline stage of a prefill group: an engine shard holding only its
// layers plus a local KV pool for those layers (all KV heads), driven by one
// thread that receives microbatches in order, runs its layers, sends the
// hidden states on, and starts the KV writes of every chunk it finished.
//
// The last stage computes logits only for the last position of each
// request's final chunk and samples the first output token (index 0) with the
// request's sampling parameters and seed; for a request scoring its prompt
// (ChunkHeader::prompt_logprobs) it computes them at every position and
// reports each prompt token's log-probability.
//
// Block ids are group-wide: the coordinator's block manager hands them out and
// every stage's pool has the same number of blocks, so one block table names
// a request's KV in every stage.
//
// Threads: Start() spawns the stage thread, which owns the engine and writes
// the pool. It ends when the receiver is drained and closed, then closes the
// sender. Stats are readable from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/recent_ids.h"
#include "engine/llama_engine.h"
#include "grammar/structured_output.h"
#include "kv/kv_pool.h"
#include "model/weight_source.h"
#include "prefill/kv_output.h"
#include "prefill/stage_link.h"

namespace pdserve::prefill {

// What one microbatch fed the stage's layers.
struct MicrobatchShape {
  int chunks = 0;
  int64_t tokens = 0;
  // Rows the LM head turned into logits (the last stage's; 0 on the others).
  int logit_rows = 0;
  // Σ over the fed tokens of the positions each attends to, its own
  // included (engine::SequenceStep::AttendedPositions of each chunk).
  int64_t attended_positions = 0;
  int first_tokens = 0;  // requests whose first token the stage sampled
};

// Per-event hooks for metrics. on_microbatch runs on the stage thread after
// every microbatch's compute, on_kv_transfer on the KV output's completion
// thread once a write landed or failed; both must be quick (no blocking).
struct StageObserver {
  std::function<void(int64_t tokens, int chunks, double seconds)> on_microbatch;
  // `bytes` is the KV payload of the stage's layers (every KV head once);
  // `seconds` runs from issuing the write until it landed or failed.
  std::function<void(int64_t bytes, double seconds, bool ok)> on_kv_transfer;
  // The microbatch's shape beside its time, as the layout planner's step
  // costs take it (prefill_worker --step-trace); after on_microbatch.
  std::function<void(const MicrobatchShape&, double seconds)> on_step;
};

struct PipelineStageOptions {
  int stage_index = 0;
  int num_stages = 1;
  engine::ShardSpec shard;  // this stage's layer range
  int block_size = 16;
  int64_t num_blocks = 0;  // group-wide block count
  int threads = 1;         // engine threads (counting the stage thread)
  StageObserver observer;
  // Where the stage computes. With kCuda the KV pool lives in GPU memory and
  // each microbatch's KV is copied to a host mirror before it is written out
  // (Debian's UCX cannot read GPU memory); KV is then bf16.
  engine::Backend backend = engine::Backend::kCpu;
  engine::CudaOptions cuda;
  // KV element type (EngineOptions::kv_dtype); unset = the backend's own.
  std::optional<kv::KvDType> kv_dtype;
  // How quantized GGUF weights multiply (EngineOptions::quantized_matmul).
  engine::QuantizedMatmul quantized_matmul =
      engine::QuantizedMatmul::kInt8Activations;
  // The last stage samples each request's first token: with structured
  // output through a grammar compiled here (null: such requests fail with
  // FAILED_PRECONDITION). Not owned; outlives the stage.
  grammar::StructuredOutputCompiler* structured_output = nullptr;
};

// Counters for metrics (names settled by the observability issue).
struct StageStats {
  double busy_seconds = 0;
  // Since Start, not computing: the pipeline bubble while the group has work
  // queued (and plain idleness when it has none).
  double idle_seconds = 0;
  int64_t microbatches = 0;
  int64_t tokens = 0;
  int64_t chunks = 0;
  int64_t kv_writes = 0;
  int64_t failures = 0;
  // Last stage: prompt tokens whose logits rows it computed to score the
  // prompt (echo + logprobs). Their share of `tokens` is the --scored-share
  // the layer split should be computed for.
  int64_t scored_tokens = 0;
  // GPU stages: KV copied device → host mirror before the writes (bytes, and
  // seconds of the stage thread, included in busy_seconds).
  int64_t kv_mirror_bytes = 0;
  double kv_mirror_seconds = 0;
};

class PipelineStage {
 public:
  // `in` and `events` are required; `out` is null for the last stage;
  // `kv_out` may be null (no KV leaves the stage). None is owned; all must
  // outlive the stage, and every KV write's `done` must have run before the
  // stage is destroyed (a completed request implies it).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<PipelineStage>> Create(
      const model::WeightSource& weights, const PipelineStageOptions& options,
      StageReceiver* in, StageSender* out, StageEventSink* events,
      StageKvOutput* kv_out);
  ~PipelineStage();  // Joins the thread (the receiver must get closed).
  PipelineStage(const PipelineStage&) = delete;
  PipelineStage& operator=(const PipelineStage&) = delete;

  // Wires the KV output after creation (a transport KvSource registers the
  // stage's pool, so it can only be made once the stage exists). Before Start.
  void set_kv_output(StageKvOutput* kv_out) { kv_out_ = kv_out; }
  // The pool KV writes read (what a transport registers): the engine's own
  // pool on the CPU, its host mirror when the engine computes on a GPU.
  kv::KvPool* mutable_pool() { return landing_ ? landing_.get() : pool_.get(); }

  void Start();
  // The request was cancelled or failed before its final chunk: forget its
  // write bookkeeping (at once, or when its writes in flight settle) and
  // report nothing for it.
  void Forget(uint64_t request_id);
  // Requests with KV-write bookkeeping open (for tests: no leak).
  size_t open_write_entries() const;
  // Waits for the thread to end (after the receiver is closed and drained).
  void Join();

  const PipelineStageOptions& options() const { return options_; }
  bool is_last() const { return out_ == nullptr; }
  const engine::LlamaEngine& engine() const { return *engine_; }
  // The local KV as writes read it (see mutable_pool); read it only while
  // the stage is idle (tests).
  const kv::KvPool& pool() const { return landing_ ? *landing_ : *pool_; }
  StageStats stats() const;
  // Compute intervals of every microbatch, in order (tests check overlap).
  std::vector<std::pair<absl::Time, absl::Time>> BusyIntervalsForTest() const;

 private:
  PipelineStage(const PipelineStageOptions& options,
                std::unique_ptr<engine::LlamaEngine> engine,
                std::unique_ptr<kv::KvPool> pool,
                std::unique_ptr<kv::KvPool> landing, StageReceiver* in,
                StageSender* out, StageEventSink* events,
                StageKvOutput* kv_out);
  void Run();
  void Process(StageMessage message);
  // The engine's step for `message`: logits where a first token is sampled
  // or a prompt scored.
  engine::ForwardBatch BatchOf(const StageMessage& message) const;
  // GPU stage: copies the positions computed into the host landing pool
  // (adding their bytes to `bytes`).
  absl::Status MirrorToHost(const StageMessage& message, int64_t* bytes);
  MicrobatchShape ShapeOf(const StageMessage& message,
                          const engine::ForwardBatch& batch,
                          int64_t tokens) const;
  // Last stage: prompt scores and first tokens of the chunks, as events.
  void ReportLastStageResults(const StageMessage& message,
                              const engine::ForwardResult& result);
  StageEvent SampleFirstToken(const ChunkHeader& chunk,
                              std::span<const float> logits);
  // Last stage: INVALID_ARGUMENT for a prompt_logprobs chunk without its
  // tokens or with a next token that cannot follow it (a peer's bug).
  absl::Status CheckPromptScoring(const StageMessage& message) const;
  // Last stage, a prompt_logprobs chunk whose logit rows start at
  // `first_row`: reports log p(each next prompt token).
  void ReportPromptLogprobs(
      const ChunkHeader& chunk, int first_row,
      const std::function<std::span<const float>(int)>& logits_row);
  void StartKvWrites(const ChunkHeader& chunk);
  void OnKvWriteDone(uint64_t request_id, absl::Status status);

  const PipelineStageOptions options_;
  std::unique_ptr<engine::LlamaEngine> engine_;
  std::unique_ptr<kv::KvPool> pool_;
  // Host mirror of a device pool (null on the CPU): every position the stage
  // computes is copied here before its KV write starts.
  std::unique_ptr<kv::KvPool> landing_;
  StageReceiver* const in_;
  StageSender* const out_;
  StageEventSink* const events_;
  StageKvOutput* kv_out_;  // set before Start()
  std::thread thread_;
  // Stage thread only: Forward's output, kept so its logits buffer (large
  // when a chunk scores its prompt) is not allocated anew per microbatch.
  engine::ForwardResult result_;

  // KV writes in flight per request; the final chunk's notice goes out once
  // every write of the request has landed.
  struct PendingWrites {
    int outstanding = 0;
    bool final_issued = false;
    bool abandoned = false;  // cancelled/failed: drop once writes settle
    absl::Status status;
  };
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, PendingWrites> writes_ ABSL_GUARDED_BY(mu_);
  // Recently forgotten ids (bounded, oldest first): a straggler chunk of one
  // must not open a new entry that no final chunk would ever close.
  RecentIds forgotten_ ABSL_GUARDED_BY(mu_){4096};
  StageStats stats_ ABSL_GUARDED_BY(mu_);
  absl::Time started_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::vector<std::pair<absl::Time, absl::Time>> intervals_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::prefill
