// Mapping a segment's pages ahead of use with madvise(MADV_POPULATE_READ / _WRITE), Linux 5.14+,
// defined here once for older headers too.
#pragma once

#include <cstddef>
#include <string>

namespace pyshmckpt {

// madvise(MADV_POPULATE_WRITE) over [start, start + nbytes), retried on EINTR: maps and allocates
// the pages for writing. Returns false (nothing done) where the kernel lacks it (EINVAL); throws
// SyscallError otherwise: ENOSPC with a clear message where a touch would have raised SIGBUS
// (EFAULT: a full tmpfs, or a file cut short), its own errno for anything else.
bool populate_for_writing(void* start, std::size_t nbytes, const std::string& name);

// The same with MADV_POPULATE_READ: maps the pages for reading.
bool populate_for_reading(void* start, std::size_t nbytes, const std::string& name);

// For tests: with `forced`, both functions above return false at once, as on kernels before 5.14,
// so that the paths that touch pages one by one run on any kernel. Process-wide.
void force_populate_fallback(bool forced) noexcept;
bool populate_fallback_forced() noexcept;

}  // namespace pyshmckpt
