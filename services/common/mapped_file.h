// Read-only memory map of a whole file, owned (RAII). Move-only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "absl/status/statusor.h"

namespace pdserve {

class MappedFile {
 public:
  // Maps `path` read-only. Errors name the path and the failing call.
  [[nodiscard]] static absl::StatusOr<MappedFile> Open(const std::string& path);

  MappedFile() = default;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  std::span<const uint8_t> bytes() const { return {data_, size_}; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  void Reset();

  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Reads a whole (small) file into a string, e.g. config.json.
[[nodiscard]] absl::StatusOr<std::string> ReadFileToString(
    const std::string& path);

}  // namespace pdserve
