#include "testing/shell.h"

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace pdserve::testing {

std::string ReadFileOrEmpty(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

CommandResult RunShell(const std::string& command,
                       const std::string& directory) {
  // One output file per call: tests may run commands from several threads.
  static std::atomic<int> counter{0};
  const std::string out =
      (std::filesystem::temp_directory_path() /
       ("pdserve-shell." + std::to_string(::getpid()) + "." +
        std::to_string(counter.fetch_add(1)) + ".out"))
          .string();
  const std::string full =
      "cd '" + directory + "' && (" + command + ") > '" + out + "' 2>&1";
  const int status = std::system(full.c_str());
  CommandResult r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.output = ReadFileOrEmpty(out);
  std::filesystem::remove(out);
  return r;
}

}  // namespace pdserve::testing
