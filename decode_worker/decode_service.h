// The gRPC face of a decode worker (proto/pdserve/v1/decode.proto) over a
// decode::DecodeWorker, with every TP rank's KV pool registered with the
// transport as a KvSink (one UcxWorker per rank: one sink per UCX worker).
//
// Request life on the wire:
//   Admit       DecodeWorker::Admit allocates blocks (prefix reuse); each
//               rank's sink grants the uncached suffix to the prefill side,
//               under a lease that restarts with every write notice.
//   KvComplete  waits (bounded) for every rank's sink to have every layer x
//               token, then DecodeWorker::MarkKvComplete(first token).
//   StreamTokens  the request's deltas, buffered in its Channel from the
//               start so a stream may attach before or after KvComplete.
//   Abort       KV still in flight: the grants are revoked first and the
//               request is aborted when the sinks release its blocks (no late
//               put can then land in reused blocks); otherwise at once.
// A sink that gives up on a request (lease expiry, a writer's death, revoke)
// aborts it in the worker; its stream ends with the sink's status.
//
// Threads: gRPC callback threads run the handlers and reactions; the
// DecodeWorker's scheduler thread calls StreamCallbacks, which only queue into
// the request's Channel (never block); one completer thread runs the bounded
// sink waits of KvComplete; UCX progress threads call the sinks' release
// callbacks, which only call DecodeWorker::Abort (non-blocking).
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/recent_ids.h"
#include "decode/decode_worker.h"
#include "model/model_config.h"
#include "pdserve/v1/decode.grpc.pb.h"
#include "rpc/auth.h"
#include "transport/kv_transfer.h"
#include "transport/ucx_worker.h"

namespace pdserve::decode_worker {

struct DecodeServiceOptions {
  std::string model_name = "model";
  // Sink lease: a request whose KV makes no progress this long is freed. The
  // DecodeWorker's own kv_lease must be longer (it is only a backstop: the
  // sink's lease restarts with every write, the worker's does not).
  absl::Duration kv_lease = absl::Seconds(30);
  // How long KvComplete waits for the sinks to confirm every layer x token,
  // counted from the call's arrival (calls queue for one completer thread).
  absl::Duration kv_complete_timeout = absl::Seconds(10);
  // Finished streams nobody attached to are dropped after this long.
  absl::Duration unclaimed_stream_ttl = absl::Seconds(60);
  transport::UcxWorkerOptions ucx;
  // One UCX worker per TP rank for the sinks, made by the caller (who may
  // have allocated the ranks' KV pools through them; they must outlive the
  // service). Empty: the service makes its own from `ucx`.
  std::vector<transport::UcxWorker*> rank_workers;
  // The cluster's internal token(s): every DecodeWorker call must carry one
  // ("authorization: Bearer <token>"), else UNAUTHENTICATED. Empty: no
  // check (tests, a trusted network).
  rpc::BearerTokens internal_tokens;
};

// One request's token stream: deltas queued by the worker's callback, written
// by at most one attached reactor. Internal; in the header for the reactor.
struct Channel;

class DecodeService final : public pdserve::v1::DecodeWorker::CallbackService {
 public:
  // `worker` must outlive the service. Creates the UCX workers and sinks.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<DecodeService>> Create(
      decode::DecodeWorker* worker, const model::ModelConfig& config,
      const DecodeServiceOptions& options);
  // Stop the gRPC server first (no handler may run during destruction).
  ~DecodeService() override;
  DecodeService(const DecodeService&) = delete;
  DecodeService& operator=(const DecodeService&) = delete;

  grpc::ServerUnaryReactor* Admit(
      grpc::CallbackServerContext* context,
      const pdserve::v1::AdmitRequest* request,
      pdserve::v1::AdmitResponse* response) override;
  grpc::ServerUnaryReactor* KvComplete(
      grpc::CallbackServerContext* context,
      const pdserve::v1::KvCompleteRequest* request,
      pdserve::v1::KvCompleteResponse* response) override;
  grpc::ServerWriteReactor<pdserve::v1::DecodeDelta>* StreamTokens(
      grpc::CallbackServerContext* context,
      const pdserve::v1::StreamTokensRequest* request) override;
  grpc::ServerUnaryReactor* Abort(
      grpc::CallbackServerContext* context,
      const pdserve::v1::AbortRequest* request,
      pdserve::v1::AbortResponse* response) override;
  grpc::ServerUnaryReactor* GetLoad(grpc::CallbackServerContext* context,
                                    const pdserve::v1::GetLoadRequest* request,
                                    pdserve::v1::DecodeLoad* response) override;

  // Drain (SIGTERM): from now on Admit answers UNAVAILABLE (the router
  // admits elsewhere); requests already admitted keep their KV transfer and
  // stream to their end. Readiness (grpc.health) is the caller's to flip.
  void StartDrain();
  bool draining() const;
  // Streams a client still waits on: admitted and not finished, or finished
  // with their last delta not yet written.
  int64_t live_streams() const;
  // Blocks until live_streams() is 0 (true) or `timeout` passed (false: the
  // streams left are cut when the server stops; the router migrates them).
  bool WaitDrained(absl::Duration timeout);
  // Ends every stream not finished yet with `why` (UNAVAILABLE: the router
  // continues it on another worker from the tokens it got) and aborts its
  // request: the end of a drain that ran out of time.
  void CutStreams(const absl::Status& why);

