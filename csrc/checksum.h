// CRC32C (Castagnoli) of byte ranges, with the SSE4.2 / ARMv8 CRC instructions where present.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pyshmckpt {

// CRC32C of [data, data + nbytes), continuing from `crc` (0 to start). Matches the iSCSI/ext4
// definition: crc32c("123456789") == 0xE3069283.
std::uint32_t crc32c(const void* data, std::size_t nbytes, std::uint32_t crc = 0) noexcept;

// CRC32C of A followed by B, from crc_a = crc32c(A), crc_b = crc32c(B) and B's length (zlib's
// crc32_combine for the Castagnoli polynomial): lets threads checksum pieces of one range.
std::uint32_t crc32c_combine(std::uint32_t crc_a, std::uint32_t crc_b, std::uint64_t len_b) noexcept;

// True when crc32c uses a hardware instruction on this CPU.
bool crc32c_hardware() noexcept;

}  // namespace pyshmckpt
