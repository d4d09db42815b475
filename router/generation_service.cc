#include "router/generation_service.h"

#include <google/protobuf/unknown_field_set.h>

#include <atomic>
#include <deque>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "rpc/status_conversion.h"

namespace pdserve::router {
namespace {

v1::FinishReason ToProto(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop:
      return v1::FINISH_REASON_STOP;
    case FinishReason::kLength:
      return v1::FINISH_REASON_LENGTH;
    case FinishReason::kCancelled:
      return v1::FINISH_REASON_CANCELLED;
    case FinishReason::kError:
      return v1::FINISH_REASON_ERROR;
    case FinishReason::kNone:
      break;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

// Appends `delta` to `out` (the streaming item or the unary accumulator).
void AppendTop(const std::vector<TokenAlternative>& alternatives,
               v1::TopLogprobs* top) {
  for (const TokenAlternative& t : alternatives) {
    v1::TopLogprob* alternative = top->add_alternatives();
    alternative->set_token_id(t.token_id);
    alternative->set_logprob(t.logprob);
  }
}

void AppendDelta(const GenerationDelta& delta, int32_t top_logprobs,
                 bool logprobs, v1::GenerateResponse* out) {
  if (delta.echo.has_value()) {
    v1::PromptEcho* echo = out->mutable_echo();
    echo->set_text(delta.echo->text);
    if (logprobs) {
      echo->add_token_ids(delta.echo->first_token.token_id);
      for (const TokenLogprob& l : delta.echo->scored_tokens) {
        echo->add_token_ids(l.chosen.token_id);
        echo->add_logprobs(l.chosen.logprob);
        if (top_logprobs > 0) AppendTop(l.top, echo->add_top_logprobs());
      }
    }
  }
  for (int32_t id : delta.token_ids) out->add_token_ids(id);
  out->mutable_text()->append(delta.text);
  for (const TokenLogprob& l : delta.logprobs) {
    out->add_logprobs(l.chosen.logprob);
    if (top_logprobs > 0) AppendTop(l.top, out->add_top_logprobs());
  }
  if (!delta.finished) return;
  out->set_finish_reason(ToProto(delta.finish_reason));
  v1::Usage* usage = out->mutable_usage();
  usage->set_prompt_tokens(delta.usage.prompt_tokens);
  usage->set_completion_tokens(delta.usage.completion_tokens);
  usage->set_cached_prompt_tokens(delta.usage.cached_prompt_tokens);
  v1::Timing* timing = out->mutable_timing();
  timing->set_time_to_first_token_seconds(
      delta.timing.time_to_first_token_seconds);
  timing->set_total_seconds(delta.timing.total_seconds);
  timing->set_queue_seconds(delta.timing.queue_seconds);
  timing->set_prefill_seconds(delta.timing.prefill_seconds);
}

absl::Time DeadlineOf(const grpc::CallbackServerContext& context) {
  auto deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) {
    return absl::InfiniteFuture();
  }
  return absl::FromChrono(deadline);
}

// The backend request for a public one, tagged with the API it came through;
// a refusal is reported to `on_rejected` (metrics count every request).
absl::StatusOr<GenerationRequest> PrepareRequest(
    const v1::GenerateRequest& request, const GenerationBackend& backend,
    const grpc::CallbackServerContext& context, const char* api,
    const RejectionHook& on_rejected) {
  absl::StatusOr<GenerationRequest> generation =
      ToGenerationRequest(request, backend, DeadlineOf(context));
  if (!generation.ok()) {
    if (on_rejected) on_rejected(api, generation.status().code());
    return generation.status();
  }
  generation->api = api;
  return generation;
}

// What a reactor keeps of its request (set before the backend starts it, so
// before any backend callback).
struct StartedRequest {
  std::string request_id;
  int32_t top_logprobs = 0;
  bool logprobs = false;
  static StartedRequest Of(const GenerationRequest& r) {
    return {r.request_id, r.top_logprobs, r.logprobs};
  }
};

// A reactor's backend call, and the race between starting it and the client
// cancelling: gRPC may call OnCancel before Start() returned, so whichever
// of Set and Cancel comes second cancels the call.
class CallSlot {
 public:
  void Set(std::shared_ptr<GenerationCall> call) {
    bool cancel = false;
    {
      absl::MutexLock lock(&mu_);
      call_ = call;
      cancel = cancelled_;
    }
    if (cancel) call->Cancel();
  }
  // Cancels the call now, or as soon as it is set. Never blocks.
  void Cancel() {
    std::shared_ptr<GenerationCall> call;
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      call = call_;
    }
    if (call != nullptr) call->Cancel();
  }

