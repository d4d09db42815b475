#include "prefill/pipeline_stage.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace pdserve::prefill {

absl::StatusOr<std::unique_ptr<PipelineStage>> PipelineStage::Create(
    const model::WeightSource& weights, const PipelineStageOptions& options,
    StageReceiver* in, StageSender* out, StageEventSink* events,
    StageKvOutput* kv_out) {
  if (in == nullptr || events == nullptr) {
    return absl::InvalidArgumentError(
        "a pipeline stage needs an input link and an event sink");
  }
  if (options.num_blocks <= 0 || options.block_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("stage ", options.stage_index,
                     " needs a positive block size and count, got ",
                     options.block_size, " x ", options.num_blocks));
  }
  engine::EngineOptions engine_options;
  engine_options.shard = options.shard;
  engine_options.num_threads = options.threads;
  engine_options.backend = options.backend;
  engine_options.kv_dtype = options.kv_dtype;
  engine_options.quantized_matmul = options.quantized_matmul;
  engine_options.cuda = options.cuda;
  PDS_ASSIGN_OR_RETURN(auto engine,
                       engine::LlamaEngine::Create(weights, engine_options));
  if (engine->holds_last_layer() != (out == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stage ", options.stage_index,
        engine->holds_last_layer()
            ? " holds the last layer but has a next stage"
            : " does not hold the last layer but has no next stage"));
  }
  PDS_ASSIGN_OR_RETURN(
      auto pool, engine->CreateKvPool(options.block_size, options.num_blocks));
  std::unique_ptr<kv::KvPool> landing;
  if (engine->kv_on_device()) {
    PDS_ASSIGN_OR_RETURN(
        landing, kv::KvPool::Create(pool->layout(), options.num_blocks));
  }
  return std::unique_ptr<PipelineStage>(
      new PipelineStage(options, std::move(engine), std::move(pool),
                        std::move(landing), in, out, events, kv_out));
}

PipelineStage::PipelineStage(const PipelineStageOptions& options,
                             std::unique_ptr<engine::LlamaEngine> engine,
                             std::unique_ptr<kv::KvPool> pool,
                             std::unique_ptr<kv::KvPool> landing,
                             StageReceiver* in, StageSender* out,
                             StageEventSink* events, StageKvOutput* kv_out)
    : options_(options),
      engine_(std::move(engine)),
      pool_(std::move(pool)),
      landing_(std::move(landing)),
      in_(in),
      out_(out),
      events_(events),
      kv_out_(kv_out) {}

PipelineStage::~PipelineStage() { Join(); }

void PipelineStage::Start() {
  {
    absl::MutexLock lock(&mu_);
    started_ = absl::Now();
  }
  thread_ = std::thread([this] { Run(); });
}

void PipelineStage::Join() {
  if (thread_.joinable()) thread_.join();
}

StageStats PipelineStage::stats() const {
  absl::MutexLock lock(&mu_);
  StageStats s = stats_;
  if (started_ != absl::InfinitePast()) {
    s.idle_seconds = std::max(
        0.0, absl::ToDoubleSeconds(absl::Now() - started_) - s.busy_seconds);
  }
  return s;
}

std::vector<std::pair<absl::Time, absl::Time>>
PipelineStage::BusyIntervalsForTest() const {
  absl::MutexLock lock(&mu_);
  return intervals_;
}

void PipelineStage::Run() {
  while (std::optional<StageMessage> message = in_->Receive()) {
    Process(std::move(*message));
  }
  if (out_ != nullptr) out_->Close();
}

engine::ForwardBatch PipelineStage::BatchOf(const StageMessage& message) const {
  engine::ForwardBatch batch;
  batch.sequences.reserve(message.chunks.size());
  for (const ChunkHeader& chunk : message.chunks) {
    engine::SequenceStep step;
    step.tokens = chunk.tokens;
    step.num_tokens = chunk.num_tokens();
    step.start_position = chunk.token_begin;
    step.block_table = chunk.block_table;
    // Logits only where a first token is sampled, or at every position of a
    // chunk whose prompt is being scored.
    if (chunk.prompt_logprobs && out_ == nullptr) {
      step.logit_indices.resize(chunk.num_tokens());
      std::iota(step.logit_indices.begin(), step.logit_indices.end(), 0);
    } else if (chunk.final_chunk) {
      step.logit_indices = {chunk.num_tokens() - 1};
    }
    batch.sequences.push_back(std::move(step));
  }
  batch.hidden_in = message.hidden;
  return batch;
}

