#include "prefill/prefill_coordinator.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kv/sequence_blocks.h"

namespace pdserve::prefill {

// ---------------------------------------------------------------------------
// PrefillTicket
// ---------------------------------------------------------------------------

bool PrefillTicket::done() const {
  absl::MutexLock lock(&mu_);
  return result_.has_value();
}

absl::StatusOr<PrefillOutcome> PrefillTicket::Wait(
    absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return result_.has_value();
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&ready), timeout)) {
    return absl::DeadlineExceededError(
        absl::StrCat("prefill of request ", request_id_,
                     " still running after ", absl::FormatDuration(timeout)));
  }
  return *result_;
}

void PrefillTicket::OnDone(
    std::function<void(const absl::StatusOr<PrefillOutcome>&)> fn) {
  {
    absl::MutexLock lock(&mu_);
    if (!result_.has_value()) {
      on_done_ = std::move(fn);
      return;
    }
  }
  // result_ never changes once set, so reading it unlocked is safe.
  fn(*result_);
}

void PrefillTicket::Finish(absl::StatusOr<PrefillOutcome> result) {
  std::function<void(const absl::StatusOr<PrefillOutcome>&)> fn;
  {
    absl::MutexLock lock(&mu_);
    if (result_.has_value()) return;
    result_ = std::move(result);
    fn = std::move(on_done_);
  }
  // Outside the lock: the callback may Wait() or inspect the ticket.
  if (fn) fn(*result_);
}

// ---------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------

absl::Status ValidatePrefillRequest(const model::ModelConfig& config,
                                    const PrefillRequest& request) {
  if (request.prompt.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("request ", request.request_id, ": prompt is empty"));
  }
  if (static_cast<int64_t>(request.prompt.size()) >
      config.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request ", request.request_id, ": prompt has ", request.prompt.size(),
        " tokens but the model's context is ", config.max_position_embeddings,
        " tokens"));
  }
  for (size_t i = 0; i < request.prompt.size(); ++i) {
    const int32_t token = request.prompt[i];
    if (token < 0 || token >= config.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "request ", request.request_id, ": prompt token ", i, " is ", token,
          ", outside the vocabulary [0, ", config.vocab_size, ")"));
    }
  }
  if (absl::Status s = request.sampling.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request ", request.request_id, ": sampling: ", s.message()));
  }
  if (request.top_logprobs < 0 ||
      request.top_logprobs > engine::kMaxTopLogprobs) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request ", request.request_id, ": top_logprobs ", request.top_logprobs,
        " is outside [0, ", engine::kMaxTopLogprobs, "]"));
  }
  if (request.kv_dst_offset < 0 ||
      request.kv_dst_offset >= static_cast<int64_t>(request.prompt.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("request ", request.request_id, ": KV destination offset ",
                     request.kv_dst_offset, " is outside the prompt [0, ",
                     request.prompt.size(), ")"));
  }
  if (!request.write_kv && !request.kv_grants.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("request ", request.request_id,
                     ": KV grants given for a request that writes no KV"));
  }
  if (request.chunk_policy.has_value()) {
    if (absl::Status s = request.chunk_policy->Validate(); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "request ", request.request_id, ": chunk policy: ", s.message()));
    }
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// PrefillCoordinator
// ---------------------------------------------------------------------------

struct PrefillCoordinator::RequestState {
  PrefillRequest request;
  std::shared_ptr<PrefillTicket> ticket;
  std::optional<kv::KvSequence> sequence;  // set once admitted
  std::vector<int32_t> block_table;        // of `sequence`, engine-typed
  int64_t cached_tokens = 0;
  int num_chunks = 0;
  int chunks_in_flight = 0;
  bool first_token_received = false;
  engine::SampledToken first_token;
  std::vector<engine::TokenLogprobs> prompt_logprobs;
  int kv_written_stages = 0;
  absl::Status status;  // first failure
};

absl::StatusOr<std::unique_ptr<PrefillCoordinator>> PrefillCoordinator::Create(
    const model::ModelConfig& config, int num_stages,
    const SchedulerOptions& options, StageSender* stage0) {
  if (num_stages < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("number of stages must be >= 1, got ", num_stages));
  }
  if (stage0 == nullptr) {
    return absl::InvalidArgumentError(
        "the coordinator needs a link to stage 0");
  }
  if (options.microbatch_token_budget < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("microbatch token budget must be >= 1, got ",
                     options.microbatch_token_budget));
  }
  if (options.max_in_flight < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max microbatches in flight must be >= 0, got ",
                     options.max_in_flight));
  }
  PDS_RETURN_IF_ERROR(options.chunk_policy.Validate());
  PDS_ASSIGN_OR_RETURN(
      auto blocks,
      kv::KvBlockManager::Create(options.num_blocks, options.block_size));
  auto coordinator = std::unique_ptr<PrefillCoordinator>(new PrefillCoordinator(
      config, num_stages, options, stage0, std::move(blocks)));
  coordinator->thread_ = std::thread([c = coordinator.get()] { c->Run(); });
  return coordinator;
}

