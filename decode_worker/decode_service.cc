#include "decode_worker/decode_service.h"

#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kv/kv_layout.h"
#include "rpc/auth.h"
#include "rpc/request_contract.h"
#include "rpc/status_conversion.h"

namespace pdserve::decode_worker {

namespace v1 = ::pdserve::v1;

class TokenStream;

struct Channel {
  explicit Channel(uint64_t id) : id(id) {}
  const uint64_t id;
  absl::Mutex mu;
  std::deque<v1::DecodeDelta> pending ABSL_GUARDED_BY(mu);
  bool final_queued ABSL_GUARDED_BY(mu) = false;
  absl::Time finished_at ABSL_GUARDED_BY(mu);
  absl::Status final_status ABSL_GUARDED_BY(mu);
  // A sink's reason for giving up on the request (reported instead of the
  // CANCELLED the resulting abort produces).
  absl::Status sink_failure ABSL_GUARDED_BY(mu);
  int64_t granted_tokens ABSL_GUARDED_BY(mu) = 0;  // 0: nothing to transfer
  bool complete_requested ABSL_GUARDED_BY(mu) = false;
  // Admit finished setting the request up (worker, pins, grants). An Abort
  // that arrives before then only sets `abort_requested`: the Admit undoes
  // its own work and answers ABORTED, so nothing is left holding blocks
  // until a lease runs out.
  bool admitted ABSL_GUARDED_BY(mu) = false;
  bool abort_requested ABSL_GUARDED_BY(mu) = false;
  // Stream state. Invariants: at most one write in flight (`writing`); Finish
  // is called once (`finish_called`), never while a write is in flight, so
  // the reactor (OnDone deletes it) is alive whenever `writing` or
  // `!finish_called` was observed under `mu`.
  bool attached ABSL_GUARDED_BY(mu) = false;
  TokenStream* reactor ABSL_GUARDED_BY(mu) = nullptr;
  bool writing ABSL_GUARDED_BY(mu) = false;
  bool final_written ABSL_GUARDED_BY(mu) = false;
  bool cancelled ABSL_GUARDED_BY(mu) = false;
  // The worker stops before the stream ended (CutStreams): finish with this
  // instead of the deltas still queued.
  absl::Status cut ABSL_GUARDED_BY(mu);
  bool finish_called ABSL_GUARDED_BY(mu) = false;
  v1::DecodeDelta current;  // the write in flight (owned by gRPC meanwhile)
};

namespace {

v1::FinishReason ToProto(decode::FinishReason reason) {
  switch (reason) {
    case decode::FinishReason::kEos:
    case decode::FinishReason::kStop:
      return v1::FINISH_REASON_STOP;
    case decode::FinishReason::kLength:
      return v1::FINISH_REASON_LENGTH;
    case decode::FinishReason::kAborted:
      return v1::FINISH_REASON_CANCELLED;
    case decode::FinishReason::kError:
      return v1::FINISH_REASON_ERROR;
    case decode::FinishReason::kNone:
      break;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

// What to do on the reactor, decided under the channel's mutex and done
// outside it.
struct Action {
  enum Kind { kNone, kWrite, kFinish } kind = kNone;
  TokenStream* reactor = nullptr;
  grpc::Status status;
};

Action Decide(Channel& ch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(ch.mu) {
  Action a;
  if (ch.reactor == nullptr || ch.writing || ch.finish_called) return a;
  a.reactor = ch.reactor;
  if (ch.cancelled) {
    ch.finish_called = true;
    a.kind = Action::kFinish;
    a.status = grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled");
  } else if (!ch.cut.ok() && !ch.final_written) {
    ch.finish_called = true;
    a.kind = Action::kFinish;
    a.status = rpc::ToGrpcStatus(ch.cut);
  } else if (ch.final_written) {
    ch.finish_called = true;
    a.kind = Action::kFinish;
    a.status = rpc::ToGrpcStatus(ch.final_status);
  } else if (!ch.pending.empty()) {
    ch.current = std::move(ch.pending.front());
    ch.pending.pop_front();
    ch.writing = true;
    a.kind = Action::kWrite;
  }
  return a;
}

}  // namespace

class TokenStream : public grpc::ServerWriteReactor<v1::DecodeDelta> {
 public:
  TokenStream(DecodeService* service, decode::DecodeWorker* worker,
              std::shared_ptr<Channel> channel)
      : service_(service), worker_(worker), ch_(std::move(channel)) {}

  // Attaches to the channel and starts writing what is queued.
  void Start() {
    Action a;
    {
      absl::MutexLock lock(&ch_->mu);
      ch_->reactor = this;
      a = Decide(*ch_);
    }
    Act(a);
  }

  static void Act(const Action& a) {
    if (a.kind == Action::kWrite) {
      a.reactor->StartWrite(&a.reactor->ch_->current);
    } else if (a.kind == Action::kFinish) {
      // Forget before finishing, so a client that saw the end and asks again
      // gets NOT_FOUND, not ALREADY_EXISTS.
      a.reactor->service_->ForgetChannel(a.reactor->ch_->id,
                                         a.reactor->ch_.get());
      a.reactor->Finish(a.status);
    }
  }

  void OnWriteDone(bool ok) override {
    Action a;
    {
      absl::MutexLock lock(&ch_->mu);
      ch_->writing = false;
      if (!ok) {
        ch_->cancelled = true;
      } else if (ch_->current.finished()) {
        ch_->final_written = true;
      }
      a = Decide(*ch_);
    }
    Act(a);
  }

  void OnCancel() override {
    Action a;
    bool abort = false;
    {
      absl::MutexLock lock(&ch_->mu);
      ch_->cancelled = true;
      abort = !ch_->final_queued;
      a = Decide(*ch_);
    }
    // The client went away: nobody will read the tokens. Abort only queues a
    // command, so this does not block the callback thread.
    if (abort) (void)worker_->Abort(ch_->id);
    Act(a);
  }

  void OnDone() override {
    {
      absl::MutexLock lock(&ch_->mu);
      ch_->reactor = nullptr;
    }
    // A stream is attached once: whatever happened, the channel is done.
    service_->ForgetChannel(ch_->id, ch_.get());
    delete this;
  }

 private:
  DecodeService* const service_;
  decode::DecodeWorker* const worker_;
  const std::shared_ptr<Channel> ch_;
};

namespace {

// A stream refused before it started.
class RefusedStream : public grpc::ServerWriteReactor<v1::DecodeDelta> {
 public:
  explicit RefusedStream(const absl::Status& status) {
    Finish(rpc::ToGrpcStatus(status));
  }
  void OnDone() override { delete this; }
};

// The worker's StreamCallback (scheduler thread): queue, maybe start a
// write; never blocks.
void Push(Channel& ch, const decode::TokenDelta& d) {
  v1::DecodeDelta delta;
  delta.mutable_token_ids()->Add(d.tokens.begin(), d.tokens.end());
  delta.set_text(d.text);
  for (const engine::TokenLogprobs& l : d.logprobs) {
    rpc::LogprobsToWire(l, delta.add_logprobs());
  }
  for (const engine::TokenLogprobs& l : d.prompt_logprobs) {
    rpc::LogprobsToWire(l, delta.add_prompt_logprobs());
  }
  if (d.finished) {
    delta.set_finished(true);
    delta.set_finish_reason(ToProto(d.reason));
    delta.set_finish_detail(decode::FinishReasonName(d.reason));
  }
  Action a;
  {
    absl::MutexLock lock(&ch.mu);
    if (ch.final_queued) return;
    ch.pending.push_back(std::move(delta));
    if (d.finished) {
      ch.final_queued = true;
      ch.finished_at = absl::Now();
      ch.final_status = d.status;
      if (!d.status.ok() && !ch.sink_failure.ok())
        ch.final_status = ch.sink_failure;
    }
    a = Decide(ch);
  }
  TokenStream::Act(a);
}

}  // namespace

// ---- DecodeService ---------------------------------------------------------

DecodeService::DecodeService(decode::DecodeWorker* worker,
                             const model::ModelConfig& config,
                             const DecodeServiceOptions& options)
    : worker_(worker), config_(config), options_(options) {}

absl::StatusOr<std::unique_ptr<DecodeService>> DecodeService::Create(
    decode::DecodeWorker* worker, const model::ModelConfig& config,
    const DecodeServiceOptions& options) {
  if (worker == nullptr) return absl::InvalidArgumentError("no worker");
  std::unique_ptr<DecodeService> service(
      new DecodeService(worker, config, options));
  const kv::KvCacheLayout& layout = worker->kv_pool(0).layout();
  transport::KvModelSpec spec;
  spec.model_id = config.Identity();
  spec.dtype = layout.dtype;
  spec.block_size = layout.block_size;
  spec.head_dim = config.head_dim;
  spec.num_layers = config.num_layers;
  spec.num_kv_heads = config.num_kv_heads;
  DecodeService* self = service.get();
  if (!options.rank_workers.empty() &&
      static_cast<int>(options.rank_workers.size()) != worker->tp_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(options.rank_workers.size(), " UCX workers for ",
                     worker->tp_size(), " ranks"));
  }
  for (int r = 0; r < worker->tp_size(); ++r) {
    Rank rank;
    if (options.rank_workers.empty()) {
      auto ucx = transport::UcxWorker::Create(options.ucx);
      if (!ucx.ok()) return ucx.status();
      rank.owned_ucx = std::move(*ucx);
      rank.ucx = rank.owned_ucx.get();
    } else {
      rank.ucx = options.rank_workers[r];
    }
    transport::KvSinkOptions so;
    so.default_lease = options.kv_lease;
    so.release_blocks = [self, r](uint64_t id, const std::vector<int64_t>&,
                                  const absl::Status& why) {
      self->OnSinkRelease(id, r, why);
    };
    auto sink = transport::KvSink::Create(rank.ucx, &worker->kv_pool(r), spec,
                                          std::move(so));
    if (!sink.ok()) return sink.status();
    rank.sink = std::move(*sink);
    service->ranks_.push_back(std::move(rank));
  }
  service->completer_ = std::thread([self] { self->CompleterLoop(); });
  return service;
}

DecodeService::~DecodeService() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (completer_.joinable()) completer_.join();
  // Sinks call OnSinkRelease (mu_, channels_) until they are gone: destroy
  // them while the rest of the service still exists.
  ranks_.clear();
}

std::shared_ptr<Channel> DecodeService::FindChannel(uint64_t id) const {
  absl::MutexLock lock(&mu_);
  auto it = channels_.find(id);
  return it == channels_.end() ? nullptr : it->second;
}

void DecodeService::ForgetChannel(uint64_t id, const Channel* channel) {
  absl::MutexLock lock(&mu_);
  auto it = channels_.find(id);
  if (it != channels_.end() && it->second.get() == channel) channels_.erase(it);
}

void DecodeService::StartDrain() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
}

bool DecodeService::draining() const {
  absl::MutexLock lock(&mu_);
  return draining_;
}

int64_t DecodeService::live_streams() const {
  absl::MutexLock lock(&mu_);
  int64_t live = 0;
  for (const auto& [id, ch] : channels_) {
    absl::MutexLock l(&ch->mu);
    // Finished and never attached: nobody is waiting for it.
    if (ch->final_queued && !ch->attached) continue;
    ++live;
  }
  return live;
}

void DecodeService::CutStreams(const absl::Status& why) {
  std::vector<std::shared_ptr<Channel>> live;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, ch] : channels_) live.push_back(ch);
  }
  for (const std::shared_ptr<Channel>& ch : live) {
    Action a;
    bool abort = false;
    {
      absl::MutexLock lock(&ch->mu);
      if (ch->final_written || ch->finish_called) continue;
      ch->cut = why;
      abort = !ch->final_queued;
      a = Decide(*ch);
    }
    // Its KV goes back now; the tokens not yet written are the router's to
    // recompute elsewhere from what it has.
    if (abort) (void)worker_->Abort(ch->id);
    TokenStream::Act(a);
  }
}

