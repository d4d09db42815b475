// The collective a tensor-parallel group needs: an all-reduce (sum) over the
// ranks of one decode worker. Backends: in-process threads (CPU ranks), and
// NCCL when CUDA is configured (decode issue / CUDA issue).
//
// Every rank of a group must call the same collectives in the same order with
// the same sizes. The in-process group checks the sizes (a mismatch is an
// error on every rank); NCCL cannot, so there a mismatch is the caller's bug.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace pdserve::comm {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place: every rank's `data` becomes the element-wise sum over ranks.
  // The result is bitwise identical on every rank (fixed summation order).
  // Blocking; returns CANCELLED if the group was shut down, INVALID_ARGUMENT
  // if ranks passed different sizes.
  [[nodiscard]] virtual absl::Status AllReduceSum(std::span<float> data) = 0;
  // Total seconds this rank spent inside collectives (for metrics/benchmarks).
  virtual double seconds_in_collectives() const = 0;
};

// A group of `size` ranks that live as threads of one process. The returned
// communicators share state; each must be used by one thread at a time.
class InProcessGroup {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<InProcessGroup>> Create(
      int size);
  virtual ~InProcessGroup() = default;
  virtual Communicator* rank(int r) = 0;
  virtual int size() const = 0;
  // Wakes every rank blocked in a collective with CANCELLED; later calls fail.
  virtual void Shutdown() = 0;
};

}  // namespace pdserve::comm
