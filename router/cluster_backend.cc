#include "router/cluster_backend.h"

#include <grpcpp/grpcpp.h>

#include <list>
#include <thread>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "kv/block_manager.h"
#include "pdserve/v1/decode.grpc.pb.h"
#include "pdserve/v1/prefill.grpc.pb.h"
#include "rpc/status_conversion.h"

namespace pdserve::router {

// Lives as long as the longest of the backend and its call threads: the
// threads report their end here, and the destructor waits on it.
struct ClusterBackend::Shared {
  absl::Mutex mu;
  std::list<std::weak_ptr<CallState>> calls ABSL_GUARDED_BY(mu);
  ClusterBackendStats stats ABSL_GUARDED_BY(mu);
  // Requests started and not yet at their first token (the "queued" gauge:
  // the router itself never queues, so this is time spent in admission,
  // prefill and KV transfer).
  std::atomic<int64_t> awaiting_first_token{0};
};

struct ClusterBackend::CallState {
  std::atomic<bool> cancelled{false};
  absl::Mutex mu;
  // The RPC in flight, which Cancel() interrupts.
  grpc::ClientContext* active ABSL_GUARDED_BY(mu) = nullptr;

  void Cancel() {
    cancelled.store(true);
    absl::MutexLock lock(&mu);
    if (active != nullptr) active->TryCancel();
  }
  // Registers `context` for cancellation; false when already cancelled.
  bool Enter(grpc::ClientContext* context) {
    absl::MutexLock lock(&mu);
    if (cancelled.load()) return false;
    active = context;
    return true;
  }
  void Leave() {
    absl::MutexLock lock(&mu);
    active = nullptr;
  }
};

namespace {

class ClusterCall final : public GenerationCall {
 public:
  explicit ClusterCall(std::shared_ptr<ClusterBackend::CallState> state)
      : state_(std::move(state)) {}
  void Cancel() override { state_->Cancel(); }