 private:
  absl::Mutex mu_;
  std::shared_ptr<GenerationCall> call_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

// Starts `request` with `observer` and puts the call in `slot`: what both
// reactors do once the request is prepared. On error no backend callback
// will come.
absl::Status StartInto(GenerationBackend* backend, GenerationRequest request,
                       GenerationObserver* observer, CallSlot* slot) {
  absl::StatusOr<std::unique_ptr<GenerationCall>> call =
      backend->Start(std::move(request), observer);
  if (!call.ok()) return call.status();
  slot->Set(std::move(call).value());
  return absl::OkStatus();
}

// Reference count shared by gRPC (released in OnDone) and the backend
// (released in its OnDone): whoever is last deletes the reactor.
class TwoOwners {
 public:
  // True when the caller was the last owner.
  bool Release() { return refs_.fetch_sub(1) == 1; }

 private:
  std::atomic<int> refs_{2};
};

// Bytes off the wire as a `T`; INVALID_ARGUMENT saying so when they are not.
// The first field in `message` (or a message inside it) that this server's
// schema does not know: "" when there is none. Protobuf keeps such fields
// aside silently; a client built from a newer .proto would otherwise get an
// answer that ignored what it asked for.
std::string FirstUnknownField(const google::protobuf::Message& message) {
  const google::protobuf::Reflection* reflection = message.GetReflection();
  const google::protobuf::UnknownFieldSet& unknown =
      reflection->GetUnknownFields(message);
  if (!unknown.empty()) {
    return absl::StrCat("field number ", unknown.field(0).number(), " of ",
                        message.GetDescriptor()->full_name());
  }
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  reflection->ListFields(message, &fields);
  for (const google::protobuf::FieldDescriptor* field : fields) {
    if (field->cpp_type() !=
        google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE) {
      continue;
    }
    if (field->is_repeated()) {
      for (int i = 0; i < reflection->FieldSize(message, field); ++i) {
        std::string found = FirstUnknownField(
            reflection->GetRepeatedMessage(message, field, i));
        if (!found.empty()) return found;
      }
    } else {
      std::string found =
          FirstUnknownField(reflection->GetMessage(message, field));
      if (!found.empty()) return found;
    }
  }
  return "";
}

template <typename T>
absl::StatusOr<T> ParseWire(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  if (grpc::Status s = buffer.Dump(&slices); !s.ok()) {
    return absl::InvalidArgumentError("the request could not be read");
  }
  std::string bytes;
  for (const grpc::Slice& slice : slices) {
    bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  T message;
  if (!message.ParseFromString(bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the request (", bytes.size(), " bytes) is not a valid ",
                     T::descriptor()->full_name()));
  }
  if (std::string unknown = FirstUnknownField(message); !unknown.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the request sets ", unknown,
        ", which this server does not know (refused rather than ignored)"));
  }
  return message;
}

// The caller's key checked first (a stranger learns nothing about the
// request format), then the request parsed.
absl::StatusOr<v1::GenerateRequest> AuthorizedRequest(
    const grpc::CallbackServerContext& context, const grpc::ByteBuffer& request,
    const rpc::BearerTokens* api_keys) {
  if (api_keys != nullptr) {
    if (absl::Status s = rpc::Authenticate(context, *api_keys); !s.ok()) {
      return s;
    }
  }
  return ParseWire<v1::GenerateRequest>(request);
}

grpc::ByteBuffer ToWire(const google::protobuf::Message& message) {
  const std::string bytes = message.SerializeAsString();
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

// A stream refused before it started (its request did not parse).
class RefusedStream final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  explicit RefusedStream(const absl::Status& status) {
    Finish(rpc::ToGrpcStatus(status));
  }
  void OnDone() override { delete this; }
};

// What both reactors share: the request prepared and started against the
// backend (the start/cancel race lives in CallSlot), two owners (gRPC and the
// backend) of which the last deletes the reactor, and Finish at most once.
template <typename GrpcReactor>
class GenerationReactor : public GrpcReactor, public GenerationObserver {
 public:
  // gRPC is done with the call.
  void OnDone() override { ReleaseOwner(); }

 protected:
  // From the derived constructor: prepares the request, lets the reactor
  // see it (OnPrepared, before any backend callback can come), starts it.
  void Begin(GenerationBackend* backend,
             const grpc::CallbackServerContext& context,
             const v1::GenerateRequest& request, const char* api,
             const RejectionHook& on_rejected,
             const rpc::BearerTokens* api_keys) {
    if (api_keys != nullptr) {
      if (absl::Status s = rpc::Authenticate(context, *api_keys); !s.ok()) {
        if (on_rejected) on_rejected(api, s.code());
        FailBeforeStart(s);
        return;
      }
    }
    absl::StatusOr<GenerationRequest> generation =
        PrepareRequest(request, *backend, context, api, on_rejected);
    if (!generation.ok()) {
      FailBeforeStart(generation.status());
      return;
    }
    request_ = StartedRequest::Of(*generation);
    OnPrepared();
    if (absl::Status s =
            StartInto(backend, *std::move(generation), this, &call_);
        !s.ok()) {
      FailBeforeStart(s);
    }
  }
  virtual void OnPrepared() {}

