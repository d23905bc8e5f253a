// Reading byte ranges of a file straight into memory in parallel, with each range's CRC32C
// computed from the bytes just read (while they are still in cache).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pyshmckpt {

// One range: `nbytes` bytes at `file_offset` of the file go to `address`.
struct ReadEntry {
  std::uint64_t file_offset;
  std::uint64_t address;
  std::uint64_t nbytes;
};

// Reads every entry with pread on the thread pool (large entries split across threads). When
// `checksums` is set, crcs[i] is the CRC32C of entry i's bytes as they landed (else 0). got[i] is
// the number of bytes read for entry i: less than nbytes when the file ends first. A failed pread
// throws SyscallError naming `path`.
// SAFETY: every [address, address + nbytes) must be writable memory that stays alive, and is not
// read or written by anyone else, until this returns; ranges must not overlap.
void read_file_ranges(int fd, const ReadEntry* entries, std::size_t count, bool checksums,
                      const std::string& path, std::uint32_t* crcs, std::uint64_t* got);

}  // namespace pyshmckpt
