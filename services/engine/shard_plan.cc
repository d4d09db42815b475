#include "engine/shard_plan.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace pdserve::engine {
namespace {

using model::LayerTensorName;
using model::Slice2D;

Slice2D Rows(int64_t begin, int64_t end) { return Slice2D{begin, end, 0, -1}; }
Slice2D Cols(int64_t begin, int64_t end) { return Slice2D{0, -1, begin, end}; }

absl::Status Read(const model::WeightSource& weights, const std::string& name,
                  const Slice2D& slice, int64_t rows, int64_t cols,
                  std::vector<float>& out, int64_t out_offset = 0) {
  if (out.size() < static_cast<size_t>(out_offset + rows * cols)) {
    out.resize(out_offset + rows * cols);
  }
  return weights.ReadF32(name, slice, out.data() + out_offset);
}

}  // namespace

kv::KvCacheLayout ShardPlan::KvLayout(int block_size, kv::KvDType dtype) const {
  kv::KvCacheLayout layout;
  layout.num_layers = num_layers();
  layout.layer_offset = shard.layer_begin;
  layout.num_kv_heads = kv_heads;
  layout.kv_head_offset = kv_head_offset;
  layout.block_size = block_size;
  layout.head_dim = config.head_dim;
  layout.dtype = dtype;
  return layout;
}

absl::StatusOr<ShardPlan> ResolveShardPlan(const model::ModelConfig& config,
                                           const EngineOptions& options) {
  PDS_RETURN_IF_ERROR(config.Validate());
  ShardPlan plan;
  plan.config = config;
  const model::ModelConfig& c = plan.config;
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
  plan.shard = shard;
  const int r = shard.tp_rank;
  plan.q_heads = c.num_heads / tp;
  plan.q_head_offset = r * plan.q_heads;
  if (tp <= c.num_kv_heads) {
    plan.kv_heads = c.num_kv_heads / tp;
    plan.kv_head_offset = r * plan.kv_heads;
  } else {
    // More ranks than KV heads: each rank keeps a replica of the one KV head
    // its query heads read.
    plan.kv_heads = 1;
    plan.kv_head_offset = plan.q_head_offset / (c.num_heads / c.num_kv_heads);
  }
  plan.ffn_begin = int64_t{c.intermediate_size} * r / tp;
  plan.ffn_end = int64_t{c.intermediate_size} * (r + 1) / tp;
  plan.expert_parallelism = options.expert_parallelism;
  if (!c.HasExperts() &&
      options.expert_parallelism == ExpertParallelism::kExpert) {
    // A flag that would change nothing is refused, not ignored.
    return absl::InvalidArgumentError(absl::StrCat(
        "expert parallelism (--moe-parallel ep) needs a mixture-of-experts "
        "model; ",
        c.architecture, " has no experts"));
  }
  if (c.HasExperts()) {
    if (options.expert_parallelism == ExpertParallelism::kExpert) {
      if (tp > c.num_experts) {
        return absl::InvalidArgumentError(
            absl::StrCat("expert parallelism over ", tp,
                         " ranks needs at "
                         "least as many experts; the model has ",
                         c.num_experts));
      }
      plan.expert_begin = c.num_experts * r / tp;
      plan.expert_end = c.num_experts * (r + 1) / tp;
      plan.expert_ffn_begin = 0;
      plan.expert_ffn_end = c.expert_intermediate_size;
    } else {
      plan.expert_begin = 0;
      plan.expert_end = c.num_experts;
      plan.expert_ffn_begin = int64_t{c.expert_intermediate_size} * r / tp;
      plan.expert_ffn_end = int64_t{c.expert_intermediate_size} * (r + 1) / tp;
    }
    plan.shared_ffn_begin = int64_t{c.shared_expert_intermediate_size} * r / tp;
    plan.shared_ffn_end =
        int64_t{c.shared_expert_intermediate_size} * (r + 1) / tp;
  }
  plan.vocab_begin = int64_t{c.vocab_size} * r / tp;
  plan.vocab_end = int64_t{c.vocab_size} * (r + 1) / tp;
  return plan;
}

