#include "process/port_file.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "process/child_process.h"

namespace pdserve::process {

absl::Status WritePortFile(const std::string& path, const std::string& text) {
  if (path.empty()) return absl::OkStatus();
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  {
    std::ofstream out(tmp);
    out << text << "\n";
    if (!out.good()) {
      return absl::UnavailableError(absl::StrCat("cannot write ", tmp));
    }
  }
  // Readers poll for the file: the rename makes it appear complete.
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot rename to ", path));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> WaitForPortFile(const std::string& path,
                                            absl::Duration timeout,
                                            ChildProcess* writer) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    {
      std::ifstream in(path);
      std::string line;
      if (in && std::getline(in, line) && !line.empty()) return line;
    }
    if (writer != nullptr) {
      if (std::optional<int> status = writer->ExitStatus()) {
        return absl::FailedPreconditionError(absl::StrCat(
            writer->options().binary, " exited (",
            ChildProcess::DescribeStatus(*status), ") before writing ", path,
            "; its log ends:\n", writer->LogTail(2048)));
      }
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "no address in ", path, " after ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

std::string ReadFileTail(const std::string& path, size_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "";
  std::stringstream buffer;
  buffer << in.rdbuf();
  std::string text = buffer.str();
  if (text.size() > max_bytes) text = text.substr(text.size() - max_bytes);
  return text;
}

absl::StatusOr<int> FreeLoopbackPort(int socket_type) {
  const int fd = socket(AF_INET, socket_type | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError("socket() failed");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  const bool ok =
      bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  close(fd);
  if (!ok) return absl::UnavailableError("cannot bind a loopback port");
  return static_cast<int>(ntohs(address.sin_port));
}

}  // namespace pdserve::process
