// PrefillStageControl (proto/pdserve/v1/prefill.proto) on a stage i > 0: how
// stage 0 learns the stage's UCX link address, wires it, points its KV source
// at a request's decode ranks, revokes KV, and checks it is alive.
//
// Threads: gRPC callback threads run the handlers; Hello and Ping answer at
// once, while Wire, ConnectSinks and CancelKv (which block on engine start-up
// or transport handshakes) run on one job thread owned here.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/closable_queue.h"
#include "pdserve/v1/prefill.grpc.pb.h"
#include "prefill_worker/stage_process.h"
#include "rpc/auth.h"

namespace pdserve::prefill {

class StageControlService final
    : public pdserve::v1::PrefillStageControl::CallbackService {
 public:
  // `stage` must outlive the service; `model_identity` is
  // ModelConfig::Identity().
  // `internal_tokens`: what every call must carry (empty: no check).
  StageControlService(StageProcess* stage, std::string model_identity,
                      rpc::BearerTokens internal_tokens = {});
  // Stop the gRPC server first; then drains the job thread.
  ~StageControlService() override;

  grpc::ServerUnaryReactor* Hello(
      grpc::CallbackServerContext* context,
      const pdserve::v1::StageHelloRequest* request,
      pdserve::v1::StageHelloResponse* response) override;
  grpc::ServerUnaryReactor* Wire(
      grpc::CallbackServerContext* context,
      const pdserve::v1::StageWireRequest* request,
      pdserve::v1::StageWireResponse* response) override;
  grpc::ServerUnaryReactor* ConnectSinks(
      grpc::CallbackServerContext* context,
      const pdserve::v1::StageConnectSinksRequest* request,
      pdserve::v1::StageConnectSinksResponse* response) override;
  grpc::ServerUnaryReactor* CancelKv(
      grpc::CallbackServerContext* context,
      const pdserve::v1::StageCancelKvRequest* request,
      pdserve::v1::StageCancelKvResponse* response) override;
  grpc::ServerUnaryReactor* Ping(
      grpc::CallbackServerContext* context,
      const pdserve::v1::StagePingRequest* request,
      pdserve::v1::PrefillStageLoad* response) override;
  grpc::ServerUnaryReactor* Restart(
      grpc::CallbackServerContext* context,
      const pdserve::v1::StageRestartRequest* request,
      pdserve::v1::StageRestartResponse* response) override;

  // When stage 0 last pinged (or InfinitePast before any ping).
  absl::Time last_ping() const;
  // Stage 0 asked this stage to restart (the process's main loop re-execs).
  bool restart_requested() const { return restart_requested_.load(); }

 private:
  // Runs `job` on the job thread and finishes `reactor` with its status.
  grpc::ServerUnaryReactor* Defer(grpc::CallbackServerContext* context,
                                  std::function<absl::Status()> job);
  void JobLoop();

  StageProcess* const stage_;
  const std::string model_identity_;
  const rpc::BearerTokens internal_tokens_;
  ClosableQueue<std::function<void()>> jobs_;
  std::thread job_thread_;
  mutable absl::Mutex mu_;
  absl::Time last_ping_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::atomic<bool> restart_requested_{false};
};

// Fills `load` from a stage's counters.
void FillStageLoad(const StageProcessOptions& options, const StageStats& stats,
                   pdserve::v1::PrefillStageLoad* load);

}  // namespace pdserve::prefill
