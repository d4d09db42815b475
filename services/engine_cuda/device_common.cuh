// Helpers every .cu of the CUDA backend uses: the launch status, bf16 views of
// the uint16_t pointers kernels.h passes, and warp reductions. Internal to
// services/engine_cuda.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace pdserve::engine::cuda::device {

inline constexpr unsigned kFullMask = 0xffffffffu;
inline constexpr int kWarp = 32;

// The last launch's error, as a status naming `what`.
inline absl::Status LaunchStatus(const char* what) {
  const cudaError_t error = cudaGetLastError();
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, " launch failed: ", cudaGetErrorString(error)));
}

__host__ __device__ __forceinline__ __nv_bfloat16* AsBf16(uint16_t* p) {
  return reinterpret_cast<__nv_bfloat16*>(p);
}
__host__ __device__ __forceinline__ const __nv_bfloat16* AsBf16(
    const uint16_t* p) {
  return reinterpret_cast<const __nv_bfloat16*>(p);
}

__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(kFullMask, v, offset);
  }
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  }
  return v;
}

}  // namespace pdserve::engine::cuda::device
