#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/float16.h"
#include "common/large_buffer.h"
#include "common/mapped_file.h"
#include "common/recent_ids.h"
#include "common/status_macros.h"
#include "common/thread_pool.h"

namespace pdserve {
namespace {

TEST(ThreadPoolTest, EveryTaskRunsExactlyOnce) {
  for (int threads : {1, 2, 4}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.num_threads(), threads);
    for (int64_t tasks : {0, 1, 3, 1000}) {
      std::vector<std::atomic<int>> hits(tasks);
      pool.ParallelFor(tasks, [&](int64_t t) { hits[t].fetch_add(1); });
      for (auto& h : hits) EXPECT_EQ(h.load(), 1);
    }
  }
}

TEST(ThreadPoolTest, RangesCoverWithoutOverlap) {
  ThreadPool pool(3);
  for (int64_t n : {1, 2, 7, 100}) {
    std::vector<int> cover(n);
    pool.ParallelRanges(
        n,
        [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) ++cover[i];
        },
        2);
    for (int c : cover) EXPECT_EQ(c, 1);
  }
}

TEST(ThreadPoolTest, ManyConsecutiveLoopsDoNotDeadlock) {
  ThreadPool pool(2);
  std::atomic<int64_t> sum{0};
  for (int round = 0; round < 2000; ++round) {
    pool.ParallelFor(4, [&](int64_t t) { sum.fetch_add(t); });
  }
  EXPECT_EQ(sum.load(), 2000 * 6);
}

// Workers poll for the next loop for a short while, then sleep: loops back
// to back (polling), loops after a pause longer than the poll (woken from
// sleep), and a pool destroyed while its workers still poll.
TEST(ThreadPoolTest, LoopsWhilePollingAfterSleepingAndAtDestruction) {
  for (int threads : {2, 4}) {
    std::atomic<int64_t> sum{0};
    {
      ThreadPool pool(threads);
      for (int round = 0; round < 40; ++round) {
        pool.ParallelFor(8, [&](int64_t t) { sum.fetch_add(t); });
        if (round % 4 == 3) {
          std::this_thread::sleep_for(std::chrono::microseconds(300));
        }
      }
    }
    EXPECT_EQ(sum.load(), 40 * 28);
    for (int i = 0; i < 20; ++i) {
      ThreadPool pool(threads);
      pool.ParallelFor(3, [&](int64_t t) { sum.fetch_add(t); });
    }
    EXPECT_EQ(sum.load(), 40 * 28 + 20 * 3);
  }
}

TEST(MappedFileTest, MapsContentsAndReportsMissingFiles) {
  char path[] = "/tmp/pdserve-mapped-XXXXXX";
  int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(write(fd, "hello", 5), 5);
  close(fd);
  auto file = MappedFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(file->bytes().data()),
                        file->size()),
            "hello");
  MappedFile moved = std::move(*file);
  EXPECT_EQ(moved.size(), 5u);
  unlink(path);

  auto missing = MappedFile::Open("/nonexistent/pdserve-file");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("/nonexistent/pdserve-file"),
            std::string::npos);
  auto folder = MappedFile::Open("/tmp");
  EXPECT_EQ(folder.status().code(), absl::StatusCode::kInvalidArgument);
}

// Kilobytes of the mapping that starts at `start` backed by huge pages
// (/proc/self/smaps' AnonHugePages), -1 when no mapping starts there.
long AnonHugeKilobytes(const void* start) {
  std::ifstream smaps("/proc/self/smaps");
  std::ostringstream prefix;
  prefix << std::hex << reinterpret_cast<uintptr_t>(start) << "-";
  std::string line;
  bool in_mapping = false;
  while (std::getline(smaps, line)) {
    if (line.rfind(prefix.str(), 0) == 0) {
      in_mapping = true;
    } else if (in_mapping && line.rfind("AnonHugePages:", 0) == 0) {
      return std::stol(line.substr(line.find(':') + 1));
    }
  }
  return -1;
}

