#include "engine/llama_engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/thread_pool.h"
#include "engine/matmul.h"

namespace pdserve::engine {
namespace {

using model::LayerTensorName;
using model::Slice2D;

void RmsNorm(const float* x, const float* weight, int64_t dim, float eps,
             float* y) {
  double sum_squares = 0;
  for (int64_t i = 0; i < dim; ++i) sum_squares += double{x[i]} * x[i];
  const float scale =
      static_cast<float>(1.0 / std::sqrt(sum_squares / dim + eps));
  for (int64_t i = 0; i < dim; ++i) y[i] = x[i] * scale * weight[i];
}

struct LayerWeights {
  std::vector<float> attn_norm;  // [hidden]
  std::vector<float> wqkv;       // [(q_heads + 2 kv_heads) * head_dim, hidden]
  std::vector<float>
      wo;  // [hidden, q_heads * head_dim]  (input columns of this rank)
  std::vector<float> ffn_norm;  // [hidden]
  std::vector<float>
      w_gate_up;              // [2 * ffn_rows, hidden]: gate rows then up rows
  std::vector<float> w_down;  // [hidden, ffn_rows]
};

// Per-token facts of one step, precomputed once.
struct TokenInfo {
  int sequence;
  int position;
};

}  // namespace

struct LlamaEngine::Impl {
  model::ModelConfig config;
  ShardSpec shard;
  comm::Communicator* communicator = nullptr;

  // What this shard holds.
  int q_heads = 0, q_head_offset = 0;
  int kv_heads = 0, kv_head_offset = 0;
  int64_t ffn_begin = 0, ffn_end = 0;
  int64_t vocab_begin = 0, vocab_end = 0;

  std::vector<float>
      embedding;  // [vocab_end - vocab_begin, hidden] when holding layer 0
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;  // [hidden] when holding the last layer
  std::vector<float> lm_head;     // [vocab_end - vocab_begin, hidden]

  std::vector<float> rope_cos, rope_sin;  // [max_position, head_dim / 2]

  std::unique_ptr<ThreadPool> workers;

  // Scratch reused across steps (Forward is not reentrant).
  std::vector<float> x, normed, qkv, attn_out, proj, gate_up, act;
  std::vector<TokenInfo> tokens;
  std::vector<int64_t> token_offsets;  // first query row of each sequence

  bool holds_first() const { return shard.layer_begin == 0; }
  bool holds_last() const { return shard.layer_end == config.num_layers; }
  int64_t qkv_rows() const {
    return int64_t{q_heads + 2 * kv_heads} * config.head_dim;
  }
  int64_t ffn_rows() const { return ffn_end - ffn_begin; }

