// The scheduler of a prefill group (runs in stage 0's process): validates and
// admits requests, owns the group-wide KV block ids (prefix reuse included),
// cuts prompts into chunks, packs chunks into microbatches under a token
// budget, keeps up to D microbatches in flight through the stages, and
// completes a request once the last stage sampled its first token and every
// stage's KV writes of it landed.
//
// Threads: one coordinator thread owns every request's state, the microbatch
// former and the block references. Submit/Cancel (any thread) and stage
// events (Report, stage threads) only push onto its inbox, a closable queue.
// Results come back through PrefillTicket.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/closable_queue.h"
#include "engine/sampler.h"
#include "kv/block_manager.h"
#include "model/model_config.h"
#include "prefill/chunk_policy.h"
#include "prefill/microbatch_former.h"
#include "prefill/stage_link.h"

namespace pdserve::prefill {

struct PrefillRequest {
  uint64_t request_id = 0;
  std::vector<int32_t> prompt;
  engine::SamplingParams sampling;
  // Most likely alternatives of the first token to report
  // (PrefillOutcome::first_token.top), 0 to engine::kMaxTopLogprobs.
  int top_logprobs = 0;
  // Score the prompt: report log p(prompt token k | tokens before it) for
  // k >= 1 (PrefillOutcome::prompt_logprobs) with top_logprobs alternatives
  // each. The prefix cache is not consulted for such a request (every
  // position's logits are needed), though its blocks are still published.
  bool prompt_logprobs = false;
  // False: nothing leaves the group (no destination; scoring only), and
  // kv_grants must be empty.
  bool write_kv = true;
  // Overrides the group's chunk policy for this request.
  std::optional<ChunkPolicy> chunk_policy;
  // Where the KV goes: grant blobs handed to every stage's KV output with the
  // request's first chunk (one per decode rank).
  std::vector<std::string> kv_grants;
  // Prompt position of the grants' token 0 (decode-side cached prefix; a
  // multiple of the block size, below the prompt length). See ChunkHeader.
  int kv_dst_offset = 0;
};

struct PrefillOutcome {
  uint64_t request_id = 0;
  engine::SampledToken first_token;
  // Prompt tokens whose compute prefix reuse skipped (their KV was still sent).
  int64_t cached_tokens = 0;
  int num_chunks = 0;
  // With PrefillRequest::prompt_logprobs: entry k scores prompt token k + 1
  // (prompt length - 1 entries).
  std::vector<engine::TokenLogprobs> prompt_logprobs;
};

// Completion of one submitted request. Thread-safe.
class PrefillTicket {
 public:
  explicit PrefillTicket(uint64_t request_id) : request_id_(request_id) {}
  uint64_t request_id() const { return request_id_; }
  bool done() const;
  // The outcome or the failure; DEADLINE_EXCEEDED if still running after
  // `timeout` (the request keeps running).
  [[nodiscard]] absl::StatusOr<PrefillOutcome> Wait(
      absl::Duration timeout) const;

  // Calls `fn` once with the result: at once (this thread) if done, else on
  // the coordinator thread when it finishes, so `fn` must not block. At most
  // one callback per ticket (a later one replaces an earlier, unfired one).
  void OnDone(std::function<void(const absl::StatusOr<PrefillOutcome>&)> fn);

  void Finish(absl::StatusOr<PrefillOutcome> result);  // coordinator only

