// Aborts that did not reach their decode worker (frozen, restarting, cut off
// from the router), sent again until the worker answers. Without this such a
// request holds its KV blocks until the worker's lease backstop runs out
// (about a minute): e.g. a request whose KV had all landed when its prefill
// stage died, so that no sink lease is left to end it.
//
// Thread-safety: Add may be called from any thread; one background thread
// retries, and stops with the object.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pdserve::router {

class AbortRetrier {
 public:
  // Sends one Abort of request `id` to the decode worker at `address`.
  using Send =
      std::function<absl::Status(const std::string& address, uint64_t id)>;

  // Retries every `every`; gives an abort up after `give_up_after` (the
  // worker's own lease has freed the request by then).
  AbortRetrier(Send send, absl::Duration every = absl::Seconds(1),
               absl::Duration give_up_after = absl::Minutes(3));
  ~AbortRetrier();
  AbortRetrier(const AbortRetrier&) = delete;
  AbortRetrier& operator=(const AbortRetrier&) = delete;

  // Whether an Abort that failed with `status` is worth sending again: the
  // worker did not answer (UNAVAILABLE, DEADLINE_EXCEEDED).
  static bool WorthRetrying(const absl::Status& status);
  void Add(const std::string& address, uint64_t id);
  // Aborts not yet answered (waiting or being sent).
  size_t pending() const;

 private:
  struct Pending {
    std::string address;
    uint64_t id = 0;
    absl::Time first_failed;
  };
  void Loop();

  const Send send_;
  const absl::Duration every_;
  const absl::Duration give_up_after_;
  mutable absl::Mutex mu_;
  std::vector<Pending> pending_ ABSL_GUARDED_BY(mu_);
  size_t sending_ ABSL_GUARDED_BY(mu_) = 0;  // taken out for this round
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace pdserve::router