bool DecodeService::WaitDrained(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (live_streams() > 0) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return true;
}

int64_t DecodeService::channels() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(channels_.size());
}

void DecodeService::OnSinkRelease(uint64_t id, int rank,
                                  const absl::Status& why) {
  if (auto ch = FindChannel(id)) {
    absl::MutexLock lock(&ch->mu);
    if (ch->sink_failure.ok()) {
      ch->sink_failure = why;
      // Every rank's sink releases the request: count it once.
      if (absl::IsDeadlineExceeded(why))
        lease_expiries_.fetch_add(1, std::memory_order_relaxed);
    }
  }
  // No put of the request can land any more (the sink's quarantine is
  // over): the request fails, and this rank's hold on its blocks ends.
  (void)worker_->Abort(id);
  RankDone(id, rank);
}

absl::Status DecodeService::HoldForTransport(uint64_t id,
                                             std::vector<int64_t> blocks,
                                             std::shared_ptr<Channel> channel) {
  PDS_RETURN_IF_ERROR(worker_->PinBlocks(blocks));
  absl::MutexLock lock(&holds_mu_);
  TransportHold& hold = holds_[id];
  hold.blocks = std::move(blocks);
  hold.ranks.assign(ranks_.size(), RankHold::kGranted);
  hold.channel = std::move(channel);
  return absl::OkStatus();
}

