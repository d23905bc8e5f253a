#include "segment.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include "errors.h"
#include "page_populate.h"
#include "pinning.h"
#include "thread_pool.h"

namespace pyshmckpt {
namespace {

std::string errno_text(int err) { return std::strerror(err); }

[[noreturn]] void throw_errno(const char* call, const std::string& name, int err = errno,
                              const std::string& detail = "") {
  throw SyscallError(err, call, name, detail.empty() ? errno_text(err) : detail);
}

std::string shm_path(const std::string& name) {
  return name.empty() || name[0] == '/' ? name : "/" + name;
}

std::string bare_name(const std::string& name) {
  return !name.empty() && name[0] == '/' ? name.substr(1) : name;
}

void random_bytes(std::uint8_t* out, std::size_t n) {
  std::size_t got = 0;
  while (got < n) {
    ssize_t r = getrandom(out + got, n - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      throw_errno("getrandom", "");
    }
    got += static_cast<std::size_t>(r);
  }
}

std::string to_hex(const std::uint8_t* data, std::size_t n) {
  static const char digits[] = "0123456789abcdef";
  std::string out(2 * n, '0');
  for (std::size_t i = 0; i < n; ++i) {
    out[2 * i] = digits[data[i] >> 4];
    out[2 * i + 1] = digits[data[i] & 15];
  }
  return out;
}

// Where glibc's shm_open puts names: checked against the open descriptor after locking.
constexpr char kShmDir[] = "/dev/shm/";
// A collector holds LOCK_EX only from its open to its unlink and close (microseconds); a lock
// still refused after this long is someone else's bug, reported rather than waited out.
constexpr auto kLockWait = std::chrono::seconds(5);
constexpr int kCollectedRetries = 8;

std::atomic<double> lock_delay_s{0.0};

// flock(LOCK_SH) on the segment's descriptor, held until it is closed: while any process holds it,
// no collector can take LOCK_EX, so none removes the segment. A refusal means a collector holds
// LOCK_EX right now (it may be removing the name): wait for it, bounded, and let the caller check
// whether the name survived.
void lock_shared(int fd, const std::string& name) {
  const double delay = lock_delay_s.load(std::memory_order_relaxed);
  if (delay > 0) std::this_thread::sleep_for(std::chrono::duration<double>(delay));
  const auto deadline = std::chrono::steady_clock::now() + kLockWait;
  auto pause = std::chrono::microseconds(50);
  while (::flock(fd, LOCK_SH | LOCK_NB) != 0) {
    const int err = errno;
    if (err == EINTR) continue;
    if (err != EWOULDBLOCK) throw_errno("flock(LOCK_SH)", name, err);
    if (std::chrono::steady_clock::now() >= deadline) {
      throw_errno("flock(LOCK_SH)", name, err,
                  "another process has held the segment exclusively for over 5 s");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(10000));
  }
}

// Whether /dev/shm/<name> still is the file open as `fd` (a collector may have unlinked the name
// between our shm_open and our lock).
bool still_named(int fd, const std::string& name) {
  struct stat open_file;
  struct stat named;
  if (fstat(fd, &open_file) != 0) throw_errno("fstat", name);
  if (lstat((kShmDir + name).c_str(), &named) != 0) {
    if (errno == ENOENT) return false;
    throw_errno("lstat", name);
  }
  return open_file.st_dev == named.st_dev && open_file.st_ino == named.st_ino;
}

// fallocate(fd, 0, offset, nbytes), retried on EINTR; ENOSPC with a clear message.
void reserve(int fd, std::uint64_t offset, std::size_t nbytes, const std::string& name) {
  if (nbytes == 0) return;
  int rc;
  do {
    rc = ::fallocate(fd, 0, static_cast<off_t>(offset), static_cast<off_t>(nbytes));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int err = errno;
    throw_errno("fallocate", name, err,
                err == ENOSPC
                    ? "not enough shared memory to allocate " + std::to_string(nbytes) + " bytes"
                    : "");
  }
}

std::uint64_t process_start_ticks(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string content((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  // The command name (field 2) may contain spaces and parentheses; fields resume after the last ')'.
  auto close_paren = content.rfind(')');
  if (close_paren == std::string::npos) return 0;
  std::istringstream rest(content.substr(close_paren + 2));
  std::string field;
  // After ')' come fields 3..; the start time is field 22, i.e. the 20th token here.
  for (int i = 3; i <= 22; ++i) {
    if (!(rest >> field)) return 0;
  }
  return std::strtoull(field.c_str(), nullptr, 10);
}

}  // namespace

std::size_t page_size() {
  static const std::size_t size = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return size;
}

void set_lock_delay(double seconds) noexcept {
  lock_delay_s.store(seconds > 0 ? seconds : 0.0, std::memory_order_relaxed);
}

void populate_pages(std::uint8_t* ptr, std::size_t nbytes, const std::string& name, int fd,
                    std::uint64_t file_offset) {
  if (nbytes == 0) return;
  const std::size_t page = page_size();
  auto begin = reinterpret_cast<std::uintptr_t>(ptr) & ~(page - 1);
  auto end = (reinterpret_cast<std::uintptr_t>(ptr) + nbytes + page - 1) & ~(page - 1);
  const std::size_t total = end - begin;
  // The file offset of `begin` (ptr's page start maps file_offset rounded down alike).
  const std::uint64_t file_begin =
      file_offset - (reinterpret_cast<std::uintptr_t>(ptr) - begin);
  ThreadPool& pool = ThreadPool::instance();
  // Chunks small enough to balance across threads, large enough to amortize the syscall.
  const std::size_t wanted = (total / (4 * pool.num_threads()) + page - 1) & ~(page - 1);
  const std::size_t chunk = std::clamp<std::size_t>(wanted, page, 64u << 20);
  const std::size_t count = (total + chunk - 1) / chunk;
  std::atomic<bool> failed{false};
  std::atomic<bool> fallback{false};
  std::mutex error_mutex;
  std::exception_ptr error;
  pool.parallel_for(count, [&](std::size_t i) {
    if (failed.load(std::memory_order_relaxed)) return;
    auto* start = reinterpret_cast<std::uint8_t*>(begin + i * chunk);
    std::size_t len = std::min(chunk, total - i * chunk);
    if (fd >= 0) {
      // Reserved before mapped: a full file system fails here instead of raising SIGBUS on a
      // touch below. fallocate calls serialize on the inode while other pieces are mapped.
      try {
        reserve(fd, file_begin + i * chunk, len, name);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        failed.store(true);
        return;
      }
    }
    if (!fallback.load(std::memory_order_relaxed)) {
      try {
        if (populate_for_writing(start, len, name)) return;
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        failed.store(true);
        return;
      }
      fallback.store(true);
    }
    // Kernels before 5.14: touch each page; reserved above or by the caller, so no SIGBUS here.
    for (std::size_t off = 0; off < len; off += page) {
      volatile std::uint8_t* p = start + off;
      *p = *p;
    }
  });
  if (error) std::rethrow_exception(error);
}

Segment Segment::create(std::size_t size, const std::string& prefix, bool populate) {
  if (size == 0) throw ArgumentError("segment size must be positive");
  const bool valid_prefix =
      !prefix.empty() && prefix.size() <= 64 &&
      std::all_of(prefix.begin(), prefix.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
      });
  if (!valid_prefix) {
    throw ArgumentError("segment prefix must be 1 to 64 characters from [A-Za-z0-9._-]");
  }
  const std::size_t page = page_size();
  if (size > (SIZE_MAX - kHeaderSize) / 2) throw ArgumentError("segment size is too large");
  size = (size + page - 1) / page * page;
  const std::size_t mapped = size + kHeaderSize;

  Segment seg;
  seg.size_ = size;
  std::uint8_t token[kTokenSize];
  for (int exists = 0, collected = 0;;) {
    std::uint8_t nonce[16];
    random_bytes(nonce, sizeof nonce);
    std::string name = prefix + "-" + std::to_string(getpid()) + "-" + to_hex(nonce, sizeof nonce);
    const int fd = shm_open(shm_path(name).c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) {
      if (errno != EEXIST || ++exists > 8) throw_errno("shm_open", name);
      continue;
    }
    // Ours from here on: the destructor removes the name and closes the descriptor on failure.
    seg.name_ = std::move(name);
    seg.fd_ = fd;
    seg.owner_ = true;
    seg.closed_ = false;
    seg.unlinked_ = false;
    lock_shared(seg.fd_, seg.name_);
    // A collector that opened the name before our lock took it for a dead process's and removed
    // it: that file is no segment of anyone's; make another.
    if (still_named(seg.fd_, seg.name_)) break;
    seg.unlinked_ = true;  // the name is gone, and may never be unlinked again by us
    seg.release_mapping();
    seg.closed_ = true;
    if (++collected > kCollectedRetries) {
      throw_errno("shm_open", seg.name_, ENOENT,
                  "each new segment was removed by a stale-segment collector before it was locked");
    }
  }
  random_bytes(token, sizeof token);

  // From here on, any failure must remove what was created; the destructor does that.
  struct statvfs vfs;
  if (fstatvfs(seg.fd_, &vfs) == 0) {
    const unsigned long long avail =
        static_cast<unsigned long long>(vfs.f_bavail) * static_cast<unsigned long long>(vfs.f_frsize);
    if (avail < mapped) {
      throw_errno("fstatvfs", seg.name_, ENOSPC,
                  "not enough shared memory: need " + std::to_string(mapped) + " bytes, " +
                      std::to_string(avail) + " free");
    }
  }
  // Processes creating segments at once all pass the check above: the pages are reserved
  // (fallocate, in populate_pages) before any is touched through the mapping.
  if (ftruncate(seg.fd_, static_cast<off_t>(mapped)) != 0) throw_errno("ftruncate", seg.name_);
  void* base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, seg.fd_, 0);
  if (base == MAP_FAILED) throw_errno("mmap", seg.name_);
  seg.base_ = static_cast<std::uint8_t*>(base);
  // The header page at least; the data pages of a lazily filled segment are left to its filler.
  populate_pages(seg.base_, populate ? mapped : page, seg.name_, seg.fd_, 0);