  absl::Status Load(const model::WeightSource& weights);
  absl::Status ValidateBatch(const ForwardBatch& batch,
                             const kv::KvPool& pool) const;
  absl::Status AllReduce(std::vector<float>& data, int64_t count) {
    if (shard.tp_size == 1) return absl::OkStatus();
    return communicator->AllReduceSum(std::span<float>(data.data(), count));
  }
  void ApplyRope(float* vec, int position) const;
  void WriteKv(const ForwardBatch& batch, int local_layer, kv::KvPool& pool);
  void Attention(const ForwardBatch& batch, int local_layer,
                 const kv::KvPool& pool);
  void TiledAttention(const SequenceStep& seq, int64_t first_token, int h,
                      int kv_head, int local_layer, const kv::KvPool& pool);
};

// ---------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------

absl::Status LlamaEngine::Impl::Load(const model::WeightSource& weights) {
  const auto& c = config;
  const int64_t hidden = c.hidden_size;
  const int64_t hd = c.head_dim;
  auto read = [&](const std::string& name, const Slice2D& slice, int64_t rows,
                  int64_t cols, std::vector<float>& out,
                  int64_t out_offset = 0) -> absl::Status {
    if (out.size() < static_cast<size_t>(out_offset + rows * cols)) {
      out.resize(out_offset + rows * cols);
    }
    return weights.ReadF32(name, slice, out.data() + out_offset);
  };
  auto rows = [](int64_t begin, int64_t end) {
    return Slice2D{begin, end, 0, -1};
  };
  auto cols = [](int64_t begin, int64_t end) {
    return Slice2D{0, -1, begin, end};
  };

  if (holds_first()) {
    PDS_RETURN_IF_ERROR(read("model.embed_tokens.weight",
                             rows(vocab_begin, vocab_end),
                             vocab_end - vocab_begin, hidden, embedding));
  }
  for (int layer = shard.layer_begin; layer < shard.layer_end; ++layer) {
    LayerWeights lw;
    PDS_RETURN_IF_ERROR(read(LayerTensorName(layer, "input_layernorm.weight"),
                             {}, 1, hidden, lw.attn_norm));
    PDS_RETURN_IF_ERROR(
        read(LayerTensorName(layer, "post_attention_layernorm.weight"), {}, 1,
             hidden, lw.ffn_norm));
    const int64_t q_rows = q_heads * hd, kv_rows = kv_heads * hd;
    PDS_RETURN_IF_ERROR(
        read(LayerTensorName(layer, "self_attn.q_proj.weight"),
             rows(q_head_offset * hd, q_head_offset * hd + q_rows), q_rows,
             hidden, lw.wqkv, 0));
    PDS_RETURN_IF_ERROR(
        read(LayerTensorName(layer, "self_attn.k_proj.weight"),
             rows(kv_head_offset * hd, kv_head_offset * hd + kv_rows), kv_rows,
             hidden, lw.wqkv, q_rows * hidden));
    PDS_RETURN_IF_ERROR(
        read(LayerTensorName(layer, "self_attn.v_proj.weight"),
             rows(kv_head_offset * hd, kv_head_offset * hd + kv_rows), kv_rows,
             hidden, lw.wqkv, (q_rows + kv_rows) * hidden));
    PDS_RETURN_IF_ERROR(
        read(LayerTensorName(layer, "self_attn.o_proj.weight"),
             cols(q_head_offset * hd, q_head_offset * hd + q_rows), hidden,
             q_rows, lw.wo));
    const int64_t f = ffn_rows();
    PDS_RETURN_IF_ERROR(read(LayerTensorName(layer, "mlp.gate_proj.weight"),
                             rows(ffn_begin, ffn_end), f, hidden, lw.w_gate_up,
                             0));
    PDS_RETURN_IF_ERROR(read(LayerTensorName(layer, "mlp.up_proj.weight"),
                             rows(ffn_begin, ffn_end), f, hidden, lw.w_gate_up,
                             f * hidden));
    PDS_RETURN_IF_ERROR(read(LayerTensorName(layer, "mlp.down_proj.weight"),
                             cols(ffn_begin, ffn_end), hidden, f, lw.w_down));
    layers.push_back(std::move(lw));
  }
  if (holds_last()) {
    PDS_RETURN_IF_ERROR(read("model.norm.weight", {}, 1, hidden, final_norm));
    const std::string head_name = weights.HasTensor("lm_head.weight")
                                      ? "lm_head.weight"
                                      : "model.embed_tokens.weight";
    PDS_RETURN_IF_ERROR(read(head_name, rows(vocab_begin, vocab_end),
                             vocab_end - vocab_begin, hidden, lm_head));
  }

  // RoPE tables in double precision: angles pos * theta^(-2j/d) lose ~1e-5 rad
  // at long positions when computed in float.
  const int half = c.head_dim / 2;
  rope_cos.resize(int64_t{c.max_position_embeddings} * half);
  rope_sin.resize(rope_cos.size());
  for (int pos = 0; pos < c.max_position_embeddings; ++pos) {
    for (int j = 0; j < half; ++j) {
      double inv_freq = std::pow(double{c.rope_theta}, -2.0 * j / c.head_dim);
      double angle = pos * inv_freq;
      rope_cos[int64_t{pos} * half + j] = static_cast<float>(std::cos(angle));
      rope_sin[int64_t{pos} * half + j] = static_cast<float>(std::sin(angle));
    }
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------

absl::Status LlamaEngine::Impl::ValidateBatch(const ForwardBatch& batch,
                                              const kv::KvPool& pool) const {
  const kv::KvCacheLayout& layout = pool.layout();
  if (layout.dtype != kv::KvDType::kF32 ||
      layout.num_layers != shard.layer_end - shard.layer_begin ||
      layout.layer_offset != shard.layer_begin ||
      layout.num_kv_heads != kv_heads ||
      layout.kv_head_offset != kv_head_offset ||
      layout.head_dim != config.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV pool layout {", layout.DebugString(),
        "} does not match this shard (layers [", shard.layer_begin, ",",
        shard.layer_end, "), kv heads [", kv_head_offset, ",",
        kv_head_offset + kv_heads, "), head_dim ", config.head_dim, ", f32)"));
  }
  if (batch.sequences.empty()) return absl::InvalidArgumentError("empty batch");
  int64_t total_tokens = 0;
  for (size_t s = 0; s < batch.sequences.size(); ++s) {
    const SequenceStep& seq = batch.sequences[s];
    if (seq.num_tokens <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence ", s, ": no query tokens"));
    }
    if (seq.start_position < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence ", s, ": negative start position"));
    }
    const int64_t end_position = int64_t{seq.start_position} + seq.num_tokens;
    if (end_position > config.max_position_embeddings) {
      return absl::OutOfRangeError(
          absl::StrCat("sequence ", s, ": positions up to ", end_position,
                       " exceed the context of ",
                       config.max_position_embeddings, " tokens"));
    }
    if (holds_first()) {
      if (seq.tokens.size() != static_cast<size_t>(seq.num_tokens)) {
        return absl::InvalidArgumentError(
            absl::StrCat("sequence ", s, ": ", seq.tokens.size(),
                         " token ids for ", seq.num_tokens, " query tokens"));
      }
      for (int32_t token : seq.tokens) {
        if (token < 0 || token >= config.vocab_size) {
          return absl::InvalidArgumentError(
              absl::StrCat("sequence ", s, ": token id ", token,
                           " outside vocab of ", config.vocab_size));
        }
      }
    }
    const int64_t blocks_needed =
        (end_position + layout.block_size - 1) / layout.block_size;
    if (static_cast<int64_t>(seq.block_table.size()) < blocks_needed) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sequence ", s, ": block table has ", seq.block_table.size(),
          " blocks, ", blocks_needed, " needed"));
    }
    for (int64_t b = 0; b < blocks_needed; ++b) {
      if (seq.block_table[b] < 0 || seq.block_table[b] >= pool.num_blocks()) {
        return absl::OutOfRangeError(
            absl::StrCat("sequence ", s, ": block id ", seq.block_table[b],
                         " outside pool of ", pool.num_blocks(), " blocks"));
      }
    }
    int previous = -1;
    for (int index : seq.logit_indices) {
      if (index <= previous || index >= seq.num_tokens) {
        return absl::InvalidArgumentError(absl::StrCat(
            "sequence ", s, ": logit indices must be ascending and below ",
            seq.num_tokens));
      }
      previous = index;
    }
    total_tokens += seq.num_tokens;
  }
  if (!holds_first() &&
      batch.hidden_in.size() !=
          static_cast<size_t>(total_tokens * config.hidden_size)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hidden_in has ", batch.hidden_in.size(), " floats, expected ",
        total_tokens, " x ", config.hidden_size));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------