PrefillCoordinator::PrefillCoordinator(
    const model::ModelConfig& config, int num_stages,
    const SchedulerOptions& options, StageSender* stage0,
    std::unique_ptr<kv::KvBlockManager> blocks)
    : config_(config),
      num_stages_(num_stages),
      options_(options),
      stage0_(stage0),
      blocks_(std::move(blocks)),
      former_(options.microbatch_token_budget) {}

PrefillCoordinator::~PrefillCoordinator() { Shutdown(); }

void PrefillCoordinator::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    shut_down_ = true;
  }
  inbox_.Close();
  if (thread_.joinable()) thread_.join();
}

absl::StatusOr<std::shared_ptr<PrefillTicket>> PrefillCoordinator::Submit(
    PrefillRequest request) {
  PDS_RETURN_IF_ERROR(ValidatePrefillRequest(config_, request));
  const int64_t needed_blocks =
      (static_cast<int64_t>(request.prompt.size()) + options_.block_size - 1) /
      options_.block_size;
  if (request.kv_dst_offset % options_.block_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request ", request.request_id, ": KV destination offset ",
        request.kv_dst_offset, " is not a multiple of the block size ",
        options_.block_size));
  }
  if (needed_blocks > blocks_->num_blocks()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "request ", request.request_id, ": prompt needs ", needed_blocks,
        " KV blocks of ", options_.block_size,
        " tokens but the prefill group has ", blocks_->num_blocks()));
  }
  const uint64_t id = request.request_id;
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) {
      return absl::UnavailableError("prefill group is shutting down");
    }
    if (!active_ids_.insert(id).second) {
      return absl::AlreadyExistsError(
          absl::StrCat("request ", id, " is already being prefilled"));
    }
  }
  auto ticket = std::make_shared<PrefillTicket>(id);
  if (!inbox_.Push(SubmitCommand{std::move(request), ticket})) {
    absl::MutexLock lock(&mu_);
    active_ids_.erase(id);
    return absl::UnavailableError("prefill group is shutting down");
  }
  return ticket;
}

absl::Status PrefillCoordinator::Cancel(uint64_t request_id) {
  {
    absl::MutexLock lock(&mu_);
    if (!active_ids_.contains(request_id)) {
      return absl::NotFoundError(
          absl::StrCat("request ", request_id, " is not being prefilled"));
    }
  }
  inbox_.Push(CancelCommand{request_id});
  return absl::OkStatus();
}

void PrefillCoordinator::Report(StageEvent event) {
  inbox_.Push(std::move(event));
}

CoordinatorStats PrefillCoordinator::stats() const {
  CoordinatorStats stats;
  {
    absl::MutexLock lock(&mu_);
    stats = stats_;
    stats.active_requests = static_cast<int64_t>(active_ids_.size());
  }
  stats.used_blocks = blocks_->used_blocks();
  return stats;
}

void PrefillCoordinator::Run() {
  while (std::optional<Command> command = inbox_.Pop()) {
    std::visit([this](auto&& c) { Handle(std::move(c)); }, std::move(*command));
    Launch();
  }
  // Shut down: nothing more will arrive from the stages.
  std::vector<uint64_t> ids;
  for (const auto& [id, state] : requests_) ids.push_back(id);
  for (uint64_t id : ids) {
    Finish(id, absl::UnavailableError("prefill group is shutting down"));
  }
}

void PrefillCoordinator::Handle(SubmitCommand command) {
  const uint64_t id = command.request.request_id;
  auto state = std::make_unique<RequestState>();
  state->request = std::move(command.request);
  state->ticket = std::move(command.ticket);
  requests_[id] = std::move(state);
  admission_.push_back(id);
  TryAdmit();
}

