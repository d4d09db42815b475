// A whole prefill group inside one process: S pipeline stages (one thread
// each) chained by in-process links, and the coordinator. What tests and the
// local CLI run; the multi-process worker wires the same PipelineStage and
// PrefillCoordinator over UCX links instead.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "model/weight_source.h"
#include "prefill/kv_output.h"
#include "prefill/pipeline_stage.h"
#include "prefill/prefill_coordinator.h"
#include "prefill/stage_link.h"

namespace pdserve::prefill {

struct PrefillGroupOptions {
  // Layers per stage (see layer_split.h); empty = one stage with every layer.
  std::vector<int> layer_split;
  int threads_per_stage = 1;
  SchedulerOptions scheduler;
  // Every stage's backend (PipelineStageOptions).
  engine::Backend backend = engine::Backend::kCpu;
  engine::CudaOptions cuda;
  std::optional<kv::KvDType> kv_dtype;  // unset = the backend's own
  // The last stage's structured-output grammars (not owned; may be null).
  grammar::StructuredOutputCompiler* structured_output = nullptr;
  // Optional: the KV output of stage i, made once its pool exists (overrides
  // the `kv_out` given to Create). The outputs are not owned.
  std::function<absl::StatusOr<StageKvOutput*>(int stage, kv::KvPool* pool)>
      kv_output_factory;
};

class InProcessPrefillGroup {
 public:
  // `kv_out` (may be null, not owned, thread-safe) receives every stage's KV.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<InProcessPrefillGroup>>
  Create(const model::WeightSource& weights, const PrefillGroupOptions& options,
         StageKvOutput* kv_out);
  // Fails unfinished requests (UNAVAILABLE), drains and joins the stages.
  ~InProcessPrefillGroup();
  InProcessPrefillGroup(const InProcessPrefillGroup&) = delete;
  InProcessPrefillGroup& operator=(const InProcessPrefillGroup&) = delete;

  [[nodiscard]] absl::StatusOr<std::shared_ptr<PrefillTicket>> Submit(
      PrefillRequest request) {
    return coordinator_->Submit(std::move(request));
  }
  // Stops the request and drops every stage's write bookkeeping of it.
  [[nodiscard]] absl::Status Cancel(uint64_t request_id) {
    absl::Status status = coordinator_->Cancel(request_id);
    if (status.ok()) {
      for (auto& stage : stages_) stage->Forget(request_id);
    }
    return status;
  }

  int num_stages() const { return static_cast<int>(stages_.size()); }
  PipelineStage& stage(int i) { return *stages_[i]; }
  PrefillCoordinator& coordinator() { return *coordinator_; }

 private:
  InProcessPrefillGroup() = default;

  // Declaration order is teardown order in reverse: stages report into the
  // coordinator and read the links, so they go first (see the destructor).
  std::vector<std::unique_ptr<InProcessStageLink>> links_;  // into stage i
  std::unique_ptr<PrefillCoordinator> coordinator_;
  std::vector<std::unique_ptr<PipelineStage>> stages_;
};

}  // namespace pdserve::prefill
