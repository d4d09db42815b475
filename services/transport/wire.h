// Little-endian byte blobs for what the control plane carries between
// processes (worker addresses, rkeys, KV descriptors, grants, notices).
// Readers never trust their input: every read is bounds-checked and a short
// or malformed blob is an INVALID_ARGUMENT, never a crash.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pdserve::transport {

class ByteWriter {
 public:
  template <typename T>
  void Put(T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    out_.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  void PutBytes(absl::string_view bytes) {
    Put<uint64_t>(bytes.size());
    out_.append(bytes.data(), bytes.size());
  }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

class ByteReader {
 public:
  explicit ByteReader(std::string_view in) : in_(in) {}

  template <typename T>
  [[nodiscard]] bool Get(T* v) {
    static_assert(std::is_trivially_copyable_v<T>);
    if (in_.size() < sizeof(T)) return false;
    std::memcpy(v, in_.data(), sizeof(T));
    in_.remove_prefix(sizeof(T));
    return true;
  }
  // Bounded by `max_len` so that a corrupt length cannot request a huge
  // allocation.
  [[nodiscard]] bool GetBytes(std::string* out, uint64_t max_len = 1 << 30) {
    uint64_t n = 0;
    if (!Get(&n) || n > in_.size() || n > max_len) return false;
    out->assign(in_.data(), n);
    in_.remove_prefix(n);
    return true;
  }
  bool empty() const { return in_.empty(); }

 private:
  std::string_view in_;
};

}  // namespace pdserve::transport
