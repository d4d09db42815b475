// The CUDA backend's kernels. Element-wise chains are fused where one pass
// over memory replaces two (residual add + RMSNorm, RoPE + KV write,
// gate/up activation); GEMMs are cuBLAS.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "absl/strings/str_cat.h"
#include "engine/attention_math.h"
#include "engine_cuda/device_common.cuh"
#include "engine_cuda/kernels.h"

namespace pdserve::engine::cuda {
namespace {

using device::AsBf16;
using device::kFullMask;
using device::kWarp;
using device::LaunchStatus;
using device::WarpMax;
using device::WarpSum;

// Largest head_dim the attention kernels hold in registers (the backend
// refuses bigger ones at creation).
constexpr int kMaxHeadDim = 256;
constexpr int kAttentionWarpsPerBlock = 4;

// Sum over the block (blockDim.x a multiple of 32, at most 1024).
__device__ float BlockSum(float v) {
  __shared__ float warp_sums[kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  v = WarpSum(v);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / kWarp;
  v = lane < warps ? warp_sums[lane] : 0.0f;
  if (warp == 0) v = WarpSum(v);
  if (threadIdx.x == 0) warp_sums[0] = v;
  __syncthreads();
  const float total = warp_sums[0];
  __syncthreads();  // warp_sums is reused by the next call
  return total;
}

// ---------------------------------------------------------------------------

__global__ void EmbedKernel(const __nv_bfloat16* embedding, int64_t vocab_begin,
                            int64_t vocab_rows, int hidden,
                            const int32_t* tokens, float* x) {
  const int t = blockIdx.x;
  const int64_t local = tokens[t] - vocab_begin;
  float* row = x + int64_t{t} * hidden;
  if (local < 0 || local >= vocab_rows) {
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) row[i] = 0.0f;
    return;
  }
  const __nv_bfloat16* source = embedding + local * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    row[i] = __bfloat162float(source[i]);
  }
}

__global__ void RmsNormKernel(float* x, const float* residual,
                              const float* residual_bias, const float* weight,
                              float eps, int hidden, __nv_bfloat16* out) {
  const int64_t row = blockIdx.x;
  float* xr = x + row * hidden;
  float sum_squares = 0.0f;
  if (residual != nullptr) {
    const float* rr = residual + row * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
      const float delta =
          residual_bias != nullptr ? rr[i] + residual_bias[i] : rr[i];
      const float v = xr[i] + delta;
      xr[i] = v;
      sum_squares += v * v;
    }
  } else {
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
      sum_squares += xr[i] * xr[i];
    }
  }
  const float scale = rsqrtf(BlockSum(sum_squares) / hidden + eps);
  __nv_bfloat16* o = out + row * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    o[i] = __float2bfloat16_rn(xr[i] * scale * weight[i]);
  }
}

// Block r (one row).
__global__ void AddRowBiasKernel(float* x, const float* bias, int cols) {
  float* row = x + int64_t{blockIdx.x} * cols;
  for (int i = threadIdx.x; i < cols; i += blockDim.x) row[i] += bias[i];
}

__global__ void AddKernel(float* x, const float* delta, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    x[i] += delta[i];
  }
}