 private:
  std::shared_ptr<ClusterBackend::CallState> state_;
};

// The errors after which another worker may well succeed.
bool Retryable(const absl::Status& status) {
  return absl::IsUnavailable(status) || absl::IsResourceExhausted(status) ||
         absl::IsAborted(status);
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

absl::StatusOr<std::unique_ptr<ClusterBackend>> ClusterBackend::Create(
    ClusterBackendOptions options, const tokenizer::Tokenizer* tokenizer,
    WorkerRegistry* registry, std::unique_ptr<AssignmentPolicy> prefill_policy,
    std::unique_ptr<AssignmentPolicy> decode_policy) {
  if (registry == nullptr || prefill_policy == nullptr ||
      decode_policy == nullptr) {
    return absl::InvalidArgumentError(
        "cluster backend needs a registry and both policies");
  }
  if (options.model.name.empty() || options.model.context_length <= 0 ||
      options.model.vocab_size <= 0) {
    return absl::InvalidArgumentError(
        "cluster backend needs the model's name, context and vocabulary size");
  }
  if (options.block_size <= 0 || options.max_attempts < 1) {
    return absl::InvalidArgumentError(
        "block_size and max_attempts must be >= 1");
  }
  return std::unique_ptr<ClusterBackend>(
      new ClusterBackend(std::move(options), tokenizer, registry,
                         std::move(prefill_policy), std::move(decode_policy)));
}

ClusterBackend::ClusterBackend(ClusterBackendOptions options,
                               const tokenizer::Tokenizer* tokenizer,
                               WorkerRegistry* registry,
                               std::unique_ptr<AssignmentPolicy> prefill_policy,
                               std::unique_ptr<AssignmentPolicy> decode_policy)
    : options_(std::move(options)),
      tokenizer_(tokenizer),
      registry_(registry),
      prefill_policy_(std::move(prefill_policy)),
      decode_policy_(std::move(decode_policy)),
      shared_(std::make_shared<Shared>()) {}

ClusterBackend::~ClusterBackend() {
  absl::MutexLock lock(&shared_->mu);
  for (auto& weak : shared_->calls) {
    if (auto call = weak.lock()) call->Cancel();
  }
  // Each thread's cancellation path makes only bounded RPCs (rpc_timeout).
  shared_->mu.Await(absl::Condition(
      +[](ClusterBackendStats* s) { return s->active == 0; }, &shared_->stats));
}

std::vector<ModelDescription> ClusterBackend::ListModels() const {
  return {options_.model};
}

absl::Status ClusterBackend::Health() const {
  int prefill = 0;
  int decode = 0;
  for (const WorkerView& w : registry_->Snapshot(WorkerRole::kPrefill)) {
    prefill += w.eligible ? 1 : 0;
  }
  for (const WorkerView& w : registry_->Snapshot(WorkerRole::kDecode)) {
    decode += w.eligible ? 1 : 0;
  }
  if (options_.colocated) prefill = 1;  // not needed
  if (prefill == 0 || decode == 0) {
    return absl::UnavailableError(
        absl::StrCat("no healthy ", prefill == 0 ? "prefill group" : "",
                     prefill == 0 && decode == 0 ? " and no healthy " : "",
                     decode == 0 ? "decode worker" : ""));
  }
  return absl::OkStatus();
}

ClusterBackendStats ClusterBackend::stats() const {
  absl::MutexLock lock(&shared_->mu);
  return shared_->stats;
}

std::shared_ptr<grpc::Channel> ClusterBackend::ChannelFor(
    const std::string& address) {
  absl::MutexLock lock(&channels_mu_);
  std::shared_ptr<grpc::Channel>& channel = channels_[address];
  if (channel == nullptr) {
    grpc::ChannelArguments args;
    // Long token streams: no cap on a message stream's lifetime, but a
    // worker that went away must be noticed on reconnect quickly.
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    channel = grpc::CreateCustomChannel(
        address, grpc::InsecureChannelCredentials(), args);
  }
  return channel;
}

absl::StatusOr<std::unique_ptr<GenerationCall>> ClusterBackend::Start(
    GenerationRequest request, GenerationObserver* observer) {
  PDS_RETURN_IF_ERROR(ValidateGenerationRequest(request));
  if (request.model != options_.model.name) {
    return absl::NotFoundError(
        absl::StrCat("model '", request.model, "' is not served here"));
  }
  std::vector<int32_t> ids;
  if (request.prompt_ids.has_value()) {
    ids = *request.prompt_ids;
    for (int32_t id : ids) {
      if (id < 0 || id >= options_.model.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat(
            "prompt token id ", id, " is outside the vocabulary [0, ",
            options_.model.vocab_size, ")"));
      }
    }
  } else {
    if (tokenizer_ == nullptr) {
      return absl::InvalidArgumentError(
          "this router has no tokenizer: send token ids");
    }
    PDS_ASSIGN_OR_RETURN(ids, tokenizer_->Encode(*request.prompt_text));
  }
  const int64_t context = options_.model.context_length;
  const int64_t n = static_cast<int64_t>(ids.size());
  if (n == 0) return absl::InvalidArgumentError("prompt is empty");
  if (n >= context) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt has ", n, " tokens; the model's context is ",
                     context, " tokens"));
  }
  if (n + request.max_tokens > context) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens ", request.max_tokens,
                     " exceeds the context: the prompt's ", n, " tokens leave ",
                     context - n, " of ", context));
  }
  if (absl::Now() >= request.deadline) {
    return absl::DeadlineExceededError("deadline passed before the start");
  }
  auto state = std::make_shared<CallState>();
  {
    absl::MutexLock lock(&shared_->mu);
    // Forget finished calls while here, so the list stays as long as the
    // number of live calls.
    shared_->calls.remove_if(
        [](const std::weak_ptr<CallState>& w) { return w.expired(); });
    shared_->calls.push_back(state);
    ++shared_->stats.started;
    ++shared_->stats.active;
  }
  std::thread([this, state, request = std::move(request), ids = std::move(ids),
               observer]() mutable {
    std::shared_ptr<Shared> shared = shared_;
    Run(state, std::move(request), std::move(ids), observer);
    // Nothing of `this` is touched from here on: the destructor may run.
    absl::MutexLock lock(&shared->mu);
    --shared->stats.active;
  }).detach();
  return std::make_unique<ClusterCall>(std::move(state));
}

