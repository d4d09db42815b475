// One read-only streaming pass over a float buffer split among threads: what
// a decode step's weight reads are bounded by (bench/engine_bench's read
// bandwidth, bench/huge_page_bench's small against huge pages).
#pragma once

#include <chrono>
#include <cstddef>
#include <thread>
#include <vector>

namespace pdserve::bench {

// Seconds `threads` threads take to read `floats` floats from `data`, each
// its contiguous share, summed so the reads are not optimized away.
inline double StreamReadSeconds(const float* data, size_t floats, int threads) {
  std::vector<double> sinks(threads);
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      const size_t begin = floats * t / threads,
                   end = floats * (t + 1) / threads;
      float acc[16] = {};
      for (size_t i = begin; i + 16 <= end; i += 16) {
        for (int k = 0; k < 16; ++k) acc[k] += data[i + k];
      }
      double total = 0;
      for (float a : acc) total += a;
      sinks[t] = total;
    });
  }
  for (auto& w : workers) w.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

}  // namespace pdserve::bench
