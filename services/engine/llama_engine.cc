#include "engine/llama_engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "common/thread_pool.h"
#include "engine/engine_backend.h"
#include "engine/expert_routing.h"
#include "engine/matmul.h"
#include "engine/sampler.h"
#include "engine/shard_plan.h"
#include "model/tensor_layout.h"

namespace pdserve::engine {
namespace {

void RmsNorm(const float* x, const float* weight, int64_t dim, float eps,
             float* y) {
  double sum_squares = 0;
  for (int64_t i = 0; i < dim; ++i) sum_squares += double{x[i]} * x[i];
  const float scale =
      static_cast<float>(1.0 / std::sqrt(sum_squares / dim + eps));
  for (int64_t i = 0; i < dim; ++i) y[i] = x[i] * scale * weight[i];
}

// One layer's weights as the CPU kernels read them: norms as loaded,
// projections in their stored format (WeightMatrix: f32/f16 panels,
// quantized blocks in place).
struct CpuExpertWeights {
  WeightMatrix gate_up, down;  // this rank's rows of one routed expert
};

struct CpuLayerWeights {
  std::vector<float> attn_norm, ffn_norm;    // [hidden]
  WeightMatrix wqkv, wo, w_gate_up, w_down;  // w_gate_up/w_down: dense MLP
  // Family extras (empty when the config has none): see HostLayerWeights.
  std::vector<float> qkv_bias, q_norm, k_norm, o_bias;
  // A sparse layer (ModelConfig::IsMoeLayer): the router (every rank holds
  // it whole: all ranks route alike), the experts [expert_begin,
  // expert_end) of the plan, and Qwen2-MoE's shared expert with its gate.
  bool sparse = false;
  WeightMatrix router;  // [num_experts, hidden]
  std::vector<CpuExpertWeights> experts;
  WeightMatrix shared_gate_up, shared_down;
  WeightMatrix shared_gate;  // [1, hidden]
  int64_t bytes() const {
    int64_t total = wqkv.bytes() + wo.bytes() + w_gate_up.bytes() +
                    w_down.bytes() + router.bytes() + shared_gate_up.bytes() +
                    shared_down.bytes() + shared_gate.bytes();
    for (const CpuExpertWeights& e : experts) {
      total += e.gate_up.bytes() + e.down.bytes();
    }
    return total;
  }
};

// Appends rows [row_begin, row_end) x columns [col_begin, col_end) of tensor
// `name` to `w`: in the stored format, in place for quantized tensors, when
// the source has stored bytes; else (dummy weights) read as f32 and packed.
// A column range of a quantized tensor must fall on block boundaries (a TP
// rank's share of o_proj/down_proj): INVALID_ARGUMENT names the tensor, its
// format and the split otherwise.
absl::Status AppendWeights(const model::WeightSource& weights,
                           const std::string& name, int64_t row_begin,
                           int64_t row_end, int64_t col_begin, int64_t col_end,
                           const ShardSpec& shard, WeightMatrix* w) {
  const int64_t rows = row_end - row_begin, cols = col_end - col_begin;
  absl::StatusOr<model::StoredTensor> stored = weights.GetStoredTensor(name);
  if (!stored.ok() &&
      stored.status().code() != absl::StatusCode::kUnimplemented) {
    return stored.status();
  }
  if (!stored.ok()) {
    std::vector<float> values(rows * cols);
    PDS_RETURN_IF_ERROR(weights.ReadF32(
        name, {row_begin, row_end, col_begin, col_end}, values.data()));
    return w->AppendF32(values.data(), rows, cols);
  }
  if (row_begin < 0 || row_end > stored->rows || col_begin < 0 ||
      col_end > stored->cols || rows < 0 || cols < 0) {
    return absl::InternalError(absl::StrCat("slice outside tensor ", name));
  }
  const int64_t block = model::BlockElements(stored->format);
  if (col_begin % block != 0 ||
      (col_end % block != 0 && col_end != stored->cols)) {
    return absl::InvalidArgumentError(absl::StrCat(
        weights.description(), ": tensor ", name, " is ",
        std::string(model::TensorFormatName(stored->format)), " (blocks of ",
        block, " values along rows of ", stored->cols,
        "): tensor-parallel rank ", shard.tp_rank, " of ", shard.tp_size,
        " would hold columns [", col_begin, ", ", col_end,
        "), which cut a block; use a TP degree that splits these columns on "
        "multiples of ",
        block));
  }
  return w->AppendStored(stored->format,
                         stored->data + row_begin * stored->row_bytes +
                             model::RowBytes(stored->format, col_begin),
                         stored->row_bytes, rows, cols,
                         stored->interleaved_rope_head_dim, stored->owner);
}

// The token embedding rows a shard holds: the stored rows in place (any
// format; a row is dequantized when a token looks it up), or f32 rows read
// from a source without stored bytes.
struct EmbeddingTable {
  std::vector<float> f32;      // [rows, hidden] when !in_place
  model::StoredTensor stored;  // when in_place
  bool in_place = false;
  int64_t first_row = 0;  // vocab_begin
  int64_t hidden = 0;

