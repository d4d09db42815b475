// PrefillGroup (proto/pdserve/v1/prefill.proto), served by stage 0 of a
// prefill group: it owns the coordinator, stage 0's StageProcess and the
// control stubs of stages 1..S-1 (PrefillStageControl), wires the pipeline at
// start-up, admits requests, tells the decode worker when a request's KV is
// complete, and watches the other stages.
//
// Request life:
//   Prefill (reactor)   validates (precise INVALID_ARGUMENT etc.), queues.
//   control thread      connects every stage's KV source to the request's
//                       decode ranks (once per sink), adds the grants at stage
//                       0 (a bad grant fails here), submits to the
//                       coordinator.
//   coordinator thread  ticket done -> failure: answer (+ revoke the KV at
//                       every stage, on the control thread); success with a
//                       decode address: async DecodeWorker.KvComplete
//                       (generic stub, v1::KvCompleteRequest), answer when
//                       it returns; without one: answer at once.
// Faults: a heartbeat thread pings every stage; the first failed ping marks
// the group down: health NOT_SERVING, the coordinator fails every unfinished
// request with UNAVAILABLE naming the dead stage, surviving stages revoke
// those requests' KV, later submits are UNAVAILABLE. (Serving again needs a
// restart of the group; see README.)
//
// Threads: gRPC callback threads (handlers never block), one control thread,
// one heartbeat thread, the coordinator thread (ticket callbacks, which only
// finish reactors or start async calls), plus the stage's own threads.
#pragma once

#include <grpcpp/generic/generic_stub.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/closable_queue.h"
#include "model/weight_source.h"
#include "pdserve/v1/prefill.grpc.pb.h"
#include "prefill/prefill_coordinator.h"
#include "prefill_worker/stage_process.h"
#include "rpc/auth.h"
#include "rpc/server.h"

namespace pdserve::prefill {

struct PrefillServiceOptions {
  // Served model name, reported in the load report's identity (the router
  // checks it against the decode workers').
  std::string model_name = "model";
  SchedulerOptions scheduler;
  // PrefillStageControl addresses of stages 1..S-1, in stage order.
  std::vector<std::string> peers;
  // How long start-up waits for every peer to answer.
  absl::Duration peer_wait = absl::Seconds(60);
  absl::Duration heartbeat_period = absl::Milliseconds(200);
  // A ping not answered within this marks the group down.
  absl::Duration heartbeat_timeout = absl::Seconds(2);
  // ConnectSinks / CancelKv calls to the stages.
  absl::Duration control_timeout = absl::Seconds(15);
  // DecodeWorker.KvComplete (the decode side waits for its sinks first).
  absl::Duration notify_timeout = absl::Seconds(15);
  // The cluster's internal token(s): PrefillGroup calls must carry one (else
  // UNAUTHENTICATED), and this stage sends the first on its calls to the
  // other stages and to decode workers. Empty: no check, none sent.
  rpc::BearerTokens internal_tokens;
};

class PrefillService final : public pdserve::v1::PrefillGroup::CallbackService {
 public:
  // Wires the group: Hello + Wire to every peer, then stage 0. `weights` and
  // `stage0` (wired here) must outlive the service. Precise errors when a
  // peer is not the stage it should be (index, layers, model, blocks).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<PrefillService>> Create(
      const model::WeightSource& weights, StageProcess* stage0,
      const PrefillServiceOptions& options);
  // Stop the gRPC server first.
  ~PrefillService() override;
  PrefillService(const PrefillService&) = delete;
  PrefillService& operator=(const PrefillService&) = delete;

  // Starts the heartbeat; health follows the group through `server`
  // (not owned; may be null).
  void Start(rpc::RunningServer* server);

  grpc::ServerUnaryReactor* Prefill(
      grpc::CallbackServerContext* context,
      const pdserve::v1::PrefillSubmitRequest* request,
      pdserve::v1::PrefillSubmitResponse* response) override;
  grpc::ServerUnaryReactor* Cancel(
      grpc::CallbackServerContext* context,
      const pdserve::v1::PrefillCancelRequest* request,
      pdserve::v1::PrefillCancelResponse* response) override;
  grpc::ServerUnaryReactor* GetLoad(
      grpc::CallbackServerContext* context,
      const pdserve::v1::PrefillLoadRequest* request,
      pdserve::v1::PrefillLoad* response) override;

  bool serving() const;
  // Drain (SIGTERM): readiness NOT_SERVING and later Prefill calls
  // UNAVAILABLE (the router uses another group or the decode worker); the
  // requests already taken run through the pipeline to their end.
  void StartDrain();
  // Prefill calls not answered yet.
  int64_t in_flight() const;
  // The group was down and every stage answers again: the process should
  // restart in place (prefill_worker's main re-execs) to rewire the group.
  bool recovery_requested() const { return recovery_requested_.load(); }
  // What GetLoad answers (metrics read it too): queue depth, in flight,
  // blocks, completed/failed, per-stage counters.
  pdserve::v1::PrefillLoad Load() const;

 private:
  struct Peer {
    int stage = 0;
    std::unique_ptr<pdserve::v1::PrefillStageControl::Stub> stub;
  };
  struct Call;

  PrefillService(const model::WeightSource& weights, StageProcess* stage0,
                 const PrefillServiceOptions& options);
  absl::Status Wire();
  void ControlLoop();
  void HeartbeatLoop();
  void Admit(const std::shared_ptr<Call>& call);
  void OnPrefilled(const std::shared_ptr<Call>& call,
                   const absl::StatusOr<PrefillOutcome>& result);
  void Notify(const std::shared_ptr<Call>& call);
  // Answers the call once (later calls are no-ops).
  void Answer(const std::shared_ptr<Call>& call, absl::Status status);
  // Revokes these requests' KV at every reachable stage (control thread).
  using KvToCancel = std::vector<std::pair<uint64_t, std::vector<std::string>>>;
  // (request id, its grants): stage 0 re-adds the grants before cancelling so
  // the sinks always hear it; the other stages cancel what they hold.
  void CancelKvEverywhere(const KvToCancel& requests);
  void GroupDown(absl::Status why);
  absl::Status DownStatus() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  grpc::GenericStub* DecodeStub(const std::string& address);

  const model::WeightSource& weights_;
  StageProcess* const stage0_;
  const PrefillServiceOptions options_;
  const int num_stages_;
  std::vector<Peer> peers_;  // stages 1..S-1, fixed after Create
  InProcessStageLink into_stage0_;
  std::unique_ptr<PrefillCoordinator> coordinator_;
  std::unique_ptr<UcxEventReceiver> event_receiver_;

  ClosableQueue<std::function<void()>> control_;
  std::thread control_thread_;
  std::thread heartbeat_thread_;
  absl::Notification stop_;

  mutable absl::Mutex mu_;
  rpc::RunningServer* server_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Call>> calls_
      ABSL_GUARDED_BY(mu_);
  int queued_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status down_ ABSL_GUARDED_BY(mu_);  // non-OK once a stage died
  int dead_stage_ ABSL_GUARDED_BY(mu_) = -1;
  std::atomic<bool> recovery_requested_{false};
  std::vector<pdserve::v1::PrefillStageLoad> stage_loads_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::unique_ptr<grpc::GenericStub>>
      decode_stubs_ ABSL_GUARDED_BY(mu_);
  // Control thread only: sinks every stage's source is connected to.
  absl::flat_hash_set<std::string> connected_sinks_;
};

}  // namespace pdserve::prefill
