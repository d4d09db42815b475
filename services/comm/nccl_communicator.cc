#include "comm/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace pdserve::comm {
namespace {

absl::Status CudaStatus(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorString(error)));
}

absl::Status NcclStatus(ncclResult_t result, const char* what) {
  if (result == ncclSuccess) return absl::OkStatus();
  const absl::StatusCode code =
      result == ncclInvalidArgument || result == ncclInvalidUsage
          ? absl::StatusCode::kInvalidArgument
          : absl::StatusCode::kInternal;
  return absl::Status(code,
                      absl::StrCat(what, ": ", ncclGetErrorString(result)));
}

}  // namespace

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return count;
}

absl::StatusOr<std::string> NcclCommunicator::NewUniqueId() {
  ncclUniqueId id;
  if (absl::Status s = NcclStatus(ncclGetUniqueId(&id), "ncclGetUniqueId");
      !s.ok()) {
    return s;
  }
  return std::string(id.internal, sizeof(id.internal));
}

NcclCommunicator::NcclCommunicator(ncclComm* comm, int rank, int size,
                                   int device)
    : comm_(comm), rank_(rank), size_(size), device_(device) {}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    const std::string& unique_id, int rank, int size, int device) {
  if (unique_id.size() != NCCL_UNIQUE_ID_BYTES) {
    return absl::InvalidArgumentError(
        absl::StrCat("NCCL unique id must be ", NCCL_UNIQUE_ID_BYTES,
                     " bytes, got ", unique_id.size()));
  }
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is not in [0, ", size, ")"));
  }
  if (device < 0 || device >= CudaDeviceCount()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no CUDA device ", device, " (", CudaDeviceCount(), " visible)"));
  }
  if (absl::Status s = CudaStatus(cudaSetDevice(device), "cudaSetDevice");
      !s.ok()) {
    return s;
  }
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  ncclComm_t comm = nullptr;
  if (absl::Status s = NcclStatus(ncclCommInitRank(&comm, size, id, rank),
                                  "ncclCommInitRank");
      !s.ok()) {
    return s;
  }
  auto out = std::unique_ptr<NcclCommunicator>(
      new NcclCommunicator(comm, rank, size, device));
  if (absl::Status s = CudaStatus(
          cudaStreamCreateWithFlags(&out->stream_, cudaStreamNonBlocking),
          "cudaStreamCreate");
      !s.ok()) {
    return s;
  }
  return out;
}