void DecodeService::RankDone(uint64_t id, int rank) {
  std::vector<int64_t> unpin;
  {
    absl::MutexLock lock(&holds_mu_);
    auto it = holds_.find(id);
    if (it == holds_.end()) return;
    it->second.ranks[rank] = RankHold::kDone;
    for (RankHold h : it->second.ranks) {
      if (h != RankHold::kDone) return;
    }
    unpin = std::move(it->second.blocks);
    holds_.erase(it);
  }
  worker_->UnpinBlocks(unpin);
}

void DecodeService::DropGrants(uint64_t id) {
  std::vector<int> cancel;
  {
    absl::MutexLock lock(&holds_mu_);
    auto it = holds_.find(id);
    if (it == holds_.end()) return;
    for (size_t r = 0; r < it->second.ranks.size(); ++r) {
      if (it->second.ranks[r] == RankHold::kGranted) {
        it->second.ranks[r] = RankHold::kCancelling;
        cancel.push_back(static_cast<int>(r));
      }
    }
  }
  for (int r : cancel) {
    bool settled = false;
    // NOT_FOUND: a Wait took the grant; its caller (or the release callback
    // before it) ends the rank's hold.
    (void)ranks_[r].sink->Cancel(id, &settled);
    if (settled) RankDone(id, r);  // no release callback follows
  }
}

