// A stage's KV output over the UCX transport: every chunk's KV of the stage's
// layers goes into the decode ranks' granted blocks through a
// transport::KvSource (one-sided puts, flushed before the sink is told).
//
// Threads: Write (stage thread) adds the request's grants on its first write
// and issues the puts without waiting; one completion thread waits for the
// transfers in issue order (each until write_timeout after it was issued)
// and calls `done`, so the stage
// computes the next microbatch while the bytes move.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/closable_queue.h"
#include "common/recent_ids.h"
#include "prefill/kv_output.h"
#include "transport/kv_transfer.h"

namespace pdserve::prefill {

class UcxKvOutput : public StageKvOutput {
 public:
  // `source` (not owned) reads from the stage's pool and is connected to the
  // sinks already; it must outlive this object.
  // `on_transfer` (optional, see StageObserver::on_kv_transfer) runs on the
  // completion thread for every write that issued puts.
  explicit UcxKvOutput(
      transport::KvSource* source,
      absl::Duration write_timeout = absl::Seconds(30),
      std::function<void(int64_t, double, bool)> on_transfer = nullptr);
  // Waits (bounded) for the writes in flight and calls their `done`.
  ~UcxKvOutput() override;
  UcxKvOutput(const UcxKvOutput&) = delete;
  UcxKvOutput& operator=(const UcxKvOutput&) = delete;

  void Write(const KvWrite& write,
             std::function<void(absl::Status)> done) override;

  // Adds a request's grants ahead of its first write (stage 0 does, so that
  // a bad destination fails the submit, not the first chunk): the transport's
  // error for a malformed grant, one from an unconnected sink or naming
  // blocks outside it. Grants already added are skipped by Write.
  [[nodiscard]] absl::Status AddGrants(std::span<const std::string> grants);

  // Revokes the request at its sinks (KvSource::Cancel) and refuses its later
  // writes (CANCELLED): chunks already on their way through the pipeline
  // must not re-add the grants and write into blocks the decode side is
  // freeing. `grants` (optional) are re-added first, so that the sinks hear
  // the cancel even when this source already forgot the request (its own
  // writes landed) or never had it. NOT_FOUND if no grant is known.
  [[nodiscard]] absl::Status Cancel(uint64_t request_id,
                                    std::span<const std::string> grants = {});
  // Drops grants added ahead for a request that never ran.
  void Forget(uint64_t request_id) { source_->Forget(request_id); }

 private:
  struct InFlight {
    uint64_t request_id = 0;
    bool final_chunk = false;
    std::shared_ptr<transport::OpHandle> handle;
    std::function<void(absl::Status)> done;
    int64_t bytes = 0;
    absl::Time issued;
  };
  void WaitLoop();

  transport::KvSource* const source_;
  const absl::Duration write_timeout_;
  const std::function<void(int64_t, double, bool)> on_transfer_;
  // Serializes Write against Cancel, so that a write either precedes the
  // cancel (and the sink's revoke flushes it) or sees the tombstone.
  absl::Mutex mu_;
  // Cancelled ids, oldest first; bounded (a straggler chunk arrives within
  // the pipeline depth, long before 4096 later cancels).
  RecentIds tombstones_ ABSL_GUARDED_BY(mu_){4096};
  ClosableQueue<InFlight> in_flight_;
  std::thread waiter_;
};

}  // namespace pdserve::prefill
