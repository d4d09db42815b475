#include "router/admission_limiter.h"

#include "absl/strings/str_cat.h"

namespace pdserve::router {
namespace {

// Forwards every callback and frees the admission slot after OnDone; deletes
// itself then (OnDone is the last callback by contract).
class SlotObserver : public GenerationObserver {
 public:
  SlotObserver(GenerationObserver* inner,
               std::shared_ptr<std::atomic<int>> in_flight)
      : inner_(inner), in_flight_(std::move(in_flight)) {}

  void OnDelta(GenerationDelta delta) override {
    inner_->OnDelta(std::move(delta));
  }
  void OnDone(absl::Status status) override {
    // Free the slot first: the client may start its next request from
    // inside OnDone and must not be refused by its own finished one.
    in_flight_->fetch_sub(1);
    GenerationObserver* inner = inner_;
    delete this;
    inner->OnDone(std::move(status));
  }

 private:
  GenerationObserver* inner_;
  std::shared_ptr<std::atomic<int>> in_flight_;
};

}  // namespace

AdmissionLimiter::AdmissionLimiter(GenerationBackend* inner, int limit)
    : inner_(inner),
      limit_(limit),
      in_flight_(std::make_shared<std::atomic<int>>(0)) {}

std::vector<ModelDescription> AdmissionLimiter::ListModels() const {
  return inner_->ListModels();
}

absl::Status AdmissionLimiter::Health() const {
  if (draining()) return absl::UnavailableError("router is draining");
  return inner_->Health();
}

absl::StatusOr<std::unique_ptr<GenerationCall>> AdmissionLimiter::Start(
    GenerationRequest request, GenerationObserver* observer) {
  if (draining()) {
    return absl::UnavailableError(
        "router is draining (shutting down): send to another replica");
  }
  if (in_flight_->fetch_add(1) >= limit_) {
    in_flight_->fetch_sub(1);
    return absl::ResourceExhaustedError(absl::StrCat(
        "admission limit reached (", limit_, " requests in flight)"));
  }
  auto* slot = new SlotObserver(observer, in_flight_);
  absl::StatusOr<std::unique_ptr<GenerationCall>> call =
      inner_->Start(std::move(request), slot);
  if (!call.ok()) {
    // No callback will come: release here.
    in_flight_->fetch_sub(1);
    delete slot;
  }
  return call;
}

}  // namespace pdserve::router
