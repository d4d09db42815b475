// Starting a gRPC server the way every pdserve process does: the services it
// registers, plus the standard health protocol (grpc.health.v1) and server
// reflection so stock tools (grpcurl, grpc_health_probe) work. Binding to port
// 0 picks a free port, which `port()` reports (tests always do this).
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace pdserve::rpc {

class RunningServer {
 public:
  // `address` like "127.0.0.1:0" or "0.0.0.0:50051". Services are not owned
  // and must outlive the server. UNAVAILABLE if the address cannot be bound.
  // `credentials`: null = plaintext; TLS from rpc::ServerCredentialsFor.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<RunningServer>> Start(
      const std::string& address, const std::vector<grpc::Service*>& services,
      std::shared_ptr<grpc::ServerCredentials> credentials = nullptr);

  ~RunningServer();  // Shutdown() with a short deadline, then waits.
  RunningServer(const RunningServer&) = delete;
  RunningServer& operator=(const RunningServer&) = delete;

  int port() const { return port_; }
  // "host:port" with the real port.
  const std::string& address() const { return address_; }
  // Sets the overall serving status reported by grpc.health.v1 ("" service)
  // and by each named service.
  void SetServing(bool serving);
  // Makes grpc.health.v1 answer for these service names too (e.g.
  // "pdserve.v1.Generation", what Kubernetes' grpc probe and grpc-health-probe
  // send with -service), following SetServing. Unnamed services answer
  // NOT_FOUND, as the protocol says.
  void ReportHealthFor(const std::vector<std::string>& service_names);
  // Cancels in-flight calls after `grace_seconds` and stops. Idempotent.
  void Shutdown(double grace_seconds = 1.0);
  void Wait();

 private:
  RunningServer() = default;
  std::unique_ptr<grpc::Server> server_;
  std::vector<std::string> service_names_;
  std::string address_;
  int port_ = 0;
  bool shut_down_ = false;
  bool serving_ = false;
};

}  // namespace pdserve::rpc