  // Before the backend took the request: no backend callback will come.
  void FailBeforeStart(const absl::Status& status) {
    {
      absl::MutexLock lock(&mu_);
      backend_done_ = true;
      FinishOnce(rpc::ToGrpcStatus(status));
    }
    // gRPC still owns us until OnDone, so this is never the last release.
    owners_.Release();
  }

  void FinishOnce(const grpc::Status& status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    BeforeFinish(status);
    this->Finish(status);
  }
  // Last words before Finish (under mu_): the unary answer's bytes.
  virtual void BeforeFinish(const grpc::Status&) {}

  // gRPC's OnDone and the backend's OnDone each release one owner.
  void ReleaseOwner() {
    if (owners_.Release()) delete this;
  }

  CallSlot call_;
  StartedRequest request_;  // set before any callback can come
  absl::Mutex mu_;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;  // Finish() was called
  bool backend_done_ ABSL_GUARDED_BY(mu_) = false;

 private:
  TwoOwners owners_;
};

// ---------------------------------------------------------------------------
// Generate (server streaming)
// ---------------------------------------------------------------------------

class GenerateReactor final
    : public GenerationReactor<grpc::ServerWriteReactor<grpc::ByteBuffer>> {
 public:
  GenerateReactor(GenerationBackend* backend,
                  grpc::CallbackServerContext* context,
                  const v1::GenerateRequest& request,
                  const RejectionHook& on_rejected,
                  const rpc::BearerTokens* api_keys) {
    Begin(backend, *context, request, "grpc_generate", on_rejected, api_keys);
  }

  // --- backend side (any thread) ---
  void OnDelta(GenerationDelta delta) override {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    v1::GenerateResponse item;
    item.set_request_id(request_.request_id);
    AppendDelta(delta, request_.top_logprobs, request_.logprobs, &item);
    queue_.push_back(ToWire(item));
    if (!write_in_flight_) {
      write_in_flight_ = true;
      StartWrite(&queue_.front());
    }
  }

  void OnDone(absl::Status status) override {
    {
      absl::MutexLock lock(&mu_);
      backend_done_ = true;
      backend_status_ = std::move(status);
      if (!write_in_flight_) FinishOnce(rpc::ToGrpcStatus(backend_status_));
    }
    ReleaseOwner();
  }

  // --- gRPC side ---
  void OnWriteDone(bool ok) override {
    bool cancel = false;
    {
      absl::MutexLock lock(&mu_);
      write_in_flight_ = false;
      queue_.pop_front();
      if (!ok) {
        // The stream is broken (client gone): stop the generation.
        FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED, "stream broken"));
        cancel = true;
      } else if (finished_) {
        // OnCancel finished the call meanwhile; drop the rest.
      } else if (!queue_.empty()) {
        write_in_flight_ = true;
        StartWrite(&queue_.front());
      } else if (backend_done_) {
        FinishOnce(rpc::ToGrpcStatus(backend_status_));
      }
    }
    if (cancel) call_.Cancel();
  }

  void OnCancel() override {
    bool cancel = false;
    {
      absl::MutexLock lock(&mu_);
      FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
      cancel = !backend_done_;
    }
    if (cancel) call_.Cancel();
  }

  using GenerationReactor::OnDone;  // gRPC's, beside the backend's above

 private:
  // Items not yet written; the front one is being written when
  // write_in_flight_ (deque: push_back keeps the front's address stable).
  std::deque<grpc::ByteBuffer> queue_ ABSL_GUARDED_BY(mu_);
  bool write_in_flight_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status backend_status_ ABSL_GUARDED_BY(mu_);
};

// ---------------------------------------------------------------------------
// GenerateUnary
// ---------------------------------------------------------------------------

