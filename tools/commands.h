// The subcommands of the `pdserve` command line (each parses argv from
// index 2 with CommandLineFlags).
#pragma once

#include "absl/status/status.h"

namespace pdserve::tools {

// pdserve local: a whole cluster on this machine until SIGINT/SIGTERM.
[[nodiscard]] absl::Status RunLocalCluster(int argc, char** argv);

// pdserve client: one request to a router's gRPC API, streamed to stdout.
[[nodiscard]] absl::Status RunClient(int argc, char** argv);

// pdserve plan: rank candidate layouts for a workload and an SLO.
[[nodiscard]] absl::Status RunPlan(int argc, char** argv);

}  // namespace pdserve::tools