std::string_view ExpertParallelismName(ExpertParallelism mode) {
  return mode == ExpertParallelism::kExpert ? "ep" : "tp";
}

absl::Status ValidateBatch(const ShardPlan& plan, const ForwardBatch& batch,
                           const kv::KvCacheLayout& layout, int64_t pool_blocks,
                           kv::KvDType dtype) {
  const model::ModelConfig& config = plan.config;
  if (layout.dtype != dtype || layout.num_layers != plan.num_layers() ||
      layout.layer_offset != plan.shard.layer_begin ||
      layout.num_kv_heads != plan.kv_heads ||
      layout.kv_head_offset != plan.kv_head_offset ||
      layout.head_dim != config.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV pool layout {", layout.DebugString(),
        "} does not match this shard (layers [", plan.shard.layer_begin, ",",
        plan.shard.layer_end, "), kv heads [", plan.kv_head_offset, ",",
        plan.kv_head_offset + plan.kv_heads, "), head_dim ", config.head_dim,
        ", ", kv::KvDTypeName(dtype), ")"));
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
    if (plan.holds_first()) {
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
      if (seq.block_table[b] < 0 || seq.block_table[b] >= pool_blocks) {
        return absl::OutOfRangeError(
            absl::StrCat("sequence ", s, ": block id ", seq.block_table[b],
                         " outside pool of ", pool_blocks, " blocks"));
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
  if (!plan.holds_first() &&
      batch.hidden_in.size() !=
          static_cast<size_t>(total_tokens * config.hidden_size)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hidden_in has ", batch.hidden_in.size(), " floats, expected ",
        total_tokens, " x ", config.hidden_size));
  }
  return absl::OkStatus();
}

absl::Status LoadLayerExtras(const model::WeightSource& weights,
                             const ShardPlan& plan, int layer,
                             HostLayerWeights* lw) {
  const int64_t hidden = plan.config.hidden_size;
  const int64_t hd = plan.config.head_dim;
  const int64_t q_rows = plan.q_heads * hd, kv_rows = plan.kv_heads * hd;
  const int64_t q0 = plan.q_head_offset * hd, kv0 = plan.kv_head_offset * hd;
  const model::ModelConfig& c = plan.config;
  if (c.qkv_bias) {
    // Sliced with their heads, like the weight rows (a replicated KV head's
    // bias when TP exceeds the KV heads).
    lw->qkv_bias.resize(q_rows + 2 * kv_rows);
    PDS_RETURN_IF_ERROR(
        Read(weights, LayerTensorName(layer, "self_attn.q_proj.bias"),
             Cols(q0, q0 + q_rows), 1, q_rows, lw->qkv_bias, 0));
    PDS_RETURN_IF_ERROR(
        Read(weights, LayerTensorName(layer, "self_attn.k_proj.bias"),
             Cols(kv0, kv0 + kv_rows), 1, kv_rows, lw->qkv_bias, q_rows));
    PDS_RETURN_IF_ERROR(Read(
        weights, LayerTensorName(layer, "self_attn.v_proj.bias"),
        Cols(kv0, kv0 + kv_rows), 1, kv_rows, lw->qkv_bias, q_rows + kv_rows));
  }
  if (c.qk_norm) {
    PDS_RETURN_IF_ERROR(Read(weights,
                             LayerTensorName(layer, "self_attn.q_norm.weight"),
                             {}, 1, hd, lw->q_norm));
    PDS_RETURN_IF_ERROR(Read(weights,
                             LayerTensorName(layer, "self_attn.k_norm.weight"),
                             {}, 1, hd, lw->k_norm));
  }
  if (c.o_bias) {
    PDS_RETURN_IF_ERROR(Read(weights,
                             LayerTensorName(layer, "self_attn.o_proj.bias"),
                             {}, 1, hidden, lw->o_bias));
  }
  return absl::OkStatus();
}