// Rotate-half RoPE: dims j and j + d/2 form one rotation pair.
void LlamaEngine::Impl::ApplyRope(float* vec, int position) const {
  const int half = config.head_dim / 2;
  const float* cos = rope_cos.data() + int64_t{position} * half;
  const float* sin = rope_sin.data() + int64_t{position} * half;
  for (int j = 0; j < half; ++j) {
    const float a = vec[j], b = vec[j + half];
    vec[j] = a * cos[j] - b * sin[j];
    vec[j + half] = b * cos[j] + a * sin[j];
  }
}

void LlamaEngine::Impl::WriteKv(const ForwardBatch& batch, int local_layer,
                                kv::KvPool& pool) {
  const kv::KvCacheLayout& layout = pool.layout();
  const int64_t hd = config.head_dim;
  const int64_t row = qkv_rows();
  float* base = pool.f32();
  const int64_t n = static_cast<int64_t>(tokens.size());
  workers->ParallelRanges(n, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const TokenInfo& info = tokens[t];
      const SequenceStep& seq = batch.sequences[info.sequence];
      const int32_t block = seq.block_table[info.position / layout.block_size];
      const int slot = info.position % layout.block_size;
      float* q = qkv.data() + t * row;
      for (int h = 0; h < q_heads; ++h) ApplyRope(q + h * hd, info.position);
      float* k = q + q_heads * hd;
      float* v = k + kv_heads * hd;
      for (int h = 0; h < kv_heads; ++h) {
        ApplyRope(k + h * hd, info.position);
        std::memcpy(base + layout.Offset(block, local_layer, 0, h, slot),
                    k + h * hd, hd * sizeof(float));
        std::memcpy(base + layout.Offset(block, local_layer, 1, h, slot),
                    v + h * hd, hd * sizeof(float));
      }
    }
  });
}

