#include "model/gguf_file.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/absl_compat.h"

namespace pdserve::model {
namespace {

constexpr uint32_t kGgufVersion = 3;
constexpr uint64_t kDefaultAlignment = 32;
constexpr int kMaxDims = 4;
// Arrays of arrays are legal GGUF but nothing real nests deeply; the limit
// keeps a hostile file from exhausting the stack through recursion.
constexpr int kMaxArrayNesting = 8;

// Smallest encoding of one value of each type, used to reject element counts
// that cannot possibly fit in the rest of the file before allocating.
uint64_t MinEncodedSize(GgufValueType type) {
  switch (type) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kBool:
      return 1;
    case GgufValueType::kUint16:
    case GgufValueType::kInt16:
      return 2;
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kFloat32:
      return 4;
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
    case GgufValueType::kFloat64:
    case GgufValueType::kString:  // u64 length
      return 8;
    case GgufValueType::kArray:  // u32 element type + u64 count
      return 12;
  }
  return 1;
}

bool IsKnownValueType(uint32_t raw) {
  return raw <= static_cast<uint32_t>(GgufValueType::kFloat64);
}

// Sequential little-endian reader over the mapped bytes. Every read checks the
// remaining length first; errors carry the file name and the byte offset.
class ByteReader {
 public:
  ByteReader(std::span<const uint8_t> bytes, const std::string& path)
      : bytes_(bytes), path_(path) {}

  uint64_t position() const { return pos_; }
  uint64_t remaining() const { return bytes_.size() - pos_; }

  absl::Status Error(std::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": ", ToAbsl(what),
                                                   " (at byte ", pos_, " of ",
                                                   bytes_.size(), ")"));
  }

  template <typename T>
  absl::Status Read(T* out, std::string_view what) {
    if (remaining() < sizeof(T)) {
      return Error(absl::StrCat("truncated file while reading ", ToAbsl(what)));
    }
    std::memcpy(out, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return absl::OkStatus();
  }

  absl::Status ReadString(std::string* out, std::string_view what) {
    uint64_t length = 0;
    PDS_RETURN_IF_ERROR(Read(&length, what));
    if (length > remaining()) {
      return Error(absl::StrCat(ToAbsl(what), " has length ", length,
                                " past the end of the file"));
    }
    out->assign(reinterpret_cast<const char*>(bytes_.data() + pos_), length);
    pos_ += length;
    return absl::OkStatus();
  }

 private:
  std::span<const uint8_t> bytes_;
  const std::string& path_;
  uint64_t pos_ = 0;
};

absl::Status ReadValue(ByteReader& reader, GgufValueType type,
                       std::string_view key, int depth, GgufValue* out);

template <typename T, typename Stored>
absl::Status ReadScalar(ByteReader& reader, std::string_view key,
                        GgufValue* out) {
  T raw{};
  PDS_RETURN_IF_ERROR(
      reader.Read(&raw, absl::StrCat("value of ", ToAbsl(key))));
  out->data = static_cast<Stored>(raw);
  return absl::OkStatus();
}

absl::Status ReadArray(ByteReader& reader, std::string_view key, int depth,
                       GgufValue* out) {
  if (depth >= kMaxArrayNesting) {
    return reader.Error(absl::StrCat("metadata ", ToAbsl(key),
                                     " nests arrays deeper than ",
                                     kMaxArrayNesting));
  }
  uint32_t raw_type = 0;
  PDS_RETURN_IF_ERROR(
      reader.Read(&raw_type, absl::StrCat("array type of ", ToAbsl(key))));
  if (!IsKnownValueType(raw_type)) {
    return reader.Error(absl::StrCat("metadata ", ToAbsl(key),
                                     " has unknown array element type ",
                                     raw_type));
  }
  auto element_type = static_cast<GgufValueType>(raw_type);
  uint64_t count = 0;
  PDS_RETURN_IF_ERROR(
      reader.Read(&count, absl::StrCat("array size of ", ToAbsl(key))));
  if (count > reader.remaining() / MinEncodedSize(element_type)) {
    return reader.Error(absl::StrCat("metadata ", ToAbsl(key), " declares ",
                                     count,
                                     " elements, more than the file holds"));
  }
  out->array_type = element_type;
  std::vector<GgufValue> elements(count);
  for (uint64_t i = 0; i < count; ++i) {
    PDS_RETURN_IF_ERROR(
        ReadValue(reader, element_type, key, depth + 1, &elements[i]));
  }
  out->data = std::move(elements);
  return absl::OkStatus();
}

