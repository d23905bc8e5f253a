// A named POSIX shared-memory segment: created by its owner, attached by name by other processes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pyshmckpt {

// First page of every segment. Attaching checks magic, version, size and token, so that a process
// that merely guesses or reuses a name cannot be handed someone else's memory.
struct SegmentHeader {
  char magic[16];
  std::uint32_t version;
  std::uint32_t header_size;
  std::uint64_t size;
  std::uint8_t token[16];
  // The creator, for information only (`pyshmckpt gc` shows it): a pid means nothing in another
  // PID namespace, so whether a segment is in use is told by its lock (see Segment), never by these.
  std::int64_t owner_pid;
  std::uint64_t owner_start_ticks;  // field 22 of /proc/<pid>/stat
};

constexpr char kSegmentMagic[16] = "PYSHMCKPT-SEG";
constexpr std::uint32_t kSegmentVersion = 1;
constexpr std::size_t kHeaderSize = 4096;
constexpr std::size_t kTokenSize = 16;

class Segment {
 public:
  // Every open Segment (created or attached) holds flock(LOCK_SH) on its descriptor for as long as
  // the descriptor is open; the kernel drops it when the last process holding it dies. A segment is
  // stale exactly when a collector can take flock(LOCK_EX | LOCK_NB) on it, whatever PID namespace
  // its users run in (see pyshmckpt/shm/stale.py).
  //
  // Creates a segment named "<prefix>-<pid>-<32 hex digits>" with mode 0600 and O_EXCL, holding
  // `size` bytes after the header, locked as above (a name a collector removed between its
  // creation and the lock is given up for a new one). Every page is reserved in the file
  // (fallocate) and then mapped, in parallel, before this returns, so a full /dev/shm is a
  // SyscallError(ENOSPC) here and never a SIGBUS later, whatever the kernel.
  // populate=false reserves and maps the header page only: the data pages are filled later
  // through the file (pwritev) or allocate_pages/populate.
  static Segment create(std::size_t size, const std::string& prefix, bool populate = true);
  // Maps an existing segment, locked as above. Checks that the caller's uid owns it, that it is not
  // accessible to others, that its size and header match, and that its token equals `token`; a
  // segment that was collected meanwhile is a SyscallError(ENOENT). With map_pages=true every page
  // is mapped now (MAP_POPULATE), else on first access or by map_pages_for_reading().
  static Segment attach(const std::string& name, std::size_t size, const std::string& token,
                        bool map_pages = true);
  // Maps the pages of an attached segment's first `nbytes` bytes (the header included; 0: all)
  // for reading (MADV_POPULATE_READ; on kernels before 5.14 by reading one byte per page), so that
  // reading them takes no page fault. Meant for pages the owner has allocated: a page it has not
  // is allocated (zeroed) by this, as by a read.
  void map_pages_for_reading(std::size_t nbytes = 0);
  // Allocates the pages of bytes [offset, offset + nbytes) of the mapping (page-aligned offset) in
  // the segment's file (fallocate: pages already allocated stay as they are and nothing is
  // written, so other threads may write those pages meanwhile), then maps them for writing
  // (MADV_POPULATE_WRITE; kernels before 5.14 map them on first access, which can no longer
  // fail). A full /dev/shm is a SyscallError(ENOSPC), never a SIGBUS.
  void allocate_pages(std::size_t offset, std::size_t nbytes);
  // Reserves (fallocate) and maps for writing the pages of bytes [offset, offset + nbytes) of the
  // mapping (page-aligned offset) in parallel on the thread pool; on kernels before 5.14 each page
  // is touched (read and written back), so nobody may write those pages meanwhile (see
  // allocate_pages for pages in use). A full /dev/shm is a SyscallError(ENOSPC), never a SIGBUS.
  void populate(std::size_t offset, std::size_t nbytes);

  Segment(Segment&& other) noexcept;
  Segment& operator=(Segment&& other) noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment();