  auto* header = reinterpret_cast<SegmentHeader*>(seg.base_);
  std::memcpy(header->magic, kSegmentMagic, sizeof header->magic);
  header->version = kSegmentVersion;
  header->header_size = static_cast<std::uint32_t>(kHeaderSize);
  header->size = size;
  std::memcpy(header->token, token, sizeof token);
  header->owner_pid = getpid();
  header->owner_start_ticks = process_start_ticks(getpid());
  return seg;
}

Segment Segment::attach(const std::string& name, std::size_t size, const std::string& token,
                        bool map_pages) {
  if (token.size() != kTokenSize) {
    throw ArgumentError("segment token must be " + std::to_string(kTokenSize) + " bytes");
  }
  Segment seg;
  seg.name_ = bare_name(name);
  if (seg.name_.empty() || seg.name_.size() > 255 || seg.name_.find('/') != std::string::npos ||
      seg.name_.find('\0') != std::string::npos) {
    throw ArgumentError("invalid segment name '" + name + "'");
  }
  seg.fd_ = shm_open(shm_path(seg.name_).c_str(), O_RDWR | O_CLOEXEC, 0);
  if (seg.fd_ < 0) throw_errno("shm_open", seg.name_);
  lock_shared(seg.fd_, seg.name_);
  if (!still_named(seg.fd_, seg.name_)) {
    throw_errno("shm_open", seg.name_, ENOENT,
                "the segment was removed as stale (no process had it open) while it was attached");
  }
  struct stat st;
  if (fstat(seg.fd_, &st) != 0) throw_errno("fstat", seg.name_);
  if (st.st_uid != geteuid()) {
    throw_errno("fstat", seg.name_, EACCES,
                "segment is owned by uid " + std::to_string(st.st_uid) + ", not by uid " +
                    std::to_string(geteuid()));
  }
  if ((st.st_mode & 077) != 0) {
    throw_errno("fstat", seg.name_, EACCES, "segment is accessible to other users");
  }
  const std::size_t mapped = size + kHeaderSize;
  if (static_cast<std::size_t>(st.st_size) != mapped) {
    throw ArgumentError("segment '" + seg.name_ + "' holds " +
                        std::to_string(st.st_size > static_cast<off_t>(kHeaderSize)
                                           ? st.st_size - static_cast<off_t>(kHeaderSize)
                                           : 0) +
                        " data bytes, expected " + std::to_string(size));
  }
  // MAP_POPULATE (map_pages): the creator allocated every page; map them all now, once, so that
  // the attaching process takes no page fault when it reads them, on any save.
  void* base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE,
                    MAP_SHARED | (map_pages ? MAP_POPULATE : 0), seg.fd_, 0);
  if (base == MAP_FAILED) throw_errno("mmap", seg.name_);
  seg.base_ = static_cast<std::uint8_t*>(base);
  seg.size_ = size;
  const auto* header = reinterpret_cast<const SegmentHeader*>(seg.base_);
  if (std::memcmp(header->magic, kSegmentMagic, sizeof header->magic) != 0 ||
      header->version != kSegmentVersion || header->header_size != kHeaderSize ||
      header->size != size) {
    throw ArgumentError("segment '" + seg.name_ + "' has no valid pyshmckpt header");
  }
  if (std::memcmp(header->token, token.data(), kTokenSize) != 0) {
    throw ArgumentError("segment '" + seg.name_ + "' token does not match");
  }
  return seg;
}

