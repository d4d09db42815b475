// y[n, out] = x[n, in] · w[out, in]^T — the projection every layer runs.
//
// The engine keeps each projection matrix packed for its own kernel
// (PackedMatrix): panels of kPanelRows output rows, each panel stored k-major
// ([in][kPanelRows]) and 64-byte aligned. One micro-kernel step loads a
// 16-float column of a panel (two AVX2 vectors) and broadcasts one activation
// of each of up to 6 rows into it: 12 accumulators, 2 loads + 6 broadcasts per
// 12 FMAs, the register tile optimized BLAS kernels use on AVX2. Packing once
// at load time is what lets it beat OpenBLAS at decode batch sizes: sgemm must
// pack the weight matrix on every call, which at a handful of rows costs more
// than the math (bench/engine_bench measures both, docs/PERFORMANCE.md).
// At one row it streams the weights once, so decode at batch 1 stays bound by
// memory bandwidth; at prefill sizes it blocks k and rows for the caches.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/large_buffer.h"
#include "model/quant_formats.h"

namespace pdserve {
class ThreadPool;
}

namespace pdserve::engine {

// Output rows per panel: two 8-float AVX2 vectors.
inline constexpr int64_t kPanelRows = 16;

// A [rows, cols] weight matrix in the panel layout described above; rows past
// the last full panel are zero.
class PackedMatrix {
 public:
  PackedMatrix() = default;
  // Packs row-major `w` ([rows, cols]). Empty when rows or cols is 0;
  // RESOURCE_EXHAUSTED when the memory cannot be had.
  static absl::StatusOr<PackedMatrix> Pack(const float* w, int64_t rows,
                                           int64_t cols);

  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  int64_t panels() const { return (rows_ + kPanelRows - 1) / kPanelRows; }
  // Element (row, col) of the original matrix (tests, debugging).
  float At(int64_t row, int64_t col) const;
  // Panel p: cols() groups of kPanelRows floats.
  const float* panel(int64_t p) const {
    return static_cast<const float*>(data_.data()) + p * cols_ * kPanelRows;
  }

 private:
  // On huge pages (common/large_buffer.h): a decode step streams it all.
  LargeBuffer data_;
  int64_t rows_ = 0, cols_ = 0;
};

// y[n, w.rows()] = x[n, w.cols()] · w^T, spread over `pool`.
void PackedMatMul(const float* x, int64_t n, const PackedMatrix& w, float* y,
                  ThreadPool& pool);

// A projection matrix whose rows keep the format they were stored in: runs
// of output rows ("segments"), each one of
//   - f32: packed into PackedMatrix panels (a copy, as PackedMatMul uses);
//   - f16: packed into panels of halves (a copy of f16 size), widened in
//     registers by the same micro-kernel: half the bytes a decode step
//     streams;
//   - Q8_0 / Q4_K / Q6_K: the stored blocks read in place (the mapped
//     file), never widened at load; kernels dequantize them as they go.
// A fused projection (q|k|v, gate|up) may mix formats (Q4_K_M files store
// some v and down projections as Q6_K).
class WeightMatrix {
 public:
  WeightMatrix() = default;
  WeightMatrix(WeightMatrix&&) = default;
  WeightMatrix& operator=(WeightMatrix&&) = default;

  // Appends `rows` f32 rows (row-major, `cols` wide), packed into panels.
  [[nodiscard]] absl::Status AppendF32(const float* w, int64_t rows,
                                       int64_t cols);
  // Appends `rows` stored rows of `format`, row r at data + r * row_bytes
  // (a column range of a wider tensor keeps the full rows' stride), `cols`
  // values each. F32/F16/BF16 rows are packed (BF16 widened to f32);
  // quantized rows are referenced in place, `cols` and the start a whole
  // number of blocks, and `owner` keeps them alive. A non-zero
  // `interleaved_head_dim` says rows are in Meta's interleaved RoPE order
  // within heads of that many rows: outputs come out in HF rotate-half
  // order all the same.
  [[nodiscard]] absl::Status AppendStored(model::TensorFormat format,
                                          const uint8_t* data,
                                          int64_t row_bytes, int64_t rows,
                                          int64_t cols,
                                          int interleaved_head_dim,
                                          std::shared_ptr<const void> owner);

  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  // Bytes of weights the kernels read (packed copies and mapped blocks).
  int64_t bytes() const;
  // e.g. "Q4_K 1024 + Q6_K 256 rows".
  std::string FormatSummary() const;
  // Element (row, col) as the kernels see it (tests).
  float At(int64_t row, int64_t col) const;

  // Quantized rows multiply activations rounded to int8 (per 32 values for
  // Q8_0, per 256 for Q4_K/Q6_K, like llama.cpp) instead of the exact f32
  // product of the dequantized weights: several times fewer instructions per
  // weight, at a rounding error of ~1/254 per activation block (int8_dot.h).
  // Ignored where the build has no int8 kernels (no AVX2).
  void set_int8_activations(bool on) { int8_activations_ = on; }
  bool int8_activations() const;

