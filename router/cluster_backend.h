// The real GenerationBackend: runs each request through a prefill group and a
// decode worker of the registry.
//
//   1. tokenize (the prompt and prompt + max_tokens must fit the context);
//   2. decode worker <- --decode-policy; DecodeWorker.Admit allocates the KV
//      blocks (reusing its prefix cache) and answers where the prefill writes;
//   3. prefill group <- --prefill-policy; PrefillGroup.Prefill with that
//      destination: the stages write the prompt's KV straight into the decode
//      worker's blocks and tell it the first token;
//   4. DecodeWorker.StreamTokens -> the observer (token ids and text deltas;
//      the decode worker detokenizes and applies stop strings).
//
// Failures before the first token (a worker unreachable, a group with a stage
// down, a decode worker dying before it streamed) are retried on other
// workers, up to `max_attempts`, and the failed worker is marked unhealthy in
// the registry until its next successful probe. After the first token an
// error ends the stream (the tokens already sent cannot be taken back).
// Cancel() stops whichever RPC is in flight and frees the request's KV on
// both sides (PrefillGroup.Cancel + DecodeWorker.Abort).
//
// Threads: every call runs on a thread of its own with blocking gRPC calls,
// so a request costs one thread for its lifetime; the router's admission
// limit bounds them. (The callback API would save the threads; at the
// concurrency one router sees — hundreds of streams — the simpler control
// flow of a thread per call wins.) The request's life on that thread is a
// ClusterRequest (router/cluster_request.h); this class checks and tokenizes
// the request, starts the thread and keeps the book of live requests.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grammar/structured_output.h"
#include "grpcpp/channel.h"
#include "router/abort_retrier.h"
#include "router/admission_queue.h"
#include "router/assignment_policy.h"
#include "router/generation_backend.h"
#include "router/router_metrics.h"
#include "router/worker_registry.h"
#include "tokenizer/tokenizer.h"

namespace pdserve::router {

struct RequestBook;  // router/cluster_request.h

struct ClusterBackendOptions {
  ModelDescription model;  // the served model (name, context, vocabulary)
  // Block size of the workers' KV (for the prefix-aware policy's hashes).
  int block_size = 16;
  // Tries per request that fail before they stream anything (each on a
  // freshly assigned worker pair); a migrated stream starts a fresh count.
  int max_attempts = 3;
  // Times one request's stream may move to another decode worker after its
  // worker died, froze or drained mid-stream (router/cluster_request.h).
  int max_migrations = 3;
  // A migrating stream that finds no decode worker in rotation (the only one
  // is restarting) waits this long for one before it fails.
  absl::Duration migration_worker_wait = absl::Seconds(10);
  // With no prefill group in rotation, a request is prefilled by its decode
  // worker (the colocated path) instead of failing with UNAVAILABLE.
  bool prefill_fallback = true;
  // Prompts of at most this many tokens are prefilled by their decode worker
  // (a group's round trip and KV handoff cost more than the prefill itself
  // there); 0: every prompt goes to a group. The planner's profile gives the
  // crossover (`pdserve plan` prints it).
  int local_prefill_max_tokens = 0;
  // Admit, Abort, Cancel.
  absl::Duration rpc_timeout = absl::Seconds(10);
  // Upper bound of one Prefill call (the request's deadline may be sooner).
  absl::Duration prefill_timeout = absl::Seconds(300);
  // Colocated serving: decode workers prefill prompts themselves
  // (AdmitRequest.local_prefill); no prefill groups are used. The baseline
  // that disaggregation is measured against, and a fallback layout.
  bool colocated = false;
  // Routing decisions, retries, TTFT (and its phases), ITL, TPOT, end to end,
  // requests waiting for their first token. Optional, not owned.
  metrics::RouterMetrics* metrics = nullptr;
  // Requests wait here in arrival order for KV room on a decode worker
  // (router/admission_queue.h) instead of failing while the cluster is
  // full.
  AdmissionQueueOptions queue;
  // The cluster's internal token, sent on every call to the workers (they
  // refuse calls without it when they were given one). Empty: none sent.
  std::string internal_token;
};

// Counters for tests, logs and metrics.
struct ClusterBackendStats {
  int64_t started = 0;
  int64_t succeeded = 0;
  int64_t failed = 0;
  int64_t cancelled = 0;
  int64_t retries = 0;
  int64_t migrations = 0;  // streams continued on another decode worker
  int64_t active = 0;
};

class ClusterBackend final : public GenerationBackend {
 public:
  // `tokenizer` (may be null: then only token-id prompts are accepted) and
  // `registry` must outlive the backend.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<ClusterBackend>> Create(
      ClusterBackendOptions options, const tokenizer::Tokenizer* tokenizer,
      WorkerRegistry* registry,
      std::unique_ptr<AssignmentPolicy> prefill_policy,
      std::unique_ptr<AssignmentPolicy> decode_policy);
  // Cancels every call still running and waits for their threads.
  ~ClusterBackend() override;
  ClusterBackend(const ClusterBackend&) = delete;
  ClusterBackend& operator=(const ClusterBackend&) = delete;

  std::vector<ModelDescription> ListModels() const override;
  absl::Status Health() const override;
  absl::StatusOr<std::unique_ptr<GenerationCall>> Start(
      GenerationRequest request, GenerationObserver* observer) override;

  ClusterBackendStats stats() const;

 private:
  ClusterBackend(ClusterBackendOptions options,
                 const tokenizer::Tokenizer* tokenizer,
                 WorkerRegistry* registry,
                 std::unique_ptr<AssignmentPolicy> prefill_policy,
                 std::unique_ptr<AssignmentPolicy> decode_policy);

  std::shared_ptr<grpc::Channel> ChannelFor(const std::string& address);
  // One Abort of `id` at the decode worker `address` (AbortRetrier's send).
  absl::Status SendAbort(const std::string& address, uint64_t id);

  const ClusterBackendOptions options_;
  const tokenizer::Tokenizer* const tokenizer_;
  // Structured output is compiled here first, so that a bad schema is a 400
  // before any worker spends a prefill on it (workers compile again, cached).
  grammar::StructuredOutputCompiler structured_output_;
  WorkerRegistry* const registry_;
  const std::unique_ptr<AssignmentPolicy> prefill_policy_;
  const std::unique_ptr<AssignmentPolicy> decode_policy_;
  // Live requests and counters; the request threads hold it too.
  const std::shared_ptr<RequestBook> book_;
  AdmissionQueue queue_;
  // Prompts longer than context x this many bytes are refused untokenized.
  const int max_token_bytes_;

  absl::Mutex channels_mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<grpc::Channel>> channels_
      ABSL_GUARDED_BY(channels_mu_);
  // Last: its thread sends through channels_, so it stops first.
  AbortRetrier abort_retrier_{[this](const std::string& address, uint64_t id) {
    return SendAbort(address, id);
  }};
};

}  // namespace pdserve::router