TEST(LargeBufferTest, SmallBuffersArePageAlignedZeroedAndNotAdvised) {
  auto empty = LargeBuffer::Allocate(0);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->data(), nullptr);
  auto small = LargeBuffer::Allocate(5000);
  ASSERT_TRUE(small.ok()) << small.status();
  ASSERT_NE(small->data(), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(small->data()) % sysconf(_SC_PAGESIZE),
            0u);
  EXPECT_EQ(small->size(), 5000u);
  EXPECT_FALSE(small->huge_pages_advised());
  const auto* bytes = static_cast<const unsigned char*>(small->data());
  EXPECT_TRUE(std::all_of(bytes, bytes + 5000, [](auto b) { return b == 0; }));
  EXPECT_EQ(LargeBuffer::Allocate(SIZE_MAX).status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(LargeBufferTest, LargeBuffersStartOnAHugePageAndGetHugePages) {
  ASSERT_TRUE(HugePagesWanted());
  const size_t bytes = 3 * LargeBuffer::kHugePageBytes + 12345;
  auto buffer = LargeBuffer::Allocate(bytes);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_EQ(
      reinterpret_cast<uintptr_t>(buffer->data()) % LargeBuffer::kHugePageBytes,
      0u);
  EXPECT_EQ(buffer->huge_pages_advised(), TransparentHugePagesAvailable());
  auto* bytes_out = static_cast<unsigned char*>(buffer->data());
  EXPECT_TRUE(
      std::all_of(bytes_out, bytes_out + bytes, [](auto b) { return b == 0; }));
  std::fill(bytes_out, bytes_out + bytes, 7);  // every byte is writable
  if (TransparentHugePagesAvailable()) {
    // The three whole 2 MiB ranges; the last 12345 bytes sit in small
    // pages. The kernel may fall back to small pages when it has no free
    // 2 MiB frame, which a machine with GBs free does not run out of.
    EXPECT_GT(AnonHugeKilobytes(buffer->data()), 0);
  }
  LargeBuffer moved = std::move(*buffer);
  EXPECT_EQ(buffer->data(), nullptr);
  EXPECT_EQ(moved.size(), bytes);
  EXPECT_EQ(static_cast<unsigned char*>(moved.data())[bytes - 1], 7);
}

TEST(LargeBufferTest, SwitchedOffLargeBuffersKeepSmallPages) {
  SetHugePagesWanted(false);
  auto buffer = LargeBuffer::Allocate(3 * LargeBuffer::kHugePageBytes);
  SetHugePagesWanted(true);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_FALSE(buffer->huge_pages_advised());
  auto* bytes = static_cast<unsigned char*>(buffer->data());
  std::fill(bytes, bytes + buffer->size(), 1);
  std::ifstream mode("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string modes;
  std::getline(mode, modes);
  // Under THP `always` the kernel backs aligned ranges unasked.
  if (modes.find("[always]") == std::string::npos) {
    EXPECT_EQ(AnonHugeKilobytes(buffer->data()), 0);
  }
}

TEST(Float16Test, RoundTripsAndSpecialValues) {
  for (float v : {0.0f, -0.0f, 1.0f, -2.5f, 65504.0f, 6.103515625e-05f,
                  5.960464477539063e-08f}) {
    EXPECT_EQ(F16ToFloat(FloatToF16(v)), v) << v;
  }
  EXPECT_TRUE(std::isinf(F16ToFloat(FloatToF16(1e6f))));
  EXPECT_TRUE(std::isnan(
      F16ToFloat(FloatToF16(std::numeric_limits<float>::quiet_NaN()))));
  for (float v : {0.0f, 1.0f, -3.0f, std::ldexp(1.5f, 100)})
    EXPECT_EQ(Bf16ToFloat(FloatToBf16(v)), v) << v;
  // Round to nearest even: 1 + 2^-8 is halfway between two bf16 values.
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + 1.0f / 256)), 1.0f);
  EXPECT_TRUE(std::isnan(
      Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
}

absl::StatusOr<int> Half(int x) {
  if (x % 2) return absl::InvalidArgumentError("odd");
  return x / 2;
}

absl::Status Quarter(int x, int* out) {
  PDS_ASSIGN_OR_RETURN(int half, Half(x));
  PDS_ASSIGN_OR_RETURN(*out, Half(half));
  PDS_RETURN_IF_ERROR(absl::OkStatus());
  return absl::OkStatus();
}

TEST(StatusMacrosTest, PropagateErrorsAndAssignValues) {
  int out = 0;
  EXPECT_TRUE(Quarter(8, &out).ok());
  EXPECT_EQ(out, 2);
  EXPECT_EQ(Quarter(6, &out).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdserve

namespace pdserve {
namespace {

TEST(RecentIdsTest, BoundedInCountAndAge) {
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  RecentIds ids(3, absl::Seconds(10));
  EXPECT_TRUE(ids.Insert(1, t0));
  EXPECT_FALSE(ids.Insert(1, t0));  // known
  EXPECT_TRUE(ids.Insert(2, t0));
  EXPECT_TRUE(ids.Insert(3, t0));
  EXPECT_TRUE(ids.Insert(4, t0));  // over capacity: the oldest goes
  EXPECT_FALSE(ids.Contains(1));
  EXPECT_TRUE(ids.Contains(2) && ids.Contains(3) && ids.Contains(4));
  // Erased, then remembered again: the old entry does not take it away.
  EXPECT_TRUE(ids.Erase(2));
  EXPECT_FALSE(ids.Erase(2));
  EXPECT_TRUE(ids.Insert(2, t0 + absl::Seconds(5)));
  EXPECT_TRUE(ids.Insert(5, t0 + absl::Seconds(5)));
  EXPECT_TRUE(ids.Contains(2));
  // Past their age the first ones are gone; the later ones stay.
  EXPECT_TRUE(ids.Insert(6, t0 + absl::Seconds(11)));
  EXPECT_FALSE(ids.Contains(3));
  EXPECT_FALSE(ids.Contains(4));
  EXPECT_TRUE(ids.Contains(2) && ids.Contains(5) && ids.Contains(6));
  EXPECT_LE(ids.size(), 3u);
  // A flood of erased ids leaves the structure bounded.
  RecentIds churn(4);
  for (uint64_t i = 0; i < 10000; ++i) {
    churn.Insert(i, t0);
    churn.Erase(i);
  }
  EXPECT_EQ(churn.size(), 0u);
}

}  // namespace
}  // namespace pdserve