void DecodeService::DropGrantsOfFinished() {
  std::vector<uint64_t> finished;
  {
    absl::MutexLock lock(&holds_mu_);
    for (auto& [id, hold] : holds_) {
      bool granted = false;
      for (RankHold h : hold.ranks) granted |= h == RankHold::kGranted;
      if (!granted || hold.channel == nullptr) continue;
      absl::MutexLock channel_lock(&hold.channel->mu);
      if (hold.channel->final_queued) finished.push_back(id);
    }
  }
  for (uint64_t id : finished) DropGrants(id);
}

bool DecodeService::AbortedWhileAdmitting(Channel& ch, int64_t granted_tokens) {
  absl::MutexLock lock(&ch.mu);
  ch.granted_tokens = granted_tokens;
  ch.admitted = true;
  return ch.abort_requested;
}

absl::Status DecodeService::AbortedDuringAdmit(uint64_t id) {
  return absl::AbortedError(
      absl::StrCat("request ", id, " was aborted before its admit completed"));
}

void DecodeService::RememberEarlyAbort(uint64_t id) {
  absl::MutexLock lock(&mu_);
  early_aborts_.Insert(id);
}

absl::Status DecodeService::AdmitImpl(const v1::AdmitRequest& request,
                                      v1::AdmitResponse* response) {
  const uint64_t id = request.request_id();
  if (request.prompt_ids().empty())
    return absl::InvalidArgumentError("prompt is empty");
  // 0 on this wire is unset: the default (the router always sets it).
  const int32_t max_tokens = rpc::MaxTokensFromWorkerWire(request.max_tokens());
  PDS_RETURN_IF_ERROR(rpc::CheckMaxTokens(max_tokens, /*echo=*/false));
  const engine::SamplingParams sampling =
      rpc::SamplingFromWire(request.sampling(), /*seed_if_unset=*/0);
  PDS_RETURN_IF_ERROR(rpc::CheckSampling(sampling));
  PDS_RETURN_IF_ERROR(
      rpc::CheckLogprobs(request.include_logprobs(), request.top_logprobs()));
  decode::RequestParams params;
  params.max_new_tokens = max_tokens;
  params.sampling = sampling;
  params.stop.assign(request.stop().begin(), request.stop().end());
  PDS_RETURN_IF_ERROR(rpc::CheckStops(params.stop));
  params.ignore_eos = request.ignore_eos();
  params.logprobs = request.include_logprobs();
  params.top_logprobs = request.top_logprobs();
  params.prompt_logprobs = request.include_prompt_logprobs();
  if (params.prompt_logprobs && !request.local_prefill()) {
    return absl::InvalidArgumentError(
        "include_prompt_logprobs needs local_prefill: a remote prefill's "
        "prompt scores come from its prefill group");
  }

  std::optional<decode::Resumption> resume;
  if (request.has_resume()) {
    if (!request.local_prefill()) {
      return absl::InvalidArgumentError(
          "resume needs local_prefill: this worker recomputes a migrated "
          "stream's KV itself");
    }
    resume.emplace();
    resume->output.assign(request.resume().output_ids().begin(),
                          request.resume().output_ids().end());
    resume->delivered_text_bytes = request.resume().delivered_text_bytes();
  }

  auto ch = std::make_shared<Channel>(id);
  {
    absl::MutexLock lock(&mu_);
    if (draining_) {
      return absl::UnavailableError(
          "decode worker is draining (shutting down): admit elsewhere");
    }
    if (early_aborts_.Erase(id)) return AbortedDuringAdmit(id);
    // Drop finished streams nobody came for.
    const absl::Time cutoff = absl::Now() - options_.unclaimed_stream_ttl;
    absl::erase_if(channels_, [&](const auto& entry) {
      Channel& c = *entry.second;
      absl::MutexLock l(&c.mu);
      return !c.attached && c.final_queued && c.finished_at < cutoff;
    });
    auto it = channels_.find(id);
    if (it != channels_.end()) {
      absl::MutexLock l(&it->second->mu);
      if (!it->second->final_queued)
        return absl::AlreadyExistsError(
            absl::StrCat("request ", id, " is live"));
    }
    channels_[id] = ch;
  }
  std::vector<int32_t> prompt(request.prompt_ids().begin(),
                              request.prompt_ids().end());
  const int64_t n = static_cast<int64_t>(prompt.size());
  if (request.local_prefill()) {
    // Colocated: this worker prefills the prompt itself; no KV destination
    // is handed out and the stream starts without a KvComplete.
    absl::Status submitted = worker_->Submit(
        id, std::move(prompt), params,
        [ch](const decode::TokenDelta& d) { Push(*ch, d); },
        resume.has_value() ? &*resume : nullptr);
    if (!submitted.ok()) {
      ForgetChannel(id, ch.get());
      return submitted;
    }
    if (AbortedWhileAdmitting(*ch, /*granted_tokens=*/0)) {
      (void)worker_->Abort(id);
      ForgetChannel(id, ch.get());
      return AbortedDuringAdmit(id);
    }
    FillIdentity(response->mutable_model());
    return absl::OkStatus();
  }
  auto admitted =
      worker_->Admit(id, std::move(prompt), params,
                     [ch](const decode::TokenDelta& d) { Push(*ch, d); });
  if (!admitted.ok()) {
    ForgetChannel(id, ch.get());
    return admitted.status();
  }
  const int block_size = worker_->block_manager().block_size();
  const int64_t cached = admitted->cached_tokens;
  const int64_t tokens = n - cached;
  // The prefix cache shares whole blocks, so the suffix starts on a block.
  if (cached % block_size != 0) {
    (void)worker_->Abort(id);
    ForgetChannel(id, ch.get());
    return absl::InternalError(absl::StrCat(
        cached, " cached tokens is not a multiple of the block size"));
  }
  std::vector<int64_t> suffix(admitted->block_ids.begin() + cached / block_size,
                              admitted->block_ids.end());
  if (tokens > 0) {
    if (absl::Status held = HoldForTransport(id, suffix, ch); !held.ok()) {
      (void)worker_->Abort(id);
      ForgetChannel(id, ch.get());
      return absl::InternalError(absl::StrCat(
          "pinning the KV blocks of request ", id, ": ", held.message()));
    }
  }
  for (size_t r = 0; r < ranks_.size(); ++r) {
    auto* dest = response->add_ranks();
    dest->set_sink_descriptor(ranks_[r].sink->descriptor());
    if (tokens == 0) continue;
    auto grant = ranks_[r].sink->Expect(id, tokens, suffix, options_.kv_lease);
    if (!grant.ok()) {
      // Ranks from r on hold no grant; the earlier ones are revoked and
      // release their blocks after their quarantine.
      for (size_t q = r; q < ranks_.size(); ++q) {
        RankDone(id, static_cast<int>(q));
      }
      DropGrants(id);
      (void)worker_->Abort(id);
      ForgetChannel(id, ch.get());
      return absl::Status(
          grant.status().code(),
          absl::StrCat("KV grant on rank ", r, ": ", grant.status().message()));
    }
    dest->set_grant(std::move(*grant));
  }
  if (AbortedWhileAdmitting(*ch, tokens)) {
    // As a failed grant: revoke what was granted (the pins hold the blocks
    // until the sinks' quarantine ends), stop the request.
    if (tokens > 0) DropGrants(id);
    (void)worker_->Abort(id);
    ForgetChannel(id, ch.get());
    return AbortedDuringAdmit(id);
  }
  response->set_cached_tokens(cached);
  FillIdentity(response->mutable_model());
  response->set_lease_seconds(absl::ToDoubleSeconds(options_.kv_lease));
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* DecodeService::Admit(
    grpc::CallbackServerContext* context, const v1::AdmitRequest* request,
    v1::AdmitResponse* response) {
  if (absl::Status auth = rpc::Authenticate(*context, options_.internal_tokens);
      !auth.ok()) {
    return rpc::Refused(context, auth);
  }
  auto* reactor = context->DefaultReactor();
  reactor->Finish(rpc::ToGrpcStatus(AdmitImpl(*request, response)));
  return reactor;
}

grpc::ServerUnaryReactor* DecodeService::KvComplete(
    grpc::CallbackServerContext* context, const v1::KvCompleteRequest* request,
    v1::KvCompleteResponse*) {
  if (absl::Status auth = rpc::Authenticate(*context, options_.internal_tokens);
      !auth.ok()) {
    return rpc::Refused(context, auth);
  }
  auto* reactor = context->DefaultReactor();
  const uint64_t id = request->request_id();
  auto ch = FindChannel(id);
  absl::Status refused;
  if (ch == nullptr) {
    refused = absl::NotFoundError(absl::StrCat("no request ", id));
  } else {
    absl::MutexLock lock(&ch->mu);
    if (ch->complete_requested) {
      refused = absl::FailedPreconditionError(
          absl::StrCat("request ", id, " was already marked complete"));
    } else if (ch->final_queued) {
      refused = absl::FailedPreconditionError(
          absl::StrCat("request ", id, " has finished"));
    } else {
      ch->complete_requested = true;
    }
  }
  if (!refused.ok()) {
    reactor->Finish(rpc::ToGrpcStatus(refused));
    return reactor;
  }
  // The sink waits may block (bounded): off the callback threads.
  absl::MutexLock lock(&mu_);
  engine::TokenLogprobs first_logprobs =
      rpc::LogprobsFromWire(request->first_token_logprob());
  jobs_.push_back({id, request->first_token(), std::move(first_logprobs),
                   std::move(ch), reactor, absl::Now()});
  return reactor;
}

void DecodeService::CompleterLoop() {
  while (true) {
    std::optional<CompleteJob> job;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || !jobs_.empty();
      };
      // Wakes at least every 250 ms to drop the grants of requests the
      // worker finished before their KV arrived.
      mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Milliseconds(250));
      if (stop_ && jobs_.empty()) return;  // stopping, nothing left
      if (!jobs_.empty()) {
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
    }
    if (job.has_value()) {
      job->reactor->Finish(rpc::ToGrpcStatus(Complete(*job)));
    } else {
      DropGrantsOfFinished();
    }
  }
}

