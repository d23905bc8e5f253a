// Copies batches of (source pointer, destination offset, nbytes) entries into a segment.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <thread>
#include <vector>

#include "segment.h"

namespace pyshmckpt {

struct CopyEntry {
  std::uint64_t src;     // source address (host or device)
  std::uint64_t dst;     // destination offset from the start of the segment's mapping
  std::uint64_t nbytes;
};

// Checks that every destination lies in the segment's data region; throws ArgumentError naming the
// first bad entry. Called before any byte is copied, so a bad batch copies nothing.
void check_destinations(const Segment& segment, const CopyEntry* entries, std::size_t count);

// Copies checked entries into the mapping at `base` with the process thread pool (no checks).
void copy_host_unchecked(std::uint8_t* base, const CopyEntry* entries, std::size_t count);

// Copies host entries with the process thread pool. Large entries are split across threads and
// small ones are batched, so the work is balanced by bytes rather than by entry.
// SAFETY: every `src` must be readable for `nbytes` bytes and stay alive and unmodified until this
// returns; sources must not overlap the destinations, nor destinations each other (which entry's
// bytes land is unspecified otherwise).
void copy_host(Segment& segment, const CopyEntry* entries, std::size_t count);

// Writes host entries into the segment through its file (pwritev) rather than its mapping, entries
// adjacent in the segment in one call. For a segment whose pages were never allocated: tmpfs
// allocates each page as the write fills it, with no zeroing, page fault or page-table entry
// (about twice as fast as allocating every page and then copying), and a full /dev/shm is a
// SyscallError(ENOSPC), not a SIGBUS. Writes to one file take its inode lock, so a large batch is
// shared: the calling thread writes 4 MiB pieces through the file from its start while a helper
// thread maps and allocates the pages of pieces from its end (MADV_POPULATE_WRITE: ENOSPC, not
// SIGBUS) and copies into them, until they meet. Returns the bytes the helper filled. Destinations
// must not overlap (which entry's bytes land is unspecified otherwise, as for copy_host).
// SAFETY: as copy_host; the caller holds an export of the segment (its descriptor stays open).
std::uint64_t write_host_through_file(Segment& segment, const CopyEntry* entries,
                                      std::size_t count);

// A host copy running on a background thread (which drives the thread pool), so that the caller
// can do other work meanwhile. Entries are checked and copied in by the constructor. The caller
// keeps the segment's mapping alive (an export) until wait() returns, even if it is closed.
class HostCopy {
 public:
  HostCopy(Segment& segment, const CopyEntry* entries, std::size_t count);
  ~HostCopy();
  HostCopy(const HostCopy&) = delete;
  HostCopy& operator=(const HostCopy&) = delete;

  // Waits for the copy and rethrows its error, if any. Idempotent.
  void wait();
  // True once the copy has finished (successfully or not), whether or not wait() was called.
  bool done() const noexcept { return finished_.load(std::memory_order_acquire); }

 private:
  std::vector<CopyEntry> entries_;
  std::exception_ptr error_;
  std::atomic<bool> finished_{false};
  std::thread thread_;
  bool joined_ = false;
};

// Completion of a batch of device-to-host copies.
class CopyEvent {
 public:
  CopyEvent(void* event, int device) noexcept : event_(event), device_(device) {}
  ~CopyEvent();
  CopyEvent(const CopyEvent&) = delete;
  CopyEvent& operator=(const CopyEvent&) = delete;

  // True once every copy of the batch has completed; throws CudaError if one failed.
  bool query();
  // Waits up to `timeout_s` seconds (negative: no limit); true when complete.
  bool wait(double timeout_s);
  int device() const noexcept { return device_; }

 private:
  void* event_;
  int device_;
};

// Issues cuMemcpyDtoHAsync for every entry on `stream` (a CUstream of `device`, such as torch's
// cudaStream_t), splitting copies at pinned-chunk boundaries, and records an event after the last
// one. Throws CudaError; when that happens after copies were queued, the segment is kept mapped
// (Segment::keep_mapped), as they may still land.
// SAFETY: every `src` must be device memory readable for `nbytes` bytes that stays allocated until
// the returned event completes; `stream` must be a live stream of `device` (0 means the legacy
// default stream).
std::unique_ptr<CopyEvent> copy_device_async(Segment& segment, const CopyEntry* entries,
                                             std::size_t count, std::uintptr_t stream, int device);

}  // namespace pyshmckpt
