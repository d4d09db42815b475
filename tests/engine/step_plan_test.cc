// Host-side logic of the CUDA backend, run on the CPU machine: graph buckets,
// which steps may replay a graph, the packed step metadata the kernels read,
// and the online-softmax merge the split-K attention kernels use.
#include "engine/step_plan.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <random>

#include "engine/attention_math.h"
#include "engine/backend_flags.h"

namespace pdserve::engine {
namespace {

TEST(GraphBucketsTest, PowersOfTwoThenTheMaximum) {
  EXPECT_EQ(GraphBatchBuckets(128),
            (std::vector<int>{1, 2, 4, 8, 16, 32, 64, 128}));
  EXPECT_EQ(GraphBatchBuckets(48), (std::vector<int>{1, 2, 4, 8, 16, 32, 48}));
  EXPECT_EQ(GraphBatchBuckets(1), (std::vector<int>{1}));
  EXPECT_TRUE(GraphBatchBuckets(0).empty());
}

TEST(GraphBucketsTest, PadsToTheNextBucket) {
  const std::vector<int> buckets = GraphBatchBuckets(48);
  EXPECT_EQ(BucketFor(1, buckets), 1);
  EXPECT_EQ(BucketFor(3, buckets), 4);
  EXPECT_EQ(BucketFor(17, buckets), 32);
  EXPECT_EQ(BucketFor(33, buckets), 48);
  EXPECT_EQ(BucketFor(49, buckets), std::nullopt);
}

// A batch of `num` sequences with `q` query tokens each, all wanting logits.
struct TestBatch {
  std::vector<std::vector<int32_t>> tokens, tables;
  ForwardBatch batch;
  TestBatch(int num, int q, int start, int block_size) {
    tokens.resize(num);
    tables.resize(num);
    for (int s = 0; s < num; ++s) {
      tokens[s].assign(q, 100 + s);
      // Sequence s starts at start + s (below).
      const int blocks = (start + s + q + block_size - 1) / block_size;
      for (int b = 0; b < blocks; ++b) tables[s].push_back(10 * s + b + 1);
    }
    for (int s = 0; s < num; ++s) {
      SequenceStep step;
      step.tokens = tokens[s];
      step.num_tokens = q;
      step.start_position = start + s;  // contexts differ per sequence
      step.block_table = tables[s];
      step.logit_indices.resize(q);
      std::iota(step.logit_indices.begin(), step.logit_indices.end(), 0);
      batch.sequences.push_back(step);
    }
  }
};

TEST(GraphShapeTest, DecodeAndVerifyStepsReplayGraphs) {
  CudaOptions options;
  const std::vector<int> buckets = GraphBatchBuckets(options.max_graph_batch);
  TestBatch decode(3, 1, 20, 16);
  EXPECT_EQ(GraphShapeFor(decode.batch, options, true, buckets),
            (GraphShape{4, 1}));
  TestBatch verify(5, 5, 20, 16);
  EXPECT_EQ(GraphShapeFor(verify.batch, options, true, buckets),
            (GraphShape{8, 5}));
}

TEST(GraphShapeTest, OtherStepsRunEager) {
  CudaOptions options;
  const std::vector<int> buckets = GraphBatchBuckets(options.max_graph_batch);
  TestBatch decode(3, 1, 20, 16);
  // Graphs off, or a pipeline stage's shard.
  CudaOptions off = options;
  off.use_graphs = false;
  EXPECT_EQ(GraphShapeFor(decode.batch, off, true, buckets), std::nullopt);
  EXPECT_EQ(GraphShapeFor(decode.batch, options, false, buckets), std::nullopt);
  // Mixed query counts whose padding would more than double a step beyond
  // max_ragged_graph_tokens.
  TestBatch mixed(2, 1, 20, 16);
  mixed.tokens[1].assign(5, 7);
  mixed.batch.sequences[1].tokens = mixed.tokens[1];
  mixed.batch.sequences[1].num_tokens = 5;
  mixed.batch.sequences[1].logit_indices = {0, 1, 2, 3, 4};
  CudaOptions strict = options;
  strict.max_ragged_graph_tokens = 8;
  EXPECT_EQ(GraphShapeFor(mixed.batch, strict, true, buckets),
            (GraphShape{2, 5}))
      << "10 padded tokens are within twice the 6 real ones";
  strict.max_ragged_graph_tokens = 4;
  TestBatch lopsided(4, 1, 20, 16);
  lopsided.tokens[3].assign(5, 7);
  lopsided.batch.sequences[3].tokens = lopsided.tokens[3];
  lopsided.batch.sequences[3].num_tokens = 5;
  lopsided.batch.sequences[3].logit_indices = {0, 1, 2, 3, 4};
  // 4 x 5 = 20 padded tokens for 8 real ones: more than double.
  EXPECT_EQ(GraphShapeFor(lopsided.batch, strict, true, buckets), std::nullopt);
  // A prefill chunk that wants only its last logits.
  TestBatch chunk(1, 4, 0, 16);
  chunk.batch.sequences[0].logit_indices = {3};
  EXPECT_EQ(GraphShapeFor(chunk.batch, options, true, buckets), std::nullopt);
  // Too many tokens per sequence, or too many sequences.
  TestBatch long_verify(1, options.max_graph_tokens_per_sequence + 1, 0, 16);
  EXPECT_EQ(GraphShapeFor(long_verify.batch, options, true, buckets),
            std::nullopt);
  TestBatch wide(options.max_graph_batch + 1, 1, 0, 16);
  EXPECT_EQ(GraphShapeFor(wide.batch, options, true, buckets), std::nullopt);
}

TEST(StepMetadataLayoutTest, ArraysAreAlignedAndDisjoint) {
  const StepMetadataLayout l = StepMetadataLayout::For(13, 5, 7);
  const std::vector<std::pair<int64_t, int64_t>> arrays = {
      {l.header, 3},
      {l.tokens, 13},
      {l.positions, 13},
      {l.slots, 13},
      {l.token_sequence, 13},
      {l.block_tables, 35},
      {l.logit_rows, 13},
      {l.sequence_items, 5 * 4},
      {l.attention_tiles, l.max_tiles * 4}};
  int64_t end = 0;
  for (const auto& [offset, count] : arrays) {
    EXPECT_EQ(offset % 4, 0);
    EXPECT_GE(offset, end);
    end = offset + count;
  }
  EXPECT_LE(end, l.total);
}

TEST(FillStepMetadataTest, EagerStepPacksEveryToken) {
  const int bs = 4;
  TestBatch b(2, 3, 5, bs);
  b.batch.sequences[0].logit_indices = {2};  // a chunk wanting its last row
  const StepMetadataLayout l = StepMetadataLayout::For(16, 4, 8);
  std::vector<int32_t> meta(l.total, -7);
  StepCounts counts;
  ASSERT_TRUE(
      FillStepMetadata(b.batch, bs, l, std::nullopt, meta, &counts).ok());
  EXPECT_EQ(counts.num_tokens, 6);
  EXPECT_EQ(counts.num_sequences, 2);
  EXPECT_EQ(counts.num_logit_rows, 4);
  EXPECT_EQ(counts.real_logit_rows, 4);
  EXPECT_EQ(meta[l.header], 6);
  EXPECT_EQ(meta[l.header + 1], 2);
  EXPECT_EQ(meta[l.header + 2], 4);
  for (int s = 0; s < 2; ++s) {
    for (int i = 0; i < 3; ++i) {
      const int t = 3 * s + i;
      const int position = 5 + s + i;
      EXPECT_EQ(meta[l.tokens + t], 100 + s);
      EXPECT_EQ(meta[l.positions + t], position);
      EXPECT_EQ(meta[l.token_sequence + t], s);
      EXPECT_EQ(meta[l.slots + t],
                b.tables[s][position / bs] * bs + position % bs);
    }
    const int32_t* row = meta.data() + l.block_tables + s * 8;
    for (size_t k = 0; k < b.tables[s].size(); ++k) {
      EXPECT_EQ(row[k], b.tables[s][k]);
    }
    for (size_t k = b.tables[s].size(); k < 8; ++k) EXPECT_EQ(row[k], 0);
  }
  // Sequence 0 wants query 2 (token 2); sequence 1 wants 0, 1, 2 (3, 4, 5).
  EXPECT_EQ(std::vector<int32_t>(meta.begin() + l.logit_rows,
                                 meta.begin() + l.logit_rows + 4),
            (std::vector<int32_t>{2, 3, 4, 5}));
}

TEST(FillStepMetadataTest, GraphStepIsPaddedWithHarmlessSequences) {
  const int bs = 16;
  TestBatch b(3, 2, 30, bs);
  const StepMetadataLayout l = StepMetadataLayout::For(64, 8, 4);
  std::vector<int32_t> meta(l.total, -7);
  StepCounts counts;
  ASSERT_TRUE(
      FillStepMetadata(b.batch, bs, l, GraphShape{4, 2}, meta, &counts).ok());
  EXPECT_EQ(counts.num_tokens, 8);
  EXPECT_EQ(counts.num_sequences, 4);
  EXPECT_EQ(counts.num_logit_rows, 8);
  EXPECT_EQ(counts.real_logit_rows, 6);
  for (int t = 6; t < 8; ++t) {
    EXPECT_EQ(meta[l.slots + t], -1) << "padding must not write KV";
    EXPECT_EQ(meta[l.token_sequence + t], 3);
    EXPECT_EQ(meta[l.positions + t], t - 6);
    EXPECT_EQ(meta[l.logit_rows + t], t);
  }
  for (int k = 0; k < 4; ++k) EXPECT_EQ(meta[l.block_tables + 3 * 4 + k], 0);
}

// Speculation proposes different draft counts per request: such a verify
// step replays the graph of the largest, each shorter sequence padded with
// queries that repeat its last position, write no KV, and whose logit rows
// come after every real one.
TEST(GraphShapeTest, RaggedVerifyStepReplaysThePaddedGraph) {
  CudaOptions options;
  const std::vector<int> buckets = GraphBatchBuckets(options.max_graph_batch);
  const int bs = 16;
  TestBatch b(3, 1, 30, bs);
  b.tokens[1].assign(3, 9);   // sequence 1 verifies two drafts
  b.tables[1].push_back(99);  // positions 31..33 reach a third block
  b.batch.sequences[1].block_table = b.tables[1];
  b.batch.sequences[1].tokens = b.tokens[1];
  b.batch.sequences[1].num_tokens = 3;
  b.batch.sequences[1].logit_indices = {0, 1, 2};
  const std::optional<GraphShape> shape =
      GraphShapeFor(b.batch, options, true, buckets);
  ASSERT_EQ(shape, (GraphShape{4, 3}));

  const StepMetadataLayout l = StepMetadataLayout::For(64, 8, 4);
  std::vector<int32_t> meta(l.total, -7);
  StepCounts counts;
  ASSERT_TRUE(FillStepMetadata(b.batch, bs, l, shape, meta, &counts).ok());
  EXPECT_EQ(counts.num_tokens, 12);
  EXPECT_EQ(counts.num_logit_rows, 12);
  EXPECT_EQ(counts.real_logit_rows, 5);
  // Tokens: seq 0 at 0..2 (1 real), seq 1 at 3..5 (3 real), seq 2 at 6..8
  // (1 real), padding sequence at 9..11.
  const std::vector<int> real = {0, 3, 4, 5, 6};
  EXPECT_EQ(std::vector<int32_t>(meta.begin() + l.logit_rows,
                                 meta.begin() + l.logit_rows + 5),
            std::vector<int32_t>(real.begin(), real.end()));
  for (int t : {1, 2, 7, 8}) {
    const int s = t / 3;
    EXPECT_EQ(meta[l.slots + t], -1) << "padded query " << t;
    EXPECT_EQ(meta[l.token_sequence + t], s);
    EXPECT_EQ(meta[l.positions + t], 30 + s) << "repeats the last position";
  }
  for (int t : real) EXPECT_GE(meta[l.slots + t], 0);
  // After the real rows: the padded queries, then the padding sequence.
  EXPECT_EQ(std::vector<int32_t>(meta.begin() + l.logit_rows + 5,
                                 meta.begin() + l.logit_rows + 12),
            (std::vector<int32_t>{1, 2, 7, 8, 9, 10, 11}));
  // A sequence longer than the shape does not fit it.
  EXPECT_FALSE(
      FillStepMetadata(b.batch, bs, l, GraphShape{4, 2}, meta, &counts).ok());
}

TEST(FillStepMetadataTest, StepsPastCapacityAreRefused) {
  TestBatch b(3, 2, 30, 16);
  std::vector<int32_t> meta(StepMetadataLayout::For(64, 8, 4).total);
  StepCounts counts;
  // Too few tokens, sequences, or blocks per sequence (30 + 2 needs 2 of 16).
  for (const StepMetadataLayout& l :
       {StepMetadataLayout::For(5, 8, 4), StepMetadataLayout::For(64, 2, 4),
        StepMetadataLayout::For(64, 8, 1)}) {
    const absl::Status status =
        FillStepMetadata(b.batch, 16, l, std::nullopt, meta, &counts);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  }
  // A graph shape the batch does not fit.
  const StepMetadataLayout l = StepMetadataLayout::For(64, 8, 4);
  EXPECT_FALSE(
      FillStepMetadata(b.batch, 16, l, GraphShape{2, 2}, meta, &counts).ok());
  EXPECT_FALSE(
      FillStepMetadata(b.batch, 16, l, GraphShape{4, 1}, meta, &counts).ok());
}

// Split-K attention: runs over partitions of the keys, merged, equal the
// softmax-weighted sum over all keys (what the kernels rely on).
TEST(AttentionMathTest, MergedPartitionRunsEqualDirectSoftmax) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const int keys = 1000, dims = 8;
  std::vector<float> scores(keys), values(keys * dims);
  for (float& s : scores) s = normal(rng);
  for (float& v : values) v = normal(rng);

