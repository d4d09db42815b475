#include "router/dns_resolver.h"

#include <ares.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>

#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace pdserve::router {
namespace {

// c-ares's process-wide state, initialised once (ares_library_init is not
// thread-safe and must precede every channel).
absl::Status InitAresLibrary() {
  static const int rc = ares_library_init(ARES_LIB_INIT_ALL);
  if (rc != ARES_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("c-ares library init: ", ares_strerror(rc)));
  }
  return absl::OkStatus();
}

// One lookup's answer, filled by the c-ares callback.
struct Lookup {
  bool done = false;
  int status = ARES_SUCCESS;
  std::set<std::string> addresses;
  int port = 0;
};

void OnAddrInfo(void* arg, int status, int /*timeouts*/,
                struct ares_addrinfo* result) {
  auto* lookup = static_cast<Lookup*>(arg);
  lookup->done = true;
  lookup->status = status;
  if (result == nullptr) return;
  for (ares_addrinfo_node* node = result->nodes; node != nullptr;
       node = node->ai_next) {
    char text[INET6_ADDRSTRLEN] = {};
    if (node->ai_family == AF_INET) {
      const auto* in = reinterpret_cast<const sockaddr_in*>(node->ai_addr);
      inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text));
      lookup->addresses.insert(absl::StrCat(text, ":", lookup->port));
    } else if (node->ai_family == AF_INET6) {
      const auto* in6 = reinterpret_cast<const sockaddr_in6*>(node->ai_addr);
      inet_ntop(AF_INET6, &in6->sin6_addr, text, sizeof(text));
      lookup->addresses.insert(absl::StrCat("[", text, "]:", lookup->port));
    }
  }
  ares_freeaddrinfo(result);
}

class AresResolver final : public Resolver {
 public:
  AresResolver(ares_channel channel, std::string servers,
               absl::Duration timeout)
      : channel_(channel), servers_(std::move(servers)), timeout_(timeout) {}
  ~AresResolver() override { ares_destroy(channel_); }
  AresResolver(const AresResolver&) = delete;
  AresResolver& operator=(const AresResolver&) = delete;

  absl::StatusOr<std::vector<std::string>> Resolve(const std::string& host,
                                                   int port) override {
    absl::MutexLock lock(&mu_);  // one channel, one lookup at a time
    Lookup lookup;
    lookup.port = port;
    ares_addrinfo_hints hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    ares_getaddrinfo(channel_, host.c_str(), nullptr, &hints, &OnAddrInfo,
                     &lookup);
    const absl::Time deadline = absl::Now() + timeout_;
    while (!lookup.done) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) {
        // Ends the query; its callback runs now with ARES_ECANCELLED.
        ares_cancel(channel_);
        break;
      }
      // poll, not select: a busy router's descriptors pass FD_SETSIZE.
      ares_socket_t sockets[ARES_GETSOCK_MAXNUM];
      const int bits = ares_getsock(channel_, sockets, ARES_GETSOCK_MAXNUM);
      std::vector<pollfd> polled;
      for (int i = 0; i < ARES_GETSOCK_MAXNUM; ++i) {
        short events = 0;
        if (ARES_GETSOCK_READABLE(bits, i)) events |= POLLIN;
        if (ARES_GETSOCK_WRITABLE(bits, i)) events |= POLLOUT;
        if (events != 0) polled.push_back({sockets[i], events, 0});
      }
      if (polled.empty()) break;  // nothing pending: the callback ran
      timeval max_wait = absl::ToTimeval(left);
      timeval wait{};
      const timeval* chosen = ares_timeout(channel_, &max_wait, &wait);
      const int wait_ms = static_cast<int>(chosen->tv_sec * 1000 +
                                           (chosen->tv_usec + 999) / 1000);
      (void)poll(polled.data(), polled.size(), wait_ms);
      bool any = false;
      for (const pollfd& p : polled) {
        const bool readable = (p.revents & (POLLIN | POLLERR | POLLHUP)) != 0;
        const bool writable = (p.revents & POLLOUT) != 0;
        if (!readable && !writable) continue;
        any = true;
        ares_process_fd(channel_, readable ? p.fd : ARES_SOCKET_BAD,
                        writable ? p.fd : ARES_SOCKET_BAD);
      }
      // Nothing ready: let c-ares run its timeouts (retries, next server).
      if (!any) ares_process_fd(channel_, ARES_SOCKET_BAD, ARES_SOCKET_BAD);
    }
    if (!lookup.done || lookup.status == ARES_ECANCELLED) {
      return absl::UnavailableError(
          absl::StrCat("cannot resolve ", host, " at ", servers_,
                       ": no answer in ", absl::FormatDuration(timeout_)));
    }
    if (lookup.status != ARES_SUCCESS) {
      return absl::UnavailableError(absl::StrCat("cannot resolve ", host,
                                                 " at ", servers_, ": ",
                                                 ares_strerror(lookup.status)));
    }
    if (lookup.addresses.empty()) {
      return absl::UnavailableError(absl::StrCat(host, " has no address"));
    }
    return std::vector<std::string>(lookup.addresses.begin(),
                                    lookup.addresses.end());
  }

 private:
  absl::Mutex mu_;
  ares_channel channel_;
  const std::string servers_;
  const absl::Duration timeout_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Resolver>> MakeDnsResolver(
    const std::string& servers, absl::Duration timeout) {
  if (servers.empty()) {
    return absl::InvalidArgumentError("no DNS server given");
  }
  for (const std::string& server :
       std::vector<std::string>(absl::StrSplit(servers, ','))) {
    std::string host;
    int port = 0;
    if (!SplitHostPort(server, &host, &port).ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "DNS server '", server, "' is not host:port (in '", servers, "')"));
    }
  }
  if (timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("DNS timeout must be > 0");
  }
  if (absl::Status s = InitAresLibrary(); !s.ok()) return s;
  ares_options options{};
  // DNS only: /etc/hosts could shadow the records under test (and a pod's
  // hosts file names only itself).
  char lookups[] = "b";
  options.lookups = lookups;
  // Each try waits a fraction of the whole bound, so a lost UDP datagram is
  // retried within it.
  options.timeout = static_cast<int>(
      std::max<int64_t>(1, absl::ToInt64Milliseconds(timeout) / 4));
  options.tries = 3;
  ares_channel channel = nullptr;
  int rc =
      ares_init_options(&channel, &options,
                        ARES_OPT_LOOKUPS | ARES_OPT_TIMEOUTMS | ARES_OPT_TRIES);
  if (rc != ARES_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("c-ares channel: ", ares_strerror(rc)));
  }
  rc = ares_set_servers_ports_csv(channel, servers.c_str());
  if (rc != ARES_SUCCESS) {
    ares_destroy(channel);
    return absl::InvalidArgumentError(
        absl::StrCat("DNS servers '", servers, "': ", ares_strerror(rc)));
  }
  return std::make_unique<AresResolver>(channel, servers, timeout);
}

}  // namespace pdserve::router
