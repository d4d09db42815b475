// DecodeWorker: the decode side's compute core, in process. T tensor-parallel
// ranks (threads meeting in a comm::InProcessGroup, each with its own engine
// shard and its own KvPool holding its KV heads; block ids are shared through
// one KvBlockManager) driven by one scheduler thread that runs continuous
// batching with optional speculative decoding.
//
// Request life:
//   Admit      allocate KV blocks for the prompt (reusing cached prefix
//              blocks) and return their ids: a remote prefill writes positions
//              [cached_tokens, prompt size) of every rank's pool. The request
//              holds its blocks until MarkKvComplete, Abort, or the lease
//              expires (then it finishes with DEADLINE_EXCEEDED).
//   MarkKvComplete(first_token)  the prefill sampled output token 0; decoding
//              starts and token 0 is streamed first.
//   Submit     local path: the worker prefills the prompt itself (also how a
//              preempted request is recomputed: prompt + generated tokens).
//   Abort      at any time; finishes the stream with CANCELLED.
// Every request gets StreamCallback calls with token deltas and incrementally
// detokenized text, and exactly one final call (finished = true). A request
// whose Admit/Submit fails never calls its callback. Callbacks run
// on the scheduler thread with no lock held: they must be quick and must not
// block on the worker's progress; calling Abort/Submit/Load from one is fine.
//
// Scheduling, per step: expired leases and aborts are freed; waiting requests
// are admitted FIFO while KV and max_running allow (prefix cache reuse);
// running requests are planned oldest first within max_step_tokens (a decode
// takes 1 + γ tokens, a prefill a chunk of what is left). When KV runs out the
// youngest running request is preempted: its blocks are freed (published ones
// stay in the prefix cache) and it is recomputed later.
//
// Thread-safety: all public methods may be called from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/engine_types.h"
#include "engine/sampler.h"
#include "kv/block_manager.h"
#include "kv/kv_pool.h"
#include "model/weight_source.h"
#include "speculative/proposer.h"
#include "tokenizer/tokenizer.h"

