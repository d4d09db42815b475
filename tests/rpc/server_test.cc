#include "rpc/server.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "grpc/health/v1/health.grpc.pb.h"
#include "rpc/status_conversion.h"

namespace pdserve::rpc {
namespace {

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

TEST(RunningServerTest, ServesHealthOnAnEphemeralPortAndFollowsSetServing) {
  auto server = RunningServer::Start("127.0.0.1:0", {});
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_GT((*server)->port(), 0);
  auto channel = grpc::CreateChannel((*server)->address(),
                                     grpc::InsecureChannelCredentials());
  auto stub = Health::NewStub(channel);
  auto check = [&] {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(10));
    HealthCheckRequest request;
    HealthCheckResponse response;
    grpc::Status status = stub->Check(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.status();
  };
  EXPECT_EQ(check(), HealthCheckResponse::SERVING);
  (*server)->SetServing(false);
  EXPECT_EQ(check(), HealthCheckResponse::NOT_SERVING);
  (*server)->SetServing(true);
  EXPECT_EQ(check(), HealthCheckResponse::SERVING);
}

// Kubernetes' grpc probe and grpc-health-probe ask for a service by name.
TEST(RunningServerTest, HealthAnswersForNamedServices) {
  auto server = RunningServer::Start("127.0.0.1:0", {});
  ASSERT_TRUE(server.ok()) << server.status();
  (*server)->ReportHealthFor({"pdserve.v1.Generation"});
  auto stub = Health::NewStub(grpc::CreateChannel(
      (*server)->address(), grpc::InsecureChannelCredentials()));
  auto check = [&](const std::string& service) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(10));
    HealthCheckRequest request;
    request.set_service(service);
    HealthCheckResponse response;
    grpc::Status status = stub->Check(&context, request, &response);
    return status.ok() ? static_cast<int>(response.status())
                       : -static_cast<int>(status.error_code());
  };
  EXPECT_EQ(check("pdserve.v1.Generation"), HealthCheckResponse::SERVING);
  EXPECT_EQ(check("pdserve.v1.Nothing"), -grpc::StatusCode::NOT_FOUND);
  (*server)->SetServing(false);
  EXPECT_EQ(check("pdserve.v1.Generation"), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(check(""), HealthCheckResponse::NOT_SERVING);
  (*server)->SetServing(true);
  EXPECT_EQ(check("pdserve.v1.Generation"), HealthCheckResponse::SERVING);
}

TEST(RunningServerTest, UnbindableAddressIsUnavailable) {
  auto server = RunningServer::Start("256.1.1.1:1", {});
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kUnavailable);
}

TEST(StatusConversionTest, CodesAndMessagesRoundTrip) {
  for (auto status :
       {absl::OkStatus(), absl::InvalidArgumentError("bad prompt"),
        absl::UnavailableError("no decode worker"),
        absl::ResourceExhaustedError("queue full")}) {
    EXPECT_EQ(FromGrpcStatus(ToGrpcStatus(status)), status);
  }
  EXPECT_EQ(ToGrpcStatus(absl::NotFoundError("x")).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

}  // namespace
}  // namespace pdserve::rpc