absl::Status PipelineStage::MirrorToHost(const StageMessage& message,
                                         int64_t* bytes) {
  // A GPU stage mirrors every position it computed (not only those it will
  // send now: a later request may reuse this prefix for a decode worker that
  // lacks it) before any write reads them.
  if (landing_ == nullptr) return absl::OkStatus();
  const kv::KvCacheLayout& layout = landing_->layout();
  for (const ChunkHeader& chunk : message.chunks) {
    PDS_RETURN_IF_ERROR(engine_->CopyTokensToHost(*pool_, chunk.block_table,
                                                  chunk.token_begin,
                                                  chunk.token_end, *landing_));
    *bytes +=
        int64_t{chunk.num_tokens()} * layout.block_bytes() / layout.block_size;
  }
  return absl::OkStatus();
}

MicrobatchShape PipelineStage::ShapeOf(const StageMessage& message,
                                       const engine::ForwardBatch& batch,
                                       int64_t tokens) const {
  // Every stage sets a final chunk's logit index; only the last one (no
  // stage after it) has the LM head that reads it and samples.
  const bool last_stage = out_ == nullptr;
  MicrobatchShape shape;
  shape.chunks = static_cast<int>(message.chunks.size());
  shape.tokens = tokens;
  for (size_t i = 0; i < batch.sequences.size(); ++i) {
    const engine::SequenceStep& step = batch.sequences[i];
    shape.attended_positions += step.AttendedPositions();
    if (!last_stage) continue;
    shape.logit_rows += static_cast<int>(step.logit_indices.size());
    if (message.chunks[i].final_chunk) ++shape.first_tokens;
  }
  return shape;
}

StageEvent PipelineStage::SampleFirstToken(const ChunkHeader& chunk,
                                           std::span<const float> logits) {
  StageEvent token;
  token.kind = StageEvent::Kind::kFirstToken;
  token.stage = options_.stage_index;
  token.request_id = chunk.request_id;
  // Output index 0: the same counter-based draw the decode worker would use
  // for this request's first token.
  const std::vector<int32_t> end_tokens = engine_->config().EndTokenIds();
  const engine::SamplingHistory history{
      chunk.penalized_prompt_tokens, {}, end_tokens};
  std::unique_ptr<engine::TokenConstraint> constraint;
  if (chunk.sampling.structured_output.enabled()) {
    absl::StatusOr<std::unique_ptr<engine::TokenConstraint>> made =
        options_.structured_output != nullptr
            ? options_.structured_output->NewConstraint(
                  chunk.sampling.structured_output)
            : absl::FailedPreconditionError(
                  "structured output: this prefill stage has no tokenizer "
                  "to compile the grammar against");
    if (!made.ok()) {
      token.status = made.status();
      return token;
    }
    constraint = *std::move(made);
  }
  absl::StatusOr<engine::SampledToken> sampled = engine::SampleWithConstraint(
      logits, chunk.sampling, 0, chunk.top_logprobs, history, constraint.get());
  if (sampled.ok()) {
    token.token = *std::move(sampled);
  } else {
    token.status = sampled.status();
  }
  return token;
}

void PipelineStage::ReportLastStageResults(
    const StageMessage& message, const engine::ForwardResult& result) {
  const int vocab = engine_->config().vocab_size;
  int row = 0;
  auto logits_row = [&](int r) {
    return std::span<const float>(result.logits.data() + int64_t{r} * vocab,
                                  vocab);
  };
  for (const ChunkHeader& chunk : message.chunks) {
    // The chunk's logit rows, as its step asked for them.
    const int rows = chunk.prompt_logprobs ? chunk.num_tokens()
                     : chunk.final_chunk   ? 1
                                           : 0;
    const int first_row = row;
    row += rows;
    if (chunk.prompt_logprobs) {
      ReportPromptLogprobs(chunk, first_row, logits_row);
    }
    // The last row samples output token 0.
    if (chunk.final_chunk) {
      events_->Report(
          SampleFirstToken(chunk, logits_row(first_row + rows - 1)));
    }
  }
}

