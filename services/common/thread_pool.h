// A fixed pool of worker threads for data-parallel loops inside one step
// (attention over sequences and heads, GEMV row blocks). The calling thread
// takes part in every loop, so a pool of size 1 has no extra threads.
//
// Thread-safety: ParallelFor may be called from one thread at a time per pool
// (each engine / TP rank owns its own pool); it blocks until every task ran.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace pdserve {

class ThreadPool {
 public:
  // `num_threads` counts the caller: 1 = run inline. 0 = hardware concurrency.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn(task) for task in [0, num_tasks), spread over the pool; returns
  // when all are done. Tasks are claimed dynamically (atomic counter).
  void ParallelFor(int64_t num_tasks, const std::function<void(int64_t)>& fn);

  // Splits [0, n) into about `num_threads()*chunks_per_thread` contiguous
  // ranges and runs fn(begin, end) on each.
  void ParallelRanges(int64_t n,
                      const std::function<void(int64_t, int64_t)>& fn,
                      int chunks_per_thread = 1);

 private:
  void WorkerLoop();
  void RunTasks();

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  // Written under mu_; read without it by threads spinning briefly before
  // they sleep (a decode step runs ~50 loops a few microseconds apart, and
  // a futex wake-up costs tens of microseconds on a VM).
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> active_workers_{0};
  bool stopping_ = false;  // guarded by mu_
  // Current loop; written under mu_ before generation_ is bumped.
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t num_tasks_ = 0;
  std::atomic<int64_t> next_task_{0};
};

}  // namespace pdserve
