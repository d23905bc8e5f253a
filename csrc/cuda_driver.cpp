#include "cuda_driver.h"

#include <dlfcn.h>
#include <link.h>

#include <cstdlib>
#include <mutex>

#include "errors.h"

namespace pyshmckpt {

namespace {

std::string describe_with(const CudaDriver& driver, const char* call, CUresult rc);

constexpr const char* kDefaultLibrary = "libcuda.so.1";
constexpr CUresult kCudaErrorNoDevice = 100;

template <typename Function>
void bind(void* library, const char* name, Function& function, std::vector<std::string>& missing) {
  function = reinterpret_cast<Function>(dlsym(library, name));
  if (function == nullptr) missing.emplace_back(name);
}

// The file the dynamic loader actually opened (a bare soname is resolved through its search path).
std::string opened_path(void* library, const std::string& requested) {
  link_map* map = nullptr;
  if (dlinfo(library, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr &&
      map->l_name[0] != '\0') {
    return map->l_name;
  }
  return requested;
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
}

std::string version_text(int version) {
  return std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10);
}

CudaDriver load() noexcept {
  CudaDriver d{};
  CudaDriverStatus& status = d.status;
  const char* configured = std::getenv("PYSHMCKPT_CUDA_DRIVER");
  const std::string requested =
      configured != nullptr && configured[0] != '\0' ? configured : kDefaultLibrary;
  dlerror();
  void* library = dlopen(requested.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = dlerror();
    status.reason = "no CUDA driver: " + requested + " could not be loaded (" +
                    (why != nullptr ? why : "unknown error") + ")";
    return d;
  }
  status.path = opened_path(library, requested);
  auto& missing = status.missing;
  bind(library, "cuInit", d.cuInit, missing);
  bind(library, "cuDriverGetVersion", d.cuDriverGetVersion, missing);
  bind(library, "cuDeviceGetCount", d.cuDeviceGetCount, missing);
  bind(library, "cuDeviceGet", d.cuDeviceGet, missing);
  bind(library, "cuDeviceGetName", d.cuDeviceGetName, missing);
  bind(library, "cuDevicePrimaryCtxRetain", d.cuDevicePrimaryCtxRetain, missing);
  bind(library, "cuCtxGetCurrent", d.cuCtxGetCurrent, missing);
  bind(library, "cuCtxSetCurrent", d.cuCtxSetCurrent, missing);
  bind(library, "cuMemHostRegister_v2", d.cuMemHostRegister, missing);
  bind(library, "cuMemHostUnregister", d.cuMemHostUnregister, missing);
  bind(library, "cuMemcpyDtoHAsync_v2", d.cuMemcpyDtoHAsync, missing);
  bind(library, "cuEventCreate", d.cuEventCreate, missing);
  bind(library, "cuEventRecord", d.cuEventRecord, missing);
  bind(library, "cuEventQuery", d.cuEventQuery, missing);
  bind(library, "cuEventDestroy_v2", d.cuEventDestroy, missing);
  bind(library, "cuPointerGetAttribute", d.cuPointerGetAttribute, missing);
  bind(library, "cuGetErrorName", d.cuGetErrorName, missing);
  bind(library, "cuGetErrorString", d.cuGetErrorString, missing);
  std::vector<std::string> optional;  // absent from older drivers: copies go one by one there
  bind(library, "cuMemcpyBatchAsync_v2", d.cuMemcpyBatchAsync_v2, optional);
  bind(library, "cuMemcpyBatchAsync", d.cuMemcpyBatchAsync, optional);
  status.batched_copies = d.cuMemcpyBatchAsync_v2 != nullptr ? "cuMemcpyBatchAsync_v2"
                          : d.cuMemcpyBatchAsync != nullptr  ? "cuMemcpyBatchAsync"
                                                             : "";
  if (d.cuDriverGetVersion != nullptr && d.cuDriverGetVersion(&status.version) != kCudaSuccess) {
    status.version = 0;
  }
  if (!missing.empty()) {
    status.reason = "the CUDA driver " + status.path +
                    (status.version ? " (version " + version_text(status.version) + ")" : "") +
                    " is too old for pyshmckpt: it lacks " + joined(missing);
    return d;
  }
  CUresult rc = d.cuInit(0);
  if (rc == kCudaErrorNoDevice) {
    status.reason = "no CUDA device: the driver " + status.path + " found none";
    return d;
  }
  if (rc != kCudaSuccess) {
    status.reason = "the CUDA driver " + status.path + " could not be initialized: " +
                    describe_with(d, "cuInit", rc);
    return d;
  }
  int count = 0;
  rc = d.cuDeviceGetCount(&count);
  if (rc != kCudaSuccess) {
    status.reason = describe_with(d, "cuDeviceGetCount", rc);
    return d;
  }
  for (int ordinal = 0; ordinal < count; ++ordinal) {
    char name[256] = {0};
    CUdevice device = 0;
    if (d.cuDeviceGet(&device, ordinal) != kCudaSuccess ||
        d.cuDeviceGetName(name, sizeof(name) - 1, device) != kCudaSuccess) {
      name[0] = '\0';
    }
    status.devices.emplace_back(name[0] != '\0' ? name : "device " + std::to_string(ordinal));
  }
  if (count == 0) {
    status.reason = "no CUDA device: the driver " + status.path + " found none";
    return d;
  }
  status.usable = true;
  return d;
}

// Errors after which the context is unusable: every later call fails the same way.
constexpr CUresult kStickyErrors[] = {
    700,  // CUDA_ERROR_ILLEGAL_ADDRESS
    702,  // CUDA_ERROR_LAUNCH_TIMEOUT
    714,  // CUDA_ERROR_HARDWARE_STACK_ERROR
    715,  // CUDA_ERROR_ILLEGAL_INSTRUCTION
    716,  // CUDA_ERROR_MISALIGNED_ADDRESS
    717,  // CUDA_ERROR_INVALID_ADDRESS_SPACE
    718,  // CUDA_ERROR_INVALID_PC
    719,  // CUDA_ERROR_LAUNCH_FAILED
};

bool sticky(CUresult rc) noexcept {
  for (CUresult code : kStickyErrors) {
    if (rc == code) return true;
  }
  return false;
}

std::string describe_with(const CudaDriver& driver, const char* call, CUresult rc) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (driver.cuGetErrorName == nullptr || driver.cuGetErrorName(rc, &name) != kCudaSuccess) {
    name = nullptr;
  }
  if (driver.cuGetErrorString == nullptr || driver.cuGetErrorString(rc, &text) != kCudaSuccess) {
    text = nullptr;
  }
  std::string out = std::string(call) + " failed: " +
                    (name != nullptr ? name : "CUDA error " + std::to_string(rc)) +
                    (text != nullptr ? std::string(": ") + text : "");
  if (sticky(rc)) {
    out += " (a sticky error: CUDA is unusable in this process until it restarts)";
  }
  return out;
}

}  // namespace

