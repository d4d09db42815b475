// absl::Status <-> grpc::Status. The codes are the same numbering (both follow
// google.rpc.Code), so the conversion keeps what the caller should do:
// UNAVAILABLE = retry elsewhere, INVALID_ARGUMENT = fix the request, ...
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace pdserve::rpc {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace pdserve::rpc
