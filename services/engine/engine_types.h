// The data types of the engine's interface, shared by every backend (CPU
// reference, CUDA) and by the code that drives an engine (decode worker,
// pipeline stage, speculative verifier).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "comm/communicator.h"
#include "kv/kv_layout.h"

namespace pdserve::engine {

struct ShardSpec {
  int layer_begin = 0;
  int layer_end = -1;  // -1: through the last layer
  int tp_rank = 0;
  int tp_size = 1;
};

// Where a shard's forward pass runs.
enum class Backend {
  kCpu,   // fp32 reference (OpenBLAS + a thread pool); always available
  kCuda,  // bf16 weights/activations, fp32 accumulation; -DPDSERVE_CUDA=ON
};

// Which attention kernels the CUDA backend runs.
enum class AttentionKernels {
  // Decode and verify steps: flash-decoding on CUDA cores (a GQA group's
  // query heads and a verify step's tokens share each K/V tile, the context
  // split across blocks); prefill chunks and mixed steps: tensor-core
  // FlashAttention tiles. Falls back to kLegacy for head dims neither holds.
  kAuto,
  // The first kernel (one warp per token, query head and partition): the
  // reference a wrong result is bisected against.
  kLegacy,
  // The tensor-core prefill kernel for every step, decode included (tests
  // check it on the goldens' decode steps too).
  kTensorCore,
};

struct CudaOptions {
  int device = 0;
  AttentionKernels attention = AttentionKernels::kAuto;
  // Replay decode/verify steps from CUDA Graphs (captured per batch bucket).
  // false = eager launches of the same kernels: the first thing to compare
  // against when graph output differs.
  bool use_graphs = true;
  // Largest batch (sequences) a graph is captured for; bigger steps run eager.
  int max_graph_batch = 128;
  // Largest query tokens per sequence a graph covers (1 = decode, γ+1 =
  // verify). Steps with mixed counts or prefill chunks run eager.
  int max_graph_tokens_per_sequence = 8;
  // Largest tokens one Forward may carry (sizes the activation buffers).
  int max_tokens_per_step = 8192;
  // Largest logits rows one Forward may ask for (sizes the [rows, vocab]
  // logits buffer of the last-layer shard). 0: enough for the largest graph
  // step and at least 256 rows. A prefill stage scoring prompts needs one row
  // per microbatch token.
  int max_logit_rows = 0;
  // Decode/verify steps whose sequences feed different query counts replay
  // the graph of the largest, padding the others, while the padded step has
  // at most this many tokens or twice the real ones (beyond that the padded
  // GEMM rows cost more than eager launches save). Unmeasured default.
  int max_ragged_graph_tokens = 256;
  // Largest sequences one Forward may carry (sizes the block tables).
  int max_sequences = 256;
  // Fuse the residual add into the next RMSNorm (one kernel instead of two);
  // false runs them separately, for measuring the fusion.
  bool fuse_residual_norm = true;
  // Steps of 1-2 rows multiply by the weights with pdserve's own
  // GEMV (one pass over each weight row, no split-K reduction launch);
  // false sends them to cuBLAS like bigger steps, for measuring it.
  bool small_batch_gemv = true;
  // kLegacy only: keys per attention partition (split-K over the context
  // for decode). A floor: the backend raises it so that the longest context
  // needs at most 64 partitions. The other kernels size their splits per
  // step from the batch, the context and the GPU's multiprocessors.
  int attention_partition = 128;
};

// How the CPU backend multiplies block-quantized weights (Q8_0, Q4_K, Q6_K).
enum class QuantizedMatmul {
  // Activations rounded to int8 per block (llama.cpp's scheme): integer dot
  // products, several times faster; logits within ~1e-2 of the exact
  // product's (engine/int8_dot.h, tests/engine/quant_engine_test).
  kInt8Activations,
  // f32 products of the dequantized weights, bit-identical values to an f32
  // model of the same weights up to summation order.
  kExact,
};

// How tensor-parallel ranks share a mixture-of-experts layer's routed
// experts (attention and dense layers are tensor parallel either way).
enum class ExpertParallelism {
  // Every rank holds every expert's rows [r I/T, (r+1) I/T): one all-reduce
  // after the experts, as for a dense MLP; a rank's experts get narrow.
  kTensor,
  // Rank r holds experts [r E/T, (r+1) E/T) whole: each rank runs the
  // tokens routed to its experts (the router runs everywhere: the hidden
  // states are replicated after attention's all-reduce) and the all-reduce
  // after the experts combines their outputs.
  kExpert,
};
std::string_view ExpertParallelismName(ExpertParallelism mode);

struct EngineOptions {
  ShardSpec shard;
  ExpertParallelism expert_parallelism = ExpertParallelism::kTensor;
  // Threads for attention and element-wise work, counting the caller
  // (0 = hardware concurrency). GEMMs use OpenBLAS's own threads. CPU only.
  int num_threads = 0;
  // Required when shard.tp_size > 1; not owned. Its rank/size must match.
  // The CUDA backend reduces device buffers in place when this is a
  // comm::NcclCommunicator, and stages through host memory otherwise.
  comm::Communicator* communicator = nullptr;
  Backend backend = Backend::kCpu;
  CudaOptions cuda;
  // Element type of the KV cache; unset = the backend's own (CPU f32, CUDA
  // bf16). The CPU backend also keeps bf16 (half the KV memory and transfer
  // bytes, attention math still f32); the CUDA backend only bf16. Prefill
  // and decode must agree: KvLayout reports it and the transport checks it.
  std::optional<kv::KvDType> kv_dtype;
  // CPU only; the CUDA backend holds no block-quantized weights.
  QuantizedMatmul quantized_matmul = QuantizedMatmul::kInt8Activations;
};

// The KV element type an engine with these settings keeps.
inline kv::KvDType ResolvedKvDType(Backend backend,
                                   std::optional<kv::KvDType> kv_dtype) {
  if (kv_dtype.has_value()) return *kv_dtype;
  return backend == Backend::kCuda ? kv::KvDType::kBF16 : kv::KvDType::kF32;
}

// One sequence's share of a forward step.
struct SequenceStep {
  // Query token ids; read only when the engine holds layer 0. When it does not,
  // only the count matters (its hidden states come in ForwardBatch).
  std::span<const int32_t> tokens;
  int num_tokens = 0;  // query tokens of this step (== tokens.size() if given)
  int start_position = 0;  // tokens of this sequence already in the KV cache
  // Block ids of this sequence, covering positions [0, start_position +
  // num_tokens).
  std::span<const int32_t> block_table;
  // Query indices (0-based within this step, ascending) that need logits;
  // ignored unless the engine holds the last layer.
  std::vector<int> logit_indices;

