// The CUDA attention kernels one by one (label `gpu`; skips without a GPU):
// random queries and a random paged bf16 KV cache behind shuffled block
// tables, the step metadata packed by the same FillStepMetadata the backend
// uses, each kernel launched directly and its output compared with a
// float64 host computation of softmax(q k / sqrt(d)) v over the same bf16
// keys and values. Shapes cover decode (one token, split contexts), verify
// (several tokens per sequence), prefill chunks with a cached prefix, mixed
// steps, GQA groups 1/2/4, head dims 8/64/128, a TP rank's head offsets and
// sliding windows.
// Small enough for compute-sanitizer memcheck and racecheck.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/float16.h"
#include "engine/attention_math.h"
#include "engine/step_plan.h"
#include "engine_cuda/kernels.h"
#include "testing/gpu.h"

namespace pdserve::engine {
namespace {

using ::pdserve::testing::GpuVisible;

// Device memory for one test, freed on scope exit.
class DeviceArray {
 public:
  explicit DeviceArray(size_t bytes) {
    EXPECT_EQ(cudaMalloc(&ptr_, std::max<size_t>(bytes, 16)), cudaSuccess);
  }
  ~DeviceArray() { cudaFree(ptr_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  template <typename T>
  void Upload(const std::vector<T>& host) {
    ASSERT_EQ(cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
  }

 private:
  void* ptr_ = nullptr;
};

struct Sequence {
  int start = 0;   // cached prefix length (its K/V already in the pool)
  int tokens = 1;  // query tokens this step
};

struct Case {
  std::string name;
  int head_dim = 128;
  int model_q_heads = 8;
  int model_kv_heads = 2;
  int tp_rank = 0, tp_size = 1;
  std::vector<Sequence> sequences;
  int window = 0;  // sliding window (keys p with position - p < window)
};

enum class Kernel { kLegacy, kDecode, kPrefill };
const char* KernelName(Kernel k) {
  return k == Kernel::kLegacy   ? "legacy"
         : k == Kernel::kDecode ? "decode"
                                : "prefill";
}

constexpr int kBlockSize = 16;
constexpr int kLayers = 2;
constexpr int kLayer = 1;  // the layer attended (checks the layer stride)

class AttentionHarness {
 public:
  explicit AttentionHarness(const Case& c) : c_(c) {
    group_ = c.model_q_heads / c.model_kv_heads;
    q_heads_ = c.model_q_heads / c.tp_size;
    q_head_offset_ = c.tp_rank * q_heads_;
    // KV heads shard like the CPU engine's plan when tp divides them.
    kv_heads_ = c.model_kv_heads / c.tp_size;
    kv_head_offset_ = c.tp_rank * kv_heads_;
    hd_ = c.head_dim;
    std::mt19937 rng(1234 + hd_ + 7 * group_);
    std::normal_distribution<float> normal(0.0f, 1.0f);

    int blocks_total = 0;
    for (const Sequence& s : c.sequences) {
      blocks_total += (s.start + s.tokens + kBlockSize - 1) / kBlockSize;
    }
    num_blocks_ = blocks_total + 3;
    // Shuffled blocks: tables walk the pool out of order.
    std::vector<int32_t> order(num_blocks_);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    int next = 0;
    for (const Sequence& s : c.sequences) {
      std::vector<int32_t> table;
      const int blocks = (s.start + s.tokens + kBlockSize - 1) / kBlockSize;
      for (int b = 0; b < blocks; ++b) table.push_back(order[next++]);
      tables_.push_back(table);
    }
    cache_.block_size = kBlockSize;
    cache_.head_dim = hd_;
    cache_.num_kv_heads = kv_heads_;
    cache_.num_layers = kLayers;
    pool_.resize(num_blocks_ * cache_.block_stride());
    for (uint16_t& v : pool_) v = FloatToBf16(normal(rng));

    for (const Sequence& s : c.sequences) tokens_ += s.tokens;
    qkv_row_ = int64_t{q_heads_ + 2 * kv_heads_} * hd_;
    qkv_.resize(tokens_ * qkv_row_);
    // Larger queries sharpen the softmax (a few keys dominate), as trained
    // models' do.
    for (float& v : qkv_) v = 2.0f * normal(rng);

    for (size_t s = 0; s < c.sequences.size(); ++s) {
      SequenceStep step;
      step.num_tokens = c.sequences[s].tokens;
      step.start_position = c.sequences[s].start;
      step.block_table = tables_[s];
      batch_.sequences.push_back(step);
    }
    max_blocks_ = 1;
    for (const auto& t : tables_) {
      max_blocks_ = std::max<int>(max_blocks_, t.size());
    }
    layout_ = StepMetadataLayout::For(tokens_, c.sequences.size(), max_blocks_,
                                      PrefillTokensPerTile(group_));
    meta_.assign(layout_.total, 0);
    StepCounts counts;
    const absl::Status status = FillStepMetadata(batch_, kBlockSize, layout_,
                                                 std::nullopt, meta_, &counts);
    EXPECT_TRUE(status.ok()) << status;
    counts_ = counts;
  }

  // float64 attention over the bf16 cache: [token][q_head][hd]. With
  // `bf16_queries`, q is rounded as the tensor-core kernel rounds it.
  std::vector<double> Reference(bool bf16_queries) const {
    std::vector<double> out(tokens_ * q_heads_ * hd_);
    int t = 0;
    for (size_t s = 0; s < c_.sequences.size(); ++s) {
      for (int i = 0; i < c_.sequences[s].tokens; ++i, ++t) {
        const int position = c_.sequences[s].start + i;
        for (int h = 0; h < q_heads_; ++h) {
          const int kvh = (q_head_offset_ + h) / group_ - kv_head_offset_;
          std::vector<double> q(hd_);
          for (int d = 0; d < hd_; ++d) {
            const float v = qkv_[t * qkv_row_ + h * hd_ + d];
            q[d] = bf16_queries ? Bf16ToFloat(FloatToBf16(v)) : v;
          }
          // Keys before the window get probability 0 (score -inf).
          const int first_key =
              c_.window > 0 ? std::max(0, position + 1 - c_.window) : 0;
          std::vector<double> scores(position + 1, -INFINITY);
          double max_score = -INFINITY;
          for (int k = first_key; k <= position; ++k) {
            const uint16_t* key = Key(s, kvh, k);
            double dot = 0;
            for (int d = 0; d < hd_; ++d) dot += q[d] * Bf16ToFloat(key[d]);
            scores[k] = dot / std::sqrt(static_cast<double>(hd_));
            max_score = std::max(max_score, scores[k]);
          }
          double total = 0;
          for (double& sc : scores) total += (sc = std::exp(sc - max_score));
          double* o = out.data() + (int64_t{t} * q_heads_ + h) * hd_;
          for (int k = first_key; k <= position; ++k) {
            const uint16_t* value = Key(s, kvh, k) + cache_.kv_stride();
            for (int d = 0; d < hd_; ++d) {
              o[d] += scores[k] / total * Bf16ToFloat(value[d]);
            }
          }
        }
      }
    }
    return out;
  }

  // Runs `kernel` (decode with `splits` partitions; 0 = the planner's) and
  // returns its output as floats (NaN where it wrote nothing).
  std::vector<float> Run(Kernel kernel, int splits) {
    DeviceArray pool(pool_.size() * 2), qkv(qkv_.size() * 4),
        meta(meta_.size() * 4),
        partials(int64_t{tokens_} * kMaxDecodeSplits * q_heads_ * (hd_ + 2) *
                 4),
        out(int64_t{tokens_} * q_heads_ * hd_ * 2);
    pool.Upload(pool_);
    qkv.Upload(qkv_);
    int rows = counts_.max_queries * group_;
    if (kernel == Kernel::kDecode && splits == 0) {
      AttentionEngineShape shape;
      shape.group = group_;
      shape.head_dim = hd_;
      shape.local_kv_heads = kv_heads_;
      int multiprocessors = 0;
      cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount,
                             0);
      shape.multiprocessors = multiprocessors;
      shape.partial_capacity = int64_t{tokens_} * kMaxDecodeSplits;
      const AttentionPlan plan =
          PlanAttention(AttentionKernels::kAuto, counts_.num_sequences,
                        counts_.max_queries, counts_.num_tokens, shape);
      EXPECT_EQ(plan.kernel, AttentionKernel::kDecode);
      splits = plan.splits;
      rows = plan.rows;
    }
    splits = std::max(splits, 1);
    last_splits_ = splits;
    std::vector<int32_t> host_meta = meta_;
    host_meta[layout_.header + kHeaderDecodePartition] =
        DecodePartition(counts_.max_context, splits);
    meta.Upload(host_meta);
    const int32_t* m = meta.as<int32_t>();
    cuda::AttentionArgs a;
    a.qkv = qkv.as<float>();
    a.num_tokens = tokens_;
    a.q_heads = q_heads_;
    a.q_head_offset = q_head_offset_;
    a.group = group_;
    a.kv_head_offset = kv_head_offset_;
    a.positions = m + layout_.positions;
    a.token_sequence = m + layout_.token_sequence;
    a.block_tables = m + layout_.block_tables;
    a.max_blocks_per_sequence = layout_.max_blocks_per_sequence;
    a.cache = cache_;
    a.cache.base = pool.as<uint16_t>();
    a.layer = kLayer;
    a.window = c_.window;
    a.partials = partials.as<float>();
    a.out = out.as<uint16_t>();
    a.header = m + layout_.header;
    // 0xffff is a bf16 NaN: an output the kernel never writes shows.
    EXPECT_EQ(cudaMemset(a.out, 0xff, int64_t{tokens_} * q_heads_ * hd_ * 2),
              cudaSuccess);
    absl::Status status;
    switch (kernel) {
      case Kernel::kLegacy:
        a.partition = 128;
        a.partitions = NumPartitions(counts_.max_context, a.partition);
        status = cuda::LaunchPagedAttention(a, nullptr);
        break;
      case Kernel::kDecode:
        a.items = m + layout_.sequence_items;
        status = cuda::LaunchDecodeAttention(a, counts_.num_sequences, rows,
                                             splits, nullptr);
        break;
      case Kernel::kPrefill:
        a.items = m + layout_.attention_tiles;
        status = cuda::LaunchPrefillAttention(a, counts_.num_tiles, nullptr);
        break;
    }
    EXPECT_TRUE(status.ok()) << status;
    const cudaError_t error = cudaDeviceSynchronize();
    EXPECT_EQ(error, cudaSuccess) << cudaGetErrorString(error);
    std::vector<uint16_t> bits(int64_t{tokens_} * q_heads_ * hd_);
    EXPECT_EQ(
        cudaMemcpy(bits.data(), a.out, bits.size() * 2, cudaMemcpyDeviceToHost),
        cudaSuccess);
    std::vector<float> result(bits.size());
    for (size_t i = 0; i < bits.size(); ++i) result[i] = Bf16ToFloat(bits[i]);
    return result;
  }

  int last_splits_ = 1;
  const Case& c_;
  int group_ = 1, q_heads_ = 0, q_head_offset_ = 0, kv_heads_ = 0,
      kv_head_offset_ = 0, hd_ = 0;
  int num_blocks_ = 0, max_blocks_ = 0, tokens_ = 0;
  int64_t qkv_row_ = 0;
  cuda::KvCacheView cache_;
  std::vector<uint16_t> pool_;
  std::vector<float> qkv_;
  std::vector<std::vector<int32_t>> tables_;
  ForwardBatch batch_;
  StepMetadataLayout layout_;
  std::vector<int32_t> meta_;
  StepCounts counts_;

 private:
  const uint16_t* Key(size_t sequence, int kvh, int k) const {
    const int block = tables_[sequence][k / kBlockSize];
    return pool_.data() + block * cache_.block_stride() +
           kLayer * cache_.layer_stride() + kvh * cache_.head_stride() +
           (k % kBlockSize) * hd_;
  }
};

// max |got - want| / max |want|; infinity when anything is NaN (unwritten).
double MaxError(const std::vector<float>& got,
                const std::vector<double>& want) {
  EXPECT_EQ(got.size(), want.size());
  double worst = 0, scale = 0;
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    if (std::isnan(got[i])) return INFINITY;
    worst = std::max(worst, std::abs(got[i] - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return scale > 0 ? worst / scale : worst;
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  // Decode: contexts of 1 key, inside one block, across tiles and splits.
  cases.push_back({"decode g4 d128",
                   128,
                   8,
                   2,
                   0,
                   1,
                   {{0, 1}, {99, 1}, {1029, 1}, {16, 1}}});
  // Speculative verify: several tokens per sequence (causal among them).
  cases.push_back(
      {"verify g4 d128", 128, 8, 2, 0, 1, {{40, 5}, {700, 5}, {3, 2}}});
  // Prefill chunks: a whole prompt, a chunk after a cached prefix, and a
  // decode token in the same (mixed) step.
  cases.push_back(
      {"prefill g4 d128", 128, 8, 2, 0, 1, {{0, 300}, {200, 70}, {50, 1}}});
  cases.push_back({"mha d64", 64, 4, 4, 0, 1, {{0, 130}, {64, 1}, {500, 3}}});
  // stories260K's shape (head_dim 8: the prefill kernel pads to 16).
  cases.push_back(
      {"stories d8 g2", 8, 8, 4, 0, 1, {{0, 40}, {260, 1}, {100, 6}}});
  // Tensor-parallel rank 1 of 2: local heads start at an offset.
  cases.push_back({"tp rank 1/2 g2 d128", 128, 8, 4, 1, 2, {{0, 65}, {77, 4}}});
  // A group of 8 (8 tokens per prefill tile; 4 verify tokens = 32 rows).
  cases.push_back({"g8 d128", 128, 16, 2, 0, 1, {{10, 1}, {300, 4}}});
  cases.push_back({"g8 d128 prefill", 128, 16, 2, 0, 1, {{0, 77}}});
  cases.push_back({"d32", 32, 2, 1, 0, 1, {{0, 33}, {5, 1}}});
  // Sliding windows (Mistral, Qwen's windowed layers): decode with whole
  // splits and key tiles before the window, a window shorter than a key
  // tile and a block, verify tokens whose windows start at different keys,
  // prefill tiles partly and wholly before their rows' windows.
  cases.push_back({"window 100 decode",
                   128,
                   8,
                   2,
                   0,
                   1,
                   {{0, 1}, {99, 1}, {1029, 1}, {250, 1}},
                   100});
  cases.push_back(
      {"window 7 decode d64", 64, 4, 4, 0, 1, {{3, 1}, {40, 1}, {517, 1}}, 7});
  cases.push_back(
      {"window 37 verify", 128, 8, 2, 0, 1, {{40, 5}, {700, 5}, {3, 2}}, 37});
  cases.push_back({"window 64 prefill",
                   128,
                   8,
                   2,
                   0,
                   1,
                   {{0, 300}, {200, 70}, {50, 1}},
                   64});
  cases.push_back({"window 8 stories d8 g2",
                   8,
                   8,
                   4,
                   0,
                   1,
                   {{0, 40}, {260, 1}, {100, 6}},
                   8});
  return cases;
}

TEST(CudaAttentionTest, EveryKernelMatchesAFloat64Reference) {
  if (!GpuVisible()) GTEST_SKIP() << "no GPU visible";
  ASSERT_TRUE(cuda::ConfigureAttentionKernels().ok());
  for (const Case& c : Cases()) {
    AttentionHarness harness(c);
    const std::vector<double> exact = harness.Reference(false);
    const std::vector<double> bf16_queries = harness.Reference(true);
    const int rows = harness.counts_.max_queries * harness.group_;
    struct Launch {
      Kernel kernel;
      int splits;
    };
    for (const Launch& launch :
         {Launch{Kernel::kLegacy, 0}, Launch{Kernel::kDecode, 0},
          Launch{Kernel::kDecode, 1}, Launch{Kernel::kDecode, 5},
          Launch{Kernel::kPrefill, 0}}) {
      if (launch.kernel == Kernel::kDecode &&
          !DecodeKernelFits(rows, c.head_dim)) {
        continue;
      }
      const std::vector<float> got = harness.Run(launch.kernel, launch.splits);
      // Outputs are bf16 (2^-9 relative); the tensor-core kernel also
      // rounds q and the probabilities to bf16 (against a reference with
      // the same q).
      const bool tensor_cores = launch.kernel == Kernel::kPrefill;
      const double error = MaxError(got, tensor_cores ? bf16_queries : exact);
      std::printf(
          "[ attention] %-20s %-7s splits %2d: max error %.2e of max |out|\n",
          c.name.c_str(), KernelName(launch.kernel),
          launch.kernel == Kernel::kDecode ? harness.last_splits_ : 1, error);
      EXPECT_LT(error, tensor_cores ? 1e-2 : 5e-3)
          << c.name << ", " << KernelName(launch.kernel) << " kernel, "
          << harness.last_splits_ << " splits";
    }
  }
}

}  // namespace
}  // namespace pdserve::engine