void LlamaEngine::Impl::Attention(const ForwardBatch& batch, int local_layer,
                                  const kv::KvPool& pool) {
  const kv::KvCacheLayout& layout = pool.layout();
  const int hd = config.head_dim;
  const int group = config.num_heads / config.num_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int64_t row = qkv_rows();
  const float* base = pool.f32();
  const int64_t num_sequences = static_cast<int64_t>(batch.sequences.size());
  // One task per (sequence, query head): independent, and enough of them to
  // keep every thread busy at batch 1 as well as at large batch.
  workers->ParallelFor(num_sequences * q_heads, [&](int64_t task) {
    const int s = static_cast<int>(task / q_heads);
    const int h = static_cast<int>(task % q_heads);
    const SequenceStep& seq = batch.sequences[s];
    const int kv_head = (q_head_offset + h) / group - kv_head_offset;
    if (seq.num_tokens >= kTiledAttentionMinQueries) {
      TiledAttention(seq, token_offsets[s], h, kv_head, local_layer, pool);
      return;
    }
    thread_local std::vector<float> scores;
    scores.resize(seq.start_position + seq.num_tokens);
    for (int i = 0; i < seq.num_tokens; ++i) {
      const int64_t t = token_offsets[s] + i;
      const int position = seq.start_position + i;
      const float* q = qkv.data() + t * row + int64_t{h} * hd;
      float max_score = -INFINITY;
      for (int j = 0; j <= position; ++j) {
        const float* k =
            base + layout.Offset(seq.block_table[j / layout.block_size],
                                 local_layer, 0, kv_head,
                                 j % layout.block_size);
        const float dot = DotProduct(q, k, hd) * scale;
        scores[j] = dot;
        max_score = std::max(max_score, dot);
      }
      float sum = 0;
      for (int j = 0; j <= position; ++j) {
        scores[j] = std::exp(scores[j] - max_score);
        sum += scores[j];
      }
      const float inv_sum = 1.0f / sum;
      float* out =
          attn_out.data() + t * int64_t{q_heads} * hd + int64_t{h} * hd;
      std::fill(out, out + hd, 0.0f);
      for (int j = 0; j <= position; ++j) {
        const float* v =
            base + layout.Offset(seq.block_table[j / layout.block_size],
                                 local_layer, 1, kv_head,
                                 j % layout.block_size);
        const float weight = scores[j] * inv_sum;
        Axpy(weight, v, out, hd);
      }
    }
  });
}

