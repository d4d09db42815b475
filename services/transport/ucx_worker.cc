#include "transport/ucx_worker.h"

#include <poll.h>
#include <ucp/api/ucp.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "transport/wire.h"

namespace pdserve::transport {
namespace {

constexpr uint32_t kAddressMagic = 0x50445741;  // "PDWA"
constexpr uint32_t kRegionMagic = 0x50445252;   // "PDRR"
// One UCX active-message id carries every pdserve message; the message kind
// travels in our header, so handlers can be added without UCX coordination.
constexpr unsigned kAmId = 17;

// Header of every message: who sent it on which of its endpoints, and the
// position in that endpoint's stream (messages are delivered by seq).
struct WireHeader {
  uint64_t sender_uid;
  uint64_t ep_id;
  uint64_t seq;
  uint16_t kind;
};

absl::Status UcsError(absl::string_view what, ucs_status_t status) {
  return absl::UnavailableError(
      absl::StrCat(what, ": ", ucs_status_string(status)));
}

// Captures what a ucp_*_print_info routine writes.
template <typename Fn>
std::string CaptureInfo(Fn fn) {
  char* buf = nullptr;
  size_t len = 0;
  FILE* f = open_memstream(&buf, &len);
  if (f == nullptr) return "";
  fn(f);
  std::fclose(f);
  std::string out(buf, len);
  std::free(buf);
  return out;
}

struct ConfigDeleter {
  void operator()(ucp_config_t* c) const { ucp_config_release(c); }
};

}  // namespace

// ---------------------------------------------------------------------------
// Impl
// ---------------------------------------------------------------------------

struct detail::WorkerCore {
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  int efd = -1;
  // With peer error handling off, messages travel on a second worker of
  // its own context restricted to tcp, with peer error handling on (null
  // otherwise: messages share `worker`). UCX's shared-memory transport gives
  // each receiver one FIFO whose slots every sender claims before writing
  // them: a sender killed between the claim and marking the slot written
  // leaves the receiver waiting on that slot for good, deaf to every other
  // peer (a decode worker to every prefill stage). Over tcp each peer has
  // its own socket, a dead one fails alone, and the failure is reported.
  // Puts stay on `worker`: shared memory, no target CPU involved.
  ucp_context_h control_context = nullptr;
  ucp_worker_h control_worker = nullptr;
  int control_efd = -1;
  // What each worker's active-message callback is given.
  struct AmTarget {
    WorkerCore* core;
    ucp_worker_h worker;
  };
  AmTarget data_target{}, control_target{};
  uint64_t uid = 0;
  absl::Duration tick;
  bool peer_error_handling = true;

  // Serializes every UCP call on this worker (UCS_THREAD_MODE_SERIALIZED).
  absl::Mutex mu;
  // The UcxWorker was destroyed: context and worker are gone, everything
  // still holding this core does nothing.
  bool destroyed ABSL_GUARDED_BY(mu) = false;
  // Live UCX objects, released by ~UcxWorker if their owners outlive it
  // (ucp_cleanup asserts on registrations still in use).
  std::set<ucp_mem_h> memhs ABSL_GUARDED_BY(mu);
  // UCX-allocated regions by base address: {length, handle}.
  std::map<uintptr_t, std::pair<size_t, ucp_mem_h>> allocations
      ABSL_GUARDED_BY(mu);
  std::set<ucp_rkey_h> rkeys ABSL_GUARDED_BY(mu);
  std::set<ucp_ep_h> eps ABSL_GUARDED_BY(mu);

  // Progresses both workers; nonzero when either did something.
  unsigned Progress() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    unsigned n = ucp_worker_progress(worker);
    if (control_worker != nullptr) n += ucp_worker_progress(control_worker);
    return n;
  }

