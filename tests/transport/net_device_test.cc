// The UCX network transports stay on the interface of the configured host:
// checked on the sockets a real UCX worker opens (from /proc), not on the
// configuration string alone.
#include "transport/net_device.h"

#include <dirent.h>
#include <unistd.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "transport/ucx_worker.h"

namespace pdserve::transport {
namespace {

TEST(NetDeviceTest, LoopbackAddressesBelongToLo) {
  absl::StatusOr<std::string> v4 = NetDeviceForHost("127.0.0.1");
  ASSERT_TRUE(v4.ok()) << v4.status();
  EXPECT_EQ(*v4, "lo");
  absl::StatusOr<std::string> name = NetDeviceForHost("localhost");
  ASSERT_TRUE(name.ok()) << name.status();
  EXPECT_EQ(*name, "lo");
}

TEST(NetDeviceTest, WildcardsMeanEveryInterface) {
  for (const char* host : {"", "0.0.0.0", "::", "[::]"}) {
    absl::StatusOr<std::string> device = NetDeviceForHost(host);
    ASSERT_TRUE(device.ok()) << host << ": " << device.status();
    EXPECT_EQ(*device, "") << host;
  }
  absl::StatusOr<std::vector<std::pair<std::string, std::string>>> config =
      UcxConfigForHost("0.0.0.0");
  ASSERT_TRUE(config.ok());
  EXPECT_TRUE(config->empty());
}

TEST(NetDeviceTest, AnAddressNoInterfaceHasIsNotFound) {
  // TEST-NET-3: documentation only, never assigned to a host.
  absl::StatusOr<std::string> device = NetDeviceForHost("203.0.113.77");
  EXPECT_EQ(device.status().code(), absl::StatusCode::kNotFound)
      << device.status();
}

// The socket inodes this process has open.
std::set<std::string> OpenSocketInodes() {
  std::set<std::string> inodes;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return inodes;
  while (dirent* entry = readdir(dir)) {
    char target[256];
    const std::string path = absl::StrCat("/proc/self/fd/", entry->d_name);
    ssize_t n = readlink(path.c_str(), target, sizeof(target) - 1);
    if (n <= 0) continue;
    std::string link(target, n);
    if (link.rfind("socket:[", 0) == 0) {
      inodes.insert(link.substr(8, link.size() - 9));
    }
  }
  closedir(dir);
  return inodes;
}

// Local addresses ("hex:port" as /proc prints them) of listening TCP sockets
// among `inodes`.
std::vector<std::string> ListeningAddresses(const std::set<std::string>& inodes,
                                            const char* table) {
  std::vector<std::string> addresses;
  std::ifstream in(table);
  std::string line;
  std::getline(in, line);  // header
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string slot, local, remote, state, queues, timer, retransmits, uid,
        timeout, inode;
    fields >> slot >> local >> remote >> state >> queues >> timer >>
        retransmits >> uid >> timeout >> inode;
    if (state == "0A" && inodes.count(inode) > 0) addresses.push_back(local);
  }
  return addresses;
}

TEST(NetDeviceTest, AUcxWorkerBoundToLoopbackListensOnLoopbackOnly) {
  const std::set<std::string> before = OpenSocketInodes();
  UcxWorkerOptions options;
  absl::StatusOr<std::vector<std::pair<std::string, std::string>>> config =
      UcxConfigForHost("127.0.0.1");
  ASSERT_TRUE(config.ok()) << config.status();
  options.ucx_config = *config;
  absl::StatusOr<std::unique_ptr<UcxWorker>> worker =
      UcxWorker::Create(options);
  ASSERT_TRUE(worker.ok()) << worker.status();
  std::set<std::string> opened;
  for (const std::string& inode : OpenSocketInodes()) {
    if (before.count(inode) == 0) opened.insert(inode);
  }
  const std::vector<std::string> v4 =
      ListeningAddresses(opened, "/proc/net/tcp");
  const std::vector<std::string> v6 =
      ListeningAddresses(opened, "/proc/net/tcp6");
  ASSERT_FALSE(v4.empty() && v6.empty())
      << "the UCX worker opened no listening TCP socket (is tcp in UCX_TLS?)";
  for (const std::string& local : v4) {
    // 127.0.0.1 in /proc's little-endian hex.
    EXPECT_EQ(local.substr(0, 8), "0100007F") << local;
  }
  for (const std::string& local : v6) {
    EXPECT_EQ(local.substr(0, 32), "00000000000000000000000001000000") << local;
  }
}

}  // namespace
}  // namespace pdserve::transport
