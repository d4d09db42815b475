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
      {l.header, 3},     {l.tokens, 13},         {l.positions, 13},
      {l.slots, 13},     {l.token_sequence, 13}, {l.block_tables, 35},
      {l.logit_rows, 13}};
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
