// For `gpu`-labelled tests: whether a CUDA device is visible, so a test can
// GTEST_SKIP cleanly on a machine without one (header-only; the test links
// CUDA::cudart).
#pragma once

#include <cuda_runtime.h>

namespace pdserve::testing {

inline int CudaDevices() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return devices;
}

inline bool GpuVisible() { return CudaDevices() > 0; }

}  // namespace pdserve::testing