  // Removes the name; idempotent. Mappings stay valid until closed.
  void unlink();
  // Unpins, unlinks if this process created the segment, unmaps and closes the descriptor. Both
  // wait until `release_export` has been called for every `acquire_export`. Idempotent.
  void close() noexcept;

  // Buffer-protocol bookkeeping: while exports are outstanding the mapping stays alive.
  void acquire_export();
  void release_export() noexcept;

  const std::string& name() const noexcept { return name_; }
  std::string token() const;                                   // raw 16 bytes
  std::size_t size() const noexcept { return size_; }           // data bytes after the header
  std::size_t mapped_size() const noexcept { return size_ + kHeaderSize; }
  std::size_t data_offset() const noexcept { return kHeaderSize; }
  std::uint8_t* base() const noexcept { return base_; }         // start of the mapping (header)
  int fd() const noexcept { return closed_ ? -1 : fd_; }
  // The descriptor while an export is held, even if another thread closed the segment meanwhile.
  int held_fd() const noexcept { return fd_; }
  bool owner() const noexcept { return owner_; }
  bool closed() const noexcept { return closed_; }
  bool unlinked() const noexcept { return unlinked_; }
  std::size_t exports() const noexcept { return exports_; }

  // Pins the mapping for CUDA (no-op result when built without CUDA or without a device).
  bool pin(std::size_t chunk_bytes);
  void unpin() noexcept;
  bool pinned() const noexcept { return pinned_chunk_ > 0; }
  std::size_t pin_chunk_bytes() const noexcept { return pinned_chunk_; }
  const std::string& pin_error() const noexcept { return pin_error_; }

  // Device copies may still land in the mapping (a batch failed part-way, or whether its copies
  // completed cannot be known): from now on it is never unpinned or unmapped, only unlinked and
  // its descriptor closed, so that a late copy cannot write into memory reused for something else.
  void keep_mapped() noexcept { keep_mapped_ = true; }
  // Another process takes the segment over (a writer holding the checkpoint in it after this
  // process's death): from now on close() leaves its name, like a segment attached by name.
  void disown() noexcept { owner_ = false; }
  bool kept_mapped() const noexcept { return keep_mapped_; }

 private:
  Segment() = default;
  void release_mapping() noexcept;
  void require_open(const char* what) const;
  // The end of the pages of [offset, offset + nbytes) within the mapping; `offset` must be a page
  // boundary of it (ArgumentError otherwise).
  std::size_t page_range_end(const char* what, std::size_t offset, std::size_t nbytes) const;

  std::string name_;
  std::uint8_t* base_ = nullptr;
  std::size_t size_ = 0;
  int fd_ = -1;
  bool owner_ = false;
  bool closed_ = false;
  bool unlinked_ = false;
  std::size_t exports_ = 0;
  std::size_t pinned_chunk_ = 0;
  std::string pin_error_;
  bool keep_mapped_ = false;
};

// The system's page size in bytes.
std::size_t page_size();

// Populates page tables (and allocates pages) for [ptr, ptr + nbytes) in parallel using
// MADV_POPULATE_WRITE, falling back to touching one byte per page where the kernel lacks it.
// With `fd` >= 0 (the file mapped at `ptr` from its byte `file_offset`), each piece's pages are
// reserved with fallocate first, so that a full filesystem is a SyscallError(ENOSPC) on every
// kernel. With fd < 0 the caller must have reserved them: on kernels without MADV_POPULATE_WRITE
// touching a page a full filesystem cannot hold raises SIGBUS.
// SAFETY: `ptr` must point into a live, writable shared mapping of at least `nbytes` bytes that
// nobody else is writing concurrently (the fallback writes bytes back unchanged).
void populate_pages(std::uint8_t* ptr, std::size_t nbytes, const std::string& name, int fd = -1,
                    std::uint64_t file_offset = 0);

// For tests: seconds create() and attach() wait between opening a segment and locking it (0: none),
// so that a collector can be made to run in between. Process-wide.
void set_lock_delay(double seconds) noexcept;

}  // namespace pyshmckpt
