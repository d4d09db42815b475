#include "decode/decode_worker.h"

#include <algorithm>
#include <deque>
#include <optional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "comm/communicator.h"
#include "common/closable_queue.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "decode/scheduled_request.h"
#include "decode/step_planner.h"
#include "engine/engine_backend.h"
#include "engine/llama_engine.h"
#include "grammar/structured_output.h"
#include "kv/sequence_blocks.h"
#include "speculative/adaptive_gamma.h"
#include "speculative/draft_proposer.h"
#include "speculative/verifier.h"
#include "tokenizer/detokenizer.h"

namespace pdserve::decode {

const char* FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kNone:
      return "none";
    case FinishReason::kEos:
      return "eos";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kAborted:
      return "aborted";
    case FinishReason::kError:
      return "error";
  }
  return "unknown";
}

namespace {

// The scheduler's view of a request (scheduled_request.h).
using Request = ScheduledRequest;

struct Command {
  enum Kind { kAbort, kKvComplete, kFail } kind;
  uint64_t id = 0;
  int32_t token = 0;
  absl::Status status;
  engine::TokenLogprobs logprobs;  // kKvComplete: token 0's
};

struct Delivery {
  std::shared_ptr<StreamCallback> callback;
  TokenDelta delta;
};

struct RankDone {
  int rank = 0;
  absl::Status status;
  std::vector<float> logits;
  std::vector<int32_t> argmax;
  // The rank's running total inside collectives: read on the rank's own
  // thread (the communicator is not thread-safe to read from elsewhere).
  double collective_seconds = 0;
};

struct Rank {
  std::unique_ptr<engine::LlamaEngine> engine;
  std::unique_ptr<kv::KvPool> pool;  // what the engine reads and writes
  // Host mirror of a device pool, where remote prefills' KV lands (null when
  // the pool is host memory).
  std::unique_ptr<kv::KvPool> landing;
  std::unique_ptr<ClosableQueue<std::shared_ptr<const StepWork>>> work;
  std::thread thread;
};

absl::Status ValidateRequest(const std::vector<int32_t>& prompt,
                             const RequestParams& params,
                             const model::ModelConfig& config,
                             const DecodeWorkerOptions& options,
                             bool has_tokenizer) {
  if (prompt.empty()) return absl::InvalidArgumentError("prompt is empty");
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= config.vocab_size)
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt token ", i, " is ", prompt[i],
          ", outside the vocabulary [0, ", config.vocab_size, ")"));
  }
  PDS_RETURN_IF_ERROR(params.sampling.ValidateForVocab(config.vocab_size));
  if (params.top_logprobs < 0 || params.top_logprobs > engine::kMaxTopLogprobs)
    return absl::InvalidArgumentError(
        absl::StrCat("top_logprobs must be in [0, ", engine::kMaxTopLogprobs,
                     "], got ", params.top_logprobs));
  if (params.max_new_tokens < 1)
    return absl::InvalidArgumentError(absl::StrCat(
        "max_new_tokens must be >= 1, got ", params.max_new_tokens));
  const int64_t total =
      static_cast<int64_t>(prompt.size()) + params.max_new_tokens;
  if (total > config.max_position_embeddings)
    return absl::InvalidArgumentError(
        absl::StrCat("prompt of ", prompt.size(), " tokens + max_new_tokens ",
                     params.max_new_tokens, " exceeds the context of ",
                     config.max_position_embeddings));
  const int64_t blocks = (total + options.block_size - 1) / options.block_size;
  if (blocks > options.num_blocks)
    return absl::ResourceExhaustedError(
        absl::StrCat("request needs ", blocks, " KV blocks, the pool has ",
                     options.num_blocks));
  if (!params.stop.empty() && !has_tokenizer)
    return absl::InvalidArgumentError(
        "stop strings need a tokenizer; this worker has none");
  for (size_t i = 0; i < params.stop.size(); ++i) {
    if (params.stop[i].empty())
      return absl::InvalidArgumentError(
          absl::StrCat("stop string ", i, " is empty"));
  }
  return absl::OkStatus();
}

