#include "model/safetensors_file.h"

#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/absl_compat.h"
#include "nlohmann/json.hpp"

namespace pdserve::model {
namespace {

using Json = nlohmann::json;

// The reference implementation refuses headers over 100 MB; a bigger one is a
// corrupt length, not a real model.
constexpr uint64_t kMaxHeaderBytes = 100u << 20;

absl::StatusOr<DType> ParseSafetensorsDtype(const std::string& text) {
  if (text == "F32") return DType::kF32;
  if (text == "F16") return DType::kF16;
  if (text == "BF16") return DType::kBF16;
  return absl::InvalidArgumentError(absl::StrCat(
      "unsupported dtype \"", ToAbsl(text), "\" (F32, F16 or BF16 only)"));
}

// Reads a non-negative JSON integer without throwing.
bool JsonToUint64(const Json& value, uint64_t* out) {
  if (value.is_number_unsigned()) {
    *out = value.get<uint64_t>();
    return true;
  }
  if (value.is_number_integer()) {
    int64_t signed_value = value.get<int64_t>();
    if (signed_value < 0) return false;
    *out = static_cast<uint64_t>(signed_value);
    return true;
  }
  return false;
}

}  // namespace

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  SafetensorsFile file;
  PDS_ASSIGN_OR_RETURN(file.file_, MappedFile::Open(path));
  PDS_RETURN_IF_ERROR(file.Parse());
  return file;
}

absl::Status SafetensorsFile::Parse() {
  std::span<const uint8_t> bytes = file_.bytes();
  auto error = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(path(), ": ", what));
  };
  if (bytes.size() < 8) {
    return error(absl::StrCat("truncated file: ", bytes.size(),
                              " bytes, shorter than the 8-byte header length"));
  }
  uint64_t header_length = 0;
  std::memcpy(&header_length, bytes.data(), 8);
  if (header_length > bytes.size() - 8) {
    return error(absl::StrCat("header length ", header_length,
                              " runs past the end of the file (", bytes.size(),
                              " bytes; truncated?)"));
  }
  if (header_length > kMaxHeaderBytes) {
    return error(absl::StrCat("header length ", header_length, " is absurd"));
  }
  data_offset_ = 8 + header_length;
  const uint64_t data_size = bytes.size() - data_offset_;

  Json header;
  try {
    const char* text = reinterpret_cast<const char*>(bytes.data() + 8);
    header = Json::parse(text, text + header_length);
  } catch (const Json::exception& e) {
    return error(absl::StrCat("invalid header JSON: ", e.what()));
  }
  if (!header.is_object()) return error("header JSON is not an object");

  tensors_.reserve(header.size());
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    auto tensor_error = [&](absl::string_view what) {
      return error(absl::StrCat("tensor ", ToAbsl(name), ": ", what));
    };
    if (!entry.is_object()) return tensor_error("entry is not an object");
    SafetensorsTensor tensor;
    tensor.name = name;

    auto dtype_it = entry.find("dtype");
    if (dtype_it == entry.end() || !dtype_it->is_string()) {
      return tensor_error("missing string \"dtype\"");
    }
    absl::StatusOr<DType> dtype =
        ParseSafetensorsDtype(dtype_it->get<std::string>());
    if (!dtype.ok()) return tensor_error(dtype.status().message());
    tensor.dtype = *dtype;

    auto shape_it = entry.find("shape");
    if (shape_it == entry.end() || !shape_it->is_array()) {
      return tensor_error("missing array \"shape\"");
    }
    uint64_t num_bytes = DTypeSize(tensor.dtype);
    for (const Json& dim : *shape_it) {
      uint64_t size;
      if (!JsonToUint64(dim, &size) ||
          size > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
          __builtin_mul_overflow(num_bytes, size, &num_bytes)) {
        return tensor_error("invalid or absurd \"shape\"");
      }
      tensor.shape.push_back(static_cast<int64_t>(size));
    }

    auto offsets_it = entry.find("data_offsets");
    if (offsets_it == entry.end() || !offsets_it->is_array() ||
        offsets_it->size() != 2 ||
        !JsonToUint64((*offsets_it)[0], &tensor.begin) ||
        !JsonToUint64((*offsets_it)[1], &tensor.end)) {
      return tensor_error("missing or invalid \"data_offsets\"");
    }
    if (tensor.begin > tensor.end || tensor.end > data_size) {
      return tensor_error(absl::StrCat("data_offsets [", tensor.begin, ", ",
                                       tensor.end,
                                       "] out of range of the data section (",
                                       data_size, " bytes; truncated?)"));
    }
    if (tensor.end - tensor.begin != num_bytes) {
      return tensor_error(
          absl::StrCat("data_offsets span ", tensor.end - tensor.begin,
                       " bytes but shape and dtype need ", num_bytes));
    }
    if (!index_.emplace(name, tensors_.size()).second) {
      return tensor_error("duplicate tensor name");
    }
    tensors_.push_back(std::move(tensor));
  }
  return absl::OkStatus();
}

const SafetensorsTensor* SafetensorsFile::FindTensor(
    std::string_view name) const {
  auto it = index_.find(ToAbsl(name));
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

std::span<const uint8_t> SafetensorsFile::TensorData(
    const SafetensorsTensor& tensor) const {
  return file_.bytes().subspan(data_offset_ + tensor.begin,
                               tensor.end - tensor.begin);
}

}  // namespace pdserve::model
