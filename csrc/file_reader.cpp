#include "file_reader.h"

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

struct Piece {
  std::size_t entry;
  std::uint64_t begin;  // within the entry
  std::uint64_t nbytes;
};

}  // namespace

void read_file_ranges(int fd, const ReadEntry* entries, std::size_t count, bool checksums,
                      const std::string& path, std::uint32_t* crcs, std::uint64_t* got) {
  std::vector<Piece> pieces;
  std::vector<std::size_t> first(count + 1);
  for (std::size_t i = 0; i < count; ++i) {
    first[i] = pieces.size();
    const std::uint64_t n = entries[i].nbytes;
    for (std::uint64_t b = 0; b < n; b += kPiece) pieces.push_back({i, b, std::min(kPiece, n - b)});
    crcs[i] = 0;
    got[i] = 0;
  }
  first[count] = pieces.size();
  std::vector<std::uint32_t> piece_crc(pieces.size(), 0);
  std::vector<std::uint64_t> piece_got(pieces.size(), 0);
  ThreadPool::instance().parallel_for(pieces.size(), [&](std::size_t k) {
    const Piece& p = pieces[k];
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
