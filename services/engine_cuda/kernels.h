// Launchers of the CUDA backend's kernels. Every pointer is device memory;
// bf16 tensors are passed as uint16_t (bit patterns) so this header needs no
// CUDA includes. Each launcher enqueues on `stream` and returns the launch
// error (cudaGetLastError) as a status; none synchronizes, so all of them
// can be captured into a CUDA Graph.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "engine/attention_math.h"  // PDS_HOST_DEVICE

struct CUstream_st;

namespace pdserve::engine::cuda {

using Stream = CUstream_st*;

// x[t] = embedding[token[t] - vocab_begin] (f32), or zeros when the token is
// outside this rank's vocab rows (the TP all-reduce then sums the shards).
absl::Status LaunchEmbed(const uint16_t* embedding, int64_t vocab_begin,
                         int64_t vocab_rows, int hidden, const int32_t* tokens,
                         int num_tokens, float* x, Stream stream);

// out[t] = bf16(x[t] * rsqrt(mean(x[t]^2) + eps) * weight). When `residual`
// is given, x[t] += residual[t] first and is written back (the fused
// residual add); with `residual_bias` ([hidden]) too, x[t] += (residual[t] +
// residual_bias), the o_proj bias added once after the TP all-reduce, in the
// order of the CPU engine and of LaunchAddRowBias + LaunchAdd.
absl::Status LaunchRmsNorm(float* x, const float* residual, const float* weight,
                           float eps, int hidden, int num_rows, uint16_t* out,
                           Stream stream, const float* residual_bias = nullptr);

// x[r] += bias for each of `rows` f32 rows of `cols` (the unfused o_proj
// bias).
absl::Status LaunchAddRowBias(float* x, const float* bias, int rows, int cols,
                              Stream stream);

// y[r][o] = Σ_k x[r][k] w[o][k] for r < rows <= kSmallBatchRows: bf16 x
// [rows][in] and w [out][in], f32 y rows `ldy` apart. Decode steps are
// weight-bandwidth bound, and for skinny shapes cuBLAS picks split-K kernels
// plus a reduction launch that leave bandwidth unused; this reads each
// weight row once with 16-byte loads, one warp per output. `in` must be a
// multiple of 8 (16-byte rows); the caller falls back to cuBLAS otherwise.
inline constexpr int kSmallBatchRows = 8;
absl::Status LaunchSmallBatchGemv(const uint16_t* x, int rows, int64_t in,
                                  const uint16_t* w, int64_t out, float* y,
                                  int64_t ldy, Stream stream);

// x += delta (f32), element-wise over count elements.
absl::Status LaunchAdd(float* x, const float* delta, int64_t count,
                       Stream stream);

// The paged KV cache of one pool: [block][layer][k|v][head][slot][head_dim]
// in bf16 (kv::KvCacheLayout).
struct KvCacheView {
  uint16_t* base = nullptr;
  int block_size = 0;
  int head_dim = 0;
  int num_kv_heads = 0;
  int num_layers = 0;
  PDS_HOST_DEVICE int64_t head_stride() const {
    return int64_t{block_size} * head_dim;
  }
  PDS_HOST_DEVICE int64_t kv_stride() const {
    return head_stride() * num_kv_heads;
  }
  PDS_HOST_DEVICE int64_t layer_stride() const { return kv_stride() * 2; }
  PDS_HOST_DEVICE int64_t block_stride() const {
    return layer_stride() * num_layers;
  }
};

// The family extras applied to q/k/v before RoPE, each null when the model
// has none: the projection biases ([q_heads + 2 kv_heads][head_dim], this
// rank's rows, Qwen2 / attention_bias) and the per-head RMSNorm weights of q
// and k ([head_dim], Qwen3; eps is the model's rms_norm_eps).
struct QkvExtras {
  const float* bias = nullptr;
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  float eps = 1e-6f;
};

// Adds the biases and normalizes q and k per head (`extras`, when given),
// then rotates q and k of every token by its position (rotate-half RoPE from
// the f32 cos/sin tables [max_position, head_dim/2]), in place in `qkv`
// ([tokens][q_heads + 2 kv_heads][head_dim], f32), and writes k and v to the
// cache at slots[t] (block * block_size + slot; -1 writes nothing). The
// order is the CPU engine's: bias, norm, RoPE.
absl::Status LaunchRopeWriteKv(float* qkv, int num_tokens, int q_heads,
                               const int32_t* positions, const int32_t* slots,
                               const float* rope_cos, const float* rope_sin,
                               const KvCacheView& cache, int layer,
                               const QkvExtras& extras, Stream stream);

// Paged attention for every query token: token t (sequence token_sequence[t],
// position positions[t]) attends causally to keys [0, positions[t]] through
// its block-table row, or with a sliding `window` > 0 to keys
// [positions[t] - window + 1, positions[t]] (the CPU engine's window). Split-K:
// `partitions` pieces of `partition` keys each produce an online-softmax run in
// `partials` ([tokens][q_heads][partitions] [head_dim + 2] f32), which a second
// kernel merges into `out` ([tokens] [q_heads * head_dim], bf16). q_head h
// reads pool KV head (q_head_offset + h) / group - kv_head_offset.
struct AttentionArgs {
  const float* qkv = nullptr;
  int num_tokens = 0;
  int q_heads = 0;
  int q_head_offset = 0;
  int group = 1;  // query heads per KV head in the model
  int kv_head_offset = 0;
  const int32_t* positions = nullptr;
  const int32_t* token_sequence = nullptr;
  const int32_t* block_tables = nullptr;
  int max_blocks_per_sequence = 0;
  KvCacheView cache;
  int layer = 0;
  int window = 0;      // this layer's sliding window; 0: the whole context
  int partition = 0;   // legacy: keys per partition
  int partitions = 1;  // legacy: partitions per token (grid size; empty
                       // ones skip)
  float* partials = nullptr;
  uint16_t* out = nullptr;
  // The step metadata's header (StepHeader slots) and the work items the
  // decode and prefill kernels read (AttentionItem, 4 int32 each).
  const int32_t* header = nullptr;
  const int32_t* items = nullptr;
};
// The legacy kernel (AttentionKernels::kLegacy).
absl::Status LaunchPagedAttention(const AttentionArgs& args, Stream stream);

// Flash-decoding (attention_kernels.cu): `num_items` sequences (args.items
// = the step's sequence items), `rows` = most query tokens of one sequence x
// group (DecodeKernelFits), `splits` context partitions per (sequence, KV
// head) of header[kHeaderDecodePartition] keys each, merged into args.out
// by a second kernel when splits > 1 (partials: [token][q_head][split]
// [head_dim + 2] f32, m and l in log2 units).
absl::Status LaunchDecodeAttention(const AttentionArgs& args, int num_items,
                                   int rows, int splits, Stream stream);

// Tensor-core prefill attention (attention_kernels.cu): `num_tiles` tiles
// (args.items = the step's attention tiles), causal within each sequence
// over its whole context in the cache (a cached prefix included).
absl::Status LaunchPrefillAttention(const AttentionArgs& args, int num_tiles,
                                    Stream stream);

// Once per process and device before the launches above: lets the decode
// kernel use more than 48 KB of shared memory.
absl::Status ConfigureAttentionKernels();

// act[t][i] = bf16(silu(gate_up[t][i]) * gate_up[t][ffn + i]).
absl::Status LaunchSwiGlu(const float* gate_up, int num_tokens, int64_t ffn,
                          uint16_t* act, Stream stream);

// out[r] = x[rows[r]] (f32 rows of `hidden`).
absl::Status LaunchGatherRows(const float* x, const int32_t* rows, int num_rows,
                              int hidden, float* out, Stream stream);

// out[r] = argmax_j logits[r][j] (lowest index on ties), for greedy sampling
// without copying logits to the host.
absl::Status LaunchArgmaxRows(const float* logits, int num_rows, int vocab,
                              int32_t* out, Stream stream);

// Host-side bf16 conversion of a weight tensor happens in the loader; this
// converts on the device (f32 -> bf16, round to nearest even).
absl::Status LaunchF32ToBf16(const float* in, int64_t count, uint16_t* out,
                             Stream stream);

}  // namespace pdserve::engine::cuda
