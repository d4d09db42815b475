#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "process/child_process.h"
#include "process/port_file.h"

namespace pdserve::process {
namespace {

std::string TempPath(const std::string& name) {
  return absl::StrCat(::testing::TempDir(), "/", name, ".", getpid());
}

TEST(ChildProcessTest, RunsWithArgumentsEnvironmentAndLog) {
  const std::string log = TempPath("echo.log");
  std::remove(log.c_str());
  SpawnOptions o;
  o.binary = "/bin/sh";
  o.args = {"-c", "echo out:$PDSERVE_TEST_VALUE; echo err >&2; exit 3"};
  o.env = {"PDSERVE_TEST_VALUE=42"};
  o.log_path = log;
  auto child = ChildProcess::Spawn(o);
  ASSERT_TRUE(child.ok()) << child.status();
  absl::StatusOr<int> status = (*child)->Wait(absl::Seconds(10));
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_TRUE(WIFEXITED(*status));
  EXPECT_EQ(WEXITSTATUS(*status), 3);
  EXPECT_EQ(ChildProcess::DescribeStatus(*status), "exit 3");
  EXPECT_EQ((*child)->LogTail(), "out:42\nerr\n");
  EXPECT_FALSE((*child)->Running());
}

TEST(ChildProcessTest, StopEscalatesToSigkillWhenTermIsIgnored) {
  SpawnOptions o;
  o.binary = "/bin/sh";
  // Ignores SIGTERM; only SIGKILL ends it.
  o.args = {"-c", "trap '' TERM; while true; do sleep 0.05; done"};
  o.stop_grace = absl::Milliseconds(200);
  auto child = ChildProcess::Spawn(o);
  ASSERT_TRUE(child.ok()) << child.status();
  absl::SleepFor(absl::Milliseconds(100));  // let the trap be installed
  EXPECT_TRUE((*child)->Running());
  EXPECT_TRUE(absl::IsDeadlineExceeded(
      (*child)->Wait(absl::Milliseconds(50)).status()));
  const absl::Time start = absl::Now();
  const int status = (*child)->Stop();
  EXPECT_TRUE(WIFSIGNALED(status));
  EXPECT_EQ(WTERMSIG(status), SIGKILL);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(150));
  // Idempotent, and a reaped child is never signalled again.
  EXPECT_EQ((*child)->Stop(), status);
  (*child)->Signal(SIGKILL);
}

TEST(ChildProcessTest, MissingBinaryIsNotFound) {
  SpawnOptions o;
  o.binary = "/nonexistent/pdserve-nothing";
  auto child = ChildProcess::Spawn(o);
  EXPECT_TRUE(absl::IsNotFound(child.status())) << child.status();
  // Exists, not executable.
  o.binary = TempPath("plain-file");
  { std::ofstream(o.binary) << "not a program\n"; }
  chmod(o.binary.c_str(), 0644);
  EXPECT_TRUE(absl::IsNotFound(ChildProcess::Spawn(o).status()));
}

TEST(ChildProcessTest, UnwritableLogIsAnError) {
  SpawnOptions o;
  o.binary = "/bin/true";
  o.log_path = "/nonexistent-dir/x.log";
  EXPECT_TRUE(absl::IsUnavailable(ChildProcess::Spawn(o).status()));
}

TEST(PortFileTest, WriteThenWaitReadsTheAddress) {
  const std::string path = TempPath("port");
  std::remove(path.c_str());
  ASSERT_TRUE(WritePortFile(path, "127.0.0.1:1234").ok());
  auto address = WaitForPortFile(path, absl::Seconds(1));
  ASSERT_TRUE(address.ok()) << address.status();
  EXPECT_EQ(*address, "127.0.0.1:1234");
  EXPECT_TRUE(WritePortFile("", "ignored").ok());
  EXPECT_FALSE(WritePortFile("/nonexistent-dir/port", "x").ok());
}

TEST(PortFileTest, WaitTimesOutOrReportsTheWriterDying) {
  const std::string path = TempPath("never");
  std::remove(path.c_str());
  auto timed_out = WaitForPortFile(path, absl::Milliseconds(100));
  EXPECT_TRUE(absl::IsDeadlineExceeded(timed_out.status()));

  SpawnOptions o;
  o.binary = "/bin/sh";
  o.args = {"-c", "echo dying; exit 7"};
  o.log_path = TempPath("dying.log");
  std::remove(o.log_path.c_str());
  auto child = ChildProcess::Spawn(o);
  ASSERT_TRUE(child.ok());
  auto failed = WaitForPortFile(path, absl::Seconds(30), child->get());
  EXPECT_TRUE(absl::IsFailedPrecondition(failed.status())) << failed.status();
  EXPECT_NE(failed.status().message().find("exit 7"), std::string::npos);
  EXPECT_NE(failed.status().message().find("dying"), std::string::npos);
}

TEST(PortFileTest, AppearsWhileWaiting) {
  const std::string path = TempPath("later");
  std::remove(path.c_str());
  SpawnOptions o;
  o.binary = "/bin/sh";
  o.args = {"-c", absl::StrCat("sleep 0.2; echo 10.0.0.1:5 > ", path,
                               ".tmp; mv ", path, ".tmp ", path)};
  auto child = ChildProcess::Spawn(o);
  ASSERT_TRUE(child.ok());
  auto address = WaitForPortFile(path, absl::Seconds(10));
  ASSERT_TRUE(address.ok()) << address.status();
  EXPECT_EQ(*address, "10.0.0.1:5");
}

}  // namespace
}  // namespace pdserve::process
