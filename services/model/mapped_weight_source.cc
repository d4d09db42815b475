#include "model/mapped_weight_source.h"

#include <cstring>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/float16.h"
#include "common/status_macros.h"
#include "model/absl_compat.h"
#include "model/tensor_layout.h"

#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#endif

namespace pdserve::model {
namespace {

void ConvertF16(const uint8_t* src, size_t count, float* out) {
  size_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
  // Hardware conversion, 8 at a time; unaligned loads because safetensors
  // offsets carry no alignment guarantee.
  for (; i + 8 <= count; i += 8) {
    __m128i halves =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(halves));
  }
#endif
  for (; i < count; ++i) {
    uint16_t bits;
    std::memcpy(&bits, src + 2 * i, 2);
    out[i] = F16ToFloat(bits);
  }
}

void ConvertBf16(const uint8_t* src, size_t count, float* out) {
  // bf16 is the top half of an f32: a shift the compiler vectorizes.
  for (size_t i = 0; i < count; ++i) {
    uint16_t bits;
    std::memcpy(&bits, src + 2 * i, 2);
    uint32_t word = static_cast<uint32_t>(bits) << 16;
    std::memcpy(out + i, &word, 4);
  }
}

}  // namespace

void ConvertToF32(const uint8_t* src, DType dtype, size_t count, float* out) {
  if (count == 0) return;  // `out` may be null for an empty slice
  switch (dtype) {
    case DType::kF32:
      std::memcpy(out, src, count * sizeof(float));
      return;
    case DType::kF16:
      ConvertF16(src, count, out);
      return;
    case DType::kBF16:
      ConvertBf16(src, count, out);
      return;
  }
}

absl::StatusOr<ResolvedSlice> ResolveSlice(const TensorInfo& info,
                                           const Slice2D& slice) {
  ResolvedSlice resolved;
  // Tensors of more than two dimensions are viewed as [prod(outer), last].
  resolved.rows = 1;
  resolved.cols = info.shape.empty() ? 1 : info.shape.back();
  for (size_t d = 0; d + 1 < info.shape.size(); ++d) {
    resolved.rows *= info.shape[d];
  }
  resolved.row_begin = slice.row_begin;
  resolved.row_end = slice.row_end == -1 ? resolved.rows : slice.row_end;
  resolved.col_begin = slice.col_begin;
  resolved.col_end = slice.col_end == -1 ? resolved.cols : slice.col_end;
  if (resolved.row_begin < 0 || resolved.row_begin > resolved.row_end ||
      resolved.row_end > resolved.rows || resolved.col_begin < 0 ||
      resolved.col_begin > resolved.col_end ||
      resolved.col_end > resolved.cols) {
    return absl::OutOfRangeError(absl::StrCat(
        "slice rows [", slice.row_begin, ", ", slice.row_end, ") cols [",
        slice.col_begin, ", ", slice.col_end, ") is outside tensor ", info.name,
        " of shape ", ShapeString(info.shape)));
  }
  return resolved;
}

bool MappedWeightSource::HasTensor(std::string_view name) const {
  return tensors_.contains(ToAbsl(name));
}

absl::StatusOr<TensorInfo> MappedWeightSource::GetTensorInfo(
    std::string_view name) const {
  auto it = tensors_.find(ToAbsl(name));
  if (it == tensors_.end()) {
    return absl::NotFoundError(
        absl::StrCat(description_, ": no tensor ", ToAbsl(name)));
  }
  return it->second.info;
}