void PrefillCoordinator::TryAdmit() {
  while (!admission_.empty()) {
    const uint64_t id = admission_.front();
    RequestState& state = *requests_.at(id);
    const std::vector<int32_t>& prompt = state.request.prompt;
    const int total = static_cast<int>(prompt.size());
    kv::KvSequence sequence(blocks_.get());
    int64_t cached = 0;
    if (options_.prefix_reuse && !state.request.prompt_logprobs) {
      kv::KvSequenceStart start =
          kv::KvSequence::StartWithPrefix(blocks_.get(), prompt);
      sequence = std::move(start.sequence);
      cached = start.cached_tokens;
    }
    if (!sequence.Reserve(total).ok()) return;  // wait for blocks to free up
    admission_.erase(admission_.begin());
    state.cached_tokens = cached;
    for (kv::BlockId block : sequence.block_table()) {
      state.block_table.push_back(static_cast<int32_t>(block));
    }
    state.sequence.emplace(std::move(sequence));
    const ChunkPolicy& policy =
        state.request.chunk_policy.value_or(options_.chunk_policy);
    std::vector<int> chunks =
        PlanChunks(policy, static_cast<int>(cached), total);
    state.num_chunks = static_cast<int>(chunks.size());
    former_.Add(id, static_cast<int>(cached), chunks);
    absl::MutexLock lock(&mu_);
    stats_.cached_tokens += cached;
  }
}

void PrefillCoordinator::Launch() {
  // Default 2S: with only S in flight a stage idles while its finished
  // microbatch travels to the coordinator and the next is formed and sent
  // (measured with bench/prefill_bench, llama-110m S = 2: bubble 21% at D = S,
  // 10% at D = 2S; tokens/s 1.40x -> 1.75x of S = 1).
  const int limit =
      options_.max_in_flight > 0 ? options_.max_in_flight : 2 * num_stages_;
  while (in_flight_ < limit) {
    std::optional<Microbatch> batch = former_.Next();
    if (!batch.has_value()) return;
    StageMessage message;
    message.microbatch_id = batch->id;
    for (const ChunkWork& chunk : batch->chunks) {
      RequestState& state = *requests_.at(chunk.request_id);
      ChunkHeader header;
      header.request_id = chunk.request_id;
      header.token_begin = chunk.token_begin;
      header.token_end = chunk.token_end;
      header.kv_begin = chunk.kv_begin;
      header.final_chunk = chunk.final_chunk;
      header.tokens.assign(state.request.prompt.begin() + chunk.token_begin,
                           state.request.prompt.begin() + chunk.token_end);
      const size_t blocks =
          (chunk.token_end + options_.block_size - 1) / options_.block_size;
      header.block_table.assign(state.block_table.begin(),
                                state.block_table.begin() + blocks);
      header.sampling = state.request.sampling;
      if (chunk.final_chunk && header.sampling.penalizes_prompt_tokens()) {
        header.penalized_prompt_tokens = state.request.prompt;
        std::sort(header.penalized_prompt_tokens.begin(),
                  header.penalized_prompt_tokens.end());
        header.penalized_prompt_tokens.erase(
            std::unique(header.penalized_prompt_tokens.begin(),
                        header.penalized_prompt_tokens.end()),
            header.penalized_prompt_tokens.end());
      }
      header.top_logprobs = state.request.top_logprobs;
      header.prompt_logprobs = state.request.prompt_logprobs;
      header.next_token =
          chunk.final_chunk ? -1 : state.request.prompt[chunk.token_end];
      header.write_kv = state.request.write_kv;
      if (chunk.chunk_index == 0) header.kv_grants = state.request.kv_grants;
      header.kv_dst_offset = state.request.kv_dst_offset;
      message.chunks.push_back(std::move(header));
      ++state.chunks_in_flight;
    }
    ++in_flight_;
    {
      absl::MutexLock lock(&mu_);
      ++stats_.microbatches;
    }
    std::vector<uint64_t> ids;
    for (const ChunkHeader& h : message.chunks) ids.push_back(h.request_id);
    if (absl::Status sent = stage0_->Send(std::move(message)); !sent.ok()) {
      // Nothing of this microbatch reached a stage.
      --in_flight_;
      for (uint64_t id : ids) {
        --requests_.at(id)->chunks_in_flight;
        Fail(id, sent);
      }
    }
  }
}

void PrefillCoordinator::Handle(const CancelCommand& command) {
  const uint64_t id = command.request_id;
  auto it = std::find(admission_.begin(), admission_.end(), id);
  if (it != admission_.end()) {
    admission_.erase(it);
    Finish(id,
           absl::CancelledError(absl::StrCat("request ", id, " cancelled")));
    TryAdmit();
    return;
  }
  if (requests_.contains(id)) {
    Fail(id, absl::CancelledError(absl::StrCat("request ", id, " cancelled")));
  }
}

