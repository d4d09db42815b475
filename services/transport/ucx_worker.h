// UCX (UCP) worker, endpoints, registered memory and ordered messages.
//
// Threads: every UcxWorker owns one progress thread. It sleeps in epoll on
// the worker's event fd (ucp_worker_arm) plus a periodic tick, so an idle
// worker costs no CPU and a busy one adds no polling latency. All UCP calls on
// a worker are serialized by the worker's mutex (the worker is created with
// UCS_THREAD_MODE_SERIALIZED); public methods are thread-safe. UCX callbacks
// run on the progress thread with the mutex held and only record results;
// anything that may call back into the worker (message handlers, peer-failure
// handlers, completion continuations, ticks) runs on the progress thread with
// the mutex released. Such handlers must not block.
//
// Lifetime: endpoints, regions and handles may outlive their worker.
// Destroying a worker stops its thread, destroys the UCX worker and context,
// and drops work that never ran: handles still in progress stay so (every
// wait is bounded), later operations fail with FAILED_PRECONDITION, and
// destructors of the leftovers do nothing.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pdserve::transport {

class UcxWorker;
namespace detail {
// The UCX context/worker and progress thread behind a UcxWorker. Shared with
// endpoints, regions and handles so that they can outlive the UcxWorker
// object safely: once it is destroyed they turn into no-ops.
struct WorkerCore;
}  // namespace detail

// ---------------------------------------------------------------------------
// Async completion
// ---------------------------------------------------------------------------

enum class OpState { kInProgress, kSucceeded, kFailed };

// Completion of one asynchronous operation, possibly made of several UCX
// requests (a batch of puts plus a flush, a message send). Thread-safe.
class OpHandle : public std::enable_shared_from_this<OpHandle> {
 public:
  OpHandle() = default;
  OpHandle(const OpHandle&) = delete;
  OpHandle& operator=(const OpHandle&) = delete;

  OpState state() const;
  // OK once succeeded, the first error once failed, UNAVAILABLE("in
  // progress") before either.
  absl::Status status() const;
  // Blocks up to `timeout`: the final status, or DEADLINE_EXCEEDED if the
  // operation is still in progress (it keeps running).
  [[nodiscard]] absl::Status Wait(absl::Duration timeout) const;
  // The same up to `deadline`: a deadline already past still returns the
  // final status of an operation that has finished.
  [[nodiscard]] absl::Status WaitUntil(absl::Time deadline) const;

  // --- for the transport's implementation ---
  // Adds n outstanding parts; the handle completes when all parts finished.
  void AddParts(int n);
  // Finishes one part; the first non-OK status wins.
  void FinishPart(absl::Status status);
  // Runs `fn(status)` on the worker's progress thread (mutex released) once
  // every part finished; waiters are woken after it returns. Set before the
  // first part can finish.
  void SetContinuation(std::shared_ptr<detail::WorkerCore> core,
                       std::function<void(absl::Status)> fn);

 private:
  // Blocks (mu_ held) until the operation finished or `deadline`; whether it
  // finished.
  bool AwaitFinished(absl::Time deadline) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Complete();

  mutable absl::Mutex mu_;
  int pending_ ABSL_GUARDED_BY(mu_) = 0;
  bool parts_done_ ABSL_GUARDED_BY(mu_) = false;
  OpState state_ ABSL_GUARDED_BY(mu_) = OpState::kInProgress;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<detail::WorkerCore> core_ ABSL_GUARDED_BY(mu_);
  std::function<void(absl::Status)> continuation_ ABSL_GUARDED_BY(mu_);
};

// ---------------------------------------------------------------------------
// Memory
// ---------------------------------------------------------------------------

// Local memory registered with UCX (ucp_mem_map), usable as the source of
// zero-copy puts and, through its packed rkey, as a remote write target.
class MemoryRegion {
 public:
  ~MemoryRegion();
  MemoryRegion(const MemoryRegion&) = delete;
  MemoryRegion& operator=(const MemoryRegion&) = delete;

  void* base() const { return base_; }
  size_t length() const { return length_; }
  // Blob a peer passes to UcxEndpoint::ImportRegion: base address, length,
  // packed rkey.
  const std::string& descriptor() const { return descriptor_; }