namespace pdserve::decode {

enum class SpeculationMode { kOff, kNgram, kDraft, kScripted };

struct SpeculationOptions {
  SpeculationMode mode = SpeculationMode::kOff;
  int max_gamma = 4;
  // Speculation is switched off for a step with more decoding requests than
  // this. Measured (bench/decode_bench.cc, llama-110m, 2 cores, docs/
  // PERFORMANCE.md "Decode"): a verify step feeds b·(1+γ) rows through every
  // projection, which stay weight-bandwidth-bound up to a few rows per
  // panel. With the packed projection kernel the marginal cost of a verified
  // token, c(b) in decode steps, is 0.05-0.09 at b = 1, 0.14-0.19 at b = 2,
  // 0.28-0.33 at b = 4, 0.3-0.5 at b = 8 and 0.6-0.8 from b = 16 on, while
  // n-gram drafts on the golden prompts are accepted 31-46% of the time
  // (γ = 1 pays iff acceptance > c). n-gram vs off measured 1.85x at b = 1
  // and 1.47x at b = 4 with this cutoff; past it verification costs about
  // what the accepted tokens save.
  int max_batch = 4;
  // Marginal cost of one more verified token per request relative to a
  // decode step, for the adaptive γ: c(1) measured 0.05-0.09 (a 5-token
  // verify costs ~1.35 decode steps at batch 1); rounded up for noise.
  double verify_cost_per_token = 0.1;
  // kDraft: the draft model (must outlive the worker; same vocabulary).
  const model::WeightSource* draft_weights = nullptr;
  int64_t draft_kv_blocks = 512;
  // kNgram.
  speculative::NgramOptions ngram;
  // kScripted: the sequences of speculative::MakeScriptedProposer.
  std::vector<std::vector<int32_t>> scripted;
};

// What one forward step did, for metrics (DecodeWorkerOptions::step_observer).
struct StepStats {
  int sequences = 0;   // requests in the step's batch
  int tokens_fed = 0;  // history + draft tokens through the model
  int logit_rows = 0;  // rows the last layer turned into logits
  // Σ over fed tokens of the positions each attends to (its own included):
  // the attention work of the step, for the layout planner's cost model.
  int64_t attended_positions = 0;
  int output_tokens = 0;  // tokens the step emitted (streamed)
  double seconds = 0;     // the forward on every rank, until the last is done
  // Per speculative verify in the step: tokens it emitted (accepted + 1).
  std::vector<int> acceptance_lengths;
};

struct DecodeWorkerOptions {
  int tp_size = 1;
  int threads_per_rank = 1;
  int block_size = 16;
  int64_t num_blocks = 256;
  int max_running = 64;
  // Tokens one step may feed (decode tokens + drafts + prefill chunks).
  int max_step_tokens = 512;
  absl::Duration kv_lease = absl::Seconds(30);
  SpeculationOptions speculation;
  // Makes rank r's KV pool (e.g. memory the transport allocates and
  // registers, so prefill writes land by shared memory or RDMA); null = plain
  // kv::KvPool::Create.
  std::function<absl::StatusOr<std::unique_ptr<kv::KvPool>>(
      int rank, const kv::KvCacheLayout& layout, int64_t num_blocks)>
      kv_pool_factory;
  // Where the model runs. With kCuda each rank computes on a GPU with its KV
  // pool in GPU memory; prefill writes land in a host pool that mirrors it
  // (kv_pool_factory's, registered with the transport, or a plain one), and a
  // request's new blocks are copied to the GPU when its KV is marked
  // complete. Ranks of one worker reduce through host memory.
  engine::Backend backend = engine::Backend::kCpu;
  engine::CudaOptions cuda;
  // KV element type (EngineOptions::kv_dtype); unset = the backend's own.
  std::optional<kv::KvDType> kv_dtype;
  // How quantized GGUF weights multiply (EngineOptions::quantized_matmul).
  engine::QuantizedMatmul quantized_matmul =
      engine::QuantizedMatmul::kInt8Activations;
  // How the TP ranks share a mixture of experts' routed experts
  // (EngineOptions::expert_parallelism; dense models ignore it).
  engine::ExpertParallelism expert_parallelism =
      engine::ExpertParallelism::kTensor;
  // GPU of rank r: cuda_devices[r % size]; empty = cuda.device for every rank.
  std::vector<int> cuda_devices;
  // Called on the scheduler thread after every step (no lock held). Must be
  // quick: it delays the next step (metrics observe histograms here).
  std::function<void(const StepStats&)> step_observer;
};

struct RequestParams {
  engine::SamplingParams sampling;
  int max_new_tokens = 16;
  std::vector<std::string> stop;  // stop strings (not included in the text)
  bool ignore_eos = false;
  // Report each output token's log-probability (TokenDelta::logprobs) and,
  // with top_logprobs > 0 (at most engine::kMaxTopLogprobs), that many most
  // likely alternatives. Costs a log-softmax per token and makes greedy steps
  // download logits rows instead of argmaxes.
  bool logprobs = false;
  int top_logprobs = 0;
  bool wants_logprobs() const { return logprobs || top_logprobs > 0; }
  // Local path only (Submit): score the prompt while prefilling it. The
  // first delta carries log p(prompt token k | tokens before it) for k >= 1
  // (TokenDelta::prompt_logprobs) with top_logprobs alternatives each. The
  // prefix cache is not used for such a request until its prompt is scored.
  bool prompt_logprobs = false;
};

// A request continued here after another worker streamed part of it (stream
// migration: that worker died or drained). The request's history is prompt +
// `output`, and everything that depends on what was generated — the output
// index the seed's draws use, max_new_tokens, min_tokens, penalties, the
// grammar's state, stop strings over the text — counts `output` as
// generated, so the continuation is the one the first worker would have
// produced (greedy: token for token; sampled: draw for draw, the uniforms
// being a function of (seed, index)).
struct Resumption {
  std::vector<int32_t> output;  // tokens already streamed (non-empty)
  // Bytes of their text the client has; the rest of it (text the first
  // worker held back because it could start a stop string) is streamed.
  int64_t delivered_text_bytes = 0;
};

enum class FinishReason { kNone, kEos, kLength, kStop, kAborted, kError };
const char* FinishReasonName(FinishReason reason);

struct TokenDelta {
  std::vector<int32_t> tokens;  // new output tokens
  // One per token when the request asked (RequestParams::logprobs).
  std::vector<engine::TokenLogprobs> logprobs;
  // First delta of a request with RequestParams::prompt_logprobs: entry k
  // scores prompt token k + 1.
  std::vector<engine::TokenLogprobs> prompt_logprobs;
  std::string text;  // text they complete (UTF-8, stop-safe)
  bool finished = false;
  FinishReason reason = FinishReason::kNone;
  absl::Status status;  // not OK iff reason is kAborted or kError
};
using StreamCallback = std::function<void(const TokenDelta&)>;

struct AdmitResult {
  std::vector<kv::BlockId> block_ids;  // covering every prompt position
  int64_t cached_tokens = 0;  // prefix already in the blocks (don't write)
};

struct LoadReport {
  int running = 0;
  int waiting = 0;      // queued for (re)admission
  int awaiting_kv = 0;  // admitted, KV not complete yet
  int64_t blocks_used = 0;
  int64_t blocks_total = 0;
  int64_t steps = 0;
  int64_t preemptions = 0;
  // Requests freed because their KV was not completed within kv_lease.
  int64_t lease_expiries = 0;
  // Seconds inside all-reduces, mean over the TP ranks (0 at tp_size 1).
  double allreduce_seconds = 0;
  // GPU workers: bytes of remotely prefilled KV copied from the host landing
  // pools to the GPUs (all ranks), and the seconds the scheduler spent on it
  // (steps wait meanwhile). 0 on CPU workers.
  int64_t kv_staged_bytes = 0;
  double kv_staging_seconds = 0;
  // Speculation: verify steps with drafts, drafts proposed and accepted, and
  // tokens those verify steps emitted (accepted + one each).
  int64_t spec_steps = 0;
  int64_t drafted_tokens = 0;
  int64_t accepted_tokens = 0;
  int64_t spec_emitted_tokens = 0;
  // Mixtures of experts, one entry per sparse layer (model order): tokens
  // routed (each token counts k times) and the load imbalance, the busiest
  // expert's tokens over the mean, since start (1 = even; E/k at worst:
  // every token picks the same experts). Empty for a dense model.
  std::vector<int> expert_layers;
  std::vector<int64_t> expert_routed_tokens;
  std::vector<double> expert_imbalance;
  double mean_acceptance_length() const {
    return spec_steps ? static_cast<double>(spec_emitted_tokens) / spec_steps
                      : 0.0;
  }
};

class DecodeWorker {
 public:
  // `weights` and `tokenizer` must outlive the worker. `tokenizer` may be
  // null (benchmarks on dummy weights): deltas then carry tokens but no text,
  // and stop strings are INVALID_ARGUMENT. INVALID_ARGUMENT for
  // impossible options (tp_size not dividing the heads, budget below
  // 1 + max_gamma, a draft with another vocabulary, ...).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<DecodeWorker>> Create(
      const model::WeightSource& weights, const tokenizer::Tokenizer* tokenizer,
      const DecodeWorkerOptions& options);
  // Aborts whatever is left (callbacks get CANCELLED) and joins the threads.
  ~DecodeWorker();
  DecodeWorker(const DecodeWorker&) = delete;
  DecodeWorker& operator=(const DecodeWorker&) = delete;

