#include "pinning.h"

#include <algorithm>

#ifdef PYSHMCKPT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace pyshmckpt {

#ifdef PYSHMCKPT_WITH_CUDA

bool cuda_compiled() noexcept { return true; }

int cuda_device_count() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

bool register_host_memory(std::uint8_t* ptr, std::size_t nbytes, std::size_t chunk_bytes,
                          std::string* error) noexcept {
  if (cuda_device_count() == 0) {
    *error = "no CUDA device is available";
    return false;
  }
  for (std::size_t off = 0; off < nbytes; off += chunk_bytes) {
    std::size_t len = std::min(chunk_bytes, nbytes - off);
    cudaError_t rc = cudaHostRegister(ptr + off, len, cudaHostRegisterPortable);
    if (rc != cudaSuccess) {
      cudaGetLastError();
      *error = std::string("cudaHostRegister of ") + std::to_string(len) + " bytes at offset " +
               std::to_string(off) + " failed: " + cudaGetErrorName(rc) + ": " +
               cudaGetErrorString(rc);
      unregister_host_memory(ptr, off, chunk_bytes);
      return false;
    }
  }
  return true;
}

void unregister_host_memory(std::uint8_t* ptr, std::size_t nbytes, std::size_t chunk_bytes) noexcept {
  for (std::size_t off = 0; off < nbytes; off += chunk_bytes) {
    cudaHostUnregister(ptr + off);
  }
  cudaGetLastError();
}

bool is_pinned_pointer(const void* ptr) noexcept {
  if (cuda_device_count() == 0) return false;
  cudaPointerAttributes attrs{};
  if (cudaPointerGetAttributes(&attrs, ptr) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attrs.type == cudaMemoryTypeHost;
}

#else

bool cuda_compiled() noexcept { return false; }
int cuda_device_count() noexcept { return 0; }

bool register_host_memory(std::uint8_t*, std::size_t, std::size_t, std::string* error) noexcept {
  *error = "pyshmckpt was built without CUDA";
  return false;
}

void unregister_host_memory(std::uint8_t*, std::size_t, std::size_t) noexcept {}
bool is_pinned_pointer(const void*) noexcept { return false; }

#endif

}  // namespace pyshmckpt
