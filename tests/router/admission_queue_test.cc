// The router's admission queue (router/admission_queue.h): arrival order,
// its bounds (a full line, max_wait, the request's deadline, cancellation)
// with their codes, and a head that was refused for lack of KV woken as soon
// as a request ends.
#include "router/admission_queue.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace pdserve::router {
namespace {

const auto kNever = [] { return false; };

TEST(AdmissionQueueTest, HeadsOfTheLineComeInArrivalOrder) {
  AdmissionQueueOptions options;
  options.recheck = absl::Milliseconds(5);
  AdmissionQueue queue(options);
  // The first place holds the head while the others line up behind it.
  auto first = queue.Join();
  ASSERT_TRUE(first.ok());
  absl::Mutex mu;
  std::vector<int> order;
  std::vector<std::thread> threads;
  for (int i = 0; i < 5; ++i) {
    // Join in a known order, then wait on separate threads.
    auto place = queue.Join();
    ASSERT_TRUE(place.ok());
    threads.emplace_back([&, i, p = std::move(place).value()]() mutable {
      ASSERT_TRUE(queue.WaitForTurn(*p, absl::InfiniteFuture(), kNever).ok());
      {
        absl::MutexLock lock(&mu);
        order.push_back(i);
      }
      absl::SleepFor(absl::Milliseconds(2));
      p.reset();  // the next one's turn
    });
  }
  EXPECT_EQ(queue.waiting(), 6);
  ASSERT_TRUE(queue.WaitForTurn(**first, absl::InfiniteFuture(), kNever).ok());
  absl::SleepFor(absl::Milliseconds(20));
  {
    absl::MutexLock lock(&mu);
    EXPECT_TRUE(order.empty()) << "nobody passes the head";
  }
  first->reset();
  for (auto& t : threads) t.join();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4}));
  EXPECT_EQ(queue.waiting(), 0);
}

TEST(AdmissionQueueTest, FullLineRefusesAtOnceAndReportsDepth) {
  AdmissionQueueOptions options;
  options.max_waiting = 2;
  std::atomic<int> depth{-1};
  AdmissionQueue queue(options, [&](int d) { depth = d; });
  auto a = queue.Join();
  auto b = queue.Join();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(depth, 2);
  auto c = queue.Join();
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(c.status().message().find("admission queue is full"),
            std::string::npos);
  a->reset();
  EXPECT_EQ(depth, 1);
}

TEST(AdmissionQueueTest, WaitsEndByMaxWaitDeadlineOrCancellation) {
  AdmissionQueueOptions options;
  options.max_wait = absl::Milliseconds(100);
  options.recheck = absl::Milliseconds(5);
  AdmissionQueue queue(options);
  auto head = queue.Join();
  ASSERT_TRUE(head.ok());
  {
    auto behind = queue.Join();
    ASSERT_TRUE(behind.ok());
    const absl::Time start = absl::Now();
    const absl::Status s =
        queue.WaitForTurn(**behind, absl::InfiniteFuture(), kNever);
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
    EXPECT_GE(absl::Now() - start, absl::Milliseconds(90));
  }
  {
    auto behind = queue.Join();
    ASSERT_TRUE(behind.ok());
    const absl::Status s = queue.WaitForTurn(
        **behind, absl::Now() + absl::Milliseconds(20), kNever);
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  }
  {
    auto behind = queue.Join();
    ASSERT_TRUE(behind.ok());
    const absl::Status s = queue.WaitForTurn(**behind, absl::InfiniteFuture(),
                                             [] { return true; });
    EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
  }
  // The head refused for lack of KV: max_wait ends it with the refusal.
  const absl::Status no_room = absl::ResourceExhaustedError("KV full");
  absl::Status s;
  while ((s = queue.WaitForCapacity(**head, absl::InfiniteFuture(), kNever,
                                    no_room))
             .ok()) {
  }
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("KV full"), std::string::npos) << s;
}

TEST(AdmissionQueueTest, ARequestEndingWakesTheRefusedHead) {
  AdmissionQueueOptions options;
  options.recheck = absl::Seconds(10);  // only CapacityChanged wakes it
  AdmissionQueue queue(options);
  auto head = queue.Join();
  ASSERT_TRUE(head.ok());
  std::thread ender([&] {
    absl::SleepFor(absl::Milliseconds(50));
    queue.CapacityChanged();
  });
  const absl::Time start = absl::Now();
  EXPECT_TRUE(queue
                  .WaitForCapacity(**head, absl::InfiniteFuture(), kNever,
                                   absl::ResourceExhaustedError("full"))
                  .ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  ender.join();
}

}  // namespace
}  // namespace pdserve::router