// A prefill chunk's attention for one query head as two GEMMs: the keys and
// values of every position so far are gathered into contiguous [len x hd]
// matrices (a block holds each head's slots contiguously, so that is one
// copy per block), then S = Q K^T, a causal softmax per row, and O = P V.
// Per-key dot products cost a call and a horizontal sum each, which
// dominates at small head dims (8 for stories260K: ~15x slower than this);
// the masked upper triangle costs at most 2x the useful FLOPs.
void LlamaEngine::Impl::TiledAttention(const SequenceStep& seq,
                                       int64_t first_token, int h, int kv_head,
                                       int local_layer,
                                       const kv::KvPool& pool) {
  const kv::KvCacheLayout& layout = pool.layout();
  const int hd = config.head_dim;
  const int n = seq.num_tokens;
  const int len = seq.start_position + n;
  const int bs = layout.block_size;
  const float* base = pool.f32();
  thread_local std::vector<float> keys, values, probs;
  keys.resize(int64_t{len} * hd);
  values.resize(int64_t{len} * hd);
  probs.resize(int64_t{n} * len);
  for (int b = 0, start = 0; start < len; ++b, start += bs) {
    const int slots = std::min(bs, len - start);
    const int64_t block = seq.block_table[b];
    std::memcpy(keys.data() + int64_t{start} * hd,
                base + layout.Offset(block, local_layer, 0, kv_head, 0),
                sizeof(float) * slots * hd);
    std::memcpy(values.data() + int64_t{start} * hd,
                base + layout.Offset(block, local_layer, 1, kv_head, 0),
                sizeof(float) * slots * hd);
  }
  const int64_t row = qkv_rows();
  const float* q = qkv.data() + first_token * row + int64_t{h} * hd;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  GemmRowMajor(/*transpose_b=*/true, n, len, hd, scale, q, row, keys.data(), hd,
               probs.data(), len);
  for (int i = 0; i < n; ++i) {
    float* p = probs.data() + int64_t{i} * len;
    const int visible = seq.start_position + i + 1;  // causal
    float max_score = -INFINITY;
    for (int j = 0; j < visible; ++j) max_score = std::max(max_score, p[j]);
    float sum = 0;
    for (int j = 0; j < visible; ++j) {
      p[j] = std::exp(p[j] - max_score);
      sum += p[j];
    }
    const float inv_sum = 1.0f / sum;
    for (int j = 0; j < visible; ++j) p[j] *= inv_sum;
    std::fill(p + visible, p + len, 0.0f);
  }
  float* out =
      attn_out.data() + first_token * int64_t{q_heads} * hd + int64_t{h} * hd;
  GemmRowMajor(/*transpose_b=*/false, n, hd, len, 1.0f, probs.data(), len,
               values.data(), hd, out, int64_t{q_heads} * hd);
}

// ---------------------------------------------------------------------------
// Engine
// ---------------------------------------------------------------------------

LlamaEngine::LlamaEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
LlamaEngine::~LlamaEngine() = default;

const model::ModelConfig& LlamaEngine::config() const { return impl_->config; }
const ShardSpec& LlamaEngine::shard() const { return impl_->shard; }
bool LlamaEngine::holds_first_layer() const { return impl_->holds_first(); }
bool LlamaEngine::holds_last_layer() const { return impl_->holds_last(); }

kv::KvCacheLayout LlamaEngine::KvLayout(int block_size) const {
  kv::KvCacheLayout layout;
  layout.num_layers = impl_->shard.layer_end - impl_->shard.layer_begin;
  layout.layer_offset = impl_->shard.layer_begin;
  layout.num_kv_heads = impl_->kv_heads;
  layout.kv_head_offset = impl_->kv_head_offset;
  layout.block_size = block_size;
  layout.head_dim = impl_->config.head_dim;
  layout.dtype = kv::KvDType::kF32;
  return layout;
}

int64_t LlamaEngine::weight_bytes() const {
  int64_t floats = impl_->embedding.size() + impl_->final_norm.size() +
                   impl_->lm_head.size();
  for (const auto& lw : impl_->layers) {
    floats += lw.attn_norm.size() + lw.wqkv.size() + lw.wo.size() +
              lw.ffn_norm.size() + lw.w_gate_up.size() + lw.w_down.size();
  }
  return floats * static_cast<int64_t>(sizeof(float));
}

