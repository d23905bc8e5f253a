// A small persistent pool of worker threads for memory-bound loops (copies, prefaulting, checksums).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace pyshmckpt {

class ThreadPool {
 public:
  // The process-wide pool. Its size defaults to min(hardware threads, 8).
  static ThreadPool& instance();

  explicit ThreadPool(std::size_t num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Runs task(i) for every i in [0, count) on the workers and the calling thread, and returns when
  // all are done. Tasks claim indices dynamically, so uneven tasks balance themselves. The first
  // exception thrown by a task is rethrown here after every task has finished.
  void parallel_for(std::size_t count, const std::function<void(std::size_t)>& task);

  // Total threads that take part in parallel_for (workers plus the caller).
  std::size_t num_threads() const;
  // Replaces the workers; must not be called while parallel_for runs on another thread.
  void resize(std::size_t num_threads);

 private:
  struct Job;
  void start(std::size_t num_workers);
  void stop();
  void worker_loop();
  static void run_tasks(Job& job);

  std::mutex submit_mutex_;  // one job at a time
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable finished_;
  std::vector<std::thread> workers_;
  Job* job_ = nullptr;
  std::size_t job_serial_ = 0;
  std::size_t active_workers_ = 0;
  bool stopping_ = false;
};

}  // namespace pyshmckpt
