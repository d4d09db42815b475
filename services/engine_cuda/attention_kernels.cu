// The CUDA backend's attention kernels for decode/verify steps
// (flash-decoding on CUDA cores) and prefill chunks (FlashAttention-2 tiles
// on tensor cores), both over the paged bf16 KV cache through the block
// table. Shapes and limits live in engine/attention_math.h, where the CPU
// tests check them; step_plan.cc chooses the kernel and fills the work items.
//
// Both stack an item's query tokens x the query heads of one KV head's group
// as the rows of a tile, so each K/V tile read from the cache serves the
// whole group (GQA) and every token of a verify step or prefill chunk.
//
// Softmax runs in base 2: queries (decode) or scores (prefill) are scaled by
// log2(e) / sqrt(head_dim), so exp2f replaces expf and the maxima m of the
// partial runs are in log2 units.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "engine/attention_math.h"
#include "engine_cuda/device_common.cuh"
#include "engine_cuda/kernels.h"

namespace pdserve::engine::cuda {
namespace {

using device::kFullMask;
using device::kWarp;
using device::LaunchStatus;
using device::WarpMax;
using device::WarpSum;

constexpr int kWarps = kAttentionThreads / kWarp;
constexpr float kLog2e = 1.4426950408889634f;
static_assert(kDecodeKeyTile == kWarp, "decode scores: one key per lane");
static_assert(kPrefillRows == 16 * kWarps, "prefill: 16 rows per warp");

// 16-byte asynchronous copy global -> shared; `valid` false writes zeros and
// reads nothing (src-size 0).
__device__ __forceinline__ void CpAsync16(void* shared, const void* global,
                                          bool valid) {
  const uint32_t target =
      static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(target),
               "l"(global), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most `kPending` committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ uint32_t PackBf16(float low, float high) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// Four 8x8 b16 matrices from shared memory; lane l gives the address of row
// l % 8 of matrix l / 8.
__device__ __forceinline__ void LdMatrixX4(const void* shared, uint32_t& r0,
                                           uint32_t& r1, uint32_t& r2,
                                           uint32_t& r3) {
  const uint32_t address =
      static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(address)
               : "memory");
}

// The same, each matrix transposed.
__device__ __forceinline__ void LdMatrixX4Trans(const void* shared,
                                                uint32_t& r0, uint32_t& r1,
                                                uint32_t& r2, uint32_t& r3) {
  const uint32_t address =
      static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
      : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
      : "r"(address)
      : "memory");
}

// d += a (16x16 bf16, row) * b (16x8 bf16, col), f32 accumulators.
__device__ __forceinline__ void Mma16816(float (&d)[4], const uint32_t (&a)[4],
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The query head (this rank's index) of group member g of pool KV head kvl,
// or -1 when this rank does not hold it (KV heads replicated under TP).
__device__ __forceinline__ int LocalQueryHead(const AttentionArgs& a, int kvl,
                                              int g) {
  const int h = (kvl + a.kv_head_offset) * a.group + g - a.q_head_offset;
  return h >= 0 && h < a.q_heads ? h : -1;
}

// The first key position a query at `position` sees (the CPU engine's
// window: keys p with position - p < window; 0 without a window).
__device__ __forceinline__ int FirstVisibleKey(int position, int window) {
  return window > 0 ? max(0, position + 1 - window) : 0;
}

// The first key any of an item's tokens [first, first + num_tokens) sees:
// tiles and splits before it hold no visible key for the whole block. Every
// thread computes the same value (a step's item has at most a few dozen
// tokens).
__device__ __forceinline__ int ItemFirstVisibleKey(const AttentionArgs& a,
                                                   int first, int num_tokens) {
  if (a.window <= 0) return 0;
  int lowest = a.positions[first];
  for (int i = 1; i < num_tokens; ++i) {
    lowest = min(lowest, a.positions[first + i]);
  }
  return FirstVisibleKey(lowest, a.window);
}

// Keys [0, context) of one pool KV head of one layer, through a sequence's
// block-table row.
struct PagedKeys {
  const __nv_bfloat16* layer_head;  // block 0's rows of this layer and head
  const int32_t* table;
  int block_size;
  int block_shift;  // log2(block_size) when a power of two, else -1
  int head_dim;
  int64_t block_stride;
  int64_t kv_stride;

  __device__ PagedKeys(const AttentionArgs& a, int sequence, int kvl) {
    const KvCacheView& c = a.cache;
    layer_head = reinterpret_cast<const __nv_bfloat16*>(c.base) +
                 int64_t{a.layer} * c.layer_stride() +
                 int64_t{kvl} * c.head_stride();
    table = a.block_tables + int64_t{sequence} * a.max_blocks_per_sequence;
    block_size = c.block_size;
    block_shift =
        (block_size & (block_size - 1)) == 0 ? __ffs(block_size) - 1 : -1;
    head_dim = c.head_dim;
    block_stride = c.block_stride();
    kv_stride = c.kv_stride();
  }
  // Key k's row (V's is kv_stride further). Shifts instead of a division
  // for the usual power-of-two block sizes: this runs once per 16 bytes.
  __device__ const __nv_bfloat16* Key(int k) const {
    const int block = block_shift >= 0 ? k >> block_shift : k / block_size;
    const int slot = block_shift >= 0 ? k & (block_size - 1) : k % block_size;
    return layer_head + int64_t{table[block]} * block_stride +
           int64_t{slot} * head_dim;
  }
};

// ---------------------------------------------------------------------------
// Decode: block (split, KV head, sequence item). Rows r = token r / group,
// member r % group. Score pass: warp w owns rows w, w + 4, ...; lane l scores
// key tile + l. Value pass: thread t owns head dims 2 (t % pairs) + {0, 1} of
// rows t / pairs + groups j.
//
// Instantiated per row capacity (4, 8, 16, 32) and head-dim class, so the
// per-key loops run over the rows a step has instead of the largest case
// (a batch-1 decode of a GQA-4 model has 4 rows: 1 per warp, 2 per value
// thread).
template <int kMaxRows, bool kWideHead>
__global__ void __launch_bounds__(kAttentionThreads)
    DecodeAttentionKernel(AttentionArgs a, float scale_log2, int rows_cap) {
  // Score-pass rows per warp (rows warp, warp + 4, ...), and value-pass rows
  // per thread: head_dim <= 128 gives at least 2 row groups.
  constexpr int kDecodeRowsPerWarp = (kMaxRows + kWarps - 1) / kWarps;
  // (DecodeKernelFits keeps head_dim > 128 at 16 rows.)
  constexpr int kRowsPerThreadWanted =
      kWideHead ? kMaxRows : (kMaxRows + 1) / 2;
  constexpr int kRowsPerThread = kRowsPerThreadWanted < kDecodeMaxRowsPerThread
                                     ? kRowsPerThreadWanted
                                     : kDecodeMaxRowsPerThread;
  static_assert(kRowsPerThread <= kDecodeMaxRowsPerThread);
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  const int hd = a.cache.head_dim;
  const int stride = hd + 8;
  float* q_s = reinterpret_cast<float*>(shared_bytes);
  __nv_bfloat16* kv_s = reinterpret_cast<__nv_bfloat16*>(q_s + rows_cap * hd);
  float* p_s = reinterpret_cast<float*>(kv_s + 2 * 2 * kDecodeKeyTile * stride);
  float* corr_s = p_s + rows_cap * kDecodeKeyTile;
  float* m_s = corr_s + rows_cap;
  float* l_s = m_s + rows_cap;

  const int32_t* item = a.items + 4 * blockIdx.z;
  const int sequence = item[0], first = item[1], num_tokens = item[2];
  const int context = item[3];
  const int kvl = blockIdx.y;
  const int split = blockIdx.x, splits = gridDim.x;
  int key_begin = 0, key_end = context;
  if (splits > 1) {
    const int partition = a.header[kHeaderDecodePartition];
    key_begin = split * partition;
    key_end = min(context, key_begin + partition);
  }
  // A sliding window: keys before every token's window are never read. A
  // split wholly before it writes no partials; the merge starts each token
  // at the split holding its own first visible key.
  key_begin = max(key_begin, ItemFirstVisibleKey(a, first, num_tokens));
  if (key_begin >= key_end) return;  // the whole block: no barrier skipped

  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  const int group = a.group;
  const int rows = num_tokens * group;
  const int64_t qkv_row = int64_t{a.q_heads + 2 * a.cache.num_kv_heads} * hd;
  for (int i = tid; i < rows * hd; i += kAttentionThreads) {
    const int r = i / hd, d = i % hd;
    const int h = LocalQueryHead(a, kvl, r % group);
    const int64_t t = first + r / group;
    q_s[i] =
        h >= 0 ? a.qkv[t * qkv_row + int64_t{h} * hd + d] * scale_log2 : 0.0f;
  }

  float m[kDecodeRowsPerWarp], l[kDecodeRowsPerWarp];
  int position[kDecodeRowsPerWarp];
  int lowest_key[kDecodeRowsPerWarp];  // the row's first visible key
#pragma unroll
  for (int j = 0; j < kDecodeRowsPerWarp; ++j) {
    const int r = warp + kWarps * j;
    position[j] = r < rows ? a.positions[first + r / group] : -1;
    lowest_key[j] = FirstVisibleKey(position[j], a.window);
    m[j] = -INFINITY;
    l[j] = 0.0f;
  }
  const int pairs = hd / 2;
  const int row_groups = DecodeRowGroups(hd);
  const int pair = tid % pairs, row_group = tid / pairs;
  const bool values_active = row_group < row_groups;
  float acc[kRowsPerThread][2];
#pragma unroll
  for (int j = 0; j < kRowsPerThread; ++j) {
    acc[j][0] = 0.0f;
    acc[j][1] = 0.0f;
  }

  const PagedKeys keys(a, sequence, kvl);
  const int chunks = hd / 8;  // 16-byte pieces of a row
  const int chunk_shift = (chunks & (chunks - 1)) == 0 ? __ffs(chunks) - 1 : -1;
  auto load_tile = [&](int tile_begin, int stage) {
    __nv_bfloat16* k_tile = kv_s + stage * 2 * kDecodeKeyTile * stride;
    __nv_bfloat16* v_tile = k_tile + kDecodeKeyTile * stride;
    for (int i = tid; i < kDecodeKeyTile * chunks; i += kAttentionThreads) {
      const int kk = chunk_shift >= 0 ? i >> chunk_shift : i / chunks;
      const int c = i - kk * chunks;
      const int k = tile_begin + kk;
      const bool valid = k < key_end;
      const __nv_bfloat16* key = valid ? keys.Key(k) + 8 * c : keys.layer_head;
      CpAsync16(k_tile + kk * stride + 8 * c, key, valid);
      CpAsync16(v_tile + kk * stride + 8 * c,
                valid ? key + keys.kv_stride : keys.layer_head, valid);
    }
    CpAsyncCommit();
  };

  load_tile(key_begin, 0);
  int stage = 0;
  for (int tile = key_begin; tile < key_end;
       tile += kDecodeKeyTile, stage ^= 1) {
    if (tile + kDecodeKeyTile < key_end) {
      load_tile(tile + kDecodeKeyTile, stage ^ 1);
      CpAsyncWait<1>();
    } else {
      CpAsyncWait<0>();
    }
    __syncthreads();  // this stage's tile (and, at first, q_s) is visible
    const __nv_bfloat16* k_tile = kv_s + stage * 2 * kDecodeKeyTile * stride;
    const __nv_bfloat16* v_tile = k_tile + kDecodeKeyTile * stride;

    // Scores: lane = key, for each of this warp's rows.
    const int key = tile + lane;
    float dot[kDecodeRowsPerWarp];
#pragma unroll
    for (int j = 0; j < kDecodeRowsPerWarp; ++j) dot[j] = 0.0f;
    for (int c = 0; c < chunks; ++c) {
      const uint4 raw =
          *reinterpret_cast<const uint4*>(k_tile + lane * stride + 8 * c);
      const __nv_bfloat162* k2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
      float kf[8];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = __bfloat1622float2(k2[e]);
        kf[2 * e] = f.x;
        kf[2 * e + 1] = f.y;
      }
#pragma unroll
      for (int j = 0; j < kDecodeRowsPerWarp; ++j) {
        const int r = warp + kWarps * j;
        if (r < rows) {
          const float4 qa =
              *reinterpret_cast<const float4*>(q_s + r * hd + 8 * c);
          const float4 qb =
              *reinterpret_cast<const float4*>(q_s + r * hd + 8 * c + 4);
          dot[j] += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3] +
                    qb.x * kf[4] + qb.y * kf[5] + qb.z * kf[6] + qb.w * kf[7];
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kDecodeRowsPerWarp; ++j) {
      const int r = warp + kWarps * j;
      if (r < rows) {  // uniform across the warp
        const float s =
            key < key_end && key <= position[j] && key >= lowest_key[j]
                ? dot[j]
                : -INFINITY;
        const float new_max = fmaxf(m[j], WarpMax(s));
        const float base = new_max == -INFINITY ? 0.0f : new_max;
        const float p = exp2f(s - base);
        const float correction = exp2f(m[j] - base);
        l[j] = l[j] * correction + WarpSum(p);
        m[j] = new_max;
        p_s[r * kDecodeKeyTile + lane] = p;
        if (lane == 0) corr_s[r] = correction;
      }
    }
    __syncthreads();  // p_s, corr_s

    if (values_active) {
      const int valid_keys = min(kDecodeKeyTile, key_end - tile);
#pragma unroll
      for (int j = 0; j < kRowsPerThread; ++j) {
        const int r = row_group + row_groups * j;
        if (r < rows) {
          const float c = corr_s[r];
          acc[j][0] *= c;
          acc[j][1] *= c;
        }
      }
      for (int kk = 0; kk < valid_keys; ++kk) {
        const float2 v =
            __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(
                v_tile + kk * stride + 2 * pair));
#pragma unroll
        for (int j = 0; j < kRowsPerThread; ++j) {
          const int r = row_group + row_groups * j;
          if (r < rows) {
            const float p = p_s[r * kDecodeKeyTile + kk];
            acc[j][0] += p * v.x;
            acc[j][1] += p * v.y;
          }
        }
      }
    }
    __syncthreads();  // the stage is free for the load after next
  }

#pragma unroll
  for (int j = 0; j < kDecodeRowsPerWarp; ++j) {
    const int r = warp + kWarps * j;
    if (r < rows && lane == 0) {
      m_s[r] = m[j];
      l_s[r] = l[j];
    }
  }
  __syncthreads();
  if (!values_active) return;
  const int d = 2 * pair;
#pragma unroll
  for (int j = 0; j < kRowsPerThread; ++j) {
    const int r = row_group + row_groups * j;
    if (r >= rows) continue;
    const int h = LocalQueryHead(a, kvl, r % group);
    if (h < 0) continue;
    const int64_t t = first + r / group;
    if (splits == 1) {
      const float inverse = 1.0f / l_s[r];
      *reinterpret_cast<__nv_bfloat162*>(
          a.out + (t * a.q_heads + h) * int64_t{hd} + d) =
          __floats2bfloat162_rn(acc[j][0] * inverse, acc[j][1] * inverse);
    } else {
      float* partial =
          a.partials + ((t * a.q_heads + h) * splits + split) * int64_t{hd + 2};
      if (pair == 0) {
        partial[0] = m_s[r];
        partial[1] = l_s[r];
      }
      partial[2 + d] = acc[j][0];
      partial[3 + d] = acc[j][1];
    }
  }
}

// Block (query head, token) of kAttentionThreads threads: thread p reads
// split p's maximum and sum (all splits at once, not one load after another
// per output dim), then each thread merges its output dims over the splits
// with the weights in shared memory. Only the splits that saw a key of this
// token count (log2-unit maxima).
__global__ void __launch_bounds__(kAttentionThreads)
    MergeDecodeSplitsKernel(AttentionArgs a, int splits) {
  static_assert(kMaxDecodeSplits <= kAttentionThreads);
  __shared__ float weight_s[kMaxDecodeSplits];
  __shared__ float warp_s[kWarps];
  const int h = blockIdx.x;
  const int64_t t = blockIdx.y;
  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  const int hd = a.cache.head_dim;
  const int partition = a.header[kHeaderDecodePartition];
  const int used = min(splits, NumPartitions(a.positions[t] + 1, partition));
  // Splits before the token's window wrote nothing (the decode kernel skips
  // them): they start at the one holding its first visible key.
  const int first_used = FirstVisibleKey(a.positions[t], a.window) / partition;
  const float* partial = a.partials + (t * a.q_heads + h) * splits * (hd + 2);
  const bool live = tid >= first_used && tid < used;
  const float m = live ? partial[tid * (hd + 2)] : -INFINITY;
  const float l = live ? partial[tid * (hd + 2) + 1] : 0.0f;
  float block_max = WarpMax(m);
  if (lane == 0) warp_s[warp] = block_max;
  __syncthreads();
  block_max = warp_s[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) block_max = fmaxf(block_max, warp_s[w]);
  const float weight = m == -INFINITY ? 0.0f : exp2f(m - block_max);
  if (tid < kMaxDecodeSplits) weight_s[tid] = weight;
  __syncthreads();  // every thread has read warp_s
  float denominator = WarpSum(weight * l);
  if (lane == 0) warp_s[warp] = denominator;
  __syncthreads();
  denominator = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) denominator += warp_s[w];
  const float inverse = 1.0f / denominator;
  for (int d = tid; d < hd; d += kAttentionThreads) {
    float numerator = 0.0f;
#pragma unroll 8
    for (int p = first_used; p < used; ++p) {
      numerator += weight_s[p] * partial[p * (hd + 2) + 2 + d];
    }
    a.out[(t * a.q_heads + h) * hd + d] =
        __bfloat16_as_ushort(__float2bfloat16_rn(numerator * inverse));
  }
}

// ---------------------------------------------------------------------------
// Prefill: block (tile, KV head), 4 warps x 16 rows. mma.sync m16n8k16
// fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16"): lane = 4 gid +
// tig; A holds rows gid and gid + 8, columns 2 tig + {0, 1} and + 8; B
// columns (n) gid, rows (k) 2 tig + {0, 1} and + 8; C rows gid and gid + 8,
// columns 2 tig + {0, 1}. S = Q K^T takes B from K rows (ldmatrix), O += P V
// takes A from S's accumulators as they lie (two 8-key n-tiles = one 16-key
// k-step) and B from V through ldmatrix.trans.
template <int kHeadDim>  // padded head dim: 16, 32, 64 or 128
__global__ void __launch_bounds__(kAttentionThreads, 3)
    PrefillAttentionKernel(AttentionArgs a, float scale_log2) {
  constexpr int kStride = kHeadDim + 8;           // bf16; rows 16-byte aligned
  constexpr int kKeyTiles = kPrefillKeyTile / 8;  // n-tiles of S
  constexpr int kDimTiles = kHeadDim / 8;         // n-tiles of O
  constexpr int kSteps = kHeadDim / 16;           // k-steps of Q K^T
  constexpr int kChunks = kHeadDim / 8;           // 16-byte pieces of a row
  __shared__ __align__(16) __nv_bfloat16 k_s[kPrefillKeyTile * kStride];
  __shared__ __align__(16) __nv_bfloat16 v_s[kPrefillKeyTile * kStride];

  const int32_t* item = a.items + 4 * blockIdx.x;
  const int sequence = item[0], first = item[1], num_tokens = item[2];
  const int context = item[3];
  const int kvl = blockIdx.y;
  const int hd = a.cache.head_dim;
  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  const int gid = lane / 4, tig = lane % 4;
  const int group = a.group;
  const int64_t qkv_row = int64_t{a.q_heads + 2 * a.cache.num_kv_heads} * hd;

  // This thread's rows gid and gid + 8 of the warp's 16.
  int position[2];
  int64_t out_at[2];
  uint32_t q[kSteps][4];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = 16 * warp + gid + 8 * i;
    const int token = r / group;
    const int h = LocalQueryHead(a, kvl, r % group);
    const bool valid = token < num_tokens && h >= 0;
    const int64_t t = first + token;
    position[i] = valid ? a.positions[t] : -1;
    out_at[i] = valid ? (t * a.q_heads + h) * hd : -1;
    const float* q_row = a.qkv + (valid ? t * qkv_row + int64_t{h} * hd : 0);
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int d = 16 * ks + 8 * half + 2 * tig;
        const float x = valid && d < hd ? q_row[d] : 0.0f;
        const float y = valid && d + 1 < hd ? q_row[d + 1] : 0.0f;
        q[ks][2 * half + i] = PackBf16(x, y);
      }
    }
  }

  const PagedKeys keys(a, sequence, kvl);
  auto load = [&](__nv_bfloat16* target, int tile, int64_t offset) {
    for (int i = tid; i < kPrefillKeyTile * kChunks; i += kAttentionThreads) {
      const int kk = i / kChunks, c = i % kChunks;
      const int k = tile * kPrefillKeyTile + kk;
      const bool valid = k < context && 8 * c < hd;
      const __nv_bfloat16* source =
          valid ? keys.Key(k) + offset + 8 * c : keys.layer_head;
      CpAsync16(target + kk * kStride + 8 * c, source, valid);
    }
    CpAsyncCommit();
  };

  float o[kDimTiles][4];