// Block t (one token); its threads walk the (head, rotation pair) items of
// the q_heads + kv_heads heads: pair j of a head is (j, j + half). One block
// per token, not per (token, head): a 2048-token prefill of an 8B model is
// 2048 blocks of 256 threads instead of 81920 blocks of 64. With family
// extras a first pass (one warp per head, every head of q, k and v) adds the
// biases and normalizes q and k heads; models without them skip it and its
// barrier.
__global__ void RopeWriteKvKernel(float* qkv, int q_heads,
                                  const int32_t* positions,
                                  const int32_t* slots, const float* rope_cos,
                                  const float* rope_sin, KvCacheView cache,
                                  int layer, QkvExtras extras) {
  const int t = blockIdx.x;
  const int hd = cache.head_dim;
  const int half = hd / 2;
  const int kv_heads = cache.num_kv_heads;
  const int64_t row = int64_t{q_heads + 2 * kv_heads} * hd;
  if (extras.bias != nullptr || extras.q_norm != nullptr ||
      extras.k_norm != nullptr) {
    const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
    const int warps = blockDim.x / kWarp;
    for (int head = warp; head < q_heads + 2 * kv_heads; head += warps) {
      float* vec = qkv + t * row + int64_t{head} * hd;
      const float* bias =
          extras.bias != nullptr ? extras.bias + int64_t{head} * hd : nullptr;
      const float* norm = head < q_heads              ? extras.q_norm
                          : head < q_heads + kv_heads ? extras.k_norm
                                                      : nullptr;
      float sum_squares = 0.0f;
      for (int d = lane; d < hd; d += kWarp) {
        const float v = bias != nullptr ? vec[d] + bias[d] : vec[d];
        vec[d] = v;
        sum_squares += v * v;
      }
      if (norm == nullptr) continue;  // uniform across the warp
      // Each lane rescales the dims it wrote itself: no barrier needed.
      const float scale = rsqrtf(WarpSum(sum_squares) / hd + extras.eps);
      for (int d = lane; d < hd; d += kWarp) vec[d] = vec[d] * scale * norm[d];
    }
    __syncthreads();  // the rotation pairs below cross warps
  }
  const int position = positions[t];
  const int slot_index = slots[t];  // -1: padding token of a graph replay
  const float* cos_row = rope_cos + int64_t{position} * half;
  const float* sin_row = rope_sin + int64_t{position} * half;
  const int items = (q_heads + kv_heads) * half;
  for (int item = threadIdx.x; item < items; item += blockDim.x) {
    const int head = item / half;
    const int j = item - head * half;
    const float c = cos_row[j];
    const float s = sin_row[j];
    float* vec = qkv + t * row + int64_t{head} * hd;
    const float a = vec[j], b = vec[j + half];
    const float ra = a * c - b * s;
    const float rb = b * c + a * s;
    if (head < q_heads) {
      vec[j] = ra;
      vec[j + half] = rb;
      continue;
    }
    if (slot_index < 0) continue;
    const int kv_head = head - q_heads;
    const int64_t block = slot_index / cache.block_size;
    const int slot = slot_index % cache.block_size;
    const int64_t at = block * cache.block_stride() +
                       layer * cache.layer_stride() +
                       kv_head * cache.head_stride() + int64_t{slot} * hd;
    __nv_bfloat16* k = AsBf16(cache.base) + at;
    __nv_bfloat16* v = k + cache.kv_stride();
    const float* v_in = vec + int64_t{kv_heads} * hd;
    k[j] = __float2bfloat16_rn(ra);
    k[j + half] = __float2bfloat16_rn(rb);
    v[j] = __float2bfloat16_rn(v_in[j]);
    v[j + half] = __float2bfloat16_rn(v_in[j + half]);
  }
}

