#include "page_populate.h"

#include <sys/mman.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "errors.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace pyshmckpt {
namespace {

std::atomic<bool> fallback_forced{false};

bool populate(void* start, std::size_t nbytes, int advice, const char* call,
              const std::string& name) {
  if (fallback_forced.load(std::memory_order_relaxed)) return false;
  int rc;
  do {
    rc = madvise(start, nbytes, advice);
  } while (rc != 0 && errno == EINTR);
  if (rc == 0) return true;
  const int err = errno;
  if (err == EINVAL) return false;  // kernels before 5.14
  if (err == EFAULT || err == ENOSPC) {  // EFAULT: where a touch would have raised SIGBUS
    throw SyscallError(ENOSPC, call, name,
                       "not enough shared memory for the segment's pages (or its file was cut short)");
  }
  throw SyscallError(err, call, name, std::strerror(err));
}

}  // namespace

void force_populate_fallback(bool forced) noexcept {
  fallback_forced.store(forced, std::memory_order_relaxed);
}

bool populate_fallback_forced() noexcept { return fallback_forced.load(std::memory_order_relaxed); }

bool populate_for_writing(void* start, std::size_t nbytes, const std::string& name) {
  return populate(start, nbytes, MADV_POPULATE_WRITE, "madvise(MADV_POPULATE_WRITE)", name);
}

bool populate_for_reading(void* start, std::size_t nbytes, const std::string& name) {
  return populate(start, nbytes, MADV_POPULATE_READ, "madvise(MADV_POPULATE_READ)", name);
}

}  // namespace pyshmckpt