  struct Segment;

 private:
  absl::Status CheckCols(int64_t cols);
  friend void MatMul(const float* x, int64_t n, const WeightMatrix& w, float* y,
                     ThreadPool& pool);
  std::vector<std::shared_ptr<const Segment>> segments_;
  int64_t rows_ = 0, cols_ = 0;
  bool int8_activations_ = false;
};

// y[n, w.rows()] = x[n, w.cols()] · w^T, spread over `pool`. Quantized rows
// are dequantized inside the kernels: one row at a time against the few
// activation rows of a decode step, into f32 panel slices for wider inputs.
void MatMul(const float* x, int64_t n, const WeightMatrix& w, float* y,
            ThreadPool& pool);

// The same product with OpenBLAS on the row-major matrix: single-threaded
// sgemm per slice of output columns, the slices spread over `pool` (all
// parallelism in one pool, so OpenBLAS's spinning workers never compete with
// ours). The engine does not use it; bench/engine_bench and the tests compare
// PackedMatMul against it.
void BlasMatMul(const float* x, int64_t n, int64_t in, const float* w,
                int64_t out, float* y, ThreadPool& pool);

// Σ a[i]·b[i] with 8-wide FMA lanes (the compiler will not reorder a float
// reduction by itself). Used for attention scores.
float DotProduct(const float* a, const float* b, int64_t n);

// p[0, n) = softmax(p[0, n)) in place (subtracting the maximum first), with
// 8-wide exp: the libm call per element and the scalar max/sum loops (GCC
// does not vectorize float reductions) were ~15% of a long prefill.
void SoftmaxInPlace(float* p, int64_t n);

// Largest of x[0, n) (-inf for n = 0); 8-wide.
float MaxOf(const float* x, int64_t n);

// Index of the first x[i] > threshold (>= with `or_equal`) in [0, n), or n;
// 8 elements per compare. What a vocabulary-wide arg-max or top-N scan
// spends its time on: almost every logit is below the bar.
int64_t FirstAbove(const float* x, int64_t n, float threshold, bool or_equal);

// log Σ e^x[i] (max + log Σ e^(x[i] - max)), the log-softmax normalizer of a
// logits row, with the same 8-wide exp (relative error < 2e-7 per term) and
// a double total: ~10x the libm loop at a 32k vocabulary. -inf for n = 0.
double LogSumExp(const float* x, int64_t n);

// out[i] = silu(gate[i]) · up[i] = gate[i] / (1 + e^-gate[i]) · up[i].
void SiluMul(const float* gate, const float* up, float* out, int64_t n);

// y[i] += alpha · x[i].
void Axpy(float alpha, const float* x, float* y, int64_t n);

// Attention for a few queries over a block of keys (decode and verify steps,
// where there is no query block big enough for a GEMM):
// scores[j] = scale · Σ_d q[d] · keys[j·dim + d] for j < count. Eight keys
// at a time share each load of q, and their eight sums are reduced together
// (one horizontal pass per eight keys, not per key).
void ScoreKeys(const float* q, const float* keys, int64_t count, int64_t dim,
               float scale, float* scores);
// The same over bf16 keys (a bf16 KV pool), widened in registers.
void ScoreKeys(const float* q, const uint16_t* keys, int64_t count, int64_t dim,
               float scale, float* scores);

// out[d] += Σ_j weights[j] · rows[j·dim + d] for j < count, d < dim: `out`
// stays in registers across the rows (one load and store per call, not per
// row).
void AccumulateWeightedRows(const float* weights, const float* rows,
                            int64_t count, int64_t dim, float* out);
void AccumulateWeightedRows(const float* weights, const uint16_t* rows,
                            int64_t count, int64_t dim, float* out);

// out[i] = the bf16 bit pattern in[i] as a float (exact: a shift), 8 at a
// time. How a bf16 KV pool's blocks reach the f32 attention math.
void Bf16RowToFloat(const uint16_t* in, float* out, int64_t n);

// out[i] = in[i] rounded to bf16, nearest-even (NaN stays NaN), 8 at a time.
void FloatRowToBf16(const float* in, uint16_t* out, int64_t n);

// C[m x n] = alpha · A[m x k] · op(B) on the calling thread (row-major, with
// leading dimensions), where op(B) is B[k x n], or B[n x k] transposed when
// `transpose_b`. C is overwritten.
void GemmRowMajor(bool transpose_b, int64_t m, int64_t n, int64_t k,
                  float alpha, const float* a, int64_t lda, const float* b,
                  int64_t ldb, float* c, int64_t ldc);

// Prefill chunks of at least this many queries take the GEMM attention path.
inline constexpr int kTiledAttentionMinQueries = 8;

// Makes OpenBLAS run every call on the calling thread (process-wide). The
// engine parallelizes GEMMs itself; BLAS threads would only contend.
void UseSingleThreadedBlas();

}  // namespace pdserve::engine
