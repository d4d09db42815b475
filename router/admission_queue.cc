#include "router/admission_queue.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace pdserve::router {

AdmissionQueue::AdmissionQueue(AdmissionQueueOptions options,
                               DepthObserver on_depth)
    : options_(options), on_depth_(std::move(on_depth)) {}

AdmissionQueue::Place::~Place() { queue_->Leave(it_); }

absl::StatusOr<std::unique_ptr<AdmissionQueue::Place>> AdmissionQueue::Join() {
  int depth = 0;
  std::list<uint64_t>::iterator it;
  {
    absl::MutexLock lock(&mu_);
    if (static_cast<int>(line_.size()) >= options_.max_waiting) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the router's admission queue is full (",
                       options_.max_waiting, " requests wait for KV room)"));
    }
    it = line_.insert(line_.end(), next_id_++);
    depth = static_cast<int>(line_.size());
  }
  if (on_depth_) on_depth_(depth);
  return std::unique_ptr<Place>(new Place(this, it, absl::Now()));
}

void AdmissionQueue::Leave(std::list<uint64_t>::iterator it) {
  int depth = 0;
  {
    absl::MutexLock lock(&mu_);
    line_.erase(it);
    depth = static_cast<int>(line_.size());
    changed_.SignalAll();
  }
  if (on_depth_) on_depth_(depth);
}

absl::Status AdmissionQueue::WaitError(const Place& place, absl::Time deadline,
                                       const std::function<bool()>& cancelled,
                                       const absl::Status& why) const {
  if (cancelled && cancelled()) return absl::CancelledError("cancelled");
  const absl::Time now = absl::Now();
  if (now >= deadline) {
    return absl::DeadlineExceededError(
        absl::StrCat("deadline exceeded waiting ",
                     absl::FormatDuration(now - place.joined()), " for KV room",
                     why.ok() ? "" : " (", why.message(), why.ok() ? "" : ")"));
  }
  if (now - place.joined() >= options_.max_wait) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "no KV room within ", absl::FormatDuration(options_.max_wait),
        " in the router's admission queue", why.ok() ? "" : ": ",
        why.message()));
  }
  return absl::OkStatus();
}

absl::Status AdmissionQueue::WaitForTurn(
    Place& place, absl::Time deadline, const std::function<bool()>& cancelled) {
  absl::MutexLock lock(&mu_);
  while (line_.front() != *place.it_) {
    mu_.Unlock();
    absl::Status error =
        WaitError(place, deadline, cancelled, absl::OkStatus());
    mu_.Lock();
    if (!error.ok()) return error;
    const absl::Time until =
        std::min({deadline, place.joined() + options_.max_wait,
                  absl::Now() + options_.recheck});
    changed_.WaitWithDeadline(&mu_, until);
  }
  return absl::OkStatus();
}

absl::Status AdmissionQueue::WaitForCapacity(
    Place& place, absl::Time deadline, const std::function<bool()>& cancelled,
    const absl::Status& why) {
  {
    absl::MutexLock lock(&mu_);
    const uint64_t epoch = capacity_epoch_;
    const absl::Time until =
        std::min({deadline, place.joined() + options_.max_wait,
                  absl::Now() + options_.recheck});
    while (capacity_epoch_ == epoch && absl::Now() < until) {
      changed_.WaitWithDeadline(&mu_, until);
    }
  }
  return WaitError(place, deadline, cancelled, why);
}

void AdmissionQueue::CapacityChanged() {
  absl::MutexLock lock(&mu_);
  ++capacity_epoch_;
  changed_.SignalAll();
}

int AdmissionQueue::waiting() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(line_.size());
}

}  // namespace pdserve::router