  // Force-closes an endpoint, bounded.
  void CloseEp(ucp_ep_h ep) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (ep == nullptr) return;
    eps.erase(ep);
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t req = ucp_ep_close_nbx(ep, &p);
    if (req != nullptr && !UCS_PTR_IS_ERR(req)) {
      // A forced close finishes locally; bound the wait anyway.
      absl::Time deadline = absl::Now() + absl::Seconds(2);
      while (ucp_request_check_status(req) == UCS_INPROGRESS &&
             absl::Now() < deadline) {
        Progress();
      }
      ucp_request_free(req);
    }
  }
  // Work that needs UCP but must not run inside a UCX callback.
  std::vector<std::function<void()>> locked_tasks ABSL_GUARDED_BY(mu);
  uint64_t next_ep_id ABSL_GUARDED_BY(mu) = 1;

  // Receive side of the ordered message streams, keyed by (sender, ep).
  struct Incoming {
    bool ready = false;
    bool failed = false;
    uint16_t kind = 0;
    std::string payload;
  };
  struct Stream {
    uint64_t next_seq = 0;
    std::map<uint64_t, Incoming> pending;
  };
  std::map<std::pair<uint64_t, uint64_t>, Stream> streams ABSL_GUARDED_BY(mu);

  // Work for the progress thread with `mu` released.
  absl::Mutex tasks_mu ABSL_ACQUIRED_AFTER(mu);
  std::vector<std::function<void()>> unlocked_tasks ABSL_GUARDED_BY(tasks_mu);
  bool tasks_closed ABSL_GUARDED_BY(tasks_mu) = false;

  absl::Mutex handlers_mu;
  std::map<uint16_t, MessageHandler> message_handlers
      ABSL_GUARDED_BY(handlers_mu);
  std::vector<PeerFailureHandler> failure_handlers ABSL_GUARDED_BY(handlers_mu);
  std::vector<std::function<void()>> tick_handlers ABSL_GUARDED_BY(handlers_mu);

  std::atomic<bool> stop{false};
  std::thread thread;

  // Dropped once the worker shut down (bounded waits report it).
  void Post(std::function<void()> fn) {
    absl::MutexLock l(&tasks_mu);
    if (tasks_closed) return;
    unlocked_tasks.push_back(std::move(fn));
    ucp_worker_signal(worker);
  }

  // Moves every message that is next in its stream to the dispatch queue.
  void Drain(Stream& s, uint64_t sender) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (auto it = s.pending.begin();
         it != s.pending.end() && it->first == s.next_seq && it->second.ready;
         it = s.pending.erase(it)) {
      ++s.next_seq;
      if (it->second.failed) continue;
      Post([this, sender, kind = it->second.kind,
            payload = std::move(it->second.payload)]() mutable {
        MessageHandler h;
        {
          absl::MutexLock l(&handlers_mu);
          auto hit = message_handlers.find(kind);
          if (hit != message_handlers.end()) h = hit->second;
        }
        if (h) {
          h(sender, std::move(payload));
        } else {
          PDS_LOG(WARNING) << "transport: no handler for message kind " << kind;
        }
      });
    }
  }

  void Loop();
};

namespace {

struct RndvRecv {
  detail::WorkerCore* impl;
  std::pair<uint64_t, uint64_t> key;
  uint64_t seq;
};

void RndvRecvDone(void* request, ucs_status_t status, size_t /*length*/,
                  void* user_data) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  // Runs inside ucp_worker_progress, i.e. with impl->mu held.
  auto* r = static_cast<RndvRecv*>(user_data);
  auto& stream = r->impl->streams[r->key];
  auto it = stream.pending.find(r->seq);
  if (it != stream.pending.end()) {
    it->second.ready = true;
    it->second.failed = status != UCS_OK;
    r->impl->Drain(stream, r->key.first);
  }
  delete r;
  if (request != nullptr) ucp_request_free(request);
}

ucs_status_t AmRecv(void* arg, const void* header, size_t header_length,
                    void* data, size_t length, const ucp_am_recv_param_t* param)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  // Runs inside ucp_worker_progress, i.e. with impl->mu held.
  const auto* target = static_cast<const detail::WorkerCore::AmTarget*>(arg);
  detail::WorkerCore* impl = target->core;
  if (header_length != sizeof(WireHeader)) {
    PDS_LOG(WARNING) << "transport: dropping message with a bad header";
    return UCS_OK;
  }
  WireHeader h;
  std::memcpy(&h, header, sizeof(h));
  auto key = std::make_pair(h.sender_uid, h.ep_id);
  auto& stream = impl->streams[key];
  if (h.seq < stream.next_seq || stream.pending.count(h.seq) != 0) {
    PDS_LOG(WARNING) << "transport: dropping duplicate message seq " << h.seq;
    return UCS_OK;
  }
  auto& in = stream.pending[h.seq];
  in.kind = h.kind;
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) == 0) {
    in.payload.assign(static_cast<const char*>(data), length);
    in.ready = true;
    impl->Drain(stream, h.sender_uid);
    return UCS_OK;
  }
  // Rendezvous: the payload is fetched zero-copy straight into the message's
  // buffer, outside this callback.
  in.payload.resize(length);
  char* dst = in.payload.data();
  ucp_worker_h worker = target->worker;
  auto* r = new RndvRecv{impl, key, h.seq};
  impl->locked_tasks.push_back([worker, data, dst, length, r]() {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.recv_am = RndvRecvDone;
    p.user_data = r;
    ucs_status_ptr_t req = ucp_am_recv_data_nbx(worker, data, dst, length, &p);
    if (req == nullptr) {
      RndvRecvDone(nullptr, UCS_OK, length, r);
    } else if (UCS_PTR_IS_ERR(req)) {
      RndvRecvDone(nullptr, UCS_PTR_STATUS(req), 0, r);
    }
  });
  return UCS_INPROGRESS;
}

}  // namespace