#pragma unroll
  for (int n = 0; n < kDimTiles; ++n) {
    o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  }
  float run_max[2] = {-INFINITY, -INFINITY}, run_sum[2] = {0.0f, 0.0f};
  const int key_tiles = (context + kPrefillKeyTile - 1) / kPrefillKeyTile;
  // With a sliding window, key tiles before every row's window are skipped.
  const int first_tile =
      ItemFirstVisibleKey(a, first, num_tokens) / kPrefillKeyTile;
  int lowest_key[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    lowest_key[i] = FirstVisibleKey(position[i], a.window);
  }
  load(k_s, first_tile, 0);
  for (int kt = first_tile; kt < key_tiles; ++kt) {
    load(v_s, kt, keys.kv_stride);
    CpAsyncWait<1>();  // K tile kt (V tile kt may still be in flight)
    __syncthreads();
    float s[kKeyTiles][4];
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
    }
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks) {
#pragma unroll
      for (int np = 0; np < kKeyTiles / 2; ++np) {
        // Matrices: keys 16np + {0..7, 0..7, 8..15, 8..15} x dims 16ks +
        // {0..7, 8..15, 0..7, 8..15} = (b0, b1) of n-tiles 2np and 2np + 1.
        const int row = 16 * np + (lane / 16) * 8 + lane % 8;
        const int col = 16 * ks + ((lane / 8) % 2) * 8;
        uint32_t b0, b1, b2, b3;
        LdMatrixX4(k_s + row * kStride + col, b0, b1, b2, b3);
        Mma16816(s[2 * np], q[ks], b0, b1);
        Mma16816(s[2 * np + 1], q[ks], b2, b3);
      }
    }
    __syncthreads();  // every warp is done with k_s
    if (kt + 1 < key_tiles) load(k_s, kt + 1, 0);

    // Causal mask and online softmax (each row's 4 lanes share its max).
    // Tiles wholly at or before both of this thread's positions (most of a
    // long prompt's), and inside both rows' windows, need no mask.
    const int key0 = kt * kPrefillKeyTile + 2 * tig;
    const bool unmasked =
        (kt + 1) * kPrefillKeyTile - 1 <= min(position[0], position[1]) &&
        kt * kPrefillKeyTile >= max(lowest_key[0], lowest_key[1]);
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + 8 * n + (e & 1);
        const bool visible = key <= position[e / 2] && key >= lowest_key[e / 2];
        const float v = unmasked || visible ? s[n][e] * scale_log2 : -INFINITY;
        s[n][e] = v;
        tile_max[e / 2] = fmaxf(tile_max[e / 2], v);
      }
    }
    float base[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      tile_max[i] =
          fmaxf(tile_max[i], __shfl_xor_sync(kFullMask, tile_max[i], 1));
      tile_max[i] =
          fmaxf(tile_max[i], __shfl_xor_sync(kFullMask, tile_max[i], 2));
      const float new_max = fmaxf(run_max[i], tile_max[i]);
      base[i] = new_max == -INFINITY ? 0.0f : new_max;
      const float correction = exp2f(run_max[i] - base[i]);
      run_max[i] = new_max;
      run_sum[i] *= correction;
#pragma unroll
      for (int n = 0; n < kDimTiles; ++n) {
        o[n][2 * i] *= correction;
        o[n][2 * i + 1] *= correction;
      }
    }
    uint32_t p[kKeyTiles / 2][4];
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n) {
      float pv[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        // The sum takes the bf16 value the P V product multiplies.
        pv[e] =
            __bfloat162float(__float2bfloat16_rn(exp2f(s[n][e] - base[e / 2])));
        run_sum[e / 2] += pv[e];
      }
      p[n / 2][2 * (n % 2)] = PackBf16(pv[0], pv[1]);
      p[n / 2][2 * (n % 2) + 1] = PackBf16(pv[2], pv[3]);
    }

    if (kt + 1 < key_tiles) {
      CpAsyncWait<1>();  // V tile kt (K tile kt + 1 may still be in flight)
    } else {
      CpAsyncWait<0>();
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kKeyTiles / 2; ++kk) {
#pragma unroll
      for (int dp = 0; dp < kDimTiles / 2; ++dp) {
        // Matrices: keys 16kk + {0..7, 8..15, 0..7, 8..15} x dims 16dp +
        // {0..7, 0..7, 8..15, 8..15}, transposed = (b0, b1) of dim n-tiles
        // 2dp and 2dp + 1.
        const int row = 16 * kk + ((lane / 8) % 2) * 8 + lane % 8;
        const int col = 16 * dp + (lane / 16) * 8;
        uint32_t b0, b1, b2, b3;
        LdMatrixX4Trans(v_s + row * kStride + col, b0, b1, b2, b3);
        Mma16816(o[2 * dp], p[kk], b0, b1);
        Mma16816(o[2 * dp + 1], p[kk], b2, b3);
      }
    }
    __syncthreads();  // every warp is done with v_s
  }

  float inverse[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float sum = run_sum[i];
    sum += __shfl_xor_sync(kFullMask, sum, 1);
    sum += __shfl_xor_sync(kFullMask, sum, 2);
    inverse[i] = 1.0f / sum;
  }
  __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(a.out);
