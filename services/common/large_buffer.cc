#include "common/large_buffer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace pdserve {
namespace {

std::atomic<bool> huge_pages_wanted{true};

size_t SmallPageBytes() {
  static const size_t bytes = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return bytes;
}

}  // namespace

void SetHugePagesWanted(bool wanted) { huge_pages_wanted = wanted; }
bool HugePagesWanted() { return huge_pages_wanted; }

bool TransparentHugePagesAvailable() {
  std::ifstream file("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string modes;
  std::getline(file, modes);
  // The selected mode is bracketed: "always [madvise] never".
  return modes.find("[always]") != std::string::npos ||
         modes.find("[madvise]") != std::string::npos;
}

LargeBuffer& LargeBuffer::operator=(LargeBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) ::munmap(data_, mapped_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_ = std::exchange(other.mapped_, 0);
    huge_pages_advised_ = std::exchange(other.huge_pages_advised_, false);
  }
  return *this;
}

LargeBuffer::~LargeBuffer() {
  if (data_ != nullptr) ::munmap(data_, mapped_);
}

absl::StatusOr<LargeBuffer> LargeBuffer::Allocate(size_t bytes) {
  LargeBuffer buffer;
  if (bytes == 0) return buffer;
  const size_t page = SmallPageBytes();
  if (bytes > SIZE_MAX - kHugePageBytes - page) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map ", bytes, " bytes"));
  }
  const size_t mapped = (bytes + page - 1) / page * page;
  const bool huge = HugePagesWanted() && bytes >= kHugePageBytes;
  // A huge page backs only a 2 MiB-aligned 2 MiB range of the mapping (the
  // kernel does not align anonymous mappings itself before 6.7): map a huge
  // page more than needed and return the unaligned head and the tail.
  const size_t reserve = huge ? mapped + kHugePageBytes : mapped;
  void* region = ::mmap(nullptr, reserve, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (region == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map ", bytes, " bytes: ", std::strerror(errno)));
  }
  char* start = static_cast<char*>(region);
  if (huge) {
    const uintptr_t address = reinterpret_cast<uintptr_t>(region);
    const uintptr_t aligned =
        (address + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
    start = reinterpret_cast<char*>(aligned);
    const size_t head = aligned - address;
    const size_t tail = reserve - head - mapped;
    if (head > 0) ::munmap(region, head);
    if (tail > 0) ::munmap(start + mapped, tail);
    // Before the first touch, so the faults take huge pages. EINVAL: a
    // kernel without THP, which keeps the small pages.
    buffer.huge_pages_advised_ = ::madvise(start, mapped, MADV_HUGEPAGE) == 0;
  }
  buffer.data_ = start;
  buffer.size_ = bytes;
  buffer.mapped_ = mapped;
  return buffer;
}

}  // namespace pdserve
