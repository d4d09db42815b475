// Pipeline links across processes over the UCX transport's ordered messages:
// microbatches (chunk headers + hidden states) from stage i to stage i+1, and
// StageEvents from stages 1..S−1 back to the coordinator in stage 0's
// process. Messages on one endpoint arrive in send order, which is what keeps
// a request's chunks in order at every stage.
//
// Wire format (little-endian, bounds-checked on decode; a malformed blob is
// INVALID_ARGUMENT, never a crash): see EncodeStageMessage / EncodeStageEvent.
//
// Threads: a receiver's message handler runs on its worker's progress thread
// and only decodes and pushes onto a closable queue (or into the event sink,
// which never blocks).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/closable_queue.h"
#include "prefill/stage_link.h"
#include "transport/ucx_worker.h"

namespace pdserve::prefill {

// Transport message kinds of the prefill pipeline (the transport's own KV
// kinds are 0x4bxx).
inline constexpr uint16_t kStageMessageKind = 0x5001;
inline constexpr uint16_t kStageEventKind = 0x5002;

std::string EncodeStageMessage(const StageMessage& message);
[[nodiscard]] absl::StatusOr<StageMessage> DecodeStageMessage(
    std::string_view blob);
std::string EncodeStageEvent(const StageEvent& event);
[[nodiscard]] absl::StatusOr<StageEvent> DecodeStageEvent(
    std::string_view blob);

// Sends microbatches to the next stage's worker. Send does not wait for the
// bytes to leave; a failed earlier send is returned by the next Send.
class UcxStageSender : public StageSender {
 public:
  explicit UcxStageSender(std::shared_ptr<transport::UcxEndpoint> endpoint);
  absl::Status Send(StageMessage message) override;
  // Sends the end-of-stream marker; the receiver then drains and ends.
  void Close() override;

 private:
  absl::Status CollectFinished();
  std::shared_ptr<transport::UcxEndpoint> endpoint_;
  std::vector<std::shared_ptr<transport::OpHandle>> pending_;
  bool closed_ = false;
};

// Receives microbatches on `worker` (one receiver per worker). Malformed
// messages are dropped and counted.
class UcxStageReceiver : public StageReceiver {
 public:
  explicit UcxStageReceiver(transport::UcxWorker* worker);
  ~UcxStageReceiver() override;
  std::optional<StageMessage> Receive() override;
  // Ends the stream locally (shutdown without a peer).
  void Close() { queue_.Close(); }
  int64_t malformed() const;

 private:
  transport::UcxWorker* const worker_;
  ClosableQueue<StageMessage> queue_;
  mutable absl::Mutex mu_;
  int64_t malformed_ ABSL_GUARDED_BY(mu_) = 0;
};

// A stage's StageEventSink that forwards to the coordinator's process.
class UcxEventSender : public StageEventSink {
 public:
  explicit UcxEventSender(std::shared_ptr<transport::UcxEndpoint> endpoint)
      : endpoint_(std::move(endpoint)) {}
  void Report(StageEvent event) override;

 private:
  std::shared_ptr<transport::UcxEndpoint> endpoint_;
};

// Delivers events arriving on `worker` to `target` (the coordinator) until
// destroyed.
class UcxEventReceiver {
 public:
  UcxEventReceiver(transport::UcxWorker* worker, StageEventSink* target);
  ~UcxEventReceiver();
  UcxEventReceiver(const UcxEventReceiver&) = delete;
  UcxEventReceiver& operator=(const UcxEventReceiver&) = delete;

 private:
  transport::UcxWorker* const worker_;
};

}  // namespace pdserve::prefill
