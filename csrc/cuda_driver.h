// The CUDA driver API, loaded at run time: no CUDA toolkit, header or library is needed to build
// pyshmckpt, and importing it never needs one. The driver (libcuda.so.1, or the library named by
// PYSHMCKPT_CUDA_DRIVER) is opened on first use; its API is stable across driver versions and
// shares each device's primary context with the CUDA runtime torch uses.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace pyshmckpt {

// The few driver types and constants used here (the driver's own ABI; no toolkit headers).
using CUresult = int;
using CUdevice = int;
using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;
using CUdeviceptr = unsigned long long;

constexpr CUresult kCudaSuccess = 0;
constexpr CUresult kCudaErrorNotReady = 600;
constexpr unsigned kHostRegisterPortable = 0x01;
constexpr unsigned kEventDisableTiming = 0x02;
constexpr int kPointerAttributeMemoryType = 2;
constexpr unsigned kMemoryTypeHost = 1;
constexpr int kMemcpySrcAccessOrderStream = 1;  // CU_MEMCPY_SRC_ACCESS_ORDER_STREAM

// CUmemcpyAttributes (CUDA 12.8): how cuMemcpyBatchAsync treats the copies it applies to.
struct MemcpyAttributes {
  int src_access_order;   // CUmemcpySrcAccessOrder
  int src_location_type;  // CUmemLocation srcLocHint (managed memory only)
  int src_location_id;
  int dst_location_type;  // CUmemLocation dstLocHint
  int dst_location_id;
  unsigned flags;         // CUmemcpyFlags
};

// What was found when the driver was loaded, for `pyshmckpt cuda-info` and error messages.
struct CudaDriverStatus {
  bool usable = false;          // loaded, every function found, initialized, a device present
  std::string path;             // the library that was opened ("" when none could be)
  std::string reason;           // why it is not usable, in words ("" when it is)
  int version = 0;              // cuDriverGetVersion: 1000 * major + 10 * minor; 0 if unknown
  std::vector<std::string> devices;  // device names, by ordinal
  std::vector<std::string> missing;  // functions the library lacks (a driver too old)
  std::string batched_copies;        // the batched copy function found ("" when none)
};

// The loaded driver's functions. Every call site checks `usable()` (through `require`) first.
struct CudaDriver {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDriverGetVersion)(int*);
  CUresult (*cuDeviceGetCount)(int*);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetName)(char*, int, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuMemHostRegister)(void*, std::size_t, unsigned);
  CUresult (*cuMemHostUnregister)(void*);
  CUresult (*cuMemcpyDtoHAsync)(void*, CUdeviceptr, std::size_t, CUstream);
  CUresult (*cuEventCreate)(CUevent*, unsigned);
  CUresult (*cuEventRecord)(CUevent, CUstream);
  CUresult (*cuEventQuery)(CUevent);
  CUresult (*cuEventDestroy)(CUevent);
  CUresult (*cuPointerGetAttribute)(void*, int, CUdeviceptr);
  CUresult (*cuGetErrorName)(CUresult, const char**);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  // Optional, null where the driver lacks them (before 12.8): the batched copy, in CUDA 13's ABI
  // and in 12.8's (which also reports the index of a failed copy).
  CUresult (*cuMemcpyBatchAsync_v2)(CUdeviceptr*, CUdeviceptr*, std::size_t*, std::size_t,
                                    MemcpyAttributes*, std::size_t*, std::size_t, CUstream);
  CUresult (*cuMemcpyBatchAsync)(CUdeviceptr*, CUdeviceptr*, std::size_t*, std::size_t,
                                 MemcpyAttributes*, std::size_t*, std::size_t, std::size_t*,
                                 CUstream);

  CudaDriverStatus status;
};

// The driver, loaded on the first call (thread-safe; never throws). Check status.usable.
const CudaDriver& cuda_driver() noexcept;

// The driver when usable; otherwise throws CudaError saying why (no driver, a driver too old for
// a call, no device), prefixed with `what` (the operation that needed it).
const CudaDriver& require_cuda_driver(const std::string& what);

// "<call> failed: CUDA_ERROR_X: <description>", and for errors that leave the context unusable
// (an illegal address, a failed launch), that the process must be restarted.
std::string describe_cuda_error(const char* call, CUresult rc);

// True for errors after which every later call in this process fails the same way.
bool is_sticky_cuda_error(CUresult rc) noexcept;

// Makes the primary context of `device` current on this thread for its lifetime, and restores
// the previous one after. Throws CudaError.
class CudaContextScope {
 public:
  explicit CudaContextScope(int device);
  ~CudaContextScope();
  CudaContextScope(const CudaContextScope&) = delete;
  CudaContextScope& operator=(const CudaContextScope&) = delete;

 private:
  const CudaDriver& driver_;
  CUcontext previous_ = nullptr;
  bool changed_ = false;
};

}  // namespace pyshmckpt