// One warp per (token, query head, partition). Lane l scores key tile + l
// (a dot product over its bf16 K row), the warp folds the tile into its
// online-softmax run, then every lane accumulates its head dims
// (d = lane + 32 i) over the tile's V rows.
__global__ void PagedAttentionKernel(AttentionArgs a, float scale) {
  __shared__ float q_shared[kAttentionWarpsPerBlock][kMaxHeadDim];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int h = blockIdx.x * kAttentionWarpsPerBlock + warp;
  const int t = blockIdx.y;
  const int part = blockIdx.z;
  if (h >= a.q_heads) return;
  const KvCacheView& cache = a.cache;
  const int hd = cache.head_dim;
  const int bs = cache.block_size;
  const int position = a.positions[t];
  // A window hides the keys before position - window + 1: partitions wholly
  // before it come out empty, like those past the position.
  const int first_visible = a.window > 0 ? max(0, position + 1 - a.window) : 0;
  const int begin = max(part * a.partition, first_visible);
  const int end = min(part * a.partition + a.partition, position + 1);
  float* partial =
      a.partials +
      ((int64_t{t} * a.q_heads + h) * a.partitions + part) * (hd + 2);
  if (begin >= end) {
    if (lane == 0) {
      partial[0] = -INFINITY;
      partial[1] = 0.0f;
    }
    return;
  }
  const int64_t qkv_row = int64_t{a.q_heads + 2 * cache.num_kv_heads} * hd;
  const float* q = a.qkv + t * qkv_row + int64_t{h} * hd;
  for (int d = lane; d < hd; d += kWarp) q_shared[warp][d] = q[d] * scale;
  __syncwarp();
  const int kv_head = (a.q_head_offset + h) / a.group - a.kv_head_offset;
  const int32_t* table =
      a.block_tables + int64_t{a.token_sequence[t]} * a.max_blocks_per_sequence;
  const __nv_bfloat16* base = AsBf16(cache.base) +
                              int64_t{a.layer} * cache.layer_stride() +
                              int64_t{kv_head} * cache.head_stride();
  constexpr int kDimsPerLane = kMaxHeadDim / kWarp;
  float acc[kDimsPerLane];
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) acc[i] = 0.0f;
  float run_max = -INFINITY, run_sum = 0.0f;
  for (int tile = begin; tile < end; tile += kWarp) {
    const int k = tile + lane;
    float score = -INFINITY;
    if (k < end) {
      const __nv_bfloat16* key = base +
                                 int64_t{table[k / bs]} * cache.block_stride() +
                                 int64_t{k % bs} * hd;
      const __nv_bfloat162* key2 = reinterpret_cast<const __nv_bfloat162*>(key);
      float dot = 0.0f;
      for (int d = 0; d < hd / 2; ++d) {
        const float2 kf = __bfloat1622float2(key2[d]);
        dot += q_shared[warp][2 * d] * kf.x + q_shared[warp][2 * d + 1] * kf.y;
      }
      score = dot;
    }
    // Lane 0's key is always inside the partition, so the tile max is finite.
    const float new_max = fmaxf(run_max, WarpMax(score));
    const float correction =
        run_max == -INFINITY ? 0.0f : expf(run_max - new_max);
    const float p = k < end ? expf(score - new_max) : 0.0f;
    run_sum = run_sum * correction + WarpSum(p);
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) acc[i] *= correction;
    const int valid = min(kWarp, end - tile);
    for (int j = 0; j < valid; ++j) {
      const float pj = __shfl_sync(kFullMask, p, j);
      const int kj = tile + j;
      const __nv_bfloat16* value =
          base + cache.kv_stride() +
          int64_t{table[kj / bs]} * cache.block_stride() +
          int64_t{kj % bs} * hd;
#pragma unroll
      for (int i = 0; i < kDimsPerLane; ++i) {
        const int d = lane + kWarp * i;
        if (d < hd) acc[i] += pj * __bfloat162float(value[d]);
      }
    }
    run_max = new_max;
  }
  if (lane == 0) {
    partial[0] = run_max;
    partial[1] = run_sum;
  }
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) {
    const int d = lane + kWarp * i;
    if (d < hd) partial[2 + d] = acc[i];
  }
}

