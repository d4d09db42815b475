#include "prefill_worker/stage_control_service.h"

#include <vector>

#include "rpc/auth.h"
#include "rpc/status_conversion.h"

namespace pdserve::prefill {

namespace v1 = ::pdserve::v1;

void FillStageLoad(const StageProcessOptions& options, const StageStats& stats,
                   v1::PrefillStageLoad* load) {
  load->set_stage(options.stage);
  load->set_layer_begin(options.shard.layer_begin);
  load->set_layer_end(options.shard.layer_end);
  load->set_reachable(true);
  load->set_busy_seconds(stats.busy_seconds);
  load->set_microbatches(stats.microbatches);
  load->set_tokens(stats.tokens);
  load->set_chunks(stats.chunks);
  load->set_kv_writes(stats.kv_writes);
  load->set_failures(stats.failures);
}

StageControlService::StageControlService(StageProcess* stage,
                                         std::string model_identity,
                                         rpc::BearerTokens internal_tokens)
    : stage_(stage),
      model_identity_(std::move(model_identity)),
      internal_tokens_(std::move(internal_tokens)) {
  job_thread_ = std::thread([this] { JobLoop(); });
}

StageControlService::~StageControlService() {
  jobs_.Close();
  if (job_thread_.joinable()) job_thread_.join();
}

void StageControlService::JobLoop() {
  while (std::optional<std::function<void()>> job = jobs_.Pop()) (*job)();
}

grpc::ServerUnaryReactor* StageControlService::Defer(
    grpc::CallbackServerContext* context, std::function<absl::Status()> job) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!jobs_.Push([reactor, job = std::move(job)] {
        reactor->Finish(rpc::ToGrpcStatus(job()));
      })) {
    reactor->Finish(
        grpc::Status(grpc::StatusCode::UNAVAILABLE, "stage is shutting down"));
  }
  return reactor;
}

grpc::ServerUnaryReactor* StageControlService::Hello(
    grpc::CallbackServerContext* context, const v1::StageHelloRequest*,
    v1::StageHelloResponse* response) {
  if (absl::Status auth = rpc::Authenticate(*context, internal_tokens_);
      !auth.ok()) {
    return rpc::Refused(context, auth);
  }
  const StageProcessOptions& o = stage_->options();
  response->set_stage(o.stage);
  response->set_num_stages(o.num_stages);
  response->set_layer_begin(o.shard.layer_begin);
  response->set_layer_end(o.shard.layer_end);
  response->set_model_identity(model_identity_);
  response->set_block_size(o.block_size);
  response->set_num_blocks(o.num_blocks);
  response->set_link_address(stage_->link_address());
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* StageControlService::Wire(
    grpc::CallbackServerContext* context, const v1::StageWireRequest* request,
    v1::StageWireResponse*) {
  if (absl::Status auth = rpc::Authenticate(*context, internal_tokens_);
      !auth.ok()) {
    return rpc::Refused(context, auth);
  }
  return Defer(context, [this, next = request->next_stage_address(),
                         coordinator = request->coordinator_address()] {
    return stage_->Wire(next, coordinator);
  });
}

grpc::ServerUnaryReactor* StageControlService::ConnectSinks(
    grpc::CallbackServerContext* context,
    const v1::StageConnectSinksRequest* request,
    v1::StageConnectSinksResponse*) {
  if (absl::Status auth = rpc::Authenticate(*context, internal_tokens_);
      !auth.ok()) {
    return rpc::Refused(context, auth);
  }
  std::vector<std::string> descriptors(request->sink_descriptors().begin(),
                                       request->sink_descriptors().end());
  return Defer(context, [this, descriptors = std::move(descriptors)] {
    return stage_->ConnectSinks(descriptors);
  });
}

grpc::ServerUnaryReactor* StageControlService::CancelKv(
    grpc::CallbackServerContext* context,
    const v1::StageCancelKvRequest* request, v1::StageCancelKvResponse*) {
  if (absl::Status auth = rpc::Authenticate(*context, internal_tokens_);
      !auth.ok()) {
    return rpc::Refused(context, auth);
  }
  std::vector<uint64_t> ids(request->request_ids().begin(),
                            request->request_ids().end());
  return Defer(context, [this, ids = std::move(ids)] {
    stage_->CancelKv(ids);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* StageControlService::Ping(
    grpc::CallbackServerContext* context, const v1::StagePingRequest*,
    v1::PrefillStageLoad* response) {
  if (absl::Status auth = rpc::Authenticate(*context, internal_tokens_);
      !auth.ok()) {
    return rpc::Refused(context, auth);
  }
  {
    absl::MutexLock lock(&mu_);
    last_ping_ = absl::Now();
  }
  FillStageLoad(stage_->options(), stage_->stats(), response);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* StageControlService::Restart(
    grpc::CallbackServerContext* context, const v1::StageRestartRequest*,
    v1::StageRestartResponse*) {
  if (absl::Status auth = rpc::Authenticate(*context, internal_tokens_);
      !auth.ok()) {
    return rpc::Refused(context, auth);
  }
  restart_requested_.store(true);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

absl::Time StageControlService::last_ping() const {
  absl::MutexLock lock(&mu_);
  return last_ping_;
}

}  // namespace pdserve::prefill
