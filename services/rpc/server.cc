#include "rpc/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include <chrono>

#include "absl/strings/str_cat.h"

namespace pdserve::rpc {

absl::StatusOr<std::unique_ptr<RunningServer>> RunningServer::Start(
    const std::string& address, const std::vector<grpc::Service*>& services,
    std::shared_ptr<grpc::ServerCredentials> credentials) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int selected_port = 0;
  builder.AddListeningPort(
      address,
      credentials != nullptr ? credentials : grpc::InsecureServerCredentials(),
      &selected_port);
  // Streams of tokens are small messages; keepalive lets a dead router or
  // client be noticed without waiting for TCP timeouts.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // pdserve's clients ping every second to notice a frozen server
  // (rpc/auth.h kKeepaliveTime); by default a server answers pings more
  // often than every 5 minutes with GOAWAY "too_many_pings".
  builder.AddChannelArgument(
      GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 500);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  std::unique_ptr<RunningServer> running(new RunningServer());
  for (grpc::Service* service : services) builder.RegisterService(service);
  running->server_ = builder.BuildAndStart();
  if (running->server_ == nullptr || selected_port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot start gRPC server on ", address));
  }
  running->port_ = selected_port;
  std::string host = address.substr(0, address.rfind(':'));
  running->address_ = absl::StrCat(host, ":", selected_port);
  running->SetServing(true);
  return running;
}

RunningServer::~RunningServer() {
  Shutdown(0.5);
  Wait();
}

void RunningServer::SetServing(bool serving) {
  if (server_ == nullptr) return;
  serving_ = serving;
  if (auto* health = server_->GetHealthCheckService(); health != nullptr) {
    health->SetServingStatus(serving);  // "" and every name set below
  }
}

void RunningServer::ReportHealthFor(
    const std::vector<std::string>& service_names) {
  if (server_ == nullptr) return;
  auto* health = server_->GetHealthCheckService();
  for (const std::string& name : service_names) {
    service_names_.push_back(name);
    if (health != nullptr) health->SetServingStatus(name, serving_);
  }
}

void RunningServer::Shutdown(double grace_seconds) {
  if (server_ == nullptr || shut_down_) return;
  shut_down_ = true;
  SetServing(false);
  server_->Shutdown(
      std::chrono::system_clock::now() +
      std::chrono::milliseconds(static_cast<int64_t>(grace_seconds * 1000)));
}

void RunningServer::Wait() {
  if (server_ != nullptr) server_->Wait();
}

}  // namespace pdserve::rpc
