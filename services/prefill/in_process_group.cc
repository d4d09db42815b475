#include "prefill/in_process_group.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "prefill/layer_split.h"

namespace pdserve::prefill {

absl::StatusOr<std::unique_ptr<InProcessPrefillGroup>>
InProcessPrefillGroup::Create(const model::WeightSource& weights,
                              const PrefillGroupOptions& options,
                              StageKvOutput* kv_out) {
  const int layers = weights.config().num_layers;
  std::vector<int> split = options.layer_split;
  if (split.empty()) split = {layers};
  int64_t covered = 0;
  for (int n : split) {
    if (n < 1) {
      return absl::InvalidArgumentError(
          "every pipeline stage needs at least one layer");
    }
    covered += n;
  }
  if (covered != layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer split covers ", covered, " layers but the model has ", layers));
  }
  const int num_stages = static_cast<int>(split.size());
  auto group =
      std::unique_ptr<InProcessPrefillGroup>(new InProcessPrefillGroup);
  for (int i = 0; i < num_stages; ++i) {
    group->links_.push_back(std::make_unique<InProcessStageLink>());
  }
  PDS_ASSIGN_OR_RETURN(
      group->coordinator_,
      PrefillCoordinator::Create(weights.config(), num_stages,
                                 options.scheduler, group->links_[0].get()));
  const std::vector<engine::ShardSpec> shards = SplitToShards(split);
  for (int i = 0; i < num_stages; ++i) {
    PipelineStageOptions stage_options;
    stage_options.stage_index = i;
    stage_options.num_stages = num_stages;
    stage_options.shard = shards[i];
    stage_options.block_size = options.scheduler.block_size;
    stage_options.num_blocks = options.scheduler.num_blocks;
    stage_options.threads = options.threads_per_stage;
    stage_options.backend = options.backend;
    stage_options.cuda = options.cuda;
    if (stage_options.cuda.max_logit_rows == 0) {
      // As prefill_worker: a microbatch scoring its prompts asks for a row
      // per token.
      stage_options.cuda.max_logit_rows =
          std::max(options.scheduler.microbatch_token_budget,
                   options.scheduler.chunk_policy.chunk_tokens);
    }
    stage_options.kv_dtype = options.kv_dtype;
    stage_options.structured_output = options.structured_output;
    StageSender* out =
        i + 1 < num_stages ? group->links_[i + 1].get() : nullptr;
    PDS_ASSIGN_OR_RETURN(
        auto stage,
        PipelineStage::Create(weights, stage_options, group->links_[i].get(),
                              out, group->coordinator_.get(), kv_out));
    if (options.kv_output_factory) {
      PDS_ASSIGN_OR_RETURN(StageKvOutput * stage_out,
                           options.kv_output_factory(i, stage->mutable_pool()));
      stage->set_kv_output(stage_out);
    }
    group->stages_.push_back(std::move(stage));
  }
  for (auto& stage : group->stages_) stage->Start();
  return group;
}

InProcessPrefillGroup::~InProcessPrefillGroup() {
  // Stop scheduling first, then let the stages drain what they hold (each
  // closes the link after it), then free the coordinator they report to.
  if (coordinator_ != nullptr) coordinator_->Shutdown();
  if (!links_.empty()) links_[0]->Close();
  for (auto& stage : stages_) stage->Join();
  // Stages that never started (Create failed half-way) have nothing to join;
  // close every link so none is left waiting.
  for (auto& link : links_) link->Close();
  stages_.clear();
  coordinator_.reset();
}

}  // namespace pdserve::prefill
