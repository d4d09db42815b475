#include "process/dns_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "process/port_file.h"

namespace pdserve::process {
namespace {

constexpr char kDnsmasq[] = "/usr/sbin/dnsmasq";

sockaddr_in Loopback(int port) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  return address;
}

// Whether something (dnsmasq, once up) holds `port` of `socket_type` on
// 127.0.0.1.
bool PortTaken(int port, int socket_type) {
  const int fd = socket(AF_INET, socket_type | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in address = Loopback(port);
  const bool taken =
      bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 &&
      errno == EADDRINUSE;
  close(fd);
  return taken;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DnsServer>> DnsServer::Start(
    const std::string& work_dir, const std::string& domain) {
  if (!IsExecutableFile(kDnsmasq)) {
    return absl::NotFoundError(
        "a DNS server needs dnsmasq (Debian's dnsmasq-base; scripts/setup.sh "
        "installs it)");
  }
  const std::string hosts_file = absl::StrCat(work_dir, "/dns.hosts");
  {
    std::ofstream empty(hosts_file, std::ios::trunc);
    if (!empty) return absl::UnavailableError("cannot write " + hosts_file);
  }
  // dnsmasq listens on UDP and TCP on its port: a free UDP port whose TCP
  // twin another process holds (a test's gRPC server) makes it exit. Such a
  // port is skipped, and one taken between the check and dnsmasq's bind is
  // tried again with another.
  constexpr int kAttempts = 8;
  std::string last_log;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    absl::StatusOr<int> port = FreeLoopbackPort(SOCK_DGRAM);
    if (!port.ok()) return port.status();
    if (PortTaken(*port, SOCK_STREAM)) {
      last_log = absl::StrCat("TCP port ", *port, " (beside a free UDP one) ",
                              "is taken\n");
      continue;
    }
    const char* user = std::getenv("USER");
    SpawnOptions spawn;
    spawn.binary = kDnsmasq;
    spawn.args = {"--keep-in-foreground", "--conf-file=/dev/null",
                  absl::StrCat("--port=", *port), "--listen-address=127.0.0.1",
                  "--bind-interfaces", "--no-resolv", "--no-hosts",
                  // The records come from this file only; a name of the
                  // domain without records is NXDOMAIN, never forwarded.
                  absl::StrCat("--addn-hosts=", hosts_file),
                  absl::StrCat("--local=/", domain, "/"), "--local-ttl=0",
                  "--pid-file=", "--log-facility=-",
                  // Stay this user: the work folder is private to it.
                  absl::StrCat("--user=", getuid() == 0     ? "root"
                                          : user != nullptr ? user
                                                            : "nobody")};
    spawn.log_path = absl::StrCat(work_dir, "/dns.log");
    absl::StatusOr<std::unique_ptr<ChildProcess>> child =
        ChildProcess::Spawn(std::move(spawn));
    if (!child.ok()) return child.status();
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (!PortTaken(*port, SOCK_DGRAM) && (*child)->Running() &&
           absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    if ((*child)->Running() && PortTaken(*port, SOCK_DGRAM)) {
      return std::unique_ptr<DnsServer>(new DnsServer(
          *std::move(child), hosts_file, absl::StrCat("127.0.0.1:", *port)));
    }
    last_log = (*child)->LogTail(1024);
    if (last_log.find("Address already in use") == std::string::npos) break;
  }
  return absl::UnavailableError(
      absl::StrCat("dnsmasq did not start; its log ends:\n", last_log));
}

absl::Status DnsServer::SetRecords(
    const std::map<std::string, std::set<std::string>>& records) {
  std::string text;
  for (const auto& [name, addresses] : records) {
    for (const std::string& address : addresses) {
      absl::StrAppend(&text, address, " ", name, "\n");
    }
  }
  const std::string staged = hosts_file_ + ".new";
  {
    std::ofstream out(staged, std::ios::trunc);
    out << text;
    if (!out) return absl::UnavailableError("cannot write " + staged);
  }
  if (std::rename(staged.c_str(), hosts_file_.c_str()) != 0) {
    return absl::UnavailableError("cannot replace " + hosts_file_);
  }
  // SIGHUP: dnsmasq clears its cache and reads --addn-hosts again.
  process_->Signal(SIGHUP);
  return absl::OkStatus();
}

std::string DnsServer::LogTail(size_t max_bytes) const {
  return process_->LogTail(max_bytes);
}

}  // namespace pdserve::process