// The prefill's token 0 report is peer input: at most kMaxTopLogprobs
// alternatives, each an id that decodes.
absl::Status CheckFirstLogprobs(const engine::TokenLogprobs& logprobs,
                                uint64_t request_id, int vocab_size) {
  if (logprobs.top.size() > engine::kMaxTopLogprobs) {
    return absl::InvalidArgumentError(
        absl::StrCat("first token of request ", request_id, " comes with ",
                     logprobs.top.size(), " alternatives, more than ",
                     engine::kMaxTopLogprobs));
  }
  for (const engine::TopLogprob& t : logprobs.top) {
    if (t.token < 0 || t.token >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "alternative ", t.token, " of request ", request_id,
          "'s first token is outside the vocabulary [0, ", vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

// Bytes at the end of `text` that could start one of `stops`: held back so a
// stop string split over tokens never reaches the client.
size_t StopHoldback(const std::string& text,
                    const std::vector<std::string>& stops) {
  size_t hold = 0;
  for (const auto& s : stops) {
    for (size_t k = std::min(s.size() - 1, text.size()); k > hold; --k) {
      if (text.compare(text.size() - k, k, s, 0, k) == 0) {
        hold = k;
        break;
      }
    }
  }
  return hold;
}

}  // namespace

struct DecodeWorker::Impl {
  Impl(const model::WeightSource& w, const tokenizer::Tokenizer* t,
       const DecodeWorkerOptions& o)
      : weights(w),
        tok(t),
        options(o),
        config(w.config()),
        end_tokens(config.EndTokenIds()),
        structured_output(t, end_tokens) {}

  const model::WeightSource& weights;
  const tokenizer::Tokenizer* tok;  // may be null: no text
  const DecodeWorkerOptions options;
  const model::ModelConfig config;
  const std::vector<int32_t> end_tokens;  // held back before min_tokens
  // Compiles each structured-output spec once against the tokenizer.
  grammar::StructuredOutputCompiler structured_output;
  std::unique_ptr<comm::InProcessGroup> group;
  // How the TP ranks reduce: "none" (tp 1), "host" or "nccl".
  std::string tp_communicator = "none";
  std::vector<Rank> ranks;
  std::unique_ptr<kv::KvBlockManager> manager;
  std::unique_ptr<speculative::Proposer> proposer;
  ClosableQueue<RankDone> done;
  std::thread scheduler;

  // ---- Shared with API callers --------------------------------------------
  enum class IdState { kAwaitingKv, kActive };
  mutable absl::Mutex mu;
  bool stop ABSL_GUARDED_BY(mu) = false;
  std::vector<std::unique_ptr<Request>> inbox ABSL_GUARDED_BY(mu);
  std::vector<Command> commands ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<uint64_t, IdState> ids ABSL_GUARDED_BY(mu);
  LoadReport load ABSL_GUARDED_BY(mu);
  LogitsObserver observer ABSL_GUARDED_BY(mu);
  bool accept_all ABSL_GUARDED_BY(mu) = false;

  // ---- Scheduler thread only ----------------------------------------------
  absl::flat_hash_map<uint64_t, std::unique_ptr<Request>> requests;
  std::deque<Request*> waiting;
  std::vector<Request*> running;  // admission order: oldest first
  std::vector<Delivery> deliveries;
  LoadReport counters;  // steps, preemptions, speculation

  absl::Status Start();
  void Shutdown();
  void RankLoop(int r);
  void SchedulerLoop();
  // The request's structured-output matcher (null without one).
  absl::StatusOr<std::unique_ptr<engine::TokenConstraint>> NewConstraint(
      const RequestParams& params) {
    if (!params.sampling.structured_output.enabled()) {
      return std::unique_ptr<engine::TokenConstraint>();
    }
    return structured_output.NewConstraint(params.sampling.structured_output);
  }
  std::unique_ptr<Request> NewRequest(uint64_t id, std::vector<int32_t> prompt,
                                      const RequestParams& params,
                                      StreamCallback callback);
  // Replays a migrated stream's tokens into a new request (Resumption).
  absl::Status Resume(Request& r, const Resumption& resume);
  void ApplyCommand(const Command& c);
  void CheckLeases();
  void AdmitWaiting();
  void Preempt(Request* r);
  // One step: propose, plan, build (step_planner.h), run on every rank,
  // apply each planned request's rows.
  void RunStep();
  // What a step carries from running it to applying its results.
  struct StepContext {
    LogitsObserver observer;
    speculative::VerifyOptions verify;
    bool argmax_only = false;
    std::vector<float> logits;    // rank 0's rows, plan order
    std::vector<int32_t> argmax;  // one per row
    StepStats stats;
  };
  absl::Status RunOnRanks(const std::shared_ptr<StepWork>& work,
                          StepContext* step);
  // Scores the request's prompt rows, samples or verifies its token rows,
  // rolls back rejected drafts, streams; advances `row` past its rows.
  void ApplyPlanned(Planned& p, StepContext& step, size_t* row);
  // Gives back the request's published KV blocks that no layer's sliding
  // window reaches any more (models whose every layer windows).
  void ReleaseKvOutsideWindow(Request* r);
  // Appends output tokens (with their logprobs when the request asked: one
  // per token), streams the delta; true if the request finished.
  bool AppendTokens(Request* r, std::span<const int32_t> tokens,
                    std::span<const engine::TokenLogprobs> logprobs = {});
  void Finish(Request* r, FinishReason reason, absl::Status status,
              std::vector<int32_t> tokens = {},
              std::vector<engine::TokenLogprobs> logprobs = {},
              std::vector<engine::TokenLogprobs> prompt_logprobs = {});
  // Moves a scored prompt's numbers into the request's first delta.
  void TakePromptScores(Request* r, TokenDelta* delta);
  void Deliver();
  void PublishLoad();
  // Copies a remotely prefilled request's new blocks to every rank's device
  // pool (no-op for host pools).
  absl::Status StageRemoteKv(const Request& r);
};

// ---- Setup ------------------------------------------------------------------

absl::Status DecodeWorker::Impl::Start() {
  const int tp = options.tp_size;
  auto device_of = [&](int r) {
    return options.cuda_devices.empty()
               ? options.cuda.device
               : options.cuda_devices[r % options.cuda_devices.size()];
  };
  if (tp > 1) {
    // GPU ranks on distinct GPUs reduce with NCCL (device to device, inside
    // CUDA Graphs); ranks sharing a GPU, and CPU ranks, through host memory.
    bool distinct_gpus = options.backend == engine::Backend::kCuda;
    for (int r = 1; r < tp && distinct_gpus; ++r) {
      for (int q = 0; q < r; ++q) distinct_gpus &= device_of(q) != device_of(r);
    }
    if (distinct_gpus) {
      std::vector<int> devices(tp);
      for (int r = 0; r < tp; ++r) devices[r] = device_of(r);
      PDS_ASSIGN_OR_RETURN(group, engine::CreateNcclGroup(tp, devices));
      tp_communicator = "nccl";
    } else {
      PDS_ASSIGN_OR_RETURN(group, comm::InProcessGroup::Create(tp));
      tp_communicator = "host";
    }
  }
  ranks.resize(tp);
  for (int r = 0; r < tp; ++r) {
    engine::EngineOptions eo;
    eo.shard = engine::ShardSpec{0, -1, r, tp};
    eo.num_threads = options.threads_per_rank;
    eo.communicator = tp > 1 ? group->rank(r) : nullptr;
    eo.backend = options.backend;
    eo.cuda = options.cuda;
    eo.kv_dtype = options.kv_dtype;
    eo.quantized_matmul = options.quantized_matmul;
    eo.expert_parallelism = options.expert_parallelism;
    // Size the GPU's step buffers for what this worker's steps can hold.
    eo.cuda.max_tokens_per_step = options.max_step_tokens;
    eo.cuda.max_sequences = std::max(options.max_running, 1);
    eo.cuda.max_graph_tokens_per_sequence =
        std::max(eo.cuda.max_graph_tokens_per_sequence,
                 options.speculation.max_gamma + 1);
    eo.cuda.device = device_of(r);
    // A colocated prefill chunk scoring its prompt asks for a logits row per
    // token: as many rows as the step holds tokens (the buffer is
    // max_step_tokens x vocab x 4 bytes: 262 MB at 512 x 128k; the graph
    // steps' rows at least).
    if (eo.cuda.max_logit_rows == 0) {
      eo.cuda.max_logit_rows = std::max(
          options.max_step_tokens,
          eo.cuda.max_graph_batch * eo.cuda.max_graph_tokens_per_sequence);
    }
    PDS_ASSIGN_OR_RETURN(ranks[r].engine,
                         engine::LlamaEngine::Create(weights, eo));
    engine::LlamaEngine& engine = *ranks[r].engine;
    const kv::KvCacheLayout layout = engine.KvLayout(options.block_size);
    auto host_pool = [&]() -> absl::StatusOr<std::unique_ptr<kv::KvPool>> {
      return options.kv_pool_factory
                 ? options.kv_pool_factory(r, layout, options.num_blocks)
                 : kv::KvPool::Create(layout, options.num_blocks);
    };
    if (engine.kv_on_device()) {
      PDS_ASSIGN_OR_RETURN(
          ranks[r].pool,
          engine.CreateKvPool(options.block_size, options.num_blocks));
      PDS_ASSIGN_OR_RETURN(ranks[r].landing, host_pool());
    } else {
      PDS_ASSIGN_OR_RETURN(ranks[r].pool, host_pool());
    }
    ranks[r].work =
        std::make_unique<ClosableQueue<std::shared_ptr<const StepWork>>>();
  }
  PDS_ASSIGN_OR_RETURN(manager, kv::KvBlockManager::Create(options.num_blocks,
                                                           options.block_size));
  const auto& so = options.speculation;
  switch (so.mode) {
    case SpeculationMode::kOff:
      break;
    case SpeculationMode::kNgram:
      proposer = speculative::MakeNgramProposer(so.ngram);
      break;
    case SpeculationMode::kScripted:
      proposer = speculative::MakeScriptedProposer(so.scripted);
      break;
    case SpeculationMode::kDraft: {
      if (so.draft_weights == nullptr)
        return absl::InvalidArgumentError(
            "speculation mode draft needs draft_weights");
      const auto& dc = so.draft_weights->config();
      if (dc.vocab_size != config.vocab_size)
        return absl::InvalidArgumentError(
            absl::StrCat("draft vocabulary ", dc.vocab_size,
                         " != target vocabulary ", config.vocab_size));
      speculative::DraftModelOptions dopt;
      dopt.num_threads = options.threads_per_rank;
      dopt.block_size = options.block_size;
      dopt.num_blocks = so.draft_kv_blocks;
      dopt.cost_per_token =
          static_cast<double>(dc.num_layers) / std::max(1, config.num_layers);
      dopt.backend = options.backend;
      dopt.cuda = options.cuda;
      dopt.cuda.device = device_of(0);
      dopt.cuda.max_sequences = std::max(options.max_running, 1);
      PDS_ASSIGN_OR_RETURN(proposer, speculative::MakeDraftModelProposer(
                                         *so.draft_weights, dopt));
      break;
    }
  }
  for (int r = 0; r < tp; ++r)
    ranks[r].thread = std::thread([this, r] { RankLoop(r); });
  scheduler = std::thread([this] { SchedulerLoop(); });
  return absl::OkStatus();
}

void DecodeWorker::Impl::Shutdown() {
  {
    absl::MutexLock lock(&mu);
    stop = true;
  }
  if (scheduler.joinable()) scheduler.join();
  for (auto& rank : ranks) {
    if (rank.work) rank.work->Close();
  }
  if (group) group->Shutdown();
  for (auto& rank : ranks) {
    if (rank.thread.joinable()) rank.thread.join();
  }
  done.Close();
}

void DecodeWorker::Impl::RankLoop(int r) {
  Rank& rank = ranks[r];
  while (auto work = rank.work->Pop()) {
    engine::ForwardResult result;
    RankDone d;
    d.rank = r;
    d.status = rank.engine->Forward((*work)->batch, *rank.pool, &result);
    if (r == 0) {
      d.logits = std::move(result.logits);
      d.argmax = std::move(result.argmax);
    }
    if (group) d.collective_seconds = group->rank(r)->seconds_in_collectives();
    done.Push(std::move(d));
  }
}

std::unique_ptr<Request> DecodeWorker::Impl::NewRequest(
    uint64_t id, std::vector<int32_t> prompt, const RequestParams& params,
    StreamCallback callback) {
  auto r = std::make_unique<Request>();
  r->id = id;
  r->params = params;
  r->callback = std::make_shared<StreamCallback>(std::move(callback));
  r->prompt_len = prompt.size();
  r->history = std::move(prompt);
  if (tok != nullptr)
    r->detokenizer = std::make_unique<tokenizer::IncrementalDetokenizer>(*tok);
  speculative::AdaptiveGammaOptions go;
  go.max_gamma = options.speculation.max_gamma;
  go.cost_per_draft_token = options.speculation.verify_cost_per_token +
                            (proposer ? proposer->cost_per_token() : 0.0);
  r->gamma = speculative::AdaptiveGamma(go);
  return r;
}

absl::Status DecodeWorker::Impl::Resume(Request& r, const Resumption& resume) {
  if (resume.output.empty())
    return absl::InvalidArgumentError("a resumed request needs its tokens");
  if (r.params.prompt_logprobs)
    return absl::InvalidArgumentError(
        "a resumed request cannot score its prompt again (prompt logprobs "
        "went with its first delta)");
  if (static_cast<int64_t>(resume.output.size()) >= r.params.max_new_tokens)
    return absl::InvalidArgumentError(absl::StrCat(
        "a resumed request's ", resume.output.size(),
        " tokens leave nothing of max_new_tokens ", r.params.max_new_tokens));
  // The same bookkeeping AppendTokens does for a token the worker sampled
  // itself, without streaming it: the grammar, the history (which penalties
  // and the proposers read), the output index, the text stop strings scan.
  for (size_t i = 0; i < resume.output.size(); ++i) {
    const int32_t t = resume.output[i];
    if (t < 0 || t >= config.vocab_size)
      return absl::InvalidArgumentError(absl::StrCat(
          "resumed token ", i, " is ", t, ", outside the vocabulary [0, ",
          config.vocab_size, ")"));
    if (r.constraint != nullptr) {
      if (absl::Status s = r.constraint->Accept(t); !s.ok())
        return absl::InvalidArgumentError(
            absl::StrCat("resumed token ", i, " (", t,
                         ") breaks the request's grammar: ", s.message()));
    }
    r.history.push_back(t);
    ++r.generated;
    if (r.detokenizer != nullptr) {
      absl::StatusOr<std::string> piece = r.detokenizer->Push(t);
      if (!piece.ok()) return piece.status();
      r.text += *piece;
    }
  }
  if (resume.delivered_text_bytes < 0 ||
      resume.delivered_text_bytes > static_cast<int64_t>(r.text.size()))
    return absl::InvalidArgumentError(absl::StrCat(
        "the client has ", resume.delivered_text_bytes,
        " bytes of text; the resumed tokens make ", r.text.size()));
  r.sent = static_cast<size_t>(resume.delivered_text_bytes);
  return absl::OkStatus();
}

// ---- Scheduler --------------------------------------------------------------

void DecodeWorker::Impl::SchedulerLoop() {
  while (true) {
    std::vector<std::unique_ptr<Request>> new_requests;
    std::vector<Command> new_commands;
    {
      absl::MutexLock lock(&mu);
      if (running.empty() && waiting.empty()) {
        // Idle: sleep until work arrives, but wake for the next lease expiry.
        absl::Time deadline = absl::Now() + absl::Milliseconds(200);
        for (const auto& [id, r] : requests)
          deadline = std::min(deadline, r->lease_deadline);
        auto has_work = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
          return stop || !inbox.empty() || !commands.empty();
        };
        mu.AwaitWithDeadline(absl::Condition(&has_work), deadline);
      }
      if (stop) break;
      new_requests.swap(inbox);
      new_commands.swap(commands);
    }
    for (auto& r : new_requests) {
      Request* raw = r.get();
      requests[raw->id] = std::move(r);
      if (raw->phase == Phase::kWaiting) waiting.push_back(raw);
    }
    for (const auto& c : new_commands) ApplyCommand(c);
    CheckLeases();
    AdmitWaiting();
    if (!running.empty()) RunStep();
    PublishLoad();
    Deliver();
  }
  // Shutdown: every live request ends with CANCELLED.
  {
    absl::MutexLock lock(&mu);
    for (auto& r : inbox) requests[r->id] = std::move(r);
    inbox.clear();
  }
  std::vector<Request*> live;
  for (auto& [id, r] : requests) live.push_back(r.get());
  for (Request* r : live)
    Finish(r, FinishReason::kAborted,
           absl::CancelledError("decode worker shutting down"));
  PublishLoad();
  Deliver();
}

void DecodeWorker::Impl::ApplyCommand(const Command& c) {
  auto it = requests.find(c.id);
  if (it == requests.end()) return;  // finished meanwhile
  Request* r = it->second.get();
  switch (c.kind) {
    case Command::kAbort:
      Finish(r, FinishReason::kAborted,
             absl::CancelledError(absl::StrCat("request ", c.id, " aborted")));
      return;
    case Command::kFail:
      Finish(r, FinishReason::kError, c.status);
      return;
    case Command::kKvComplete: {
      if (r->phase != Phase::kAwaitingKv) return;
      // Between steps every rank's engine is idle: bring the blocks the
      // prefill wrote from the host mirror to the GPU.
      if (absl::Status staged = StageRemoteKv(*r); !staged.ok()) {
        Finish(r, FinishReason::kError, staged);
        return;
      }
      r->phase = Phase::kRunning;
      r->lease_deadline = absl::InfiniteFuture();
      // The prompt's KV is now complete: its full blocks may be shared.
      r->PromptKvLanded();
      running.push_back(r);
      const int32_t token = c.token;
      // The prefill may report more alternatives than this request wants.
      engine::TokenLogprobs first = c.logprobs;
      if (first.top.size() > static_cast<size_t>(r->params.top_logprobs))
        first.top.resize(r->params.top_logprobs);
      AppendTokens(r, std::span<const int32_t>(&token, 1),
                   r->params.wants_logprobs()
                       ? std::span<const engine::TokenLogprobs>(&first, 1)
                       : std::span<const engine::TokenLogprobs>());
      return;
    }
  }
}

absl::Status DecodeWorker::Impl::StageRemoteKv(const Request& r) {
  if (ranks.empty() || ranks[0].landing == nullptr) return absl::OkStatus();
  const auto table = r.sequence->block_table();
  const int64_t first = r.prefilled_from / options.block_size;
  const int64_t last =
      (static_cast<int64_t>(r.prompt_len) + options.block_size - 1) /
      options.block_size;
  if (first >= last) return absl::OkStatus();
  std::vector<int32_t> blocks(table.begin() + first, table.begin() + last);
  const absl::Time start = absl::Now();
  for (Rank& rank : ranks) {
    PDS_RETURN_IF_ERROR(
        rank.engine->CopyBlocksFromHost(*rank.landing, blocks, *rank.pool));
    counters.kv_staged_bytes += static_cast<int64_t>(blocks.size()) *
                                rank.landing->layout().block_bytes();
  }
  counters.kv_staging_seconds += absl::ToDoubleSeconds(absl::Now() - start);
  return absl::OkStatus();
}

void DecodeWorker::Impl::CheckLeases() {
  const absl::Time now = absl::Now();
  std::vector<Request*> expired;
  for (auto& [id, r] : requests) {
    if (r->phase == Phase::kAwaitingKv && r->lease_deadline <= now)
      expired.push_back(r.get());
  }
  for (Request* r : expired) {
    {
      // A MarkKvComplete that won the race is already queued: honour it.
      absl::MutexLock lock(&mu);
      auto it = ids.find(r->id);
      if (it != ids.end() && it->second != IdState::kAwaitingKv) continue;
    }
    ++counters.lease_expiries;
    Finish(r, FinishReason::kError,
           absl::DeadlineExceededError(absl::StrCat(
               "request ", r->id, ": KV not completed within the lease of ",
               absl::FormatDuration(options.kv_lease))));
  }
}

void DecodeWorker::Impl::AdmitWaiting() {
  while (!waiting.empty() &&
         static_cast<int>(running.size()) < options.max_running) {
    Request* r = waiting.front();
    const int64_t need_blocks =
        (static_cast<int64_t>(r->history.size()) + options.block_size - 1) /
        options.block_size;
    // FIFO: the head waits until enough KV frees up (a later, smaller request
    // does not overtake it, so it cannot starve).
    if (manager->available_blocks() < need_blocks) break;
    // Every prompt position's logits are needed to score it: a cached prefix
    // has none.
    r->StartKv(manager.get(), /*reuse_prefix=*/!r->scoring());
    r->phase = Phase::kRunning;
    waiting.pop_front();
    running.push_back(r);
  }
}

void DecodeWorker::Impl::Preempt(Request* r) {
  r->DropKv();  // published blocks stay in the prefix cache
  r->phase = Phase::kWaiting;
  if (proposer) proposer->Forget(r->id);
  running.erase(std::find(running.begin(), running.end(), r));
  waiting.push_front(r);
  ++counters.preemptions;
}

void DecodeWorker::Impl::RunStep() {
  const StepLimits limits{options.max_step_tokens,
                          options.speculation.max_batch,
                          config.max_position_embeddings};
  const Proposals proposals = ProposeDrafts(running, proposer.get(), limits);
  std::vector<Planned> plan =
      PlanStep(running, proposals, limits, [this](Request* r) { Preempt(r); });
  if (plan.empty()) return;
  StepContext step;
  {
    absl::MutexLock lock(&mu);
    step.observer = observer;
    step.verify.accept_all_for_test = accept_all;
  }
  std::shared_ptr<StepWork> work =
      BuildStepWork(plan, step.observer || step.verify.accept_all_for_test);
  step.argmax_only = work->batch.argmax_only;

  const absl::Time step_start = absl::Now();
  const absl::Status status = RunOnRanks(work, &step);
  step.stats.seconds = absl::ToDoubleSeconds(absl::Now() - step_start);
  step.stats.sequences = static_cast<int>(plan.size());
  for (const Planned& p : plan) step.stats.tokens_fed += p.fed();
  for (const engine::SequenceStep& seq : work->batch.sequences) {
    step.stats.logit_rows += static_cast<int>(seq.logit_indices.size());
    step.stats.attended_positions += seq.AttendedPositions();
  }
  if (!status.ok()) {
    // Requests were validated on entry, so this is a bug or a shutdown: fail
    // the step's requests rather than the worker.
    for (const Planned& p : plan) {
      Finish(p.request, FinishReason::kError,
             absl::InternalError(
                 absl::StrCat("decode step failed: ", status.message())));
    }
    return;
  }
  size_t row = 0;  // logits/argmax rows are in plan order
  for (Planned& p : plan) ApplyPlanned(p, step, &row);
  if (options.step_observer) options.step_observer(step.stats);
}

absl::Status DecodeWorker::Impl::RunOnRanks(
    const std::shared_ptr<StepWork>& work, StepContext* step) {
  for (auto& rank : ranks) rank.work->Push(work);
  absl::Status status;
  double collective_seconds = 0;
  for (size_t i = 0; i < ranks.size(); ++i) {
    std::optional<RankDone> d = done.Pop();
    if (!d) {
      status = absl::CancelledError("rank threads stopped");
      break;
    }
    if (!d->status.ok() && status.ok()) status = d->status;
    if (d->rank == 0) {
      step->logits = std::move(d->logits);
      step->argmax = std::move(d->argmax);
    }
    collective_seconds += d->collective_seconds;
  }
  ++counters.steps;
  counters.allreduce_seconds = collective_seconds / ranks.size();
  return status;
}

void DecodeWorker::Impl::ApplyPlanned(Planned& p, StepContext& step,
                                      size_t* row) {
  const int vocab = config.vocab_size;
  Request* r = p.request;
  for (int k = 0; k < p.score_rows; ++k, ++*row) {
    // Position q predicts prompt token q + 1; positions scored before a
    // preemption are computed again but not scored twice.
    const int64_t q = r->kv_tokens + k;
    if (q != static_cast<int64_t>(r->prompt_scores.size())) continue;
    r->prompt_scores.push_back(engine::ComputeTokenLogprobs(
        std::span<const float>(step.logits.data() + *row * vocab, vocab),
        r->history[q + 1], r->params.top_logprobs));
  }
  if (!p.wants_logits) {
    // A prefill chunk: its KV is final, nothing sampled.
    r->KeepKv(r->kv_tokens + p.history_feed);
    r->PublishKv();
    ReleaseKvOutsideWindow(r);
    return;
  }
  const size_t rows = p.drafts.size() + 1;
  std::span<const float> rows_logits;
  absl::StatusOr<speculative::VerifyOutcome> outcome;
  if (step.argmax_only) {
    outcome =
        *row + rows <= step.argmax.size()
            ? speculative::VerifyGreedyFromArgmax(
                  std::span<const int32_t>(step.argmax).subspan(*row, rows),
                  p.drafts)
            : absl::InternalError("engine returned too few argmaxes");
  } else {
    rows_logits =
        std::span<const float>(step.logits.data() + *row * vocab, rows * vocab);
    const std::span<const int32_t> history(r->history);
    outcome =
        speculative::VerifyDraft(rows_logits, vocab, p.drafts, p.draft_probs,
                                 r->params.sampling, r->generated, step.verify,
                                 {history.first(r->prompt_len),
                                  history.subspan(r->prompt_len), end_tokens},
                                 r->constraint.get());
  }
  *row += rows;
  if (!outcome.ok()) {
    Finish(r, FinishReason::kError, outcome.status());
    return;
  }
  if (step.observer) {
    for (size_t i = 0; i < outcome->tokens.size(); ++i) {
      step.observer(r->id, r->generated + static_cast<int64_t>(i),
                    rows_logits.subspan(i * vocab, vocab));
    }
  }
  if (!p.drafts.empty()) {
    r->gamma.Record(static_cast<int>(p.drafts.size()),
                    outcome->accepted_drafts);
    ++counters.spec_steps;
    counters.drafted_tokens += static_cast<int64_t>(p.drafts.size());
    counters.accepted_tokens += outcome->accepted_drafts;
    counters.spec_emitted_tokens +=
        static_cast<int64_t>(outcome->tokens.size());
    step.stats.acceptance_lengths.push_back(
        static_cast<int>(outcome->tokens.size()));
  }
  step.stats.output_tokens += static_cast<int>(outcome->tokens.size());
  // KV is valid for the fed history and the accepted drafts; the rejected
  // drafts' slots are rolled back.
  r->KeepKv(r->kv_tokens + p.history_feed + outcome->accepted_drafts);
  // Output i of a verify (accepted draft or the final token) was drawn from
  // row i: its logprobs are that row's, as without speculation.
  std::vector<engine::TokenLogprobs> token_logprobs;
  if (r->params.wants_logprobs()) {
    for (size_t i = 0; i < outcome->tokens.size(); ++i) {
      token_logprobs.push_back(engine::ComputeTokenLogprobs(
          rows_logits.subspan(i * vocab, vocab), outcome->tokens[i],
          r->params.top_logprobs));
    }
  }
  if (AppendTokens(r, outcome->tokens, token_logprobs)) return;
  // Only accepted tokens (whose KV is final) reach the prefix cache.
  r->PublishKv();
  ReleaseKvOutsideWindow(r);
}

void DecodeWorker::Impl::ReleaseKvOutsideWindow(Request* r) {
  // Only when every layer windows: a layer without one reads every key.
  // The next query is at position kv_tokens (a rolled-back verify never
  // goes below it) and sees keys from kv_tokens + 1 - window on.
  if (!config.EveryLayerWindowed()) return;
  r->ReleaseKvBefore(r->kv_tokens + 1 - config.sliding_window);
}

bool DecodeWorker::Impl::AppendTokens(
    Request* r, std::span<const int32_t> tokens,
    std::span<const engine::TokenLogprobs> logprobs) {
  TokenDelta delta;
  TakePromptScores(r, &delta);
  FinishReason reason = FinishReason::kNone;
  size_t max_stop = 0;
  for (const auto& s : r->params.stop) max_stop = std::max(max_stop, s.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int32_t t = tokens[i];
    if (r->constraint != nullptr) {
      // Sampling was masked by this same state, so this fails only for a
      // first token a prefill group sampled against another grammar.
      if (absl::Status s = r->constraint->Accept(t); !s.ok()) {
        Finish(r, FinishReason::kError, s, std::move(delta.tokens),
               std::move(delta.logprobs), std::move(delta.prompt_logprobs));
        return true;
      }
    }
    r->history.push_back(t);
    ++r->generated;
    delta.tokens.push_back(t);
    if (i < logprobs.size()) delta.logprobs.push_back(logprobs[i]);
    absl::StatusOr<std::string> piece =
        r->detokenizer ? r->detokenizer->Push(t) : std::string();
    if (!piece.ok()) {
      Finish(r, FinishReason::kError, piece.status(), std::move(delta.tokens),
             std::move(delta.logprobs), std::move(delta.prompt_logprobs));
      return true;
    }
    const size_t before = r->text.size();
    r->text += *piece;
    // Stop strings, like EOS, cannot end the output before min_tokens.
    if (max_stop > 0 && !piece->empty() &&
        r->generated > r->params.sampling.min_tokens) {
      const size_t from = before >= max_stop - 1 ? before - (max_stop - 1) : 0;
      size_t cut = std::string::npos;
      for (const auto& s : r->params.stop)
        cut = std::min(cut, r->text.find(s, from));
      if (cut != std::string::npos) {
        r->text.resize(cut);
        reason = FinishReason::kStop;
        break;
      }
    }
    if (!r->params.ignore_eos && config.IsEos(t)) {
      reason = FinishReason::kEos;
      break;
    }
    if (r->generated >= r->params.max_new_tokens ||
        static_cast<int64_t>(r->history.size()) >=
            config.max_position_embeddings) {
      reason = FinishReason::kLength;
      break;
    }
  }
  if (reason != FinishReason::kNone) {
    if (reason != FinishReason::kStop && r->detokenizer)
      r->text += r->detokenizer->Finish();
    Finish(r, reason, absl::OkStatus(), std::move(delta.tokens),
           std::move(delta.logprobs), std::move(delta.prompt_logprobs));
    return true;
  }
  const size_t safe = r->text.size() - StopHoldback(r->text, r->params.stop);
  if (safe > r->sent) {
    delta.text = r->text.substr(r->sent, safe - r->sent);
    r->sent = safe;
  }
  deliveries.push_back({r->callback, std::move(delta)});
  return false;
}

void DecodeWorker::Impl::TakePromptScores(Request* r, TokenDelta* delta) {
  if (!r->params.prompt_logprobs || r->prompt_scores_sent) return;
  r->prompt_scores_sent = true;
  delta->prompt_logprobs = std::move(r->prompt_scores);
  r->prompt_scores.clear();
}

void DecodeWorker::Impl::Finish(
    Request* r, FinishReason reason, absl::Status status,
    std::vector<int32_t> tokens, std::vector<engine::TokenLogprobs> logprobs,
    std::vector<engine::TokenLogprobs> prompt_logprobs) {
  TokenDelta delta;
  delta.tokens = std::move(tokens);
  delta.logprobs = std::move(logprobs);
  delta.prompt_logprobs = std::move(prompt_logprobs);
  if (status.ok() && r->text.size() > r->sent)
    delta.text = r->text.substr(r->sent);
  delta.finished = true;
  delta.reason = reason;
  delta.status = std::move(status);
  deliveries.push_back({r->callback, std::move(delta)});
  if (proposer) proposer->Forget(r->id);
  r->DropKv();
  if (r->phase == Phase::kRunning) {
    running.erase(std::find(running.begin(), running.end(), r));
  } else if (r->phase == Phase::kWaiting) {
    auto it = std::find(waiting.begin(), waiting.end(), r);
    if (it != waiting.end()) waiting.erase(it);
  }
  {
    absl::MutexLock lock(&mu);
    ids.erase(r->id);
  }
  requests.erase(r->id);
}

void DecodeWorker::Impl::Deliver() {
  std::vector<Delivery> batch;
  batch.swap(deliveries);
  for (auto& d : batch) {
    if (*d.callback) (*d.callback)(d.delta);
  }
}

void DecodeWorker::Impl::PublishLoad() {
  LoadReport l = counters;
  // Expert load from rank 0 (every rank routes every token alike); read
  // here, between steps, on the thread that steps.
  if (const engine::LlamaEngine& e = *ranks[0].engine;
      e.config().HasExperts()) {
    const std::vector<std::vector<int64_t>> load = e.ExpertLoad();
    for (size_t local = 0; local < load.size(); ++local) {
      const int layer = e.shard().layer_begin + static_cast<int>(local);
      if (!e.config().IsMoeLayer(layer)) continue;
      int64_t total = 0, busiest = 0;
      for (int64_t tokens : load[local]) {
        total += tokens;
        busiest = std::max(busiest, tokens);
      }
      l.expert_layers.push_back(layer);
      l.expert_routed_tokens.push_back(total);
      l.expert_imbalance.push_back(total > 0 ? static_cast<double>(busiest) *
                                                   load[local].size() / total
                                             : 0.0);
    }
  }
  l.running = static_cast<int>(running.size());
  l.waiting = static_cast<int>(waiting.size());
  absl::MutexLock lock(&mu);
  load = l;
}

// ---- Public face ------------------------------------------------------------

absl::StatusOr<std::unique_ptr<DecodeWorker>> DecodeWorker::Create(
    const model::WeightSource& weights, const tokenizer::Tokenizer* tokenizer,
    const DecodeWorkerOptions& options) {
  const auto& c = weights.config();
  if (options.tp_size < 1 || c.num_heads % options.tp_size != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("tp_size ", options.tp_size, " must divide the ",
                     c.num_heads, " attention heads"));
  if (options.block_size < 1 || options.num_blocks < 1)
    return absl::InvalidArgumentError(
        absl::StrCat("block_size and num_blocks must be >= 1, got ",
                     options.block_size, " and ", options.num_blocks));
  if (options.max_running < 1)
    return absl::InvalidArgumentError("max_running must be >= 1");
  if (options.speculation.max_gamma < 0)
    return absl::InvalidArgumentError("speculation.max_gamma must be >= 0");
  if (options.max_step_tokens < 1 + options.speculation.max_gamma)
    return absl::InvalidArgumentError(
        absl::StrCat("max_step_tokens ", options.max_step_tokens,
                     " must be at least 1 + max_gamma = ",
                     1 + options.speculation.max_gamma));
  if (tokenizer != nullptr)
    PDS_RETURN_IF_ERROR(tokenizer->CheckCompatibleWith(c.vocab_size));
  auto impl = std::make_unique<Impl>(weights, tokenizer, options);
  absl::Status s = impl->Start();
  if (!s.ok()) {
    impl->Shutdown();
    return s;
  }
  {
    absl::MutexLock lock(&impl->mu);
    impl->load.blocks_total = options.num_blocks;
  }
  return std::unique_ptr<DecodeWorker>(new DecodeWorker(std::move(impl)));
}

DecodeWorker::DecodeWorker(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {}

DecodeWorker::~DecodeWorker() { impl_->Shutdown(); }

absl::StatusOr<AdmitResult> DecodeWorker::Admit(uint64_t request_id,
                                                std::vector<int32_t> prompt,
                                                const RequestParams& params,
                                                StreamCallback callback) {
  Impl& m = *impl_;
  PDS_RETURN_IF_ERROR(
      ValidateRequest(prompt, params, m.config, m.options, m.tok != nullptr));
  absl::StatusOr<std::unique_ptr<engine::TokenConstraint>> constraint =
      m.NewConstraint(params);
  if (!constraint.ok()) return constraint.status();
  if (params.prompt_logprobs) {
    return absl::InvalidArgumentError(
        "prompt logprobs of a remotely prefilled request come from its "
        "prefill group; only a local prefill (Submit) scores the prompt");
  }
  {
    absl::MutexLock lock(&m.mu);
    if (m.stop) return absl::UnavailableError("decode worker shutting down");
    if (!m.ids.try_emplace(request_id, Impl::IdState::kAwaitingKv).second)
      return absl::AlreadyExistsError(
          absl::StrCat("request ", request_id, " is already live"));
  }
  auto start = kv::KvSequence::StartWithPrefix(m.manager.get(), prompt);
  absl::Status reserved =
      start.sequence.Reserve(static_cast<int64_t>(prompt.size()));
  if (!reserved.ok()) {
    absl::MutexLock lock(&m.mu);
    m.ids.erase(request_id);
    return reserved;
  }
  AdmitResult result;
  auto table = start.sequence.block_table();
  result.block_ids.assign(table.begin(), table.end());
  result.cached_tokens = start.cached_tokens;
  auto r =
      m.NewRequest(request_id, std::move(prompt), params, std::move(callback));
  r->constraint = *std::move(constraint);
  r->AwaitRemoteKv(std::move(start.sequence), start.cached_tokens);
  r->phase = Phase::kAwaitingKv;
  r->lease_deadline = absl::Now() + m.options.kv_lease;
  absl::MutexLock lock(&m.mu);
  m.inbox.push_back(std::move(r));
  return result;
}

absl::Status DecodeWorker::MarkKvComplete(
    uint64_t request_id, int32_t first_token,
    engine::TokenLogprobs first_logprobs) {
  Impl& m = *impl_;
  absl::MutexLock lock(&m.mu);
  auto it = m.ids.find(request_id);
  if (it == m.ids.end())
    return absl::NotFoundError(
        absl::StrCat("request ", request_id, " is not admitted"));
  if (it->second != Impl::IdState::kAwaitingKv)
    return absl::FailedPreconditionError(absl::StrCat(
        "request ", request_id, " already has its KV marked complete"));
  it->second = Impl::IdState::kActive;
  if (first_token < 0 || first_token >= m.config.vocab_size) {
    absl::Status error = absl::InvalidArgumentError(absl::StrCat(
        "first token ", first_token, " of request ", request_id,
        " is outside the vocabulary [0, ", m.config.vocab_size, ")"));
    m.commands.push_back({Command::kFail, request_id, 0, error, {}});
    return error;
  }
  absl::Status bad_logprobs =
      CheckFirstLogprobs(first_logprobs, request_id, m.config.vocab_size);
  if (!bad_logprobs.ok()) {
    m.commands.push_back({Command::kFail, request_id, 0, bad_logprobs, {}});
    return bad_logprobs;
  }
  m.commands.push_back({Command::kKvComplete,
                        request_id,
                        first_token,
                        {},
                        std::move(first_logprobs)});
  return absl::OkStatus();
}

absl::Status DecodeWorker::Submit(uint64_t request_id,
                                  std::vector<int32_t> prompt,
                                  const RequestParams& params,
                                  StreamCallback callback,
                                  const Resumption* resume) {
  Impl& m = *impl_;
  PDS_RETURN_IF_ERROR(
      ValidateRequest(prompt, params, m.config, m.options, m.tok != nullptr));
  absl::StatusOr<std::unique_ptr<engine::TokenConstraint>> constraint =
      m.NewConstraint(params);
  if (!constraint.ok()) return constraint.status();
  auto r =
      m.NewRequest(request_id, std::move(prompt), params, std::move(callback));
  r->constraint = *std::move(constraint);
  if (resume != nullptr) PDS_RETURN_IF_ERROR(m.Resume(*r, *resume));
  absl::MutexLock lock(&m.mu);
  if (m.stop) return absl::UnavailableError("decode worker shutting down");
  if (!m.ids.try_emplace(request_id, Impl::IdState::kActive).second)
    return absl::AlreadyExistsError(
        absl::StrCat("request ", request_id, " is already live"));
  m.inbox.push_back(std::move(r));
  return absl::OkStatus();
}

absl::Status DecodeWorker::Abort(uint64_t request_id) {
  Impl& m = *impl_;
  absl::MutexLock lock(&m.mu);
  if (!m.ids.contains(request_id))
    return absl::NotFoundError(
        absl::StrCat("request ", request_id, " is not live"));
  m.commands.push_back({Command::kAbort, request_id, 0, {}, {}});
  return absl::OkStatus();
}

LoadReport DecodeWorker::Load() const {
  LoadReport l;
  {
    absl::MutexLock lock(&impl_->mu);
    l = impl_->load;
    // Exact now (the rest is the scheduler's last snapshot): a router that
    // just admitted a request sees it.
    l.awaiting_kv = 0;
    for (const auto& [id, state] : impl_->ids)
      l.awaiting_kv += state == Impl::IdState::kAwaitingKv;
  }
  l.blocks_used = impl_->manager->used_blocks();
  l.blocks_total = impl_->manager->num_blocks();
  return l;
}

kv::KvPool& DecodeWorker::kv_pool(int rank) {
  Rank& r = impl_->ranks[rank];
  return r.landing != nullptr ? *r.landing : *r.pool;
}

const kv::KvBlockManager& DecodeWorker::block_manager() const {
  return *impl_->manager;
}

absl::Status DecodeWorker::PinBlocks(std::span<const int64_t> blocks) {
  return impl_->manager->AddRef(blocks);
}

void DecodeWorker::UnpinBlocks(std::span<const int64_t> blocks) {
  const absl::Status s = impl_->manager->Free(blocks);
  if (!s.ok()) PDS_LOG(ERROR) << "unpinning KV blocks: " << s;
}

const std::string& DecodeWorker::tp_communicator() const {
  return impl_->tp_communicator;
}

int DecodeWorker::tp_size() const { return impl_->options.tp_size; }

std::vector<int64_t> DecodeWorker::rank_weight_bytes() const {
  std::vector<int64_t> out;
  for (const auto& r : impl_->ranks) out.push_back(r.engine->weight_bytes());
  return out;
}

void DecodeWorker::SetLogitsObserverForTest(LogitsObserver observer) {
  absl::MutexLock lock(&impl_->mu);
  impl_->observer = std::move(observer);
}

void DecodeWorker::SetAcceptAllDraftsForTest(bool accept_all) {
  absl::MutexLock lock(&impl_->mu);
  impl_->accept_all = accept_all;
}

}  // namespace pdserve::decode
