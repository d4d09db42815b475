// A validated, memory-mapped safetensors file (one shard).
//
// Layout: 8-byte little-endian header length N, N bytes of JSON header
// {"name": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]},
//  "__metadata__": {...}}, then the data section; offsets are relative to it.
// Open() checks the header length against the file size, the JSON, every
// dtype (F32/F16/BF16 only), shape, and that each tensor's byte range lies in
// the data section with size == prod(shape) * dtype size.
//
// Thread-safety: immutable after Open(); const methods may run concurrently.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "common/mapped_file.h"
#include "model/model_config.h"

namespace pdserve::model {

struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte range relative to the data section
  uint64_t end = 0;
};

class SafetensorsFile {
 public:
  [[nodiscard]] static absl::StatusOr<SafetensorsFile> Open(
      const std::string& path);

  SafetensorsFile(SafetensorsFile&&) = default;
  SafetensorsFile& operator=(SafetensorsFile&&) = default;

  const std::string& path() const { return file_.path(); }
  // Tensors in header order.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const SafetensorsTensor* FindTensor(std::string_view name) const;
  // The bytes of a tensor (bounds were checked at Open()).
  std::span<const uint8_t> TensorData(const SafetensorsTensor& tensor) const;

 private:
  SafetensorsFile() = default;
  absl::Status Parse();

  MappedFile file_;
  uint64_t data_offset_ = 0;
  std::vector<SafetensorsTensor> tensors_;
  absl::flat_hash_map<std::string, size_t> index_;
};

}  // namespace pdserve::model