absl::StatusOr<std::unique_ptr<LlamaEngine>> LlamaEngine::Create(
    const model::WeightSource& weights, const EngineOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->config = weights.config();
  PDS_RETURN_IF_ERROR(impl->config.Validate());
  const model::ModelConfig& c = impl->config;
  ShardSpec shard = options.shard;
  if (shard.layer_end < 0) shard.layer_end = c.num_layers;
  if (shard.layer_begin < 0 || shard.layer_begin >= shard.layer_end ||
      shard.layer_end > c.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "invalid layer range [", shard.layer_begin, ", ", shard.layer_end,
        ") for a model of ", c.num_layers, " layers"));
  }
  const int tp = shard.tp_size;
  if (tp <= 0 || shard.tp_rank < 0 || shard.tp_rank >= tp) {
    return absl::InvalidArgumentError(absl::StrCat(
        "invalid tensor-parallel rank ", shard.tp_rank, " of ", tp));
  }
  if (c.num_heads % tp != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor-parallel degree ", tp, " does not divide ",
                     c.num_heads, " attention heads"));
  }
  if (tp <= c.num_kv_heads ? c.num_kv_heads % tp != 0
                           : tp % c.num_kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor-parallel degree ", tp, " and ", c.num_kv_heads,
                     " KV heads: one must divide the other"));
  }
  if (tp > 1) {
    if (options.communicator == nullptr) {
      return absl::InvalidArgumentError(
          "tensor parallelism needs a communicator");
    }
    if (options.communicator->size() != tp ||
        options.communicator->rank() != shard.tp_rank) {
      return absl::InvalidArgumentError(
          absl::StrCat("communicator is rank ", options.communicator->rank(),
                       " of ", options.communicator->size(), ", shard is rank ",
                       shard.tp_rank, " of ", tp));
    }
  }
  impl->shard = shard;
  impl->communicator = options.communicator;
  const int r = shard.tp_rank;
  impl->q_heads = c.num_heads / tp;
  impl->q_head_offset = r * impl->q_heads;
  if (tp <= c.num_kv_heads) {
    impl->kv_heads = c.num_kv_heads / tp;
    impl->kv_head_offset = r * impl->kv_heads;
  } else {
    // More ranks than KV heads: each rank keeps a replica of the one KV head
    // its query heads read.
    impl->kv_heads = 1;
    impl->kv_head_offset = impl->q_head_offset / (c.num_heads / c.num_kv_heads);
  }
  impl->ffn_begin = int64_t{c.intermediate_size} * r / tp;
  impl->ffn_end = int64_t{c.intermediate_size} * (r + 1) / tp;
  impl->vocab_begin = int64_t{c.vocab_size} * r / tp;
  impl->vocab_end = int64_t{c.vocab_size} * (r + 1) / tp;
  PDS_RETURN_IF_ERROR(impl->Load(weights));
  UseSingleThreadedBlas();
  impl->workers = std::make_unique<ThreadPool>(options.num_threads);
  return std::unique_ptr<LlamaEngine>(new LlamaEngine(std::move(impl)));
}