absl::Status MappedWeightSource::ReadF32(std::string_view name,
                                         const Slice2D& slice,
                                         float* out) const {
  auto it = tensors_.find(ToAbsl(name));
  if (it == tensors_.end()) {
    return absl::NotFoundError(
        absl::StrCat(description_, ": no tensor ", ToAbsl(name)));
  }
  const MappedTensor& tensor = it->second;
  absl::StatusOr<ResolvedSlice> resolved = ResolveSlice(tensor.info, slice);
  if (!resolved.ok()) {
    return absl::OutOfRangeError(
        absl::StrCat(*tensor.file_path, ": ", resolved.status().message()));
  }
  const int64_t out_cols = resolved->col_end - resolved->col_begin;
  const bool permuted = tensor.interleaved_rope_head_dim != 0;
  const TensorFormat format = tensor.info.format;
  const int64_t row_bytes = RowBytes(format, resolved->cols);

  if (IsQuantized(format)) {
    // Whole rows dequantized (blocks span columns), then the slice copied.
    const bool whole_rows = out_cols == resolved->cols;
    std::vector<float> row_values(whole_rows ? 0 : resolved->cols);
    for (int64_t row = resolved->row_begin; row < resolved->row_end; ++row) {
      const int64_t stored_row =
          permuted ? InterleavedRopeRow(row, tensor.interleaved_rope_head_dim)
                   : row;
      float* dst = out + (row - resolved->row_begin) * out_cols;
      const uint8_t* src = tensor.data.data() + stored_row * row_bytes;
      if (whole_rows) {
        DequantizeRow(format, src, resolved->cols, dst);
      } else {
        DequantizeRow(format, src, resolved->cols, row_values.data());
        std::memcpy(dst, row_values.data() + resolved->col_begin,
                    out_cols * sizeof(float));
      }
    }
    return absl::OkStatus();
  }

  const DType dtype = tensor.info.dtype;
  const size_t element_size = DTypeSize(dtype);
  // Whole rows, in storage order: one contiguous run.
  if (!permuted && out_cols == resolved->cols) {
    const uint8_t* src = tensor.data.data() +
                         resolved->row_begin * resolved->cols * element_size;
    ConvertToF32(src, dtype,
                 static_cast<size_t>((resolved->row_end - resolved->row_begin) *
                                     out_cols),
                 out);
    return absl::OkStatus();
  }
  for (int64_t row = resolved->row_begin; row < resolved->row_end; ++row) {
    const int64_t stored_row =
        permuted ? InterleavedRopeRow(row, tensor.interleaved_rope_head_dim)
                 : row;
    const uint8_t* src =
        tensor.data.data() +
        (stored_row * resolved->cols + resolved->col_begin) * element_size;
    ConvertToF32(src, dtype, static_cast<size_t>(out_cols),
                 out + (row - resolved->row_begin) * out_cols);
  }
  return absl::OkStatus();
}

absl::StatusOr<StoredTensor> MappedWeightSource::GetStoredTensor(
    std::string_view name) const {
  auto it = tensors_.find(ToAbsl(name));
  if (it == tensors_.end()) {
    return absl::NotFoundError(
        absl::StrCat(description_, ": no tensor ", ToAbsl(name)));
  }
  const MappedTensor& tensor = it->second;
  PDS_ASSIGN_OR_RETURN(ResolvedSlice whole, ResolveSlice(tensor.info, {}));
  StoredTensor stored;
  stored.format = tensor.info.format;
  stored.data = tensor.data.data();
  stored.rows = whole.rows;
  stored.cols = whole.cols;
  stored.row_bytes = RowBytes(stored.format, whole.cols);
  stored.interleaved_rope_head_dim = tensor.interleaved_rope_head_dim;
  stored.owner = mapping_owner_;
  return stored;
}

absl::Status MappedWeightSource::ValidateArchitecture(
    std::string_view missing_file) const {
  const std::vector<ExpectedTensor> layout = LlamaTensorLayout(config_);
  absl::flat_hash_set<std::string> expected_names;
  for (const ExpectedTensor& expected : layout) {
    expected_names.insert(expected.name);
  }
  for (const auto& [name, tensor] : tensors_) {
    if (IsArchitectureTensorName(name) && !expected_names.contains(name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          *tensor.file_path, ": tensor ", name, " is not part of a ",
          config_.architecture, " model with this config (qkv_bias=",
          config_.qkv_bias ? 1 : 0, ", o_bias=", config_.o_bias ? 1 : 0,
          ", qk_norm=", config_.qk_norm ? 1 : 0,
          "); its values would be ignored"));
    }
  }
  for (const ExpectedTensor& expected : layout) {
    auto it = tensors_.find(expected.name);
    if (it == tensors_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(ToAbsl(missing_file), ": missing tensor ", expected.name,
                       " (expected shape ", ShapeString(expected.shape), ")"));
    }
    const MappedTensor& tensor = it->second;
    if (tensor.info.shape != expected.shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          *tensor.file_path, ": tensor ", expected.name, " has shape ",
          ShapeString(tensor.info.shape), " but the config implies ",
          ShapeString(expected.shape)));
    }
  }
  return absl::OkStatus();
}

}  // namespace pdserve::model
