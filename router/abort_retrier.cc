#include "router/abort_retrier.h"

#include <utility>

#include "absl/time/clock.h"
#include "common/logging.h"

namespace pdserve::router {

AbortRetrier::AbortRetrier(Send send, absl::Duration every,
                           absl::Duration give_up_after)
    : send_(std::move(send)), every_(every), give_up_after_(give_up_after) {
  thread_ = std::thread([this] { Loop(); });
}

AbortRetrier::~AbortRetrier() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

bool AbortRetrier::WorthRetrying(const absl::Status& status) {
  return absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status);
}

void AbortRetrier::Add(const std::string& address, uint64_t id) {
  absl::MutexLock lock(&mu_);
  pending_.push_back({address, id, absl::Now()});
}

size_t AbortRetrier::pending() const {
  absl::MutexLock lock(&mu_);
  return pending_.size() + sending_;
}

void AbortRetrier::Loop() {
  while (true) {
    std::vector<Pending> batch;
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stop_), every_);
      if (stop_) return;
      batch.swap(pending_);
      sending_ = batch.size();
    }
    std::vector<Pending> keep;
    for (Pending& p : batch) {
      const absl::Status s = send_(p.address, p.id);
      if (!WorthRetrying(s)) continue;  // done (OK, or NOT_FOUND: gone)
      if (absl::Now() - p.first_failed >= give_up_after_) {
        PDS_LOG(WARNING) << "router: gave up aborting request " << p.id
                         << " on decode worker " << p.address << " after "
                         << absl::FormatDuration(give_up_after_) << ": " << s;
        continue;
      }
      keep.push_back(std::move(p));
    }
    absl::MutexLock lock(&mu_);
    pending_.insert(pending_.end(), std::make_move_iterator(keep.begin()),
                    std::make_move_iterator(keep.end()));
    sending_ = 0;
  }
}

}  // namespace pdserve::router
