// y[n, out] = x[n, in] · w[out, in]^T — the projection every layer runs.
//
// Decode batches are skinny (n = 1..64 rows): a BLAS sgemm packs the whole
// weight matrix for each call, which costs more than the math at these sizes.
// SkinnyMatMul streams each weight row once from memory and multiplies it into
// all n activation rows while it sits in L1 (register-blocked 4 weight rows x
// 4 activation rows, AVX2/FMA when compiled for it). Wide inputs (prefill
// chunks) go to OpenBLAS sgemm, which is compute-optimal there.
#pragma once

#include <cstdint>

namespace pdserve {
class ThreadPool;
}

namespace pdserve::engine {

// Below this many activation rows the skinny kernel is used.
inline constexpr int64_t kSkinnyMatMulMaxRows = 64;

void SkinnyMatMul(const float* x, int64_t n, int64_t in, const float* w,
                  int64_t out, float* y, ThreadPool& pool);

// Dispatches between SkinnyMatMul and OpenBLAS by n.
void MatMulTransposedWeights(const float* x, int64_t n, int64_t in,
                             const float* w, int64_t out, float* y,
                             ThreadPool& pool);

// Σ a[i]·b[i] with 8-wide FMA lanes (the compiler will not reorder a float
// reduction by itself). Used for attention scores.
float DotProduct(const float* a, const float* b, int64_t n);

// y[i] += alpha · x[i].
void Axpy(float alpha, const float* x, float* y, int64_t n);

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
