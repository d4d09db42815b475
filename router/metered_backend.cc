#include "router/metered_backend.h"

#include <utility>

namespace pdserve::router {
namespace {

// Forwards to the caller's observer and records the outcome; deletes itself
// after the final callback (the backend never calls back after OnDone).
class MeteredObserver final : public GenerationObserver {
 public:
  MeteredObserver(GenerationObserver* inner, metrics::RouterMetrics* metrics,
                  std::string api, std::shared_ptr<std::atomic<int64_t>> count)
      : inner_(inner),
        metrics_(metrics),
        api_(std::move(api)),
        in_flight_(std::move(count)) {}

  void OnDelta(GenerationDelta delta) override {
    inner_->OnDelta(std::move(delta));
  }
  void OnDone(absl::Status status) override {
    metrics_->OnRequest(api_, status.code());
    metrics_->SetInFlight(in_flight_->fetch_sub(1) - 1);
    GenerationObserver* inner = inner_;
    delete this;
    inner->OnDone(std::move(status));
  }

 private:
  GenerationObserver* const inner_;
  metrics::RouterMetrics* const metrics_;
  const std::string api_;
  const std::shared_ptr<std::atomic<int64_t>> in_flight_;
};

}  // namespace

MeteredBackend::MeteredBackend(GenerationBackend* inner,
                               metrics::RouterMetrics* metrics)
    : inner_(inner), metrics_(metrics) {}

std::vector<ModelDescription> MeteredBackend::ListModels() const {
  return inner_->ListModels();
}

absl::Status MeteredBackend::Health() const { return inner_->Health(); }

void MeteredBackend::OnRejected(const std::string& api, absl::StatusCode code) {
  metrics_->OnRequest(api, code);
}

absl::StatusOr<std::unique_ptr<GenerationCall>> MeteredBackend::Start(
    GenerationRequest request, GenerationObserver* observer) {
  const std::string api = request.api.empty() ? "unknown" : request.api;
  metrics_->SetInFlight(in_flight_->fetch_add(1) + 1);
  auto* metered = new MeteredObserver(observer, metrics_, api, in_flight_);
  absl::StatusOr<std::unique_ptr<GenerationCall>> call =
      inner_->Start(std::move(request), metered);
  if (!call.ok()) {
    // No callback will come: the observer is ours to free.
    delete metered;
    metrics_->SetInFlight(in_flight_->fetch_sub(1) - 1);
    metrics_->OnRequest(api, call.status().code());
  }
  return call;
}

}  // namespace pdserve::router
