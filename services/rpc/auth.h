// Who may call a pdserve server: bearer tokens. The router's public API takes
// API keys (HTTP `Authorization: Bearer <key>`, gRPC metadata
// `authorization: Bearer <key>`); the workers' internal APIs (DecodeWorker,
// PrefillGroup, PrefillStageControl) take the cluster's shared internal token
// the same way, so an unauthenticated peer cannot Admit, Abort, wire a stage
// or take KV blocks. Health and reflection stay open (probes need them).
//
// Tokens live in files (one per line; blank lines and `#` comments skipped),
// never on a command line (visible to every local user in ps).
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace pdserve::rpc {

// The metadata key (gRPC) and header (HTTP, case-insensitive) tokens ride in.
inline constexpr char kAuthorizationKey[] = "authorization";

// The tokens a server accepts; empty = anyone may call.
class BearerTokens {
 public:
  BearerTokens() = default;
  // NOT_FOUND for a missing file, INVALID_ARGUMENT for one with no token or
  // a token shorter than 16 bytes (too easy to guess).
  static absl::StatusOr<BearerTokens> FromFile(const std::string& path);
  static absl::StatusOr<BearerTokens> Of(std::vector<std::string> tokens);

  bool enabled() const { return !tokens_.empty(); }
  // Whether `authorization` ("Bearer <token>", scheme case-insensitive)
  // names one of the tokens. Compares every byte of every token (no early
  // exit), so timing does not tell how much of a guess was right.
  bool Accepts(std::string_view authorization) const;
  // The first token: what a client of this cluster sends.
  const std::string& first() const;

 private:
  std::vector<std::string> tokens_;
};

// OK when `tokens` is empty or the call's metadata carries one of them;
// otherwise UNAUTHENTICATED naming what was wrong (missing or refused).
absl::Status Authenticate(const grpc::ServerContextBase& context,
                          const BearerTokens& tokens);

// A unary reactor that has already answered `status`: for refusing a call
// before any work.
grpc::ServerUnaryReactor* Refused(grpc::CallbackServerContext* context,
                                  const absl::Status& status);

// How often a channel pings an otherwise quiet connection, and how long it
// waits for the answer before it declares the peer gone.
inline constexpr absl::Duration kKeepaliveTime = absl::Seconds(1);
inline constexpr absl::Duration kKeepaliveTimeout = absl::Seconds(1);

// A channel to `address` whose every call carries "authorization: Bearer
// <token>" (nothing when `token` is empty), with keepalive pings
// (kKeepaliveTime/kKeepaliveTimeout): a frozen peer's calls fail UNAVAILABLE
// within 2 s (4 s when gRPC needs a second round). Insecure transport: use with
// loopback or a private network, or with TLS in front.
// `credentials`: null = plaintext (rpc::ClientTlsCredentials for a TLS
// server).
std::shared_ptr<grpc::Channel> CreateChannel(
    const std::string& address, const std::string& token,
    const grpc::ChannelArguments& args = grpc::ChannelArguments(),
    std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr);

}  // namespace pdserve::rpc
