// The CUDA backend's entry points in a build without -DPDSERVE_CUDA=ON.
#include "engine/engine_backend.h"

namespace pdserve::engine {

absl::StatusOr<std::unique_ptr<EngineBackend>> CreateCudaBackend(
    const model::WeightSource&, const EngineOptions&, ShardPlan) {
  return absl::UnimplementedError(
      "the CUDA backend is not in this build (configure with "
      "-DPDSERVE_CUDA=ON)");
}

bool CudaBackendCompiled() { return false; }

absl::StatusOr<std::unique_ptr<comm::InProcessGroup>> CreateNcclGroup(
    int, const std::vector<int>&) {
  return absl::UnimplementedError(
      "NCCL is not in this build (configure with -DPDSERVE_CUDA=ON)");
}

}  // namespace pdserve::engine
