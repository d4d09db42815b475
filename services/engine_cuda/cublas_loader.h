// The cuBLAS entry points the CUDA backend calls, resolved with dlopen from
// libcublas.so.<major> when the first CUDA engine starts, instead of linked.
//
// Why: linked, cuBLAS brings cuBLASLt, whose static initialisers run for
// ~0.4 s and map ~200 MB in every process that links the engine — CPU-only
// prefill and decode workers of a CUDA build, and every test binary — before
// main(), whether or not the process ever touches a GPU. Loaded here, only a
// process that creates a CUDA engine pays it.
#pragma once

#include <cublas_v2.h>

#include "absl/status/statusor.h"

namespace pdserve::engine::cuda {

struct CublasApi {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSetWorkspace_v2) set_workspace = nullptr;
  // Spelled out: C++ sees a second, inline cublasGemmEx overload (legacy
  // cudaDataType compute types) in cublas_api.h; this is the exported one.
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t,
                            cublasOperation_t, int m, int n, int k,
                            const void* alpha, const void* a, cudaDataType,
                            int lda, const void* b, cudaDataType, int ldb,
                            const void* beta, void* c, cudaDataType, int ldc,
                            cublasComputeType_t, cublasGemmAlgo_t) = nullptr;
};

// Loads cuBLAS once per process (thread-safe) and returns its entry points;
// later calls return the same table, or the same error:
// FAILED_PRECONDITION naming the library and the loader's reason when it
// cannot be loaded (also from the CUDA toolkit's own library folder), or the
// entry point it lacks.
absl::StatusOr<const CublasApi*> LoadCublas();

// Whether libcublas is mapped into this process now.
bool CublasMapped();

}  // namespace pdserve::engine::cuda