class GenerateUnaryReactor final
    : public GenerationReactor<grpc::ServerUnaryReactor> {
 public:
  GenerateUnaryReactor(GenerationBackend* backend,
                       grpc::CallbackServerContext* context,
                       const v1::GenerateRequest& request,
                       grpc::ByteBuffer* wire_response,
                       const RejectionHook& on_rejected,
                       const rpc::BearerTokens* api_keys)
      : wire_response_(wire_response) {
    Begin(backend, *context, request, "grpc_generate_unary", on_rejected,
          api_keys);
  }

  void OnDelta(GenerationDelta delta) override {
    absl::MutexLock lock(&mu_);
    if (!finished_) {
      AppendDelta(delta, request_.top_logprobs, request_.logprobs, &response_);
    }
  }

  void OnDone(absl::Status status) override {
    {
      absl::MutexLock lock(&mu_);
      FinishOnce(rpc::ToGrpcStatus(status));
    }
    ReleaseOwner();
  }

  void OnCancel() override {
    {
      absl::MutexLock lock(&mu_);
      FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
    }
    call_.Cancel();
  }

  using GenerationReactor::OnDone;  // gRPC's, beside the backend's above

 private:
  // The id leads the answer (the backend has not started yet).
  void OnPrepared() override {
    absl::MutexLock lock(&mu_);
    response_.set_request_id(request_.request_id);
  }
  void BeforeFinish(const grpc::Status& status) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (status.ok()) *wire_response_ = ToWire(response_);
  }

  v1::GenerateResponse response_ ABSL_GUARDED_BY(mu_);
  // Owned by gRPC; written only before Finish().
  grpc::ByteBuffer* const wire_response_ ABSL_PT_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<GenerationRequest> ToGenerationRequest(
    const v1::GenerateRequest& request, const GenerationBackend& backend,
    absl::Time deadline) {
  GenerationRequest out;
  if (request.request_id().size() > kMaxRequestIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request_id has ", request.request_id().size(), " bytes; at most ",
        kMaxRequestIdBytes, " (it is echoed on every response item)"));
  }
  out.request_id =
      request.request_id().empty() ? NewRequestId() : request.request_id();
  absl::StatusOr<ModelDescription> model =
      ResolveModel(backend, request.model());
  if (!model.ok()) return model.status();
  out.model = model->name;
  switch (request.prompt_case()) {
    case v1::GenerateRequest::kText:
      out.prompt_text = request.text();
      break;
    case v1::GenerateRequest::kTokenIds:
      out.prompt_ids.emplace(request.token_ids().ids().begin(),
                             request.token_ids().ids().end());
      break;
    case v1::GenerateRequest::PROMPT_NOT_SET:
      return absl::InvalidArgumentError(
          "a prompt (text or token_ids) is required");
  }
  out.echo = request.echo();
  // Unset: the contract's default (validation below refuses 0 without echo,
  // and negatives).
  out.max_tokens =
      request.has_max_tokens() ? request.max_tokens() : rpc::kDefaultMaxTokens;
  out.sampling = rpc::SamplingFromWire(request.sampling(), NewRandomSeed());
  out.stop.assign(request.stop().begin(), request.stop().end());
  out.ignore_eos = request.ignore_eos();
  out.logprobs = request.include_logprobs();
  out.top_logprobs = request.top_logprobs();
  out.deadline = deadline;
  if (absl::Status s = ValidateGenerationRequest(out); !s.ok()) return s;
  return out;
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* GenerationService::Generate(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) {
  absl::StatusOr<v1::GenerateRequest> parsed =
      AuthorizedRequest(*context, *request, api_keys_);
  if (!parsed.ok()) {
    if (on_rejected_) on_rejected_("grpc_generate", parsed.status().code());
    return new RefusedStream(parsed.status());
  }
  return new GenerateReactor(backend_, context, *parsed, on_rejected_,
                             api_keys_);
}

grpc::ServerUnaryReactor* GenerationService::GenerateUnary(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  absl::StatusOr<v1::GenerateRequest> parsed =
      AuthorizedRequest(*context, *request, api_keys_);
  if (!parsed.ok()) {
    if (on_rejected_) {
      on_rejected_("grpc_generate_unary", parsed.status().code());
    }
    return rpc::Refused(context, parsed.status());
  }
  return new GenerateUnaryReactor(backend_, context, *parsed, response,
                                  on_rejected_, api_keys_);
}

grpc::ServerUnaryReactor* GenerationService::ListModels(
    grpc::CallbackServerContext* context, const v1::ListModelsRequest*,
    v1::ListModelsResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (api_keys_ != nullptr) {
    if (absl::Status s = rpc::Authenticate(*context, *api_keys_); !s.ok()) {
      reactor->Finish(rpc::ToGrpcStatus(s));
      return reactor;
    }
  }
  for (const ModelDescription& model : backend_->ListModels()) {
    v1::ModelInfo* info = response->add_models();
    info->set_name(model.name);
    info->set_context_length(model.context_length);
    info->set_vocab_size(model.vocab_size);
  }
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace pdserve::router
