// Which network interface a listen address belongs to, so UCX's network
// transports can be kept on it: UCX's TCP transport otherwise listens on
// every interface (the external one included) however a worker's gRPC
// --host was set.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace pdserve::transport {

// The interface that owns `host` (an IPv4/IPv6 literal or a name resolved
// with getaddrinfo): "lo" for 127.0.0.1 and localhost. Empty for a wildcard
// ("", 0.0.0.0, ::): every interface. NOT_FOUND when no local interface has
// the address (binding there would fail anyway).
absl::StatusOr<std::string> NetDeviceForHost(const std::string& host);

// The UCX configuration that keeps its network transports on `host`'s
// interface ({"NET_DEVICES", "<if>"}; nothing for a wildcard). Shared memory
// transports are unaffected (they never leave the host).
absl::StatusOr<std::vector<std::pair<std::string, std::string>>>
UcxConfigForHost(const std::string& host);

// The workers' --ucx-net-devices: "auto" keeps UCX on --host's interface
// (UcxConfigForHost), "all" lets it use every interface, anything else is
// UCX's own device list (e.g. "mlx5_0:1,eth0": RDMA needs its HCA named,
// which "auto" would leave out).
absl::StatusOr<std::vector<std::pair<std::string, std::string>>>
UcxNetworkConfig(const std::string& net_devices, const std::string& host);

}  // namespace pdserve::transport