std::size_t Segment::page_range_end(const char* what, std::size_t offset, std::size_t nbytes) const {
  require_open(what);
  const std::size_t page = page_size();
  if (offset % page != 0 || offset > mapped_size()) {
    throw ArgumentError(std::string(what) + ": offset " + std::to_string(offset) +
                        " is not a page boundary of the mapping");
  }
  return std::min(mapped_size(), (offset + std::min(nbytes, mapped_size()) + page - 1) / page * page);
}

void Segment::allocate_pages(std::size_t offset, std::size_t nbytes) {
  const std::size_t end = page_range_end("allocate_pages", offset, nbytes);
  if (end <= offset) return;
  reserve(fd_, offset, end - offset, name_);
  // Allocated already: mapping the pages ahead is all this adds (nothing on kernels without it).
  populate_for_writing(base_ + offset, end - offset, name_);
}

void Segment::populate(std::size_t offset, std::size_t nbytes) {
  const std::size_t end = page_range_end("populate", offset, nbytes);
  if (end <= offset) return;
  populate_pages(base_ + offset, end - offset, name_, fd_, offset);
}

void Segment::map_pages_for_reading(std::size_t nbytes) {
  require_open("map_pages_for_reading");
  const std::size_t page = page_size();
  const std::size_t wanted = nbytes == 0 ? mapped_size() : std::min(nbytes, mapped_size());
  const std::size_t length = (wanted + page - 1) / page * page;
  if (populate_for_reading(base_, length, name_)) return;
  // Kernels before 5.14: read one byte of each page.
  for (std::size_t off = 0; off < length; off += page) {
    (void)*static_cast<volatile const std::uint8_t*>(base_ + off);
  }
}

