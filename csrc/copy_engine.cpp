#include "copy_engine.h"

#include <sys/mman.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <chrono>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "cuda_driver.h"
#include "device_copies.h"
#include "errors.h"
#include "page_populate.h"
#include "stream_copy.h"
#include "thread_pool.h"


namespace pyshmckpt {

void check_destinations(const Segment& segment, const CopyEntry* entries, std::size_t count) {
  const std::uint64_t lo = segment.data_offset();
  const std::uint64_t hi = segment.mapped_size();
  for (std::size_t i = 0; i < count; ++i) {
    const CopyEntry& e = entries[i];
    if (e.nbytes == 0) continue;
    if (e.dst < lo || e.dst > hi || e.nbytes > hi - e.dst) {
      throw ArgumentError("copy entry " + std::to_string(i) + " writes [" + std::to_string(e.dst) +
                          ", " + std::to_string(e.dst + e.nbytes) +
                          ") outside the data region [" + std::to_string(lo) + ", " +
                          std::to_string(hi) + ") of segment '" + segment.name() + "'");
    }
    if (e.src == 0) {
      throw ArgumentError("copy entry " + std::to_string(i) + " has a null source pointer");
    }
  }
}

void copy_host(Segment& segment, const CopyEntry* entries, std::size_t count) {
  if (segment.closed()) throw ArgumentError("segment '" + segment.name() + "' is closed");
  check_destinations(segment, entries, count);
  copy_host_unchecked(segment.base(), entries, count);
}

namespace {

// Writes every byte of `iov` at `position` of `fd`, resuming after short writes and EINTR.
void pwritev_all(int fd, std::vector<iovec>& iov, off_t position, const std::string& name) {
  std::size_t first = 0;
  while (first < iov.size()) {
    const int n = static_cast<int>(std::min<std::size_t>(iov.size() - first, IOV_MAX));
    const ssize_t written = ::pwritev(fd, iov.data() + first, n, position);
    if (written < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      throw SyscallError(err, "pwritev", name,
                         err == ENOSPC ? "not enough shared memory to fill the segment"
                                       : std::string(std::strerror(err)));
    }
    position += written;
    auto left = static_cast<std::size_t>(written);
    while (first < iov.size() && left >= iov[first].iov_len) left -= iov[first++].iov_len;
    if (left > 0) {
      iov[first].iov_base = static_cast<std::uint8_t*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
  }
}

}  // namespace

// Batches at least this large are shared between the calling thread, writing pieces through the
// file from the front, and a helper thread filling pieces through the mapping from the back, until
// they meet. The helper must also zero each page before copying into it, and takes fewer pieces
// when it gets less of a core.
constexpr std::uint64_t kShareBytes = std::uint64_t{32} << 20;
constexpr std::uint64_t kPieceBytes = std::uint64_t{4} << 20;  // a multiple of any page size

namespace {

// Writes entries sorted by destination through the segment's file, adjacent ones in one pwritev.
void pwrite_sorted(Segment& segment, const CopyEntry* first, const CopyEntry* last) {
  std::vector<iovec> iov;
  while (first != last) {
    const std::uint64_t start = first->dst;
    std::uint64_t end = start;
    iov.clear();
    for (; first != last && first->dst == end; ++first) {
      iov.push_back({reinterpret_cast<void*>(first->src), first->nbytes});
      end += first->nbytes;
    }
    pwritev_all(segment.held_fd(), iov, static_cast<off_t>(start), segment.name());
  }
}

// Entries sorted by destination, cut where destinations cross a multiple of kPieceBytes (of the
// mapping's offsets, so that pieces line up with huge pages too): piece p is entries[starts[p],
// starts[p + 1]), and no page holds bytes of two pieces.
struct Pieces {
  std::vector<CopyEntry> entries;
  std::vector<std::size_t> starts;

