// AbortRetrier: aborts the decode worker did not answer are sent again until
// it answers (OK or NOT_FOUND), and given up after a bound.
#include "router/abort_retrier.h"

#include <gtest/gtest.h>

#include <atomic>
#include <map>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace pdserve::router {
namespace {

bool Eventually(const std::function<bool()>& condition,
                absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (condition()) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return condition();
}

TEST(AbortRetrierTest, RetriesUntilTheWorkerAnswers) {
  absl::Mutex mu;
  std::map<uint64_t, int> sends;
  AbortRetrier retrier(
      [&](const std::string& address, uint64_t id) {
        EXPECT_EQ(address, "decode-0:1");
        absl::MutexLock lock(&mu);
        const int n = ++sends[id];
        // Request 1: frozen for two tries, then aborted. Request 2: the
        // worker no longer knows it (restarted): done too.
        if (id == 1) {
          return n < 3 ? absl::UnavailableError("frozen") : absl::OkStatus();
        }
        return absl::NotFoundError("request 2 is not live");
      },
      absl::Milliseconds(20), absl::Minutes(1));
  retrier.Add("decode-0:1", 1);
  retrier.Add("decode-0:1", 2);
  EXPECT_TRUE(
      Eventually([&] { return retrier.pending() == 0; }, absl::Seconds(10)));
  absl::MutexLock lock(&mu);
  EXPECT_EQ(sends[1], 3);
  EXPECT_EQ(sends[2], 1);
}

TEST(AbortRetrierTest, GivesUpAfterItsBound) {
  std::atomic<int> sends{0};
  AbortRetrier retrier(
      [&](const std::string&, uint64_t) {
        ++sends;
        return absl::DeadlineExceededError("no answer");
      },
      absl::Milliseconds(10), absl::Milliseconds(100));
  retrier.Add("decode-0:1", 7);
  EXPECT_TRUE(
      Eventually([&] { return retrier.pending() == 0; }, absl::Seconds(10)));
  EXPECT_GE(sends.load(), 2);
  EXPECT_TRUE(AbortRetrier::WorthRetrying(absl::UnavailableError("")));
  EXPECT_FALSE(AbortRetrier::WorthRetrying(absl::NotFoundError("")));
  EXPECT_FALSE(AbortRetrier::WorthRetrying(absl::InvalidArgumentError("")));
}

}  // namespace
}  // namespace pdserve::router
