// A request as the decode worker's scheduler thread holds it (internal to
// services/decode: decode_worker.cc and step_planner.cc). Owned by the
// scheduler thread once it leaves the inbox; nothing here is thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "decode/decode_worker.h"
#include "engine/sampler.h"
#include "kv/block_manager.h"
#include "kv/sequence_blocks.h"
#include "speculative/adaptive_gamma.h"
#include "tokenizer/detokenizer.h"

namespace pdserve::decode {

enum class Phase { kAwaitingKv, kWaiting, kRunning };

struct ScheduledRequest {
  uint64_t id = 0;
  RequestParams params;
  std::shared_ptr<StreamCallback> callback;
  size_t prompt_len = 0;
  std::vector<int32_t> history;  // prompt + generated
  int64_t generated = 0;
  std::optional<kv::KvSequence> sequence;
  // Positions whose KV is complete; a running request feeds
  // history[kv_tokens, history.size()) next. Changed only through the KV
  // methods below.
  int64_t kv_tokens = 0;
  // Prompt positions a remote prefill writes (the rest were a cached prefix).
  int64_t prefilled_from = 0;
  Phase phase = Phase::kWaiting;
  absl::Time lease_deadline = absl::InfiniteFuture();
  std::unique_ptr<tokenizer::IncrementalDetokenizer> detokenizer;
  std::string text;  // generated text (cut at a stop string)
  size_t sent = 0;   // bytes of `text` streamed
  speculative::AdaptiveGamma gamma;
  // RequestParams::prompt_logprobs: entry k scores prompt token k + 1;
  // complete at prompt_len - 1 entries, handed to the first delta.
  std::vector<engine::TokenLogprobs> prompt_scores;
  bool prompt_scores_sent = false;
  // Structured output: the grammar's state after the generated tokens (null
  // without). Every emitted token is Accepted; verification masks by it.
  std::unique_ptr<engine::TokenConstraint> constraint;

  bool scoring() const {
    return params.prompt_logprobs && !prompt_scores_sent &&
           prompt_scores.size() + 1 < prompt_len;
  }
  // Decoding: all history but its last token has KV (a draft can follow).
  bool decoding() const {
    return kv_tokens + 1 == static_cast<int64_t>(history.size());
  }

  // ---- Every change of the request's KV goes through these -------------
  // The invariant they keep: kv_tokens positions of `sequence` hold final KV
  // (never a rejected draft's), and only those positions' full blocks are
  // ever published to the prefix cache.

  // A fresh sequence; with `prefix`, the longest cached prefix of the
  // history is reused (a request scoring its prompt needs every position's
  // logits, so it takes none).
  void StartKv(kv::KvBlockManager* manager, bool reuse_prefix) {
    if (!reuse_prefix) {
      sequence.emplace(manager);
      kv_tokens = 0;
      return;
    }
    auto start = kv::KvSequence::StartWithPrefix(manager, history);
    sequence.emplace(std::move(start.sequence));
    kv_tokens = start.cached_tokens;
  }
  // Admitted for a remote prefill: `reserved` holds the prompt's blocks, the
  // first `cached` positions from the prefix cache; the prefill writes the
  // rest.
  void AwaitRemoteKv(kv::KvSequence reserved, int64_t cached) {
    sequence.emplace(std::move(reserved));
    prefilled_from = cached;
  }
  // A remote prefill wrote the whole prompt.
  void PromptKvLanded() {
    kv_tokens = static_cast<int64_t>(history.size());
    PublishKv();
  }
  // After a step: the first `tokens` positions are final; slots beyond (a
  // verify's rejected drafts) are given back.
  void KeepKv(int64_t tokens) {
    kv_tokens = tokens;
    (void)sequence->Truncate(tokens);
  }
  // Shares the final KV's full blocks through the prefix cache.
  void PublishKv() {
    (void)sequence->PublishFullBlocks(
        std::span<const int32_t>(history).first(kv_tokens));
  }
  // A model whose every layer windows: blocks wholly before `position`
  // (the first key any later query sees) go back once published.
  void ReleaseKvBefore(int64_t position) {
    if (sequence.has_value()) (void)sequence->ReleaseBlocksBefore(position);
  }
  // Preemption: the blocks go back (published ones stay in the cache).
  void DropKv() {
    sequence.reset();
    kv_tokens = 0;
  }
};

}  // namespace pdserve::decode
