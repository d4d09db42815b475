#include "rpc/auth.h"

#include <grpcpp/support/client_interceptor.h>

#include <algorithm>
#include <fstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "rpc/status_conversion.h"

namespace pdserve::rpc {
namespace {

constexpr size_t kMinTokenBytes = 16;

// Equal without an early exit on the first differing byte.
bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? a[i] : 0;
    const unsigned char y = i < b.size() ? b[i] : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

class TokenInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit TokenInterceptor(const std::string* header) : header_(header) {}
  void Intercept(
      grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::
                PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->insert({kAuthorizationKey, *header_});
    }
    methods->Proceed();
  }

 private:
  const std::string* const header_;
};

class TokenInterceptorFactory final
    : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit TokenInterceptorFactory(std::string token)
      : header_(absl::StrCat("Bearer ", token)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new TokenInterceptor(&header_);
  }

 private:
  // Lives as long as the channel (gRPC owns the factory).
  const std::string header_;
};

}  // namespace

absl::StatusOr<BearerTokens> BearerTokens::Of(std::vector<std::string> tokens) {
  if (tokens.empty()) {
    return absl::InvalidArgumentError("no token given");
  }
  for (const std::string& t : tokens) {
    if (t.size() < kMinTokenBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("a token of ", t.size(),
                       " bytes is too short (at least ", kMinTokenBytes, ")"));
    }
    for (char c : t) {
      if (absl::ascii_isspace(static_cast<unsigned char>(c)) ||
          !absl::ascii_isprint(static_cast<unsigned char>(c))) {
        return absl::InvalidArgumentError(
            "a token holds a space or an unprintable byte");
      }
    }
  }
  BearerTokens out;
  out.tokens_ = std::move(tokens);
  return out;
}

absl::StatusOr<BearerTokens> BearerTokens::FromFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::vector<std::string> tokens;
  std::string line;
  while (std::getline(in, line)) {
    const absl::string_view t = absl::StripAsciiWhitespace(line);
    if (t.empty() || t.front() == '#') continue;
    tokens.emplace_back(t.data(), t.size());
  }
  absl::StatusOr<BearerTokens> out = Of(std::move(tokens));
  if (!out.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", out.status().message()));
  }
  return out;
}

bool BearerTokens::Accepts(std::string_view authorization) const {
  absl::string_view value = absl::StripAsciiWhitespace(
      absl::string_view(authorization.data(), authorization.size()));
  if (value.size() < 7 ||
      !absl::EqualsIgnoreCase(value.substr(0, 7), "bearer ")) {
    return false;
  }
  value = absl::StripLeadingAsciiWhitespace(value.substr(7));
  const std::string_view token(value.data(), value.size());
  bool accepted = false;
  for (const std::string& t : tokens_) accepted |= ConstantTimeEquals(token, t);
  return accepted;
}

const std::string& BearerTokens::first() const {
  static const std::string kNone;
  return tokens_.empty() ? kNone : tokens_.front();
}

absl::Status Authenticate(const grpc::ServerContextBase& context,
                          const BearerTokens& tokens) {
  if (!tokens.enabled()) return absl::OkStatus();
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(kAuthorizationKey);
  if (it == metadata.end()) {
    return absl::UnauthenticatedError(
        "missing credentials: send metadata \"authorization: Bearer <token>\"");
  }
  if (!tokens.Accepts(std::string_view(it->second.data(), it->second.size()))) {
    return absl::UnauthenticatedError("the bearer token is not accepted");
  }
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* Refused(grpc::CallbackServerContext* context,
                                  const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

std::shared_ptr<grpc::Channel> CreateChannel(
    const std::string& address, const std::string& token,
    const grpc::ChannelArguments& caller_args,
    std::shared_ptr<grpc::ChannelCredentials> credentials) {
  if (credentials == nullptr) credentials = grpc::InsecureChannelCredentials();
  // A frozen peer (SIGSTOP, a wedged host) keeps its TCP connection open
  // and answers nothing: HTTP/2 pings that go unanswered for
  // kKeepaliveTimeout close the connection, so its calls fail UNAVAILABLE
  // within kKeepaliveTime + kKeepaliveTimeout instead of hanging until a
  // deadline (servers allow pings this often: rpc/server.cc).
  grpc::ChannelArguments args = caller_args;
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS,
              static_cast<int>(absl::ToInt64Milliseconds(kKeepaliveTime)));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
              static_cast<int>(absl::ToInt64Milliseconds(kKeepaliveTimeout)));
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // A server-streaming call sends no data after its request, so without
  // this the client's pings are spaced by the default of minutes.
  args.SetInt(GRPC_ARG_HTTP2_MIN_SENT_PING_INTERVAL_WITHOUT_DATA_MS,
              static_cast<int>(absl::ToInt64Milliseconds(kKeepaliveTime)));
  // BDP probing's own pings delay keepalive's when a peer freezes mid-stream
  // (measured: errors after 6 s instead of 3 s in about a third of runs).
  // pdserve's RPCs carry token ids and small messages (KV goes by UCX), so
  // the default flow-control window is plenty.
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  if (token.empty()) {
    return grpc::CreateCustomChannel(address, credentials, args);
  }
  std::vector<
      std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>>
      interceptors;
  interceptors.push_back(std::make_unique<TokenInterceptorFactory>(token));
  return grpc::experimental::CreateCustomChannelWithInterceptors(
      address, credentials, args, std::move(interceptors));
}

}  // namespace pdserve::rpc
