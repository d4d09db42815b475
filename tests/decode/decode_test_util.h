// Fixtures for decode worker tests: stories260K weights + tokenizer loaded
// once, a stream collector, and waiting helpers.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "comm/communicator.h"
#include "common/logging.h"
#include "decode/decode_worker.h"
#include "engine/llama_engine.h"
#include "engine/sampler.h"
#include "model/weight_source.h"
#include "speculative/truncated_weights.h"
#include "testing/golden.h"
#include "tokenizer/tokenizer.h"

namespace pdserve::decode::testing_util {

struct Model {
  std::unique_ptr<model::WeightSource> weights;
  std::unique_ptr<model::WeightSource> draft;  // first 3 of 5 layers
  std::unique_ptr<tokenizer::Tokenizer> tokenizer;
};

inline const Model& Stories() {
  static Model* m = [] {
    auto* model = new Model;
    auto w = model::OpenModel(pdserve::testing::Stories260KGguf());
    PDS_CHECK(w.ok());
    model->weights = std::move(*w);
    auto d = speculative::MakeLayerTruncatedWeights(*model->weights, 3);
    PDS_CHECK(d.ok());
    model->draft = std::move(*d);
    auto t = tokenizer::LoadTokenizerForModel(*model->weights);
    PDS_CHECK(t.ok());
    model->tokenizer = std::move(*t);
    return model;
  }();
  return *m;
}

inline std::vector<pdserve::testing::GoldenCase> AllGoldenCases() {
  auto cases = pdserve::testing::LoadGoldenCases("golden.jsonl");
  for (auto& c : pdserve::testing::LoadGoldenCases("golden_long.jsonl"))
    cases.push_back(c);
  return cases;
}

// Collects one request's stream.
class Stream {
 public:
  StreamCallback Callback() {
    return [this](const TokenDelta& d) {
      absl::MutexLock lock(&mu_);
      EXPECT_FALSE(finished_) << "delta after the final one";
      EXPECT_TRUE(d.logprobs.empty() || d.logprobs.size() == d.tokens.size())
          << d.logprobs.size() << " logprobs for " << d.tokens.size()
          << " tokens";
      tokens_.insert(tokens_.end(), d.tokens.begin(), d.tokens.end());
      logprobs_.insert(logprobs_.end(), d.logprobs.begin(), d.logprobs.end());
      if (!d.prompt_logprobs.empty()) {
        EXPECT_EQ(deltas_, 0) << "prompt scores after the first delta";
        EXPECT_TRUE(prompt_logprobs_.empty()) << "prompt scores twice";
        prompt_logprobs_ = d.prompt_logprobs;
      }
      text_ += d.text;
      ++deltas_;
      if (d.finished) {
        finished_ = true;
        reason_ = d.reason;
        status_ = d.status;
      }
    };
  }
  // Waits (bounded) for the final delta.
  bool Wait(absl::Duration timeout = absl::Seconds(60)) {
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(&finished_), timeout);
  }
  std::vector<int32_t> tokens() {
    absl::MutexLock lock(&mu_);
    return tokens_;
  }
  std::vector<engine::TokenLogprobs> logprobs() {
    absl::MutexLock lock(&mu_);
    return logprobs_;
  }
  std::vector<engine::TokenLogprobs> prompt_logprobs() {
    absl::MutexLock lock(&mu_);
    return prompt_logprobs_;
  }
  size_t num_tokens() {
    absl::MutexLock lock(&mu_);
    return tokens_.size();
  }
  std::string text() {
    absl::MutexLock lock(&mu_);
    return text_;
  }
  FinishReason reason() {
    absl::MutexLock lock(&mu_);
    return reason_;
  }
  absl::Status status() {
    absl::MutexLock lock(&mu_);
    return status_;
  }
  bool finished() {
    absl::MutexLock lock(&mu_);
    return finished_;
  }

 private:
  absl::Mutex mu_;
  std::vector<int32_t> tokens_;
  std::vector<engine::TokenLogprobs> logprobs_;
  std::vector<engine::TokenLogprobs> prompt_logprobs_;
  std::string text_;
  int deltas_ = 0;
  bool finished_ = false;
  FinishReason reason_ = FinishReason::kNone;
  absl::Status status_;
};

