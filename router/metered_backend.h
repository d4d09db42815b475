// A GenerationBackend decorator that counts every request's outcome by API
// and status code (pdserve_router_requests_total) and keeps the in-flight
// gauge, around whatever it wraps (placed outside the admission limiter, so
// refusals with RESOURCE_EXHAUSTED are counted too). Thread-safe.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "router/generation_backend.h"
#include "router/router_metrics.h"

namespace pdserve::router {

class MeteredBackend : public GenerationBackend {
 public:
  // Neither is owned; both must outlive every call started through this.
  MeteredBackend(GenerationBackend* inner, metrics::RouterMetrics* metrics);

  std::vector<ModelDescription> ListModels() const override;
  absl::Status Health() const override;
  absl::StatusOr<std::unique_ptr<GenerationCall>> Start(
      GenerationRequest request, GenerationObserver* observer) override;

  // For the front-ends' RejectionHook.
  void OnRejected(const std::string& api, absl::StatusCode code);

 private:
  GenerationBackend* const inner_;
  metrics::RouterMetrics* const metrics_;
  std::shared_ptr<std::atomic<int64_t>> in_flight_ =
      std::make_shared<std::atomic<int64_t>>(0);
};

}  // namespace pdserve::router