// Block (query head, token); thread d owns output dim d.
__global__ void MergePartitionsKernel(AttentionArgs a) {
  const int h = blockIdx.x;
  const int t = blockIdx.y;
  const int d = threadIdx.x;
  const int hd = a.cache.head_dim;
  const int used =
      min(a.partitions, NumPartitions(a.positions[t] + 1, a.partition));
  const float* partial =
      a.partials + (int64_t{t} * a.q_heads + h) * a.partitions * (hd + 2);
  float max_score = -INFINITY;
  for (int p = 0; p < used; ++p) {
    max_score = fmaxf(max_score, partial[p * (hd + 2)]);
  }
  float numerator = 0.0f, denominator = 0.0f;
  for (int p = 0; p < used; ++p) {
    const float* run = partial + p * (hd + 2);
    // An empty partition (before a sliding window) wrote no values.
    if (run[0] == -INFINITY) continue;
    const float weight = expf(run[0] - max_score);
    denominator += weight * run[1];
    if (d < hd) numerator += weight * run[2 + d];
  }
  if (d < hd) {
    AsBf16(a.out)[int64_t{t} * a.q_heads * hd + int64_t{h} * hd + d] =
        __float2bfloat16_rn(numerator / denominator);
  }
}

// Block (token, x): four elements per thread, 16-byte loads when the row
// allows (a 2D grid: no 64-bit division per element).
__global__ void SwiGluKernel(const float* gate_up, int64_t ffn,
                             __nv_bfloat16* act) {
  const int64_t t = blockIdx.x;
  const float* gate = gate_up + t * 2 * ffn;
  const float* up = gate + ffn;
  __nv_bfloat16* out = act + t * ffn;
  const int64_t i = (blockIdx.y * int64_t{blockDim.x} + threadIdx.x) * 4;
  if (i >= ffn) return;
  auto silu_times = [](float g, float u) { return g / (1.0f + expf(-g)) * u; };
  if (ffn % 4 == 0) {
    const float4 g = *reinterpret_cast<const float4*>(gate + i);
    const float4 u = *reinterpret_cast<const float4*>(up + i);
    __nv_bfloat162* pair = reinterpret_cast<__nv_bfloat162*>(out + i);
    pair[0] = __floats2bfloat162_rn(silu_times(g.x, u.x), silu_times(g.y, u.y));
    pair[1] = __floats2bfloat162_rn(silu_times(g.z, u.z), silu_times(g.w, u.w));
    return;
  }
  for (int64_t k = i; k < i + 4 && k < ffn; ++k) {
    out[k] = __float2bfloat16_rn(silu_times(gate[k], up[k]));
  }
}

// 8 warps per block, warp = one output row of w. Lane l reads the 16-byte
// chunks l, l + 32, ... of that row (four in flight per iteration) and the
// same chunks of every x row (tiny, cached), then the warp sums.
template <int kRows>
__global__ void __launch_bounds__(256)
    SmallBatchGemvKernel(const __nv_bfloat16* x, int64_t in,
                         const __nv_bfloat16* w, int64_t out, float* y,
                         int64_t ldy) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t o = blockIdx.x * int64_t{8} + warp;
  if (o >= out) return;  // whole warps only: no shuffle loses a lane
  const uint4* row = reinterpret_cast<const uint4*>(w + o * in);
  const int64_t chunks = in / 8;
  float acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.0f;
  auto accumulate = [&](const uint4& wv, int64_t c) {
    const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&wv);
    float wf[8];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f = __bfloat1622float2(w2[e]);
      wf[2 * e] = f.x;
      wf[2 * e + 1] = f.y;
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + r * in) + c);
      const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&xv);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = __bfloat1622float2(x2[e]);
        acc[r] += wf[2 * e] * f.x + wf[2 * e + 1] * f.y;
      }
    }
  };
  int64_t c = lane;
  for (; c + 3 * kWarp < chunks; c += 4 * kWarp) {
    uint4 wv[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) wv[u] = __ldg(row + c + u * kWarp);
#pragma unroll
    for (int u = 0; u < 4; ++u) accumulate(wv[u], c + u * kWarp);
  }
  for (; c < chunks; c += kWarp) accumulate(__ldg(row + c), c);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float total = WarpSum(acc[r]);
    if (lane == 0) y[r * ldy + o] = total;
  }
}

