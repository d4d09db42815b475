// A DNS server of our own on a loopback port (Debian's dnsmasq, as a
// ChildProcess): what a headless Kubernetes Service is to the router — a
// name whose A records are the members' addresses — for `pdserve local
// --discovery dns` and the elastic-cluster tests. Names under `domain` are
// answered from the records set here only (nothing is forwarded; a name with
// no records is NXDOMAIN), with TTL 0.
//
// Not thread-safe: one owner sets the records.
#pragma once

#include <map>
#include <memory>
#include <set>
#include <string>

#include "absl/status/statusor.h"
#include "process/child_process.h"

namespace pdserve::process {

class DnsServer {
 public:
  // Starts dnsmasq on 127.0.0.1 at a free UDP port, its hosts file and log
  // in `work_dir`. NOT_FOUND without dnsmasq (package dnsmasq-base),
  // UNAVAILABLE when it does not come up.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<DnsServer>> Start(
      const std::string& work_dir, const std::string& domain);
  ~DnsServer() = default;  // the ChildProcess stops it
  DnsServer(const DnsServer&) = delete;
  DnsServer& operator=(const DnsServer&) = delete;

  // "127.0.0.1:PORT", for a resolver (router --dns-server).
  const std::string& address() const { return address_; }
  // Replaces every record: name -> its IPv4 addresses (an empty set removes
  // the name). dnsmasq re-reads them on SIGHUP, so a lookup a moment later
  // sees them.
  [[nodiscard]] absl::Status SetRecords(
      const std::map<std::string, std::set<std::string>>& records);
  std::string LogTail(size_t max_bytes = 2048) const;

 private:
  DnsServer(std::unique_ptr<ChildProcess> process, std::string hosts_file,
            std::string address)
      : process_(std::move(process)),
        hosts_file_(std::move(hosts_file)),
        address_(std::move(address)) {}

  std::unique_ptr<ChildProcess> process_;
  const std::string hosts_file_;
  const std::string address_;
};

}  // namespace pdserve::process