void PrefillCoordinator::Handle(const StageEvent& event) {
  switch (event.kind) {
    case StageEvent::Kind::kMicrobatchDone: {
      const bool leaves_pipeline =
          !event.status.ok() || event.stage == num_stages_ - 1;
      if (!leaves_pipeline) return;
      --in_flight_;
      for (uint64_t id : event.request_ids) {
        auto it = requests_.find(id);
        if (it == requests_.end()) continue;
        --it->second->chunks_in_flight;
        if (!event.status.ok()) {
          Fail(id, event.status);
        } else {
          MaybeFinish(id);
        }
      }
      return;
    }
    case StageEvent::Kind::kFirstToken: {
      auto it = requests_.find(event.request_id);
      if (it == requests_.end()) return;
      if (!event.status.ok()) {
        // The first token could not be sampled (structured output's grammar).
        Fail(event.request_id, event.status);
        return;
      }
      it->second->first_token_received = true;
      it->second->first_token = event.token;
      MaybeFinish(event.request_id);
      return;
    }
    case StageEvent::Kind::kPromptLogprobs: {
      auto it = requests_.find(event.request_id);
      if (it == requests_.end()) return;
      RequestState& state = *it->second;
      // Chunks of a request leave the last stage in order, so the scores
      // arrive contiguous; anything else is a peer's bug.
      const size_t expected_first = state.prompt_logprobs.size() + 1;
      if (!state.request.prompt_logprobs ||
          event.first_scored != static_cast<int>(expected_first) ||
          expected_first - 1 + event.prompt_logprobs.size() >=
              state.request.prompt.size()) {
        Fail(event.request_id,
             absl::InternalError(absl::StrCat(
                 "request ", event.request_id, ": prompt scores from position ",
                 event.first_scored, " (", event.prompt_logprobs.size(),
                 " entries) do not continue the ", state.prompt_logprobs.size(),
                 " received")));
        return;
      }
      state.prompt_logprobs.insert(state.prompt_logprobs.end(),
                                   event.prompt_logprobs.begin(),
                                   event.prompt_logprobs.end());
      return;
    }
    case StageEvent::Kind::kKvWritten: {
      auto it = requests_.find(event.request_id);
      if (it == requests_.end()) return;
      if (!event.status.ok()) {
        Fail(event.request_id, event.status);
      } else {
        ++it->second->kv_written_stages;
        MaybeFinish(event.request_id);
      }
      return;
    }
  }
}

void PrefillCoordinator::Fail(uint64_t request_id, const absl::Status& status) {
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return;
  if (it->second->status.ok()) it->second->status = status;
  former_.Remove(request_id);
  MaybeFinish(request_id);
}

void PrefillCoordinator::MaybeFinish(uint64_t request_id) {
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return;
  RequestState& state = *it->second;
  // Blocks stay held while any stage may still compute into them.
  if (state.chunks_in_flight > 0) return;
  if (!state.status.ok()) {
    Finish(request_id, state.status);
    return;
  }
  if (!state.first_token_received || state.kv_written_stages < num_stages_) {
    return;
  }
  if (options_.prefix_reuse && state.sequence.has_value()) {
    // Every stage holds this prompt's KV now: later prompts sharing its full
    // leading blocks skip that compute.
    (void)state.sequence->PublishFullBlocks(state.request.prompt);
  }
  if (state.request.prompt_logprobs &&
      state.prompt_logprobs.size() + 1 != state.request.prompt.size()) {
    Finish(request_id,
           absl::InternalError(absl::StrCat(
               "request ", request_id, ": ", state.prompt_logprobs.size(),
               " prompt tokens scored of ", state.request.prompt.size() - 1)));
    return;
  }
  PrefillOutcome outcome;
  outcome.request_id = request_id;
  outcome.prompt_logprobs = std::move(state.prompt_logprobs);
  outcome.first_token = state.first_token;
  outcome.cached_tokens = state.cached_tokens;
  outcome.num_chunks = state.num_chunks;
  Finish(request_id, outcome);
}

void PrefillCoordinator::Finish(uint64_t request_id,
                                absl::StatusOr<PrefillOutcome> result) {
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return;
  std::unique_ptr<RequestState> state = std::move(it->second);
  requests_.erase(it);
  former_.Remove(request_id);
  auto queued = std::find(admission_.begin(), admission_.end(), request_id);
  if (queued != admission_.end()) admission_.erase(queued);
  const bool ok = result.ok();
  state->sequence.reset();  // releases the blocks (published ones stay cached)
  {
    absl::MutexLock lock(&mu_);
    active_ids_.erase(request_id);
    if (ok) {
      ++stats_.completed;
    } else {
      ++stats_.failed;
    }
  }
  state->ticket->Finish(std::move(result));
  TryAdmit();
}

}  // namespace pdserve::prefill