  explicit Pieces(const std::vector<CopyEntry>& sorted) {
    std::uint64_t current = ~std::uint64_t{0};
    for (CopyEntry e : sorted) {
      while (e.nbytes > 0) {
        const std::uint64_t piece = e.dst / kPieceBytes;
        const std::uint64_t n = std::min(e.nbytes, (piece + 1) * kPieceBytes - e.dst);
        if (piece != current) {
          starts.push_back(entries.size());
          current = piece;
        }
        entries.push_back({e.src, e.dst, n});
        e.src += n;
        e.dst += n;
        e.nbytes -= n;
      }
    }
    starts.push_back(entries.size());
  }
  std::size_t size() const { return starts.size() - 1; }
  std::uint64_t bytes(std::size_t p) const {
    std::uint64_t n = 0;
    for (const CopyEntry* e = begin(p); e != end(p); ++e) n += e->nbytes;
    return n;
  }
  const CopyEntry* begin(std::size_t p) const { return entries.data() + starts[p]; }
  const CopyEntry* end(std::size_t p) const { return entries.data() + starts[p + 1]; }
};

// Set once MADV_POPULATE_WRITE was found missing (kernels before 5.14): later batches go through
// the file alone.
std::atomic<bool> populate_write_missing{false};

// Fills entries (sorted by destination) through the mapping: maps and allocates their pages with
// MADV_POPULATE_WRITE, which fails where a full /dev/shm would raise SIGBUS on a touch, then copies
// the bytes in. False, with nothing written, on kernels without it.
bool fill_through_mapping(Segment& segment, const CopyEntry* first, const CopyEntry* last) {
  const std::uint64_t page = page_size();
  std::uint64_t end = 0;
  for (const CopyEntry* e = first; e != last; ++e) end = std::max(end, e->dst + e->nbytes);
  const std::uint64_t start = first->dst / page * page;
  end = std::min<std::uint64_t>((end + page - 1) / page * page, segment.mapped_size());
  std::uint8_t* base = segment.base();
  if (!populate_for_writing(base + start, end - start, segment.name())) {
    populate_write_missing.store(true, std::memory_order_relaxed);
    return false;
  }
  for (const CopyEntry* e = first; e != last; ++e) {
    stream_copy(base + e->dst, reinterpret_cast<const void*>(e->src), e->nbytes);
  }
  return true;
}

// Pieces claimed from both ends: the file's from the front, the mapping's from the back.
class PieceQueue {
 public:
  explicit PieceQueue(std::size_t count) : back_(count) {}
  // The next piece from the front (or the back), or false once they have met or work stopped.
  bool front(std::size_t* piece) { return take(piece, true); }
  bool back(std::size_t* piece) { return take(piece, false); }
  void stop() {
    std::lock_guard<std::mutex> lock(mutex_);
    stopped_ = true;
  }

 private:
  bool take(std::size_t* piece, bool from_front) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopped_ || front_ >= back_) return false;
    *piece = from_front ? front_++ : --back_;
    return true;
  }
  std::mutex mutex_;
  std::size_t front_ = 0;
  std::size_t back_;
  bool stopped_ = false;
};

// The helper thread of a shared write: it fills pieces from the back until the queue meets or
// stops; the destructor stops the queue and joins it, whatever the caller's thread is doing.
class MappingHelper {
 public:
  MappingHelper(Segment& segment, const Pieces& pieces, PieceQueue& queue)
      : queue_(queue), left_(pieces.size()) {
    thread_ = std::thread([this, &segment, &pieces] {
      std::size_t p;
      try {
        while (queue_.back(&p)) {
          if (!fill_through_mapping(segment, pieces.begin(p), pieces.end(p))) {
            left_ = p;  // not written: the caller writes it through the file
            return;
          }
          filled_ += pieces.bytes(p);
        }
      } catch (...) {
        error_ = std::current_exception();
        queue_.stop();
      }
    });
  }
  ~MappingHelper() { finish(); }
  MappingHelper(const MappingHelper&) = delete;
  MappingHelper& operator=(const MappingHelper&) = delete;