absl::Status ReadValue(ByteReader& reader, GgufValueType type,
                       std::string_view key, int depth, GgufValue* out) {
  out->type = type;
  switch (type) {
    case GgufValueType::kUint8:
      return ReadScalar<uint8_t, uint64_t>(reader, key, out);
    case GgufValueType::kInt8:
      return ReadScalar<int8_t, int64_t>(reader, key, out);
    case GgufValueType::kUint16:
      return ReadScalar<uint16_t, uint64_t>(reader, key, out);
    case GgufValueType::kInt16:
      return ReadScalar<int16_t, int64_t>(reader, key, out);
    case GgufValueType::kUint32:
      return ReadScalar<uint32_t, uint64_t>(reader, key, out);
    case GgufValueType::kInt32:
      return ReadScalar<int32_t, int64_t>(reader, key, out);
    case GgufValueType::kUint64:
      return ReadScalar<uint64_t, uint64_t>(reader, key, out);
    case GgufValueType::kInt64:
      return ReadScalar<int64_t, int64_t>(reader, key, out);
    case GgufValueType::kFloat32:
      return ReadScalar<float, double>(reader, key, out);
    case GgufValueType::kFloat64:
      return ReadScalar<double, double>(reader, key, out);
    case GgufValueType::kBool: {
      uint8_t raw = 0;
      PDS_RETURN_IF_ERROR(
          reader.Read(&raw, absl::StrCat("value of ", ToAbsl(key))));
      if (raw > 1) {
        return reader.Error(absl::StrCat("metadata ", ToAbsl(key),
                                         " has invalid bool byte ", raw));
      }
      out->data = raw != 0;
      return absl::OkStatus();
    }
    case GgufValueType::kString: {
      std::string text;
      PDS_RETURN_IF_ERROR(reader.ReadString(
          &text, absl::StrCat("string value of ", ToAbsl(key))));
      out->data = std::move(text);
      return absl::OkStatus();
    }
    case GgufValueType::kArray:
      return ReadArray(reader, key, depth, out);
  }
  return reader.Error(
      absl::StrCat("metadata ", ToAbsl(key), " has unknown type"));
}

// The format of a supported ggml type.
std::optional<TensorFormat> FormatOfGgmlType(uint32_t type) {
  switch (type) {
    case kGgmlTypeF32:
      return TensorFormat::kF32;
    case kGgmlTypeF16:
      return TensorFormat::kF16;
    case kGgmlTypeBF16:
      return TensorFormat::kBF16;
    case kGgmlTypeQ8_0:
      return TensorFormat::kQ8_0;
    case kGgmlTypeQ4_K:
      return TensorFormat::kQ4_K;
    case kGgmlTypeQ6_K:
      return TensorFormat::kQ6_K;
    default:
      return std::nullopt;
  }
}

}  // namespace

std::string GgmlTypeName(uint32_t type) {
  switch (type) {
    case kGgmlTypeF32:
      return "F32";
    case kGgmlTypeF16:
      return "F16";
    case kGgmlTypeBF16:
      return "BF16";
    case 2:
      return "Q4_0";
    case 3:
      return "Q4_1";
    case 6:
      return "Q5_0";
    case 7:
      return "Q5_1";
    case kGgmlTypeQ8_0:
      return "Q8_0";
    case 10:
      return "Q2_K";
    case 11:
      return "Q3_K";
    case kGgmlTypeQ4_K:
      return "Q4_K";
    case 13:
      return "Q5_K";
    case kGgmlTypeQ6_K:
      return "Q6_K";
    default:
      return absl::StrCat("ggml type ", type);
  }
}