absl::Status DecodeService::Complete(const CompleteJob& job) {
  int64_t granted = 0;
  {
    absl::MutexLock lock(&job.channel->mu);
    granted = job.channel->granted_tokens;
  }
  if (granted > 0) {
    // One completer thread serves every call in arrival order: behind a
    // request whose KV never lands, each queued call would otherwise start
    // its own timeout only once that one ran out.
    const absl::Time deadline = job.received + options_.kv_complete_timeout;
    for (size_t r = 0; r < ranks_.size(); ++r) {
      absl::Status s = ranks_[r].sink->Wait(
          job.request_id,
          std::max(absl::ZeroDuration(), deadline - absl::Now()));
      // The grant left the sink unless still pending (DEADLINE_EXCEEDED): a
      // failure is reported only after its blocks were released.
      if (!absl::IsDeadlineExceeded(s)) {
        RankDone(job.request_id, static_cast<int>(r));
      }
      if (s.ok()) continue;
      s = absl::Status(
          s.code(), absl::StrCat("KV of request ", job.request_id, " on rank ",
                                 r, ": ", s.message()));
      {
        absl::MutexLock lock(&job.channel->mu);
        if (job.channel->sink_failure.ok()) job.channel->sink_failure = s;
      }
      // The request fails; its blocks stay pinned until every sink is done
      // with its grant (a prefill that claimed to be done may still have a
      // put in flight).
      DropGrants(job.request_id);
      (void)worker_->Abort(job.request_id);
      return s;
    }
  }
  return worker_->MarkKvComplete(job.request_id, job.first_token,
                                 job.first_logprobs);
}

