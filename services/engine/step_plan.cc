#include "engine/step_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/attention_math.h"

namespace pdserve::engine {

std::vector<int> GraphBatchBuckets(int max_batch) {
  std::vector<int> buckets;
  for (int b = 1; b < max_batch; b *= 2) buckets.push_back(b);
  if (max_batch >= 1) buckets.push_back(max_batch);
  return buckets;
}

std::optional<int> BucketFor(int batch, std::span<const int> buckets) {
  for (int b : buckets) {
    if (b >= batch) return b;
  }
  return std::nullopt;
}

std::optional<GraphShape> GraphShapeFor(const ForwardBatch& batch,
                                        const CudaOptions& options,
                                        bool holds_all_layers,
                                        std::span<const int> buckets) {
  if (!options.use_graphs || !holds_all_layers || batch.sequences.empty()) {
    return std::nullopt;
  }
  int q = 0;
  int64_t real_tokens = 0;
  for (const SequenceStep& seq : batch.sequences) {
    // Every query index wants logits (ascending and below num_tokens, as
    // validated, so num_tokens of them means 0..num_tokens-1).
    if (seq.num_tokens < 1 ||
        seq.logit_indices.size() != static_cast<size_t>(seq.num_tokens)) {
      return std::nullopt;
    }
    q = std::max(q, seq.num_tokens);
    real_tokens += seq.num_tokens;
  }
  if (q > options.max_graph_tokens_per_sequence) return std::nullopt;
  const std::optional<int> bucket =
      BucketFor(static_cast<int>(batch.sequences.size()), buckets);
  if (!bucket) return std::nullopt;
  // Sequences with fewer queries than q (speculation proposed fewer drafts
  // for them) are padded to q. Padding costs GEMM rows: allow it while the
  // step stays small (weight-bandwidth bound) or at most doubles.
  if (real_tokens < static_cast<int64_t>(batch.sequences.size()) * q &&
      int64_t{*bucket} * q >
          std::max<int64_t>(options.max_ragged_graph_tokens, 2 * real_tokens)) {
    return std::nullopt;
  }
  return GraphShape{*bucket, q};
}

StepMetadataLayout StepMetadataLayout::For(int max_tokens, int max_sequences,
                                           int max_blocks_per_sequence,
                                           int tokens_per_tile) {
  StepMetadataLayout l;
  l.max_tokens = max_tokens;
  l.max_sequences = max_sequences;
  l.max_blocks_per_sequence = max_blocks_per_sequence;
  l.tokens_per_tile = std::max(1, tokens_per_tile);
  // Each sequence's tokens fill whole tiles but its last.
  l.max_tiles =
      (max_tokens + l.tokens_per_tile - 1) / l.tokens_per_tile + max_sequences;
  int64_t at = 0;
  // 4-element alignment (16 bytes) for every array.
  auto take = [&](int64_t count) {
    const int64_t offset = at;
    at += (count + 3) / 4 * 4;
    return offset;
  };
  l.header = take(kHeaderSlots);
  l.tokens = take(max_tokens);
  l.positions = take(max_tokens);
  l.slots = take(max_tokens);
  l.token_sequence = take(max_tokens);
  l.block_tables = take(int64_t{max_sequences} * max_blocks_per_sequence);
  l.logit_rows = take(max_tokens);
  l.sequence_items = take(int64_t{max_sequences} * 4);
  l.attention_tiles = take(int64_t{l.max_tiles} * 4);
  l.total = at;
  return l;
}

namespace {

// What a step holds, checked against its graph shape and the layout.
struct StepSize {
  int real_sequences = 0;
  int num_sequences = 0;   // with graph padding
  int64_t num_tokens = 0;  // with graph padding
  int64_t real_rows = 0;   // logit rows the caller asked for
};

absl::StatusOr<StepSize> SizeStep(const ForwardBatch& batch, int block_size,
                                  const StepMetadataLayout& layout,
                                  const std::optional<GraphShape>& graph) {
  StepSize size;
  size.real_sequences = static_cast<int>(batch.sequences.size());
  size.num_sequences = graph ? graph->batch : size.real_sequences;
  int64_t real_tokens = 0;
  int64_t longest_blocks = 0;
  for (const SequenceStep& seq : batch.sequences) {
    real_tokens += seq.num_tokens;
    size.real_rows += static_cast<int64_t>(seq.logit_indices.size());
    longest_blocks = std::max<int64_t>(
        longest_blocks,
        (int64_t{seq.start_position} + seq.num_tokens + block_size - 1) /
            block_size);
  }
  size.num_tokens =
      graph ? int64_t{graph->batch} * graph->tokens_per_sequence : real_tokens;
  if (graph) {
    bool fits = size.real_sequences <= graph->batch;
    for (const SequenceStep& seq : batch.sequences) {
      fits &= seq.num_tokens <= graph->tokens_per_sequence &&
              seq.logit_indices.size() == static_cast<size_t>(seq.num_tokens);
    }
    if (!fits) {
      return absl::InvalidArgumentError(
          "batch does not match the graph shape it was bucketed to");
    }
  }
  if (size.num_tokens > layout.max_tokens ||
      size.num_sequences > layout.max_sequences ||
      longest_blocks > layout.max_blocks_per_sequence) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step of ", size.num_tokens, " tokens, ", size.num_sequences,
        " sequences, ", longest_blocks,
        " blocks per sequence exceeds the engine's capacity (",
        layout.max_tokens, " tokens, ", layout.max_sequences, " sequences, ",
        layout.max_blocks_per_sequence, " blocks)"));
  }
  return size;
}