void PipelineStage::Process(StageMessage message) {
  StageEvent done;
  done.kind = StageEvent::Kind::kMicrobatchDone;
  done.stage = options_.stage_index;
  done.microbatch_id = message.microbatch_id;
  for (const ChunkHeader& chunk : message.chunks) {
    done.request_ids.push_back(chunk.request_id);
    done.tokens += chunk.num_tokens();
  }
  done.start = absl::Now();

  const engine::ForwardBatch batch = BatchOf(message);
  // The stage's own result buffers, reused: see ForwardResult::logits.
  engine::ForwardResult& result = result_;
  absl::Status status = CheckPromptScoring(message);
  if (status.ok()) status = engine_->Forward(batch, *pool_, &result);
  const absl::Time mirror_start = absl::Now();
  int64_t mirror_bytes = 0;
  if (status.ok()) status = MirrorToHost(message, &mirror_bytes);
  done.end = absl::Now();
  {
    absl::MutexLock lock(&mu_);
    stats_.busy_seconds += absl::ToDoubleSeconds(done.end - done.start);
    ++stats_.microbatches;
    stats_.tokens += done.tokens;
    stats_.chunks += static_cast<int64_t>(message.chunks.size());
    if (out_ == nullptr && status.ok()) {
      for (const ChunkHeader& chunk : message.chunks) {
        if (chunk.prompt_logprobs) stats_.scored_tokens += chunk.num_tokens();
      }
    }
    if (landing_ != nullptr) {
      stats_.kv_mirror_bytes += mirror_bytes;
      stats_.kv_mirror_seconds +=
          absl::ToDoubleSeconds(done.end - mirror_start);
    }
    if (!status.ok()) ++stats_.failures;
    intervals_.emplace_back(done.start, done.end);
  }
  if (options_.observer.on_microbatch) {
    options_.observer.on_microbatch(
        done.tokens, static_cast<int>(message.chunks.size()),
        absl::ToDoubleSeconds(done.end - done.start));
  }
  if (options_.observer.on_step && status.ok()) {
    options_.observer.on_step(ShapeOf(message, batch, done.tokens),
                              absl::ToDoubleSeconds(done.end - done.start));
  }
  if (!status.ok()) {
    done.status = absl::Status(
        status.code(), absl::StrCat("prefill stage ", options_.stage_index,
                                    ": ", status.message()));
    events_->Report(std::move(done));
    return;
  }

  // Hand the hidden states on first, so the next stage starts while this one
  // issues its KV writes.
  if (out_ != nullptr) {
    StageMessage next;
    next.microbatch_id = message.microbatch_id;
    next.chunks = message.chunks;
    next.hidden = std::move(result.hidden_out);
    if (absl::Status sent = out_->Send(std::move(next)); !sent.ok()) {
      done.status = sent;
    }
  } else {
    ReportLastStageResults(message, result);
  }
  for (const ChunkHeader& chunk : message.chunks) StartKvWrites(chunk);
  events_->Report(std::move(done));
}

absl::Status PipelineStage::CheckPromptScoring(
    const StageMessage& message) const {
  if (out_ != nullptr) return absl::OkStatus();
  const int vocab = engine_->config().vocab_size;
  for (const ChunkHeader& chunk : message.chunks) {
    if (!chunk.prompt_logprobs) continue;
    if (static_cast<int>(chunk.tokens.size()) != chunk.num_tokens()) {
      return absl::InvalidArgumentError(
          absl::StrCat("request ", chunk.request_id,
                       ": a prompt-scoring chunk arrived without its tokens"));
    }
    for (int32_t token : chunk.tokens) {
      if (token < 0 || token >= vocab) {
        return absl::InvalidArgumentError(
            absl::StrCat("request ", chunk.request_id, ": prompt token ", token,
                         " is outside the vocabulary"));
      }
    }
    const bool next_ok =
        chunk.final_chunk ? chunk.next_token == -1
                          : chunk.next_token >= 0 && chunk.next_token < vocab;
    if (!next_ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("request ", chunk.request_id, ": next prompt token ",
                       chunk.next_token, " does not fit a ",
                       chunk.final_chunk ? "final" : "non-final", " chunk"));
    }
  }
  return absl::OkStatus();
}

