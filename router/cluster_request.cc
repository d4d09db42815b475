#include "router/cluster_request.h"

#include <grpcpp/grpcpp.h>

#include <utility>

#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kv/block_manager.h"
#include "rpc/request_contract.h"
#include "rpc/status_conversion.h"

namespace pdserve::router {
namespace {

// The errors after which another worker may well succeed. CANCELLED is
// never the client's here (every caller handles a cancelled request first):
// a worker cancelled the call, as its server does to calls still open when
// it stops (a drained group's last moments, measured: 1 in 3 scale-downs of
// a prefill group under load failed a request before).
bool Retryable(const absl::Status& status) {
  return absl::IsUnavailable(status) || absl::IsResourceExhausted(status) ||
         absl::IsAborted(status) || absl::IsCancelled(status);
}

absl::Status Annotate(const absl::Status& status, absl::string_view what,
                      const std::string& address) {
  return absl::Status(status.code(),
                      absl::StrCat(what, " ", address, ": ", status.message()));
}

FinishReason MapFinish(v1::FinishReason reason) {
  switch (reason) {
    case v1::FINISH_REASON_STOP:
      return FinishReason::kStop;
    case v1::FINISH_REASON_LENGTH:
      return FinishReason::kLength;
    case v1::FINISH_REASON_CANCELLED:
      return FinishReason::kCancelled;
    case v1::FINISH_REASON_ERROR:
      return FinishReason::kError;
    default:
      return FinishReason::kNone;
  }
}

uint64_t NewWireId() {
  // Random, not a counter: several routers share the workers, and a collision
  // (ALREADY_EXISTS) would only cost a retry.
  thread_local absl::BitGen gen;
  return absl::Uniform<uint64_t>(gen, 1, UINT64_MAX);
}

std::chrono::system_clock::time_point Deadline(absl::Time request_deadline,
                                               absl::Duration bound) {
  return absl::ToChronoTime(std::min(request_deadline, absl::Now() + bound));
}

}  // namespace

void RequestCancellation::Cancel() {
  cancelled_.store(true);
  absl::MutexLock lock(&mu_);
  if (active_ != nullptr) active_->TryCancel();
}

bool RequestCancellation::Enter(grpc::ClientContext* context) {
  absl::MutexLock lock(&mu_);
  if (cancelled_.load()) return false;
  active_ = context;
  return true;
}

void RequestCancellation::Leave() {
  absl::MutexLock lock(&mu_);
  active_ = nullptr;
}

RequestMode ModeFor(const GenerationRequest& request, bool colocated) {
  const bool score_only = request.max_tokens == 0;
  const bool scored = request.echo && request.logprobs;
  if (score_only && !scored) return RequestMode::kEchoOnly;
  if (colocated) return RequestMode::kColocated;
  return score_only ? RequestMode::kScoreOnPrefill
                    : RequestMode::kDisaggregated;
}

ClusterRequest::ClusterRequest(
    const ClusterServices& services,
    std::shared_ptr<RequestCancellation> cancellation,
    GenerationRequest request, std::vector<int32_t> prompt_ids,
    GenerationObserver* observer)
    : services_(services),
      options_(services.options),
      metrics_(services.options.metrics),
      cancellation_(std::move(cancellation)),
      request_(std::move(request)),
      prompt_ids_(std::move(prompt_ids)),
      observer_(observer),
      mode_(ModeFor(request_, options_.colocated)),
      submit_scored_(request_.echo && request_.logprobs),
      block_hashes_(kv::FullBlockHashes(prompt_ids_, options_.block_size)),
      started_(absl::Now()) {
  rpc::SamplingToWire(request_.sampling, &sampling_);
  usage_.prompt_tokens = static_cast<int32_t>(prompt_ids_.size());
}

bool ClusterRequest::UsesDecode(const Attempt& a) const {
  // A request that only scores its prompt on a prefill group needs no decode
  // worker and its KV goes nowhere. (Colocated, or with no group to be had,
  // the decode worker is what scores it.)
  return mode_ == RequestMode::kDisaggregated ||
         mode_ == RequestMode::kColocated || a.local_prefill;
}

void ClusterRequest::DecidePrefill(Attempt& a) const {
  a.resume = resuming();
  if (mode_ == RequestMode::kColocated) {
    a.local_prefill = true;
    a.prefill_where = "decode_colocated";
  } else if (a.resume) {
    // The new decode worker recomputes prompt + streamed tokens itself: the
    // next token's sampling needs the output so far (its index, penalties,
    // grammar), which only a decode worker keeps.
    a.local_prefill = true;
    a.prefill_where = "decode_resume";
  } else if (mode_ == RequestMode::kDisaggregated &&
             options_.local_prefill_max_tokens > 0 &&
             static_cast<int64_t>(prompt_ids_.size()) <=
                 options_.local_prefill_max_tokens) {
    a.local_prefill = true;
    a.prefill_where = "decode_short";
  } else {
    a.local_prefill = false;
    a.prefill_where = "group";
  }
}

bool ClusterRequest::FallsBackToDecode(const absl::Status& no_group) const {
  return options_.prefill_fallback && absl::IsUnavailable(no_group);
}

void ClusterRequest::Run() {
  if (metrics_ != nullptr) {
    metrics_->SetQueued(services_.book.awaiting_first_token.fetch_add(1) + 1);
  }
  if (mode_ == RequestMode::kEchoOnly) {
    // Echo of the prompt with nothing to generate or score: no worker needed.
    ResetEcho();
    FinishWithEcho();
    return;
  }
  // Tries in a row that streamed nothing; a migrated stream starts afresh.
  int failures = 0;
  bool retrying = false;
  while (failures < options_.max_attempts) {
    // A retry scores the prompt again; once something reached the client
    // the echo went with it.
    if (!delivered_) ResetEcho();
    if (retrying) {
      if (metrics_ != nullptr) metrics_->OnRetry(retry_side_);
      absl::MutexLock lock(&services_.book.mu);
      ++services_.book.stats.retries;
    }
    if (cancellation_->cancelled()) {
      Finish(absl::CancelledError("cancelled"));
      return;
    }
    if (absl::Now() >= request_.deadline) {
      Finish(absl::DeadlineExceededError(
          absl::StrCat("deadline exceeded before the first token (last error: ",
                       last_error_.message(), ")")));
      return;
    }
    attempt_ = failures;
    Attempt a;
    a.wire_id = NewWireId();
    const Next next = RunAttempt(a);
    if (next == Next::kDone) return;
    if (next == Next::kMigrate) {
      failures = 0;
      retrying = false;
      continue;
    }
    ++failures;
    retrying = true;
  }
  Finish(absl::UnavailableError(
      absl::StrCat("gave up after ", options_.max_attempts,
                   " attempts; last error: ", last_error_.message())));
}

ClusterRequest::Next ClusterRequest::RunAttempt(Attempt& a) {
  if (Next next = Admit(a); next != Next::kContinue) return next;
  if (metrics_ != nullptr) metrics_->OnPrefillDecision(a.prefill_where);
  // From here on the decode worker (if any) holds KV blocks for the wire id:
  // every exit path below frees them (Abort), unless the stream finished.
  a.prefill_returned_at = absl::Now();
  if (!a.local_prefill) {
    if (Next next = PrefillOnGroup(a); next != Next::kContinue) return next;
  }
  return StreamFromDecode(a);
}

absl::Status ClusterRequest::PickPrefillGroup(Attempt& a) {
  const AssignmentContext assignment{block_hashes_};
  absl::StatusOr<WorkerLease> lease = services_.registry.Assign(
      WorkerRole::kPrefill, services_.prefill_policy, assignment);
  if (lease.ok()) {
    a.prefill_address = lease->address();
    a.prefill_lease.emplace(*std::move(lease));
    return absl::OkStatus();
  }
  if (!FallsBackToDecode(lease.status())) return lease.status();
  a.local_prefill = true;
  a.prefill_where = "decode_no_group";
  return absl::OkStatus();
}

ClusterRequest::Next ClusterRequest::Admit(Attempt& a) {
  const auto cancelled = [this] { return cancellation_->cancelled(); };
  DecidePrefill(a);
  if (mode_ == RequestMode::kScoreOnPrefill) {
    // Scored by a group, no decode worker and no line to wait in; with no
    // group in rotation, scored by a decode worker instead.
    if (absl::Status s = PickPrefillGroup(a); !s.ok()) return Finish(s);
    if (!a.local_prefill) return Next::kContinue;
  }
  std::unique_ptr<AdmissionQueue::Place> place;
  if (UsesDecode(a)) {
    absl::StatusOr<std::unique_ptr<AdmissionQueue::Place>> joined =
        services_.queue.Join();
    if (!joined.ok()) return Finish(joined.status());
    place = *std::move(joined);
    if (absl::Status s =
            services_.queue.WaitForTurn(*place, request_.deadline, cancelled);
        !s.ok()) {
      return Finish(s);
    }
  }
  // Leaving (returning) hands the head of the line to the next request.
  auto left_line = [&](Next next) {
    if (place != nullptr && metrics_ != nullptr) {
      metrics_->ObserveAdmissionWait(
          absl::ToDoubleSeconds(absl::Now() - place->joined()));
    }
    return next;
  };
  while (true) {
    if (!a.local_prefill) {
      // A prefill group first: without one that can take the request,
      // admitting it on a decode worker would only hold KV there for
      // nothing. With none in rotation (a group restarting, all draining)
      // the decode worker prefills it: slower for a long prompt, but an
      // answer instead of a 503.
      if (absl::Status s = PickPrefillGroup(a); !s.ok()) {
        return left_line(Finish(s));
      }
    }
    if (!UsesDecode(a)) return Next::kContinue;
    const Next next = AdmitOnDecode(a);
    if (next != Next::kNoRoom) return left_line(next);
    a.prefill_lease.reset();
    a.decode_lease.reset();
    if (absl::Status s = services_.queue.WaitForCapacity(
            *place, request_.deadline, cancelled, last_error_);
        !s.ok()) {
      return left_line(Finish(s));
    }
  }
}

ClusterRequest::Next ClusterRequest::Failed(const absl::Status& status,
                                            const char* who,
                                            const std::string& address,
                                            bool retry) {
  last_error_ = Annotate(status, who, address);
  if (absl::IsUnavailable(status)) {
    services_.registry.MarkUnhealthy(address, std::string(status.message()));
  }
  if (absl::IsDeadlineExceeded(status) && absl::Now() >= request_.deadline) {
    return Finish(last_error_);
  }
  if (retry && Retryable(status)) return Next::kRetry;
  return Finish(last_error_);
}

ClusterRequest::Next ClusterRequest::AdmitOnDecode(Attempt& a) {
  const AssignmentContext assignment{block_hashes_};
  absl::StatusOr<WorkerLease> lease = services_.registry.Assign(
      WorkerRole::kDecode, services_.decode_policy, assignment);
  if (!lease.ok() && a.resume) {
    // A stream in the middle of its answer waits a while for a decode worker
    // to come back (the only one restarting, a rolling update) rather than
    // break in front of its client.
    const absl::Time until = std::min(
        request_.deadline, absl::Now() + options_.migration_worker_wait);
    while (!lease.ok() && absl::Now() < until && !cancellation_->cancelled()) {
      absl::SleepFor(absl::Milliseconds(100));
      lease = services_.registry.Assign(WorkerRole::kDecode,
                                        services_.decode_policy, assignment);
    }
    if (!lease.ok() && metrics_ != nullptr) metrics_->OnMigration("no_worker");
  }
  if (!lease.ok()) {
    // No decode worker at all: retrying cannot help. After a failed attempt
    // the earlier error says more than "none left".
    return Finish(attempt_ == 0
                      ? lease.status()
                      : absl::UnavailableError(absl::StrCat(
                            lease.status().message(),
                            "; last error: ", last_error_.message())));
  }
  a.decode_address = lease->address();
  a.decode_lease.emplace(*std::move(lease));
  if (metrics_ != nullptr) {
    metrics_->OnRouting(std::string(services_.decode_policy.name()), "decode",
                        a.decode_address);
  }
  retry_side_ = "decode";
  a.decode = v1::DecodeWorker::NewStub(services_.channel_for(a.decode_address));

  const bool score_only = request_.max_tokens == 0;
  v1::AdmitRequest admit_request;
  admit_request.set_request_id(a.wire_id);
  admit_request.mutable_prompt_ids()->Add(prompt_ids_.begin(),
                                          prompt_ids_.end());
  // Colocated scoring only: the worker prefills (and scores) the prompt and
  // samples one token, which is not returned.
  admit_request.set_max_tokens(score_only ? 1 : request_.max_tokens);
  admit_request.set_include_prompt_logprobs(a.local_prefill && !a.resume &&
                                            submit_scored_);
  *admit_request.mutable_sampling() = sampling_;
  for (const std::string& s : request_.stop) admit_request.add_stop(s);
  admit_request.set_ignore_eos(request_.ignore_eos);
  admit_request.set_local_prefill(a.local_prefill);
  if (a.resume) {
    v1::ResumeState* resume = admit_request.mutable_resume();
    resume->mutable_output_ids()->Add(streamed_ids_.begin(),
                                      streamed_ids_.end());
    resume->set_delivered_text_bytes(streamed_text_bytes_);
  }
  admit_request.set_include_logprobs(request_.logprobs);
  admit_request.set_top_logprobs(request_.top_logprobs);
  grpc::ClientContext context;
  context.set_deadline(Deadline(request_.deadline, options_.rpc_timeout));
  if (!cancellation_->Enter(&context)) {
    return Finish(absl::CancelledError("cancelled"));
  }
  const absl::Status s =
      rpc::FromGrpcStatus(a.decode->Admit(&context, admit_request, &a.admit));
  cancellation_->Leave();
  if (!s.ok()) {
    if (cancellation_->cancelled()) {
      (void)AbortDecode(a);  // the Admit may have landed: free it
      return Finish(absl::CancelledError("cancelled"));
    }
    // (Never past the deadline here: an Admit deadline is the rpc bound.)
    last_error_ = Annotate(s, "decode worker", a.decode_address);
    // No KV for it now: wait in the admission queue, not an attempt spent.
    if (absl::IsResourceExhausted(s)) return Next::kNoRoom;
    if (absl::IsUnavailable(s)) {
      services_.registry.MarkUnhealthy(a.decode_address,
                                       std::string(s.message()));
    }
    return Retryable(s) ? Next::kRetry : Finish(last_error_);
  }
  // A migrated stream's usage stays its first admission's.
  if (!a.resume) {
    usage_.cached_prompt_tokens = static_cast<int32_t>(a.admit.cached_tokens());
  }
  return Next::kContinue;
}

ClusterRequest::Next ClusterRequest::PrefillOnGroup(Attempt& a) {
  // TTFT phases (metrics): colocated requests have no prefill call, their
  // whole TTFT counts as the first step. (The group was picked before the
  // decode worker admitted the request: RunAttempt.)
  const std::string address = a.prefill_address;
  if (metrics_ != nullptr) {
    metrics_->OnRouting(std::string(services_.prefill_policy.name()), "prefill",
                        address);
  }
  retry_side_ = "prefill";
  auto prefill = v1::PrefillGroup::NewStub(services_.channel_for(address));
  v1::PrefillSubmitRequest submit;
  submit.set_request_id(a.wire_id);
  submit.mutable_prompt_ids()->Add(prompt_ids_.begin(), prompt_ids_.end());
  *submit.mutable_sampling() = sampling_;
  submit.set_top_logprobs(request_.top_logprobs);
  submit.set_prompt_logprobs(submit_scored_);
  if (mode_ == RequestMode::kDisaggregated) {
    v1::PrefillDestination* destination = submit.mutable_destination();
    destination->set_decode_address(a.decode_address);
    destination->set_cached_tokens(a.admit.cached_tokens());
    *destination->mutable_ranks() = a.admit.ranks();
  }
  grpc::ClientContext context;
  context.set_deadline(Deadline(request_.deadline, options_.prefill_timeout));
  if (!cancellation_->Enter(&context)) {
    (void)AbortDecode(a);
    return Finish(absl::CancelledError("cancelled"));
  }
  const absl::Time submitted_at = absl::Now();
  v1::PrefillSubmitResponse prefilled;
  const absl::Status s =
      rpc::FromGrpcStatus(prefill->Prefill(&context, submit, &prefilled));
  a.prefill_returned_at = absl::Now();
  cancellation_->Leave();
  a.prefill_lease.reset();  // the group is done with the request
  if (!s.ok()) {
    // Stop the group's work for this request (it may still be running when
    // our side gave up) and free the decode side's blocks.
    grpc::ClientContext cancel_context;
    cancel_context.set_deadline(
        Deadline(absl::InfiniteFuture(), options_.rpc_timeout));
    v1::PrefillCancelRequest cancel;
    cancel.set_request_id(a.wire_id);
    v1::PrefillCancelResponse ignored;
    (void)prefill->Cancel(&cancel_context, cancel, &ignored);
    const absl::Status aborted = AbortDecode(a);
    if (cancellation_->cancelled()) {
      return Finish(absl::CancelledError("cancelled"));
    }
    if (absl::IsUnavailable(s) && absl::IsUnavailable(aborted)) {
      // The group could not reach the decode worker, and neither can we:
      // the decode worker is what failed (it died under the prefill), not
      // the group, which stays in rotation.
      retry_side_ = "decode";
      return Failed(aborted, "decode worker", a.decode_address,
                    /*retry=*/true);
    }
    return Failed(s, "prefill group", address, /*retry=*/true);
  }
  usage_.cached_prompt_tokens = static_cast<int32_t>(
      std::max<int64_t>(a.admit.cached_tokens(), prefilled.cached_tokens()));
  timing_.queue_seconds = prefilled.queue_seconds();
  timing_.prefill_seconds =
      prefilled.prefill_seconds() + prefilled.notify_seconds();
  a.breakdown.queue = absl::ToDoubleSeconds(submitted_at - started_) +
                      prefilled.queue_seconds();
  a.breakdown.prefill = prefilled.prefill_seconds();
  a.breakdown.kv_transfer = prefilled.notify_seconds();
  if (submit_scored_) {
    const absl::Status scored = TakeScores(
        prefilled.prompt_logprobs(), absl::StrCat("prefill group ", address));
    if (!scored.ok()) {
      (void)AbortDecode(a);
      return Finish(scored);
    }
  }
  // Nothing to generate: the prompt's numbers are the whole answer.
  if (mode_ == RequestMode::kScoreOnPrefill) return FinishWithEcho();
  return Next::kContinue;
}

absl::StatusOr<GenerationDelta> ClusterRequest::ReadDelta(
    const v1::DecodeDelta& in, const Attempt& a) const {
  GenerationDelta out;
  out.token_ids.assign(in.token_ids().begin(), in.token_ids().end());
  out.text = in.text();
  if (!request_.logprobs) return out;
  if (in.logprobs_size() != in.token_ids_size()) {
    return absl::InternalError(absl::StrCat(
        "decode worker ", a.decode_address, " sent ", in.logprobs_size(),
        " logprobs for ", in.token_ids_size(), " tokens"));
  }
  out.logprobs.reserve(in.logprobs_size());
  for (int k = 0; k < in.logprobs_size(); ++k) {
    out.logprobs.push_back(ToTokenLogprob(in.token_ids(k), in.logprobs(k)));
  }
  return out;
}

void ClusterRequest::ObserveTokens(size_t tokens, Attempt& a) {
  const absl::Time now = absl::Now();
  if (first_token_at_ == absl::InfinitePast()) {
    first_token_at_ = now;
    timing_.time_to_first_token_seconds = absl::ToDoubleSeconds(now - started_);
    FirstTokenReached();
    if (metrics_ != nullptr) {
      metrics_->ObserveTtft(timing_.time_to_first_token_seconds);
      a.breakdown.first_step =
          absl::ToDoubleSeconds(now - a.prefill_returned_at);
      metrics_->ObserveTtftBreakdown(a.breakdown);
    }
  } else if (metrics_ != nullptr) {
    // A speculative step delivers several tokens at once: spread the gap
    // over them, as a client reading tokens sees it.
    const double per_token = absl::ToDoubleSeconds(now - last_token_at_) /
                             static_cast<double>(tokens);
    for (size_t k = 0; k < tokens; ++k) metrics_->ObserveItl(per_token);
  }
  last_token_at_ = now;
}

void ClusterRequest::RestoreEchoSpace(GenerationDelta& out,
                                      bool& restore_space) const {
  const bool first_tokens =
      !out.token_ids.empty() &&
      usage_.completion_tokens == static_cast<int32_t>(out.token_ids.size());
  if (request_.echo && services_.tokenizer != nullptr && first_tokens) {
    absl::StatusOr<std::string> bytes =
        services_.tokenizer->TokenBytes(out.token_ids[0]);
    restore_space = bytes.ok() && absl::StartsWith(*bytes, " ");
  }
  if (restore_space && !out.text.empty()) {
    // The worker decodes the continuation on its own, dropping its first
    // word's space (SentencePiece's dummy prefix); after the echoed prompt
    // that space separates the two.
    if (!absl::StartsWith(out.text, " ")) out.text.insert(0, " ");
    restore_space = false;
  }
}

ClusterRequest::Next ClusterRequest::StreamFromDecode(Attempt& a) {
  grpc::ClientContext context;
  if (request_.deadline != absl::InfiniteFuture()) {
    context.set_deadline(absl::ToChronoTime(request_.deadline));
  }
  if (!cancellation_->Enter(&context)) {
    (void)AbortDecode(a);
    return Finish(absl::CancelledError("cancelled"));
  }
  v1::StreamTokensRequest stream_request;
  stream_request.set_request_id(a.wire_id);
  std::unique_ptr<grpc::ClientReader<v1::DecodeDelta>> reader =
      a.decode->StreamTokens(&context, stream_request);
  // Ends the stream early (this side found the worker's answer wrong) and
  // frees the request at the worker.
  auto abandon = [&](absl::Status why) {
    context.TryCancel();
    (void)reader->Finish();
    cancellation_->Leave();
    (void)AbortDecode(a);
    return Finish(std::move(why));
  };
  const bool score_only = request_.max_tokens == 0;
  v1::DecodeDelta in;
  bool finished = false;
  bool restore_space = false;  // echo: see below
  // Colocated: the decode worker scored the prompt; its numbers ride on the
  // first delta.
  bool awaiting_scores = a.local_prefill && !a.resume && submit_scored_;
  while (reader->Read(&in)) {
    if (awaiting_scores) {
      awaiting_scores = false;
      const absl::Status s =
          TakeScores(in.prompt_logprobs(),
                     absl::StrCat("decode worker ", a.decode_address));
      if (!s.ok()) return abandon(s);
    }
    if (score_only) {
      // The token sampled after the scored prompt is not part of the answer;
      // the stream ends after it (max_tokens 1).
      if (!in.finished()) continue;
      (void)reader->Finish();
      cancellation_->Leave();
      return FinishWithEcho();
    }
    absl::StatusOr<GenerationDelta> read = ReadDelta(in, a);
    if (!read.ok()) {
      last_error_ = read.status();
      return abandon(last_error_);
    }
    GenerationDelta& out = *read;
    usage_.completion_tokens += static_cast<int32_t>(out.token_ids.size());
    const absl::Duration since_start = absl::Now() - started_;
    if (!out.token_ids.empty()) ObserveTokens(out.token_ids.size(), a);
    // A worker that ends the stream as cancelled without this side asking
    // (it shut down with the request on it) broke the stream: the tokens
    // with it are good, the end is not.
    const bool ended_by_worker =
        in.finished() && in.finish_reason() == v1::FINISH_REASON_CANCELLED &&
        !cancellation_->cancelled();
    if (in.finished() && !ended_by_worker) {
      finished = true;
      out.finished = true;
      out.finish_reason = MapFinish(in.finish_reason());
      out.usage = usage_;
      timing_.total_seconds = absl::ToDoubleSeconds(since_start);
      out.timing = timing_;
    }
    RestoreEchoSpace(out, restore_space);
    if (echo_.has_value()) out.echo = std::move(echo_);  // first delta only
    echo_.reset();
    streamed_ids_.insert(streamed_ids_.end(), out.token_ids.begin(),
                         out.token_ids.end());
    streamed_text_bytes_ += static_cast<int64_t>(in.text().size());
    if (out.finished || !out.token_ids.empty() || !out.text.empty() ||
        out.echo.has_value()) {
      delivered_ = true;
      observer_->OnDelta(std::move(out));
    }
    if (finished) break;
    if (ended_by_worker) {
      context.TryCancel();
      (void)reader->Finish();
      cancellation_->Leave();
      (void)AbortDecode(a);
      retry_side_ = "decode";
      return StreamBroke(
          absl::UnavailableError(absl::StrCat(
              "ended the stream (", in.finish_detail(), ") without a cancel")),
          a.decode_address);
    }
  }
  absl::Status s = rpc::FromGrpcStatus(reader->Finish());
  cancellation_->Leave();
  if (finished) return Finish(absl::OkStatus());
  if (cancellation_->cancelled()) {
    (void)AbortDecode(a);  // the cancelled stream aborted it already; be sure
    return Finish(absl::CancelledError("cancelled"));
  }
  if (s.ok()) {
    s = absl::InternalError("token stream ended without a finished item");
  }
  (void)AbortDecode(a);
  retry_side_ = "decode";
  if (!streamed_ids_.empty()) return StreamBroke(s, a.decode_address);
  return Failed(s, "decode worker", a.decode_address,
                /*retry=*/!delivered_);
}

ClusterRequest::Next ClusterRequest::StreamBroke(const absl::Status& status,
                                                 const std::string& address) {
  last_error_ = Annotate(status, "decode worker", address);
  if (absl::IsUnavailable(status)) {
    services_.registry.MarkUnhealthy(address, std::string(status.message()));
  }
  if (cancellation_->cancelled()) {
    return Finish(absl::CancelledError("cancelled"));
  }
  // Errors the request itself caused would only repeat elsewhere.
  const bool request_fault =
      absl::IsInvalidArgument(status) || absl::IsFailedPrecondition(status) ||
      absl::IsOutOfRange(status) || absl::IsPermissionDenied(status) ||
      absl::IsUnauthenticated(status) || absl::IsUnimplemented(status);
  if (request_fault || absl::Now() >= request_.deadline) {
    return Finish(last_error_);
  }
  if (migrations_ >= options_.max_migrations) {
    if (metrics_ != nullptr) metrics_->OnMigration("spent");
    return Finish(absl::Status(
        last_error_.code(), absl::StrCat(last_error_.message(), " (after ",
                                         migrations_, " stream migrations)")));
  }
  ++migrations_;
  if (metrics_ != nullptr) metrics_->OnMigration("started");
  {
    absl::MutexLock lock(&services_.book.mu);
    ++services_.book.stats.migrations;
  }
  return Next::kMigrate;
}

absl::Status ClusterRequest::AbortDecode(const Attempt& a) {
  if (a.decode == nullptr) return absl::OkStatus();
  grpc::ClientContext context;
  context.set_deadline(Deadline(absl::InfiniteFuture(), options_.rpc_timeout));
  v1::AbortRequest abort;
  abort.set_request_id(a.wire_id);
  v1::AbortResponse ignored;
  const absl::Status s =
      rpc::FromGrpcStatus(a.decode->Abort(&context, abort, &ignored));
  if (services_.abort_retrier != nullptr && AbortRetrier::WorthRetrying(s)) {
    services_.abort_retrier->Add(a.decode_address, a.wire_id);
  }
  return s;
}

void ClusterRequest::ResetEcho() {
  echo_.reset();
  if (!request_.echo) return;
  echo_.emplace();
  if (request_.prompt_text.has_value()) {
    echo_->text = *request_.prompt_text;
  } else if (services_.tokenizer != nullptr) {
    absl::StatusOr<std::string> text = services_.tokenizer->Decode(prompt_ids_);
    if (text.ok()) echo_->text = *std::move(text);
  }
}

TokenAlternative ClusterRequest::Alternative(int32_t id, float logprob) const {
  // Token text for logprob listings; a worker's id outside the vocabulary
  // keeps its id and no text rather than failing the stream.
  TokenAlternative out{id, logprob, {}};
  if (services_.tokenizer != nullptr) {
    absl::StatusOr<std::string> bytes = services_.tokenizer->TokenBytes(id);
    if (bytes.ok()) out.bytes = *std::move(bytes);
    out.control = services_.tokenizer->IsControl(id);
  }
  return out;
}

TokenLogprob ClusterRequest::ToTokenLogprob(int32_t id,
                                            const v1::TokenLogprob& l) const {
  const engine::TokenLogprobs wire = rpc::LogprobsFromWire(l);
  TokenLogprob entry;
  entry.chosen = Alternative(id, wire.logprob);
  for (const engine::TopLogprob& t : wire.top) {
    entry.top.push_back(Alternative(t.token, t.logprob));
  }
  return entry;
}

absl::Status ClusterRequest::TakeScores(
    const google::protobuf::RepeatedPtrField<v1::TokenLogprob>& scores,
    const std::string& who) {
  if (scores.size() + 1 != static_cast<int>(prompt_ids_.size())) {
    return absl::InternalError(absl::StrCat(who, " scored ", scores.size(),
                                            " prompt tokens of ",
                                            prompt_ids_.size() - 1));
  }
  echo_->first_token = Alternative(prompt_ids_[0], 0.0f);
  for (int k = 0; k < scores.size(); ++k) {
    echo_->scored_tokens.push_back(
        ToTokenLogprob(prompt_ids_[k + 1], scores[k]));
  }
  return absl::OkStatus();
}

void ClusterRequest::FirstTokenReached() {
  if (!awaiting_first_) return;
  awaiting_first_ = false;
  if (metrics_ != nullptr) {
    metrics_->SetQueued(services_.book.awaiting_first_token.fetch_sub(1) - 1);
  }
}

ClusterRequest::Next ClusterRequest::Finish(absl::Status status) {
  FirstTokenReached();
  if (metrics_ != nullptr && status.ok()) {
    metrics_->ObserveE2e(absl::ToDoubleSeconds(absl::Now() - started_));
    if (usage_.completion_tokens >= 2) {
      metrics_->ObserveTpot(
          absl::ToDoubleSeconds(last_token_at_ - first_token_at_) /
          (usage_.completion_tokens - 1));
    }
    metrics_->OnTokens(usage_.prompt_tokens, usage_.completion_tokens);
  }
  {
    absl::MutexLock lock(&services_.book.mu);
    ClusterBackendStats& stats = services_.book.stats;
    if (status.ok()) {
      ++stats.succeeded;
    } else if (absl::IsCancelled(status)) {
      ++stats.cancelled;
    } else {
      ++stats.failed;
    }
  }
  observer_->OnDone(std::move(status));
  // Its KV is (being) freed: the head of the admission line may fit now.
  services_.queue.CapacityChanged();
  return Next::kDone;
}

ClusterRequest::Next ClusterRequest::FinishWithEcho() {
  GenerationDelta out;
  out.echo = std::move(echo_);
  out.finished = true;
  out.finish_reason = FinishReason::kLength;
  out.usage = usage_;
  timing_.total_seconds = absl::ToDoubleSeconds(absl::Now() - started_);
  out.timing = timing_;
  observer_->OnDelta(std::move(out));
  return Finish(absl::OkStatus());
}

}  // namespace pdserve::router