void ClusterBackend::Run(std::shared_ptr<CallState> call,
                         GenerationRequest request,
                         std::vector<int32_t> prompt_ids,
                         GenerationObserver* observer) {
  const absl::Time started = absl::Now();
  const std::vector<uint64_t> hashes =
      kv::FullBlockHashes(prompt_ids, options_.block_size);
  AssignmentContext assignment{hashes};
  v1::SamplingParams sampling;
  rpc::SamplingToWire(request.sampling, &sampling);

  GenerationUsage usage;
  usage.prompt_tokens = static_cast<int32_t>(prompt_ids.size());
  GenerationTiming timing;
  // Token text for logprob listings; a worker's id outside the vocabulary
  // keeps its id and no text rather than failing the stream.
  auto alternative = [this](int32_t id, float logprob) {
    TokenAlternative out{id, logprob, {}};
    if (tokenizer_ != nullptr) {
      absl::StatusOr<std::string> bytes = tokenizer_->TokenBytes(id);
      if (bytes.ok()) out.bytes = *std::move(bytes);
      out.control = tokenizer_->IsControl(id);
    }
    return out;
  };
  auto to_token_logprob = [&](int32_t id, const v1::TokenLogprob& l) {
    TokenLogprob entry;
    entry.chosen = alternative(id, l.logprob());
    for (const v1::TopLogprob& t : l.top()) {
      entry.top.push_back(alternative(t.token_id(), t.logprob()));
    }
    return entry;
  };
  // Echo: the prompt's text now; its scores (with logprobs) come from the
  // prefill group. Delivered with the first delta.
  const bool score_only = request.max_tokens == 0;
  const bool submit_scored = request.echo && request.logprobs;
  std::optional<PromptEcho> echo;
  auto reset_echo = [&] {
    echo.reset();
    if (!request.echo) return;
    echo.emplace();
    if (request.prompt_text.has_value()) {
      echo->text = *request.prompt_text;
    } else if (tokenizer_ != nullptr) {
      absl::StatusOr<std::string> text = tokenizer_->Decode(prompt_ids);
      if (text.ok()) echo->text = *std::move(text);
    }
  };
  // The prompt's scores as a worker (`who`) reported them, one per prompt
  // token after the first; INTERNAL for any other count.
  auto take_scores =
      [&](const google::protobuf::RepeatedPtrField<v1::TokenLogprob>& scores,
          const std::string& who) -> absl::Status {
    if (scores.size() + 1 != static_cast<int>(prompt_ids.size())) {
      return absl::InternalError(absl::StrCat(who, " scored ", scores.size(),
                                              " prompt tokens of ",
                                              prompt_ids.size() - 1));
    }
    echo->first_token = alternative(prompt_ids[0], 0.0f);
    for (int k = 0; k < scores.size(); ++k) {
      echo->scored_tokens.push_back(
          to_token_logprob(prompt_ids[k + 1], scores[k]));
    }
    return absl::OkStatus();
  };
  bool delivered = false;  // a delta reached the observer: no more retries
  metrics::RouterMetrics* const m = options_.metrics;
  bool awaiting_first = true;
  if (m != nullptr) {
    m->SetQueued(shared_->awaiting_first_token.fetch_add(1) + 1);
  }
  auto first_token_reached = [&] {
    if (!awaiting_first) return;
    awaiting_first = false;
    if (m != nullptr) {
      m->SetQueued(shared_->awaiting_first_token.fetch_sub(1) - 1);
    }
  };
  absl::Time first_token_at = absl::InfinitePast();
  absl::Time last_token_at = absl::InfinitePast();
  std::string retry_side;

  auto finish = [&](absl::Status status) {
    first_token_reached();
    if (m != nullptr && status.ok()) {
      m->ObserveE2e(absl::ToDoubleSeconds(absl::Now() - started));
      if (usage.completion_tokens >= 2) {
        m->ObserveTpot(absl::ToDoubleSeconds(last_token_at - first_token_at) /
                       (usage.completion_tokens - 1));
      }
      m->OnTokens(usage.prompt_tokens, usage.completion_tokens);
    }
    {
      absl::MutexLock lock(&shared_->mu);
      if (status.ok()) {
        ++shared_->stats.succeeded;
      } else if (absl::IsCancelled(status)) {
        ++shared_->stats.cancelled;
      } else {
        ++shared_->stats.failed;
      }
    }
    observer->OnDone(std::move(status));
  };

  absl::Status last_error = absl::UnavailableError("no attempt made");
  // A request generating nothing ends with one delta: the echoed prompt.
  auto finish_with_echo = [&] {
    GenerationDelta out;
    out.echo = std::move(echo);
    out.finished = true;
    out.finish_reason = FinishReason::kLength;
    out.usage = usage;
    timing.total_seconds = absl::ToDoubleSeconds(absl::Now() - started);
    out.timing = timing;
    observer->OnDelta(std::move(out));
    finish(absl::OkStatus());
  };
  if (score_only && !submit_scored) {
    // Echo of the prompt with nothing to generate or score: no worker needed.
    reset_echo();
    return finish_with_echo();
  }
  for (int attempt = 0; attempt < options_.max_attempts; ++attempt) {
    reset_echo();  // a retry scores the prompt again
    if (attempt > 0) {
      if (m != nullptr) m->OnRetry(retry_side);
      absl::MutexLock lock(&shared_->mu);
      ++shared_->stats.retries;
    }
    if (call->cancelled.load())
      return finish(absl::CancelledError("cancelled"));
    if (absl::Now() >= request.deadline) {
      return finish(absl::DeadlineExceededError(
          absl::StrCat("deadline exceeded before the first token (last error: ",
                       last_error.message(), ")")));
    }

    // --- Decode worker: admit (allocates the KV destination). ---
    // Not for a request that only scores its prompt on a prefill group: it
    // needs no decode worker and its KV goes nowhere. (Colocated, the decode
    // worker is what scores it.)
    const bool uses_decode = !score_only || options_.colocated;
    std::string decode_address;
    std::unique_ptr<v1::DecodeWorker::Stub> decode;
    const uint64_t wire_id = NewWireId();
    if (uses_decode) {
      absl::StatusOr<WorkerLease> decode_lease =
          registry_->Assign(WorkerRole::kDecode, *decode_policy_, assignment);
      if (!decode_lease.ok()) {
        return finish(attempt == 0
                          ? decode_lease.status()
                          : absl::UnavailableError(absl::StrCat(
                                decode_lease.status().message(),
                                "; last error: ", last_error.message())));
      }
      decode_address = decode_lease->address();
      if (m != nullptr) {
        m->OnRouting(std::string(decode_policy_->name()), "decode",
                     decode_address);
      }
      retry_side = "decode";
      decode = v1::DecodeWorker::NewStub(ChannelFor(decode_address));
    }
    // Frees the request's blocks at the decode worker (best effort: NOT_FOUND
    // when it already finished or was never admitted).
    auto abort_decode = [&] {
      if (decode == nullptr) return;
      grpc::ClientContext context;
      context.set_deadline(
          Deadline(absl::InfiniteFuture(), options_.rpc_timeout));
      v1::AbortRequest abort;
      abort.set_request_id(wire_id);
      v1::AbortResponse ignored;
      (void)decode->Abort(&context, abort, &ignored);
    };
    v1::AdmitResponse admit;
    if (uses_decode) {
      v1::AdmitRequest admit_request;
      admit_request.set_request_id(wire_id);
      admit_request.mutable_prompt_ids()->Add(prompt_ids.begin(),
                                              prompt_ids.end());
      // Colocated scoring only: the worker prefills (and scores) the prompt
      // and samples one token, which is not returned.
      admit_request.set_max_tokens(score_only ? 1 : request.max_tokens);
      admit_request.set_include_prompt_logprobs(options_.colocated &&
                                                submit_scored);
      *admit_request.mutable_sampling() = sampling;
      for (const std::string& s : request.stop) admit_request.add_stop(s);
      admit_request.set_ignore_eos(request.ignore_eos);
      admit_request.set_local_prefill(options_.colocated);
      admit_request.set_include_logprobs(request.logprobs);
      admit_request.set_top_logprobs(request.top_logprobs);
      grpc::ClientContext context;
      context.set_deadline(Deadline(request.deadline, options_.rpc_timeout));
      if (!call->Enter(&context)) {
        return finish(absl::CancelledError("cancelled"));
      }
      absl::Status s =
          rpc::FromGrpcStatus(decode->Admit(&context, admit_request, &admit));
      call->Leave();
      if (!s.ok()) {
        if (call->cancelled.load()) {
          abort_decode();  // the Admit may have landed: free it
          return finish(absl::CancelledError("cancelled"));
        }
        last_error = Annotate(s, "decode worker", decode_address);
        if (absl::IsUnavailable(s)) {
          registry_->MarkUnhealthy(decode_address, std::string(s.message()));
        }
        if (Retryable(s)) continue;
        return finish(last_error);
      }
    }
    // From here on the decode worker holds KV blocks for `wire_id`: every
    // exit path below frees them (Abort), unless the stream finished.
    usage.cached_prompt_tokens = static_cast<int32_t>(admit.cached_tokens());

    // --- Prefill group: compute the prompt, write its KV, first token. ---
    // TTFT phases (metrics): colocated requests have no prefill call, their
    // whole TTFT counts as the first step.
    absl::Time prefill_submitted_at = absl::Now();
    absl::Time prefill_returned_at = prefill_submitted_at;
    metrics::TtftBreakdown breakdown;
    if (!options_.colocated) {
      absl::StatusOr<WorkerLease> prefill_lease =
          registry_->Assign(WorkerRole::kPrefill, *prefill_policy_, assignment);
      if (!prefill_lease.ok()) {
        abort_decode();
        return finish(prefill_lease.status());
      }
      const std::string prefill_address = prefill_lease->address();
      if (m != nullptr) {
        m->OnRouting(std::string(prefill_policy_->name()), "prefill",
                     prefill_address);
      }
      retry_side = "prefill";
      auto prefill = v1::PrefillGroup::NewStub(ChannelFor(prefill_address));
      v1::PrefillSubmitResponse prefilled;
      {
        v1::PrefillSubmitRequest submit;
        submit.set_request_id(wire_id);
        submit.mutable_prompt_ids()->Add(prompt_ids.begin(), prompt_ids.end());
        *submit.mutable_sampling() = sampling;
        submit.set_top_logprobs(request.top_logprobs);
        submit.set_prompt_logprobs(submit_scored);
        if (!score_only) {
          v1::PrefillDestination* destination = submit.mutable_destination();
          destination->set_decode_address(decode_address);
          destination->set_cached_tokens(admit.cached_tokens());
          *destination->mutable_ranks() = admit.ranks();
        }
        grpc::ClientContext context;
        context.set_deadline(
            Deadline(request.deadline, options_.prefill_timeout));
        if (!call->Enter(&context)) {
          abort_decode();
          return finish(absl::CancelledError("cancelled"));
        }
        prefill_submitted_at = absl::Now();
        absl::Status s =
            rpc::FromGrpcStatus(prefill->Prefill(&context, submit, &prefilled));
        prefill_returned_at = absl::Now();
        call->Leave();
        if (!s.ok()) {
          // Stop the group's work for this request (it may still be running
          // when our side gave up) and free the decode side's blocks.
          grpc::ClientContext cancel_context;
          cancel_context.set_deadline(
              Deadline(absl::InfiniteFuture(), options_.rpc_timeout));
          v1::PrefillCancelRequest cancel;
          cancel.set_request_id(wire_id);
          v1::PrefillCancelResponse ignored;
          (void)prefill->Cancel(&cancel_context, cancel, &ignored);
          abort_decode();
          if (call->cancelled.load()) {
            return finish(absl::CancelledError("cancelled"));
          }
          last_error = Annotate(s, "prefill group", prefill_address);
          if (absl::IsUnavailable(s)) {
            registry_->MarkUnhealthy(prefill_address, std::string(s.message()));
          }
          if (absl::IsDeadlineExceeded(s) && absl::Now() >= request.deadline) {
            return finish(last_error);
          }
          if (Retryable(s)) continue;
          return finish(last_error);
        }
      }
      usage.cached_prompt_tokens = static_cast<int32_t>(
          std::max<int64_t>(admit.cached_tokens(), prefilled.cached_tokens()));
      timing.queue_seconds = prefilled.queue_seconds();
      timing.prefill_seconds =
          prefilled.prefill_seconds() + prefilled.notify_seconds();
      breakdown.queue = absl::ToDoubleSeconds(prefill_submitted_at - started) +
                        prefilled.queue_seconds();
      breakdown.prefill = prefilled.prefill_seconds();
      breakdown.kv_transfer = prefilled.notify_seconds();
      if (submit_scored) {
        absl::Status s =
            take_scores(prefilled.prompt_logprobs(),
                        absl::StrCat("prefill group ", prefill_address));
        if (!s.ok()) {
          abort_decode();
          return finish(s);
        }
      }
      // Nothing to generate: the prompt's numbers are the whole answer.
      if (score_only) return finish_with_echo();
    }

    // --- Decode worker: stream the tokens. ---
    grpc::ClientContext context;
    if (request.deadline != absl::InfiniteFuture()) {
      context.set_deadline(absl::ToChronoTime(request.deadline));
    }
    if (!call->Enter(&context)) {
      abort_decode();
      return finish(absl::CancelledError("cancelled"));
    }
    v1::StreamTokensRequest stream_request;
    stream_request.set_request_id(wire_id);
    std::unique_ptr<grpc::ClientReader<v1::DecodeDelta>> reader =
        decode->StreamTokens(&context, stream_request);
    v1::DecodeDelta in;
    bool finished = false;
    bool restore_space = false;  // echo: see below
    // Colocated: the decode worker scored the prompt; its numbers ride on
    // the first delta.
    bool awaiting_scores = options_.colocated && submit_scored;
    while (reader->Read(&in)) {
      if (awaiting_scores) {
        awaiting_scores = false;
        absl::Status s =
            take_scores(in.prompt_logprobs(),
                        absl::StrCat("decode worker ", decode_address));
        if (!s.ok()) {
          context.TryCancel();
          (void)reader->Finish();
          call->Leave();
          abort_decode();
          return finish(s);
        }
      }
      if (score_only) {
        // The token sampled after the scored prompt is not part of the
        // answer; the stream ends after it (max_tokens 1).
        if (!in.finished()) continue;
        (void)reader->Finish();
        call->Leave();
        return finish_with_echo();
      }
      GenerationDelta out;
      out.token_ids.assign(in.token_ids().begin(), in.token_ids().end());
      out.text = in.text();
      if (request.logprobs) {
        if (in.logprobs_size() != in.token_ids_size()) {
          last_error = absl::InternalError(absl::StrCat(
              "decode worker ", decode_address, " sent ", in.logprobs_size(),
              " logprobs for ", in.token_ids_size(), " tokens"));
          context.TryCancel();
          (void)reader->Finish();
          call->Leave();
          abort_decode();
          return finish(last_error);
        }
        out.logprobs.reserve(in.logprobs_size());
        for (int k = 0; k < in.logprobs_size(); ++k) {
          out.logprobs.push_back(
              to_token_logprob(in.token_ids(k), in.logprobs(k)));
        }
      }
      usage.completion_tokens += static_cast<int32_t>(out.token_ids.size());
      const absl::Duration since_start = absl::Now() - started;
      if (!out.token_ids.empty()) {
        const absl::Time now = absl::Now();
        if (first_token_at == absl::InfinitePast()) {
          first_token_at = now;
          timing.time_to_first_token_seconds =
              absl::ToDoubleSeconds(since_start);
          first_token_reached();
          if (m != nullptr) {
            m->ObserveTtft(timing.time_to_first_token_seconds);
            breakdown.first_step =
                absl::ToDoubleSeconds(now - prefill_returned_at);
            m->ObserveTtftBreakdown(breakdown);
          }
        } else if (m != nullptr) {
          // A speculative step delivers several tokens at once: spread the
          // gap over them, as a client reading tokens sees it.
          const double per_token = absl::ToDoubleSeconds(now - last_token_at) /
                                   static_cast<double>(out.token_ids.size());
          for (size_t k = 0; k < out.token_ids.size(); ++k) {
            m->ObserveItl(per_token);
          }
        }
        last_token_at = now;
      }
      if (in.finished()) {
        finished = true;
        out.finished = true;
        out.finish_reason = MapFinish(in.finish_reason());
        out.usage = usage;
        timing.total_seconds = absl::ToDoubleSeconds(since_start);
        out.timing = timing;
      }
      const bool first_tokens =
          !out.token_ids.empty() &&
          usage.completion_tokens == static_cast<int32_t>(out.token_ids.size());
      if (request.echo && tokenizer_ != nullptr && first_tokens) {
        absl::StatusOr<std::string> bytes =
            tokenizer_->TokenBytes(out.token_ids[0]);
        restore_space = bytes.ok() && absl::StartsWith(*bytes, " ");
      }
      if (restore_space && !out.text.empty()) {
        // The worker decodes the continuation on its own, dropping its first
        // word's space (SentencePiece's dummy prefix); after the echoed
        // prompt that space separates the two.
        if (!absl::StartsWith(out.text, " ")) out.text.insert(0, " ");
        restore_space = false;
      }
      if (echo.has_value()) out.echo = std::move(echo);  // first delta only
      echo.reset();
      if (out.finished || !out.token_ids.empty() || !out.text.empty() ||
          out.echo.has_value()) {
        delivered = true;
        observer->OnDelta(std::move(out));
      }
      if (finished) break;
    }
    absl::Status s = rpc::FromGrpcStatus(reader->Finish());
    call->Leave();
    if (finished) return finish(absl::OkStatus());
    if (call->cancelled.load()) {
      abort_decode();  // the cancelled stream aborted it already; be sure
      return finish(absl::CancelledError("cancelled"));
    }
    if (s.ok()) {
      s = absl::InternalError("token stream ended without a finished item");
    }
    last_error = Annotate(s, "decode worker", decode_address);
    if (absl::IsUnavailable(s)) {
      registry_->MarkUnhealthy(decode_address, std::string(s.message()));
    }
    abort_decode();
    if (absl::IsDeadlineExceeded(s) && absl::Now() >= request.deadline) {
      return finish(last_error);
    }
    retry_side = "decode";
    if (!delivered && Retryable(s)) continue;
    return finish(last_error);
  }
  finish(absl::UnavailableError(
      absl::StrCat("gave up after ", options_.max_attempts,
                   " attempts; last error: ", last_error.message())));
}

}  // namespace pdserve::router