__global__ void GatherRowsKernel(const float* x, const int32_t* rows,
                                 int hidden, float* out) {
  const int r = blockIdx.x;
  const float* source = x + int64_t{rows[r]} * hidden;
  float* target = out + int64_t{r} * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) target[i] = source[i];
}

__global__ void ArgmaxRowsKernel(const float* logits, int vocab, int32_t* out) {
  __shared__ float best_values[1024];
  __shared__ int best_indices[1024];
  const float* row = logits + int64_t{blockIdx.x} * vocab;
  float best = -INFINITY;
  int best_index = vocab;  // larger than any real index
  for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
    const float v = row[j];
    if (v > best) {  // strictly: the first (lowest) index wins ties
      best = v;
      best_index = j;
    }
  }
  best_values[threadIdx.x] = best;
  best_indices[threadIdx.x] = best_index;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      const float ov = best_values[threadIdx.x + stride];
      const int oi = best_indices[threadIdx.x + stride];
      if (ov > best_values[threadIdx.x] ||
          (ov == best_values[threadIdx.x] && oi < best_indices[threadIdx.x])) {
        best_values[threadIdx.x] = ov;
        best_indices[threadIdx.x] = oi;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = best_indices[0];
}

__global__ void F32ToBf16Kernel(const float* in, int64_t count,
                                __nv_bfloat16* out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = __float2bfloat16_rn(in[i]);
  }
}

int GridFor(int64_t count, int threads) {
  const int64_t blocks = (count + threads - 1) / threads;
  return static_cast<int>(blocks < 65535 * 8 ? (blocks > 0 ? blocks : 1)
                                             : 65535 * 8);
}

int NormThreads(int hidden) {
  int threads = 32;
  while (threads < hidden && threads < 1024) threads *= 2;
  return threads;
}

}  // namespace

absl::Status LaunchEmbed(const uint16_t* embedding, int64_t vocab_begin,
                         int64_t vocab_rows, int hidden, const int32_t* tokens,
                         int num_tokens, float* x, Stream stream) {
  EmbedKernel<<<num_tokens, 256, 0, stream>>>(AsBf16(embedding), vocab_begin,
                                              vocab_rows, hidden, tokens, x);
  return LaunchStatus("embed");
}

absl::Status LaunchRmsNorm(float* x, const float* residual, const float* weight,
                           float eps, int hidden, int num_rows, uint16_t* out,
                           Stream stream, const float* residual_bias) {
  RmsNormKernel<<<num_rows, NormThreads(hidden), 0, stream>>>(
      x, residual, residual_bias, weight, eps, hidden, AsBf16(out));
  return LaunchStatus("rms_norm");
}

absl::Status LaunchAddRowBias(float* x, const float* bias, int rows, int cols,
                              Stream stream) {
  if (rows == 0) return absl::OkStatus();
  AddRowBiasKernel<<<rows, 256, 0, stream>>>(x, bias, cols);
  return LaunchStatus("add_row_bias");
}

absl::Status LaunchAdd(float* x, const float* delta, int64_t count,
                       Stream stream) {
  AddKernel<<<GridFor(count, 256), 256, 0, stream>>>(x, delta, count);
  return LaunchStatus("add");
}

absl::Status LaunchRopeWriteKv(float* qkv, int num_tokens, int q_heads,
                               const int32_t* positions, const int32_t* slots,
                               const float* rope_cos, const float* rope_sin,
                               const KvCacheView& cache, int layer,
                               const QkvExtras& extras, Stream stream) {
  RopeWriteKvKernel<<<num_tokens, 256, 0, stream>>>(
      qkv, q_heads, positions, slots, rope_cos, rope_sin, cache, layer, extras);
  return LaunchStatus("rope_write_kv");
}

