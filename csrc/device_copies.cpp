#include "device_copies.h"

#include <atomic>
#include <mutex>

namespace pyshmckpt {

namespace {

constexpr CUresult kCudaErrorInvalidValue = 1;
constexpr CUresult kCudaErrorNotSupported = 801;

std::atomic<bool> batches_refused{false};
std::mutex refusal_mutex;
std::string refusal;  // why, once refused

bool has_batches(const CudaDriver& driver) {
  return driver.cuMemcpyBatchAsync_v2 != nullptr || driver.cuMemcpyBatchAsync != nullptr;
}

const char* batch_call(const CudaDriver& driver) {
  return driver.cuMemcpyBatchAsync_v2 != nullptr ? "cuMemcpyBatchAsync_v2" : "cuMemcpyBatchAsync";
}

CUresult queue_batch(const CudaDriver& driver, DeviceCopies& copies, CUstream stream) {
  // One set of attributes for every copy: the sources are read in stream order (after the work
  // that produced them), no location hints (they only concern managed memory).
  MemcpyAttributes attributes{};
  attributes.src_access_order = kMemcpySrcAccessOrderStream;
  std::size_t first = 0;
  if (driver.cuMemcpyBatchAsync_v2 != nullptr) {
    return driver.cuMemcpyBatchAsync_v2(copies.dsts.data(), copies.srcs.data(),
                                        copies.sizes.data(), copies.sizes.size(), &attributes,
                                        &first, 1, stream);
  }
  std::size_t failed = 0;
  return driver.cuMemcpyBatchAsync(copies.dsts.data(), copies.srcs.data(), copies.sizes.data(),
                                   copies.sizes.size(), &attributes, &first, 1, &failed, stream);
}

}  // namespace

QueuedCopies queue_device_copies(const CudaDriver& driver, DeviceCopies& copies, CUstream stream) {
  const std::size_t count = copies.sizes.size();
  if (count > 1 && stream != nullptr && has_batches(driver) && !batches_refused.load()) {
    const CUresult rc = queue_batch(driver, copies, stream);
    if (rc == kCudaSuccess) return {};
    if (rc != kCudaErrorInvalidValue && rc != kCudaErrorNotSupported) {
      return {rc, batch_call(driver), true};
    }
    {
      std::lock_guard<std::mutex> lock(refusal_mutex);
      refusal = describe_cuda_error(batch_call(driver), rc);
    }
    batches_refused.store(true);
    // Queued again one by one below: a copy the refused batch did queue lands twice, the same
    // bytes to the same place.
  }
  for (std::size_t i = 0; i < count; ++i) {
    const CUresult rc = driver.cuMemcpyDtoHAsync(reinterpret_cast<void*>(copies.dsts[i]),
                                                 copies.srcs[i], copies.sizes[i], stream);
    if (rc != kCudaSuccess) return {rc, "cuMemcpyDtoHAsync", i > 0};
  }
  return {};
}

std::string device_copy_method() {
  const CudaDriver& driver = cuda_driver();
  if (!driver.status.usable) return "none (" + driver.status.reason + ")";
  if (!has_batches(driver)) {
    return "one cuMemcpyDtoHAsync per copy (the driver has no cuMemcpyBatchAsync, which came "
           "with CUDA 12.8)";
  }
  if (batches_refused.load()) {
    std::lock_guard<std::mutex> lock(refusal_mutex);
    return "one cuMemcpyDtoHAsync per copy (the driver refused a batch: " + refusal + ")";
  }
  return std::string("batched: one ") + batch_call(driver) + " per device and stage";
}

}  // namespace pyshmckpt
