// Page-locking host memory for CUDA (cudaHostRegister), and what the CUDA runtime can see.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pyshmckpt {

// True when this module was compiled with the CUDA path.
bool cuda_compiled() noexcept;
// Number of CUDA devices the runtime sees; 0 without CUDA, driver or device. Never throws, and
// clears any error it provokes so that it cannot stick to the caller's later CUDA calls.
int cuda_device_count() noexcept;

// Registers [ptr, ptr + nbytes) with cudaHostRegister in chunks of `chunk_bytes` (the driver limits
// how much one call may register). On failure, unregisters what was registered, clears the error,
// writes the reason to *error and returns false. Returns false with a reason without CUDA.
bool register_host_memory(std::uint8_t* ptr, std::size_t nbytes, std::size_t chunk_bytes,
                          std::string* error) noexcept;
// Undoes register_host_memory with the same arguments. Errors are cleared, not reported.
void unregister_host_memory(std::uint8_t* ptr, std::size_t nbytes, std::size_t chunk_bytes) noexcept;
// True when the CUDA runtime reports `ptr` as registered or allocated host memory.
bool is_pinned_pointer(const void* ptr) noexcept;

}  // namespace pyshmckpt
