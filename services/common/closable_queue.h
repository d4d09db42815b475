// A FIFO that producers can close: Pop blocks until an item arrives or the
// queue is closed and drained. How threads hand work to each other (the
// decode scheduler to its TP ranks, the prefill coordinator to its stages).
#pragma once

#include <deque>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace pdserve {

template <typename T>
class ClosableQueue {
 public:
  // False (item dropped) once closed.
  bool Push(T item) {
    absl::MutexLock lock(&mu_);
    if (closed_) return false;
    items_.push_back(std::move(item));
    return true;
  }
  // Blocks; nullopt once closed and empty.
  std::optional<T> Pop() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](ClosableQueue* q) ABSL_SHARED_LOCKS_REQUIRED(q->mu_) {
          return q->closed_ || !q->items_.empty();
        },
        this));
    if (items_.empty()) return std::nullopt;
    T item = std::move(items_.front());
    items_.pop_front();
    return item;
  }
  void Close() {
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }
  size_t size() const {
    absl::MutexLock lock(&mu_);
    return items_.size();
  }

 private:
  mutable absl::Mutex mu_;
  std::deque<T> items_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace pdserve
