// Host side of a CUDA step: which CUDA Graph (if any) a batch can replay, and
// the per-step metadata (token ids, positions, KV slots, block tables, logit
// rows) packed into one int32 buffer with a fixed layout. The backend uploads
// that buffer with one copy into fixed-address device memory before a graph
// replay or an eager launch, so captured kernels read every per-step quantity
// from the same addresses on each replay.
//
// Pure C++: unit-tested on the CPU machine; the kernels that read the buffer
// are in services/engine_cuda.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "engine/attention_math.h"  // StepHeader
#include "engine/engine_types.h"

namespace pdserve::engine {

// Batch sizes graphs are captured for: 1, 2, 4, ... below max_batch, then
// max_batch itself. Empty when max_batch < 1.
std::vector<int> GraphBatchBuckets(int max_batch);

// The smallest bucket >= batch, or nullopt when batch exceeds every bucket.
std::optional<int> BucketFor(int batch, std::span<const int> buckets);

// One captured graph: `batch` sequences (a bucket; real ones first, the rest
// padding), each with `tokens_per_sequence` query tokens that all need logits
// (1 = a decode step, γ+1 = a speculative verify).
struct GraphShape {
  int batch = 0;
  int tokens_per_sequence = 0;
  bool operator==(const GraphShape&) const = default;
};

// The graph a step can replay, or nullopt when it must run eager: graphs off,
// an engine that does not hold every layer, more than
// max_graph_tokens_per_sequence tokens, a sequence that does not want logits
// at every query index, more sequences than the largest bucket, or mixed
// query counts whose padding to the largest would exceed
// CudaOptions::max_ragged_graph_tokens and twice the real tokens.
std::optional<GraphShape> GraphShapeFor(const ForwardBatch& batch,
                                        const CudaOptions& options,
                                        bool holds_all_layers,
                                        std::span<const int> buckets);

// One unit of attention work (packed as 4 int32 in the step metadata): a
// run of query tokens of one sequence, consecutive in the step and in
// position. The decode kernel takes a whole sequence per item, the prefill
// kernel a tile of PrefillTokensPerTile(group) tokens.
struct AttentionItem {
  int32_t sequence = 0;     // block-table row
  int32_t first_token = 0;  // index of its first query token in the step
  int32_t num_tokens = 0;
  int32_t context = 0;  // keys its last query sees (its position + 1)
};
static_assert(sizeof(AttentionItem) == 16);

// Where each array lives in the packed int32 buffer, sized for the largest
// step (capacity), so offsets never move.
struct StepMetadataLayout {
  int max_tokens = 0;
  int max_sequences = 0;
  int max_blocks_per_sequence = 0;
  int tokens_per_tile = 0;  // prefill attention tile (PrefillTokensPerTile)
  int max_tiles = 0;

  // Offsets in int32 elements.
  int64_t header = 0;           // kHeaderSlots values (StepHeader)
  int64_t tokens = 0;           // [max_tokens] token ids (0 when hidden_in)
  int64_t positions = 0;        // [max_tokens] position of each query token
  int64_t slots = 0;            // [max_tokens] block * block_size + slot; -1:
                                // padding, write no KV
  int64_t token_sequence = 0;   // [max_tokens] sequence (block-table row)
  int64_t block_tables = 0;     // [max_sequences][max_blocks_per_sequence]
  int64_t logit_rows = 0;       // [max_tokens] token index of each logit row
  int64_t sequence_items = 0;   // [max_sequences] AttentionItem, one per
                                // sequence (the decode kernel's items)
  int64_t attention_tiles = 0;  // [max_tiles] AttentionItem, the prefill
                                // kernel's tiles, longest context first
  int64_t total = 0;            // int32 elements in all

  // tokens_per_tile: query tokens per prefill attention tile (a sequence of
  // n tokens takes ceil(n / tokens_per_tile) of them).
  static StepMetadataLayout For(int max_tokens, int max_sequences,
                                int max_blocks_per_sequence,
                                int tokens_per_tile = 64);
};

// What FillStepMetadata produced.
struct StepCounts {
  int num_tokens = 0;       // incl. padding
  int num_sequences = 0;    // incl. padding
  int num_logit_rows = 0;   // incl. padding rows
  int real_logit_rows = 0;  // the caller's rows (a prefix of the logit rows)
  int num_tiles = 0;        // prefill attention tiles
  int max_queries = 0;      // most query tokens of one sequence (padded)
  int max_context = 0;      // longest context (last position + 1)
};

// Packs `batch` (already validated) into `out` (layout.total elements).
// With `graph`, pads to graph->batch sequences of graph->tokens_per_sequence
// tokens each: padding tokens have id 0, positions 0.., slot -1 (their K/V
// is not written), block-table rows of block 0, and logit rows (discarded).
// INVALID_ARGUMENT when the batch does not fit the layout's capacity.
[[nodiscard]] absl::Status FillStepMetadata(
    const ForwardBatch& batch, int block_size, const StepMetadataLayout& layout,
    const std::optional<GraphShape>& graph, std::span<int32_t> out,
    StepCounts* counts);

// Which attention kernel a step runs and its grid.
enum class AttentionKernel { kLegacy, kDecode, kPrefill };
struct AttentionPlan {
  AttentionKernel kernel = AttentionKernel::kLegacy;
  int rows = 0;    // decode: rows per item (max queries x group)
  int splits = 1;  // decode: context partitions per (sequence, KV head)
};

// What the planner needs to know of the engine and the GPU.
struct AttentionEngineShape {
  int group = 1;  // query heads per KV head in the model
  int head_dim = 0;
  int local_kv_heads = 1;  // KV heads this rank's pool holds
  int multiprocessors = 1;
  // (token, split) partial runs the backend's buffer holds.
  int64_t partial_capacity = 0;
};

// The kernel for a step of `num_sequences` sequences with at most
// `max_queries` query tokens each, `num_tokens` in all. kAuto: the decode
// kernel when its rows fit (decode and verify steps), else the prefill
// kernel, else the legacy one. Splits give the GPU about four blocks per
// multiprocessor (batch 1 spreads its context over up to
// kMaxDecodeSplits blocks per KV head; batch 128 needs none) within the
// partial buffer. A graph plans from its shape, so every replay keeps the
// captured grid; only the partition length changes (DecodePartition).
AttentionPlan PlanAttention(AttentionKernels mode, int num_sequences,
                            int max_queries, int num_tokens,
                            const AttentionEngineShape& shape);

// Keys per decode split for a step whose longest context is `max_context`:
// the context spread over `splits` blocks, in whole key tiles.
int DecodePartition(int max_context, int splits);

}  // namespace pdserve::engine
