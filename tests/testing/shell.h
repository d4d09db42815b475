// Running outside tools (npm setup scripts, node references, promtool) from a
// test: one shell command, its exit code and its combined output.
#pragma once

#include <string>

namespace pdserve::testing {

struct CommandResult {
  int code = -1;       // exit status; -1 when it did not exit normally
  std::string output;  // stdout and stderr together
};

// Runs `command` with /bin/sh in `directory` (scripts are named from the
// source tree while ctest runs in the build tree).
CommandResult RunShell(const std::string& command,
                       const std::string& directory);

// A whole file's bytes; "" when it cannot be read.
std::string ReadFileOrEmpty(const std::string& path);

}  // namespace pdserve::testing
