// The CUDA driver API, resolved at run time.
//
// cotenant never links libcuda: every driver entry point it uses is looked up
// through the CUDA runtime (cudaGetDriverEntryPointByVersion), the runtime
// that torch itself loads. So the extension imports on a machine with no
// NVIDIA driver, and the first use says clearly that there is no GPU instead
// of failing at load time with a missing libcuda.so.1.
#pragma once

#include <cuda.h>

#include <string>

namespace cotenant::cuda {

// Function pointers to the driver entry points cotenant uses, all resolved
// for the CUDA 12.0 ABI (the VMM and host-memory calls have not changed since).
struct DriverApi {
  decltype(&::cuGetErrorString) cuGetErrorString = nullptr;
  decltype(&::cuGetErrorName) cuGetErrorName = nullptr;
  decltype(&::cuDeviceGet) cuDeviceGet = nullptr;
  decltype(&::cuDeviceGetAttribute) cuDeviceGetAttribute = nullptr;
  decltype(&::cuDevicePrimaryCtxRetain) cuDevicePrimaryCtxRetain = nullptr;
  decltype(&::cuDevicePrimaryCtxRelease) cuDevicePrimaryCtxRelease = nullptr;
  decltype(&::cuCtxGetCurrent) cuCtxGetCurrent = nullptr;
  decltype(&::cuCtxSetCurrent) cuCtxSetCurrent = nullptr;
  decltype(&::cuMemGetAllocationGranularity) cuMemGetAllocationGranularity = nullptr;
  decltype(&::cuMemAddressReserve) cuMemAddressReserve = nullptr;
  decltype(&::cuMemAddressFree) cuMemAddressFree = nullptr;
  decltype(&::cuMemCreate) cuMemCreate = nullptr;
  decltype(&::cuMemRelease) cuMemRelease = nullptr;
  decltype(&::cuMemMap) cuMemMap = nullptr;
  decltype(&::cuMemUnmap) cuMemUnmap = nullptr;
  decltype(&::cuMemSetAccess) cuMemSetAccess = nullptr;
  decltype(&::cuMemHostAlloc) cuMemHostAlloc = nullptr;
  decltype(&::cuMemHostGetDevicePointer) cuMemHostGetDevicePointer = nullptr;
  decltype(&::cuMemFreeHost) cuMemFreeHost = nullptr;
};

// The process's driver table. Throws cotenant::Error with a sentence saying
// that no usable GPU or driver was found (and the runtime's reason) when the
// runtime cannot reach a driver or sees no device.
const DriverApi& driver();

// Whether a CUDA device is usable, without throwing; `reason` receives the
// explanation when it is not.
bool gpu_available(std::string* reason);

// Throws cotenant::Error "<what> failed: <driver's message> (CUDA_ERROR_NAME, error N)"
// when `result` is not CUDA_SUCCESS.
void check_driver(CUresult result, const char* what);

}  // namespace cotenant::cuda
