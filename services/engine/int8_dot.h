// Internal to services/engine: products of block-quantized weight rows
// (Q8_0, Q4_K, Q6_K) with activations quantized to int8, as llama.cpp
// multiplies them (its q8_0 / q8_K activation blocks).
//
// Why: dequantizing each weight to f32 costs about five vector ops per eight
// weights (unpack, convert, scale, FMA), which makes quantized decode
// compute-bound at a third of the speed its memory traffic allows. With the
// activations in int8, 32 weights take one multiply-add of bytes into 16-bit
// pairs and one of those pairs by the sub-block's integer scale into int32
// lanes; floats appear once per 8 blocks (Q8_0) or super-block (Q4_K, Q6_K).
// Prefill chunks (16 rows and more; VNNI for Q8_0, AVX-512 for Q4_K) repack
// each weight row per product so that one vpdpbusd covers 4 values of each
// of 8 blocks (Q8_0) or sub-blocks (Q4_K).
//
// Numerics. Each activation row is rounded to int8 per block of 32 values
// (Q8_0 weights) or 256 (K-quant weights), scale max|x|/127. The integer
// parts are exact, so a product differs from the dequantized-weight f32
// product only by that rounding: |x - d·q| <= d/2 per value, a relative
// error of about 1/254 per block in the worst case and ~0.3% of a dot
// product's magnitude on average. tests/engine/quant_engine_test states the
// whole-model tolerance this gives.
//
// Determinism. Every (activation row, weight row) pair goes through the same
// float operations in the same order whatever the number of rows multiplied
// together (the integer parts may be summed in another order, exactly), so
// a sequence's logits do not depend on what it is batched with (a decode
// step of 1 row, a speculative verify of 5 and a 512-token prefill chunk
// give each row the same values).
#pragma once

#include <cstdint>
#include <new>
#include <vector>

#include "model/quant_formats.h"

namespace pdserve::engine::internal {

// Q8_0 products sum the integer dot products of 8 blocks into the 8 lanes of
// one vector before any float arithmetic: per group of 8 blocks, one
// convert, one scale product and one FMA (per block that was 5 ops per 32
// multiply-adds, more than the integer work).
inline constexpr int64_t kQ8_0GroupBlocks = 8;
// Q4_K products (AVX-512 builds) likewise sum the integers of 4 blocks of
// 256, split into even and odd sub-blocks of 32, into the 8 lanes of one
// vector per float step.
inline constexpr int64_t kKQuantGroupBlocks = 4;

// Allocations on 64-byte (cache line) boundaries: the kernels' 512-bit loads
// of packed rows are whole cache lines only then (a split line costs a
// second load; measured 1.4-2x on whole products with 16-byte-aligned
// vectors).
template <typename T>
struct CacheAlignedAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlignment{64};
  CacheAlignedAllocator() = default;
  template <typename U>
  CacheAlignedAllocator(const CacheAlignedAllocator<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), kAlignment));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, kAlignment); }
  bool operator==(const CacheAlignedAllocator&) const { return true; }
};
template <typename T>
using CacheAlignedVector = std::vector<T, CacheAlignedAllocator<T>>;

// Whether this build has the int8 kernels (AVX2; VNNI used when present).
bool Int8ActivationKernelsAvailable();

// Activation rows rounded to int8 for the formats of one matrix.
class Int8Activations {
 public:
  // Rounds rows [0, n) of x (`cols` wide; cols a multiple of 32, and of 256
  // when `for_k_quants`) per 32 values when `for_q8_0` and per 256 values
  // (with the sum of every 16) when `for_k_quants`.
  void Quantize(const float* x, int64_t n, int64_t cols, bool for_q8_0,
                bool for_k_quants);
  // The same in two steps, so threads can round disjoint rows: Resize, then
  // QuantizeRows over ranges of [0, n) (x is all n rows).
  void Resize(int64_t n, int64_t cols, bool for_q8_0, bool for_k_quants);
  void QuantizeRows(const float* x, int64_t t0, int64_t t1);

  int64_t rows() const { return n_; }
  int64_t cols() const { return cols_; }
  // Row t of the per-32 rounding: cols int8 values and its block scales,
  // zero-padded to a whole group of kQ8_0GroupBlocks.
  const int8_t* q32(int64_t t) const { return q32_.data() + t * cols_; }
  const float* d32(int64_t t) const {
    return d32_.data() + t * q8_0_padded_blocks_;
  }
  // Whether rows also come in the packed Q8_0 form below (wide inputs on
  // VNNI machines: prefill chunks).
  bool has_packed_q8_0() const { return has_packed_q8_0_; }
  // Row t of the per-32 rounding packed for the prefill kernel: per group
  // of 8 blocks, 8 chunks of 32 bytes; chunk j holds bytes 4j..4j+3 of each
  // block of the group, as q + 128 (unsigned), padding blocks 128.
  const uint8_t* packed_q8_0(int64_t t) const {
    return packed_q8_0_.data() + t * q8_0_padded_blocks_ * 32;
  }
  // Row t of the per-256 rounding: values, cols/256 scales (zero-padded to
  // a whole group of kKQuantGroupBlocks), cols/16 sums.
  const int8_t* q256(int64_t t) const { return q256_.data() + t * cols_; }
  const float* d256(int64_t t) const {
    return d256_.data() + t * k_padded_blocks_;
  }
  // Whether rows also come in the packed K-quant form below (wide inputs on
  // AVX-512 VNNI machines: prefill chunks).
  bool has_packed_k() const { return has_packed_k_; }
  // Row t of the per-256 rounding packed for the prefill kernel: per block
  // of 256, 8 chunks of 32 bytes; chunk j holds values 4j..4j+3 of the
  // block's sub-blocks of 32 in the order 0, 2, 4, 6, 1, 3, 5, 7.
  const int8_t* packed_k(int64_t t) const {
    return packed_k_.data() + t * cols_;
  }
  const int16_t* sums16(int64_t t) const {
    return sums16_.data() + t * (cols_ / 16);
  }
  // The same sums times their block's scale, per 16 and per 32 values (the
  // K-quant min/offset terms multiply these).
  const float* scaled_sums16(int64_t t) const {
    return scaled_sums16_.data() + t * (cols_ / 16);
  }
  const float* scaled_sums32(int64_t t) const {
    return scaled_sums32_.data() + t * (cols_ / 32);
  }

  // Activation value (t, k) as the kernels see it (tests).
  float Value(model::TensorFormat format, int64_t t, int64_t k) const;

 private:
  int64_t n_ = 0, cols_ = 0, q8_0_padded_blocks_ = 0, k_padded_blocks_ = 0;
  bool for_q8_0_ = false, for_k_quants_ = false;
  bool has_packed_q8_0_ = false, has_packed_k_ = false;
  CacheAlignedVector<int8_t> q32_, q256_, packed_k_;
  CacheAlignedVector<uint8_t> packed_q8_0_;
  CacheAlignedVector<float> d32_, d256_;
  CacheAlignedVector<int16_t> sums16_;
  CacheAlignedVector<float> scaled_sums16_, scaled_sums32_;
};

// y[t·ldy + r] = Σ_k w_r[k]·x_t[k] for every activation row t of x and
// weight rows r in [0, row_count), w_r the quantized row at
// rows + r·row_bytes (`cols` values of `format`: Q8_0, Q4_K or Q6_K).
void Int8RowDots(model::TensorFormat format, const uint8_t* rows,
                 int64_t row_bytes, int64_t row_count, int64_t cols,
                 const Int8Activations& x, float* y, int64_t ldy);

}  // namespace pdserve::engine::internal