uint32_t GgmlTypeOf(TensorFormat format) {
  switch (format) {
    case TensorFormat::kF32:
      return kGgmlTypeF32;
    case TensorFormat::kF16:
      return kGgmlTypeF16;
    case TensorFormat::kBF16:
      return kGgmlTypeBF16;
    case TensorFormat::kQ8_0:
      return kGgmlTypeQ8_0;
    case TensorFormat::kQ4_K:
      return kGgmlTypeQ4_K;
    case TensorFormat::kQ6_K:
      return kGgmlTypeQ6_K;
  }
  return kGgmlTypeF32;
}

std::string_view GgufValueTypeName(GgufValueType type) {
  switch (type) {
    case GgufValueType::kUint8:
      return "uint8";
    case GgufValueType::kInt8:
      return "int8";
    case GgufValueType::kUint16:
      return "uint16";
    case GgufValueType::kInt16:
      return "int16";
    case GgufValueType::kUint32:
      return "uint32";
    case GgufValueType::kInt32:
      return "int32";
    case GgufValueType::kFloat32:
      return "float32";
    case GgufValueType::kBool:
      return "bool";
    case GgufValueType::kString:
      return "string";
    case GgufValueType::kArray:
      return "array";
    case GgufValueType::kUint64:
      return "uint64";
    case GgufValueType::kInt64:
      return "int64";
    case GgufValueType::kFloat64:
      return "float64";
  }
  return "unknown";
}

bool GgufValue::is_integer() const {
  return std::holds_alternative<uint64_t>(data) ||
         std::holds_alternative<int64_t>(data);
}

bool GgufValue::is_float() const {
  return std::holds_alternative<double>(data);
}

std::optional<int64_t> GgufValue::AsInt64() const {
  if (const auto* value = std::get_if<int64_t>(&data)) return *value;
  if (const auto* value = std::get_if<uint64_t>(&data)) {
    if (*value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return std::nullopt;
    }
    return static_cast<int64_t>(*value);
  }
  return std::nullopt;
}

std::optional<double> GgufValue::AsDouble() const {
  if (const auto* value = std::get_if<double>(&data)) return *value;
  if (const auto* value = std::get_if<int64_t>(&data)) {
    return static_cast<double>(*value);
  }
  if (const auto* value = std::get_if<uint64_t>(&data)) {
    return static_cast<double>(*value);
  }
  return std::nullopt;
}

const std::string* GgufValue::AsString() const {
  return std::get_if<std::string>(&data);
}

const std::vector<GgufValue>* GgufValue::AsArray() const {
  return std::get_if<std::vector<GgufValue>>(&data);
}

std::vector<int64_t> GgufTensorInfo::Shape() const {
  // ne values were checked at Open() to fit int64.
  return std::vector<int64_t>(ne.rbegin(), ne.rend());
}

DType GgufTensorInfo::dtype() const {
  switch (format) {
    case TensorFormat::kF16:
      return DType::kF16;
    case TensorFormat::kBF16:
      return DType::kBF16;
    default:
      return DType::kF32;
  }
}

absl::StatusOr<GgufFile> GgufFile::Open(const std::string& path,
                                        const GgufOpenOptions& options) {
  GgufFile gguf;
  PDS_ASSIGN_OR_RETURN(gguf.file_, MappedFile::Open(path));
  PDS_RETURN_IF_ERROR(gguf.Parse(options));
  return gguf;
}

