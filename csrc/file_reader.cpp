#include "file_reader.h"

#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "checksum.h"
#include "errors.h"
#include "thread_pool.h"

namespace pyshmckpt {
namespace {

constexpr std::uint64_t kPiece = 8u << 20;  // a task: large enough for the kernel's readahead
constexpr std::uint64_t kBlock = 512u << 10;  // read, then checksum while the block is in cache
constexpr std::size_t kMaxRun = 256;          // entries one readv takes (IOV_MAX is 1024)

// A task: a piece of one large entry, or a run of small entries that lie back to back in the
// file, read by one preadv (one system call, not one per entry).
struct Piece {
  std::size_t entry;    // the first entry
  std::size_t entries;  // 1 for a piece of a large entry; the run's length otherwise
  std::uint64_t begin;  // within the entry (a run begins at its first entry's start)
  std::uint64_t nbytes;
};

// Reads the run of `count` back-to-back entries starting at `entries` with preadv, a short
// read continued where it stopped; got[i] is what landed of entry i (the file may end inside).
void read_run(int fd, const ReadEntry* entries, std::size_t count, const std::string& path,
              std::uint64_t* got) {
  iovec iov[kMaxRun];
  for (std::size_t i = 0; i < count; ++i) {
    iov[i].iov_base = reinterpret_cast<void*>(entries[i].address);
    iov[i].iov_len = entries[i].nbytes;
    got[i] = 0;
  }
  std::size_t first = 0;  // the entry the next read starts in
  std::uint64_t offset = entries[0].file_offset;
  while (first < count) {
    const ssize_t n = ::preadv(fd, iov + first, static_cast<int>(count - first),
                               static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw SyscallError(errno, "pread", path, std::strerror(errno));
    }
    if (n == 0) return;  // end of file
    offset += static_cast<std::uint64_t>(n);
    auto left = static_cast<std::uint64_t>(n);
    while (left > 0 && first < count) {
      const std::uint64_t take = std::min<std::uint64_t>(left, iov[first].iov_len);
      got[first] += take;
      left -= take;
      iov[first].iov_base = static_cast<std::uint8_t*>(iov[first].iov_base) + take;
      iov[first].iov_len -= take;
      if (iov[first].iov_len == 0) ++first;
    }
  }
}

}  // namespace

void read_file_ranges(int fd, const ReadEntry* entries, std::size_t count, bool checksums,
                      const std::string& path, std::uint32_t* crcs, std::uint64_t* got) {
  std::vector<Piece> pieces;
  std::vector<std::size_t> first(count + 1);
  std::vector<char> in_run(count, 0);  // read by a run: its got and crc are set by the run
  for (std::size_t i = 0; i < count; ++i) {
    crcs[i] = 0;
    got[i] = 0;
  }
  for (std::size_t i = 0; i < count;) {
    first[i] = pieces.size();
    const std::uint64_t n = entries[i].nbytes;
    if (n > 0 && n < kPiece) {  // small: a run of it and the small entries right after it
      std::size_t j = i + 1;
      std::uint64_t total = n;
      while (j < count && j - i < kMaxRun && entries[j].nbytes > 0 &&
             total + entries[j].nbytes <= kPiece &&
             entries[j].file_offset == entries[j - 1].file_offset + entries[j - 1].nbytes) {
        total += entries[j].nbytes;
        ++j;
      }
      if (j - i > 1) {
        pieces.push_back({i, j - i, 0, total});
        for (std::size_t k = i; k < j; ++k) {
          in_run[k] = 1;
          first[k] = pieces.size() - 1;
        }
        i = j;
        continue;
      }
    }
    for (std::uint64_t b = 0; b < n; b += kPiece) pieces.push_back({i, 1, b, std::min(kPiece, n - b)});
    ++i;
  }
  first[count] = pieces.size();
  std::vector<std::uint32_t> piece_crc(pieces.size(), 0);
  std::vector<std::uint64_t> piece_got(pieces.size(), 0);
  ThreadPool::instance().parallel_for(pieces.size(), [&](std::size_t k) {
    const Piece& p = pieces[k];
    if (p.entries > 1) {
      read_run(fd, entries + p.entry, p.entries, path, got + p.entry);
      if (checksums) {
        for (std::size_t i = p.entry; i < p.entry + p.entries; ++i) {
          crcs[i] = crc32c(reinterpret_cast<const void*>(entries[i].address), got[i]);
        }
      }
      return;
    }
    const ReadEntry& e = entries[p.entry];
    auto* dst = reinterpret_cast<std::uint8_t*>(e.address) + p.begin;
    std::uint64_t done = 0;
    std::uint32_t crc = 0;
    while (done < p.nbytes) {
      const std::uint64_t want = std::min(kBlock, p.nbytes - done);
      std::uint64_t block = 0;
      while (block < want) {
        const ssize_t n = ::pread(fd, dst + done + block, want - block,
                                  static_cast<off_t>(e.file_offset + p.begin + done + block));
        if (n < 0) {
          if (errno == EINTR) continue;
          throw SyscallError(errno, "pread", path, std::strerror(errno));
        }
        if (n == 0) break;  // end of file
        block += static_cast<std::uint64_t>(n);
      }
      if (checksums) crc = crc32c(dst + done, block, crc);
      done += block;
      if (block < want) break;
    }
    piece_crc[k] = crc;
    piece_got[k] = done;
  });
  for (std::size_t i = 0; i < count; ++i) {
    if (in_run[i]) continue;  // its run set its got and crc
    std::uint32_t crc = 0;
    std::uint64_t total = 0;
    for (std::size_t k = first[i]; k < first[i + 1]; ++k) {
      if (checksums) crc = crc32c_combine(crc, piece_crc[k], piece_got[k]);
      total += piece_got[k];
      if (piece_got[k] < pieces[k].nbytes) break;  // the file ended inside this piece
    }
    crcs[i] = crc;
    got[i] = total;
  }
}

}  // namespace pyshmckpt
