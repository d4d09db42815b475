// Command-line spellings of the engine backend, shared by every binary that
// runs an engine (pdserve generate, decode_worker, prefill_worker):
//   --backend cpu|cuda  --cuda-devices 0[,1,...]  --cuda-graphs 1|0
//   --kv-dtype auto|f32|bf16  --cuda-attention auto|legacy|tensor-core
//   --quantized-matmul int8|exact
#pragma once

#include <optional>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/engine_types.h"

namespace pdserve::engine {

// "cpu" or "cuda"; INVALID_ARGUMENT names the accepted values.
[[nodiscard]] absl::StatusOr<Backend> ParseBackend(std::string_view name);
const char* BackendName(Backend backend);

// --kv-dtype: "auto" (the backend's own: nullopt), "f32", "bf16" or "f16";
// INVALID_ARGUMENT otherwise. Whether the backend keeps that type is checked
// when the engine is created.
[[nodiscard]] absl::StatusOr<std::optional<kv::KvDType>> ParseKvDTypeFlag(
    std::string_view name);

// --cuda-attention: "auto", "legacy" or "tensor-core" (CudaOptions::
// attention); INVALID_ARGUMENT names the accepted values.
[[nodiscard]] absl::StatusOr<AttentionKernels> ParseAttentionKernels(
    std::string_view name);
const char* AttentionKernelsName(AttentionKernels kernels);

// --quantized-matmul: "int8" (activations rounded to int8, the default) or
// "exact" (f32 products of the dequantized weights); INVALID_ARGUMENT names
// the accepted values.
[[nodiscard]] absl::StatusOr<QuantizedMatmul> ParseQuantizedMatmul(
    std::string_view name);
const char* QuantizedMatmulName(QuantizedMatmul mode);
// --moe-parallel: tp | ep (ExpertParallelism).
[[nodiscard]] absl::StatusOr<ExpertParallelism> ParseExpertParallelism(
    std::string_view name);

// "0,1,3" -> {0, 1, 3}; INVALID_ARGUMENT for anything but non-negative
// integers separated by commas.
[[nodiscard]] absl::StatusOr<std::vector<int>> ParseDeviceList(
    std::string_view list);

}  // namespace pdserve::engine
