// Minimal leveled logging to stderr and fatal checks for impossible states.
// Bad input never reaches PDS_CHECK: it is reported through absl::Status.
#pragma once

#include <sstream>
#include <string_view>

namespace pdserve {

enum class LogLevel {
  kDebug = 0,
  kInfo = 1,
  kWarning = 2,
  kError = 3,
  kFatal = 4
};

// Messages below this level are dropped. Set from PDSERVE_LOG_LEVEL
// (debug|info|warning|error) on first use; default info.
LogLevel MinLogLevel();
void SetMinLogLevel(LogLevel level);

class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line);
  ~LogMessage();
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;
  std::ostream& stream() { return stream_; }

 private:
  LogLevel level_;
  std::ostringstream stream_;
};

// Swallows the stream expression when the level is disabled.
struct LogVoidify {
  void operator&(std::ostream&) {}
};

}  // namespace pdserve

#define PDS_LOG_LEVEL_DEBUG ::pdserve::LogLevel::kDebug
#define PDS_LOG_LEVEL_INFO ::pdserve::LogLevel::kInfo
#define PDS_LOG_LEVEL_WARNING ::pdserve::LogLevel::kWarning
#define PDS_LOG_LEVEL_ERROR ::pdserve::LogLevel::kError
#define PDS_LOG_LEVEL_FATAL ::pdserve::LogLevel::kFatal

#define PDS_LOG(level)                                                       \
  (PDS_LOG_LEVEL_##level < ::pdserve::MinLogLevel())                         \
      ? (void)0                                                              \
      : ::pdserve::LogVoidify() &                                            \
            ::pdserve::LogMessage(PDS_LOG_LEVEL_##level, __FILE__, __LINE__) \
                .stream()

#define PDS_CHECK(cond)                                                     \
  (cond) ? (void)0                                                          \
         : ::pdserve::LogVoidify() &                                        \
               ::pdserve::LogMessage(::pdserve::LogLevel::kFatal, __FILE__, \
                                     __LINE__)                              \
                       .stream()                                            \
                   << "Check failed: " #cond " "