absl::Status LaunchPagedAttention(const AttentionArgs& args, Stream stream) {
  const float scale = 1.0f / sqrtf(static_cast<float>(args.cache.head_dim));
  const dim3 grid(
      (args.q_heads + kAttentionWarpsPerBlock - 1) / kAttentionWarpsPerBlock,
      args.num_tokens, args.partitions);
  PagedAttentionKernel<<<grid, kAttentionWarpsPerBlock * kWarp, 0, stream>>>(
      args, scale);
  if (absl::Status status = LaunchStatus("paged_attention"); !status.ok()) {
    return status;
  }
  const int threads = ((args.cache.head_dim + kWarp - 1) / kWarp) * kWarp;
  MergePartitionsKernel<<<dim3(args.q_heads, args.num_tokens), threads, 0,
                          stream>>>(args);
  return LaunchStatus("merge_partitions");
}

absl::Status LaunchSwiGlu(const float* gate_up, int num_tokens, int64_t ffn,
                          uint16_t* act, Stream stream) {
  const dim3 grid(num_tokens, static_cast<unsigned>((ffn + 1023) / 1024));
  SwiGluKernel<<<grid, 256, 0, stream>>>(gate_up, ffn, AsBf16(act));
  return LaunchStatus("swiglu");
}

template <int kRows>
void LaunchGemvRows(const uint16_t* x, int64_t in, const uint16_t* w,
                    int64_t out, float* y, int64_t ldy, Stream stream) {
  SmallBatchGemvKernel<kRows>
      <<<static_cast<unsigned>((out + 7) / 8), 256, 0, stream>>>(
          AsBf16(x), in, AsBf16(w), out, y, ldy);
}

absl::Status LaunchSmallBatchGemv(const uint16_t* x, int rows, int64_t in,
                                  const uint16_t* w, int64_t out, float* y,
                                  int64_t ldy, Stream stream) {
  if (rows < 1 || rows > kSmallBatchRows || in % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("small-batch GEMV takes 1..", kSmallBatchRows,
                     " rows of a multiple of 8 inputs, not ", rows, " x ", in));
  }
  // One instantiation per row count: the kernel reads exactly `rows` rows
  // of x and keeps their sums in registers.
  switch (rows) {
    case 1:
      LaunchGemvRows<1>(x, in, w, out, y, ldy, stream);
      break;
    case 2:
      LaunchGemvRows<2>(x, in, w, out, y, ldy, stream);
      break;
    case 3:
      LaunchGemvRows<3>(x, in, w, out, y, ldy, stream);
      break;
    case 4:
      LaunchGemvRows<4>(x, in, w, out, y, ldy, stream);
      break;
    case 5:
      LaunchGemvRows<5>(x, in, w, out, y, ldy, stream);
      break;
    case 6:
      LaunchGemvRows<6>(x, in, w, out, y, ldy, stream);
      break;
    case 7:
      LaunchGemvRows<7>(x, in, w, out, y, ldy, stream);
      break;
    default:
      LaunchGemvRows<8>(x, in, w, out, y, ldy, stream);
      break;
  }
  return LaunchStatus("small_batch_gemv");
}

absl::Status LaunchGatherRows(const float* x, const int32_t* rows, int num_rows,
                              int hidden, float* out, Stream stream) {
  GatherRowsKernel<<<num_rows, 256, 0, stream>>>(x, rows, hidden, out);
  return LaunchStatus("gather_rows");
}

absl::Status LaunchArgmaxRows(const float* logits, int num_rows, int vocab,
                              int32_t* out, Stream stream) {
  ArgmaxRowsKernel<<<num_rows, 1024, 0, stream>>>(logits, vocab, out);
  return LaunchStatus("argmax_rows");
}

absl::Status LaunchF32ToBf16(const float* in, int64_t count, uint16_t* out,
                             Stream stream) {
  F32ToBf16Kernel<<<GridFor(count, 256), 256, 0, stream>>>(in, count,
                                                           AsBf16(out));
  return LaunchStatus("f32_to_bf16");
}

}  // namespace pdserve::engine::cuda
