// Shared by the transport tests and their peer process: framing over a
// socketpair (the stand-in for the control plane) and the deterministic KV
// contents every process can regenerate.
#pragma once

#include <poll.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kv/kv_layout.h"
#include "kv/kv_pool.h"

namespace pdserve::transport::testing {

inline bool WriteAll(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = ::write(fd, c, n);
    if (w <= 0) return false;
    c += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

inline bool WriteFrame(int fd, const std::string& s) {
  uint64_t n = s.size();
  return WriteAll(fd, &n, sizeof(n)) && WriteAll(fd, s.data(), s.size());
}

// Bounded: never waits past `timeout` in total.
inline absl::StatusOr<std::string> ReadFrame(int fd, absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  auto read_exact = [&](char* p, size_t n) -> absl::Status {
    while (n > 0) {
      int ms =
          static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
      if (ms <= 0) return absl::DeadlineExceededError("frame read timed out");
      pollfd pfd{fd, POLLIN, 0};
      if (poll(&pfd, 1, ms) <= 0) continue;
      ssize_t r = ::read(fd, p, n);
      if (r <= 0) return absl::UnavailableError("peer closed the pipe");
      p += r;
      n -= static_cast<size_t>(r);
    }
    return absl::OkStatus();
  };
  uint64_t n = 0;
  absl::Status s = read_exact(reinterpret_cast<char*>(&n), sizeof(n));
  if (!s.ok()) return s;
  if (n > (1ull << 30)) return absl::InvalidArgumentError("frame too large");
  std::string out(n, '\0');
  s = read_exact(out.data(), n);
  if (!s.ok()) return s;
  return out;
}

// Value of one KV element, a pure function of its coordinates, so that
// sources fill and sinks verify without shipping the data twice.
inline uint32_t KvValue(uint64_t seed, int layer, int kv, int head,
                        int64_t token, int d) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull;
  for (uint64_t v : {uint64_t(layer), uint64_t(kv), uint64_t(head),
                     uint64_t(token), uint64_t(d)}) {
    x ^= v + 0x9E3779B97F4A7C15ull + (x << 6) + (x >> 2);
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 31;
  }
  return static_cast<uint32_t>(x) | 1u;  // never zero: unwritten bytes stay 0
}

// Writes the values of tokens [0, num_tokens) for every layer/head `pool`
// holds into `blocks` (token order). Returns the expected image when used on
// a zero buffer of the pool's size.
inline void FillKv(const kv::KvCacheLayout& l, char* base,
                   const std::vector<int64_t>& blocks, int64_t num_tokens,
                   uint64_t seed) {
  const size_t es = kv::KvDTypeSize(l.dtype);
  for (int64_t t = 0; t < num_tokens; ++t) {
    int64_t b = blocks[t / l.block_size];
    int slot = static_cast<int>(t % l.block_size);
    for (int layer = 0; layer < l.num_layers; ++layer) {
      for (int kv = 0; kv < 2; ++kv) {
        for (int h = 0; h < l.num_kv_heads; ++h) {
          int64_t off = l.Offset(b, layer, kv, h, slot);
          for (int d = 0; d < l.head_dim; ++d) {
            uint32_t v = KvValue(seed, layer + l.layer_offset, kv,
                                 h + l.kv_head_offset, t, d);
            std::memcpy(base + (off + d) * es, &v, es);
          }
        }
      }
    }
  }
}

}  // namespace pdserve::transport::testing
