// The NCCL backend of comm::Communicator: one communicator per rank/GPU, for
// the decode worker's tensor-parallel all-reduces on GPUs. Compiled only with
// -DPDSERVE_CUDA=ON (target pdserve_comm_nccl); CI builds it on the CPU
// machine, and its tests (label `gpu`) skip cleanly where no GPU is present.
//
// Ranks may be threads of one process (NcclGroup::Create: ncclCommInitAll over
// a device list; NCCL refuses two ranks of one communicator on the same GPU)
// or processes
// (NcclCommunicator::Create with a unique id passed out of band, e.g. in a
// gRPC field, from rank 0 to the others).
//
// AllReduceSum(span) takes host memory, like the CPU backend, so the same
// engine code runs over either (it stages through a device buffer owned by
// the communicator). A CUDA engine passes device memory to
// AllReduceSumDevice instead, on its own stream.
//
// Results: NCCL's ring all-reduce delivers the same reduced bytes to every
// rank (each reduced chunk is computed once and broadcast along the ring), so
// the bitwise-identical guarantee of the interface holds for NCCL_ALGO=Ring;
// other algorithms (Tree, NVLS) may differ by rounding between ranks.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/communicator.h"

// Opaque CUDA/NCCL handles: keep cuda_runtime.h and nccl.h out of includers.
struct ncclComm;
struct CUstream_st;

namespace pdserve::comm {

class NcclCommunicator final : public Communicator {
 public:
  // 128 bytes (NCCL_UNIQUE_ID_BYTES) made by rank 0, given to every rank.
  [[nodiscard]] static absl::StatusOr<std::string> NewUniqueId();
  // Joins the group `unique_id` names as `rank` of `size`, on `device`.
  // Blocks until every rank joined (NCCL's init is collective).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(
      const std::string& unique_id, int rank, int size, int device);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int device() const { return device_; }
  // Host data: copied to the device, reduced, copied back (blocking).
  [[nodiscard]] absl::Status AllReduceSum(std::span<float> data) override;
  // Device data, enqueued on `stream` (null: the communicator's own stream)
  // and waited for.
  [[nodiscard]] absl::Status AllReduceSumDevice(float* device_data,
                                                size_t count,
                                                CUstream_st* stream = nullptr);
  // Enqueues the in-place all-reduce of device data on `stream` and returns
  // without waiting: what a CUDA engine calls between its kernels, and what a
  // CUDA Graph capture records. Time is not counted in
  // seconds_in_collectives (it runs on the device).
  [[nodiscard]] absl::Status EnqueueAllReduceSumDevice(float* device_data,
                                                       size_t count,
                                                       CUstream_st* stream);
  double seconds_in_collectives() const override { return seconds_; }
  // ncclCommAbort: collectives waiting for a peer that will never arrive
  // return, and every later call fails with CANCELLED. Safe from any thread
  // (it is how a stuck rank is woken); idempotent.
  void Abort();

 private:
  friend class NcclGroup;
  NcclCommunicator(ncclComm* comm, int rank, int size, int device);
  absl::Status Reserve(size_t count);
  absl::Status CheckNotAborted() const;

  ncclComm* comm_ = nullptr;
  CUstream_st* stream_ = nullptr;
  float* staging_ = nullptr;  // device
  size_t staging_count_ = 0;
  const int rank_;
  const int size_;
  const int device_;
  double seconds_ = 0;
  std::atomic<bool> aborted_{false};
};

// `size` ranks as threads of this process on `devices` (rank r on
// devices[r % devices.size()]; NCCL needs them distinct: FAILED_PRECONDITION
// names the shared GPU). Each rank's communicator must be used by one thread
// at a time; collectives of different ranks must run concurrently (one thread
// per rank), as with the host InProcessGroup it stands in for.
class NcclGroup final : public InProcessGroup {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<NcclGroup>> Create(
      int size, const std::vector<int>& devices);
  NcclCommunicator* rank(int r) override { return ranks_[r].get(); }
  int size() const override { return static_cast<int>(ranks_.size()); }
  // Aborts every rank's communicator (NcclCommunicator::Abort).
  void Shutdown() override;

 private:
  std::vector<std::unique_ptr<NcclCommunicator>> ranks_;
};

// Number of CUDA devices visible (0 without a driver or GPU).
int CudaDeviceCount();

}  // namespace pdserve::comm
