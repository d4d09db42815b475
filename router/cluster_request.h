// One request's life through the cluster, from the router's side. The mode is
// chosen once when the request starts (RequestMode); then attempts run —
// admit on a decode worker, prefill on a prefill group, stream from the
// decode worker, each phase as it applies to the mode — until the request
// finishes or the attempts are spent. A ClusterRequest owns everything of
// the request (its attempts, the echo and prompt scores, timing, metrics
// bookkeeping) and lives on the request's own thread (ClusterBackend::Start).
//
// Contract (router/README.md, "Request life"; when code and that document
// disagree, it is a design bug):
//   * the observer gets exactly one OnDone, the last callback, from Finish;
//   * once a decode worker admitted the request, every way out of the
//     attempt frees its KV there (Abort) unless the stream finished, and a
//     failed or cancelled Prefill is cancelled at its group;
//   * an attempt is retried on freshly assigned workers only for errors
//     another worker may not have (UNAVAILABLE, RESOURCE_EXHAUSTED, ABORTED),
//     and never past the request's deadline;
//   * a stream that breaks after tokens reached the client (its decode
//     worker died, froze or drained past its timeout) migrates: another
//     decode worker is admitted with the prompt + every token streamed so
//     far (AdmitRequest.resume) and continues the same stream, so the client
//     sees no error, no duplicate and no missing token, and usage counts
//     each token once (at most max_migrations times);
//   * a worker that answered UNAVAILABLE is marked unhealthy in the registry
//     until its next successful probe.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "pdserve/v1/decode.grpc.pb.h"
#include "pdserve/v1/prefill.grpc.pb.h"
#include "router/abort_retrier.h"
#include "router/admission_queue.h"
#include "router/cluster_backend.h"

namespace pdserve::router {

// Cancellation of one request, shared by its call handle (any thread) and its
// thread: Cancel() interrupts whichever RPC is in flight.
class RequestCancellation {
 public:
  void Cancel();
  bool cancelled() const { return cancelled_.load(); }
  // Registers `context` as the RPC in flight; false when already cancelled.
  [[nodiscard]] bool Enter(grpc::ClientContext* context);
  void Leave();

 private:
  std::atomic<bool> cancelled_{false};
  absl::Mutex mu_;
  grpc::ClientContext* active_ ABSL_GUARDED_BY(mu_) = nullptr;
};

// A backend's live requests and counters. Shared with the request threads,
// so it outlives the backend until the last of them ends.
struct RequestBook {
  absl::Mutex mu;
  std::list<std::weak_ptr<RequestCancellation>> calls ABSL_GUARDED_BY(mu);
  ClusterBackendStats stats ABSL_GUARDED_BY(mu);
  // Requests started and not yet at their first token (the "queued" gauge:
  // the router itself never queues, so this is time spent in admission,
  // prefill and KV transfer).
  std::atomic<int64_t> awaiting_first_token{0};
};

// What a request uses of its backend; all of it outlives the request (the
// backend's destructor waits for every request thread).
struct ClusterServices {
  const ClusterBackendOptions& options;
  const tokenizer::Tokenizer* tokenizer;  // may be null
  WorkerRegistry& registry;
  AssignmentPolicy& prefill_policy;
  AssignmentPolicy& decode_policy;
  std::function<std::shared_ptr<grpc::Channel>(const std::string&)> channel_for;
  RequestBook& book;
  AdmissionQueue& queue;
  // Aborts the decode worker did not answer, sent again (may be null).
  AbortRetrier* abort_retrier = nullptr;
};

// Which workers a request needs, decided once from the request and the
// layout.
enum class RequestMode {
  // Prefill group writes the prompt's KV into a decode worker, which streams.
  kDisaggregated,
  // The decode worker prefills (and, with echo + logprobs, scores) itself.
  kColocated,
  // max_tokens 0 with echo + logprobs, disaggregated: a prefill group scores
  // the prompt and nobody decodes.
  kScoreOnPrefill,
  // max_tokens 0 without scores: the echoed prompt is the whole answer.
  kEchoOnly,
};
RequestMode ModeFor(const GenerationRequest& request, bool colocated);

class ClusterRequest {
 public:
  ClusterRequest(const ClusterServices& services,
                 std::shared_ptr<RequestCancellation> cancellation,
                 GenerationRequest request, std::vector<int32_t> prompt_ids,
                 GenerationObserver* observer);
  ClusterRequest(const ClusterRequest&) = delete;
  ClusterRequest& operator=(const ClusterRequest&) = delete;

  // Runs the request to its end (the observer's OnDone).
  void Run();

