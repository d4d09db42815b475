// What the decode worker's next step computes (internal to services/decode):
// which running requests propose drafts and how many, which requests the
// step feeds within its token budget and the KV (preempting the youngest
// when the KV runs out), and the batch every TP rank runs. Pure scheduling:
// no engine, no streaming; decode_worker.cc runs the step and applies its
// results.
//
// Scheduler thread only.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "decode/scheduled_request.h"
#include "engine/engine_types.h"
#include "speculative/proposer.h"

namespace pdserve::decode {

// What one request contributes to the step.
struct Planned {
  ScheduledRequest* request = nullptr;
  int history_feed = 0;  // tokens of history fed
  std::vector<int32_t> drafts;
  std::vector<std::vector<float>> draft_probs;
  bool wants_logits = false;
  // Leading rows (positions kv_tokens ..) whose logits only score the
  // prompt (ScheduledRequest::scoring): they precede the wants_logits rows.
  int score_rows = 0;

  int fed() const { return history_feed + static_cast<int>(drafts.size()); }
};

// One forward step as every rank sees it. Owns the storage the batch's spans
// point into; lives until every rank reported back.
struct StepWork {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::vector<int32_t>> tables;
  engine::ForwardBatch batch;
};

struct StepLimits {
  int max_step_tokens = 0;
  // Speculation is off for the step when more requests than this decode.
  int speculation_max_batch = 0;
  int max_position = 0;  // the model's context
};

using Proposals = absl::flat_hash_map<ScheduledRequest*, speculative::Proposal>;

// Drafts for the decoding requests among `running` (nothing when there is no
// proposer or too many decode). γ per request from its AdaptiveGamma,
// never past max_new_tokens (the bonus token counts) or the context. A
// proposer failure is logged and the step decodes without drafts.
Proposals ProposeDrafts(const std::vector<ScheduledRequest*>& running,
                        speculative::Proposer* proposer,
                        const StepLimits& limits);

// The step's requests, oldest first, within the token budget, each with KV
// reserved for what it feeds. When the KV is short, `preempt` is called on
// the youngest running request (which removes it from `running`) until the
// current one fits — or it was the youngest itself, and the plan stops.
std::vector<Planned> PlanStep(
    const std::vector<ScheduledRequest*>& running, const Proposals& proposals,
    const StepLimits& limits,
    const std::function<void(ScheduledRequest*)>& preempt);

// The batch every rank runs. `argmax_only` when every sampled row is greedy
// and nobody asked for logprobs, prompt scores, or to watch the logits
// (`logits_watched`): a GPU engine then copies rows x 4 bytes instead of
// rows x vocab x 4.
std::shared_ptr<StepWork> BuildStepWork(const std::vector<Planned>& plan,
                                        bool logits_watched);

}  // namespace pdserve::decode
