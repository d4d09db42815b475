// A child process owned by RAII: spawned with fork/exec, its stdout and stderr
// appended to a log file, killed with SIGKILL if the parent dies first
// (PR_SET_PDEATHSIG, so a crashed launcher or test leaves no orphans), and
// stopped (SIGTERM, then SIGKILL after a grace period) when the handle goes.
#pragma once

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pdserve::process {

struct SpawnOptions {
  std::string binary;             // path of the executable
  std::vector<std::string> args;  // argv[1..]
  std::string log_path;           // stdout+stderr (appended); "" = inherit
  // Extra environment entries ("NAME=value"), added to the parent's.
  std::vector<std::string> env;
  // How long Stop() waits after SIGTERM before SIGKILL.
  absl::Duration stop_grace = absl::Seconds(5);
};

class ChildProcess {
 public:
  // NOT_FOUND when `binary` is not an executable file; INTERNAL when fork
  // fails. An exec failure in the child shows as exit code 127.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<ChildProcess>> Spawn(
      SpawnOptions options);
  // Stop().
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  const SpawnOptions& options() const { return options_; }

  // Sends `signal` if the child has not been reaped yet.
  void Signal(int signal);
  // Non-blocking: the wait status once the child exited (reaping it).
  std::optional<int> ExitStatus();
  bool Running() { return !ExitStatus().has_value(); }
  // Waits up to `timeout` for the child to exit; DEADLINE_EXCEEDED otherwise.
  [[nodiscard]] absl::StatusOr<int> Wait(absl::Duration timeout);
  // SIGTERM, up to stop_grace for an orderly exit, then SIGKILL. Returns the
  // wait status. Idempotent.
  int Stop();
  // The log's last `max_bytes` bytes (for error messages).
  std::string LogTail(size_t max_bytes = 4096) const;
  // A short description of a wait status: "exit 3", "signal 9".
  static std::string DescribeStatus(int status);

 private:
  ChildProcess(SpawnOptions options, pid_t pid)
      : options_(std::move(options)), pid_(pid) {}

  const SpawnOptions options_;
  const pid_t pid_;
  absl::Mutex mu_;
  std::optional<int> status_ ABSL_GUARDED_BY(mu_);
};

// A regular file this process may execute.
bool IsExecutableFile(const std::string& path);

// The folder of the running executable (/proc/self/exe): where its sibling
// binaries live. "." when it cannot be read.
std::string ExecutableDir();

}  // namespace pdserve::process