void detail::WorkerCore::Loop() {
  absl::Time next_tick = absl::Now() + tick;
  while (!stop.load()) {
    bool busy = false;
    {
      absl::MutexLock l(&mu);
      while (Progress() != 0) busy = true;
      while (!locked_tasks.empty()) {
        auto tasks = std::move(locked_tasks);
        locked_tasks.clear();
        for (auto& t : tasks) t();
        while (Progress() != 0) {
        }
        busy = true;
      }
    }
    std::vector<std::function<void()>> tasks;
    {
      absl::MutexLock l(&tasks_mu);
      tasks.swap(unlocked_tasks);
    }
    for (auto& t : tasks) t();
    if (!tasks.empty()) busy = true;
    if (absl::Now() >= next_tick) {
      std::vector<std::function<void()>> ticks;
      {
        absl::MutexLock l(&handlers_mu);
        ticks = tick_handlers;
      }
      for (auto& t : ticks) t();
      next_tick = absl::Now() + tick;
    }
    if (busy) continue;
    ucs_status_t st;
    {
      absl::MutexLock l(&mu);
      st = ucp_worker_arm(worker);
      if (st != UCS_ERR_BUSY && control_worker != nullptr) {
        st = ucp_worker_arm(control_worker);
      }
    }
    if (st == UCS_ERR_BUSY) continue;
    {
      absl::MutexLock l(&tasks_mu);
      if (!unlocked_tasks.empty()) continue;
    }
    // Sleep until UCX has an event, someone signals (new work, Post, stop),
    // or the next tick is due.
    int wait_ms =
        static_cast<int>(absl::ToInt64Milliseconds(next_tick - absl::Now()));
    pollfd pfds[2] = {{efd, POLLIN, 0}, {control_efd, POLLIN, 0}};
    poll(pfds, control_worker != nullptr ? 2 : 1, std::max(wait_ms, 0) + 1);
  }
}

// ---------------------------------------------------------------------------
// OpHandle
// ---------------------------------------------------------------------------

OpState OpHandle::state() const {
  absl::MutexLock l(&mu_);
  return state_;
}

absl::Status OpHandle::status() const {
  absl::MutexLock l(&mu_);
  if (state_ == OpState::kInProgress)
    return absl::UnavailableError("in progress");
  return status_;
}

bool OpHandle::AwaitFinished(absl::Time deadline) const {
  auto done = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return state_ != OpState::kInProgress;
  };
  return mu_.AwaitWithDeadline(absl::Condition(&done), deadline);
}

absl::Status OpHandle::Wait(absl::Duration timeout) const {
  absl::MutexLock l(&mu_);
  if (!AwaitFinished(absl::Now() + timeout)) {
    return absl::DeadlineExceededError(
        absl::StrCat("transport operation still in progress after ",
                     absl::FormatDuration(timeout)));
  }
  return status_;
}

absl::Status OpHandle::WaitUntil(absl::Time deadline) const {
  absl::MutexLock l(&mu_);
  if (!AwaitFinished(deadline)) {
    return absl::DeadlineExceededError(
        absl::StrCat("transport operation still in progress at its deadline, ",
                     absl::FormatTime(deadline)));
  }
  return status_;
}

void OpHandle::AddParts(int n) {
  absl::MutexLock l(&mu_);
  pending_ += n;
}

void OpHandle::FinishPart(absl::Status status) {
  std::function<void(absl::Status)> cont;
  std::shared_ptr<detail::WorkerCore> core;
  absl::Status final_status;
  {
    absl::MutexLock l(&mu_);
    if (!status.ok() && status_.ok()) status_ = std::move(status);
    if (--pending_ > 0 || parts_done_) return;
    parts_done_ = true;
    if (!continuation_) {
      state_ = status_.ok() ? OpState::kSucceeded : OpState::kFailed;
      return;
    }
    cont = std::move(continuation_);
    core = core_;
    final_status = status_;
  }
  core->Post(
      [self = shared_from_this(), cont = std::move(cont), final_status]() {
        cont(final_status);
        self->Complete();
      });
}

void OpHandle::SetContinuation(std::shared_ptr<detail::WorkerCore> core,
                               std::function<void(absl::Status)> fn) {
  absl::MutexLock l(&mu_);
  core_ = std::move(core);
  continuation_ = std::move(fn);
}

void OpHandle::Complete() {
  absl::MutexLock l(&mu_);
  state_ = status_.ok() ? OpState::kSucceeded : OpState::kFailed;
}

