#include "transport/net_device.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
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