  // Remote-prefill path. INVALID_ARGUMENT for a bad prompt/params,
  // ALREADY_EXISTS for a live id, RESOURCE_EXHAUSTED when the blocks are not
  // free now (retry elsewhere or later).
  [[nodiscard]] absl::StatusOr<AdmitResult> Admit(uint64_t request_id,
                                                  std::vector<int32_t> prompt,
                                                  const RequestParams& params,
                                                  StreamCallback callback);
  // NOT_FOUND for an unknown id, FAILED_PRECONDITION if its KV was already
  // marked complete, INVALID_ARGUMENT for a token (or an alternative in
  // `first_logprobs`) outside the vocabulary or more than
  // engine::kMaxTopLogprobs alternatives (the request is then failed and
  // freed). `first_logprobs` is what the prefill
  // computed for token 0 (streamed when the request asked for logprobs; it
  // keeps at most the top_logprobs alternatives the request asked for).
  [[nodiscard]] absl::Status MarkKvComplete(
      uint64_t request_id, int32_t first_token,
      engine::TokenLogprobs first_logprobs = {});
  // Local-prefill path. Errors as Admit, except that a lack of free blocks
  // only queues the request. With `resume`, the request continues a stream
  // another worker began (Resumption); INVALID_ARGUMENT when its tokens are
  // outside the vocabulary or the grammar, already reach max_new_tokens, or
  // come with prompt_logprobs, or when the delivered text is longer than
  // theirs.
  [[nodiscard]] absl::Status Submit(uint64_t request_id,
                                    std::vector<int32_t> prompt,
                                    const RequestParams& params,
                                    StreamCallback callback,
                                    const Resumption* resume = nullptr);
  // NOT_FOUND for an unknown or finished id.
  [[nodiscard]] absl::Status Abort(uint64_t request_id);

  LoadReport Load() const;
  // Rank r's KV pool as prefills write it (what the transport registers):
  // the engine's own pool on CPU, its host mirror on a GPU.
  kv::KvPool& kv_pool(int rank);
  const kv::KvBlockManager& block_manager() const;
  // The transport's hold on blocks a KV grant covers (decode_worker/): one
  // more reference each, so no other request can be given them — whatever
  // happens to the admitted request (aborted, its lease expired, failed) —
  // until UnpinBlocks, once no put of the grant can still land.
  // Thread-safe.
  [[nodiscard]] absl::Status PinBlocks(std::span<const int64_t> blocks);
  void UnpinBlocks(std::span<const int64_t> blocks);
  int tp_size() const;
  // How the TP ranks all-reduce: "none" (tp 1), "host" (CPU ranks, or GPU
  // ranks sharing a GPU) or "nccl" (GPU ranks on distinct GPUs).
  const std::string& tp_communicator() const;
  // Sum over ranks of the weight bytes each shard holds, per rank.
  std::vector<int64_t> rank_weight_bytes() const;

  // Test-only: called on the scheduler thread with the target logits of every
  // row the worker samples from (request, output index, logits).
  using LogitsObserver =
      std::function<void(uint64_t, int64_t, std::span<const float>)>;
  void SetLogitsObserverForTest(LogitsObserver observer);
  // Test-only: the verifier accepts every draft (biased on purpose).
  void SetAcceptAllDraftsForTest(bool accept_all);

  struct Impl;

 private:
  explicit DecodeWorker(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pdserve::decode