namespace {

// user_data of every send-side UCX request: keeps the handle (and the
// message's header and payload) alive until UCX is done with them.
struct SendCtx {
  std::shared_ptr<OpHandle> handle;
  WireHeader header{};
  std::string payload;
};

void SendDone(void* request, ucs_status_t status, void* user_data) {
  auto* ctx = static_cast<SendCtx*>(user_data);
  ctx->handle->FinishPart(status == UCS_OK
                              ? absl::OkStatus()
                              : UcsError("transport op failed", status));
  delete ctx;
  ucp_request_free(request);
}

// Completes `ctx` for a request that did not go asynchronous.
void FinishImmediate(ucs_status_ptr_t req, SendCtx* ctx) {
  if (req == nullptr) {
    ctx->handle->FinishPart(absl::OkStatus());
    delete ctx;
  } else if (UCS_PTR_IS_ERR(req)) {
    ctx->handle->FinishPart(
        UcsError("transport op failed", UCS_PTR_STATUS(req)));
    delete ctx;
  }
}

ucp_request_param_t SendParam(SendCtx* ctx) {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = SendDone;
  p.user_data = ctx;
  return p;
}

}  // namespace

// ---------------------------------------------------------------------------
// Endpoint
// ---------------------------------------------------------------------------

struct UcxEndpoint::State {
  detail::WorkerCore* impl = nullptr;
  ucp_ep_h ep = nullptr;  // puts, region keys
  // Messages: on the control worker where there is one, else `ep`.
  ucp_ep_h control_ep = nullptr;
  uint64_t peer_uid = 0;
  uint64_t ep_id = 0;
  uint64_t next_seq = 0;  // guarded by impl->mu
  absl::Mutex mu;
  absl::Status health ABSL_GUARDED_BY(mu);
};

namespace {

void EpError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* state = static_cast<UcxEndpoint::State*>(arg);
  absl::Status s = UcsError(
      absl::StrCat("peer ", absl::Hex(state->peer_uid), " failed"), status);
  {
    absl::MutexLock l(&state->mu);
    if (!state->health.ok()) return;
    state->health = s;
  }
  PDS_LOG(WARNING) << "transport: " << s.message();
  detail::WorkerCore* impl = state->impl;
  uint64_t peer = state->peer_uid;
  impl->Post([impl, peer, s]() {
    std::vector<PeerFailureHandler> handlers;
    {
      absl::MutexLock l(&impl->handlers_mu);
      handlers = impl->failure_handlers;
    }
    for (auto& h : handlers) h(peer, s);
  });
}

}  // namespace

UcxEndpoint::~UcxEndpoint() {
  absl::MutexLock l(&core_->mu);
  if (core_->destroyed) return;  // ~UcxWorker closed it
  core_->CloseEp(state_->control_ep);
  core_->CloseEp(state_->ep);
}

absl::Status UcxEndpoint::health() const {
  absl::MutexLock l(&state_->mu);
  return state_->health;
}

std::string UcxEndpoint::TransportInfo() const {
  absl::MutexLock l(&core_->mu);
  if (core_->destroyed) return "";
  return CaptureInfo([&](FILE* f) {
    ucp_ep_print_info(state_->ep, f);
    if (state_->control_ep != nullptr) {
      std::fprintf(f, "# messages:\n");
      ucp_ep_print_info(state_->control_ep, f);
    }
  });
}

absl::StatusOr<std::unique_ptr<RemoteRegion>> UcxEndpoint::ImportRegion(
    const std::string& region_descriptor) {
  ByteReader r(region_descriptor);
  uint32_t magic = 0;
  uint64_t base = 0, length = 0;
  std::string rkey_buf;
  if (!r.Get(&magic) || magic != kRegionMagic || !r.Get(&base) ||
      !r.Get(&length) || !r.GetBytes(&rkey_buf, 1 << 20) || !r.empty()) {
    return absl::InvalidArgumentError("malformed memory region descriptor");
  }
  PDS_RETURN_IF_ERROR(health());
  ucp_rkey_h rkey = nullptr;
  {
    absl::MutexLock l(&core_->mu);
    if (core_->destroyed)
      return absl::FailedPreconditionError("UCX worker shut down");
    ucs_status_t st = ucp_ep_rkey_unpack(state_->ep, rkey_buf.data(), &rkey);
    if (st != UCS_OK) return UcsError("ucp_ep_rkey_unpack", st);
    core_->rkeys.insert(rkey);
  }
  return std::unique_ptr<RemoteRegion>(
      new RemoteRegion(core_, base, length, rkey));
}

