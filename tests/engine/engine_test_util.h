// Helpers for engine tests: run one sequence through an engine with a private
// block table, and compare float vectors.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "engine/llama_engine.h"
#include "engine/sampler.h"
#include "kv/kv_pool.h"
#include "model/weight_source.h"
#include "testing/golden.h"

namespace pdserve::engine::testing_util {

// K/V of positions [0, tokens) of a sequence with an identity block table, as
// f32 in [layer][k|v][head][position][dim] order (what
// prefill::CapturingKvOutput::Collected returns), so pools compare slot by
// slot. The pool must be f32.
inline std::vector<float> ExtractKv(const kv::KvPool& pool, int tokens) {
  const auto& layout = pool.layout();
  std::vector<float> out;
  for (int layer = 0; layer < layout.num_layers; ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int head = 0; head < layout.num_kv_heads; ++head) {
        for (int pos = 0; pos < tokens; ++pos) {
          const float* p =
              pool.f32() + layout.Offset(pos / layout.block_size, layer, kv,
                                         head, pos % layout.block_size);
          out.insert(out.end(), p, p + layout.head_dim);
        }
      }
    }
  }
  return out;
}

// What the single-process engine says about `output` after `prompt`: one
// forward over prompt + output[0, n - 1) with logits at the positions that
// predicted each output token.
inline std::vector<TokenLogprobs> ReferenceLogprobs(
    const model::WeightSource& weights, const std::vector<int32_t>& prompt,
    const std::vector<int32_t>& output, int top_n,
    std::optional<kv::KvDType> kv_dtype = std::nullopt) {
  EngineOptions eo;
  eo.num_threads = 1;
  eo.kv_dtype = kv_dtype;
  auto engine = LlamaEngine::Create(weights, eo);
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (!engine.ok() || output.empty()) return {};
  std::vector<int32_t> tokens = prompt;
  tokens.insert(tokens.end(), output.begin(), output.end() - 1);
  constexpr int kBlock = 16;
  const int blocks = static_cast<int>(tokens.size()) / kBlock + 1;
  auto pool = kv::KvPool::Create((*engine)->KvLayout(kBlock), blocks);
  EXPECT_TRUE(pool.ok()) << pool.status();
  if (!pool.ok()) return {};
  std::vector<int32_t> table(blocks);
  for (int b = 0; b < blocks; ++b) table[b] = b;
  SequenceStep step;
  step.tokens = tokens;
  step.num_tokens = static_cast<int>(tokens.size());
  step.block_table = table;
  for (size_t q = prompt.size() - 1; q < tokens.size(); ++q)
    step.logit_indices.push_back(static_cast<int>(q));
  ForwardBatch batch;
  batch.sequences.push_back(step);
  ForwardResult result;
  EXPECT_TRUE((*engine)->Forward(batch, **pool, &result).ok());
  const int vocab = (*engine)->config().vocab_size;
  std::vector<TokenLogprobs> out;
  for (size_t k = 0; k < output.size(); ++k) {
    out.push_back(ComputeTokenLogprobs(
        std::span<const float>(result.logits).subspan(k * vocab, vocab),
        output[k], top_n));
  }
  return out;
}

inline std::unique_ptr<model::WeightSource> OpenStories(bool gguf) {
  auto source = gguf ? model::OpenModel(pdserve::testing::Stories260KGguf())
                     : model::OpenModel(pdserve::testing::Stories260KDir());
  EXPECT_TRUE(source.ok()) << source.status();
  return source.ok() ? std::move(source).value() : nullptr;
}

