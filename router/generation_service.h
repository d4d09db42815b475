// The public gRPC Generation service (proto/pdserve/v1/generate.proto) over a
// GenerationBackend, with the callback API: no thread ever blocks in it.
//
// Generate is a ServerWriteReactor: backend deltas are queued, one write is in
// flight at a time, the next starts from OnWriteDone; Finish is called exactly
// once (backend done, write failure or OnCancel, whichever is first, under the
// reactor's mutex); the reactor deletes itself when both gRPC (OnDone) and the
// backend (its OnDone) are finished with it. Client cancellation and deadline
// expiry reach the backend through GenerationCall::Cancel().
//
// Generate and GenerateUnary take their requests as raw bytes and parse them
// here: gRPC's own parsing answers bytes that are no GenerateRequest with
// UNIMPLEMENTED and no message; this service says INVALID_ARGUMENT and why.
#pragma once

#include "absl/status/statusor.h"
#include "pdserve/v1/generate.grpc.pb.h"
#include "router/generation_backend.h"
#include "rpc/auth.h"

namespace pdserve::router {

class GenerationService final
    : public v1::Generation::WithRawCallbackMethod_Generate<
          v1::Generation::WithRawCallbackMethod_GenerateUnary<
              v1::Generation::WithCallbackMethod_ListModels<
                  v1::Generation::Service>>> {
 public:
  // `backend` is not owned and must outlive the service, as must
  // `api_keys` (null or empty: no key needed): every call then carries
  // "authorization: Bearer <key>" or gets UNAUTHENTICATED.
  explicit GenerationService(GenerationBackend* backend,
                             RejectionHook on_rejected = nullptr,
                             const rpc::BearerTokens* api_keys = nullptr)
      : backend_(backend),
        on_rejected_(std::move(on_rejected)),
        api_keys_(api_keys) {}

  // Raw: a serialized v1::GenerateRequest in, v1::GenerateResponse(s) out.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Generate(
      grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request) override;
  grpc::ServerUnaryReactor* GenerateUnary(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ListModels(
      grpc::CallbackServerContext* context,
      const v1::ListModelsRequest* request,
      v1::ListModelsResponse* response) override;

 private:
  GenerationBackend* const backend_;
  const RejectionHook on_rejected_;
  const rpc::BearerTokens* const api_keys_;
};

// The backend request for a public request: fills defaults (max_tokens 0 =
// 16, top_p 0 = 1, a request id, the only model), resolves the model
// (NOT_FOUND) and validates (INVALID_ARGUMENT). `deadline` from the call.
[[nodiscard]] absl::StatusOr<GenerationRequest> ToGenerationRequest(
    const v1::GenerateRequest& request, const GenerationBackend& backend,
    absl::Time deadline);

}  // namespace pdserve::router
