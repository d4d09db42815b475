// Worker discovery through a real DNS server (Debian's dnsmasq on a loopback
// port, process::DnsServer): the c-ares resolver reads a name's A records
// as a headless Service lists its Ready pods, follows them as they change,
// says precisely what failed, and the registry over it adds and drops
// workers with the records while a DNS blip keeps the last answer.
#include "router/dns_resolver.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "process/dns_server.h"
#include "router/worker_registry.h"

namespace pdserve::router {
namespace {

class DnsResolverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/pdserve-dns-test.XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
    auto started = process::DnsServer::Start(dir_, "pdserve.test");
    ASSERT_TRUE(started.ok()) << started.status();
    dns_ = *std::move(started);
    auto resolver = MakeDnsResolver(dns_->address(), absl::Milliseconds(800));
    ASSERT_TRUE(resolver.ok()) << resolver.status();
    resolver_ = *std::move(resolver);
  }
  void TearDown() override {
    dns_.reset();
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

  // dnsmasq reads new records on SIGHUP, a moment after SetRecords.
  absl::StatusOr<std::vector<std::string>> ResolveUntil(const std::string& host,
                                                        int port,
                                                        size_t count) {
    absl::StatusOr<std::vector<std::string>> got;
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    do {
      got = resolver_->Resolve(host, port);
      if (got.ok() && got->size() == count) return got;
      absl::SleepFor(absl::Milliseconds(20));
    } while (absl::Now() < deadline);
    return got;
  }

  std::string dir_;
  std::unique_ptr<process::DnsServer> dns_;
  std::unique_ptr<Resolver> resolver_;
};

TEST_F(DnsResolverTest, ReadsEveryRecordAndFollowsChanges) {
  ASSERT_TRUE(
      dns_->SetRecords({{"decode.pdserve.test", {"127.0.2.1", "127.0.2.2"}},
                        {"prefill.pdserve.test", {"127.0.3.1"}}})
          .ok());
  auto decode = ResolveUntil("decode.pdserve.test", 7100, 2);
  ASSERT_TRUE(decode.ok()) << decode.status();
  EXPECT_EQ(*decode,
            (std::vector<std::string>{"127.0.2.1:7100", "127.0.2.2:7100"}));
  auto prefill = resolver_->Resolve("prefill.pdserve.test", 7001);
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  EXPECT_EQ(*prefill, std::vector<std::string>{"127.0.3.1:7001"});
  // Scale up, then down: the answers follow.
  ASSERT_TRUE(dns_->SetRecords({{"decode.pdserve.test",
                                 {"127.0.2.1", "127.0.2.2", "127.0.2.3"}}})
                  .ok());
  decode = ResolveUntil("decode.pdserve.test", 7100, 3);
  ASSERT_TRUE(decode.ok()) << decode.status();
  EXPECT_EQ(decode->size(), 3u);
  ASSERT_TRUE(dns_->SetRecords({{"decode.pdserve.test", {"127.0.2.3"}}}).ok());
  decode = ResolveUntil("decode.pdserve.test", 7100, 1);
  ASSERT_TRUE(decode.ok()) << decode.status();
  EXPECT_EQ(*decode, std::vector<std::string>{"127.0.2.3:7100"});
}

TEST_F(DnsResolverTest, UnknownNamesAndDeadServersArePreciseErrors) {
  absl::StatusOr<std::vector<std::string>> none =
      resolver_->Resolve("nobody.pdserve.test", 1);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(none.status().message().find("nobody.pdserve.test"),
            std::string::npos)
      << none.status();
  // /etc/hosts is not read: a name only it knows does not resolve here.
  EXPECT_FALSE(resolver_->Resolve("localhost", 1).ok());

  const std::string silent = "127.0.0.1:9";  // discard port: no DNS there
  auto dead = MakeDnsResolver(silent, absl::Milliseconds(300));
  ASSERT_TRUE(dead.ok()) << dead.status();
  const absl::Time start = absl::Now();
  absl::StatusOr<std::vector<std::string>> lost =
      (*dead)->Resolve("decode.pdserve.test", 1);
  EXPECT_EQ(lost.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  EXPECT_NE(lost.status().message().find(silent), std::string::npos)
      << lost.status();

  for (const char* bad : {"", "127.0.0.1", "dns:x", "127.0.0.1:53,"}) {
    auto made = MakeDnsResolver(bad);
    EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument)
        << "'" << bad << "': " << made.status();
  }
}

// A prober that finds every address serving with the same identity.
class AllServing : public WorkerProber {
 public:
  ProbeResult Probe(WorkerRole, const std::string&, absl::Duration) override {
    ProbeResult r;
    r.serving = true;
    r.load = WorkerLoad{};
    v1::ModelIdentity id;
    id.set_name("m");
    r.identity = id;
    return r;
  }
};

std::vector<std::string> DecodeAddresses(const WorkerRegistry& registry) {
  std::vector<std::string> out;
  for (const WorkerStatus& w : registry.Workers()) {
    if (w.role == WorkerRole::kDecode) out.push_back(w.address);
  }
  return out;
}

TEST_F(DnsResolverTest, RegistryMembershipFollowsTheRecords) {
  ASSERT_TRUE(dns_->SetRecords({{"decode.pdserve.test", {"127.0.2.1"}}}).ok());
  ASSERT_TRUE(ResolveUntil("decode.pdserve.test", 7100, 1).ok());
  RegistryConfig config;
  config.decode = {"decode.pdserve.test:7100"};
  auto resolver = MakeDnsResolver(dns_->address(), absl::Milliseconds(800));
  ASSERT_TRUE(resolver.ok());
  WorkerRegistry registry(config, *std::move(resolver),
                          std::make_unique<AllServing>());
  registry.Refresh();
  EXPECT_EQ(DecodeAddresses(registry),
            std::vector<std::string>{"127.0.2.1:7100"});
  ASSERT_TRUE(
      dns_->SetRecords({{"decode.pdserve.test", {"127.0.2.1", "127.0.2.2"}}})
          .ok());
  ASSERT_TRUE(ResolveUntil("decode.pdserve.test", 7100, 2).ok());
  registry.Refresh();
  EXPECT_EQ(DecodeAddresses(registry),
            (std::vector<std::string>{"127.0.2.1:7100", "127.0.2.2:7100"}));
  ASSERT_TRUE(dns_->SetRecords({{"decode.pdserve.test", {"127.0.2.2"}}}).ok());
  ASSERT_TRUE(ResolveUntil("decode.pdserve.test", 7100, 1).ok());
  registry.Refresh();
  EXPECT_EQ(DecodeAddresses(registry),
            std::vector<std::string>{"127.0.2.2:7100"});
  // The DNS server gone (a control-plane blip): the last answer stays.
  dns_.reset();
  registry.Refresh();
  EXPECT_EQ(DecodeAddresses(registry),
            std::vector<std::string>{"127.0.2.2:7100"});
}

}  // namespace
}  // namespace pdserve::router
