#include "transport/net_device.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstring>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace pdserve::transport {
namespace {

bool IsWildcard(const sockaddr* address) {
  if (address->sa_family == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(address)->sin_addr.s_addr ==
           htonl(INADDR_ANY);
  }
  if (address->sa_family == AF_INET6) {
    const in6_addr& a =
        reinterpret_cast<const sockaddr_in6*>(address)->sin6_addr;
    return IN6_IS_ADDR_UNSPECIFIED(&a);
  }
  return false;
}

bool SameAddress(const sockaddr* a, const sockaddr* b) {
  if (a->sa_family != b->sa_family) return false;
  if (a->sa_family == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr ==
           reinterpret_cast<const sockaddr_in*>(b)->sin_addr.s_addr;
  }
  if (a->sa_family == AF_INET6) {
    return std::memcmp(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr,
                       &reinterpret_cast<const sockaddr_in6*>(b)->sin6_addr,
                       sizeof(in6_addr)) == 0;
  }
  return false;
}

// An IPv4 address inside a loopback interface's subnet: Linux delivers all
// of 127.0.0.0/8 to `lo` though only 127.0.0.1 is assigned, so processes
// bound to 127.0.2.7 (one loopback address per worker, as the discovery
// tests run them) are on that interface.
bool InLoopbackSubnet(const sockaddr* address, const ifaddrs& interface) {
  if (address->sa_family != AF_INET || interface.ifa_addr == nullptr ||
      interface.ifa_netmask == nullptr ||
      interface.ifa_addr->sa_family != AF_INET ||
      (interface.ifa_flags & IFF_LOOPBACK) == 0) {
    return false;
  }
  const auto bits = [](const sockaddr* a) {
    return reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr;
  };
  const uint32_t mask = bits(interface.ifa_netmask);
  return (bits(address) & mask) == (bits(interface.ifa_addr) & mask);
}

struct AddrInfoDeleter {
  void operator()(addrinfo* info) const { freeaddrinfo(info); }
};
struct IfAddrsDeleter {
  void operator()(ifaddrs* list) const { freeifaddrs(list); }
};

}  // namespace

absl::StatusOr<std::string> NetDeviceForHost(const std::string& host) {
  if (host.empty()) return std::string();
  // gRPC accepts "[::1]"; getaddrinfo wants the bare literal.
  std::string name = host;
  if (name.size() >= 2 && name.front() == '[' && name.back() == ']') {
    name = name.substr(1, name.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* raw_resolved = nullptr;
  if (int rc = getaddrinfo(name.c_str(), nullptr, &hints, &raw_resolved);
      rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot resolve host '", host, "': ", gai_strerror(rc)));
  }
  std::unique_ptr<addrinfo, AddrInfoDeleter> resolved(raw_resolved);
  ifaddrs* raw_interfaces = nullptr;
  if (getifaddrs(&raw_interfaces) != 0) {
    return absl::InternalError(
        absl::StrCat("getifaddrs: ", std::strerror(errno)));
  }
  std::unique_ptr<ifaddrs, IfAddrsDeleter> interfaces(raw_interfaces);
  for (const addrinfo* a = resolved.get(); a != nullptr; a = a->ai_next) {
    if (IsWildcard(a->ai_addr)) return std::string();
    for (const ifaddrs* i = interfaces.get(); i != nullptr; i = i->ifa_next) {
      if (i->ifa_addr != nullptr && SameAddress(a->ai_addr, i->ifa_addr)) {
        return std::string(i->ifa_name);
      }
    }
    for (const ifaddrs* i = interfaces.get(); i != nullptr; i = i->ifa_next) {
      if (InLoopbackSubnet(a->ai_addr, *i)) return std::string(i->ifa_name);
    }
  }
  return absl::NotFoundError(absl::StrCat(
      "no local network interface has the address of host '", host, "'"));
}

absl::StatusOr<std::vector<std::pair<std::string, std::string>>>
UcxConfigForHost(const std::string& host) {
  absl::StatusOr<std::string> device = NetDeviceForHost(host);
  if (!device.ok()) return device.status();
  std::vector<std::pair<std::string, std::string>> config;
  if (!device->empty()) config.emplace_back("NET_DEVICES", *device);
  return config;
}

absl::StatusOr<std::vector<std::pair<std::string, std::string>>>
UcxNetworkConfig(const std::string& net_devices, const std::string& host) {
  if (net_devices == "auto") return UcxConfigForHost(host);
  std::vector<std::pair<std::string, std::string>> config;
  if (net_devices.empty()) {
    return absl::InvalidArgumentError(
        "--ucx-net-devices must be auto, all or a UCX device list");
  }
  if (net_devices != "all") config.emplace_back("NET_DEVICES", net_devices);
  return config;
}

}  // namespace pdserve::transport