absl::Status GgufFile::Parse(const GgufOpenOptions& options) {
  ByteReader reader(file_.bytes(), file_.path());

  uint8_t magic[4] = {};
  PDS_RETURN_IF_ERROR(reader.Read(&magic, "magic"));
  if (std::memcmp(magic, "GGUF", 4) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path(), ": not a GGUF file (bad magic)"));
  }
  PDS_RETURN_IF_ERROR(reader.Read(&version_, "version"));
  if (version_ != kGgufVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat(path(), ": unsupported GGUF version ", version_,
                     " (only version ", kGgufVersion, ")"));
  }
  uint64_t tensor_count = 0;
  uint64_t kv_count = 0;
  PDS_RETURN_IF_ERROR(reader.Read(&tensor_count, "tensor count"));
  PDS_RETURN_IF_ERROR(reader.Read(&kv_count, "metadata count"));
  // A key/value takes at least 13 bytes (length, type, 1-byte value) and a
  // tensor info at least 24 (name length, n_dims, type, offset).
  if (kv_count > reader.remaining() / 13) {
    return reader.Error(absl::StrCat("metadata count ", kv_count,
                                     " is more than the file can hold"));
  }
  if (tensor_count > reader.remaining() / 24) {
    return reader.Error(absl::StrCat("tensor count ", tensor_count,
                                     " is more than the file can hold"));
  }

  metadata_.reserve(kv_count);
  for (uint64_t i = 0; i < kv_count; ++i) {
    std::string key;
    PDS_RETURN_IF_ERROR(
        reader.ReadString(&key, absl::StrCat("metadata key #", i)));
    uint32_t raw_type = 0;
    PDS_RETURN_IF_ERROR(
        reader.Read(&raw_type, absl::StrCat("type of ", ToAbsl(key))));
    if (!IsKnownValueType(raw_type)) {
      return reader.Error(absl::StrCat("metadata ", ToAbsl(key),
                                       " has unknown type ", raw_type));
    }
    GgufValue value;
    PDS_RETURN_IF_ERROR(ReadValue(reader, static_cast<GgufValueType>(raw_type),
                                  key, /*depth=*/0, &value));
    if (!metadata_index_.emplace(key, metadata_.size()).second) {
      return reader.Error(absl::StrCat("duplicate metadata key ", ToAbsl(key)));
    }
    metadata_.emplace_back(std::move(key), std::move(value));
  }

  if (const GgufValue* alignment = FindMetadata("general.alignment")) {
    std::optional<int64_t> value = alignment->AsInt64();
    if (alignment->type != GgufValueType::kUint32 || !value.has_value() ||
        *value <= 0 || (*value & (*value - 1)) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          path(), ": general.alignment must be a uint32 power of two"));
    }
    alignment_ = static_cast<uint64_t>(*value);
  } else {
    alignment_ = kDefaultAlignment;
  }

  tensors_.reserve(tensor_count);
  for (uint64_t i = 0; i < tensor_count; ++i) {
    GgufTensorInfo tensor;
    PDS_RETURN_IF_ERROR(
        reader.ReadString(&tensor.name, absl::StrCat("name of tensor #", i)));
    uint32_t n_dims = 0;
    PDS_RETURN_IF_ERROR(
        reader.Read(&n_dims, absl::StrCat("n_dims of tensor ", tensor.name)));
    if (n_dims == 0 || n_dims > kMaxDims) {
      return reader.Error(absl::StrCat("tensor ", tensor.name, " has ", n_dims,
                                       " dimensions (1 to ", kMaxDims, ")"));
    }
    tensor.ne.resize(n_dims);
    uint64_t num_elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      PDS_RETURN_IF_ERROR(reader.Read(
          &tensor.ne[d], absl::StrCat("ne[", d, "] of tensor ", tensor.name)));
      if (tensor.ne[d] >
              static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
          __builtin_mul_overflow(num_elements, tensor.ne[d], &num_elements)) {
        return reader.Error(
            absl::StrCat("tensor ", tensor.name, " has an absurd shape"));
      }
    }
    tensor.num_elements = num_elements;
    PDS_RETURN_IF_ERROR(reader.Read(
        &tensor.ggml_type, absl::StrCat("type of tensor ", tensor.name)));
    PDS_RETURN_IF_ERROR(reader.Read(
        &tensor.offset, absl::StrCat("offset of tensor ", tensor.name)));
    const std::optional<TensorFormat> format =
        FormatOfGgmlType(tensor.ggml_type);
    tensor.supported = format.has_value();
    if (!tensor.supported && !options.allow_unsupported_tensor_types) {
      return absl::InvalidArgumentError(
          absl::StrCat(path(), ": tensor ", tensor.name,
                       " has unsupported type ", GgmlTypeName(tensor.ggml_type),
                       " (F32, F16, BF16, Q8_0, Q4_K or Q6_K only)"));
    }
    if (tensor.supported) {
      tensor.format = *format;
      // Blocks run along the innermost dimension: every row is a whole
      // number of them.
      const uint64_t block = BlockElements(tensor.format);
      if (tensor.ne[0] % block != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            path(), ": tensor ", tensor.name, " of type ",
            GgmlTypeName(tensor.ggml_type), " has rows of ", tensor.ne[0],
            " values, not a multiple of its ", block, "-value blocks"));
      }
      if (__builtin_mul_overflow(
              num_elements / block,
              static_cast<uint64_t>(BlockBytes(tensor.format)),
              &tensor.num_bytes)) {
        return reader.Error(
            absl::StrCat("tensor ", tensor.name, " has an absurd shape"));
      }
    }
    if (tensor.offset % alignment_ != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          path(), ": tensor ", tensor.name, " offset ", tensor.offset,
          " is not a multiple of the alignment ", alignment_));
    }
    if (!tensor_index_.emplace(tensor.name, tensors_.size()).second) {
      return reader.Error(absl::StrCat("duplicate tensor name ", tensor.name));
    }
    tensors_.push_back(std::move(tensor));
  }

  // The data section starts at the next multiple of the alignment.
  uint64_t header_end = reader.position();
  uint64_t padding = (alignment_ - header_end % alignment_) % alignment_;
  data_offset_ = header_end + padding;
  uint64_t file_size = file_.size();
  if (tensors_.empty()) {
    data_offset_ = std::min(data_offset_, file_size);
    return absl::OkStatus();
  }
  if (data_offset_ > file_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        path(), ": truncated file: data section would start at byte ",
        data_offset_, " but the file has ", file_size, " bytes"));
  }
  uint64_t data_size = file_size - data_offset_;
  auto describe = [](const GgufTensorInfo& tensor) {
    if (!IsQuantized(tensor.format)) {
      return absl::StrCat(GgmlTypeName(tensor.ggml_type), ", ",
                          tensor.num_bytes, " bytes");
    }
    return absl::StrCat(GgmlTypeName(tensor.ggml_type), ", ",
                        tensor.num_elements / BlockElements(tensor.format),
                        " blocks of ", BlockBytes(tensor.format),
                        " bytes = ", tensor.num_bytes, " bytes");
  };
  for (const GgufTensorInfo& tensor : tensors_) {
    // Written as a subtraction so that no sum can overflow.
    if (tensor.offset > data_size ||
        tensor.num_bytes > data_size - tensor.offset) {
      return absl::InvalidArgumentError(
          absl::StrCat(path(), ": tensor ", tensor.name, " (", describe(tensor),
                       ") at data offset ", tensor.offset,
                       " lies past the end of the data section (", data_size,
                       " bytes; file truncated?)"));
    }
  }
  // A tensor whose declared size runs into the next tensor's data was
  // written with the wrong shape or type: refuse it rather than read the
  // neighbour's bytes as its own.
  std::vector<const GgufTensorInfo*> by_offset;
  for (const GgufTensorInfo& tensor : tensors_) {
    if (tensor.supported) by_offset.push_back(&tensor);
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const GgufTensorInfo* a, const GgufTensorInfo* b) {
              return a->offset < b->offset;
            });
  for (size_t i = 0; i + 1 < by_offset.size(); ++i) {
    const GgufTensorInfo& a = *by_offset[i];
    const GgufTensorInfo& b = *by_offset[i + 1];
    if (a.num_bytes > b.offset - a.offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          path(), ": tensor ", a.name, " (", describe(a), ") at data offset ",
          a.offset, " runs into tensor ", b.name, " at data offset ", b.offset,
          ": its shape or type does not match the bytes written for it"));
    }
  }
  return absl::OkStatus();
}

