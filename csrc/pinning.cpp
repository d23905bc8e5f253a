#include "pinning.h"

#include <algorithm>
#include <memory>

#include "cuda_driver.h"
#include "errors.h"

namespace pyshmckpt {

namespace {

// Registration needs a current context: the caller's when it has one (torch made it current),
// else the primary context of device 0. Registered memory is portable to every context.
class RegistrationContext {
 public:
  explicit RegistrationContext(const CudaDriver& driver) {
    CUcontext current = nullptr;
    if (driver.cuCtxGetCurrent(&current) != kCudaSuccess || current == nullptr) {
      scope_ = std::make_unique<CudaContextScope>(0);
    }
  }

 private:
  std::unique_ptr<CudaContextScope> scope_;
};

}  // namespace

int cuda_device_count() noexcept {
  const CudaDriver& driver = cuda_driver();
  return driver.status.usable ? static_cast<int>(driver.status.devices.size()) : 0;
}

bool register_host_memory(std::uint8_t* ptr, std::size_t nbytes, std::size_t chunk_bytes,
                          std::string* error) noexcept {
  const CudaDriver& driver = cuda_driver();
  if (!driver.status.usable) {
    *error = driver.status.reason;
    return false;
  }
  try {
    RegistrationContext context(driver);
    for (std::size_t off = 0; off < nbytes; off += chunk_bytes) {
      std::size_t len = std::min(chunk_bytes, nbytes - off);
      CUresult rc = driver.cuMemHostRegister(ptr + off, len, kHostRegisterPortable);
      if (rc != kCudaSuccess) {
        *error = "registering " + std::to_string(len) + " bytes at offset " +
                 std::to_string(off) + ": " + describe_cuda_error("cuMemHostRegister", rc);
        unregister_host_memory(ptr, off, chunk_bytes);
        return false;
      }
    }
  } catch (const CudaError& e) {
    *error = e.what();
    return false;
  }
  return true;
}

void unregister_host_memory(std::uint8_t* ptr, std::size_t nbytes, std::size_t chunk_bytes) noexcept {
  const CudaDriver& driver = cuda_driver();
  if (!driver.status.usable) return;
  try {
    RegistrationContext context(driver);
    for (std::size_t off = 0; off < nbytes; off += chunk_bytes) {
      driver.cuMemHostUnregister(ptr + off);
    }
  } catch (const CudaError&) {
    // No context to unregister in: the registrations die with the process.
  }
}

bool is_pinned_pointer(const void* ptr) noexcept {
  const CudaDriver& driver = cuda_driver();
  if (!driver.status.usable) return false;
  unsigned type = 0;
  try {
    RegistrationContext context(driver);
    if (driver.cuPointerGetAttribute(&type, kPointerAttributeMemoryType,
                                     reinterpret_cast<CUdeviceptr>(ptr)) != kCudaSuccess) {
      return false;
    }
  } catch (const CudaError&) {
    return false;
  }
  return type == kMemoryTypeHost;
}

}  // namespace pyshmckpt