inline DecodeWorkerOptions Options(int tp, SpeculationMode mode) {
  DecodeWorkerOptions o;
  o.tp_size = tp;
  o.threads_per_rank = 1;
  o.block_size = 16;
  o.num_blocks = 128;
  o.speculation.mode = mode;
  // These tests check speculation's correctness with several requests in the
  // batch, not its economics: keep it on at any batch and with a cheap verify
  // (the defaults switch it off past batch 2, see decode_worker.h).
  o.speculation.max_batch = 1 << 20;
  o.speculation.verify_cost_per_token = 0.05;
  o.speculation.draft_weights = Stories().draft.get();
  o.speculation.draft_kv_blocks = 128;
  return o;
}

inline std::unique_ptr<DecodeWorker> MakeWorker(
    const DecodeWorkerOptions& options) {
  auto w = DecodeWorker::Create(*Stories().weights, Stories().tokenizer.get(),
                                options);
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? std::move(w).value() : nullptr;
}

inline RequestParams Greedy(int max_new_tokens) {
  RequestParams p;
  p.max_new_tokens = max_new_tokens;
  return p;
}

// Plays the prefill side: runs the prompt through T engine shards writing the
// worker's pools at the admitted block ids (positions [cached, n)), and
// returns the last position's logits (rank 0's; the first token is drawn
// from them).
inline std::vector<float> RemotePrefill(DecodeWorker& worker,
                                        const std::vector<int32_t>& prompt,
                                        const AdmitResult& admit) {
  const int tp = worker.tp_size();
  std::unique_ptr<comm::InProcessGroup> group;
  if (tp > 1) group = std::move(comm::InProcessGroup::Create(tp)).value();
  std::vector<int32_t> table(admit.block_ids.begin(), admit.block_ids.end());
  std::vector<std::vector<float>> logits(tp);
  std::vector<std::thread> threads;
  for (int r = 0; r < tp; ++r) {
    threads.emplace_back([&, r] {
      engine::EngineOptions eo;
      eo.shard = engine::ShardSpec{0, -1, r, tp};
      eo.num_threads = 1;
      eo.communicator = group ? group->rank(r) : nullptr;
      auto engine = engine::LlamaEngine::Create(*Stories().weights, eo);
      ASSERT_TRUE(engine.ok());
      engine::ForwardBatch batch;
      engine::SequenceStep step;
      const int cached = static_cast<int>(admit.cached_tokens);
      step.tokens = std::span<const int32_t>(prompt).subspan(cached);
      step.num_tokens = static_cast<int>(prompt.size()) - cached;
      step.start_position = cached;
      step.block_table = table;
      step.logit_indices = {step.num_tokens - 1};
      batch.sequences.push_back(step);
      engine::ForwardResult result;
      ASSERT_TRUE((*engine)->Forward(batch, worker.kv_pool(r), &result).ok());
      logits[r] = std::move(result.logits);
    });
  }
  for (auto& t : threads) t.join();
  return logits[0];
}

// Blocks used return to 0 once every request is gone (the scheduler frees
// asynchronously right before the final callback, so this is immediate).
inline void ExpectNoLeak(const DecodeWorker& worker) {
  EXPECT_EQ(worker.block_manager().used_blocks(), 0);
  EXPECT_TRUE(worker.block_manager().CheckInvariantsForTest().ok());
}

// Submits every golden prompt at once (greedy, its golden length) and
// expects each stream to end by length with the golden tokens and text (a
// mismatch names the golden's top-2 margin: bf16 backends may flip near
// ties), then that no KV is left behind.
inline void ExpectEveryGoldenCase(DecodeWorker& worker) {
  auto cases = AllGoldenCases();
  std::vector<Stream> streams(cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    ASSERT_TRUE(worker
                    .Submit(i, cases[i].prompt_ids,
                            Greedy(cases[i].max_new_tokens),
                            streams[i].Callback())
                    .ok());
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    ASSERT_TRUE(streams[i].Wait()) << "case " << i;
    EXPECT_TRUE(streams[i].status().ok()) << streams[i].status();
    EXPECT_EQ(streams[i].reason(), FinishReason::kLength) << "case " << i;
    EXPECT_EQ(streams[i].tokens(), cases[i].greedy_ids)
        << "case " << i << " (golden min top-2 margin "
        << cases[i].min_top2_margin << ")";
    EXPECT_EQ(streams[i].text(), cases[i].text) << "case " << i;
  }
  ExpectNoLeak(worker);
}

}  // namespace pdserve::decode::testing_util
