#include "comm/communicator.h"

#include <gtest/gtest.h>

#include <thread>

namespace pdserve::comm {
namespace {

TEST(InProcessGroupTest, AllReduceSumsAcrossRanksIdentically) {
  for (int size : {1, 2, 3, 4, 8}) {
    auto group = InProcessGroup::Create(size);
    ASSERT_TRUE(group.ok());
    std::vector<std::vector<float>> data(size);
    std::vector<std::thread> threads;
    for (int r = 0; r < size; ++r) {
      threads.emplace_back([&, r] {
        for (int round = 0; round < 20; ++round) {
          // Sizes vary by round to exercise growth of the shared buffer.
          const int n = 1 + round * 37;
          data[r].assign(n, 0.0f);
          for (int i = 0; i < n; ++i) data[r][i] = 0.1f * (r + 1) + i;
          ASSERT_TRUE((*group)->rank(r)->AllReduceSum(data[r]).ok());
          for (int i = 0; i < n; ++i) {
            float expected = 0;
            for (int k = 0; k < size; ++k) expected += 0.1f * (k + 1) + i;
            ASSERT_NEAR(data[r][i], expected, 1e-3 * std::abs(expected) + 1e-4);
          }
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 1; r < size; ++r) EXPECT_EQ(data[r], data[0]);
  }
}

TEST(InProcessGroupTest, SizeMismatchIsAnErrorOnEveryRank) {
  auto group = InProcessGroup::Create(2);
  ASSERT_TRUE(group.ok());
  absl::Status status[2];
  std::thread t0([&] {
    std::vector<float> v(4, 1.0f);
    status[0] = (*group)->rank(0)->AllReduceSum(v);
  });
  std::thread t1([&] {
    std::vector<float> v(5, 1.0f);
    status[1] = (*group)->rank(1)->AllReduceSum(v);
  });
  t0.join();
  t1.join();
  EXPECT_EQ(status[0].code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status[1].code(), absl::StatusCode::kInvalidArgument);
}

TEST(InProcessGroupTest, ShutdownWakesABlockedRank) {
  auto group = InProcessGroup::Create(2);
  ASSERT_TRUE(group.ok());
  absl::Status status;
  std::thread waiter([&] {
    std::vector<float> v(3, 1.0f);
    status = (*group)->rank(0)->AllReduceSum(v);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  (*group)->Shutdown();
  waiter.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled);
}

TEST(InProcessGroupTest, InvalidSizeIsRejected) {
  EXPECT_FALSE(InProcessGroup::Create(0).ok());
  EXPECT_FALSE(InProcessGroup::Create(-3).ok());
}

}  // namespace
}  // namespace pdserve::comm
