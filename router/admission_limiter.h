// Admission limit for the router: at most `limit` generations in flight across
// both front-ends; one more is refused with RESOURCE_EXHAUSTED (HTTP 429) at
// once rather than queued without bound, so overload shows up as fast
// refusals a client can back off from instead of growing latency for all.
#pragma once

#include <atomic>
#include <memory>

#include "router/generation_backend.h"

namespace pdserve::router {

// A GenerationBackend decorator; `inner` is not owned and must outlive it.
// Thread-safe.
class AdmissionLimiter : public GenerationBackend {
 public:
  AdmissionLimiter(GenerationBackend* inner, int limit);

  std::vector<ModelDescription> ListModels() const override;
  absl::Status Health() const override;
  absl::StatusOr<std::unique_ptr<GenerationCall>> Start(
      GenerationRequest request, GenerationObserver* observer) override;

  // Drain (SIGTERM): Health() turns UNAVAILABLE (readiness and the gRPC
  // health service say NOT_SERVING, so load balancers stop sending) and new
  // generations are refused with UNAVAILABLE (HTTP 503, which clients and
  // gateways retry on another replica); those in flight run to their end.
  void StartDrain() { draining_->store(true); }
  bool draining() const { return draining_->load(); }

  int in_flight() const { return in_flight_->load(); }
  int limit() const { return limit_; }

 private:
  GenerationBackend* inner_;
  const int limit_;
  // Shared with the per-call observers, which release their slot in OnDone
  // (possibly after the limiter is gone during shutdown).
  std::shared_ptr<std::atomic<int>> in_flight_;
  std::shared_ptr<std::atomic<bool>> draining_ =
      std::make_shared<std::atomic<bool>>(false);
};

}  // namespace pdserve::router