absl::Status LlamaEngine::Forward(const ForwardBatch& batch, kv::KvPool& pool,
                                  ForwardResult* result) {
  Impl& m = *impl_;
  PDS_RETURN_IF_ERROR(m.ValidateBatch(batch, pool));
  const model::ModelConfig& c = m.config;
  const int64_t hidden = c.hidden_size;

  m.tokens.clear();
  m.token_offsets.clear();
  for (size_t s = 0; s < batch.sequences.size(); ++s) {
    const SequenceStep& seq = batch.sequences[s];
    m.token_offsets.push_back(static_cast<int64_t>(m.tokens.size()));
    for (int i = 0; i < seq.num_tokens; ++i) {
      m.tokens.push_back({static_cast<int>(s), seq.start_position + i});
    }
  }
  const int64_t n = static_cast<int64_t>(m.tokens.size());

  // Hidden states in.
  m.x.assign(n * hidden, 0.0f);
  if (m.holds_first()) {
    int64_t t = 0;
    for (const SequenceStep& seq : batch.sequences) {
      for (int32_t token : seq.tokens) {
        if (token >= m.vocab_begin && token < m.vocab_end) {
          std::memcpy(m.x.data() + t * hidden,
                      m.embedding.data() + (token - m.vocab_begin) * hidden,
                      hidden * sizeof(float));
        }
        ++t;
      }
    }
    // Vocab-sharded embedding: each rank contributed the rows it holds.
    PDS_RETURN_IF_ERROR(m.AllReduce(m.x, n * hidden));
  } else {
    std::copy(batch.hidden_in.begin(), batch.hidden_in.end(), m.x.begin());
  }

  const int64_t qkv_rows = m.qkv_rows();
  const int64_t attn_width = int64_t{m.q_heads} * c.head_dim;
  const int64_t f = m.ffn_rows();
  m.normed.resize(n * hidden);
  m.qkv.resize(n * qkv_rows);
  m.attn_out.resize(n * attn_width);
  m.proj.resize(n * hidden);
  m.gate_up.resize(n * 2 * f);
  m.act.resize(n * f);

  for (size_t local = 0; local < m.layers.size(); ++local) {
    const LayerWeights& lw = m.layers[local];
    // Attention block.
    for (int64_t t = 0; t < n; ++t) {
      RmsNorm(m.x.data() + t * hidden, lw.attn_norm.data(), hidden,
              c.rms_norm_eps, m.normed.data() + t * hidden);
    }
    MatMulTransposedWeights(m.normed.data(), n, hidden, lw.wqkv.data(),
                            qkv_rows, m.qkv.data(), *m.workers);
    m.WriteKv(batch, static_cast<int>(local), pool);
    m.Attention(batch, static_cast<int>(local), pool);
    MatMulTransposedWeights(m.attn_out.data(), n, attn_width, lw.wo.data(),
                            hidden, m.proj.data(), *m.workers);
    PDS_RETURN_IF_ERROR(m.AllReduce(m.proj, n * hidden));
    for (int64_t i = 0; i < n * hidden; ++i) m.x[i] += m.proj[i];

    // MLP block (SwiGLU).
    for (int64_t t = 0; t < n; ++t) {
      RmsNorm(m.x.data() + t * hidden, lw.ffn_norm.data(), hidden,
              c.rms_norm_eps, m.normed.data() + t * hidden);
    }
    MatMulTransposedWeights(m.normed.data(), n, hidden, lw.w_gate_up.data(),
                            2 * f, m.gate_up.data(), *m.workers);
    for (int64_t t = 0; t < n; ++t) {
      const float* gate = m.gate_up.data() + t * 2 * f;
      const float* up = gate + f;
      float* out = m.act.data() + t * f;
      for (int64_t i = 0; i < f; ++i)
        out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    }
    MatMulTransposedWeights(m.act.data(), n, f, lw.w_down.data(), hidden,
                            m.proj.data(), *m.workers);
    PDS_RETURN_IF_ERROR(m.AllReduce(m.proj, n * hidden));
    for (int64_t i = 0; i < n * hidden; ++i) m.x[i] += m.proj[i];
  }

  result->hidden_out.clear();
  result->logits.clear();
  result->num_logit_rows = 0;
  if (!m.holds_last()) {
    result->hidden_out.assign(m.x.begin(), m.x.end());
    return absl::OkStatus();
  }

  // Logits only for the requested rows.
  std::vector<int64_t> rows;
  for (size_t s = 0; s < batch.sequences.size(); ++s) {
    for (int index : batch.sequences[s].logit_indices)
      rows.push_back(m.token_offsets[s] + index);
  }
  const int64_t num_rows = static_cast<int64_t>(rows.size());
  result->num_logit_rows = static_cast<int>(num_rows);
  if (num_rows == 0) return absl::OkStatus();
  const int64_t vocab_shard = m.vocab_end - m.vocab_begin;
  std::vector<float> normed_rows(num_rows * hidden);
  for (int64_t i = 0; i < num_rows; ++i) {
    RmsNorm(m.x.data() + rows[i] * hidden, m.final_norm.data(), hidden,
            c.rms_norm_eps, normed_rows.data() + i * hidden);
  }
  std::vector<float> shard_logits(num_rows * vocab_shard);
  MatMulTransposedWeights(normed_rows.data(), num_rows, hidden,
                          m.lm_head.data(), vocab_shard, shard_logits.data(),
                          *m.workers);
  if (m.shard.tp_size == 1) {
    result->logits = std::move(shard_logits);
    return absl::OkStatus();
  }
  // Vocab-parallel lm_head: place this rank's columns, sum = gather.
  result->logits.assign(num_rows * c.vocab_size, 0.0f);
  for (int64_t i = 0; i < num_rows; ++i) {
    std::memcpy(result->logits.data() + i * c.vocab_size + m.vocab_begin,
                shard_logits.data() + i * vocab_shard,
                vocab_shard * sizeof(float));
  }
  return m.AllReduce(result->logits, num_rows * c.vocab_size);
}

}  // namespace pdserve::engine
