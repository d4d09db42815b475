#include "router/cluster_backend.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "router/cluster_request.h"
#include "rpc/auth.h"
#include "rpc/status_conversion.h"

namespace pdserve::router {

namespace {

// The most bytes of text one token stands for: a vocabulary piece, or a
// character <unk> covers (UTF-8: up to 4).
int MaxTokenBytes(const tokenizer::Tokenizer* tokenizer) {
  size_t most = 4;
  if (tokenizer == nullptr) return static_cast<int>(most);
  for (int32_t id = 0; id < tokenizer->vocab_size(); ++id) {
    absl::StatusOr<std::string> bytes = tokenizer->TokenBytes(id);
    if (bytes.ok()) most = std::max(most, bytes->size());
  }
  return static_cast<int>(most);
}

class ClusterCall final : public GenerationCall {
 public:
  explicit ClusterCall(std::shared_ptr<RequestCancellation> cancellation)
      : cancellation_(std::move(cancellation)) {}
  void Cancel() override { cancellation_->Cancel(); }

 private:
  std::shared_ptr<RequestCancellation> cancellation_;
};

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
      structured_output_(tokenizer,
                         {tokenizer != nullptr && tokenizer->eos_id() >= 0
                              ? tokenizer->eos_id()
                              : 0}),
      registry_(registry),
      prefill_policy_(std::move(prefill_policy)),
      decode_policy_(std::move(decode_policy)),
      book_(std::make_shared<RequestBook>()),
      queue_(options_.queue,
             [metrics = options_.metrics](int depth) {
               if (metrics != nullptr) metrics->SetAdmissionQueueDepth(depth);
             }),
      max_token_bytes_(MaxTokenBytes(tokenizer)) {}

ClusterBackend::~ClusterBackend() {
  absl::MutexLock lock(&book_->mu);
  for (auto& weak : book_->calls) {
    if (auto call = weak.lock()) call->Cancel();
  }
  // Each thread's cancellation path makes only bounded RPCs (rpc_timeout).
  book_->mu.Await(absl::Condition(
      +[](ClusterBackendStats* s) { return s->active == 0; }, &book_->stats));
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
  absl::MutexLock lock(&book_->mu);
  return book_->stats;
}

absl::Status ClusterBackend::SendAbort(const std::string& address,
                                       uint64_t id) {
  auto stub = v1::DecodeWorker::NewStub(ChannelFor(address));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(
      absl::Now() + std::min(options_.rpc_timeout, absl::Seconds(2))));
  v1::AbortRequest abort;
  abort.set_request_id(id);
  v1::AbortResponse ignored;
  return rpc::FromGrpcStatus(stub->Abort(&context, abort, &ignored));
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
    channel = rpc::CreateChannel(address, options_.internal_token, args);
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
  if (absl::Status s =
          request.sampling.ValidateForVocab(options_.model.vocab_size);
      !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("sampling: ", s.message()));
  }
  if (request.sampling.structured_output.enabled()) {
    absl::StatusOr<std::unique_ptr<engine::TokenConstraint>> checked =
        structured_output_.NewConstraint(request.sampling.structured_output);
    if (!checked.ok()) {
      // A schema we cannot compile, or no tokenizer: the request's fault or
      // a deployment without one, never worth a retry.
      return absl::InvalidArgumentError(checked.status().message());
    }
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
    // Refused before tokenizing when even the longest tokens could not fit
    // it into the context (tokenizing a 100k-token prompt costs ~1 s of
    // CPU).
    const int64_t max_bytes =
        int64_t{options_.model.context_length} * max_token_bytes_;
    if (static_cast<int64_t>(request.prompt_text->size()) > max_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt of ", request.prompt_text->size(),
                       " bytes cannot fit the model's context of ",
                       options_.model.context_length, " tokens (at most ",
                       max_token_bytes_, " bytes per token)"));
    }
    PDS_ASSIGN_OR_RETURN(ids, tokenizer_->Encode(*request.prompt_text,
                                                 request.add_special_tokens));
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
  auto cancellation = std::make_shared<RequestCancellation>();
  {
    absl::MutexLock lock(&book_->mu);
    // Forget finished calls while here, so the list stays as long as the
    // number of live calls.
    book_->calls.remove_if([](const std::weak_ptr<RequestCancellation>& w) {
      return w.expired();
    });
    book_->calls.push_back(cancellation);
    ++book_->stats.started;
    ++book_->stats.active;
  }
  std::thread([this, cancellation, request = std::move(request),
               ids = std::move(ids), observer]() mutable {
    std::shared_ptr<RequestBook> book = book_;
    {
      const ClusterServices services{
          options_,
          tokenizer_,
          *registry_,
          *prefill_policy_,
          *decode_policy_,
          [this](const std::string& address) { return ChannelFor(address); },
          *book,
          queue_,
          &abort_retrier_};
      ClusterRequest(services, cancellation, std::move(request), std::move(ids),
                     observer)
          .Run();
    }
    // Nothing of `this` is touched from here on: the destructor may run.
    absl::MutexLock lock(&book->mu);
    --book->stats.active;
  }).detach();
  return std::make_unique<ClusterCall>(std::move(cancellation));
}

}  // namespace pdserve::router