 private:
  friend class UcxWorker;
  friend class UcxEndpoint;
  MemoryRegion(std::shared_ptr<detail::WorkerCore> core, void* base,
               size_t length, void* memh)
      : core_(std::move(core)), base_(base), length_(length), memh_(memh) {}

  std::shared_ptr<detail::WorkerCore> core_;
  void* base_;
  size_t length_;
  void* memh_;             // ucp_mem_h
  bool owns_memh_ = true;  // false: a view into an Allocate()d region
  std::string descriptor_;
};

// A peer's registered region, reachable through one endpoint.
class RemoteRegion {
 public:
  ~RemoteRegion();
  RemoteRegion(const RemoteRegion&) = delete;
  RemoteRegion& operator=(const RemoteRegion&) = delete;

  uint64_t base() const { return base_; }
  uint64_t length() const { return length_; }

 private:
  friend class UcxEndpoint;
  RemoteRegion(std::shared_ptr<detail::WorkerCore> core, uint64_t base,
               uint64_t length, void* rkey)
      : core_(std::move(core)), base_(base), length_(length), rkey_(rkey) {}

  std::shared_ptr<detail::WorkerCore> core_;
  uint64_t base_;
  uint64_t length_;
  void* rkey_;  // ucp_rkey_h
};

// One contiguous put: `length` bytes from local offset `src_offset` to remote
// offset `dst_offset` (both relative to their region's base).
struct PutSegment {
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
  uint64_t length = 0;
};

// ---------------------------------------------------------------------------
// Endpoint
// ---------------------------------------------------------------------------

// Runs on the progress thread (mutex released) when an operation finished,
// before its handle reports completion. Must not block.
using Continuation = std::function<void(absl::Status)>;

// A connection to one peer worker, in peer error-handling mode: if the peer
// dies, outstanding operations fail and health() turns non-OK instead of
// anything hanging. Thread-safe.
class UcxEndpoint {
 public:
  ~UcxEndpoint();  // Force-closes the UCX endpoint.
  UcxEndpoint(const UcxEndpoint&) = delete;
  UcxEndpoint& operator=(const UcxEndpoint&) = delete;

  uint64_t peer_uid() const { return peer_uid_; }
  // OK while usable; UNAVAILABLE naming the UCX error once the peer failed.
  absl::Status health() const;

  [[nodiscard]] absl::StatusOr<std::unique_ptr<RemoteRegion>> ImportRegion(
      const std::string& region_descriptor);

  // Puts every segment (each checked against both regions first: nothing is
  // issued if any segment is out of range), then flushes the endpoint, so the
  // handle succeeds only once the bytes are in the peer's memory.
  [[nodiscard]] absl::StatusOr<std::shared_ptr<OpHandle>> PutAndFlush(
      const MemoryRegion& src, const RemoteRegion& dst,
      const std::vector<PutSegment>& segments, Continuation then = {});

  // Sends a message of `kind` to the peer's handler for `kind`. Messages sent
  // on one endpoint are delivered in order. Large payloads go zero-copy
  // (rendezvous); the handle owns the payload until the send completes.
  [[nodiscard]] absl::StatusOr<std::shared_ptr<OpHandle>> Send(
      uint16_t kind, std::string payload, Continuation then = {});

  // Completes once every operation issued before it reached the peer.
  [[nodiscard]] absl::StatusOr<std::shared_ptr<OpHandle>> Flush(
      Continuation then = {});

  // Multi-line description of the lanes/transports UCX picked.
  std::string TransportInfo() const;

  struct State;  // implementation detail (UCX handle, error state)

 private:
  friend class UcxWorker;
  UcxEndpoint(std::shared_ptr<detail::WorkerCore> core, uint64_t peer_uid,
              std::shared_ptr<State> state)
      : core_(std::move(core)), peer_uid_(peer_uid), state_(std::move(state)) {}

  std::shared_ptr<detail::WorkerCore> core_;
  uint64_t peer_uid_;
  std::shared_ptr<State> state_;
};

// ---------------------------------------------------------------------------
// Worker
// ---------------------------------------------------------------------------