const GgufValue* GgufFile::FindMetadata(std::string_view key) const {
  auto it = metadata_index_.find(ToAbsl(key));
  return it == metadata_index_.end() ? nullptr : &metadata_[it->second].second;
}

namespace {

absl::Status MissingKey(const std::string& path, std::string_view key) {
  return absl::NotFoundError(
      absl::StrCat(path, ": metadata key ", ToAbsl(key), " is missing"));
}

absl::Status WrongType(const std::string& path, std::string_view key,
                       const GgufValue& value, std::string_view expected) {
  return absl::InvalidArgumentError(absl::StrCat(
      path, ": metadata key ", ToAbsl(key), " has type ",
      ToAbsl(GgufValueTypeName(value.type)), ", expected ", ToAbsl(expected)));
}

}  // namespace

absl::StatusOr<int64_t> GgufFile::GetInt(std::string_view key) const {
  const GgufValue* value = FindMetadata(key);
  if (value == nullptr) return MissingKey(path(), key);
  std::optional<int64_t> result = value->AsInt64();
  if (!result.has_value()) return WrongType(path(), key, *value, "an integer");
  return *result;
}

absl::StatusOr<double> GgufFile::GetFloat(std::string_view key) const {
  const GgufValue* value = FindMetadata(key);
  if (value == nullptr) return MissingKey(path(), key);
  std::optional<double> result = value->AsDouble();
  if (!result.has_value()) return WrongType(path(), key, *value, "a number");
  return *result;
}

