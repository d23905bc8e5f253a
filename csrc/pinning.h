// Page-locking host memory for CUDA (cuMemHostRegister, through the driver loaded at run time).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pyshmckpt {

// Number of CUDA devices the driver sees; 0 without a usable driver or device. Never throws.
int cuda_device_count() noexcept;

// Registers [ptr, ptr + nbytes) with cuMemHostRegister in chunks of `chunk_bytes` (the driver
// limits how much one call may register). On failure, unregisters what was registered, writes the
// reason to *error and returns false; without a usable driver, returns false with its reason.
bool register_host_memory(std::uint8_t* ptr, std::size_t nbytes, std::size_t chunk_bytes,
                          std::string* error) noexcept;
// Undoes register_host_memory with the same arguments. Errors are not reported.
void unregister_host_memory(std::uint8_t* ptr, std::size_t nbytes, std::size_t chunk_bytes) noexcept;
// True when the driver reports `ptr` as registered or allocated host memory.
bool is_pinned_pointer(const void* ptr) noexcept;

}  // namespace pyshmckpt