NcclCommunicator::~NcclCommunicator() {
  cudaSetDevice(device_);
  // An aborted communicator's resources were released by ncclCommAbort.
  if (comm_ != nullptr && !aborted_.load()) ncclCommDestroy(comm_);
  if (staging_ != nullptr) cudaFree(staging_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

void NcclCommunicator::Abort() {
  if (comm_ == nullptr || aborted_.exchange(true)) return;
  cudaSetDevice(device_);
  ncclCommAbort(comm_);
}

absl::Status NcclCommunicator::CheckNotAborted() const {
  if (!aborted_.load()) return absl::OkStatus();
  return absl::CancelledError(absl::StrCat("NCCL communicator of rank ", rank_,
                                           " was aborted (group shut down)"));
}

absl::Status NcclCommunicator::Reserve(size_t count) {
  if (count <= staging_count_) return absl::OkStatus();
  if (staging_ != nullptr) cudaFree(staging_);
  staging_ = nullptr;
  staging_count_ = 0;
  void* memory = nullptr;
  if (absl::Status s = CudaStatus(cudaMalloc(&memory, count * sizeof(float)),
                                  "cudaMalloc (all-reduce staging)");
      !s.ok()) {
    return s;
  }
  staging_ = static_cast<float*>(memory);
  staging_count_ = count;
  return absl::OkStatus();
}

absl::Status NcclCommunicator::AllReduceSumDevice(float* device_data,
                                                  size_t count,
                                                  CUstream_st* stream) {
  if (absl::Status status = CheckNotAborted(); !status.ok()) return status;
  const auto start = std::chrono::steady_clock::now();
  cudaStream_t s = stream != nullptr ? stream : stream_;
  if (absl::Status status = CudaStatus(cudaSetDevice(device_), "cudaSetDevice");
      !status.ok()) {
    return status;
  }
  if (absl::Status status =
          NcclStatus(ncclAllReduce(device_data, device_data, count, ncclFloat,
                                   ncclSum, comm_, s),
                     "ncclAllReduce");
      !status.ok()) {
    return status;
  }
  absl::Status status =
      CudaStatus(cudaStreamSynchronize(s), "all-reduce stream");
  seconds_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  return status;
}

absl::Status NcclCommunicator::EnqueueAllReduceSumDevice(float* device_data,
                                                         size_t count,
                                                         CUstream_st* stream) {
  // No cudaSetDevice: the caller's thread already works on this device, and
  // a stream being captured must not see anything but the collective.
  if (absl::Status status = CheckNotAborted(); !status.ok()) return status;
  return NcclStatus(ncclAllReduce(device_data, device_data, count, ncclFloat,
                                  ncclSum, comm_, stream),
                    "ncclAllReduce");
}

absl::Status NcclCommunicator::AllReduceSum(std::span<float> data) {
  if (absl::Status status = CheckNotAborted(); !status.ok()) return status;
  if (data.empty()) return absl::OkStatus();
  if (absl::Status s = CudaStatus(cudaSetDevice(device_), "cudaSetDevice");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Reserve(data.size()); !s.ok()) return s;
  const size_t bytes = data.size() * sizeof(float);
  if (absl::Status s =
          CudaStatus(cudaMemcpyAsync(staging_, data.data(), bytes,
                                     cudaMemcpyHostToDevice, stream_),
                     "copy to device");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = AllReduceSumDevice(staging_, data.size(), stream_);
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          CudaStatus(cudaMemcpyAsync(data.data(), staging_, bytes,
                                     cudaMemcpyDeviceToHost, stream_),
                     "copy to host");
      !s.ok()) {
    return s;
  }
  return CudaStatus(cudaStreamSynchronize(stream_), "all-reduce copy back");
}

absl::StatusOr<std::unique_ptr<NcclGroup>> NcclGroup::Create(
    int size, const std::vector<int>& devices) {
  if (size < 1 || devices.empty()) {
    return absl::InvalidArgumentError("an NCCL group needs ranks and devices");
  }
  const int visible = CudaDeviceCount();
  for (int d : devices) {
    if (d < 0 || d >= visible) {
      return absl::FailedPreconditionError(
          absl::StrCat("no CUDA device ", d, " (", visible, " visible)"));
    }
  }
  std::vector<int> device_of(size);
  for (int r = 0; r < size; ++r) {
    device_of[r] = devices[r % devices.size()];
    for (int q = 0; q < r; ++q) {
      if (device_of[q] == device_of[r]) {
        return absl::FailedPreconditionError(absl::StrCat(
            "NCCL ranks ", q, " and ", r, " would share GPU ", device_of[r],
            "; an NCCL group needs one GPU per rank"));
      }
    }
  }
  std::vector<ncclComm_t> comms(size, nullptr);
  if (absl::Status s =
          NcclStatus(ncclCommInitAll(comms.data(), size, device_of.data()),
                     "ncclCommInitAll");
      !s.ok()) {
    return s;
  }
  auto group = std::unique_ptr<NcclGroup>(new NcclGroup());
  for (int r = 0; r < size; ++r) {
    group->ranks_.push_back(std::unique_ptr<NcclCommunicator>(
        new NcclCommunicator(comms[r], r, size, device_of[r])));
  }
  for (auto& rank : group->ranks_) {
    if (absl::Status s =
            CudaStatus(cudaSetDevice(rank->device_), "cudaSetDevice");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = CudaStatus(
            cudaStreamCreateWithFlags(&rank->stream_, cudaStreamNonBlocking),
            "cudaStreamCreate");
        !s.ok()) {
      return s;
    }
  }
  return group;
}

void NcclGroup::Shutdown() {
  for (auto& rank : ranks_) rank->Abort();
}

}  // namespace pdserve::comm