// Token ids, positions, KV slots, each token's sequence, the block tables
// and the logit rows; returns the number of logit rows.
int64_t WriteTokens(const ForwardBatch& batch, int block_size,
                    const StepMetadataLayout& layout,
                    const std::optional<GraphShape>& graph,
                    const StepSize& size, std::span<int32_t> out) {
  int32_t* tokens = out.data() + layout.tokens;
  int32_t* positions = out.data() + layout.positions;
  int32_t* slots = out.data() + layout.slots;
  int32_t* token_sequence = out.data() + layout.token_sequence;
  int32_t* tables = out.data() + layout.block_tables;
  int32_t* logit_rows = out.data() + layout.logit_rows;

  int64_t t = 0, row = 0;
  // Logit rows of padded queries go after every real one, so the first
  // real_logit_rows rows are the caller's, in order.
  std::vector<int32_t> padded_rows;
  for (int s = 0; s < size.real_sequences; ++s) {
    const SequenceStep& seq = batch.sequences[s];
    const int64_t first = t;
    int32_t* table = tables + int64_t{s} * layout.max_blocks_per_sequence;
    const int64_t blocks =
        (int64_t{seq.start_position} + seq.num_tokens + block_size - 1) /
        block_size;
    std::copy_n(seq.block_table.begin(), blocks, table);
    std::fill(table + blocks, table + layout.max_blocks_per_sequence, 0);
    for (int i = 0; i < seq.num_tokens; ++i, ++t) {
      const int position = seq.start_position + i;
      tokens[t] = seq.tokens.empty() ? 0 : seq.tokens[i];
      positions[t] = position;
      slots[t] = seq.block_table[position / block_size] * block_size +
                 position % block_size;
      token_sequence[t] = s;
    }
    for (int index : seq.logit_indices) {
      logit_rows[row++] = static_cast<int32_t>(first + index);
    }
    // Graph padding of a sequence with fewer queries than the shape: repeat
    // its last query's position (attention reads only keys that exist),
    // write no KV, and drop the logits.
    for (int i = seq.num_tokens; graph && i < graph->tokens_per_sequence;
         ++i, ++t) {
      tokens[t] = 0;
      positions[t] = seq.start_position + seq.num_tokens - 1;
      slots[t] = -1;
      token_sequence[t] = s;
      padded_rows.push_back(static_cast<int32_t>(t));
    }
  }
  for (int32_t padded : padded_rows) logit_rows[row++] = padded;
  // Padding sequences (graph replays only): harmless work whose results are
  // dropped. They read block 0 and write nothing.
  for (int s = size.real_sequences; s < size.num_sequences; ++s) {
    int32_t* table = tables + int64_t{s} * layout.max_blocks_per_sequence;
    std::fill(table, table + layout.max_blocks_per_sequence, 0);
    for (int i = 0; i < graph->tokens_per_sequence; ++i, ++t) {
      tokens[t] = 0;
      positions[t] = i;
      slots[t] = -1;
      token_sequence[t] = s;
      logit_rows[row++] = static_cast<int32_t>(t);
    }
  }
  return row;
}

struct AttentionWork {
  int num_tiles = 0;
  int max_queries = 0;
  int max_context = 0;
};