  void Row(int64_t local_row, float* out) const {
    if (!in_place) {
      std::memcpy(out, f32.data() + local_row * hidden, hidden * sizeof(float));
      return;
    }
    model::DequantizeRow(
        stored.format, stored.data + (first_row + local_row) * stored.row_bytes,
        hidden, out);
  }
  int64_t bytes(int64_t rows) const {
    return in_place ? rows * stored.row_bytes
                    : static_cast<int64_t>(f32.size() * sizeof(float));
  }
};

// A 1-D tensor (a norm's weights) as f32.
absl::Status LoadNorm(const model::WeightSource& weights,
                      const std::string& name, int64_t size,
                      std::vector<float>* out) {
  out->resize(size);
  return weights.ReadF32(name, {}, out->data());
}

// Per-token facts of one step, precomputed once.
struct TokenInfo {
  int sequence;
  int position;
};

}  // namespace

// The fp32 reference backend. Its KV pool holds f32 (the reference) or
// bf16 (half the bytes to hold, read and send; attention math stays f32:
// blocks are widened as they are read).
class CpuBackend final : public EngineBackend {
 public:
  const ShardPlan& plan() const override { return p; }
  kv::KvDType kv_dtype() const override { return kv_type; }
  bool kv_on_device() const override { return false; }
  int64_t weight_bytes() const override;
  std::vector<std::vector<int64_t>> ExpertLoad() const override {
    return expert_tokens;
  }
  absl::Status Forward(const ForwardBatch& batch, kv::KvPool& pool,
                       ForwardResult* result) override;
  absl::StatusOr<std::unique_ptr<kv::KvPool>> CreateKvPool(
      const kv::KvCacheLayout& layout, int64_t num_blocks) override {
    return kv::KvPool::Create(layout, num_blocks);
  }
  absl::Status CopyBlocksFromHost(const kv::KvPool& host,
                                  std::span<const int32_t> blocks,
                                  kv::KvPool& pool) override {
    const int64_t bytes = pool.layout().block_bytes();
    for (int32_t b : blocks) {
      std::memcpy(static_cast<char*>(pool.data()) + b * bytes,
                  static_cast<const char*>(host.data()) + b * bytes, bytes);
    }
    return absl::OkStatus();
  }
  absl::Status CopyToHost(const kv::KvPool& pool,
                          std::span<const kv::StridedCopy> copies,
                          kv::KvPool& host) override {
    for (const kv::StridedCopy& c : copies) {
      for (int64_t row = 0; row < c.rows; ++row) {
        const int64_t at = c.offset + row * c.pitch;
        std::memcpy(static_cast<char*>(host.data()) + at,
                    static_cast<const char*>(pool.data()) + at, c.width);
      }
    }
    return absl::OkStatus();
  }

  ShardPlan p;
  const model::ModelConfig& config = p.config;
  const ShardSpec& shard = p.shard;
  comm::Communicator* communicator = nullptr;
  kv::KvDType kv_type = kv::KvDType::kF32;

  // What this shard holds (copied from the plan for the kernels below).
  int q_heads = 0, q_head_offset = 0;
  int kv_heads = 0, kv_head_offset = 0;
  int64_t vocab_begin = 0, vocab_end = 0;

  EmbeddingTable embedding;  // this rank's vocab rows, when holding layer 0
  std::vector<CpuLayerWeights> layers;
  std::vector<float> final_norm;  // [hidden] when holding the last layer
  WeightMatrix lm_head;           // [vocab_end - vocab_begin, hidden]

  std::vector<float> rope_cos, rope_sin;  // [max_position, head_dim / 2]

  std::unique_ptr<ThreadPool> workers;

  // Scratch reused across steps (Forward is not reentrant).
  std::vector<float> x, normed, qkv, attn_out, proj, gate_up, act;
  // Sparse layers' scratch: router logits, each token's experts and
  // weights, the rows routed to the expert being run, and per-expert
  // counts (cumulative per layer: ExpertLoad()).
  std::vector<float> router_logits, route_weights, expert_in, expert_gate_up,
      expert_act, expert_out, shared_out, shared_scale;
  std::vector<int32_t> route_experts, expert_rows;
  std::vector<int64_t> expert_offsets, expert_next;
  std::vector<std::vector<int64_t>> expert_tokens;  // [local layer][expert]
  std::vector<TokenInfo> tokens;
  std::vector<int64_t> token_offsets;  // first query row of each sequence

  bool holds_first() const { return p.holds_first(); }
  bool holds_last() const { return p.holds_last(); }
  int64_t qkv_rows() const { return p.qkv_rows(); }
  int64_t ffn_rows() const { return p.ffn_rows(); }

