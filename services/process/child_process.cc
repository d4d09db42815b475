#include "process/child_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "process/port_file.h"

extern char** environ;

namespace pdserve::process {

bool IsExecutableFile(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
         access(path.c_str(), X_OK) == 0;
}

std::string ExecutableDir() {
  char buffer[PATH_MAX] = {};
  const ssize_t n = readlink("/proc/self/exe", buffer, sizeof(buffer) - 1);
  if (n <= 0) return ".";
  return std::filesystem::path(std::string(buffer, n)).parent_path().string();
}

absl::StatusOr<std::unique_ptr<ChildProcess>> ChildProcess::Spawn(
    SpawnOptions options) {
  if (!IsExecutableFile(options.binary)) {
    return absl::NotFoundError(
        absl::StrCat("no executable at '", options.binary, "'"));
  }
  // Everything the child needs is built before fork: between fork and exec a
  // child of a multi-threaded parent may only make async-signal-safe calls.
  std::vector<std::string> argv_storage;
  argv_storage.push_back(options.binary);
  for (const std::string& arg : options.args) argv_storage.push_back(arg);
  std::vector<char*> argv;
  for (std::string& arg : argv_storage) argv.push_back(arg.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_storage = options.env;
  std::vector<char*> envp;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    envp.push_back(*e);
  }
  for (std::string& entry : env_storage) envp.push_back(entry.data());
  envp.push_back(nullptr);

  int log_fd = -1;
  if (!options.log_path.empty()) {
    log_fd = open(options.log_path.c_str(),
                  O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (log_fd < 0) {
      return absl::UnavailableError(absl::StrCat(
          "cannot open log '", options.log_path, "': ", std::strerror(errno)));
    }
  }
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    const int err = errno;
    if (log_fd >= 0) close(log_fd);
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(err)));
  }
  if (pid == 0) {
    // The parent's death (strictly: the death of the thread that forked)
    // kills the child; if the parent already died, do not start at all.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(126);
    // A fresh process group, so a terminal's Ctrl-C reaches the launcher
    // only, which then stops its children in order.
    setpgid(0, 0);
    if (log_fd >= 0) {
      dup2(log_fd, STDOUT_FILENO);
      dup2(log_fd, STDERR_FILENO);
    }
    // Signal dispositions and masks survive exec: give the child defaults.
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    signal(SIGPIPE, SIG_DFL);
    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  if (log_fd >= 0) close(log_fd);
  return std::unique_ptr<ChildProcess>(
      new ChildProcess(std::move(options), pid));
}

ChildProcess::~ChildProcess() { Stop(); }

void ChildProcess::Signal(int signal) {
  absl::MutexLock lock(&mu_);
  // Once reaped the pid may belong to someone else: never signal it then.
  if (!status_.has_value()) kill(pid_, signal);
}

std::optional<int> ChildProcess::ExitStatus() {
  absl::MutexLock lock(&mu_);
  if (!status_.has_value()) {
    int status = 0;
    const pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      status_ = status;
    } else if (r < 0 && errno == ECHILD) {
      status_ = -1;  // reaped elsewhere (should not happen)
    }
  }
  return status_;
}

absl::StatusOr<int> ChildProcess::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration nap = absl::Milliseconds(1);
  while (true) {
    if (std::optional<int> status = ExitStatus()) return *status;
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("process ", pid_, " still running after ",
                       absl::FormatDuration(timeout)));
    }
    absl::SleepFor(nap);
    nap = std::min(nap * 2, absl::Milliseconds(50));
  }
}

int ChildProcess::Stop() {
  if (std::optional<int> status = ExitStatus()) return *status;
  Signal(SIGTERM);
  if (absl::StatusOr<int> status = Wait(options_.stop_grace); status.ok()) {
    return *status;
  }
  Signal(SIGKILL);
  absl::StatusOr<int> status = Wait(absl::Seconds(30));
  return status.ok() ? *status : -1;
}

std::string ChildProcess::LogTail(size_t max_bytes) const {
  return options_.log_path.empty() ? ""
                                   : ReadFileTail(options_.log_path, max_bytes);
}

std::string ChildProcess::DescribeStatus(int status) {
  if (status < 0) return "unknown";
  if (WIFEXITED(status)) return absl::StrCat("exit ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return absl::StrCat("signal ", WTERMSIG(status));
  return absl::StrCat("status ", status);
}

}  // namespace pdserve::process