grpc::ServerWriteReactor<v1::DecodeDelta>* DecodeService::StreamTokens(
    grpc::CallbackServerContext* context,
    const v1::StreamTokensRequest* request) {
  if (absl::Status auth = rpc::Authenticate(*context, options_.internal_tokens);
      !auth.ok()) {
    return new RefusedStream(auth);
  }
  const uint64_t id = request->request_id();
  auto ch = FindChannel(id);
  if (ch == nullptr)
    return new RefusedStream(absl::NotFoundError(
        absl::StrCat("no request ", id, " (unknown or already streamed)")));
  {
    absl::MutexLock lock(&ch->mu);
    if (ch->attached)
      return new RefusedStream(absl::AlreadyExistsError(
          absl::StrCat("request ", id, " already has a stream")));
    ch->attached = true;
  }
  auto* stream = new TokenStream(this, worker_, std::move(ch));
  stream->Start();
  return stream;
}

grpc::ServerUnaryReactor* DecodeService::Abort(
    grpc::CallbackServerContext* context, const v1::AbortRequest* request,
    v1::AbortResponse*) {
  if (absl::Status auth = rpc::Authenticate(*context, options_.internal_tokens);
      !auth.ok()) {
    return rpc::Refused(context, auth);
  }
  auto* reactor = context->DefaultReactor();
  const uint64_t id = request->request_id();
  bool in_transfer = false;
  if (auto ch = FindChannel(id)) {
    absl::MutexLock lock(&ch->mu);
    if (!ch->admitted) {
      // Its Admit is still running: it sees the flag when done and undoes
      // itself (the router's Admit call may have timed out meanwhile).
      ch->abort_requested = true;
      reactor->Finish(grpc::Status::OK);
      return reactor;
    }
    in_transfer =
        ch->granted_tokens > 0 && !ch->complete_requested && !ch->final_queued;
  } else {
    // No Admit seen yet: one may still be on its way (the router gave up
    // waiting for it). Remember the id so that it is refused on arrival.
    RememberEarlyAbort(id);
  }
  if (in_transfer) {
    // Revoke the grants: each sink ends its rank's pin on the blocks once no
    // put of the request can still land (after its quarantine), or at once
    // when the rank's KV had all landed (then no release callback follows).
    DropGrants(id);
  }
  // The request ends now either way: the pins, not the request, keep its
  // blocks from another request while a put may still land. (Waiting for
  // the sinks' callbacks to abort it left a request whose KV had landed, but
  // whose stage died before KvComplete, in the worker until its lease.)
  const absl::Status aborted = worker_->Abort(id);
  const absl::Status s = in_transfer ? absl::OkStatus() : aborted;
  reactor->Finish(rpc::ToGrpcStatus(s));
  return reactor;
}

