// What one engine shard holds (layer range, TP rank's heads, MLP rows, vocab
// rows), resolved once from the model config and the ShardSpec, plus the
// pieces every backend shares: batch validation, the KV layout of the shard,
// host-side weight slices and RoPE tables. Keeping these in one place is what
// lets the CUDA backend be compared with the CPU reference shard for shard.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/engine_types.h"
#include "kv/kv_layout.h"
#include "model/model_config.h"
#include "model/weight_source.h"

namespace pdserve::engine {

struct ShardPlan {
  model::ModelConfig config;
  ShardSpec shard;  // layer_end resolved (never -1)
  int q_heads = 0, q_head_offset = 0;
  int kv_heads = 0, kv_head_offset = 0;
  int64_t ffn_begin = 0, ffn_end = 0;  // dense MLP rows (and shared expert's)
  // Sparse layers: the experts [expert_begin, expert_end) this rank holds,
  // rows [expert_ffn_begin, expert_ffn_end) of each (ExpertParallelism),
  // and the shared expert's rows.
  ExpertParallelism expert_parallelism = ExpertParallelism::kTensor;
  int expert_begin = 0, expert_end = 0;
  int64_t expert_ffn_begin = 0, expert_ffn_end = 0;
  int64_t shared_ffn_begin = 0, shared_ffn_end = 0;
  int64_t vocab_begin = 0, vocab_end = 0;

  bool holds_first() const { return shard.layer_begin == 0; }
  bool holds_last() const { return shard.layer_end == config.num_layers; }
  int num_layers() const { return shard.layer_end - shard.layer_begin; }
  int64_t qkv_rows() const {
    return int64_t{q_heads + 2 * kv_heads} * config.head_dim;
  }
  int64_t attn_width() const { return int64_t{q_heads} * config.head_dim; }
  int64_t ffn_rows() const { return ffn_end - ffn_begin; }
  int64_t expert_ffn_rows() const { return expert_ffn_end - expert_ffn_begin; }
  int64_t shared_ffn_rows() const { return shared_ffn_end - shared_ffn_begin; }
  int local_experts() const { return expert_end - expert_begin; }
  int64_t vocab_rows() const { return vocab_end - vocab_begin; }
  // The pool-local KV head query head `h` (local) reads.
  int KvHeadOf(int h) const {
    const int group = config.num_heads / config.num_kv_heads;
    return (q_head_offset + h) / group - kv_head_offset;
  }
  kv::KvCacheLayout KvLayout(int block_size, kv::KvDType dtype) const;
};

// INVALID_ARGUMENT for an impossible shard (layer range, tp_size not dividing
// the heads, missing or mismatched communicator).
[[nodiscard]] absl::StatusOr<ShardPlan> ResolveShardPlan(
    const model::ModelConfig& config, const EngineOptions& options);

// Checks a batch against the shard and its pool before anything is written:
// token ids in vocab, positions inside the context, block tables long enough
// and inside the pool, ascending logit indices, hidden_in sized right, and a
// pool whose layout is this shard's with `dtype`.
[[nodiscard]] absl::Status ValidateBatch(const ShardPlan& plan,
                                         const ForwardBatch& batch,
                                         const kv::KvCacheLayout& pool_layout,
                                         int64_t pool_blocks,
                                         kv::KvDType dtype);

// One layer's weights as this shard holds them, f32 on the host.
struct HostLayerWeights {
  std::vector<float> attn_norm;  // [hidden]
  std::vector<float> wqkv;       // [(q_heads + 2 kv_heads) * head_dim, hidden]
  std::vector<float> wo;  // [hidden, q_heads * head_dim] (this rank's cols)
  std::vector<float> ffn_norm;   // [hidden]
  std::vector<float> w_gate_up;  // [2 * ffn_rows, hidden]: gate then up rows
  std::vector<float> w_down;     // [hidden, ffn_rows]
  // Family extras, empty when the config has none:
  std::vector<float> qkv_bias;        // [qkv_rows]: this shard's q, k, v rows
  std::vector<float> q_norm, k_norm;  // [head_dim], every head alike
  std::vector<float> o_bias;          // [hidden], added once after the sum
};

// Only the family extras of HostLayerWeights (biases, q/k norms): what a
// backend that loads its projections in their stored format needs besides.
[[nodiscard]] absl::Status LoadLayerExtras(const model::WeightSource& weights,
                                           const ShardPlan& plan, int layer,
                                           HostLayerWeights* out);
// `layer` is the model layer (inside the shard's range).
[[nodiscard]] absl::Status LoadLayerWeights(const model::WeightSource& weights,
                                            const ShardPlan& plan, int layer,
                                            HostLayerWeights* out);
// [vocab_rows, hidden]: this rank's rows of the token embedding.
[[nodiscard]] absl::Status LoadEmbedding(const model::WeightSource& weights,
                                         const ShardPlan& plan,
                                         std::vector<float>* out);
// Final norm [hidden] and this rank's lm_head rows [vocab_rows, hidden]
// (the embedding when the model ties them).
[[nodiscard]] absl::Status LoadHead(const model::WeightSource& weights,
                                    const ShardPlan& plan,
                                    std::vector<float>* final_norm,
                                    std::vector<float>* lm_head);

// The inverse frequency of each rotation pair j < head_dim / 2 under the
// config's RoPE scaling, as transformers' rope init functions compute it
// (in double): theta^(-2j/d), divided by the linear factor, llama3's
// smoothed per-band factor, yarn's ramp between interpolation and
// extrapolation, or GGUF's stored factors. Dynamic NTK depends on the
// sequence length: `seq_len` (<= the original context: no scaling).
std::vector<double> RopeInverseFrequencies(const model::ModelConfig& config,
                                           int64_t seq_len = 0);

// Rotate-half RoPE tables [max_position, head_dim / 2], computed in double:
// angles pos * inv_freq lose ~1e-5 rad at long positions in float. yarn's
// attention factor multiplies cos and sin (transformers' post-processing
// scale, so q.k grows by its square). Dynamic NTK: position p rotates with
// the frequencies of seq_len = p + 1, what transformers computes when each
// token is its own step; one-shot prefill there uses the prompt's length
// for every prompt token, which would make results depend on how a prompt
// is chunked and batched.
void BuildRopeTables(const model::ModelConfig& config, std::vector<float>* cos,
                     std::vector<float>* sin);

}  // namespace pdserve::engine