#pragma unroll
  for (int n = 0; n < kDimTiles; ++n) {
    const int d = 8 * n + 2 * tig;
    if (d >= hd) continue;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (out_at[i] < 0) continue;
      *reinterpret_cast<__nv_bfloat162*>(out + out_at[i] + d) =
          __floats2bfloat162_rn(o[n][2 * i] * inverse[i],
                                o[n][2 * i + 1] * inverse[i]);
    }
  }
}

template <int kMaxRows, bool kWideHead>
cudaError_t AllowDecodeSharedMemory() {
  return cudaFuncSetAttribute(DecodeAttentionKernel<kMaxRows, kWideHead>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              DecodeSharedBytes(kMaxRows, 256));
}

template <int kMaxRows, bool kWideHead>
void LaunchDecode(const AttentionArgs& args, dim3 grid, int rows,
                  float scale_log2, Stream stream) {
  DecodeAttentionKernel<kMaxRows, kWideHead>
      <<<grid, kAttentionThreads, DecodeSharedBytes(rows, args.cache.head_dim),
         stream>>>(args, scale_log2, rows);
}

// The smallest instantiation that holds `rows`.
template <bool kWideHead>
void LaunchDecodeForRows(const AttentionArgs& args, dim3 grid, int rows,
                         float scale_log2, Stream stream) {
  if (rows <= 4) {
    LaunchDecode<4, kWideHead>(args, grid, rows, scale_log2, stream);
  } else if (rows <= 8) {
    LaunchDecode<8, kWideHead>(args, grid, rows, scale_log2, stream);
  } else if (rows <= 16) {
    LaunchDecode<16, kWideHead>(args, grid, rows, scale_log2, stream);
  } else {
    LaunchDecode<32, kWideHead>(args, grid, rows, scale_log2, stream);
  }
}