absl::StatusOr<std::shared_ptr<OpHandle>> UcxEndpoint::PutAndFlush(
    const MemoryRegion& src, const RemoteRegion& dst,
    const std::vector<PutSegment>& segments, Continuation then) {
  for (const PutSegment& s : segments) {
    if (s.length == 0 || s.src_offset > src.length() ||
        s.length > src.length() - s.src_offset || s.dst_offset > dst.length() ||
        s.length > dst.length() - s.dst_offset) {
      return absl::OutOfRangeError(
          absl::StrCat("put outside a registered region: src [", s.src_offset,
                       ", +", s.length, ") of ", src.length(), ", dst [",
                       s.dst_offset, ", +", s.length, ") of ", dst.length()));
    }
  }
  PDS_RETURN_IF_ERROR(health());
  auto handle = std::make_shared<OpHandle>();
  // One part: the flush. The puts carry no callback (no per-put allocation
  // or bookkeeping, which dominated small KV segments): the flush completes
  // only after every put before it completed remotely, and fails if any did.
  handle->AddParts(1);
  if (then) handle->SetContinuation(core_, std::move(then));
  detail::WorkerCore* impl = core_.get();
  absl::Status issue_error;
  {
    absl::MutexLock l(&impl->mu);
    if (impl->destroyed)
      return absl::FailedPreconditionError("UCX worker shut down");
    ucp_request_param_t put{};
    put.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
    put.memh = static_cast<ucp_mem_h>(src.memh_);
    for (const PutSegment& s : segments) {
      ucs_status_ptr_t req = ucp_put_nbx(
          state_->ep, static_cast<const char*>(src.base()) + s.src_offset,
          s.length, dst.base() + s.dst_offset,
          static_cast<ucp_rkey_h>(dst.rkey_), &put);
      if (UCS_PTR_IS_ERR(req)) {
        issue_error = UcsError("ucp_put_nbx", UCS_PTR_STATUS(req));
        handle->AddParts(1);  // finished below, after the flush is issued
        break;
      }
      // Released at once: the operation goes on, tracked by the flush.
      if (req != nullptr) ucp_request_free(req);
    }
    // Remote completion of every put above before the handle succeeds: a
    // notice sent after this handle can never overtake the bytes.
    auto* ctx = new SendCtx{handle, {}, {}};
    ucp_request_param_t p = SendParam(ctx);
    FinishImmediate(ucp_ep_flush_nbx(state_->ep, &p), ctx);
  }
  if (!issue_error.ok()) handle->FinishPart(issue_error);
  ucp_worker_signal(impl->worker);
  return handle;
}

absl::StatusOr<std::shared_ptr<OpHandle>> UcxEndpoint::Send(uint16_t kind,
                                                            std::string payload,
                                                            Continuation then) {
  PDS_RETURN_IF_ERROR(health());
  auto handle = std::make_shared<OpHandle>();
  handle->AddParts(1);
  if (then) handle->SetContinuation(core_, std::move(then));
  detail::WorkerCore* impl = core_.get();
  {
    absl::MutexLock l(&impl->mu);
    if (impl->destroyed)
      return absl::FailedPreconditionError("UCX worker shut down");
    auto* ctx = new SendCtx{handle, {}, {}};
    ctx->header =
        WireHeader{impl->uid, state_->ep_id, state_->next_seq++, kind};
    ctx->payload = std::move(payload);
    ucp_request_param_t p = SendParam(ctx);
    FinishImmediate(
        ucp_am_send_nbx(
            state_->control_ep != nullptr ? state_->control_ep : state_->ep,
            kAmId, &ctx->header, sizeof(WireHeader), ctx->payload.data(),
            ctx->payload.size(), &p),
        ctx);
  }
  ucp_worker_signal(impl->worker);
  return handle;
}

absl::StatusOr<std::shared_ptr<OpHandle>> UcxEndpoint::Flush(
    Continuation then) {
  PDS_RETURN_IF_ERROR(health());
  auto handle = std::make_shared<OpHandle>();
  // Puts and messages alike: both endpoints where messages have their own.
  handle->AddParts(state_->control_ep != nullptr ? 2 : 1);
  if (then) handle->SetContinuation(core_, std::move(then));
  detail::WorkerCore* impl = core_.get();
  {
    absl::MutexLock l(&impl->mu);
    if (impl->destroyed)
      return absl::FailedPreconditionError("UCX worker shut down");
    for (ucp_ep_h ep : {state_->ep, state_->control_ep}) {
      if (ep == nullptr) continue;
      auto* ctx = new SendCtx{handle, {}, {}};
      ucp_request_param_t p = SendParam(ctx);
      FinishImmediate(ucp_ep_flush_nbx(ep, &p), ctx);
    }
  }
  ucp_worker_signal(impl->worker);
  return handle;
}

// ---------------------------------------------------------------------------
// Regions
// ---------------------------------------------------------------------------

MemoryRegion::~MemoryRegion() {
  absl::MutexLock l(&core_->mu);
  if (core_->destroyed) return;  // ~UcxWorker released the mapping
  if (!owns_memh_) return;       // a view into an allocation
  core_->allocations.erase(reinterpret_cast<uintptr_t>(base_));
  core_->memhs.erase(static_cast<ucp_mem_h>(memh_));
  ucp_mem_unmap(core_->context, static_cast<ucp_mem_h>(memh_));
}

RemoteRegion::~RemoteRegion() {
  absl::MutexLock l(&core_->mu);
  if (core_->destroyed) return;
  core_->rkeys.erase(static_cast<ucp_rkey_h>(rkey_));
  ucp_rkey_destroy(static_cast<ucp_rkey_h>(rkey_));
}