  // Requests with a channel (live, or finished and not yet streamed).
  int64_t channels() const;
  // Requests whose sinks gave up waiting for KV (the sink lease expired).
  int64_t lease_expiries() const {
    return lease_expiries_.load(std::memory_order_relaxed);
  }
  // The sink of rank r (tests).
  transport::KvSink& sink(int rank) { return *ranks_[rank].sink; }

  // Called by a stream reactor once it wrote the final delta.
  void ForgetChannel(uint64_t request_id, const Channel* channel);

 private:
  // The model and KV layout this worker serves (Admit and GetLoad report it).
  void FillIdentity(pdserve::v1::ModelIdentity* model) const;
  struct Rank {
    std::unique_ptr<transport::UcxWorker> owned_ucx;  // when not given
    transport::UcxWorker* ucx = nullptr;
    std::unique_ptr<transport::KvSink> sink;
  };
  struct CompleteJob {
    uint64_t request_id = 0;
    int32_t first_token = 0;
    engine::TokenLogprobs first_logprobs;
    std::shared_ptr<Channel> channel;
    grpc::ServerUnaryReactor* reactor = nullptr;
    // When the KvComplete call arrived: its kv_complete_timeout runs from
    // here, not from when the completer thread reaches it.
    absl::Time received;
  };

  DecodeService(decode::DecodeWorker* worker, const model::ModelConfig& config,
                const DecodeServiceOptions& options);
  absl::Status AdmitImpl(const pdserve::v1::AdmitRequest& request,
                         pdserve::v1::AdmitResponse* response);
  // Rank `rank`'s sink released a failed request's blocks (UCX progress
  // thread).
  void OnSinkRelease(uint64_t request_id, int rank, const absl::Status& why);

  // ---- The transport's hold on a request's granted blocks -----------------
  // The blocks a request's grants cover stay pinned in the worker's block
  // manager (DecodeWorker::PinBlocks) from Admit until every rank's sink is
  // done with its grant: its KV landed and was waited for, or its failure's
  // revoke quarantine ended (release_blocks). Only then can they go to
  // another request — whatever became of this one in the worker — so no
  // block is ever granted twice (a one-sided put of a revoked request could
  // otherwise land in another request's KV).
  enum class RankHold : uint8_t { kGranted, kCancelling, kDone };
  struct TransportHold {
    std::vector<int64_t> blocks;
    std::vector<RankHold> ranks;
    std::shared_ptr<Channel> channel;
  };
  // Pins `blocks` for the request's grants on every rank.
  absl::Status HoldForTransport(uint64_t request_id,
                                std::vector<int64_t> blocks,
                                std::shared_ptr<Channel> channel);
  // The sink of `rank` is done with the request's grant (idempotent); the
  // last rank unpins the blocks.
  void RankDone(uint64_t request_id, int rank);
  // Stops every grant of the request still running (their sinks revoke and
  // release them after the quarantine); grants whose KV already landed are
  // done at once. Idempotent; any thread.
  void DropGrants(uint64_t request_id);
  // Grants of requests the worker finished without their KV completing (a
  // lease expiry, an error): dropped from the completer thread.
  void DropGrantsOfFinished();
  void CompleterLoop();
  absl::Status Complete(const CompleteJob& job);
  std::shared_ptr<Channel> FindChannel(uint64_t request_id) const;
  // Marks the channel's Admit done (with the tokens its grants cover) and
  // says whether an Abort arrived meanwhile.
  bool AbortedWhileAdmitting(Channel& channel, int64_t granted_tokens);
  static absl::Status AbortedDuringAdmit(uint64_t request_id);
  void RememberEarlyAbort(uint64_t request_id);

  decode::DecodeWorker* const worker_;
  const model::ModelConfig config_;
  const DecodeServiceOptions options_;
  std::vector<Rank> ranks_;  // fixed after Create
  absl::Mutex holds_mu_;
  absl::flat_hash_map<uint64_t, TransportHold> holds_
      ABSL_GUARDED_BY(holds_mu_);

  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Channel>> channels_
      ABSL_GUARDED_BY(mu_);
  std::deque<CompleteJob> jobs_ ABSL_GUARDED_BY(mu_);
  // Ids aborted before their Admit arrived, refused when it does. An Admit
  // later than a minute is one the router stopped waiting for long ago (its
  // RPC deadline is far shorter); the bound keeps a flood of Aborts for
  // made-up ids from growing it without limit.
  RecentIds early_aborts_ ABSL_GUARDED_BY(mu_){1 << 16, absl::Seconds(60)};
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  std::thread completer_;
  std::atomic<int64_t> lease_expiries_{0};
};

}  // namespace pdserve::decode_worker