  // Joins the helper; then `left`, `filled` and `error` are its results.
  void finish() noexcept {
    if (!thread_.joinable()) return;
    queue_.stop();  // once the caller's thread is done, or failed: nothing more is taken
    thread_.join();
  }
  std::size_t left() const { return left_; }
  std::uint64_t filled() const { return filled_; }
  std::exception_ptr error() const { return error_; }

 private:
  PieceQueue& queue_;
  std::size_t left_;
  std::uint64_t filled_ = 0;
  std::exception_ptr error_;
  std::thread thread_;
};

}  // namespace

std::uint64_t write_host_through_file(Segment& segment, const CopyEntry* entries,
                                      std::size_t count) {
  if (segment.closed()) throw ArgumentError("segment '" + segment.name() + "' is closed");
  check_destinations(segment, entries, count);
  std::vector<CopyEntry> sorted;
  sorted.reserve(count);
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < count; ++i) {
    if (entries[i].nbytes > 0) sorted.push_back(entries[i]);
    total += entries[i].nbytes;
  }
  std::sort(sorted.begin(), sorted.end(),
            [](const CopyEntry& a, const CopyEntry& b) { return a.dst < b.dst; });
  if (total < kShareBytes || ThreadPool::instance().num_threads() < 2 ||
      populate_write_missing.load(std::memory_order_relaxed)) {
    pwrite_sorted(segment, sorted.data(), sorted.data() + sorted.size());
    return 0;
  }
  const Pieces pieces(sorted);
  PieceQueue queue(pieces.size());
  std::unique_ptr<MappingHelper> helper;
  try {
    helper = std::make_unique<MappingHelper>(segment, pieces, queue);
  } catch (const std::system_error&) {  // no thread to be had (a process or thread limit)
    pwrite_sorted(segment, sorted.data(), sorted.data() + sorted.size());
    return 0;
  }
  std::size_t p;
  while (queue.front(&p)) pwrite_sorted(segment, pieces.begin(p), pieces.end(p));
  helper->finish();
  if (helper->error()) std::rethrow_exception(helper->error());
  const std::size_t left = helper->left();
  if (left < pieces.size()) {  // the helper stopped there; the front went on to meet it
    pwrite_sorted(segment, pieces.begin(left), pieces.end(left));
  }
  return helper->filled();
}

void copy_host_unchecked(std::uint8_t* base, const CopyEntry* entries, std::size_t count) {
  // Treat the batch as one stream of bytes and cut it into equal pieces; each piece copies the parts
  // of the entries it overlaps. Prefix sums locate a piece's first entry by binary search.
  std::vector<std::uint64_t> starts(count + 1, 0);
  for (std::size_t i = 0; i < count; ++i) starts[i + 1] = starts[i] + entries[i].nbytes;
  const std::uint64_t total = starts[count];
  if (total == 0) return;
  ThreadPool& pool = ThreadPool::instance();
  const bool streaming = total >= kStreamingBytes;
  const std::uint64_t wanted = total / (4 * pool.num_threads()) + 1;
  const std::uint64_t piece = std::clamp<std::uint64_t>(wanted, 256u << 10, 64u << 20);
  const std::size_t pieces = static_cast<std::size_t>((total + piece - 1) / piece);
  pool.parallel_for(pieces, [&](std::size_t p) {
    const std::uint64_t begin = p * piece;
    const std::uint64_t end = std::min(total, begin + piece);
    std::size_t i = static_cast<std::size_t>(
        std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1);
    for (std::uint64_t pos = begin; pos < end && i < count; ++i) {
      const std::uint64_t entry_end = starts[i + 1];
      if (entry_end <= pos) continue;
      const std::uint64_t within = pos - starts[i];
      const std::uint64_t len = std::min(entry_end, end) - pos;
      std::uint8_t* to = base + entries[i].dst + within;
      const auto* from = reinterpret_cast<const std::uint8_t*>(entries[i].src) + within;
      if (streaming) {
        stream_copy(to, from, len);
      } else {
        std::memcpy(to, from, len);
      }
      pos += len;
    }
  });
}

