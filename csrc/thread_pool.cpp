#include "thread_pool.h"

#include <algorithm>
#include <atomic>
#include <exception>

namespace pyshmckpt {

struct ThreadPool::Job {
  const std::function<void(std::size_t)>* task;
  std::size_t count;
  std::atomic<std::size_t> next{0};
  std::mutex error_mutex;
  std::exception_ptr error;
};

ThreadPool& ThreadPool::instance() {
  // Leaked on purpose: joining threads from a static destructor at interpreter exit can deadlock.
  static ThreadPool* pool = new ThreadPool(
      std::min<std::size_t>(std::max(1u, std::thread::hardware_concurrency()), 8));
  return *pool;
}

ThreadPool::ThreadPool(std::size_t num_threads) { start(num_threads > 0 ? num_threads - 1 : 0); }

ThreadPool::~ThreadPool() { stop(); }

std::size_t ThreadPool::num_threads() const { return workers_.size() + 1; }

void ThreadPool::resize(std::size_t num_threads) {
  std::lock_guard<std::mutex> submit(submit_mutex_);
  stop();
  start(num_threads > 0 ? num_threads - 1 : 0);
}

void ThreadPool::start(std::size_t num_workers) {
  stopping_ = false;
  workers_.reserve(num_workers);
  for (std::size_t i = 0; i < num_workers; ++i) workers_.emplace_back([this] { worker_loop(); });
}

void ThreadPool::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
}

void ThreadPool::run_tasks(Job& job) {
  for (;;) {
    std::size_t i = job.next.fetch_add(1, std::memory_order_relaxed);
    if (i >= job.count) return;
    try {
      (*job.task)(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(job.error_mutex);
      if (!job.error) job.error = std::current_exception();
    }
  }
}

void ThreadPool::worker_loop() {
  std::size_t seen_serial = 0;
  for (;;) {
    Job* job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || (job_ != nullptr && job_serial_ != seen_serial); });
      if (stopping_) return;
      job = job_;
      seen_serial = job_serial_;
      ++active_workers_;
    }
    run_tasks(*job);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      --active_workers_;
    }
    finished_.notify_all();
  }
}

void ThreadPool::parallel_for(std::size_t count, const std::function<void(std::size_t)>& task) {
  if (count == 0) return;
  std::lock_guard<std::mutex> submit(submit_mutex_);
  Job job;
  job.task = &task;
  job.count = count;
  if (count == 1 || workers_.empty()) {
    run_tasks(job);
  } else {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &job;
      ++job_serial_;
    }
    wake_.notify_all();
    run_tasks(job);
    std::unique_lock<std::mutex> lock(mutex_);
    // All indices are claimed once the caller returns from run_tasks; wait for workers still inside
    // a task, and detach the job before it goes out of scope.
    job_ = nullptr;
    finished_.wait(lock, [&] { return active_workers_ == 0; });
  }
  if (job.error) std::rethrow_exception(job.error);
}

}  // namespace pyshmckpt