// ---------------------------------------------------------------------------
// Worker
// ---------------------------------------------------------------------------

UcxWorker::UcxWorker(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

UcxWorker::~UcxWorker() {
  impl_->stop.store(true);
  {
    absl::MutexLock l(&impl_->tasks_mu);
    impl_->tasks_closed = true;
    ucp_worker_signal(impl_->worker);
  }
  if (impl_->thread.joinable()) impl_->thread.join();
  // Work that never ran is dropped: its handles stay in progress, and every
  // wait on them is bounded. (Dropping it may close endpoints: still fine.)
  std::vector<std::function<void()>> dropped;
  {
    absl::MutexLock l(&impl_->tasks_mu);
    dropped.swap(impl_->unlocked_tasks);
  }
  dropped.clear();
  absl::MutexLock l(&impl_->mu);
  impl_->locked_tasks.clear();
  // Leftovers whose owners outlive the worker: rkeys before their
  // endpoints, registrations last.
  for (ucp_rkey_h rkey : impl_->rkeys) ucp_rkey_destroy(rkey);
  impl_->rkeys.clear();
  while (!impl_->eps.empty()) impl_->CloseEp(*impl_->eps.begin());
  for (ucp_mem_h memh : impl_->memhs) ucp_mem_unmap(impl_->context, memh);
  impl_->memhs.clear();
  impl_->destroyed = true;
  if (impl_->control_worker != nullptr) {
    ucp_worker_destroy(impl_->control_worker);
  }
  if (impl_->control_context != nullptr) {
    ucp_cleanup(impl_->control_context);
  }
  ucp_worker_destroy(impl_->worker);
  ucp_cleanup(impl_->context);
}

absl::StatusOr<std::unique_ptr<UcxWorker>> UcxWorker::Create(
    const UcxWorkerOptions& options) {
  ucp_config_t* raw_config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &raw_config);
  if (st != UCS_OK) return UcsError("ucp_config_read", st);
  std::unique_ptr<ucp_config_t, ConfigDeleter> config(raw_config);
  for (const auto& [name, value] : options.ucx_config) {
    if (std::getenv(absl::StrCat("UCX_", name).c_str()) != nullptr) continue;
    st = ucp_config_modify(config.get(), name.c_str(), value.c_str());
    if (st != UCS_OK) {
      return absl::InvalidArgumentError(absl::StrCat(
          "UCX config ", name, "=", value, ": ", ucs_status_string(st)));
    }
  }

  auto impl = std::make_shared<Impl>();
  impl->tick = options.tick;
  impl->peer_error_handling = options.peer_error_handling;
  std::random_device rd;
  impl->uid = (uint64_t{rd()} << 32) ^ rd() ^ (uint64_t(getpid()) << 16);

  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  st = ucp_init(&params, config.get(), &impl->context);
  if (st != UCS_OK) return UcsError("ucp_init", st);

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  st = ucp_worker_create(impl->context, &wp, &impl->worker);
  if (st != UCS_OK) {
    ucp_cleanup(impl->context);
    return UcsError("ucp_worker_create", st);
  }
  // From here on the UcxWorker destructor owns context and worker.
  std::unique_ptr<UcxWorker> w(new UcxWorker(std::move(impl)));
  Impl* im = w->impl_.get();
  w->uid_ = im->uid;

  st = ucp_worker_get_efd(im->worker, &im->efd);
  if (st != UCS_OK) return UcsError("ucp_worker_get_efd", st);

  if (!options.peer_error_handling && options.messages_over_tcp) {
    // The message worker (see WorkerCore::control_worker): tcp whatever
    // UCX_TLS says, since the point is a transport where peers do not
    // share a queue; messages only, so no software RMA over it.
    ucp_config_t* raw_control = nullptr;
    st = ucp_config_read(nullptr, nullptr, &raw_control);
    if (st != UCS_OK) return UcsError("ucp_config_read", st);
    std::unique_ptr<ucp_config_t, ConfigDeleter> control_config(raw_control);
    st = ucp_config_modify(control_config.get(), "TLS", "tcp");
    if (st != UCS_OK) return UcsError("UCX config TLS=tcp (messages)", st);
    ucp_params_t control_params{};
    control_params.field_mask = UCP_PARAM_FIELD_FEATURES;
    control_params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    st = ucp_init(&control_params, control_config.get(), &im->control_context);
    if (st != UCS_OK) return UcsError("ucp_init (messages over tcp)", st);
    st = ucp_worker_create(im->control_context, &wp, &im->control_worker);
    if (st != UCS_OK) {
      return UcsError("ucp_worker_create (messages over tcp)", st);
    }
    st = ucp_worker_get_efd(im->control_worker, &im->control_efd);
    if (st != UCS_OK) return UcsError("ucp_worker_get_efd", st);
  }

  // Both workers take messages: a peer without a message worker of its own
  // (peer error handling on) sends them to the one that takes its puts.
  im->data_target = {im, im->worker};
  im->control_target = {im, im->control_worker};
  for (Impl::AmTarget* target : {&im->data_target, &im->control_target}) {
    if (target->worker == nullptr) continue;
    ucp_am_handler_param_t ap{};
    ap.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                    UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG;
    ap.id = kAmId;
    ap.cb = AmRecv;
    ap.arg = target;
    st = ucp_worker_set_am_recv_handler(target->worker, &ap);
    if (st != UCS_OK) return UcsError("ucp_worker_set_am_recv_handler", st);
  }

  // The blob: magic, uid, the put worker's UCX address, the message
  // worker's (empty without one).
  ByteWriter bw;
  bw.Put(kAddressMagic);
  bw.Put(im->uid);
  for (ucp_worker_h worker : {im->worker, im->control_worker}) {
    if (worker == nullptr) {
      bw.PutBytes("");
      continue;
    }
    ucp_address_t* addr = nullptr;
    size_t addr_len = 0;
    st = ucp_worker_get_address(worker, &addr, &addr_len);
    if (st != UCS_OK) return UcsError("ucp_worker_get_address", st);
    bw.PutBytes(
        absl::string_view(reinterpret_cast<const char*>(addr), addr_len));
    ucp_worker_release_address(worker, addr);
  }
  w->address_ = bw.Take();

  // Which transports UCX opened: the "md[...]"/"resource[...]" lines of the
  // context summary, e.g. "posix/memory", "cma/memory", "tcp/lo".
  std::string info =
      CaptureInfo([&](FILE* f) { ucp_context_print_info(im->context, f); });
  std::vector<std::string> resources;
  for (absl::string_view line : absl::StrSplit(info, '\n')) {
    auto pos = line.find("flags -- ");
    if (line.find("resource") != absl::string_view::npos &&
        pos != absl::string_view::npos) {
      resources.emplace_back(line.substr(pos + 9));
    }
  }
  const char* tls = std::getenv("UCX_TLS");
  w->transports_ = absl::StrCat(
      "UCX_TLS=", tls != nullptr ? tls : "(default)",
      "; resources: ", absl::StrJoin(resources, " "),
      im->control_worker != nullptr ? "; messages: tcp, peer errors on" : "");
  PDS_LOG(INFO) << "transport: worker " << absl::StrCat(absl::Hex(im->uid))
                << " " << w->transports_;

  im->thread = std::thread([im]() { im->Loop(); });
  return w;
}

