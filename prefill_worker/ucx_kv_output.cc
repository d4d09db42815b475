#include "prefill_worker/ucx_kv_output.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace pdserve::prefill {

UcxKvOutput::UcxKvOutput(transport::KvSource* source,
                         absl::Duration write_timeout,
                         std::function<void(int64_t, double, bool)> on_transfer)
    : source_(source),
      write_timeout_(write_timeout),
      on_transfer_(std::move(on_transfer)) {
  waiter_ = std::thread([this] { WaitLoop(); });
}

UcxKvOutput::~UcxKvOutput() {
  in_flight_.Close();
  if (waiter_.joinable()) waiter_.join();
}

namespace {}  // namespace

absl::Status UcxKvOutput::AddGrants(std::span<const std::string> grants) {
  absl::MutexLock lock(&mu_);
  for (const std::string& grant : grants) {
    if (absl::Status s = source_->AddGrant(grant);
        !s.ok() && !absl::IsAlreadyExists(s)) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::Status UcxKvOutput::Cancel(uint64_t request_id,
                                 std::span<const std::string> grants) {
  absl::MutexLock lock(&mu_);
  for (const std::string& grant : grants) (void)source_->AddGrant(grant);
  tombstones_.Insert(request_id);
  return source_->Cancel(request_id);
}

void UcxKvOutput::Write(const KvWrite& write,
                        std::function<void(absl::Status)> done) {
  absl::ReleasableMutexLock lock(&mu_);
  if (tombstones_.Contains(write.request_id)) {
    lock.Release();
    done(absl::CancelledError(
        absl::StrCat("request ", write.request_id, " was cancelled")));
    return;
  }
  for (const std::string& grant : write.grants) {
    // ALREADY_EXISTS: stage 0 added it ahead (AddGrants).
    if (absl::Status s = source_->AddGrant(grant);
        !s.ok() && !absl::IsAlreadyExists(s)) {
      lock.Release();
      done(s);
      return;
    }
  }
  if (write.token_begin >= write.token_end) {
    lock.Release();
    done(absl::OkStatus());  // grants only: nothing of this chunk is sent
    return;
  }
  // The grant's token 0 is prompt position kv_dst_offset (a multiple of the
  // block size), so dropping that many leading source blocks lines the two
  // block lists up token for token.
  const int64_t block_size = write.pool->layout().block_size;
  const int64_t skip = write.kv_dst_offset / block_size;
  if (write.kv_dst_offset % block_size != 0 ||
      skip > static_cast<int64_t>(write.block_table.size()) ||
      write.token_begin < write.kv_dst_offset) {
    lock.Release();
    done(absl::InvalidArgumentError(
        absl::StrCat("KV destination offset ", write.kv_dst_offset,
                     " does not fit the write of positions [",
                     write.token_begin, ", ", write.token_end, ")")));
    return;
  }
  std::vector<int64_t> blocks(write.block_table.begin() + skip,
                              write.block_table.end());
  const kv::KvCacheLayout& layout = write.pool->layout();
  const int64_t bytes = int64_t{write.token_end - write.token_begin} *
                        (write.layer_end - write.layer_begin) * 2 *
                        layout.num_kv_heads * layout.head_dim *
                        static_cast<int64_t>(kv::KvDTypeSize(layout.dtype));
  const absl::Time issued = absl::Now();
  auto handle =
      source_->Write(write.request_id, blocks, write.layer_begin,
                     write.layer_end, write.token_begin - write.kv_dst_offset,
                     write.token_end - write.kv_dst_offset);
  lock.Release();
  if (!handle.ok()) {
    done(handle.status());
    return;
  }
  InFlight item{write.request_id,
                write.final_chunk,
                std::move(*handle),
                std::move(done),
                bytes,
                issued};
  if (!in_flight_.Push(std::move(item))) {
    // Only after destruction began; the caller is shutting down too.
    return;
  }
}

void UcxKvOutput::WaitLoop() {
  while (std::optional<InFlight> item = in_flight_.Pop()) {
    // Bounded from when the write was issued, not from when this thread
    // reaches it: writes complete in order, so behind a peer that stopped
    // progressing every queued write would otherwise wait write_timeout
    // afresh (8 in flight: 4 minutes before the last request heard).
    absl::Status status =
        item->handle->WaitUntil(item->issued + write_timeout_);
    if (on_transfer_) {
      on_transfer_(item->bytes,
                   absl::ToDoubleSeconds(absl::Now() - item->issued),
                   status.ok());
    }
    // The request's grants are no longer needed once its last write landed.
    if (item->final_chunk) source_->Forget(item->request_id);
    item->done(status);
  }
}

}  // namespace pdserve::prefill
