// Worker discovery through a named DNS server (c-ares), for a router that
// should not take the machine's resolver: a test's own DNS server on a
// loopback port, or a cluster DNS reached directly. On Kubernetes the
// system resolver (MakeSystemResolver) already asks the cluster DNS; both
// read the A/AAAA records of a headless Service, which list its Ready pods
// only, so a pod that drains (readiness NOT_SERVING) leaves the answer.
//
// Every Resolve asks the server afresh (no cache here: the records' TTL is
// the DNS server's business, and a headless Service's is short), bounded by
// `timeout`.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "router/worker_registry.h"

namespace pdserve::router {

// `servers`: "host:port[,host:port...]" (IPv4 or [IPv6]); the names are
// looked up in DNS only (not in /etc/hosts). INVALID_ARGUMENT for a
// malformed server list, INTERNAL when c-ares cannot start.
[[nodiscard]] absl::StatusOr<std::unique_ptr<Resolver>> MakeDnsResolver(
    const std::string& servers, absl::Duration timeout = absl::Seconds(2));

}  // namespace pdserve::router