absl::StatusOr<std::shared_ptr<UcxEndpoint>> UcxWorker::Connect(
    const std::string& address_blob) {
  ByteReader r(address_blob);
  uint32_t magic = 0;
  uint64_t peer_uid = 0;
  std::string ucp_addr, control_addr;
  if (!r.Get(&magic) || magic != kAddressMagic || !r.Get(&peer_uid) ||
      !r.GetBytes(&ucp_addr, 1 << 20) || !r.GetBytes(&control_addr, 1 << 20) ||
      !r.empty() || ucp_addr.empty()) {
    return absl::InvalidArgumentError("malformed worker address");
  }
  auto state = std::make_shared<UcxEndpoint::State>();
  state->impl = impl_.get();
  state->peer_uid = peer_uid;
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                  UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.address = reinterpret_cast<const ucp_address_t*>(ucp_addr.data());
  // Peer mode: a dead peer fails operations instead of hanging them.
  ep.err_mode = impl_->peer_error_handling ? UCP_ERR_HANDLING_MODE_PEER
                                           : UCP_ERR_HANDLING_MODE_NONE;
  ep.err_handler.cb = EpError;
  ep.err_handler.arg = state.get();
  {
    absl::MutexLock l(&impl_->mu);
    state->ep_id = impl_->next_ep_id++;
    ucs_status_t st = ucp_ep_create(impl_->worker, &ep, &state->ep);
    if (st != UCS_OK) {
      // UCX 1.13 refuses peer error handling when the only transports left
      // (e.g. UCX_TLS=sm) cannot detect a dead peer; tcp or verbs can.
      const char* tls = std::getenv("UCX_TLS");
      return UcsError(
          absl::StrCat(
              "ucp_ep_create (peer error handling needs a transport that "
              "detects peer failure, e.g. tcp; UCX_TLS=",
              tls != nullptr ? tls : "(default)", ")"),
          st);
    }
    impl_->eps.insert(state->ep);
    if (impl_->control_worker != nullptr) {
      // Messages from our message worker to the peer's (or, where it has
      // none, to the worker that takes its puts, which listens on tcp too),
      // in peer mode: the peer's death is reported, not waited out.
      ucp_ep_params_t control = ep;
      control.address = reinterpret_cast<const ucp_address_t*>(
          control_addr.empty() ? ucp_addr.data() : control_addr.data());
      control.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      st = ucp_ep_create(impl_->control_worker, &control, &state->control_ep);
      if (st != UCS_OK) {
        impl_->CloseEp(state->ep);
        return UcsError("ucp_ep_create (messages over tcp)", st);
      }
      impl_->eps.insert(state->control_ep);
    }
  }
  std::shared_ptr<UcxEndpoint> out(
      new UcxEndpoint(impl_, peer_uid, std::move(state)));
  // The lanes UCX chose for this peer ("lane[0]: ... tcp/lo ...").
  std::vector<std::string> lanes;
  for (absl::string_view line : absl::StrSplit(out->TransportInfo(), '\n')) {
    if (line.find("lane[") != absl::string_view::npos) {
      lanes.emplace_back(
          absl::StripAsciiWhitespace(absl::StripPrefix(line, "#")));
    }
  }
  PDS_LOG(INFO) << "transport: endpoint to "
                << absl::StrCat(absl::Hex(peer_uid)) << ": "
                << absl::StrJoin(lanes, "; ");
  return out;
}

