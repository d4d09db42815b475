#include "common/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace pdserve {
namespace {

// How long a thread polls for the next loop (a worker) or for the workers to
// finish (the caller) before sleeping on a condition variable. Loops of one
// step follow each other within microseconds; between steps the pool sleeps
// after this long.
constexpr std::chrono::microseconds kSpin{50};

// Polls `done` until it returns true or kSpin has passed; returns its last
// value.
template <typename Done>
bool SpinUntil(const Done& done) {
  const auto deadline = std::chrono::steady_clock::now() + kSpin;
  for (int i = 0;; ++i) {
    if (done()) return true;
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
    if ((i & 63) == 63 && std::chrono::steady_clock::now() >= deadline) {
      return done();
    }
  }
}

}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0) {
    num_threads =
        static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }
  for (int i = 1; i < num_threads; ++i) {
    workers_.emplace_back([this] { WorkerLoop(); });
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (auto& worker : workers_) worker.join();
}

void ThreadPool::RunTasks() {
  const auto& fn = *fn_;
  const int64_t n = num_tasks_;
  for (int64_t task = next_task_.fetch_add(1, std::memory_order_relaxed);
       task < n; task = next_task_.fetch_add(1, std::memory_order_relaxed)) {
    fn(task);
  }
}

void ThreadPool::WorkerLoop() {
  uint64_t seen_generation = 0;
  while (true) {
    const bool new_loop = SpinUntil([&] {
      return generation_.load(std::memory_order_acquire) != seen_generation;
    });
    if (!new_loop) {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] {
        return stopping_ ||
               generation_.load(std::memory_order_acquire) != seen_generation;
      });
      if (stopping_) return;
    }
    seen_generation = generation_.load(std::memory_order_acquire);
    RunTasks();
    if (active_workers_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      // Under the mutex, so a caller between its check and its wait cannot
      // miss this.
      std::lock_guard<std::mutex> lock(mu_);
      done_cv_.notify_one();
    }
  }
}

void ThreadPool::ParallelFor(int64_t num_tasks,
                             const std::function<void(int64_t)>& fn) {
  if (num_tasks <= 0) return;
  if (workers_.empty() || num_tasks == 1) {
    for (int64_t task = 0; task < num_tasks; ++task) fn(task);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    num_tasks_ = num_tasks;
    next_task_.store(0, std::memory_order_relaxed);
    active_workers_.store(static_cast<int>(workers_.size()),
                          std::memory_order_relaxed);
    // Release: a worker that sees the new generation sees the loop above.
    generation_.fetch_add(1, std::memory_order_release);
  }
  work_cv_.notify_all();
  RunTasks();
  auto all_done = [&] {
    return active_workers_.load(std::memory_order_acquire) == 0;
  };
  if (!SpinUntil(all_done)) {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, all_done);
  }
  fn_ = nullptr;
}

void ThreadPool::ParallelRanges(int64_t n,
                                const std::function<void(int64_t, int64_t)>& fn,
                                int chunks_per_thread) {
  if (n <= 0) return;
  int64_t chunks =
      std::min<int64_t>(n, int64_t{num_threads()} * chunks_per_thread);
  ParallelFor(chunks, [&](int64_t chunk) {
    int64_t begin = n * chunk / chunks;
    int64_t end = n * (chunk + 1) / chunks;
    if (begin < end) fn(begin, end);
  });
}

}  // namespace pdserve
