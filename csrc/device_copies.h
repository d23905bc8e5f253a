// Queuing device-to-host copies on a stream: one batched driver call (cuMemcpyBatchAsync, drivers
// of CUDA 12.8 and newer) where the driver has it and takes the batch, else one cuMemcpyDtoHAsync
// per copy. Many small tensors then cost one call, not one per tensor.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "cuda_driver.h"

namespace pyshmckpt {

// The copies of one stage on one device: host destinations, device sources, sizes.
struct DeviceCopies {
  std::vector<CUdeviceptr> dsts;
  std::vector<CUdeviceptr> srcs;
  std::vector<std::size_t> sizes;

  void add(CUdeviceptr dst, CUdeviceptr src, std::size_t bytes) {
    dsts.push_back(dst);
    srcs.push_back(src);
    sizes.push_back(bytes);
  }
};

// How queuing ended: rc is kCudaSuccess, or the failing call's code and name; some_queued says
// whether copies may have been queued before it failed (they may still land).
struct QueuedCopies {
  CUresult rc = kCudaSuccess;
  const char* call = nullptr;
  bool some_queued = false;
};

// Queues every copy on `stream`, in the context current on this thread. A driver that refuses
// batches (CUDA_ERROR_INVALID_VALUE or _NOT_SUPPORTED: a platform it does not batch on) gets one
// call per copy from then on, in this process; the legacy default stream (null), which batches
// never take, always does.
QueuedCopies queue_device_copies(const CudaDriver& driver, DeviceCopies& copies, CUstream stream);

// How device-to-host copies are queued in this process, in words (`pyshmckpt cuda-info`).
std::string device_copy_method();

}  // namespace pyshmckpt