HostCopy::HostCopy(Segment& segment, const CopyEntry* entries, std::size_t count)
    : entries_(entries, entries + count) {
  if (segment.closed()) throw ArgumentError("segment '" + segment.name() + "' is closed");
  check_destinations(segment, entries_.data(), entries_.size());
  std::uint8_t* base = segment.base();
  thread_ = std::thread([this, base] {
    try {
      copy_host_unchecked(base, entries_.data(), entries_.size());
    } catch (...) {
      error_ = std::current_exception();
    }
    finished_.store(true, std::memory_order_release);
  });
}

HostCopy::~HostCopy() {
  if (thread_.joinable()) thread_.join();
}

void HostCopy::wait() {
  if (!joined_) {
    if (thread_.joinable()) thread_.join();
    joined_ = true;
  }
  if (error_) std::rethrow_exception(error_);
}

CopyEvent::~CopyEvent() {
  if (event_ == nullptr) return;
  const CudaDriver& driver = cuda_driver();
  try {
    CudaContextScope scope(device_);
    driver.cuEventDestroy(static_cast<CUevent>(event_));
  } catch (const CudaError&) {
    // The context is gone or unusable: the event goes with it.
  }
}

bool CopyEvent::query() {
  const CudaDriver& driver = require_cuda_driver("querying a device copy");
  CudaContextScope scope(device_);
  CUresult rc = driver.cuEventQuery(static_cast<CUevent>(event_));
  if (rc == kCudaSuccess) return true;
  if (rc == kCudaErrorNotReady) return false;
  throw CudaError(describe_cuda_error("cuEventQuery", rc));
}

bool CopyEvent::wait(double timeout_s) {
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::duration<double>(timeout_s);
  auto pause = std::chrono::microseconds(5);
  while (!query()) {
    if (timeout_s >= 0 && clock::now() >= deadline) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
  return true;
}

std::unique_ptr<CopyEvent> copy_device_async(Segment& segment, const CopyEntry* entries,
                                             std::size_t count, std::uintptr_t stream, int device) {
  if (segment.closed()) throw ArgumentError("segment '" + segment.name() + "' is closed");
  check_destinations(segment, entries, count);
  const CudaDriver& driver = require_cuda_driver("copying from a CUDA device");
  CudaContextScope scope(device);
  auto s = reinterpret_cast<CUstream>(stream);
  // A single copy must not span two separately registered chunks.
  const std::uint64_t chunk = segment.pinned() ? segment.pin_chunk_bytes() : 0;
  std::uint8_t* base = segment.base();
  DeviceCopies copies;
  for (std::size_t i = 0; i < count; ++i) {
    std::uint64_t dst = entries[i].dst;
    std::uint64_t src = entries[i].src;
    std::uint64_t left = entries[i].nbytes;
    while (left > 0) {
      std::uint64_t len = left;
      if (chunk != 0) len = std::min(left, chunk - dst % chunk);
      copies.add(reinterpret_cast<CUdeviceptr>(base + dst), src, len);
      dst += len;
      src += len;
      left -= len;
    }
  }
  const QueuedCopies queued = queue_device_copies(driver, copies, s);
  // Once a copy is queued, a failure leaves copies that may still land: the mapping stays.
  if (queued.rc != kCudaSuccess) {
    if (queued.some_queued) segment.keep_mapped();
    throw CudaError(describe_cuda_error(queued.call, queued.rc));
  }
  auto fail = [&](const char* call, CUresult rc) {
    if (!copies.sizes.empty()) segment.keep_mapped();
    throw CudaError(describe_cuda_error(call, rc));
  };
  CUevent event = nullptr;
  CUresult rc = driver.cuEventCreate(&event, kEventDisableTiming);
  if (rc != kCudaSuccess) fail("cuEventCreate", rc);
  rc = driver.cuEventRecord(event, s);
  if (rc != kCudaSuccess) {
    driver.cuEventDestroy(event);
    fail("cuEventRecord", rc);
  }
  return std::make_unique<CopyEvent>(event, device);
}

}  // namespace pyshmckpt