absl::StatusOr<bool> GgufFile::GetBool(std::string_view key) const {
  const GgufValue* value = FindMetadata(key);
  if (value == nullptr) return MissingKey(path(), key);
  const bool* result = std::get_if<bool>(&value->data);
  if (result == nullptr) return WrongType(path(), key, *value, "a bool");
  return *result;
}

absl::StatusOr<std::string> GgufFile::GetString(std::string_view key) const {
  const GgufValue* value = FindMetadata(key);
  if (value == nullptr) return MissingKey(path(), key);
  const std::string* result = value->AsString();
  if (result == nullptr) return WrongType(path(), key, *value, "a string");
  return *result;
}

absl::StatusOr<std::vector<std::string>> GgufFile::GetStringArray(
    std::string_view key) const {
  const GgufValue* value = FindMetadata(key);
  if (value == nullptr) return MissingKey(path(), key);
  const std::vector<GgufValue>* array = value->AsArray();
  if (array == nullptr || value->array_type != GgufValueType::kString) {
    return WrongType(path(), key, *value, "an array of strings");
  }
  std::vector<std::string> result;
  result.reserve(array->size());
  for (const GgufValue& element : *array) result.push_back(*element.AsString());
  return result;
}

absl::StatusOr<std::vector<double>> GgufFile::GetFloatArray(
    std::string_view key) const {
  const GgufValue* value = FindMetadata(key);
  if (value == nullptr) return MissingKey(path(), key);
  const std::vector<GgufValue>* array = value->AsArray();
  if (array == nullptr) return WrongType(path(), key, *value, "an array");
  std::vector<double> result;
  result.reserve(array->size());
  for (const GgufValue& element : *array) {
    std::optional<double> number = element.AsDouble();
    if (!number.has_value()) {
      return WrongType(path(), key, *value, "an array of numbers");
    }
    result.push_back(*number);
  }
  return result;
}

absl::StatusOr<std::vector<int64_t>> GgufFile::GetIntArray(
    std::string_view key) const {
  const GgufValue* value = FindMetadata(key);
  if (value == nullptr) return MissingKey(path(), key);
  const std::vector<GgufValue>* array = value->AsArray();
  if (array == nullptr) return WrongType(path(), key, *value, "an array");
  std::vector<int64_t> result;
  result.reserve(array->size());
  for (const GgufValue& element : *array) {
    std::optional<int64_t> number = element.AsInt64();
    if (!number.has_value()) {
      return WrongType(path(), key, *value, "an array of integers");
    }
    result.push_back(*number);
  }
  return result;
}

const GgufTensorInfo* GgufFile::FindTensor(std::string_view name) const {
  auto it = tensor_index_.find(ToAbsl(name));
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

std::span<const uint8_t> GgufFile::TensorData(
    const GgufTensorInfo& tensor) const {
  if (!tensor.supported) return {};
  return file_.bytes().subspan(data_offset_ + tensor.offset, tensor.num_bytes);
}

}  // namespace pdserve::model