  double max_score = -INFINITY;
  for (float s : scores) max_score = std::max<double>(max_score, s);
  std::vector<double> expected(dims, 0.0);
  double denominator = 0;
  for (int j = 0; j < keys; ++j) {
    const double w = std::exp(scores[j] - max_score);
    denominator += w;
    for (int d = 0; d < dims; ++d) expected[d] += w * values[j * dims + d];
  }
  for (double& e : expected) e /= denominator;

  for (int partition : {1, 7, 32, 512, 1000, 4096}) {
    float run_max = -INFINITY, run_sum = 0;
    std::vector<float> acc(dims, 0.0f);
    ASSERT_EQ(NumPartitions(keys, partition),
              (keys + partition - 1) / partition);
    for (int p = 0; p < NumPartitions(keys, partition); ++p) {
      float part_max = -INFINITY, part_sum = 0;
      std::vector<float> part_acc(dims, 0.0f);
      const int end = std::min(keys, (p + 1) * partition);
      for (int j = p * partition; j < end; ++j) {
        part_max = std::max(part_max, scores[j]);
      }
      for (int j = p * partition; j < end; ++j) {
        const float w = std::exp(scores[j] - part_max);
        part_sum += w;
        for (int d = 0; d < dims; ++d) part_acc[d] += w * values[j * dims + d];
      }
      MergeRunInto(run_max, run_sum, acc.data(), part_max, part_sum,
                   part_acc.data(), dims);
    }
    for (int d = 0; d < dims; ++d) {
      EXPECT_NEAR(acc[d] / run_sum, expected[d], 1e-4)
          << "partition " << partition << " dim " << d;
    }
  }
}

TEST(AttentionMathTest, EmptyRunsMergeAsIdentity) {
  float max = -INFINITY, sum = 0, acc[2] = {0, 0};
  const float other_acc[2] = {3.0f, 4.0f};
  MergeRunInto(max, sum, acc, -INFINITY, 0.0f, other_acc, 2);
  EXPECT_EQ(max, -INFINITY);
  EXPECT_EQ(sum, 0.0f);
  MergeRunInto(max, sum, acc, 1.5f, 2.0f, other_acc, 2);
  EXPECT_EQ(max, 1.5f);
  EXPECT_EQ(sum, 2.0f);
  EXPECT_EQ(acc[0], 3.0f);
  EXPECT_EQ(acc[1], 4.0f);
  MergeRunInto(max, sum, acc, -INFINITY, 0.0f, other_acc, 2);
  EXPECT_EQ(sum, 2.0f);
  EXPECT_EQ(acc[1], 4.0f);
}

// The attention work lists: one item per sequence, and prefill tiles of
// tokens_per_tile tokens, longest context first.
TEST(FillStepMetadataTest, AttentionItemsAndTilesCoverEveryToken) {
  const int bs = 4;
  TestBatch b(3, 5, 10, bs);  // sequences at 10, 11, 12; 5 tokens each
  b.tokens[1].resize(2);
  b.batch.sequences[1].num_tokens = 2;
  b.batch.sequences[1].tokens = b.tokens[1];
  b.batch.sequences[1].logit_indices = {1};
  const StepMetadataLayout l = StepMetadataLayout::For(16, 4, 8, 2);
  EXPECT_EQ(l.max_tiles, 16 / 2 + 4);
  std::vector<int32_t> meta(l.total, -7);
  StepCounts counts;
  ASSERT_TRUE(
      FillStepMetadata(b.batch, bs, l, std::nullopt, meta, &counts).ok());
  EXPECT_EQ(counts.num_tokens, 12);
  EXPECT_EQ(counts.max_queries, 5);
  EXPECT_EQ(counts.max_context, 12 + 5);
  EXPECT_EQ(meta[l.header + kHeaderMaxQueries], 5);
  EXPECT_EQ(meta[l.header + kHeaderMaxContext], 17);
  EXPECT_EQ(meta[l.header + kHeaderDecodePartition], 0);  // the backend's
  const AttentionItem* items =
      reinterpret_cast<const AttentionItem*>(meta.data() + l.sequence_items);
  const std::vector<std::vector<int>> want_items = {
      {0, 0, 5, 15}, {1, 5, 2, 13}, {2, 7, 5, 17}};
  for (int s = 0; s < 3; ++s) {
    EXPECT_EQ((std::vector<int>{items[s].sequence, items[s].first_token,
                                items[s].num_tokens, items[s].context}),
              want_items[s])
        << "sequence " << s;
  }
  // Tiles of 2 tokens: 3 + 1 + 3, sorted by context (ties keep order).
  ASSERT_EQ(counts.num_tiles, 7);
  EXPECT_EQ(meta[l.header + kHeaderTiles], 7);
  const AttentionItem* tiles =
      reinterpret_cast<const AttentionItem*>(meta.data() + l.attention_tiles);
  const std::vector<std::vector<int>> want_tiles = {
      {2, 11, 1, 17}, {2, 9, 2, 16}, {0, 4, 1, 15}, {0, 2, 2, 14},
      {2, 7, 2, 14},  {1, 5, 2, 13}, {0, 0, 2, 12}};
  std::vector<int> covered(12, 0);
  for (int i = 0; i < 7; ++i) {
    EXPECT_EQ((std::vector<int>{tiles[i].sequence, tiles[i].first_token,
                                tiles[i].num_tokens, tiles[i].context}),
              want_tiles[i])
        << "tile " << i;
    for (int t = 0; t < tiles[i].num_tokens; ++t) {
      ++covered[tiles[i].first_token + t];
    }
  }
  EXPECT_EQ(covered, std::vector<int>(12, 1));
}

TEST(FillStepMetadataTest, GraphStepItemsIncludeThePadding) {
  const int bs = 16;
  TestBatch b(3, 1, 30, bs);
  const StepMetadataLayout l = StepMetadataLayout::For(64, 8, 4, 16);
  std::vector<int32_t> meta(l.total, -7);
  StepCounts counts;
  ASSERT_TRUE(
      FillStepMetadata(b.batch, bs, l, GraphShape{4, 2}, meta, &counts).ok());
  // The grid a graph captured (4 items, 4 tiles) holds on every replay.
  EXPECT_EQ(counts.num_tiles, 4);
  EXPECT_EQ(counts.max_queries, 2);
  const AttentionItem* items =
      reinterpret_cast<const AttentionItem*>(meta.data() + l.sequence_items);
  for (int s = 0; s < 3; ++s) {
    EXPECT_EQ(items[s].first_token, 2 * s);
    EXPECT_EQ(items[s].num_tokens, 2);
    // The padded query repeats the real one's position: same context.
    EXPECT_EQ(items[s].context, 30 + s + 1);
  }
  EXPECT_EQ(items[3].sequence, 3);
  EXPECT_EQ(items[3].context, 2);  // padding sequence: positions 0, 1
}

AttentionEngineShape Llama8bShape() {
  AttentionEngineShape shape;
  shape.group = 4;
  shape.head_dim = 128;
  shape.local_kv_heads = 8;
  shape.multiprocessors = 132;
  shape.partial_capacity = 256 * kMaxDecodeSplits;
  return shape;
}

TEST(AttentionPlanTest, DecodeStepsSplitTheContextUntilTheGpuIsFull) {
  const AttentionEngineShape shape = Llama8bShape();
  // Batch 1: 8 (sequence, KV head) pairs; 4 x 132 blocks wanted.
  AttentionPlan plan = PlanAttention(AttentionKernels::kAuto, 1, 1, 1, shape);
  EXPECT_EQ(plan.kernel, AttentionKernel::kDecode);
  EXPECT_EQ(plan.rows, 4);
  EXPECT_EQ(plan.splits, kMaxDecodeSplits);
  plan = PlanAttention(AttentionKernels::kAuto, 32, 1, 32, shape);
  EXPECT_EQ(plan.splits, 3);  // ceil(528 / 256)
  plan = PlanAttention(AttentionKernels::kAuto, 128, 1, 128, shape);
  EXPECT_EQ(plan.splits, 1);
  // A verify step: 5 tokens x group 4 = 20 rows, still the decode kernel.
  plan = PlanAttention(AttentionKernels::kAuto, 2, 5, 10, shape);
  EXPECT_EQ(plan.kernel, AttentionKernel::kDecode);
  EXPECT_EQ(plan.rows, 20);
  // The partial buffer bounds tokens x splits.
  AttentionEngineShape small = shape;
  small.partial_capacity = 100;
  plan = PlanAttention(AttentionKernels::kAuto, 1, 4, 4, small);
  EXPECT_EQ(plan.splits, 25);
}

TEST(AttentionPlanTest, ChunksTakeTheTensorCoreKernelAndOddShapesTheLegacy) {
  const AttentionEngineShape shape = Llama8bShape();
  // 9 tokens x 4 = 36 rows: more than the decode kernel holds.
  EXPECT_EQ(PlanAttention(AttentionKernels::kAuto, 1, 9, 9, shape).kernel,
            AttentionKernel::kPrefill);
  EXPECT_EQ(PlanAttention(AttentionKernels::kAuto, 3, 2048, 4000, shape).kernel,
            AttentionKernel::kPrefill);
  EXPECT_EQ(PlanAttention(AttentionKernels::kLegacy, 1, 1, 1, shape).kernel,
            AttentionKernel::kLegacy);
  EXPECT_EQ(PlanAttention(AttentionKernels::kTensorCore, 1, 1, 1, shape).kernel,
            AttentionKernel::kPrefill);
  // head_dim 256: decode holds 16 rows (group 4 x 4 tokens), no tensor-core
  // tiles; beyond that the legacy kernel.
  AttentionEngineShape wide = shape;
  wide.head_dim = 256;
  EXPECT_EQ(PlanAttention(AttentionKernels::kAuto, 1, 4, 4, wide).kernel,
            AttentionKernel::kDecode);
  EXPECT_EQ(PlanAttention(AttentionKernels::kAuto, 1, 5, 5, wide).kernel,
            AttentionKernel::kLegacy);
  EXPECT_EQ(PlanAttention(AttentionKernels::kTensorCore, 1, 1, 1, wide).kernel,
            AttentionKernel::kLegacy);
  // head_dim 100 (no 16-byte rows): legacy only.
  AttentionEngineShape odd = shape;
  odd.head_dim = 100;
  EXPECT_EQ(PlanAttention(AttentionKernels::kAuto, 1, 1, 1, odd).kernel,
            AttentionKernel::kLegacy);
}

TEST(AttentionPlanTest, KernelShapeRules) {
  EXPECT_EQ(DecodeRowGroups(128), 2);
  EXPECT_EQ(DecodeRowGroups(8), 32);
  EXPECT_EQ(DecodeRowGroups(256), 1);
  EXPECT_EQ(DecodeRowGroups(512), 0);
  EXPECT_TRUE(DecodeKernelFits(32, 128));
  EXPECT_FALSE(DecodeKernelFits(33, 128));
  EXPECT_TRUE(DecodeKernelFits(16, 256));
  EXPECT_FALSE(DecodeKernelFits(17, 256));
  EXPECT_TRUE(DecodeKernelFits(32, 8));
  EXPECT_FALSE(DecodeKernelFits(0, 128));
  EXPECT_EQ(PrefillPaddedHeadDim(8), 16);
  EXPECT_EQ(PrefillPaddedHeadDim(64), 64);
  EXPECT_EQ(PrefillPaddedHeadDim(96), 128);
  EXPECT_EQ(PrefillTokensPerTile(4), 16);
  EXPECT_EQ(PrefillTokensPerTile(3), 21);
  EXPECT_TRUE(PrefillKernelFits(96, 4));
  EXPECT_FALSE(PrefillKernelFits(136, 4));
  // Largest decode block: within the 227 KB an H100/H200 block may opt in
  // to, and the smallest within the default 48 KB.
  EXPECT_LE(DecodeSharedBytes(kDecodeMaxRows, 256), 227 * 1024);
  EXPECT_LE(DecodeSharedBytes(4, 128), 48 * 1024);
}

TEST(AttentionPlanTest, DecodePartitionsCoverTheContextInWholeTiles) {
  EXPECT_EQ(DecodePartition(1025, 64), 32);
  EXPECT_EQ(DecodePartition(1025, 1), 1056);
  EXPECT_EQ(DecodePartition(1, 64), kDecodeKeyTile);
  EXPECT_EQ(DecodePartition(0, 3), kDecodeKeyTile);
  for (int context : {1, 31, 32, 33, 500, 1024, 1025, 8191, 131072}) {
    for (int splits : {1, 2, 3, 7, 64}) {
      const int partition = DecodePartition(context, splits);
      EXPECT_EQ(partition % kDecodeKeyTile, 0);
      EXPECT_LE(NumPartitions(context, partition), splits)
          << context << " keys in " << splits << " splits";
    }
  }
}

TEST(BackendFlagsTest, ParsesAttentionKernels) {
  for (AttentionKernels k : {AttentionKernels::kAuto, AttentionKernels::kLegacy,
                             AttentionKernels::kTensorCore}) {
    EXPECT_EQ(*ParseAttentionKernels(AttentionKernelsName(k)), k);
  }
  auto bad = ParseAttentionKernels("flash");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("auto, legacy or tensor-core"),
            std::string::npos);
}