absl::StatusOr<std::unique_ptr<MemoryRegion>> UcxWorker::Register(
    void* base, size_t length) {
  if (base == nullptr || length == 0) {
    return absl::InvalidArgumentError("cannot register an empty region");
  }
  return MapMemory(base, length);
}

absl::StatusOr<std::unique_ptr<MemoryRegion>> UcxWorker::Allocate(
    size_t length) {
  if (length == 0) {
    return absl::InvalidArgumentError("cannot allocate an empty region");
  }
  return MapMemory(nullptr, length);
}

absl::StatusOr<std::unique_ptr<MemoryRegion>> UcxWorker::MapMemory(
    void* base, size_t length) {
  absl::MutexLock l(&impl_->mu);
  ucp_mem_h memh = nullptr;
  bool owns = true;
  ucs_status_t st;
  // Memory inside one of our allocations reuses that allocation's handle:
  // a fresh registration would lose the shared-memory key that lets peers
  // write it directly.
  if (base != nullptr) {
    const auto b = reinterpret_cast<uintptr_t>(base);
    auto it = impl_->allocations.upper_bound(b);
    if (it != impl_->allocations.begin()) {
      --it;
      if (b + length <= it->first + it->second.first) {
        memh = it->second.second;
        owns = false;
      }
    }
  }
  if (memh == nullptr) {
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS |
                    UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                    UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.address = base;
    mp.length = length;
    mp.flags = base == nullptr ? UCP_MEM_MAP_ALLOCATE : 0;
    st = ucp_mem_map(impl_->context, &mp, &memh);
    if (st != UCS_OK) return UcsError("ucp_mem_map", st);
    if (base == nullptr) {
      ucp_mem_attr_t attr{};
      attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
      st = ucp_mem_query(memh, &attr);
      if (st != UCS_OK) {
        ucp_mem_unmap(impl_->context, memh);
        return UcsError("ucp_mem_query", st);
      }
      base = attr.address;
      impl_->allocations[reinterpret_cast<uintptr_t>(base)] = {length, memh};
    }
  }
  void* rkey_buf = nullptr;
  size_t rkey_len = 0;
  st = ucp_rkey_pack(impl_->context, memh, &rkey_buf, &rkey_len);
  if (st != UCS_OK) {
    if (owns) {
      impl_->allocations.erase(reinterpret_cast<uintptr_t>(base));
      ucp_mem_unmap(impl_->context, memh);
    }
    return UcsError("ucp_rkey_pack", st);
  }
  if (owns) impl_->memhs.insert(memh);
  std::unique_ptr<MemoryRegion> region(
      new MemoryRegion(impl_, base, length, memh));
  region->owns_memh_ = owns;
  ByteWriter bw;
  bw.Put(kRegionMagic);
  bw.Put<uint64_t>(reinterpret_cast<uintptr_t>(base));
  bw.Put<uint64_t>(length);
  bw.PutBytes(absl::string_view(static_cast<const char*>(rkey_buf), rkey_len));
  region->descriptor_ = bw.Take();
  ucp_rkey_buffer_release(rkey_buf);
  return region;
}

void UcxWorker::SetMessageHandler(uint16_t kind, MessageHandler handler) {
  absl::MutexLock l(&impl_->handlers_mu);
  impl_->message_handlers[kind] = std::move(handler);
}

void UcxWorker::AddPeerFailureHandler(PeerFailureHandler handler) {
  absl::MutexLock l(&impl_->handlers_mu);
  impl_->failure_handlers.push_back(std::move(handler));
}

void UcxWorker::AddTickHandler(std::function<void()> handler) {
  absl::MutexLock l(&impl_->handlers_mu);
  impl_->tick_handlers.push_back(std::move(handler));
}

void UcxWorker::Post(std::function<void()> fn) { impl_->Post(std::move(fn)); }

}  // namespace pdserve::transport
