#include "cuda_driver.h"

#include <cuda_runtime_api.h>

#include <mutex>
#include <string>

#include "cotenant/errors.h"

namespace cotenant::cuda {
namespace {

// The ABI version the entry points are requested for (CUDA 12.0).
constexpr unsigned int kDriverAbiVersion = 12000;

std::string no_gpu_message(const std::string& reason) {
  return "cotenant found no usable NVIDIA GPU: " + reason +
         ". cotenant manages CUDA memory and needs a CUDA device with a working driver; "
         "run on a GPU machine, or leave cotenant disabled (COTENANT_DISABLE=1) on this one.";
}

template <typename Fn>
void resolve(const char* symbol, Fn& slot) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  cudaError_t err =
      cudaGetDriverEntryPointByVersion(symbol, &fn, kDriverAbiVersion, cudaEnableDefault, &status);
  if (err != cudaSuccess || status != cudaDriverEntryPointSuccess || fn == nullptr) {
    throw Error(no_gpu_message(std::string("the CUDA driver does not provide ") + symbol + " (" +
                               cudaGetErrorString(err) + ")"));
  }
  slot = reinterpret_cast<Fn>(fn);
}

struct LoadedDriver {
  DriverApi api;
  std::string error;  // empty when api is complete
};

LoadedDriver load() {
  LoadedDriver loaded;
  int devices = 0;
  cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free runtime error so torch does not see it
    loaded.error = no_gpu_message(std::string("the CUDA runtime reports \"") +
                                  cudaGetErrorString(err) + "\"");
    return loaded;
  }
  if (devices == 0) {
    loaded.error = no_gpu_message("the CUDA runtime sees 0 devices");
    return loaded;
  }
  try {
    DriverApi& a = loaded.api;
    resolve("cuGetErrorString", a.cuGetErrorString);
    resolve("cuGetErrorName", a.cuGetErrorName);
    resolve("cuDeviceGet", a.cuDeviceGet);
    resolve("cuDeviceGetAttribute", a.cuDeviceGetAttribute);
    resolve("cuDevicePrimaryCtxRetain", a.cuDevicePrimaryCtxRetain);
    resolve("cuDevicePrimaryCtxRelease", a.cuDevicePrimaryCtxRelease);
    resolve("cuCtxGetCurrent", a.cuCtxGetCurrent);
    resolve("cuCtxSetCurrent", a.cuCtxSetCurrent);
    resolve("cuMemGetAllocationGranularity", a.cuMemGetAllocationGranularity);
    resolve("cuMemAddressReserve", a.cuMemAddressReserve);
    resolve("cuMemAddressFree", a.cuMemAddressFree);
    resolve("cuMemCreate", a.cuMemCreate);
    resolve("cuMemRelease", a.cuMemRelease);
    resolve("cuMemMap", a.cuMemMap);
    resolve("cuMemUnmap", a.cuMemUnmap);
    resolve("cuMemSetAccess", a.cuMemSetAccess);
    resolve("cuMemHostAlloc", a.cuMemHostAlloc);
    resolve("cuMemHostGetDevicePointer", a.cuMemHostGetDevicePointer);
    resolve("cuMemFreeHost", a.cuMemFreeHost);
  } catch (const Error& e) {
    loaded.error = e.what();
  }
  return loaded;
}

const LoadedDriver& loaded_driver() {
  static const LoadedDriver loaded = load();  // thread-safe, once per process
  return loaded;
}

}  // namespace

const DriverApi& driver() {
  const LoadedDriver& loaded = loaded_driver();
  if (!loaded.error.empty()) throw Error(loaded.error);
  return loaded.api;
}

bool gpu_available(std::string* reason) {
  const LoadedDriver& loaded = loaded_driver();
  if (loaded.error.empty()) return true;
  if (reason != nullptr) *reason = loaded.error;
  return false;
}

void check_driver(CUresult result, const char* what) {
  if (result == CUDA_SUCCESS) return;
  const char* message = nullptr;
  const char* name = nullptr;
  const DriverApi& api = loaded_driver().api;
  if (api.cuGetErrorString != nullptr) api.cuGetErrorString(result, &message);
  if (api.cuGetErrorName != nullptr) api.cuGetErrorName(result, &name);
  throw Error(std::string(what) + " failed: " + (message ? message : "unknown CUDA driver error") + " (" +
              (name ? name : "CUresult") + ", error " + std::to_string(static_cast<int>(result)) + ")");
}

}  // namespace cotenant::cuda
