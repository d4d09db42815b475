#include "decode/step_planner.h"

#include <algorithm>

#include "common/logging.h"

namespace pdserve::decode {

Proposals ProposeDrafts(const std::vector<ScheduledRequest*>& running,
                        speculative::Proposer* proposer,
                        const StepLimits& limits) {
  Proposals proposals;
  if (proposer == nullptr) return proposals;
  int decoding = 0;
  for (const ScheduledRequest* r : running) decoding += r->decoding();
  if (decoding > limits.speculation_max_batch) return proposals;
  std::vector<speculative::ProposalRequest> asks;
  std::vector<ScheduledRequest*> askers;
  for (ScheduledRequest* r : running) {
    if (!r->decoding()) continue;
    const int64_t len = static_cast<int64_t>(r->history.size());
    int64_t gamma = r->gamma.NextGamma();
    gamma =
        std::min<int64_t>(gamma, r->params.max_new_tokens - r->generated - 1);
    gamma = std::min<int64_t>(gamma, limits.max_position - len);
    if (gamma <= 0) continue;
    speculative::ProposalRequest a;
    a.request_id = r->id;
    a.history = r->history;
    a.max_tokens = static_cast<int>(gamma);
    a.sampling = r->params.sampling;
    a.first_output_index = static_cast<uint64_t>(r->generated);
    asks.push_back(a);
    askers.push_back(r);
  }
  if (asks.empty()) return proposals;
  std::vector<speculative::Proposal> out;
  const absl::Status s = proposer->Propose(asks, &out);
  if (!s.ok()) {
    PDS_LOG(WARNING) << "proposer " << proposer->name()
                     << " failed, decoding without drafts: " << s;
    return proposals;
  }
  for (size_t i = 0; i < askers.size(); ++i) {
    proposals[askers[i]] = std::move(out[i]);
  }
  return proposals;
}

std::vector<Planned> PlanStep(
    const std::vector<ScheduledRequest*>& running, const Proposals& proposals,
    const StepLimits& limits,
    const std::function<void(ScheduledRequest*)>& preempt) {
  std::vector<Planned> plan;
  int budget = limits.max_step_tokens;
  // `running` shrinks as requests are preempted (always from its end).
  for (size_t i = 0; i < running.size() && budget > 0; ++i) {
    ScheduledRequest* r = running[i];
    const int64_t len = static_cast<int64_t>(r->history.size());
    Planned p;
    p.request = r;
    p.history_feed =
        static_cast<int>(std::min<int64_t>(len - r->kv_tokens, budget));
    p.wants_logits = r->kv_tokens + p.history_feed == len;
    if (r->scoring()) {
      // Positions before the last prompt token predict prompt tokens; the
      // last one (wants_logits) predicts output token 0.
      p.score_rows = p.history_feed - (p.wants_logits ? 1 : 0);
    }
    if (p.wants_logits && p.history_feed == 1) {
      auto it = proposals.find(r);
      if (it != proposals.end()) {
        const speculative::Proposal& prop = it->second;
        const size_t keep = std::min<size_t>(prop.tokens.size(), budget - 1);
        p.drafts.assign(prop.tokens.begin(), prop.tokens.begin() + keep);
        if (!prop.probs.empty()) {
          p.draft_probs.assign(prop.probs.begin(), prop.probs.begin() + keep);
        }
      }
    }
    // KV for this step; preempt the youngest running requests until it fits.
    bool preempted_self = false;
    while (!r->sequence->Reserve(r->kv_tokens + p.fed()).ok()) {
      ScheduledRequest* victim = running.back();
      if (victim == r) {
        preempted_self = true;
        break;
      }
      preempt(victim);
    }
    if (preempted_self) {
      preempt(r);
      break;  // r was the youngest: nobody after it
    }
    budget -= p.fed();
    plan.push_back(std::move(p));
  }
  return plan;
}

std::shared_ptr<StepWork> BuildStepWork(const std::vector<Planned>& plan,
                                        bool logits_watched) {
  auto work = std::make_shared<StepWork>();
  work->tokens.resize(plan.size());
  work->tables.resize(plan.size());
  bool argmax_only = !logits_watched;
  for (size_t k = 0; k < plan.size(); ++k) {
    const Planned& p = plan[k];
    const ScheduledRequest* r = p.request;
    auto& tokens = work->tokens[k];
    tokens.assign(r->history.begin() + r->kv_tokens,
                  r->history.begin() + r->kv_tokens + p.history_feed);
    tokens.insert(tokens.end(), p.drafts.begin(), p.drafts.end());
    auto blocks = r->sequence->block_table();
    work->tables[k].assign(blocks.begin(), blocks.end());
    engine::SequenceStep step;
    step.tokens = tokens;
    step.num_tokens = static_cast<int>(tokens.size());
    step.start_position = static_cast<int>(r->kv_tokens);
    step.block_table = work->tables[k];
    for (int q = 0; q < p.score_rows; ++q) step.logit_indices.push_back(q);
    if (p.wants_logits) {
      for (int q = p.history_feed - 1; q < step.num_tokens; ++q) {
        step.logit_indices.push_back(q);
      }
    }
    work->batch.sequences.push_back(std::move(step));
    // Logit processors change the greedy choice: the raw arg-max is not it.
    const engine::SamplingParams& sampling = r->params.sampling;
    if (p.score_rows > 0 ||
        (p.wants_logits && (!sampling.greedy() || sampling.processes_logits() ||
                            r->params.wants_logprobs()))) {
      argmax_only = false;
    }
  }
  work->batch.argmax_only = argmax_only;
  return work;
}

}  // namespace pdserve::decode
