// In-process all-reduce: ranks publish their buffers, then each rank reduces a
// contiguous slice over all ranks (in rank order, so results are identical on
// every rank) into a shared result, then every rank copies the result back.
// Two barrier phases per collective; the next collective's publish barrier
// guarantees everyone finished copying the previous result.
#include <algorithm>
#include <chrono>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "comm/communicator.h"

namespace pdserve::comm {
namespace {

class GroupState;

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(GroupState* group, int rank)
      : group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override;
  absl::Status AllReduceSum(std::span<float> data) override;
  double seconds_in_collectives() const override { return seconds_; }

 private:
  GroupState* group_;
  int rank_;
  double seconds_ = 0;
};

class GroupState final : public InProcessGroup {
 public:
  explicit GroupState(int size) : size_(size), buffers_(size), sizes_(size) {
    for (int r = 0; r < size; ++r)
      ranks_.push_back(std::make_unique<InProcessCommunicator>(this, r));
  }
  Communicator* rank(int r) override { return ranks_[r].get(); }
  int size() const override { return size_; }
  void Shutdown() override {
    absl::MutexLock lock(&mu_);
    shutdown_ = true;
  }

  absl::Status AllReduce(int rank, std::span<float> data) {
    buffers_[rank] = data.data();
    sizes_[rank] = data.size();
    // The last rank to arrive checks sizes and grows the shared result while
    // everyone else is parked, so no rank reads a vector being resized.
    if (!Barrier([&] {
          sizes_match_ = std::all_of(sizes_.begin(), sizes_.end(),
                                     [&](size_t s) { return s == sizes_[0]; });
          if (sizes_match_ && result_.size() < sizes_[0])
            result_.resize(sizes_[0]);
        })) {
      return absl::CancelledError("communicator group shut down");
    }
    if (!sizes_match_) {
      size_t mine = data.size();
      // Pass the second barrier too so that no rank is left waiting.
      if (!Barrier([] {}))
        return absl::CancelledError("communicator group shut down");
      return absl::InvalidArgumentError(
          absl::StrCat("all-reduce size mismatch across ranks (rank ", rank,
                       " passed ", mine, " elements)"));
    }
    const size_t n = data.size();
    const size_t begin = n * rank / size_;
    const size_t end = n * (rank + 1) / size_;
    for (size_t i = begin; i < end; ++i) {
      float sum = buffers_[0][i];
      for (int r = 1; r < size_; ++r) sum += buffers_[r][i];
      result_[i] = sum;
    }
    if (!Barrier([] {}))
      return absl::CancelledError("communicator group shut down");
    std::copy(result_.begin(), result_.begin() + n, data.begin());
    return absl::OkStatus();
  }

 private:
  // Generation barrier; `on_last` runs (under the lock) in the last rank to
  // arrive, before anyone is released. Returns false if shut down.
  template <typename OnLast>
  bool Barrier(OnLast on_last) {
    absl::MutexLock lock(&mu_);
    if (shutdown_) return false;
    const uint64_t generation = generation_;
    if (++arrived_ == size_) {
      on_last();
      arrived_ = 0;
      ++generation_;
      return true;
    }
    auto released = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return generation_ != generation || shutdown_;
    };
    mu_.Await(absl::Condition(&released));
    return generation_ != generation;
  }

  const int size_;
  std::vector<std::unique_ptr<InProcessCommunicator>> ranks_;
  std::vector<float*> buffers_;
  std::vector<size_t> sizes_;
  std::vector<float> result_;
  bool sizes_match_ = true;  // written by the last arriver of a barrier
  absl::Mutex mu_;
  int arrived_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
};

int InProcessCommunicator::size() const { return group_->size(); }

absl::Status InProcessCommunicator::AllReduceSum(std::span<float> data) {
  if (group_->size() == 1) return absl::OkStatus();
  auto start = std::chrono::steady_clock::now();
  absl::Status status = group_->AllReduce(rank_, data);
  seconds_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  return status;
}

}  // namespace

absl::StatusOr<std::unique_ptr<InProcessGroup>> InProcessGroup::Create(
    int size) {
  if (size <= 0 || size > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid group size ", size));
  }
  return std::make_unique<GroupState>(size);
}

}  // namespace pdserve::comm