struct UcxWorkerOptions {
  // UCX configuration (names without the UCX_ prefix, e.g. {"TLS", "tcp"}).
  // A variable already set in the environment wins, so UCX_TLS & co. are
  // always honoured.
  std::vector<std::pair<std::string, std::string>> ucx_config;
  // Endpoints in UCP_ERR_HANDLING_MODE_PEER: a dead peer fails operations
  // promptly. UCX 1.13 then only uses transports that detect peer failure
  // (tcp, verbs), not shared memory/CMA. With false, UCX may pick shared
  // memory/CMA and a dead peer is noticed by leases and bounded waits only.
  bool peer_error_handling = true;
  // With peer_error_handling off: messages (not puts) on a second UCX worker
  // restricted to tcp, with peer error handling on. Over shared memory all
  // senders share the receiver's one queue, and a sender killed mid-message
  // stops it for every peer (FaultTest.SenderKilledMidMessageLeavesOther-
  // SendersHeard); over tcp a dead peer fails alone and is reported. Off
  // only to measure what it costs.
  bool messages_over_tcp = true;
  // Period of the progress thread's housekeeping tick (leases, timeouts).
  absl::Duration tick = absl::Milliseconds(20);
};

// Called on the progress thread with the mutex released.
using MessageHandler =
    std::function<void(uint64_t peer_uid, std::string payload)>;
using PeerFailureHandler = std::function<void(uint64_t peer_uid, absl::Status)>;

class UcxWorker {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<UcxWorker>> Create(
      const UcxWorkerOptions& options = {});
  ~UcxWorker();
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;

  // Random id naming this worker in every message it sends.
  uint64_t uid() const { return uid_; }
  // Blob for Connect(): uid + UCX worker addresses (puts; messages, where
  // they have their own worker). The control plane carries it.
  const std::string& address() const { return address_; }

  // Creates an endpoint to the worker that published `address_blob`.
  // INVALID_ARGUMENT for a malformed blob, UNAVAILABLE if UCX cannot reach it.
  // Connecting is lazy in UCX: a dead peer shows up as a failed first
  // operation (use a handshake with a deadline to detect it).
  [[nodiscard]] absl::StatusOr<std::shared_ptr<UcxEndpoint>> Connect(
      const std::string& address_blob);

  // Registers [base, base + length) for RMA. Memory inside a live
  // Allocate()d region reuses that allocation's registration (a view that
  // must not outlive it), keeping its shared-memory reach.
  [[nodiscard]] absl::StatusOr<std::unique_ptr<MemoryRegion>> Register(
      void* base, size_t length);

  // Allocates and registers `length` bytes through UCX (UCP_MEM_MAP_ALLOCATE).
  // UCX may place it in shared memory that a peer on the same host maps
  // directly, which makes one-sided puts into it plain memory copies; user
  // memory given to Register() can only be reached by RMA-capable transports
  // (verbs, CMA, cuda_ipc) or UCX's software RMA emulation.
  [[nodiscard]] absl::StatusOr<std::unique_ptr<MemoryRegion>> Allocate(
      size_t length);

  // One handler per kind; replaces a previous one. Kinds are the caller's.
  void SetMessageHandler(uint16_t kind, MessageHandler handler);
  // Called once for every endpoint (to that peer) that fails.
  void AddPeerFailureHandler(PeerFailureHandler handler);
  // Called on every tick and whenever the progress thread wakes.
  void AddTickHandler(std::function<void()> handler);
  // Runs `fn` on the progress thread, mutex released.
  void Post(std::function<void()> fn);

  // UCX_TLS in effect ("all" when unset) and the transports UCX opened.
  const std::string& transports() const { return transports_; }

  using Impl = detail::WorkerCore;

 private:
  explicit UcxWorker(std::shared_ptr<Impl> impl);
  absl::StatusOr<std::unique_ptr<MemoryRegion>> MapMemory(void* base,
                                                          size_t length);
  friend class UcxEndpoint;
  friend class MemoryRegion;
  friend class RemoteRegion;
  friend class OpHandle;

  std::shared_ptr<Impl> impl_;
  uint64_t uid_ = 0;
  std::string address_;
  std::string transports_;
};

}  // namespace pdserve::transport