const CudaDriver& cuda_driver() noexcept {
  static const CudaDriver driver = load();
  return driver;
}

const CudaDriver& require_cuda_driver(const std::string& what) {
  const CudaDriver& driver = cuda_driver();
  if (!driver.status.usable) throw CudaError(what + ": " + driver.status.reason);
  return driver;
}

bool is_sticky_cuda_error(CUresult rc) noexcept { return sticky(rc); }

std::string describe_cuda_error(const char* call, CUresult rc) {
  return describe_with(cuda_driver(), call, rc);
}

CudaContextScope::CudaContextScope(int device) : driver_(require_cuda_driver("CUDA")) {
  const int count = static_cast<int>(driver_.status.devices.size());
  if (device < 0 || device >= count) {
    throw CudaError("CUDA device " + std::to_string(device) + " does not exist (" +
                    std::to_string(count) + " device(s))");
  }
  // Primary contexts are retained once per device for the life of the process, as torch's
  // runtime does: the same context torch's streams and memory belong to.
  static std::mutex lock;
  static std::vector<CUcontext> primaries;
  CUcontext context = nullptr;
  {
    std::lock_guard<std::mutex> guard(lock);
    if (primaries.empty()) primaries.assign(count, nullptr);
    if (primaries[device] == nullptr) {
      CUdevice handle = 0;
      CUresult rc = driver_.cuDeviceGet(&handle, device);
      if (rc != kCudaSuccess) throw CudaError(describe_cuda_error("cuDeviceGet", rc));
      rc = driver_.cuDevicePrimaryCtxRetain(&primaries[device], handle);
      if (rc != kCudaSuccess) {
        primaries[device] = nullptr;
        throw CudaError(describe_cuda_error("cuDevicePrimaryCtxRetain", rc));
      }
    }
    context = primaries[device];
  }
  CUresult rc = driver_.cuCtxGetCurrent(&previous_);
  if (rc != kCudaSuccess) throw CudaError(describe_cuda_error("cuCtxGetCurrent", rc));
  if (previous_ != context) {
    rc = driver_.cuCtxSetCurrent(context);
    if (rc != kCudaSuccess) throw CudaError(describe_cuda_error("cuCtxSetCurrent", rc));
    changed_ = true;
  }
}

CudaContextScope::~CudaContextScope() {
  if (changed_) driver_.cuCtxSetCurrent(previous_);
}

}  // namespace pyshmckpt
