// Copying large buffers without reading the destination into the cache first.
#pragma once

#include <cstddef>

namespace pyshmckpt {

// Batches at least this large are copied with streaming stores: their data is larger than any
// cache, so a plain memcpy's stores only cost a read of each destination line.
inline constexpr std::size_t kStreamingBytes = std::size_t{16} << 20;

// Copies `n` bytes from `src` to `dst` (not overlapping). Where the CPU has streaming stores
// (x86-64), the whole 64-byte lines of the destination are written with them, bypassing the cache,
// the source is prefetched non-temporally, and a store fence orders the stores before this
// returns; elsewhere this is memcpy.
void stream_copy(void* dst, const void* src, std::size_t n);

}  // namespace pyshmckpt