  absl::Status Load(const model::WeightSource& weights);
  // One layer's MLP weights: dense, or the router and this rank's experts.
  absl::Status LoadMlp(const model::WeightSource& weights, int layer,
                       CpuLayerWeights* cw);
  // The SwiGLU of `rows` rows of `in` through gate_up/down into `out`.
  void SwiGlu(const float* in, int64_t rows, const WeightMatrix& w_gate_up,
              const WeightMatrix& w_down, float* out);
  // A sparse layer's MLP over m.normed into m.proj (this rank's share of the
  // sum: its experts' rows or its whole experts).
  void SparseMlp(const CpuLayerWeights& lw, int local_layer, int64_t n);
  void SetQuantizedMatmul(QuantizedMatmul mode) {
    const bool int8 = mode == QuantizedMatmul::kInt8Activations;
    for (CpuLayerWeights& lw : layers) {
      for (WeightMatrix* w : {&lw.wqkv, &lw.wo, &lw.w_gate_up, &lw.w_down,
                              &lw.shared_gate_up, &lw.shared_down}) {
        w->set_int8_activations(int8);
      }
      for (CpuExpertWeights& e : lw.experts) {
        e.gate_up.set_int8_activations(int8);
        e.down.set_int8_activations(int8);
      }
    }
    lm_head.set_int8_activations(int8);
  }
  absl::Status AllReduce(std::vector<float>& data, int64_t count) {
    if (shard.tp_size == 1) return absl::OkStatus();
    return communicator->AllReduceSum(std::span<float>(data.data(), count));
  }
  void ApplyRope(float* vec, int position) const;
  // Adds the q/k/v biases, normalizes q and k per head, rotates them and
  // writes this step's K/V into the pool.
  void WriteKv(const ForwardBatch& batch, int local_layer,
               const CpuLayerWeights& lw, kv::KvPool& pool);
  // The first key position a query at `position` attends to in this
  // shard's layer `local_layer` (its window, if that layer has one).
  int FirstVisibleKey(int position, int local_layer) const {
    const int window = config.LayerWindow(shard.layer_begin + local_layer);
    return window > 0 ? std::max(0, position + 1 - window) : 0;
  }
  void Attention(const ForwardBatch& batch, int local_layer,
                 const kv::KvPool& pool);
  void TiledAttention(const SequenceStep& seq, int64_t first_token, int h,
                      int kv_head, int local_layer, const kv::KvPool& pool);
  // Asks the memory system for one (block, layer, K|V, head) slab ahead of
  // its use: a sequence's blocks are scattered over the pool, so each slab
  // (2-4 KiB) starts a new stream the hardware prefetcher has not seen, and
  // without this a decode step at long context waits on each slab's first
  // lines.
  void PrefetchHeadBlock(const kv::KvPool& pool, int32_t block, int local_layer,
                         int kv, int kv_head) const {
    const kv::KvCacheLayout& layout = pool.layout();
    const int64_t element = kv::KvDTypeSize(layout.dtype);
    const char* slab =
        static_cast<const char*>(pool.data()) +
        layout.Offset(block, local_layer, kv, kv_head, 0) * element;
    const int64_t bytes = layout.head_stride() * element;
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(slab + at);
  }
  // `count` K or V rows of one head starting at element `offset` of the
  // pool, as f32: the pool itself when it holds f32, else widened into
  // `scratch` (which must hold count x head_dim floats).
  const float* KvRows(const kv::KvPool& pool, int64_t offset, int count,
                      float* scratch) const {
    if (kv_type == kv::KvDType::kF32) return pool.f32() + offset;
    Bf16RowToFloat(static_cast<const uint16_t*>(pool.data()) + offset, scratch,
                   int64_t{count} * config.head_dim);
    return scratch;
  }
};

// ---------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------

absl::Status CpuBackend::Load(const model::WeightSource& weights) {
  const int64_t hidden = config.hidden_size;
  if (holds_first()) {
    embedding.hidden = hidden;
    embedding.first_row = p.vocab_begin;
    absl::StatusOr<model::StoredTensor> stored =
        weights.GetStoredTensor("model.embed_tokens.weight");
    if (stored.ok()) {
      embedding.stored = *std::move(stored);
      embedding.in_place = true;
    } else if (stored.status().code() == absl::StatusCode::kUnimplemented) {
      PDS_RETURN_IF_ERROR(LoadEmbedding(weights, p, &embedding.f32));
    } else {
      return stored.status();
    }
  }
  const int64_t attn_width = p.attn_width();
  const int64_t hd = config.head_dim;
  const int64_t q_rows = int64_t{p.q_heads} * hd,
                kv_rows = int64_t{p.kv_heads} * hd;
  const int64_t q0 = int64_t{p.q_head_offset} * hd;
  const int64_t kv0 = int64_t{p.kv_head_offset} * hd;
  // Progress for people waiting on a large model (minutes for 8B on a few
  // cores): a log line every 2 s with the rate and the time left.
  const int num_layers = shard.layer_end - shard.layer_begin;
  double layer_bytes = 0;  // of the first layer loaded
  const absl::Time load_start = absl::Now();
  absl::Time last_report = load_start;
  for (int layer = shard.layer_begin; layer < shard.layer_end; ++layer) {
    if (const absl::Time now = absl::Now();
        now - last_report >= absl::Seconds(2)) {
      last_report = now;
      const int done = layer - shard.layer_begin;
      const double seconds = absl::ToDoubleSeconds(now - load_start);
      const double rate = done * layer_bytes / seconds;
      PDS_LOG(INFO) << absl::StrFormat(
          "loading weights: layer %d of %d, %.2f of %.2f GB, %.0f MB/s, "
          "about %.0f s left",
          done, num_layers, done * layer_bytes / 1e9,
          num_layers * layer_bytes / 1e9, rate / 1e6,
          rate > 0 ? (num_layers - done) * layer_bytes / rate : 0.0);
    }
    CpuLayerWeights& cw = layers.emplace_back();
    PDS_RETURN_IF_ERROR(LoadNorm(
        weights, model::LayerTensorName(layer, "input_layernorm.weight"),
        hidden, &cw.attn_norm));
    PDS_RETURN_IF_ERROR(LoadNorm(
        weights,
        model::LayerTensorName(layer, "post_attention_layernorm.weight"),
        hidden, &cw.ffn_norm));
    auto append = [&](const char* suffix, int64_t r0, int64_t r1, int64_t c0,
                      int64_t c1, WeightMatrix* w) {
      return AppendWeights(weights, model::LayerTensorName(layer, suffix), r0,
                           r1, c0, c1, shard, w);
    };
    PDS_RETURN_IF_ERROR(append("self_attn.q_proj.weight", q0, q0 + q_rows, 0,
                               hidden, &cw.wqkv));
    PDS_RETURN_IF_ERROR(append("self_attn.k_proj.weight", kv0, kv0 + kv_rows, 0,
                               hidden, &cw.wqkv));
    PDS_RETURN_IF_ERROR(append("self_attn.v_proj.weight", kv0, kv0 + kv_rows, 0,
                               hidden, &cw.wqkv));
    PDS_RETURN_IF_ERROR(append("self_attn.o_proj.weight", 0, hidden, q0,
                               q0 + attn_width, &cw.wo));
    PDS_RETURN_IF_ERROR(LoadMlp(weights, layer, &cw));
    if (layer_bytes == 0) layer_bytes = static_cast<double>(cw.bytes());
    {
      // The family extras (biases, q/k norms), sliced with this shard's heads.
      HostLayerWeights extras;
      PDS_RETURN_IF_ERROR(LoadLayerExtras(weights, p, layer, &extras));
      cw.qkv_bias = std::move(extras.qkv_bias);
      cw.q_norm = std::move(extras.q_norm);
      cw.k_norm = std::move(extras.k_norm);
      cw.o_bias = std::move(extras.o_bias);
    }
  }
  if (holds_last()) {
    if (absl::Now() - load_start >= absl::Seconds(2)) {
      PDS_LOG(INFO) << "loading weights: the output head";
    }
    PDS_RETURN_IF_ERROR(
        LoadNorm(weights, "model.norm.weight", hidden, &final_norm));
    const std::string head_name = weights.HasTensor("lm_head.weight")
                                      ? "lm_head.weight"
                                      : "model.embed_tokens.weight";
    PDS_RETURN_IF_ERROR(AppendWeights(weights, head_name, p.vocab_begin,
                                      p.vocab_end, 0, hidden, shard, &lm_head));
  }
  expert_tokens.assign(layers.size(),
                       std::vector<int64_t>(config.num_experts, 0));
  BuildRopeTables(config, &rope_cos, &rope_sin);
  if (absl::Now() - load_start >= absl::Seconds(2)) {
    PDS_LOG(INFO) << absl::StrFormat(
        "loaded %d layers (%.2f GB) in %.1f s", num_layers,
        num_layers * layer_bytes / 1e9,
        absl::ToDoubleSeconds(absl::Now() - load_start));
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::LoadMlp(const model::WeightSource& weights, int layer,
                                 CpuLayerWeights* cw) {
  const int64_t hidden = config.hidden_size;
  auto append = [&](const std::string& name, int64_t r0, int64_t r1, int64_t c0,
                    int64_t c1, WeightMatrix* w) {
    return AppendWeights(weights, name, r0, r1, c0, c1, shard, w);
  };
  auto swiglu = [&](std::string_view prefix, int64_t begin, int64_t end,
                    WeightMatrix* gate_up, WeightMatrix* down) -> absl::Status {
    auto name = [&](std::string_view proj) {
      return model::LayerTensorName(
          layer, std::string(prefix) + std::string(proj) + ".weight");
    };
    PDS_RETURN_IF_ERROR(
        append(name("gate_proj"), begin, end, 0, hidden, gate_up));
    PDS_RETURN_IF_ERROR(
        append(name("up_proj"), begin, end, 0, hidden, gate_up));
    return append(name("down_proj"), 0, hidden, begin, end, down);
  };
  if (!config.IsMoeLayer(layer)) {
    return swiglu("mlp.", p.ffn_begin, p.ffn_end, &cw->w_gate_up, &cw->w_down);
  }
  cw->sparse = true;
  PDS_RETURN_IF_ERROR(append(model::RouterTensorName(config, layer), 0,
                             config.num_experts, 0, hidden, &cw->router));
  using model::ExpertProjection;
  for (int e = p.expert_begin; e < p.expert_end; ++e) {
    CpuExpertWeights& expert = cw->experts.emplace_back();
    auto name = [&](ExpertProjection projection) {
      return model::ExpertTensorName(config, layer, e, projection);
    };
    const int64_t begin = p.expert_ffn_begin, end = p.expert_ffn_end;
    PDS_RETURN_IF_ERROR(append(name(ExpertProjection::kGate), begin, end, 0,
                               hidden, &expert.gate_up));
    PDS_RETURN_IF_ERROR(append(name(ExpertProjection::kUp), begin, end, 0,
                               hidden, &expert.gate_up));
    PDS_RETURN_IF_ERROR(append(name(ExpertProjection::kDown), 0, hidden, begin,
                               end, &expert.down));
  }
  if (config.shared_expert_intermediate_size > 0) {
    PDS_RETURN_IF_ERROR(swiglu("mlp.shared_expert.", p.shared_ffn_begin,
                               p.shared_ffn_end, &cw->shared_gate_up,
                               &cw->shared_down));
    PDS_RETURN_IF_ERROR(
        append(model::LayerTensorName(layer, "mlp.shared_expert_gate.weight"),
               0, 1, 0, hidden, &cw->shared_gate));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------

// Rotate-half RoPE: dims j and j + d/2 form one rotation pair.
void CpuBackend::ApplyRope(float* vec, int position) const {
  const int half = config.head_dim / 2;
  const float* cos = rope_cos.data() + int64_t{position} * half;
  const float* sin = rope_sin.data() + int64_t{position} * half;
  for (int j = 0; j < half; ++j) {
    const float a = vec[j], b = vec[j + half];
    vec[j] = a * cos[j] - b * sin[j];
    vec[j + half] = b * cos[j] + a * sin[j];
  }
}

void CpuBackend::WriteKv(const ForwardBatch& batch, int local_layer,
                         const CpuLayerWeights& lw, kv::KvPool& pool) {
  const kv::KvCacheLayout& layout = pool.layout();
  const int64_t hd = config.head_dim;
  const int64_t row = qkv_rows();
  const bool bf16 = kv_type == kv::KvDType::kBF16;
  float* base = bf16 ? nullptr : pool.f32();
  uint16_t* base16 = bf16 ? static_cast<uint16_t*>(pool.data()) : nullptr;
  const int64_t n = static_cast<int64_t>(tokens.size());
  workers->ParallelRanges(n, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const TokenInfo& info = tokens[t];
      const SequenceStep& seq = batch.sequences[info.sequence];
      const int32_t block = seq.block_table[info.position / layout.block_size];
      const int slot = info.position % layout.block_size;
      float* q = qkv.data() + t * row;
      if (!lw.qkv_bias.empty()) {
        for (int64_t i = 0; i < row; ++i) q[i] += lw.qkv_bias[i];
      }
      for (int h = 0; h < q_heads; ++h) {
        if (!lw.q_norm.empty()) {
          RmsNorm(q + h * hd, lw.q_norm.data(), hd, config.rms_norm_eps,
                  q + h * hd);
        }
        ApplyRope(q + h * hd, info.position);
      }
      float* k = q + q_heads * hd;
      float* v = k + kv_heads * hd;
      for (int h = 0; h < kv_heads; ++h) {
        if (!lw.k_norm.empty()) {
          RmsNorm(k + h * hd, lw.k_norm.data(), hd, config.rms_norm_eps,
                  k + h * hd);
        }
        ApplyRope(k + h * hd, info.position);
        const int64_t k_at = layout.Offset(block, local_layer, 0, h, slot);
        const int64_t v_at = layout.Offset(block, local_layer, 1, h, slot);
        if (bf16) {
          FloatRowToBf16(k + h * hd, base16 + k_at, hd);
          FloatRowToBf16(v + h * hd, base16 + v_at, hd);
        } else {
          std::memcpy(base + k_at, k + h * hd, hd * sizeof(float));
          std::memcpy(base + v_at, v + h * hd, hd * sizeof(float));
        }
      }
    }
  });
}

void CpuBackend::Attention(const ForwardBatch& batch, int local_layer,
                           const kv::KvPool& pool) {
  const kv::KvCacheLayout& layout = pool.layout();
  const int hd = config.head_dim;
  const int group = config.num_heads / config.num_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int64_t row = qkv_rows();
  const int64_t num_sequences = static_cast<int64_t>(batch.sequences.size());
  // This shard's query heads grouped by the KV head they read.
  std::vector<std::vector<int>> heads_of_kv(kv_heads);
  for (int h = 0; h < q_heads; ++h) {
    heads_of_kv[(q_head_offset + h) / group - kv_head_offset].push_back(h);
  }
  // One task per (sequence, KV head): every query head of the group and
  // every query token of the step share one pass over that head's keys and
  // values (read once instead of once per query head: at long contexts the
  // KV bytes of a batch outweigh the weights). Prefill chunks take the GEMM
  // path per query head inside the task.
  workers->ParallelFor(num_sequences * kv_heads, [&](int64_t task) {
    const int s = static_cast<int>(task / kv_heads);
    const int kv_head = static_cast<int>(task % kv_heads);
    const SequenceStep& seq = batch.sequences[s];
    const std::vector<int>& heads = heads_of_kv[kv_head];
    if (seq.num_tokens >= kTiledAttentionMinQueries) {
      for (int h : heads) {
        TiledAttention(seq, token_offsets[s], h, kv_head, local_layer, pool);
      }
      return;
    }
    const int n = seq.num_tokens;
    const int len = seq.start_position + n;
    const int bs = layout.block_size;
    // Row (head index in group, query token) of `scores`: len keys each.
    const int queries = static_cast<int>(heads.size()) * n;
    thread_local std::vector<float> scores;
    scores.resize(int64_t{queries} * len);
    auto query = [&](int qi) {
      const int64_t t = token_offsets[s] + qi % n;
      return qkv.data() + t * row + int64_t{heads[qi / n]} * hd;
    };
    auto output = [&](int qi) {
      const int64_t t = token_offsets[s] + qi % n;
      return attn_out.data() + t * int64_t{q_heads} * hd +
             int64_t{heads[qi / n]} * hd;
    };
    // Both passes read the pool's elements as stored (f32, or bf16 widened in
    // registers by the kernels).
    auto passes = [&](const auto* elements) {
      // Calls visit(rows, qi, first, count) for every block of the head's K
      // (kv 0) or V (kv 1) and every query that sees `count` > 0 of its rows
      // (key j is visible to query token i iff j <= start + i), prefetching
      // the next block's slab while this one is used.
      // With a sliding window a query also sees no key before
      // FirstVisibleKey, and blocks before the first query's window are
      // never read.
      const int first_block =
          FirstVisibleKey(seq.start_position, local_layer) / bs;
      auto for_each_block = [&](int kv, auto&& visit) {
        for (int b = first_block, first = b * bs; first < len;
             ++b, first += bs) {
          if (first + bs < len) {
            PrefetchHeadBlock(pool, seq.block_table[b + 1], local_layer, kv,
                              kv_head);
          }
          const auto* rows =
              elements +
              layout.Offset(seq.block_table[b], local_layer, kv, kv_head, 0);
          const int slots = std::min(bs, len - first);
          for (int qi = 0; qi < queries; ++qi) {
            const int position = seq.start_position + qi % n;
            const int count = std::min(slots, position + 1 - first);
            const int skip =
                std::max(0, FirstVisibleKey(position, local_layer) - first);
            if (count > skip) {
              visit(rows + int64_t{skip} * hd, qi, first + skip, count - skip);
            }
          }
        }
      };
      for_each_block(0, [&](const auto* keys, int qi, int first, int count) {
        ScoreKeys(query(qi), keys, count, hd, scale,
                  scores.data() + int64_t{qi} * len + first);
      });
      for (int qi = 0; qi < queries; ++qi) {
        const int position = seq.start_position + qi % n;
        const int lo = FirstVisibleKey(position, local_layer);
        SoftmaxInPlace(scores.data() + int64_t{qi} * len + lo,
                       position + 1 - lo);
        std::fill(output(qi), output(qi) + hd, 0.0f);
      }
      for_each_block(1, [&](const auto* values, int qi, int first, int count) {
        AccumulateWeightedRows(scores.data() + int64_t{qi} * len + first,
                               values, count, hd, output(qi));
      });
    };
    if (kv_type == kv::KvDType::kBF16) {
      passes(static_cast<const uint16_t*>(pool.data()));
    } else {
      passes(pool.f32());
    }
  });
}

// A prefill chunk's attention for one query head as two GEMMs: the keys and
// values of every position so far are gathered into contiguous [len x hd]
// matrices (a block holds each head's slots contiguously, so that is one
// copy per block), then S = Q K^T, a causal softmax per row, and O = P V.
// Per-key dot products cost a call and a horizontal sum each, which
// dominates at small head dims (8 for stories260K: ~15x slower than this);
// queries go in blocks of 64 so the masked upper triangle costs at most one
// block's worth of extra keys per block.
void CpuBackend::TiledAttention(const SequenceStep& seq, int64_t first_token,
                                int h, int kv_head, int local_layer,
                                const kv::KvPool& pool) {
  const kv::KvCacheLayout& layout = pool.layout();
  const int hd = config.head_dim;
  const int n = seq.num_tokens;
  const int len = seq.start_position + n;
  const int bs = layout.block_size;
  // Keys from the block holding the first query's first visible key (0
  // without a sliding window): keys[i] is position gathered_from + i.
  const int gathered_from =
      FirstVisibleKey(seq.start_position, local_layer) / bs * bs;
  thread_local std::vector<float> keys, values, probs;
  keys.resize(int64_t{len - gathered_from} * hd);
  values.resize(int64_t{len - gathered_from} * hd);
  // Causal: query i sees start_position + i + 1 keys. Blocks of queries
  // multiply only the keys their last query sees, so a long chunk does not
  // spend half its attention FLOPs on masked scores and zero probabilities
  // (and, with a window, only from the keys their first query sees).
  constexpr int kQueryBlock = 64;
  probs.resize(int64_t{std::min(n, kQueryBlock)} * (len - gathered_from));
  for (int b = gathered_from / bs, start = gathered_from; start < len;
       ++b, start += bs) {
    const int slots = std::min(bs, len - start);
    const int64_t block = seq.block_table[b];
    float* key_rows = keys.data() + int64_t{start - gathered_from} * hd;
    float* value_rows = values.data() + int64_t{start - gathered_from} * hd;
    const int64_t k_at = layout.Offset(block, local_layer, 0, kv_head, 0);
    const int64_t v_at = layout.Offset(block, local_layer, 1, kv_head, 0);
    if (kv_type == kv::KvDType::kF32) {
      std::memcpy(key_rows, pool.f32() + k_at, sizeof(float) * slots * hd);
      std::memcpy(value_rows, pool.f32() + v_at, sizeof(float) * slots * hd);
    } else {  // widened straight into the gathered matrices
      KvRows(pool, k_at, slots, key_rows);
      KvRows(pool, v_at, slots, value_rows);
    }
  }
  const int64_t row = qkv_rows();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int64_t out_stride = int64_t{q_heads} * hd;
  for (int i0 = 0; i0 < n; i0 += kQueryBlock) {
    const int rows = std::min(kQueryBlock, n - i0);
    // Key columns [key_lo, keys_end) of this block of queries.
    const int key_lo = FirstVisibleKey(seq.start_position + i0, local_layer);
    const int keys_end = seq.start_position + i0 + rows;
    const int columns = keys_end - key_lo;
    const float* block_keys =
        keys.data() + int64_t{key_lo - gathered_from} * hd;
    const float* block_values =
        values.data() + int64_t{key_lo - gathered_from} * hd;
    const float* q = qkv.data() + (first_token + i0) * row + int64_t{h} * hd;
    GemmRowMajor(/*transpose_b=*/true, rows, columns, hd, scale, q, row,
                 block_keys, hd, probs.data(), columns);
    for (int i = 0; i < rows; ++i) {
      float* p = probs.data() + int64_t{i} * columns;
      const int position = seq.start_position + i0 + i;
      const int lo = FirstVisibleKey(position, local_layer) - key_lo;
      const int visible = position + 1 - key_lo;
      std::fill(p, p + lo, 0.0f);
      SoftmaxInPlace(p + lo, visible - lo);
      std::fill(p + visible, p + columns, 0.0f);
    }
    float* out =
        attn_out.data() + (first_token + i0) * out_stride + int64_t{h} * hd;
    GemmRowMajor(/*transpose_b=*/false, rows, hd, columns, 1.0f, probs.data(),
                 columns, block_values, hd, out, out_stride);
  }
}

// ---------------------------------------------------------------------------
// Engine
// ---------------------------------------------------------------------------

int64_t CpuBackend::weight_bytes() const {
  int64_t bytes = (holds_first() ? embedding.bytes(p.vocab_rows()) : 0) +
                  static_cast<int64_t>(final_norm.size() * sizeof(float)) +
                  lm_head.bytes();
  for (const auto& lw : layers) {
    bytes += static_cast<int64_t>((lw.attn_norm.size() + lw.ffn_norm.size()) *
                                  sizeof(float)) +
             lw.bytes() +
             static_cast<int64_t>((lw.qkv_bias.size() + lw.q_norm.size() +
                                   lw.k_norm.size() + lw.o_bias.size()) *
                                  sizeof(float));
  }
  return bytes;
}

void CpuBackend::SwiGlu(const float* in, int64_t rows,
                        const WeightMatrix& w_gate_up,
                        const WeightMatrix& w_down, float* out) {
  const int64_t f = w_gate_up.rows() / 2;
  gate_up.resize(rows * 2 * f);
  act.resize(rows * f);
  MatMul(in, rows, w_gate_up, gate_up.data(), *workers);
  for (int64_t t = 0; t < rows; ++t) {
    const float* gate = gate_up.data() + t * 2 * f;
    SiluMul(gate, gate + f, act.data() + t * f, f);
  }
  MatMul(act.data(), rows, w_down, out, *workers);
}

void CpuBackend::SparseMlp(const CpuLayerWeights& lw, int local_layer,
                           int64_t n) {
  const int64_t hidden = config.hidden_size;
  const int num_experts = config.num_experts;
  const int k = config.experts_per_token;
  // Route every token (each rank alike: the router is whole everywhere).
  router_logits.resize(n * num_experts);
  MatMul(normed.data(), n, lw.router, router_logits.data(), *workers);
  route_experts.resize(n * k);
  route_weights.resize(n * k);
  for (int64_t t = 0; t < n; ++t) {
    RouteToken(router_logits.data() + t * num_experts, num_experts, k,
               config.normalize_expert_weights, route_experts.data() + t * k,
               route_weights.data() + t * k);
  }
  // Group the (token, slot) pairs by this rank's experts (a counting sort:
  // tokens keep their order inside an expert's group).
  const int first = p.expert_begin, local_count = p.local_experts();
  expert_offsets.assign(local_count + 1, 0);
  for (int64_t i = 0; i < n * k; ++i) {
    const int e = route_experts[i] - first;
    if (e >= 0 && e < local_count) ++expert_offsets[e + 1];
  }
  // Every expert's load, also those another rank holds (all ranks route
  // alike, so any rank's counts are the group's).
  std::vector<int64_t>& load = expert_tokens[local_layer];
  for (int64_t i = 0; i < n * k; ++i) ++load[route_experts[i]];
  for (int e = 0; e < local_count; ++e) {
    expert_offsets[e + 1] += expert_offsets[e];
  }
  expert_rows.resize(expert_offsets[local_count]);
  expert_next.assign(expert_offsets.begin(), expert_offsets.end() - 1);
  for (int64_t i = 0; i < n * k; ++i) {
    const int e = route_experts[i] - first;
    if (e >= 0 && e < local_count) {
      expert_rows[expert_next[e]++] = static_cast<int32_t>(i);
    }
  }
  std::fill(proj.begin(), proj.begin() + n * hidden, 0.0f);
  // Each expert runs its tokens as one batch through the packed kernels:
  // only the chosen experts' weights are read.
  for (int e = 0; e < local_count; ++e) {
    const int64_t begin = expert_offsets[e],
                  rows = expert_offsets[e + 1] - begin;
    if (rows == 0) continue;
    expert_in.resize(rows * hidden);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t token = expert_rows[begin + i] / k;
      std::memcpy(expert_in.data() + i * hidden, normed.data() + token * hidden,
                  hidden * sizeof(float));
    }
    expert_out.resize(rows * hidden);
    SwiGlu(expert_in.data(), rows, lw.experts[e].gate_up, lw.experts[e].down,
           expert_out.data());
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t slot = expert_rows[begin + i];
      Axpy(route_weights[slot], expert_out.data() + i * hidden,
           proj.data() + (slot / k) * hidden, hidden);
    }
  }
  if (lw.shared_gate_up.rows() == 0) return;
  // Qwen2-MoE's shared expert: every token, scaled by sigmoid(gate . x)
  // (the scalar is whole on every rank, so scaling a rank's share of the
  // sum scales the sum).
  shared_out.resize(n * hidden);
  SwiGlu(normed.data(), n, lw.shared_gate_up, lw.shared_down,
         shared_out.data());
  shared_scale.resize(n);
  MatMul(normed.data(), n, lw.shared_gate, shared_scale.data(), *workers);
  for (int64_t t = 0; t < n; ++t) {
    const float scale = 1.0f / (1.0f + std::exp(-shared_scale[t]));
    Axpy(scale, shared_out.data() + t * hidden, proj.data() + t * hidden,
         hidden);
  }
}

LlamaEngine::LlamaEngine(std::unique_ptr<EngineBackend> backend, Backend kind)
    : backend_(std::move(backend)), kind_(kind) {}
LlamaEngine::~LlamaEngine() = default;

const model::ModelConfig& LlamaEngine::config() const {
  return backend_->plan().config;
}
const ShardSpec& LlamaEngine::shard() const { return backend_->plan().shard; }
bool LlamaEngine::holds_first_layer() const {
  return backend_->plan().holds_first();
}
bool LlamaEngine::holds_last_layer() const {
  return backend_->plan().holds_last();
}
Backend LlamaEngine::backend() const { return kind_; }
kv::KvCacheLayout LlamaEngine::KvLayout(int block_size) const {
  return backend_->plan().KvLayout(block_size, backend_->kv_dtype());
}
bool LlamaEngine::kv_on_device() const { return backend_->kv_on_device(); }
absl::StatusOr<std::unique_ptr<kv::KvPool>> LlamaEngine::CreateKvPool(
    int block_size, int64_t num_blocks) {
  return backend_->CreateKvPool(KvLayout(block_size), num_blocks);
}
int64_t LlamaEngine::weight_bytes() const { return backend_->weight_bytes(); }
std::vector<std::vector<int64_t>> LlamaEngine::ExpertLoad() const {
  return backend_->ExpertLoad();
}

namespace {

// A host pool stands in for a device pool only with the same layout and size.
absl::Status CheckMirror(const kv::KvPool& host, const kv::KvPool& pool) {
  const kv::KvCacheLayout& a = host.layout();
  const kv::KvCacheLayout& b = pool.layout();
  if (a.DebugString() != b.DebugString() ||
      host.num_blocks() != pool.num_blocks()) {
    return absl::InvalidArgumentError(
        absl::StrCat("staging pool {", a.DebugString(), "} x ",
                     host.num_blocks(), " does not mirror the engine's pool {",
                     b.DebugString(), "} x ", pool.num_blocks()));
  }
  return absl::OkStatus();
}

absl::Status CheckBlockIds(std::span<const int32_t> blocks,
                           const kv::KvPool& pool) {
  for (int32_t block : blocks) {
    if (block < 0 || block >= pool.num_blocks()) {
      return absl::OutOfRangeError(absl::StrCat(
          "block ", block, " outside a pool of ", pool.num_blocks()));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LlamaEngine::CopyBlocksFromHost(const kv::KvPool& host,
                                             std::span<const int32_t> blocks,
                                             kv::KvPool& pool) {
  PDS_RETURN_IF_ERROR(CheckMirror(host, pool));
  PDS_RETURN_IF_ERROR(CheckBlockIds(blocks, pool));
  return backend_->CopyBlocksFromHost(host, blocks, pool);
}

absl::Status LlamaEngine::CopyTokensToHost(const kv::KvPool& pool,
                                           std::span<const int32_t> block_table,
                                           int64_t token_begin,
                                           int64_t token_end,
                                           kv::KvPool& host) {
  PDS_RETURN_IF_ERROR(CheckMirror(host, pool));
  const int64_t block_size = pool.layout().block_size;
  const int64_t needed = (token_end + block_size - 1) / block_size;
  if (token_begin < 0 || token_begin > token_end ||
      needed > static_cast<int64_t>(block_table.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokens [", token_begin, ", ", token_end, ") need ",
                     needed, " blocks of ", block_size,
                     "; the block table has ", block_table.size()));
  }
  if (token_begin == token_end) return absl::OkStatus();
  const int64_t first = token_begin / block_size;
  PDS_RETURN_IF_ERROR(
      CheckBlockIds(block_table.subspan(first, needed - first), pool));
  const std::vector<kv::StridedCopy> copies =
      kv::TokenRangeCopies(pool.layout(), block_table, token_begin, token_end);
  return backend_->CopyToHost(pool, copies, host);
}

absl::Status LlamaEngine::Forward(const ForwardBatch& batch, kv::KvPool& pool,
                                  ForwardResult* result) {
  result->argmax.clear();
  PDS_RETURN_IF_ERROR(backend_->Forward(batch, pool, result));
  // Backends that do not pick the argmax on their device get it here.
  if (result->argmax.empty() && !result->logits.empty()) {
    const int64_t vocab = config().vocab_size;
    result->argmax.resize(result->num_logit_rows);
    for (int r = 0; r < result->num_logit_rows; ++r) {
      result->argmax[r] = ArgMax(std::span<const float>(
          result->logits.data() + int64_t{r} * vocab, vocab));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<LlamaEngine>> LlamaEngine::Create(
    const model::WeightSource& weights, const EngineOptions& options) {
  PDS_ASSIGN_OR_RETURN(ShardPlan plan,
                       ResolveShardPlan(weights.config(), options));
  std::unique_ptr<EngineBackend> backend;
  if (options.backend == Backend::kCuda && plan.config.HasExperts()) {
    return absl::UnimplementedError(absl::StrCat(
        "the CUDA backend does not run mixture-of-experts layers yet (",
        plan.config.architecture, ", ", plan.config.num_experts,
        " experts); serve this model with --backend cpu"));
  }
  if (options.backend == Backend::kCuda) {
    PDS_ASSIGN_OR_RETURN(backend,
                         CreateCudaBackend(weights, options, std::move(plan)));
  } else {
    const kv::KvDType kv_dtype = options.kv_dtype.value_or(kv::KvDType::kF32);
    if (kv_dtype != kv::KvDType::kF32 && kv_dtype != kv::KvDType::kBF16) {
      return absl::InvalidArgumentError(
          absl::StrCat("the CPU backend keeps KV in f32 or bf16, not ",
                       kv::KvDTypeName(kv_dtype)));
    }
    auto cpu = std::make_unique<CpuBackend>();
    cpu->kv_type = kv_dtype;
    cpu->p = std::move(plan);
    cpu->communicator = options.communicator;
    cpu->q_heads = cpu->p.q_heads;
    cpu->q_head_offset = cpu->p.q_head_offset;
    cpu->kv_heads = cpu->p.kv_heads;
    cpu->kv_head_offset = cpu->p.kv_head_offset;
    cpu->vocab_begin = cpu->p.vocab_begin;
    cpu->vocab_end = cpu->p.vocab_end;
    PDS_RETURN_IF_ERROR(cpu->Load(weights));
    cpu->SetQuantizedMatmul(options.quantized_matmul);
    UseSingleThreadedBlas();
    cpu->workers = std::make_unique<ThreadPool>(options.num_threads);
    backend = std::move(cpu);
  }
  return std::unique_ptr<LlamaEngine>(
      new LlamaEngine(std::move(backend), options.backend));
}

absl::Status CpuBackend::Forward(const ForwardBatch& batch, kv::KvPool& pool,
                                 ForwardResult* result) {
  CpuBackend& m = *this;
  PDS_RETURN_IF_ERROR(
      ValidateBatch(p, batch, pool.layout(), pool.num_blocks(), kv_type));
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
          m.embedding.Row(token - m.vocab_begin, m.x.data() + t * hidden);
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
  m.normed.resize(n * hidden);
  m.qkv.resize(n * qkv_rows);
  m.attn_out.resize(n * attn_width);
  m.proj.resize(n * hidden);

  for (size_t local = 0; local < m.layers.size(); ++local) {
    const CpuLayerWeights& lw = m.layers[local];
    // Attention block.
    for (int64_t t = 0; t < n; ++t) {
      RmsNorm(m.x.data() + t * hidden, lw.attn_norm.data(), hidden,
              c.rms_norm_eps, m.normed.data() + t * hidden);
    }
    MatMul(m.normed.data(), n, lw.wqkv, m.qkv.data(), *m.workers);
    m.WriteKv(batch, static_cast<int>(local), lw, pool);
    m.Attention(batch, static_cast<int>(local), pool);
    MatMul(m.attn_out.data(), n, lw.wo, m.proj.data(), *m.workers);
    PDS_RETURN_IF_ERROR(m.AllReduce(m.proj, n * hidden));
    if (lw.o_bias.empty()) {
      for (int64_t i = 0; i < n * hidden; ++i) m.x[i] += m.proj[i];
    } else {  // after the sum, so every rank adds it once
      for (int64_t t = 0; t < n; ++t) {
        float* x = m.x.data() + t * hidden;
        const float* proj = m.proj.data() + t * hidden;
        for (int64_t i = 0; i < hidden; ++i) x[i] += proj[i] + lw.o_bias[i];
      }
    }

    // MLP block (SwiGLU, or the routed experts of a sparse layer).
    for (int64_t t = 0; t < n; ++t) {
      RmsNorm(m.x.data() + t * hidden, lw.ffn_norm.data(), hidden,
              c.rms_norm_eps, m.normed.data() + t * hidden);
    }
    if (lw.sparse) {
      m.SparseMlp(lw, static_cast<int>(local), n);
    } else {
      m.SwiGlu(m.normed.data(), n, lw.w_gate_up, lw.w_down, m.proj.data());
    }
    PDS_RETURN_IF_ERROR(m.AllReduce(m.proj, n * hidden));
    for (int64_t i = 0; i < n * hidden; ++i) m.x[i] += m.proj[i];
  }

  result->hidden_out.clear();
  // Not cleared: resized below, so a caller reusing its ForwardResult keeps
  // the buffer (a prefill chunk scoring its prompt has [512, 32000] logits:
  // 65 MB that a fresh vector would page-fault in and zero on every step).
  result->num_logit_rows = 0;
  if (!m.holds_last()) {
    result->logits.clear();
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
  if (num_rows == 0) {
    result->logits.clear();
    return absl::OkStatus();
  }
  const int64_t vocab_shard = m.vocab_end - m.vocab_begin;
  std::vector<float> normed_rows(num_rows * hidden);
  for (int64_t i = 0; i < num_rows; ++i) {
    RmsNorm(m.x.data() + rows[i] * hidden, m.final_norm.data(), hidden,
            c.rms_norm_eps, normed_rows.data() + i * hidden);
  }
  if (m.shard.tp_size == 1) {
    result->logits.resize(num_rows * vocab_shard);
    MatMul(normed_rows.data(), num_rows, m.lm_head, result->logits.data(),
           *m.workers);
    return absl::OkStatus();
  }
  std::vector<float> shard_logits(num_rows * vocab_shard);
  MatMul(normed_rows.data(), num_rows, m.lm_head, shard_logits.data(),
         *m.workers);
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