Segment::Segment(Segment&& other) noexcept { *this = std::move(other); }

Segment& Segment::operator=(Segment&& other) noexcept {
  if (this != &other) {
    close();
    name_ = std::move(other.name_);
    base_ = other.base_;
    size_ = other.size_;
    fd_ = other.fd_;
    owner_ = other.owner_;
    closed_ = other.closed_;
    unlinked_ = other.unlinked_;
    exports_ = other.exports_;
    pinned_chunk_ = other.pinned_chunk_;
    pin_error_ = std::move(other.pin_error_);
    keep_mapped_ = other.keep_mapped_;
    other.base_ = nullptr;
    other.fd_ = -1;
    other.closed_ = true;
    other.unlinked_ = true;
    other.exports_ = 0;
    other.pinned_chunk_ = 0;
  }
  return *this;
}

Segment::~Segment() {
  close();
  if (fd_ >= 0) ::close(fd_);  // exports outstanding at destruction: keep their mapping only
}

std::string Segment::token() const {
  require_open("token");
  const auto* header = reinterpret_cast<const SegmentHeader*>(base_);
  return std::string(reinterpret_cast<const char*>(header->token), kTokenSize);
}

void Segment::require_open(const char* what) const {
  if (closed_ || base_ == nullptr) {
    throw ArgumentError(std::string("cannot use ") + what + " of closed segment '" + name_ + "'");
  }
}

void Segment::unlink() {
  if (unlinked_ || name_.empty()) return;
  if (shm_unlink(shm_path(name_).c_str()) != 0 && errno != ENOENT) throw_errno("shm_unlink", name_);
  unlinked_ = true;
}

void Segment::release_mapping() noexcept {
  if (base_ != nullptr) {
    if (!keep_mapped_) munmap(base_, mapped_size());
    base_ = nullptr;
  }
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

void Segment::close() noexcept {
  if (closed_) return;
  closed_ = true;
  unpin();
  if (owner_ && !unlinked_ && !name_.empty()) {
    shm_unlink(shm_path(name_).c_str());
    unlinked_ = true;
  }
  if (exports_ == 0) release_mapping();
}

void Segment::acquire_export() {
  require_open("the buffer");
  ++exports_;
}

void Segment::release_export() noexcept {
  if (exports_ > 0) --exports_;
  if (closed_ && exports_ == 0) release_mapping();
}

bool Segment::pin(std::size_t chunk_bytes) {
  require_open("pin");
  if (pinned()) return true;
  pin_error_.clear();
  if (chunk_bytes == 0) throw ArgumentError("pin chunk size must be positive");
  const std::size_t page = page_size();
  chunk_bytes = std::max(page, chunk_bytes / page * page);
  std::string error;
  if (register_host_memory(base_, mapped_size(), chunk_bytes, &error)) {
    pinned_chunk_ = chunk_bytes;
    return true;
  }
  pin_error_ = error;
  return false;
}

void Segment::unpin() noexcept {
  if (pinned_chunk_ == 0 || base_ == nullptr || keep_mapped_) return;
  unregister_host_memory(base_, mapped_size(), pinned_chunk_);
  pinned_chunk_ = 0;
}

}  // namespace pyshmckpt