template <int kHeadDim>
absl::Status LaunchPrefill(const AttentionArgs& args, int num_tiles,
                           float scale_log2, Stream stream) {
  const dim3 grid(num_tiles, args.cache.num_kv_heads);
  PrefillAttentionKernel<kHeadDim>
      <<<grid, kAttentionThreads, 0, stream>>>(args, scale_log2);
  return LaunchStatus("prefill_attention");
}

}  // namespace

absl::Status ConfigureAttentionKernels() {
  for (const cudaError_t error :
       {AllowDecodeSharedMemory<4, false>(),
        AllowDecodeSharedMemory<8, false>(),
        AllowDecodeSharedMemory<16, false>(),
        AllowDecodeSharedMemory<32, false>(),
        AllowDecodeSharedMemory<4, true>(), AllowDecodeSharedMemory<8, true>(),
        AllowDecodeSharedMemory<16, true>(),
        AllowDecodeSharedMemory<32, true>()}) {
    if (error != cudaSuccess) {
      return absl::InternalError(absl::StrCat(
          "decode attention shared memory: ", cudaGetErrorString(error)));
    }
  }
  return absl::OkStatus();
}

absl::Status LaunchDecodeAttention(const AttentionArgs& args, int num_items,
                                   int rows, int splits, Stream stream) {
  const int hd = args.cache.head_dim;
  if (!DecodeKernelFits(rows, hd) || splits < 1 || splits > kMaxDecodeSplits) {
    return absl::InvalidArgumentError(
        absl::StrCat("decode attention does not hold ", rows,
                     " rows of head_dim ", hd, " in ", splits, " splits"));
  }
  if (num_items == 0) return absl::OkStatus();
  const float scale_log2 = kLog2e / sqrtf(static_cast<float>(hd));
  const dim3 grid(splits, args.cache.num_kv_heads, num_items);
  if (hd > 128) {
    LaunchDecodeForRows<true>(args, grid, rows, scale_log2, stream);
  } else {
    LaunchDecodeForRows<false>(args, grid, rows, scale_log2, stream);
  }
  if (absl::Status status = LaunchStatus("decode_attention"); !status.ok()) {
    return status;
  }
  if (splits == 1) return absl::OkStatus();
  MergeDecodeSplitsKernel<<<dim3(args.q_heads, args.num_tokens),
                            kAttentionThreads, 0, stream>>>(args, splits);
  return LaunchStatus("merge_decode_splits");
}

absl::Status LaunchPrefillAttention(const AttentionArgs& args, int num_tiles,
                                    Stream stream) {
  const int hd = args.cache.head_dim;
  if (!PrefillKernelFits(hd, args.group)) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill attention does not hold head_dim ", hd,
                     ", group ", args.group));
  }
  if (num_tiles == 0) return absl::OkStatus();
  const float scale_log2 = kLog2e / sqrtf(static_cast<float>(hd));
  switch (PrefillPaddedHeadDim(hd)) {
    case 16:
      return LaunchPrefill<16>(args, num_tiles, scale_log2, stream);
    case 32:
      return LaunchPrefill<32>(args, num_tiles, scale_log2, stream);
    case 64:
      return LaunchPrefill<64>(args, num_tiles, scale_log2, stream);
    default:
      return LaunchPrefill<128>(args, num_tiles, scale_log2, stream);
  }
}

}  // namespace pdserve::engine::cuda
