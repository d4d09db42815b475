// Anonymous memory for the large buffers a step streams every time it runs
// (packed weights, the KV pool), asking the kernel to back it with
// transparent huge pages (2 MiB) where it may.
//
// Why: a decode step reads every weight once, hundreds of MB in 4 KiB pages,
// so each step walks ~100 k page translations. Measured on this project's
// 2-vCPU VM (bench/huge_page_bench): a 440 MB streaming pass ran 1.3x faster
// on huge pages, and in 4 KiB pages its first pass after the process slept
// 2-3 s took up to twice its steady time (the host had dropped the guest's
// translations), which a serving cluster pays as TTFT on every request that
// arrives at an idle worker; on huge pages it did not. Debian's default THP
// mode is `madvise`: memory gets huge pages only where the process asks.
#pragma once

#include <cstddef>

#include "absl/status/statusor.h"

namespace pdserve {

// Whether LargeBuffer::Allocate asks for huge pages (default: yes). A
// process-wide switch so that a benchmark can measure the same code with the
// feature off; a serving process leaves it on.
void SetHugePagesWanted(bool wanted);
bool HugePagesWanted();

// Whether the kernel would back madvised memory with huge pages
// (/sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise`).
bool TransparentHugePagesAvailable();

// Zeroed anonymous memory, mapped on its own and unmapped on destruction.
// Move-only.
class LargeBuffer {
 public:
  // Buffers of at least this many bytes start on a huge page boundary and
  // are madvised for huge pages; smaller ones would waste more than they
  // gain.
  static constexpr size_t kHugePageBytes = size_t{2} << 20;

  LargeBuffer() = default;
  LargeBuffer(LargeBuffer&& other) noexcept { *this = std::move(other); }
  LargeBuffer& operator=(LargeBuffer&& other) noexcept;
  LargeBuffer(const LargeBuffer&) = delete;
  LargeBuffer& operator=(const LargeBuffer&) = delete;
  ~LargeBuffer();

  // `bytes` of zeroed memory, page-aligned (2 MiB-aligned and madvised for
  // huge pages from kHugePageBytes up, while HugePagesWanted()).
  // RESOURCE_EXHAUSTED when the memory cannot be mapped.
  static absl::StatusOr<LargeBuffer> Allocate(size_t bytes);

  void* data() const { return data_; }
  size_t size() const { return size_; }
  // The kernel accepted the huge page advice (it may still back some of it
  // with small pages when it has no free 2 MiB frames).
  bool huge_pages_advised() const { return huge_pages_advised_; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;    // asked for
  size_t mapped_ = 0;  // mapped: size_ rounded up to whole small pages
  bool huge_pages_advised_ = false;
};

}  // namespace pdserve