  // Σ over the query tokens of the positions each attends to, its own
  // included (query i sees start_position + i + 1): the step's attention
  // work, as the layout planner's step costs take it.
  int64_t AttendedPositions() const {
    return int64_t{num_tokens} * start_position +
           int64_t{num_tokens} * (num_tokens + 1) / 2;
  }
};

struct ForwardBatch {
  std::vector<SequenceStep> sequences;
  // Hidden states of every query token, sequences concatenated in order,
  // [total_tokens, hidden]; required iff the engine does not hold layer 0.
  std::span<const float> hidden_in;
  // The caller needs only each logit row's argmax (greedy decoding without
  // log-probabilities): ForwardResult::logits may then be left empty, which
  // saves the CUDA backend copying [rows, vocab] floats to the host.
  bool argmax_only = false;
};

struct ForwardResult {
  // [total_tokens, hidden]; filled iff the engine does not hold the last layer.
  std::vector<float> hidden_out;
  // [rows, vocab]: one row per requested logit index, sequences in order.
  // Reuse one ForwardResult across steps where rows are many (prompt
  // scoring): the CPU backend resizes this buffer instead of allocating it.
  std::vector<float> logits;
  // Per logit row, the index of its largest logit (the lowest on ties).
  std::vector<int32_t> argmax;
  int num_logit_rows = 0;
};

}  // namespace pdserve::engine
