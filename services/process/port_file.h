// Port files: a server started with port 0 writes the "host:port" it bound to
// a file, so a launcher learns the address without parsing logs.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace pdserve::process {

class ChildProcess;

// Writes `text` + "\n" to `path` atomically (a temporary file renamed into
// place), so a reader polling for the file never sees half of it. An empty
// path is a no-op.
[[nodiscard]] absl::Status WritePortFile(const std::string& path,
                                         const std::string& text);

// Polls for `path` until it holds a non-empty first line and returns that
// line. DEADLINE_EXCEEDED after `timeout`; FAILED_PRECONDITION as soon as
// `writer` (optional) has exited, since the file would then never come.
[[nodiscard]] absl::StatusOr<std::string> WaitForPortFile(
    const std::string& path, absl::Duration timeout,
    ChildProcess* writer = nullptr);

// The last `max_bytes` bytes of the file at `path` ("" when unreadable): for
// error messages that quote a process's log.
std::string ReadFileTail(const std::string& path, size_t max_bytes);

// A port free on 127.0.0.1 now for `socket_type` (SOCK_STREAM or
// SOCK_DGRAM): bound to port 0 and read back. Another process may take it
// before the caller binds it; good enough for loopback tests and launchers.
[[nodiscard]] absl::StatusOr<int> FreeLoopbackPort(int socket_type);

}  // namespace pdserve::process
