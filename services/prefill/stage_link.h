// What travels between pipeline stages and back to the coordinator, and the
// link interfaces a stage is wired with. The in-process implementation (a
// closable queue) runs whole pipelines inside one test process; a UCX link
// (services/transport messages) implements the same two interfaces across
// processes.
//
// Stage i receives one StageMessage per microbatch, in order, runs its layers
// and sends the message on with the hidden states replaced. Every stage
// reports StageEvents to the coordinator (stage 0's process).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/closable_queue.h"
#include "engine/sampler.h"

namespace pdserve::prefill {

// One request's chunk inside a microbatch: everything any stage needs.
struct ChunkHeader {
  uint64_t request_id = 0;
  int token_begin = 0;  // positions [token_begin, token_end) are computed
  int token_end = 0;
  int kv_begin = 0;  // KV of [kv_begin, token_end) is sent after this chunk
  // Prompt position of the destination's token 0 (a multiple of the block
  // size): the decode side already holds the KV below it (its own prefix
  // cache), so positions < kv_dst_offset are not sent and position p lands in
  // grant token p - kv_dst_offset.
  int kv_dst_offset = 0;
  bool final_chunk = false;
  std::vector<int32_t> tokens;  // prompt tokens [token_begin, token_end)
  std::vector<int32_t>
      block_table;  // group-wide block ids covering [0, token_end)
  engine::SamplingParams sampling;  // used by the last stage on the final chunk
  // The prompt's distinct tokens, on a final chunk whose sampling penalizes
  // them (SamplingParams::penalizes_prompt_tokens: the last stage sees only
  // its chunk's tokens).
  std::vector<int32_t> penalized_prompt_tokens;
  int top_logprobs = 0;  // alternatives of the first token to report
  // Score the prompt: the last stage computes logits at every position of the
  // chunk and reports log p(next prompt token) (kPromptLogprobs), with
  // top_logprobs alternatives each.
  bool prompt_logprobs = false;
  // The prompt token at token_end (what the chunk's last position predicts);
  // -1 on the final chunk. Only meaningful with prompt_logprobs.
  int32_t next_token = -1;
  // False for a request with no KV destination (scoring only): the stages
  // compute into their own pool and send nothing.
  bool write_kv = true;
  // A request's first chunk carries the decode side's KV grants (opaque blobs
  // for the stage's KV output, e.g. transport::KvSink::Expect results).
  std::vector<std::string> kv_grants;
  int num_tokens() const { return token_end - token_begin; }
};

struct StageMessage {
  uint64_t microbatch_id = 0;
  std::vector<ChunkHeader> chunks;
  // [total tokens, hidden] in chunk order; empty into stage 0.
  std::vector<float> hidden;
};

struct StageEvent {
  enum class Kind {
    kMicrobatchDone,  // a stage finished (or failed) a microbatch
    kFirstToken,      // the last stage sampled a request's first token
    kKvWritten,       // a stage's KV writes of a request's final chunk landed
    kPromptLogprobs,  // the last stage scored a prompt_logprobs chunk
  };
  Kind kind = Kind::kMicrobatchDone;
  int stage = 0;
  uint64_t microbatch_id = 0;         // kMicrobatchDone
  std::vector<uint64_t> request_ids;  // kMicrobatchDone: requests inside
  uint64_t request_id = 0;            // kFirstToken, kKvWritten
  absl::Status status;                // a failure of this step
  engine::SampledToken token;         // kFirstToken (with its alternatives)
  absl::Time start, end;              // kMicrobatchDone: compute interval
  int tokens = 0;                     // kMicrobatchDone
  // kPromptLogprobs: entry k is log p(prompt token first_scored + k | the
  // tokens before it), with the chunk's top_logprobs alternatives.
  int first_scored = 0;
  std::vector<engine::TokenLogprobs> prompt_logprobs;
};

// Sending end of a link to the next stage. Thread-compatible: one sender.
class StageSender {
 public:
  virtual ~StageSender() = default;
  // UNAVAILABLE once the link is closed or the peer is gone.
  [[nodiscard]] virtual absl::Status Send(StageMessage message) = 0;
  // No more messages; the receiver drains and then sees the end.
  virtual void Close() = 0;
};

// Receiving end. Receive blocks until a message arrives; nullopt once the
// link is closed and drained (the stage then shuts down).
class StageReceiver {
 public:
  virtual ~StageReceiver() = default;
  virtual std::optional<StageMessage> Receive() = 0;
};

// Where stages report to the coordinator. Thread-safe; never blocks.
class StageEventSink {
 public:
  virtual ~StageEventSink() = default;
  virtual void Report(StageEvent event) = 0;
};

// Both ends of an in-process link.
class InProcessStageLink : public StageSender, public StageReceiver {
 public:
  absl::Status Send(StageMessage message) override {
    if (!queue_.Push(std::move(message))) {
      return absl::UnavailableError("stage link is closed");
    }
    return absl::OkStatus();
  }
  void Close() override { queue_.Close(); }
  std::optional<StageMessage> Receive() override { return queue_.Pop(); }
  size_t depth() const { return queue_.size(); }

 private:
  ClosableQueue<StageMessage> queue_;
};

}  // namespace pdserve::prefill
