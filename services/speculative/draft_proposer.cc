#include "speculative/draft_proposer.h"

#include <algorithm>
#include <optional>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/llama_engine.h"
#include "engine/sampler.h"
#include "kv/block_manager.h"
#include "kv/kv_pool.h"
#include "kv/sequence_blocks.h"

namespace pdserve::speculative {
namespace {

class DraftModelProposer final : public Proposer {
 public:
  DraftModelProposer(std::unique_ptr<engine::LlamaEngine> engine,
                     std::unique_ptr<kv::KvPool> pool,
                     std::unique_ptr<kv::KvBlockManager> manager,
                     double cost_per_token)
      : engine_(std::move(engine)),
        pool_(std::move(pool)),
        manager_(std::move(manager)),
        cost_per_token_(cost_per_token) {}

  std::string_view name() const override { return "draft"; }
  double cost_per_token() const override { return cost_per_token_; }
  void Forget(uint64_t request_id) override { states_.erase(request_id); }

  absl::Status Propose(std::span<const ProposalRequest> requests,
                       std::vector<Proposal>* proposals) override {
    proposals->assign(requests.size(), Proposal{});
    const int max_pos = engine_->config().max_position_embeddings;
    // Per participating request: how many tokens it still drafts.
    struct Active {
      size_t index;
      State* state;
      int gamma;
      std::vector<int32_t> feed;  // tokens of the next draft step
      int start = 0;
    };
    std::vector<Active> active;
    for (size_t i = 0; i < requests.size(); ++i) {
      const auto& r = requests[i];
      const int len = static_cast<int>(r.history.size());
      const int gamma = std::min(r.max_tokens, max_pos - len);
      if (gamma <= 0 || len == 0) continue;
      std::unique_ptr<State>& slot = states_[r.request_id];
      if (slot == nullptr) slot = std::make_unique<State>(manager_.get());
      State& s = *slot;
      // Longest common prefix of the draft's cache and the history, but
      // leave at least the last history token to feed (its logits give d_1).
      size_t common = 0;
      while (common < s.tokens.size() && common + 1 < r.history.size() &&
             s.tokens[common] == r.history[common])
        ++common;
      if (!s.sequence.Truncate(static_cast<int64_t>(common)).ok() ||
          !s.sequence.Reserve(len + gamma - 1).ok()) {
        // Out of draft KV: drop this request's cache; no proposal this step.
        s.sequence.Release();
        s.tokens.clear();
        continue;
      }
      s.tokens.assign(r.history.begin(), r.history.begin() + common);
      Active a{i, &s, gamma, {}, static_cast<int>(common)};
      a.feed.assign(r.history.begin() + common, r.history.end());
      active.push_back(std::move(a));
    }
    const int vocab = engine_->config().vocab_size;
    std::vector<float> q;
    std::vector<float> processed;
    std::vector<int32_t> output;
    const std::vector<int32_t> end_tokens = engine_->config().EndTokenIds();
    while (!active.empty()) {
      engine::ForwardBatch batch;
      std::vector<std::vector<int32_t>> tables(active.size());
      for (size_t k = 0; k < active.size(); ++k) {
        Active& a = active[k];
        auto blocks = a.state->sequence.block_table();
        tables[k].assign(blocks.begin(), blocks.end());
        engine::SequenceStep step;
        step.tokens = a.feed;
        step.num_tokens = static_cast<int>(a.feed.size());
        step.start_position = a.start;
        step.block_table = tables[k];
        step.logit_indices = {step.num_tokens - 1};
        batch.sequences.push_back(std::move(step));
      }
      // Greedy drafts need only each row's argmax (a GPU draft then skips
      // copying its logits).
      batch.argmax_only = true;
      for (const Active& a : active) {
        const engine::SamplingParams& sampling = requests[a.index].sampling;
        if (!sampling.greedy() || sampling.processes_logits()) {
          batch.argmax_only = false;
        }
      }
      engine::ForwardResult result;
      PDS_RETURN_IF_ERROR(engine_->Forward(batch, *pool_, &result));
      std::vector<Active> next;
      for (size_t k = 0; k < active.size(); ++k) {
        Active& a = active[k];
        const auto& r = requests[a.index];
        Proposal& p = (*proposals)[a.index];
        a.state->tokens.insert(a.state->tokens.end(), a.feed.begin(),
                               a.feed.end());
        int32_t token;
        const uint64_t index = r.first_output_index + p.tokens.size();
        if (r.sampling.greedy() && !r.sampling.processes_logits()) {
          token = result.argmax[k];
        } else {
          std::span<const float> logits(result.logits.data() + k * vocab,
                                        vocab);
          if (r.sampling.processes_logits()) {
            // The draft follows the target's logit processors (same history,
            // drafts so far included) so that its guesses survive them;
            // losslessness does not depend on it (q is reported as drawn).
            const size_t prompt_len = r.history.size() - r.first_output_index;
            output.assign(r.history.begin() + prompt_len, r.history.end());
            output.insert(output.end(), p.tokens.begin(), p.tokens.end());
            processed.assign(logits.begin(), logits.end());
            engine::ApplyLogitProcessors(
                processed, r.sampling,
                {r.history.first(prompt_len), output, end_tokens}, index);
            logits = processed;
          }
          if (r.sampling.greedy()) {
            token = engine::ArgMax(logits);
          } else {
            engine::SamplingDistribution(logits, r.sampling, &q);
            token = engine::DrawFromDistribution(
                q, engine::UniformForRequest(r.sampling.seed, index,
                                             kDraftStream));
            p.probs.push_back(q);
          }
        }
        p.tokens.push_back(token);
        if (static_cast<int>(p.tokens.size()) < a.gamma) {
          a.start += static_cast<int>(a.feed.size());
          a.feed = {token};
          next.push_back(std::move(a));
        }
      }
      active = std::move(next);
    }
    return absl::OkStatus();
  }

 private:
  struct State {
    explicit State(kv::KvBlockManager* manager) : sequence(manager) {}
    kv::KvSequence sequence;
    std::vector<int32_t> tokens;  // tokens whose KV the draft cache holds
  };

  std::unique_ptr<engine::LlamaEngine> engine_;
  std::unique_ptr<kv::KvPool> pool_;
  std::unique_ptr<kv::KvBlockManager> manager_;
  double cost_per_token_;
  // Declared after manager_ so sequences are released before it dies. Boxed:
  // Propose keeps State pointers while inserting other requests' states.
  absl::flat_hash_map<uint64_t, std::unique_ptr<State>> states_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Proposer>> MakeDraftModelProposer(
    const model::WeightSource& weights, const DraftModelOptions& options) {
  if (options.block_size <= 0 || options.num_blocks <= 0)
    return absl::InvalidArgumentError(
        absl::StrCat("draft KV needs block_size > 0 and num_blocks > 0, got ",
                     options.block_size, " and ", options.num_blocks));
  engine::EngineOptions engine_options;
  engine_options.num_threads = options.num_threads;
  engine_options.backend = options.backend;
  engine_options.cuda = options.cuda;
  PDS_ASSIGN_OR_RETURN(auto engine,
                       engine::LlamaEngine::Create(weights, engine_options));
  PDS_ASSIGN_OR_RETURN(
      auto pool, engine->CreateKvPool(options.block_size, options.num_blocks));
  PDS_ASSIGN_OR_RETURN(
      auto manager,
      kv::KvBlockManager::Create(options.num_blocks, options.block_size));
  return std::make_unique<DraftModelProposer>(
      std::move(engine), std::move(pool), std::move(manager),
      options.cost_per_token);
}

}  // namespace pdserve::speculative