void DecodeService::FillIdentity(v1::ModelIdentity* model) const {
  model->set_name(options_.model_name);
  model->set_config_identity(config_.Identity());
  model->set_num_layers(config_.num_layers);
  model->set_num_kv_heads(config_.num_kv_heads);
  model->set_head_dim(config_.head_dim);
  model->set_block_size(worker_->block_manager().block_size());
  model->set_kv_dtype(kv::KvDTypeName(worker_->kv_pool(0).layout().dtype));
}

grpc::ServerUnaryReactor* DecodeService::GetLoad(
    grpc::CallbackServerContext* context, const v1::GetLoadRequest*,
    v1::DecodeLoad* response) {
  if (absl::Status auth = rpc::Authenticate(*context, options_.internal_tokens);
      !auth.ok()) {
    return rpc::Refused(context, auth);
  }
  const decode::LoadReport load = worker_->Load();
  response->set_running(load.running);
  response->set_waiting(load.waiting);
  response->set_awaiting_kv(load.awaiting_kv);
  response->set_kv_blocks_used(load.blocks_used);
  response->set_kv_blocks_total(load.blocks_total);
  response->set_steps(load.steps);
  response->set_preemptions(load.preemptions);
  response->set_spec_steps(load.spec_steps);
  response->set_drafted_tokens(load.drafted_tokens);
  response->set_accepted_tokens(load.accepted_tokens);
  response->set_mean_acceptance_length(load.mean_acceptance_length());
  FillIdentity(response->mutable_model());
  auto* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace pdserve::decode_worker
