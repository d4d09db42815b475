// The online-softmax algebra the CUDA attention kernels use, as host+device
// functions so the CPU tests check the same code the GPU runs.
//
// A "run" summarizes attention over a subset of keys for one query:
//   max = max_j s_j,  sum = Σ_j exp(s_j - max),  acc[d] = Σ_j exp(s_j - max)
//   v_j[d].
// Two runs over disjoint key sets merge exactly (up to rounding) into the run
// over their union; the attention output is acc / sum. Split-K decode
// attention computes one run per context partition and merges them.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define PDS_HOST_DEVICE __host__ __device__
#else
#define PDS_HOST_DEVICE
#endif

namespace pdserve::engine {

// Scale factors that bring runs with maxima `max_a` and `max_b` to their
// common maximum; an empty run (max = -inf) gets factor 0.
struct RunRescale {
  float max;
  float scale_a;
  float scale_b;
};

PDS_HOST_DEVICE inline RunRescale RescaleRuns(float max_a, float max_b) {
  RunRescale r;
  r.max = max_a > max_b ? max_a : max_b;
  if (r.max == -INFINITY) {
    r.scale_a = 0.0f;
    r.scale_b = 0.0f;
    return r;
  }
  r.scale_a = max_a == -INFINITY ? 0.0f : expf(max_a - r.max);
  r.scale_b = max_b == -INFINITY ? 0.0f : expf(max_b - r.max);
  return r;
}

// Folds run b into run a (acc arrays of `dims` floats).
PDS_HOST_DEVICE inline void MergeRunInto(float& max_a, float& sum_a,
                                         float* acc_a, float max_b, float sum_b,
                                         const float* acc_b, int dims) {
  const RunRescale r = RescaleRuns(max_a, max_b);
  for (int d = 0; d < dims; ++d) {
    acc_a[d] = acc_a[d] * r.scale_a + acc_b[d] * r.scale_b;
  }
  sum_a = sum_a * r.scale_a + sum_b * r.scale_b;
  max_a = r.max;
}

// Partitions of `context` keys in pieces of `partition` keys.
PDS_HOST_DEVICE inline int NumPartitions(int context, int partition) {
  return (context + partition - 1) / partition;
}

// ---------------------------------------------------------------------------
// Shapes of the CUDA attention kernels, shared by the host code that plans a
// step (step_plan) and the kernels (engine_cuda/kernels.cu), so the CPU tests
// check the same rules the GPU obeys.
//
// Both kernels give one thread block to one KV head of one work item and
// stack the item's query tokens x the query heads of that KV head's group as
// the rows of one tile ("row" r = token r / group, group member r % group):
// every K/V tile they load from the paged cache serves all of them (GQA).
//
// Decode kernel (decode and speculative-verify steps, CUDA cores): an item
// is a whole sequence; the context splits into `splits` partitions of
// `partition` keys (flash-decoding), each one block, merged by a second
// kernel when splits > 1. Keys stream through shared memory in tiles of
// kDecodeKeyTile (16-byte cp.async loads, double-buffered).
//
// Prefill kernel (chunks, tensor cores, FlashAttention-2 style): an item is
// a tile of up to kPrefillRows rows of one sequence; 4 warps of 16 rows each
// run bf16 mma.sync over key tiles of kPrefillKeyTile with an online softmax
// in registers, the causal mask per row.

// Named slots of the step metadata header (step_plan.h) that kernels read.
enum StepHeader : int {
  kHeaderTokens = 0,
  kHeaderSequences = 1,
  kHeaderLogitRows = 2,
  kHeaderTiles = 3,            // prefill tiles (attention_tiles entries)
  kHeaderDecodePartition = 4,  // keys per decode split (set by the backend)
  kHeaderMaxQueries = 5,       // most query tokens of one sequence
  kHeaderMaxContext = 6,       // longest context of the step
  kHeaderSlots = 8,
};

inline constexpr int kAttentionThreads = 128;
inline constexpr int kDecodeKeyTile = 32;
inline constexpr int kDecodeMaxRows = 32;  // 8 per warp in the score pass
inline constexpr int kDecodeMaxRowsPerThread = 16;  // accumulator rows
inline constexpr int kMaxDecodeSplits = 64;
inline constexpr int kPrefillRows = 64;
inline constexpr int kPrefillKeyTile = 64;
inline constexpr int kPrefillMaxHeadDim = 128;

// The decode kernel's value pass gives each thread one pair of head dims of
// rows r, r + groups, r + 2 groups, ...: this many row groups.
PDS_HOST_DEVICE inline int DecodeRowGroups(int head_dim) {
  const int pairs = head_dim / 2;
  return pairs > 0 && pairs <= kAttentionThreads ? kAttentionThreads / pairs
                                                 : 0;
}

// Whether the decode kernel holds `rows` rows (tokens x group) of head_dim.
PDS_HOST_DEVICE inline bool DecodeKernelFits(int rows, int head_dim) {
  const int groups = DecodeRowGroups(head_dim);
  return head_dim % 8 == 0 && groups > 0 && rows >= 1 &&
         rows <= kDecodeMaxRows &&
         (rows + groups - 1) / groups <= kDecodeMaxRowsPerThread;
}

// Whether the prefill kernel handles head_dim (padded to a multiple of 16 in
// its tiles; 16-byte loads need multiples of 8) and this GQA group.
PDS_HOST_DEVICE inline bool PrefillKernelFits(int head_dim, int group) {
  return head_dim % 8 == 0 && head_dim >= 8 && head_dim <= kPrefillMaxHeadDim &&
         group >= 1 && group <= kPrefillRows;
}

// Query tokens of one sequence that one prefill tile holds.
PDS_HOST_DEVICE inline int PrefillTokensPerTile(int group) {
  return group >= 1 && group <= kPrefillRows ? kPrefillRows / group : 1;
}

// The head dim the prefill kernel's tiles use: the next of 16/32/64/128.
PDS_HOST_DEVICE inline int PrefillPaddedHeadDim(int head_dim) {
  int padded = 16;
  while (padded < head_dim) padded *= 2;
  return padded;
}

// Dynamic shared memory of one decode block: the rows' scaled queries (f32),
// two stages of K and V tiles (bf16, rows padded by 8 elements so 16-byte
// lanes of a warp hit distinct banks), and per-row probabilities and
// rescale factors.
PDS_HOST_DEVICE inline int DecodeSharedBytes(int rows, int head_dim) {
  return rows * head_dim * 4 + 2 * 2 * kDecodeKeyTile * (head_dim + 8) * 2 +
         rows * kDecodeKeyTile * 4 + rows * 3 * 4;
}

}  // namespace pdserve::engine
