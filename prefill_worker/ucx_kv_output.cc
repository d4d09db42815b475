#include "prefill_worker/ucx_kv_output.h"

#include <vector>

namespace pdserve::prefill {

UcxKvOutput::UcxKvOutput(transport::KvSource* source,
                         absl::Duration write_timeout)
    : source_(source), write_timeout_(write_timeout) {
  waiter_ = std::thread([this] { WaitLoop(); });
}

UcxKvOutput::~UcxKvOutput() {
  in_flight_.Close();
  if (waiter_.joinable()) waiter_.join();
}

void UcxKvOutput::Write(const KvWrite& write,
                        std::function<void(absl::Status)> done) {
  for (const std::string& grant : write.grants) {
    if (absl::Status s = source_->AddGrant(grant); !s.ok()) {
      done(s);
      return;
    }
  }
  std::vector<int64_t> blocks(write.block_table.begin(),
                              write.block_table.end());
  auto handle =
      source_->Write(write.request_id, blocks, write.layer_begin,
                     write.layer_end, write.token_begin, write.token_end);
  if (!handle.ok()) {
    done(handle.status());
    return;
  }
  InFlight item{write.request_id, write.final_chunk, std::move(*handle),
                std::move(done)};
  if (!in_flight_.Push(std::move(item))) {
    // Only after destruction began; the caller is shutting down too.
    return;
  }
}

void UcxKvOutput::WaitLoop() {
  while (std::optional<InFlight> item = in_flight_.Pop()) {
    absl::Status status = item->handle->Wait(write_timeout_);
    // The request's grants are no longer needed once its last write landed.
    if (item->final_chunk) source_->Forget(item->request_id);
    item->done(status);
  }
}

}  // namespace pdserve::prefill