absl::Status LoadLayerWeights(const model::WeightSource& weights,
                              const ShardPlan& plan, int layer,
                              HostLayerWeights* lw) {
  const int64_t hidden = plan.config.hidden_size;
  const int64_t hd = plan.config.head_dim;
  PDS_RETURN_IF_ERROR(Read(weights,
                           LayerTensorName(layer, "input_layernorm.weight"), {},
                           1, hidden, lw->attn_norm));
  PDS_RETURN_IF_ERROR(
      Read(weights, LayerTensorName(layer, "post_attention_layernorm.weight"),
           {}, 1, hidden, lw->ffn_norm));
  const int64_t q_rows = plan.q_heads * hd, kv_rows = plan.kv_heads * hd;
  const int64_t q0 = plan.q_head_offset * hd, kv0 = plan.kv_head_offset * hd;
  PDS_RETURN_IF_ERROR(Read(weights,
                           LayerTensorName(layer, "self_attn.q_proj.weight"),
                           Rows(q0, q0 + q_rows), q_rows, hidden, lw->wqkv, 0));
  PDS_RETURN_IF_ERROR(Read(
      weights, LayerTensorName(layer, "self_attn.k_proj.weight"),
      Rows(kv0, kv0 + kv_rows), kv_rows, hidden, lw->wqkv, q_rows * hidden));
  PDS_RETURN_IF_ERROR(Read(weights,
                           LayerTensorName(layer, "self_attn.v_proj.weight"),
                           Rows(kv0, kv0 + kv_rows), kv_rows, hidden, lw->wqkv,
                           (q_rows + kv_rows) * hidden));
  PDS_RETURN_IF_ERROR(Read(weights,
                           LayerTensorName(layer, "self_attn.o_proj.weight"),
                           Cols(q0, q0 + q_rows), hidden, q_rows, lw->wo));
  PDS_RETURN_IF_ERROR(LoadLayerExtras(weights, plan, layer, lw));
  const int64_t f = plan.ffn_rows();
  PDS_RETURN_IF_ERROR(
      Read(weights, LayerTensorName(layer, "mlp.gate_proj.weight"),
           Rows(plan.ffn_begin, plan.ffn_end), f, hidden, lw->w_gate_up, 0));
  PDS_RETURN_IF_ERROR(Read(weights,
                           LayerTensorName(layer, "mlp.up_proj.weight"),
                           Rows(plan.ffn_begin, plan.ffn_end), f, hidden,
                           lw->w_gate_up, f * hidden));
  return Read(weights, LayerTensorName(layer, "mlp.down_proj.weight"),
              Cols(plan.ffn_begin, plan.ffn_end), hidden, f, lw->w_down);
}

absl::Status LoadEmbedding(const model::WeightSource& weights,
                           const ShardPlan& plan, std::vector<float>* out) {
  return Read(weights, "model.embed_tokens.weight",
              Rows(plan.vocab_begin, plan.vocab_end), plan.vocab_rows(),
              plan.config.hidden_size, *out);
}

absl::Status LoadHead(const model::WeightSource& weights, const ShardPlan& plan,
                      std::vector<float>* final_norm,
                      std::vector<float>* lm_head) {
  const int64_t hidden = plan.config.hidden_size;
  PDS_RETURN_IF_ERROR(
      Read(weights, "model.norm.weight", {}, 1, hidden, *final_norm));
  const std::string head_name = weights.HasTensor("lm_head.weight")
                                    ? "lm_head.weight"
                                    : "model.embed_tokens.weight";
  return Read(weights, head_name, Rows(plan.vocab_begin, plan.vocab_end),
              plan.vocab_rows(), hidden, *lm_head);
}