inline std::unique_ptr<LlamaEngine> MakeEngine(
    const model::WeightSource& weights, ShardSpec shard = {},
    comm::Communicator* communicator = nullptr, int threads = 2,
    QuantizedMatmul quantized_matmul = QuantizedMatmul::kInt8Activations,
    ExpertParallelism expert_parallelism = ExpertParallelism::kTensor) {
  EngineOptions options;
  options.shard = shard;
  options.expert_parallelism = expert_parallelism;
  options.num_threads = threads;
  options.communicator = communicator;
  options.quantized_matmul = quantized_matmul;
  auto engine = LlamaEngine::Create(weights, options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

inline std::unique_ptr<kv::KvPool> MakePool(const LlamaEngine& engine,
                                            int block_size, int64_t blocks) {
  auto pool = kv::KvPool::Create(engine.KvLayout(block_size), blocks);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? std::move(pool).value() : nullptr;
}

inline std::vector<int32_t> IdentityBlockTable(int64_t blocks,
                                               int32_t first = 0) {
  std::vector<int32_t> table(blocks);
  std::iota(table.begin(), table.end(), first);
  return table;
}

// Prefills `prompt` in chunks of `chunk` tokens (0 = whole) and returns the
// logits of every prompt position, [prompt.size()][vocab].
inline std::vector<std::vector<float>> PrefillAllLogits(
    LlamaEngine& engine, kv::KvPool& pool, const std::vector<int32_t>& prompt,
    const std::vector<int32_t>& table, int chunk = 0) {
  std::vector<std::vector<float>> out;
  const int vocab = engine.config().vocab_size;
  int n = static_cast<int>(prompt.size());
  if (chunk <= 0) chunk = n;
  for (int start = 0; start < n; start += chunk) {
    int len = std::min(chunk, n - start);
    ForwardBatch batch;
    SequenceStep step;
    step.tokens = std::span<const int32_t>(prompt.data() + start, len);
    step.num_tokens = len;
    step.start_position = start;
    step.block_table = table;
    step.logit_indices.resize(len);
    std::iota(step.logit_indices.begin(), step.logit_indices.end(), 0);
    batch.sequences.push_back(step);
    ForwardResult result;
    absl::Status status = engine.Forward(batch, pool, &result);
    EXPECT_TRUE(status.ok()) << status;
    if (!status.ok()) return out;
    for (int i = 0; i < len; ++i) {
      out.emplace_back(result.logits.begin() + int64_t{i} * vocab,
                       result.logits.begin() + int64_t{i + 1} * vocab);
    }
  }
  return out;
}

// Greedy generation of one sequence: prefill (in chunks), then one token per
// step. Stops after EOS or max_new tokens.
// With `step_logits`, the logits each generated token was picked from. With
// `processors`, each token is the greedy choice through their logit
// processors (engine::DrawToken with the prompt and output as history).
inline std::vector<int32_t> GreedyGenerate(
    LlamaEngine& engine, kv::KvPool& pool, const std::vector<int32_t>& prompt,
    int max_new, int chunk = 0,
    std::vector<std::vector<float>>* step_logits = nullptr,
    const SamplingParams* processors = nullptr) {
  const int block_size = pool.layout().block_size;
  const int64_t total = static_cast<int64_t>(prompt.size()) + max_new;
  auto table = IdentityBlockTable((total + block_size - 1) / block_size);
  auto logits = PrefillAllLogits(engine, pool, prompt, table, chunk);
  std::vector<int32_t> generated;
  if (logits.empty()) return generated;
  const std::vector<int32_t> end_tokens = engine.config().EndTokenIds();
  auto argmax = [&](const std::vector<float>& v) {
    if (processors != nullptr) {
      SamplingParams greedy = *processors;
      greedy.temperature = 0;
      return DrawToken(v, greedy, generated.size(),
                       {prompt, generated, end_tokens});
    }
    return static_cast<int32_t>(std::max_element(v.begin(), v.end()) -
                                v.begin());
  };
  int32_t next = argmax(logits.back());
  if (step_logits != nullptr) step_logits->assign(1, logits.back());
  const int eos = engine.config().eos_token_id;
  int position = static_cast<int>(prompt.size());
  while (true) {
    generated.push_back(next);
    if (next == eos || static_cast<int>(generated.size()) >= max_new) break;
    ForwardBatch batch;
    SequenceStep step;
    step.tokens = std::span<const int32_t>(&generated.back(), 1);
    step.num_tokens = 1;
    step.start_position = position++;
    step.block_table = table;
    step.logit_indices = {0};
    batch.sequences.push_back(step);
    ForwardResult result;
    absl::Status status = engine.Forward(batch, pool, &result);
    EXPECT_TRUE(status.ok()) << status;
    if (!status.ok()) break;
    next = argmax(result.logits);
    if (step_logits != nullptr) step_logits->push_back(result.logits);
  }
  return generated;
}

// Relative error of `a` against reference `b`, in the max norm:
// max_i |a_i - b_i| / max_i |b_i|. Elementwise ratios would blow up on
// near-zero entries that carry no information about the computation.
inline double MaxRelativeError(const std::vector<float>& a,
                               const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0, scale = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    worst = std::max(worst, std::abs(double{a[i]} - b[i]));
    scale = std::max(scale, std::abs(double{b[i]}));
  }
  return scale > 0 ? worst / scale : worst;
}

}  // namespace pdserve::engine::testing_util
