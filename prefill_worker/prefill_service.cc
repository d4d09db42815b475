#include "prefill_worker/prefill_service.h"

#include <grpcpp/grpcpp.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kv/kv_layout.h"
#include "prefill_worker/stage_control_service.h"
#include "rpc/auth.h"
#include "rpc/request_contract.h"
#include "rpc/status_conversion.h"

namespace pdserve::prefill {

namespace v1 = ::pdserve::v1;

namespace {

constexpr char kKvCompleteMethod[] = "/pdserve.v1.DecodeWorker/KvComplete";

absl::Status Annotate(const grpc::Status& status, const std::string& what) {
  absl::Status s = rpc::FromGrpcStatus(status);
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

}  // namespace

struct PrefillService::Call {
  uint64_t id = 0;
  grpc::ServerUnaryReactor* reactor = nullptr;
  v1::PrefillSubmitResponse* response = nullptr;
  PrefillRequest request;
  std::vector<std::string> descriptors;
  std::string decode_address;
  absl::Time received, submitted, prefilled;
  // Guarded by the service's mu_.
  std::shared_ptr<PrefillTicket> ticket;
  bool cancelled = false;
  bool answered = false;
  // The KvComplete call (alive until its callback ran).
  grpc::ClientContext notify_context;
  grpc::ByteBuffer notify_request, notify_response;
};

PrefillService::PrefillService(const model::WeightSource& weights,
                               StageProcess* stage0,
                               const PrefillServiceOptions& options)
    : weights_(weights),
      stage0_(stage0),
      options_(options),
      num_stages_(static_cast<int>(options.peers.size()) + 1) {}

absl::StatusOr<std::unique_ptr<PrefillService>> PrefillService::Create(
    const model::WeightSource& weights, StageProcess* stage0,
    const PrefillServiceOptions& options) {
  const StageProcessOptions& o = stage0->options();
  if (o.stage != 0 ||
      o.num_stages != static_cast<int>(options.peers.size()) + 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stage 0 of ", o.num_stages, " stages needs ", o.num_stages - 1,
        " peer addresses, got ", options.peers.size()));
  }
  auto service = std::unique_ptr<PrefillService>(
      new PrefillService(weights, stage0, options));
  PDS_ASSIGN_OR_RETURN(
      service->coordinator_,
      PrefillCoordinator::Create(weights.config(), service->num_stages_,
                                 options.scheduler, &service->into_stage0_));
  service->event_receiver_ = std::make_unique<UcxEventReceiver>(
      stage0->link_worker(), service->coordinator_.get());
  service->control_thread_ =
      std::thread([s = service.get()] { s->ControlLoop(); });
  PDS_RETURN_IF_ERROR(service->Wire());
  return service;
}

