#include "engine/backend_flags.h"

#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace pdserve::engine {

absl::StatusOr<Backend> ParseBackend(std::string_view name) {
  if (name == "cpu") return Backend::kCpu;
  if (name == "cuda") return Backend::kCuda;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown backend \"", std::string(name), "\" (expected cpu or cuda)"));
}

const char* BackendName(Backend backend) {
  return backend == Backend::kCuda ? "cuda" : "cpu";
}

absl::StatusOr<std::optional<kv::KvDType>> ParseKvDTypeFlag(
    std::string_view name) {
  if (name == "auto") return std::nullopt;
  for (kv::KvDType dtype :
       {kv::KvDType::kF32, kv::KvDType::kBF16, kv::KvDType::kF16}) {
    if (name == kv::KvDTypeName(dtype)) return dtype;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown KV dtype \"", std::string(name),
                   "\" (expected auto, f32, bf16 or f16)"));
}

absl::StatusOr<AttentionKernels> ParseAttentionKernels(std::string_view name) {
  for (AttentionKernels kernels :
       {AttentionKernels::kAuto, AttentionKernels::kLegacy,
        AttentionKernels::kTensorCore}) {
    if (name == AttentionKernelsName(kernels)) return kernels;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown attention kernels \"", std::string(name),
                   "\" (expected auto, legacy or tensor-core)"));
}

const char* AttentionKernelsName(AttentionKernels kernels) {
  switch (kernels) {
    case AttentionKernels::kAuto:
      return "auto";
    case AttentionKernels::kLegacy:
      return "legacy";
    case AttentionKernels::kTensorCore:
      return "tensor-core";
  }
  return "auto";
}

absl::StatusOr<QuantizedMatmul> ParseQuantizedMatmul(std::string_view name) {
  for (QuantizedMatmul mode :
       {QuantizedMatmul::kInt8Activations, QuantizedMatmul::kExact}) {
    if (name == QuantizedMatmulName(mode)) return mode;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown quantized matmul \"", std::string(name),
                   "\" (expected int8 or exact)"));
}

absl::StatusOr<ExpertParallelism> ParseExpertParallelism(
    std::string_view name) {
  for (ExpertParallelism mode :
       {ExpertParallelism::kTensor, ExpertParallelism::kExpert}) {
    if (name == ExpertParallelismName(mode)) return mode;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown --moe-parallel \"", std::string(name),
                   "\" (expected tp: every expert's rows split over the "
                   "ranks, or ep: whole experts per rank)"));
}

const char* QuantizedMatmulName(QuantizedMatmul mode) {
  return mode == QuantizedMatmul::kExact ? "exact" : "int8";
}

absl::StatusOr<std::vector<int>> ParseDeviceList(std::string_view list) {
  std::vector<int> devices;
  for (absl::string_view part :
       absl::StrSplit(absl::string_view(list.data(), list.size()), ',')) {
    int device = -1;
    if (!absl::SimpleAtoi(part, &device) || device < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad CUDA device list \"", std::string(list),
                       "\" (expected e.g. 0 or 0,1)"));
    }
    devices.push_back(device);
  }
  return devices;
}

}  // namespace pdserve::engine