// Attention work: one item per sequence, and the prefill tiles. Every
// sequence's tokens are consecutive in the step with consecutive positions
// (padding repeats the last one), so a sequence's context is its last
// token's position + 1. Reads the positions WriteTokens wrote.
absl::StatusOr<AttentionWork> WriteAttentionWork(
    const ForwardBatch& batch, const StepMetadataLayout& layout,
    const std::optional<GraphShape>& graph, const StepSize& size,
    std::span<int32_t> out) {
  const int32_t* positions = out.data() + layout.positions;
  AttentionItem* items =
      reinterpret_cast<AttentionItem*>(out.data() + layout.sequence_items);
  std::vector<AttentionItem> tiles;
  AttentionWork work;
  int64_t first = 0;
  for (int s = 0; s < size.num_sequences; ++s) {
    const int n = s < size.real_sequences && !graph
                      ? batch.sequences[s].num_tokens
                      : graph->tokens_per_sequence;
    AttentionItem item;
    item.sequence = s;
    item.first_token = static_cast<int32_t>(first);
    item.num_tokens = n;
    item.context = positions[first + n - 1] + 1;
    items[s] = item;
    work.max_queries = std::max(work.max_queries, n);
    work.max_context = std::max(work.max_context, item.context);
    for (int i = 0; i < n; i += layout.tokens_per_tile) {
      AttentionItem tile = item;
      tile.first_token = static_cast<int32_t>(first + i);
      tile.num_tokens = std::min(layout.tokens_per_tile, n - i);
      tile.context = positions[tile.first_token + tile.num_tokens - 1] + 1;
      tiles.push_back(tile);
    }
    first += n;
  }
  if (static_cast<int64_t>(tiles.size()) > layout.max_tiles) {
    return absl::InternalError(absl::StrCat(
        tiles.size(), " attention tiles exceed the layout's ",
        layout.max_tiles));  // For() sizes max_tiles for any fitting step
  }
  // Longest contexts first: causal tiles differ in work, and the GPU runs
  // blocks roughly in index order, so the long ones should not start last.
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const AttentionItem& a, const AttentionItem& b) {
                     return a.context > b.context;
                   });
  std::copy(
      tiles.begin(), tiles.end(),
      reinterpret_cast<AttentionItem*>(out.data() + layout.attention_tiles));
  work.num_tiles = static_cast<int>(tiles.size());
  return work;
}

}  // namespace

absl::Status FillStepMetadata(const ForwardBatch& batch, int block_size,
                              const StepMetadataLayout& layout,
                              const std::optional<GraphShape>& graph,
                              std::span<int32_t> out, StepCounts* counts) {
  if (static_cast<int64_t>(out.size()) < layout.total) {
    return absl::InvalidArgumentError("step metadata buffer too small");
  }
  PDS_ASSIGN_OR_RETURN(const StepSize size,
                       SizeStep(batch, block_size, layout, graph));
  const int64_t rows = WriteTokens(batch, block_size, layout, graph, size, out);
  PDS_ASSIGN_OR_RETURN(const AttentionWork work,
                       WriteAttentionWork(batch, layout, graph, size, out));

  int32_t* header = out.data() + layout.header;
  std::fill(header, header + kHeaderSlots, 0);
  header[kHeaderTokens] = static_cast<int32_t>(size.num_tokens);
  header[kHeaderSequences] = size.num_sequences;
  header[kHeaderLogitRows] = static_cast<int32_t>(rows);
  header[kHeaderTiles] = work.num_tiles;
  header[kHeaderMaxQueries] = work.max_queries;
  header[kHeaderMaxContext] = work.max_context;
  counts->num_tokens = static_cast<int>(size.num_tokens);
  counts->num_sequences = size.num_sequences;
  counts->num_logit_rows = static_cast<int>(rows);
  counts->real_logit_rows = static_cast<int>(size.real_rows);
  counts->num_tiles = work.num_tiles;
  counts->max_queries = work.max_queries;
  counts->max_context = work.max_context;
  return absl::OkStatus();
}

AttentionPlan PlanAttention(AttentionKernels mode, int num_sequences,
                            int max_queries, int num_tokens,
                            const AttentionEngineShape& shape) {
  AttentionPlan plan;
  const int rows = max_queries * shape.group;
  const bool decode_fits = DecodeKernelFits(rows, shape.head_dim);
  const bool prefill_fits = PrefillKernelFits(shape.head_dim, shape.group);
  if (mode == AttentionKernels::kLegacy ||
      (mode == AttentionKernels::kTensorCore && !prefill_fits) ||
      (!decode_fits && !prefill_fits)) {
    return plan;  // kLegacy
  }
  if (mode == AttentionKernels::kTensorCore || !decode_fits) {
    plan.kernel = AttentionKernel::kPrefill;
    return plan;
  }
  plan.kernel = AttentionKernel::kDecode;
  plan.rows = rows;
  // About four blocks per multiprocessor over the step's (sequence, KV head)
  // pairs; each split costs a partial run per token and a merge.
  const int64_t pairs =
      std::max<int64_t>(1, int64_t{num_sequences} * shape.local_kv_heads);
  const int64_t target = 4 * int64_t{std::max(1, shape.multiprocessors)};
  int64_t splits = (target + pairs - 1) / pairs;
  splits = std::min<int64_t>(splits, kMaxDecodeSplits);
  if (num_tokens > 0) {
    splits = std::min<int64_t>(
        splits, shape.partial_capacity / std::max(1, num_tokens));
  }
  plan.splits = static_cast<int>(std::max<int64_t>(1, splits));
  return plan;
}

int DecodePartition(int max_context, int splits) {
  const int per_split =
      NumPartitions(std::max(1, max_context), std::max(1, splits));
  return NumPartitions(per_split, kDecodeKeyTile) * kDecodeKeyTile;
}

}  // namespace pdserve::engine