absl::Status PrefillService::Wire() {
  const model::ModelConfig& config = weights_.config();
  const StageProcessOptions& o = stage0_->options();
  if (o.shard.layer_begin != 0) {
    return absl::InvalidArgumentError("stage 0 must start at layer 0");
  }
  std::vector<std::string> link_addresses = {stage0_->link_address()};
  int layer = o.shard.layer_end;
  for (size_t i = 0; i < options_.peers.size(); ++i) {
    const int want = static_cast<int>(i) + 1;
    const std::string& address = options_.peers[i];
    Peer peer;
    peer.stage = want;
    peer.stub = v1::PrefillStageControl::NewStub(
        rpc::CreateChannel(address, options_.internal_tokens.first()));
    grpc::ClientContext context;
    // Peers may still be loading weights: wait for them (bounded).
    context.set_wait_for_ready(true);
    context.set_deadline(absl::ToChronoTime(absl::Now() + options_.peer_wait));
    v1::StageHelloResponse hello;
    grpc::Status s = peer.stub->Hello(&context, {}, &hello);
    if (!s.ok()) {
      return Annotate(s, absl::StrCat("prefill stage ", want, " at ", address));
    }
    auto mismatch = [&](const std::string& what) {
      return absl::FailedPreconditionError(
          absl::StrCat("the peer at ", address, " (expected stage ", want,
                       " of ", num_stages_, "): ", what));
    };
    if (hello.stage() != want || hello.num_stages() != num_stages_) {
      return mismatch(absl::StrCat("it is stage ", hello.stage(), " of ",
                                   hello.num_stages()));
    }
    if (hello.model_identity() != config.Identity()) {
      return mismatch(absl::StrCat("it serves model '", hello.model_identity(),
                                   "', not '", config.Identity(), "'"));
    }
    if (hello.block_size() != o.block_size ||
        hello.num_blocks() != o.num_blocks) {
      return mismatch(absl::StrCat(
          "it has ", hello.num_blocks(), " KV blocks of ", hello.block_size(),
          " tokens, stage 0 has ", o.num_blocks, " of ", o.block_size));
    }
    if (hello.layer_begin() != layer || hello.layer_end() <= layer) {
      return mismatch(absl::StrCat("it holds layers [", hello.layer_begin(),
                                   ", ", hello.layer_end(),
                                   ") but the previous stage ends at ", layer));
    }
    layer = hello.layer_end();
    link_addresses.push_back(hello.link_address());
    peers_.push_back(std::move(peer));
  }
  if (layer != config.num_layers) {
    return absl::FailedPreconditionError(
        absl::StrCat("the stages cover layers [0, ", layer,
                     ") but the model has ", config.num_layers));
  }
  // Later stages first: each is listening before its predecessor may send.
  for (int i = static_cast<int>(peers_.size()) - 1; i >= 0; --i) {
    v1::StageWireRequest wire;
    if (i + 2 < num_stages_) wire.set_next_stage_address(link_addresses[i + 2]);
    wire.set_coordinator_address(stage0_->link_address());
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + options_.peer_wait));
    v1::StageWireResponse ignored;
    grpc::Status s = peers_[i].stub->Wire(&context, wire, &ignored);
    if (!s.ok()) {
      return Annotate(s, absl::StrCat("wiring prefill stage ", i + 1));
    }
  }
  PDS_RETURN_IF_ERROR(stage0_->WireFirst(
      &into_stage0_, num_stages_ > 1 ? link_addresses[1] : std::string(),
      coordinator_.get()));
  absl::MutexLock lock(&mu_);
  stage_loads_.resize(num_stages_);
  return absl::OkStatus();
}

PrefillService::~PrefillService() {
  stop_.Notify();
  if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
  control_.Close();
  if (control_thread_.joinable()) control_thread_.join();
  // Fails what is left (UNAVAILABLE), then ends the pipeline: stage 0 drains
  // and closes its link to stage 1, which ends the next, and so on.
  if (coordinator_ != nullptr) coordinator_->Shutdown();
  into_stage0_.Close();
  stage0_->Shutdown();
  event_receiver_.reset();
  coordinator_.reset();
}

void PrefillService::Start(rpc::RunningServer* server) {
  {
    absl::MutexLock lock(&mu_);
    server_ = server;
    if (server_ != nullptr) server_->SetServing(down_.ok() && !draining_);
  }
  heartbeat_thread_ = std::thread([this] { HeartbeatLoop(); });
}

bool PrefillService::serving() const {
  absl::MutexLock lock(&mu_);
  return down_.ok();
}

void PrefillService::StartDrain() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
  if (server_ != nullptr) server_->SetServing(false);
}

int64_t PrefillService::in_flight() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(calls_.size());
}

absl::Status PrefillService::DownStatus() const {
  return absl::UnavailableError(
      absl::StrCat("prefill group is not serving: ", down_.message()));
}

void PrefillService::ControlLoop() {
  while (std::optional<std::function<void()>> job = control_.Pop()) (*job)();
}

// ---------------------------------------------------------------------------
// Prefill
// ---------------------------------------------------------------------------