 private:
  const uint64_t request_id_;
  mutable absl::Mutex mu_;
  std::optional<absl::StatusOr<PrefillOutcome>> result_ ABSL_GUARDED_BY(mu_);
  std::function<void(const absl::StatusOr<PrefillOutcome>&)> on_done_
      ABSL_GUARDED_BY(mu_);
};

struct SchedulerOptions {
  ChunkPolicy chunk_policy;
  int microbatch_token_budget = 256;
  int max_in_flight = 0;  // D; 0 = twice the number of stages
  int block_size = 16;
  int64_t num_blocks =
      0;  // group-wide blocks (each stage's pool holds them all)
  bool prefix_reuse = true;
};

struct CoordinatorStats {
  int64_t used_blocks = 0;
  int64_t active_requests = 0;
  int64_t microbatches = 0;
  int64_t completed = 0;
  int64_t failed = 0;
  int64_t cached_tokens = 0;  // prompt tokens skipped by prefix reuse
};

// INVALID_ARGUMENT naming what is wrong: empty prompt, prompt longer than the
// context, a token outside the vocabulary, invalid sampling parameters or
// chunk policy.
[[nodiscard]] absl::Status ValidatePrefillRequest(
    const model::ModelConfig& config, const PrefillRequest& request);

class PrefillCoordinator : public StageEventSink {
 public:
  // `stage0` (not owned, outlives the coordinator) carries microbatches into
  // the first stage.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<PrefillCoordinator>>
  Create(const model::ModelConfig& config, int num_stages,
         const SchedulerOptions& options, StageSender* stage0);
  ~PrefillCoordinator() override;
  PrefillCoordinator(const PrefillCoordinator&) = delete;
  PrefillCoordinator& operator=(const PrefillCoordinator&) = delete;

  // Validates synchronously (ValidatePrefillRequest; ALREADY_EXISTS for an id
  // in use; RESOURCE_EXHAUSTED for a prompt needing more blocks than the
  // group has; UNAVAILABLE after Shutdown), then queues the request. A request
  // waits for blocks when the pool is full.
  [[nodiscard]] absl::StatusOr<std::shared_ptr<PrefillTicket>> Submit(
      PrefillRequest request);
  // Stops the request: its queued chunks are dropped, its ticket fails with
  // CANCELLED, and its blocks are released once no chunk of it is in flight.
  // NOT_FOUND for an unknown or finished request.
  [[nodiscard]] absl::Status Cancel(uint64_t request_id);

  // StageEventSink.
  void Report(StageEvent event) override;

  // Fails every unfinished request with UNAVAILABLE and stops the thread.
  // Later Reports are dropped. Idempotent.
  void Shutdown();

  CoordinatorStats stats() const;
  const kv::KvBlockManager& block_manager() const { return *blocks_; }
  int num_stages() const { return num_stages_; }

 private:
  struct SubmitCommand {
    PrefillRequest request;
    std::shared_ptr<PrefillTicket> ticket;
  };
  struct CancelCommand {
    uint64_t request_id;
  };
  using Command = std::variant<SubmitCommand, CancelCommand, StageEvent>;

  struct RequestState;

  PrefillCoordinator(const model::ModelConfig& config, int num_stages,
                     const SchedulerOptions& options, StageSender* stage0,
                     std::unique_ptr<kv::KvBlockManager> blocks);
  void Run();
  void Handle(SubmitCommand command);
  void Handle(const CancelCommand& command);
  void Handle(const StageEvent& event);
  void TryAdmit();
  void Launch();
  void Fail(uint64_t request_id, const absl::Status& status);
  void MaybeFinish(uint64_t request_id);
  void Finish(uint64_t request_id, absl::StatusOr<PrefillOutcome> result);

  const model::ModelConfig config_;
  const int num_stages_;
  const SchedulerOptions options_;
  StageSender* const stage0_;
  std::unique_ptr<kv::KvBlockManager> blocks_;
  ClosableQueue<Command> inbox_;
  std::thread thread_;

  // Coordinator-thread state.
  MicrobatchFormer former_;
  absl::flat_hash_map<uint64_t, std::unique_ptr<RequestState>> requests_;
  std::vector<uint64_t> admission_;  // waiting for blocks, FIFO
  int in_flight_ = 0;

  mutable absl::Mutex mu_;
  absl::flat_hash_set<uint64_t> active_ids_ ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  CoordinatorStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::prefill
