// NCCL communicator: argument checks run everywhere; the collectives need a
// GPU and skip cleanly without one (label `gpu`).
#include "comm/nccl_communicator.h"

#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace pdserve::comm {
namespace {

TEST(NcclCommunicatorTest, RejectsBadArgumentsWithoutTouchingAGpu) {
  EXPECT_EQ(NcclCommunicator::Create("short", 0, 1, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::string id(128, '\0');
  EXPECT_EQ(NcclCommunicator::Create(id, 2, 2, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A device that is not there (none at all on a CPU machine).
  EXPECT_EQ(
      NcclCommunicator::Create(id, 0, 1, CudaDeviceCount()).status().code(),
      absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(NcclGroup::Create(2, {CudaDeviceCount()}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(NcclGroup::Create(0, {0}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(NcclCommunicatorTest, AllReduceSumsAcrossRanksOnEveryGpu) {
  const int devices = CudaDeviceCount();
  if (devices == 0) GTEST_SKIP() << "no CUDA device";
  const int size = std::min(devices, 4);
  std::vector<int> device_list;
  for (int d = 0; d < size; ++d) device_list.push_back(d);
  auto group = NcclGroup::Create(size, device_list);
  ASSERT_TRUE(group.ok()) << group.status();
  constexpr int kCount = 4099;  // not a multiple of anything NCCL likes
  std::vector<std::vector<float>> data(size, std::vector<float>(kCount));
  for (int r = 0; r < size; ++r) {
    for (int i = 0; i < kCount; ++i) data[r][i] = 0.5f * r + 0.25f * (i % 7);
  }
  std::vector<absl::Status> status(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back(
        [&, r] { status[r] = (*group)->rank(r)->AllReduceSum(data[r]); });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < size; ++r) {
    ASSERT_TRUE(status[r].ok()) << status[r];
    for (int i = 0; i < kCount; i += 97) {
      float want = 0;
      for (int q = 0; q < size; ++q) want += 0.5f * q + 0.25f * (i % 7);
      EXPECT_FLOAT_EQ(data[r][i], want) << "rank " << r << " index " << i;
    }
    EXPECT_EQ(data[r], data[0]) << "rank " << r << " differs from rank 0";
    EXPECT_GT((*group)->rank(r)->seconds_in_collectives(), 0);
  }
}

TEST(NcclCommunicatorTest, RanksSharingAGpuAreRefused) {
  // Without a GPU device 0 is missing; with one, two ranks would share it.
  // Both are FAILED_PRECONDITION, before NCCL is asked.
  auto group = NcclGroup::Create(2, {0});
  ASSERT_FALSE(group.ok());
  EXPECT_EQ(group.status().code(), absl::StatusCode::kFailedPrecondition);
  if (CudaDeviceCount() > 0) {
    EXPECT_NE(group.status().message().find("would share GPU 0"),
              std::string::npos)
        << group.status();
  }
}

TEST(NcclCommunicatorTest, ShutdownAbortsAndLaterCallsAreCancelled) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto group = NcclGroup::Create(1, {0});
  ASSERT_TRUE(group.ok()) << group.status();
  InProcessGroup& as_group = **group;  // what the decode worker holds
  std::vector<float> data = {1, 2};
  ASSERT_TRUE(as_group.rank(0)->AllReduceSum(data).ok());
  as_group.Shutdown();
  as_group.Shutdown();  // idempotent
  const absl::Status after = as_group.rank(0)->AllReduceSum(data);
  EXPECT_EQ(after.code(), absl::StatusCode::kCancelled) << after;
}

TEST(NcclCommunicatorTest, UniqueIdJoinsRanks) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto id = NcclCommunicator::NewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(id->size(), 128u);
  auto single = NcclCommunicator::Create(*id, 0, 1, 0);
  ASSERT_TRUE(single.ok()) << single.status();
  std::vector<float> data = {1, 2, 3};
  ASSERT_TRUE((*single)->AllReduceSum(data).ok());
  EXPECT_EQ(data, (std::vector<float>{1, 2, 3}));
}

}  // namespace
}  // namespace pdserve::comm