 private:
  // What a phase leaves the attempt loop to do.
  enum class Next {
    kContinue,  // on to the next phase
    kRetry,     // another attempt, on other workers
    kNoRoom,    // the decode worker has no KV for it now: wait in line
    kMigrate,   // the stream broke after tokens: continue it elsewhere
    kDone,      // finished: OnDone was called
  };
  // One try on one pair of workers.
  struct Attempt {
    uint64_t wire_id = 0;
    // The decode worker prefills the prompt itself (AdmitRequest
    // .local_prefill): colocated serving, a short prompt, no prefill group to
    // be had, or a migrated stream. Decided in Admit; `prefill_where` names
    // why, for the metric.
    bool local_prefill = false;
    const char* prefill_where = "";
    // The attempt continues a stream another decode worker began
    // (AdmitRequest.resume).
    bool resume = false;
    std::string decode_address;
    // Counts the request against its decode worker until the attempt ends
    // (what least-loaded assignment reads).
    std::optional<WorkerLease> decode_lease;
    std::unique_ptr<v1::DecodeWorker::Stub> decode;  // null: no decode side
    v1::AdmitResponse admit;
    // The prefill group, picked before the decode admit (its lease counts the
    // request against the group until the attempt ends).
    std::string prefill_address;
    std::optional<WorkerLease> prefill_lease;
    absl::Time prefill_returned_at;
    metrics::TtftBreakdown breakdown;
  };

  bool UsesDecode(const Attempt& a) const;
  // Where the attempt's prompt is prefilled: on a group, unless the mode,
  // a migration or ClusterBackendOptions say the decode worker does it.
  void DecidePrefill(Attempt& a) const;
  // Leases a prefill group for the attempt, or, with none in rotation and
  // the fallback on, has its decode worker prefill (a.local_prefill); the
  // assignment's error otherwise.
  absl::Status PickPrefillGroup(Attempt& a);
  // Whether a request finding no prefill group for this reason is prefilled
  // by its decode worker (ClusterBackendOptions::prefill_fallback).
  bool FallsBackToDecode(const absl::Status& no_group) const;
  bool resuming() const { return !streamed_ids_.empty(); }
  // A broken stream that had delivered tokens: migrate, or finish with it
  // when the migrations are spent or it cannot help.
  Next StreamBroke(const absl::Status& status, const std::string& address);
  Next RunAttempt(Attempt& a);
  // In the admission queue, in arrival order: a prefill group picked, then
  // the decode worker's Admit; a refusal for lack of KV waits for room.
  Next Admit(Attempt& a);
  Next AdmitOnDecode(Attempt& a);
  Next PrefillOnGroup(Attempt& a);
  Next StreamFromDecode(Attempt& a);
  // One wire delta as the observer's, its logprobs checked against its ids.
  absl::StatusOr<GenerationDelta> ReadDelta(const v1::DecodeDelta& in,
                                            const Attempt& a) const;
  // TTFT (and its breakdown) at the first tokens, inter-token latency after.
  void ObserveTokens(size_t tokens, Attempt& a);
  // Echo: the space the worker's detokenizer dropped before the first word
  // of the continuation (`restore_space` carries over until a delta has
  // text).
  void RestoreEchoSpace(GenerationDelta& out, bool& restore_space) const;
  // Frees the request's blocks at the attempt's decode worker (best effort:
  // NOT_FOUND when it already finished or was never admitted).
  // Returns the Abort's status (OK without a decode side).
  absl::Status AbortDecode(const Attempt& a);
  // A failed RPC of `who` at `address`: remembers it, marks an UNAVAILABLE
  // worker unhealthy, and retries when another worker may succeed (and
  // `retry` allows), else finishes with it.
  Next Failed(const absl::Status& status, const char* who,
              const std::string& address, bool retry);

  void ResetEcho();
  // The prompt's scores as a worker (`who`) reported them, one per prompt
  // token after the first; INTERNAL for any other count.
  absl::Status TakeScores(
      const google::protobuf::RepeatedPtrField<v1::TokenLogprob>& scores,
      const std::string& who);
  TokenAlternative Alternative(int32_t id, float logprob) const;
  TokenLogprob ToTokenLogprob(int32_t id, const v1::TokenLogprob& l) const;
  void FirstTokenReached();
  Next Finish(absl::Status status);
  // A request generating nothing ends with one delta: the echoed prompt.
  Next FinishWithEcho();

  const ClusterServices& services_;
  const ClusterBackendOptions& options_;
  metrics::RouterMetrics* const metrics_;
  const std::shared_ptr<RequestCancellation> cancellation_;
  const GenerationRequest request_;
  const std::vector<int32_t> prompt_ids_;
  GenerationObserver* const observer_;
  const RequestMode mode_;
  const bool submit_scored_;  // echo + logprobs: the prompt is scored
  const std::vector<uint64_t> block_hashes_;
  v1::SamplingParams sampling_;

  const absl::Time started_;
  GenerationUsage usage_;
  GenerationTiming timing_;
  std::optional<PromptEcho> echo_;
  bool delivered_ = false;  // a delta reached the observer: no more retries
  bool awaiting_first_ = true;
  absl::Time first_token_at_ = absl::InfinitePast();
  absl::Time last_token_at_ = absl::InfinitePast();
  std::string retry_side_;
  int attempt_ = 0;
  // Every token id the client got, in order, and the bytes of worker text
  // with them: what a migrated stream resumes from.
  std::vector<int32_t> streamed_ids_;
  int64_t streamed_text_bytes_ = 0;
  int migrations_ = 0;
  absl::Status last_error_ = absl::UnavailableError("no attempt made");
};

}  // namespace pdserve::router
