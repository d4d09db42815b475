// Where requests wait, in arrival order, for a decode worker with KV room,
// instead of being refused while the cluster is full (what vLLM and SGLang
// users expect of an overloaded server).
//
// Why here and not in the decode worker's scheduler: a decode worker's
// Admit answers at once with the KV grants a prefill group needs, so a
// request that does not fit must wait before Admit — and only the router
// sees every decode worker, can send the head of the line to whichever frees
// room first, and keeps arrival order across them.
//
// The line is FIFO: only its head tries to admit; a head refused for lack of
// KV (RESOURCE_EXHAUSTED from every candidate) waits for a request of this
// router to end, or for `recheck` (room can also free elsewhere: another
// router's requests, a lease), and tries again; the next request waits
// behind it. Admission is thus sized by the workers' KV, not by a fixed
// count. A request leaves the line once admitted, refused for another
// reason, cancelled, past its deadline, or after `max_wait` (then
// RESOURCE_EXHAUSTED: HTTP 429). A full line (`max_waiting`) refuses at once
// (429); "nothing healthy" stays UNAVAILABLE (503).
//
// Thread-safe: request threads block in it.
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pdserve::router {

struct AdmissionQueueOptions {
  int max_waiting = 1024;
  absl::Duration max_wait = absl::Seconds(60);
  absl::Duration recheck = absl::Milliseconds(50);
};

class AdmissionQueue {
 public:
  // Called with the line's length whenever it changes (a metrics gauge).
  using DepthObserver = std::function<void(int)>;
  explicit AdmissionQueue(AdmissionQueueOptions options,
                          DepthObserver on_depth = nullptr);
  AdmissionQueue(const AdmissionQueue&) = delete;
  AdmissionQueue& operator=(const AdmissionQueue&) = delete;

  // A request's place in line; destroying it leaves the line (the next one
  // becomes the head).
  class Place {
   public:
    ~Place();
    Place(const Place&) = delete;
    Place& operator=(const Place&) = delete;
    absl::Time joined() const { return joined_; }

   private:
    friend class AdmissionQueue;
    Place(AdmissionQueue* queue, std::list<uint64_t>::iterator it,
          absl::Time joined)
        : queue_(queue), it_(it), joined_(joined) {}
    AdmissionQueue* const queue_;
    const std::list<uint64_t>::iterator it_;
    const absl::Time joined_;
  };

  // Joins the end of the line; RESOURCE_EXHAUSTED when max_waiting requests
  // already wait.
  absl::StatusOr<std::unique_ptr<Place>> Join();

  // Blocks until `place` heads the line (OK), or returns
  // RESOURCE_EXHAUSTED after max_wait in line, DEADLINE_EXCEEDED at
  // `deadline`, CANCELLED once `cancelled()` (polled every recheck).
  absl::Status WaitForTurn(Place& place, absl::Time deadline,
                           const std::function<bool()>& cancelled);

  // The head was refused for lack of KV: waits for CapacityChanged() or the
  // recheck interval, then returns OK to try again — or the same errors as
  // WaitForTurn. `why` (the refusal) goes into a max_wait error.
  absl::Status WaitForCapacity(Place& place, absl::Time deadline,
                               const std::function<bool()>& cancelled,
                               const absl::Status& why);

  // A request of this router ended: its KV may be free now.
  void CapacityChanged();

  int waiting() const;
  const AdmissionQueueOptions& options() const { return options_; }

 private:
  void Leave(std::list<uint64_t>::iterator it);
  // The error for a wait that ended without its condition, or OK.
  absl::Status WaitError(const Place& place, absl::Time deadline,
                         const std::function<bool()>& cancelled,
                         const absl::Status& why) const;

  const AdmissionQueueOptions options_;
  const DepthObserver on_depth_;
  mutable absl::Mutex mu_;
  absl::CondVar changed_;
  std::list<uint64_t> line_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t capacity_epoch_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pdserve::router