grpc::ServerUnaryReactor* PrefillService::Prefill(
    grpc::CallbackServerContext* context,
    const v1::PrefillSubmitRequest* request,
    v1::PrefillSubmitResponse* response) {
  if (absl::Status auth = rpc::Authenticate(*context, options_.internal_tokens);
      !auth.ok()) {
    return rpc::Refused(context, auth);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto call = std::make_shared<Call>();
  call->id = request->request_id();
  call->reactor = reactor;
  call->response = response;
  call->received = absl::Now();
  PrefillRequest& r = call->request;
  r.request_id = request->request_id();
  r.prompt.assign(request->prompt_ids().begin(), request->prompt_ids().end());
  const engine::SamplingParams sampling =
      rpc::SamplingFromWire(request->sampling(), /*seed_if_unset=*/0);
  r.sampling = sampling;
  r.top_logprobs = request->top_logprobs();
  r.prompt_logprobs = request->prompt_logprobs();
  r.write_kv = request->has_destination();
  const v1::PrefillDestination& destination = request->destination();
  call->decode_address = destination.decode_address();
  if (destination.cached_tokens() < 0 ||
      destination.cached_tokens() > static_cast<int64_t>(r.prompt.size())) {
    r.kv_dst_offset = -1;  // rejected by the validation below, precisely
  } else {
    r.kv_dst_offset = static_cast<int>(destination.cached_tokens());
  }
  absl::Status status = rpc::CheckSampling(sampling);
  if (status.ok()) {
    // Alternatives ride on token 0 (and on the prompt's scores): the same
    // bound as a decode worker's, without a logprobs flag on this wire.
    status = rpc::CheckLogprobs(/*logprobs=*/true, request->top_logprobs());
  }
  if (status.ok()) status = ValidatePrefillRequest(weights_.config(), r);
  if (status.ok() && r.write_kv && destination.ranks().empty()) {
    status = absl::InvalidArgumentError(absl::StrCat(
        "request ", r.request_id, ": the destination names no decode rank"));
  }
  for (int i = 0; status.ok() && i < destination.ranks_size(); ++i) {
    const v1::KvRankDestination& rank = destination.ranks(i);
    if (rank.sink_descriptor().empty() || rank.grant().empty()) {
      status = absl::InvalidArgumentError(
          absl::StrCat("request ", r.request_id, ": decode rank ", i,
                       " has no sink descriptor or no grant"));
    }
    call->descriptors.push_back(rank.sink_descriptor());
    r.kv_grants.push_back(rank.grant());
  }
  if (status.ok()) {
    absl::MutexLock lock(&mu_);
    if (!down_.ok()) {
      status = DownStatus();
    } else if (draining_) {
      status = absl::UnavailableError(
          "prefill group is draining (shutting down): use another");
    } else if (!calls_.emplace(call->id, call).second) {
      status = absl::AlreadyExistsError(
          absl::StrCat("request ", call->id, " is already being prefilled"));
    } else {
      ++queued_;
    }
  }
  if (!status.ok()) {
    reactor->Finish(rpc::ToGrpcStatus(status));
    return reactor;
  }
  if (!control_.Push([this, call] { Admit(call); })) {
    Answer(call, absl::UnavailableError("prefill group is shutting down"));
  }
  return reactor;
}

void PrefillService::Admit(const std::shared_ptr<Call>& call) {
  absl::Status early;
  {
    absl::MutexLock lock(&mu_);
    --queued_;
    if (call->cancelled) {
      early = absl::CancelledError(
          absl::StrCat("request ", call->id, " was cancelled"));
    } else if (!down_.ok()) {
      early = DownStatus();
    }
  }
  if (!early.ok()) {
    Answer(call, early);
    return;
  }
  // Every stage's source must reach the request's sinks before any chunk
  // runs; each sink is connected once, so this is a set lookup afterwards.
  std::vector<std::string> fresh;
  for (const std::string& d : call->descriptors) {
    if (!connected_sinks_.contains(d)) fresh.push_back(d);
  }
  if (!fresh.empty()) {
    absl::Status s = stage0_->ConnectSinks(fresh);
    for (size_t i = 0; s.ok() && i < peers_.size(); ++i) {
      v1::StageConnectSinksRequest connect;
      for (const std::string& d : fresh) connect.add_sink_descriptors(d);
      grpc::ClientContext context;
      context.set_deadline(
          absl::ToChronoTime(absl::Now() + options_.control_timeout));
      v1::StageConnectSinksResponse ignored;
      grpc::Status g =
          peers_[i].stub->ConnectSinks(&context, connect, &ignored);
      if (!g.ok()) {
        s = Annotate(g, absl::StrCat("prefill stage ", peers_[i].stage));
      }
    }
    if (!s.ok()) {
      Answer(call, absl::Status(s.code(), absl::StrCat("request ", call->id,
                                                       ": ", s.message())));
      return;
    }
    for (const std::string& d : fresh) connected_sinks_.insert(d);
  }
  if (absl::Status s = stage0_->AddGrants(call->request.kv_grants); !s.ok()) {
    Answer(call,
           absl::Status(s.code(), absl::StrCat("request ", call->id,
                                               ": KV grant: ", s.message())));
    return;
  }
  call->submitted = absl::Now();
  auto ticket = coordinator_->Submit(call->request);
  if (!ticket.ok()) {
    stage0_->ForgetGrants(call->id);
    absl::Status s = ticket.status();
    {
      absl::MutexLock lock(&mu_);
      if (!down_.ok()) s = DownStatus();
    }
    Answer(call, s);
    return;
  }
  bool cancelled = false;
  {
    absl::MutexLock lock(&mu_);
    call->ticket = *ticket;
    cancelled = call->cancelled;
  }
  if (cancelled) (void)coordinator_->Cancel(call->id);
  (*ticket)->OnDone([this, call](const absl::StatusOr<PrefillOutcome>& result) {
    OnPrefilled(call, result);
  });
}

void PrefillService::OnPrefilled(const std::shared_ptr<Call>& call,
                                 const absl::StatusOr<PrefillOutcome>& result) {
  call->prefilled = absl::Now();
  if (!result.ok()) {
    absl::Status s = result.status();
    {
      absl::MutexLock lock(&mu_);
      if (!down_.ok()) s = DownStatus();
    }
    // The decode ranks must not keep (or keep receiving into) its blocks.
    control_.Push([this, id = call->id, grants = call->request.kv_grants] {
      CancelKvEverywhere({{id, grants}});
    });
    Answer(call, s);
    return;
  }
  v1::PrefillSubmitResponse* r = call->response;
  r->set_first_token(result->first_token.token);
  r->set_first_token_logprob(result->first_token.logprob);
  rpc::AlternativesToWire(result->first_token.top,
                          r->mutable_first_token_top_logprobs());
  for (const engine::TokenLogprobs& scored : result->prompt_logprobs) {
    rpc::LogprobsToWire(scored, r->add_prompt_logprobs());
  }
  r->set_cached_tokens(result->cached_tokens);
  r->set_num_chunks(result->num_chunks);
  r->set_queue_seconds(absl::ToDoubleSeconds(call->submitted - call->received));
  r->set_prefill_seconds(
      absl::ToDoubleSeconds(call->prefilled - call->submitted));
  if (call->decode_address.empty()) {
    Answer(call, absl::OkStatus());
    return;
  }
  Notify(call);
}

grpc::GenericStub* PrefillService::DecodeStub(const std::string& address) {
  absl::MutexLock lock(&mu_);
  auto& stub = decode_stubs_[address];
  if (stub == nullptr) {
    stub = std::make_unique<grpc::GenericStub>(
        rpc::CreateChannel(address, options_.internal_tokens.first()));
  }
  return stub.get();
}

void PrefillService::Notify(const std::shared_ptr<Call>& call) {
  // The decode worker's KvComplete, through a generic stub (no decode stubs
  // here); its request message is common.proto's.
  v1::KvCompleteRequest notice;
  notice.set_request_id(call->id);
  notice.set_first_token(call->response->first_token());
  v1::TokenLogprob* logprob = notice.mutable_first_token_logprob();
  logprob->set_logprob(call->response->first_token_logprob());
  *logprob->mutable_top() = call->response->first_token_top_logprobs();
  std::string bytes = notice.SerializeAsString();
  grpc::Slice slice(bytes);
  call->notify_request = grpc::ByteBuffer(&slice, 1);
  call->notify_context.set_deadline(
      absl::ToChronoTime(absl::Now() + options_.notify_timeout));
  DecodeStub(call->decode_address)
      ->UnaryCall(
          &call->notify_context, kKvCompleteMethod, grpc::StubOptions(),
          &call->notify_request, &call->notify_response,
          [this, call](grpc::Status status) {
            const absl::Time now = absl::Now();
            call->response->set_notify_seconds(
                absl::ToDoubleSeconds(now - call->prefilled));
            if (!status.ok()) {
              absl::Status why = Annotate(
                  status,
                  absl::StrCat("decode worker ", call->decode_address,
                               " did not accept the KV of request ", call->id));
              // The group did its part; its destination is down or frozen.
              // Not UNAVAILABLE: the router would take this group out of
              // rotation for the decode worker's fault (every request then
              // fails "no healthy prefill worker" while one decode worker
              // of several is frozen). ABORTED: retried elsewhere.
              if (absl::IsUnavailable(why) || absl::IsDeadlineExceeded(why)) {
                why = absl::AbortedError(
                    absl::StrCat(why.message(), " (",
                                 absl::StatusCodeToString(why.code()), ")"));
              }
              Answer(call, why);
              return;
            }
            call->response->set_decode_notified(true);
            Answer(call, absl::OkStatus());
          });
}

void PrefillService::Answer(const std::shared_ptr<Call>& call,
                            absl::Status status) {
  {
    absl::MutexLock lock(&mu_);
    if (call->answered) return;
    call->answered = true;
    auto it = calls_.find(call->id);
    if (it != calls_.end() && it->second == call) calls_.erase(it);
  }
  call->response->set_total_seconds(
      absl::ToDoubleSeconds(absl::Now() - call->received));
  call->reactor->Finish(rpc::ToGrpcStatus(status));
}

// ---------------------------------------------------------------------------
// Cancel, load
// ---------------------------------------------------------------------------

grpc::ServerUnaryReactor* PrefillService::Cancel(
    grpc::CallbackServerContext* context,
    const v1::PrefillCancelRequest* request, v1::PrefillCancelResponse*) {
  if (absl::Status auth = rpc::Authenticate(*context, options_.internal_tokens);
      !auth.ok()) {
    return rpc::Refused(context, auth);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const uint64_t id = request->request_id();
  std::shared_ptr<PrefillTicket> ticket;
  std::vector<std::string> grants;
  {
    absl::MutexLock lock(&mu_);
    auto it = calls_.find(id);
    if (it == calls_.end()) {
      reactor->Finish(grpc::Status(
          grpc::StatusCode::NOT_FOUND,
          absl::StrCat("no prefill in flight with request id ", id)));
      return reactor;
    }
    it->second->cancelled = true;
    ticket = it->second->ticket;
    grants = it->second->request.kv_grants;
  }
  // Not yet submitted: Admit sees the flag. Submitted: the coordinator drops
  // its queued chunks, fails the ticket with CANCELLED once its chunks in
  // flight drained, and frees its blocks.
  if (ticket != nullptr) (void)coordinator_->Cancel(id);
  control_.Push([this, id, grants = std::move(grants)] {
    CancelKvEverywhere({{id, grants}});
  });
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

void PrefillService::CancelKvEverywhere(const KvToCancel& requests) {
  std::vector<uint64_t> ids;
  for (const auto& [id, grants] : requests) {
    ids.push_back(id);
    stage0_->CancelKvWithGrants(id, grants);
  }
  int dead = -1;
  {
    absl::MutexLock lock(&mu_);
    dead = dead_stage_;
  }
  v1::StageCancelKvRequest cancel;
  for (uint64_t id : ids) cancel.add_request_ids(id);
  for (Peer& peer : peers_) {
    if (peer.stage == dead) continue;
    grpc::ClientContext context;
    context.set_deadline(
        absl::ToChronoTime(absl::Now() + options_.heartbeat_timeout));
    v1::StageCancelKvResponse ignored;
    // Best effort: a stage that does not answer is found by the heartbeat,
    // and the decode side's leases free the blocks of a silent source.
    (void)peer.stub->CancelKv(&context, cancel, &ignored);
  }
}

grpc::ServerUnaryReactor* PrefillService::GetLoad(
    grpc::CallbackServerContext* context, const v1::PrefillLoadRequest*,
    v1::PrefillLoad* response) {
  if (absl::Status auth = rpc::Authenticate(*context, options_.internal_tokens);
      !auth.ok()) {
    return rpc::Refused(context, auth);
  }
  *response = Load();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

v1::PrefillLoad PrefillService::Load() const {
  v1::PrefillLoad result;
  v1::PrefillLoad* response = &result;
  const CoordinatorStats stats = coordinator_->stats();
  v1::PrefillStageLoad local;
  FillStageLoad(stage0_->options(), stage0_->stats(), &local);
  {
    absl::MutexLock lock(&mu_);
    response->set_serving(down_.ok());
    response->set_queued(queued_);
    // Stage 0's own entry is current; the others are as of the last ping.
    for (size_t i = 0; i < stage_loads_.size(); ++i)
      *response->add_stages() = i == 0 ? local : stage_loads_[i];
  }
  response->set_in_flight(static_cast<int32_t>(stats.active_requests));
  response->set_kv_blocks_used(stats.used_blocks);
  response->set_kv_blocks_total(options_.scheduler.num_blocks);
  response->set_completed(stats.completed);
  response->set_failed(stats.failed);
  response->set_cached_tokens(stats.cached_tokens);
  const model::ModelConfig& config = weights_.config();
  v1::ModelIdentity* model = response->mutable_model();
  model->set_name(options_.model_name);
  model->set_config_identity(config.Identity());
  model->set_num_layers(config.num_layers);
  model->set_num_kv_heads(config.num_kv_heads);
  model->set_head_dim(config.head_dim);
  model->set_block_size(options_.scheduler.block_size);
  // What stage 0 computes and sends (the group's stages share a backend; a
  // mismatched one fails the KV compatibility check instead).
  model->set_kv_dtype(kv::KvDTypeName(stage0_->kv_dtype()));
  return result;
}

// ---------------------------------------------------------------------------
// Faults
// ---------------------------------------------------------------------------

void PrefillService::HeartbeatLoop() {
  bool down = false;
  while (!stop_.WaitForNotificationWithTimeout(options_.heartbeat_period)) {
    bool all_answered = true;
    for (Peer& peer : peers_) {
      grpc::ClientContext context;
      context.set_deadline(
          absl::ToChronoTime(absl::Now() + options_.heartbeat_timeout));
      v1::PrefillStageLoad load;
      grpc::Status s = peer.stub->Ping(&context, {}, &load);
      if (!s.ok()) {
        all_answered = false;
        if (down) continue;
        {
          absl::MutexLock lock(&mu_);
          stage_loads_[peer.stage].set_reachable(false);
          if (dead_stage_ < 0) dead_stage_ = peer.stage;
        }
        GroupDown(Annotate(
            s, absl::StrCat("prefill stage ", peer.stage, " is unreachable")));
        down = true;
        break;
      }
      absl::MutexLock lock(&mu_);
      stage_loads_[peer.stage] = load;
    }
    if (down && all_answered) {
      // Every stage answers again (the dead one was restarted). The links of
      // the survivors point at the dead process, so the group restarts
      // whole, in place: each peer re-execs on its port, and so does this
      // process (the main loop sees recovery_requested()); the fresh stage 0
      // wires the fresh stages as at first start.
      for (Peer& peer : peers_) {
        grpc::ClientContext context;
        context.set_deadline(
            absl::ToChronoTime(absl::Now() + options_.control_timeout));
        v1::StageRestartResponse ignored;
        (void)peer.stub->Restart(&context, {}, &ignored);
      }
      recovery_requested_.store(true);
      return;
    }
  }
}

void PrefillService::GroupDown(absl::Status why) {
  KvToCancel requests;
  {
    absl::MutexLock lock(&mu_);
    if (!down_.ok()) return;
    down_ = absl::UnavailableError(why.message());
    if (server_ != nullptr) server_->SetServing(false);
    for (const auto& [id, call] : calls_) {
      requests.emplace_back(id, call->request.kv_grants);
    }
  }
  // Fails every unfinished request with UNAVAILABLE; their callbacks answer
  // with the reason (down_ is set) and queue the KV revokes.
  coordinator_->Shutdown();
  control_.Push([this, requests] { CancelKvEverywhere(requests); });
}

}  // namespace pdserve::prefill