std::vector<double> RopeInverseFrequencies(const model::ModelConfig& c,
                                           int64_t seq_len) {
  using model::RopeScalingType;
  const model::RopeScaling& rope = c.rope_scaling;
  const int half = c.head_dim / 2;
  const double dim = c.head_dim;
  double base = c.rope_theta;
  if (rope.type == RopeScalingType::kDynamic &&
      seq_len > rope.original_max_position) {
    // NTK-aware: grow the base with the sequence past the trained context.
    base *= std::pow(
        rope.factor * seq_len / rope.original_max_position - (rope.factor - 1),
        dim / (dim - 2));
  }
  std::vector<double> inv(half);
  for (int j = 0; j < half; ++j) inv[j] = std::pow(base, -2.0 * j / dim);
  switch (rope.type) {
    case RopeScalingType::kNone:
    case RopeScalingType::kDynamic:
      break;
    case RopeScalingType::kLinear:
      for (double& f : inv) f /= rope.factor;
      break;
    case RopeScalingType::kFreqFactors:
      for (int j = 0; j < half; ++j) inv[j] /= rope.freq_factors[j];
      break;
    case RopeScalingType::kLlama3: {
      // Long wavelengths (past the old context / low_freq_factor) are
      // interpolated by the factor, short ones (below old context /
      // high_freq_factor) kept, the band between blended smoothly.
      const double old_context = rope.original_max_position;
      const double low_wavelength = old_context / rope.low_freq_factor;
      const double high_wavelength = old_context / rope.high_freq_factor;
      for (double& f : inv) {
        const double wavelength = 2 * M_PI / f;
        if (wavelength < high_wavelength) continue;
        if (wavelength > low_wavelength) {
          f /= rope.factor;
          continue;
        }
        const double smooth =
            (old_context / wavelength - rope.low_freq_factor) /
            (rope.high_freq_factor - rope.low_freq_factor);
        f = (1 - smooth) * f / rope.factor + smooth * f;
      }
      break;
    }
    case RopeScalingType::kYarn: {
      // Pairs that turn fewer than beta_slow times over the original
      // context are interpolated, more than beta_fast times extrapolated,
      // a linear ramp in between.
      auto correction_dim = [&](double rotations) {
        return dim *
               std::log(rope.original_max_position / (rotations * 2 * M_PI)) /
               (2 * std::log(double{c.rope_theta}));
      };
      double low = correction_dim(rope.beta_fast);
      double high = correction_dim(rope.beta_slow);
      if (rope.truncate) {
        low = std::floor(low);
        high = std::ceil(high);
      }
      low = std::max(low, 0.0);
      high = std::min(high, dim - 1);
      if (low == high) high += 0.001;  // as transformers: no singular ramp
      for (int j = 0; j < half; ++j) {
        const double ramp = std::clamp((j - low) / (high - low), 0.0, 1.0);
        const double extrapolation = 1 - ramp;
        inv[j] =
            inv[j] / rope.factor * (1 - extrapolation) + inv[j] * extrapolation;
      }
      break;
    }
  }
  return inv;
}

void BuildRopeTables(const model::ModelConfig& c, std::vector<float>* cos,
                     std::vector<float>* sin) {
  const int half = c.head_dim / 2;
  const model::RopeScaling& rope = c.rope_scaling;
  const double scale =
      rope.type == model::RopeScalingType::kYarn ? rope.attention_factor : 1.0;
  const bool dynamic = rope.type == model::RopeScalingType::kDynamic;
  cos->resize(int64_t{c.max_position_embeddings} * half);
  sin->resize(cos->size());
  // Once per model (per position only where dynamic NTK grows the base).
  std::vector<double> inv_freq = RopeInverseFrequencies(c);
  for (int pos = 0; pos < c.max_position_embeddings; ++pos) {
    if (dynamic && pos + 1 > rope.original_max_position) {
      inv_freq = RopeInverseFrequencies(c, pos + 1);
    }
    for (int j = 0; j < half; ++j) {
      const double angle = pos * inv_freq[j];
      (*cos)[int64_t{pos} * half + j] =
          static_cast<float>(std::cos(angle) * scale);
      (*sin)[int64_t{pos} * half + j] =
          static_cast<float>(std::sin(angle) * scale);
    }
  }
}

}  // namespace pdserve::engine