TEST(BackendFlagsTest, ParsesQuantizedMatmul) {
  EXPECT_EQ(*ParseQuantizedMatmul("int8"), QuantizedMatmul::kInt8Activations);
  EXPECT_EQ(*ParseQuantizedMatmul("exact"), QuantizedMatmul::kExact);
  EXPECT_STREQ(QuantizedMatmulName(QuantizedMatmul::kExact), "exact");
  EXPECT_EQ(EngineOptions{}.quantized_matmul,
            QuantizedMatmul::kInt8Activations);
  auto bad = ParseQuantizedMatmul("f32");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("expected int8 or exact"),
            std::string::npos);
}

TEST(BackendFlagsTest, ParsesBackendsAndDeviceLists) {
  ASSERT_TRUE(ParseBackend("cpu").ok());
  EXPECT_EQ(*ParseBackend("cpu"), Backend::kCpu);
  EXPECT_EQ(*ParseBackend("cuda"), Backend::kCuda);
  EXPECT_STREQ(BackendName(Backend::kCuda), "cuda");
  auto bad = ParseBackend("gpu");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("expected cpu or cuda"),
            std::string::npos);

  EXPECT_EQ(*ParseDeviceList("0"), (std::vector<int>{0}));
  EXPECT_EQ(*ParseDeviceList("0,1,3"), (std::vector<int>{0, 1, 3}));
  for (const char* list : {"", "0,", "a", "-1", "0,,1", "1.5"}) {
    auto devices = ParseDeviceList(list);
    EXPECT_EQ(devices.status().code(), absl::StatusCode::kInvalidArgument)
        << "\"" << list << "\"";
  }
}

}  // namespace
}  // namespace pdserve::engine
