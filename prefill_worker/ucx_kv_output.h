// A stage's KV output over the UCX transport: every chunk's KV of the stage's
// layers goes into the decode ranks' granted blocks through a
// transport::KvSource (one-sided puts, flushed before the sink is told).
//
// Threads: Write (stage thread) adds the request's grants on its first write
// and issues the puts without waiting; one completion thread waits for the
// transfers in issue order (each wait bounded) and calls `done`, so the stage
// computes the next microbatch while the bytes move.
#pragma once

#include <memory>
#include <thread>

#include "absl/time/time.h"
#include "prefill_worker/closable_queue.h"
#include "prefill_worker/kv_output.h"
#include "transport/kv_transfer.h"

namespace pdserve::prefill {

class UcxKvOutput : public StageKvOutput {
 public:
  // `source` (not owned) reads from the stage's pool and is connected to the
  // sinks already; it must outlive this object.
  explicit UcxKvOutput(transport::KvSource* source,
                       absl::Duration write_timeout = absl::Seconds(30));
  // Waits (bounded) for the writes in flight and calls their `done`.
  ~UcxKvOutput() override;
  UcxKvOutput(const UcxKvOutput&) = delete;
  UcxKvOutput& operator=(const UcxKvOutput&) = delete;

  void Write(const KvWrite& write,
             std::function<void(absl::Status)> done) override;

 private:
  struct InFlight {
    uint64_t request_id = 0;
    bool final_chunk = false;
    std::shared_ptr<transport::OpHandle> handle;
    std::function<void(absl::Status)> done;
  };
  void WaitLoop();

  transport::KvSource* const source_;
  const absl::Duration write_timeout_;
  ClosableQueue<InFlight> in_flight_;
  std::thread waiter_;
};

}  // namespace pdserve::prefill