void PipelineStage::ReportPromptLogprobs(
    const ChunkHeader& chunk, int first_row,
    const std::function<std::span<const float>(int)>& logits_row) {
  // Row k (position token_begin + k) predicts the prompt token after it: the
  // chunk's next token, or for its last position the first of the next chunk
  // (none after the final chunk, whose last row samples the output instead).
  StageEvent scored;
  scored.kind = StageEvent::Kind::kPromptLogprobs;
  scored.stage = options_.stage_index;
  scored.request_id = chunk.request_id;
  scored.first_scored = chunk.token_begin + 1;
  const int n = chunk.num_tokens();
  const int scored_rows = chunk.final_chunk ? n - 1 : n;
  scored.prompt_logprobs.reserve(scored_rows);
  for (int k = 0; k < scored_rows; ++k) {
    const int32_t next = k + 1 < n ? chunk.tokens[k + 1] : chunk.next_token;
    scored.prompt_logprobs.push_back(engine::ComputeTokenLogprobs(
        logits_row(first_row + k), next, chunk.top_logprobs));
  }
  events_->Report(std::move(scored));
}

void PipelineStage::StartKvWrites(const ChunkHeader& chunk) {
  const uint64_t id = chunk.request_id;
  {
    absl::MutexLock lock(&mu_);
    PendingWrites& pending = writes_[id];
    // A straggler chunk of a forgotten request: count it so its completion
    // settles, and drop the entry then.
    if (forgotten_.Contains(id)) pending.abandoned = true;
    ++pending.outstanding;
    if (chunk.final_chunk) pending.final_issued = true;
  }
  // Positions the decode side already holds (its cached prefix) are not sent;
  // a chunk entirely below them writes nothing but its grants still must
  // reach the output (they ride with the first chunk).
  const int kv_begin = std::max(chunk.kv_begin, chunk.kv_dst_offset);
  if (kv_out_ != nullptr && chunk.write_kv &&
      (kv_begin < chunk.token_end || !chunk.kv_grants.empty())) {
    KvWrite write;
    write.request_id = id;
    write.layer_begin = engine_->shard().layer_begin;
    write.layer_end = engine_->shard().layer_end;
    write.kv_dst_offset = chunk.kv_dst_offset;
    write.token_begin = std::min(kv_begin, chunk.token_end);
    write.token_end = chunk.token_end;
    write.final_chunk = chunk.final_chunk;
    write.block_table = chunk.block_table;
    write.pool = mutable_pool();
    write.grants = chunk.kv_grants;
    {
      absl::MutexLock lock(&mu_);
      ++stats_.kv_writes;
    }
    kv_out_->Write(
        write, [this, id](absl::Status status) { OnKvWriteDone(id, status); });
  } else {
    OnKvWriteDone(id, absl::OkStatus());
  }
}

void PipelineStage::OnKvWriteDone(uint64_t request_id, absl::Status status) {
  StageEvent event;
  {
    absl::MutexLock lock(&mu_);
    auto it = writes_.find(request_id);
    if (it == writes_.end()) return;
    PendingWrites& pending = it->second;
    --pending.outstanding;
    if (pending.status.ok()) pending.status = status;
    if (pending.abandoned && pending.outstanding == 0) {
      writes_.erase(it);
      return;
    }
    if (!pending.final_issued || pending.outstanding > 0) return;
    event.status = pending.status;
    writes_.erase(it);
  }
  event.kind = StageEvent::Kind::kKvWritten;
  event.stage = options_.stage_index;
  event.request_id = request_id;
  events_->Report(std::move(event));
}

size_t PipelineStage::open_write_entries() const {
  absl::MutexLock lock(&mu_);
  return writes_.size();
}

void PipelineStage::Forget(uint64_t request_id) {
  absl::MutexLock lock(&mu_);
  forgotten_.Insert(request_id);
  auto it = writes_.find(request_id);
  if (it == writes_.end()) return;
  if (it->second.outstanding == 0) {
    writes_.erase(it);
  } else {
    it->second.abandoned = true;
  }
}

}  // namespace pdserve::prefill
