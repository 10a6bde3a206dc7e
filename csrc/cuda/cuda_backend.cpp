#include "cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>

#include "cotenant/errors.h"
#include "cotenant/host_memory.h"
#include "cuda_driver.h"

namespace cotenant::cuda {
namespace {

// Throws "<what> failed: <message> (cudaErrorName, error N)". The runtime's
// last-error state is cleared first, so torch's next check does not report
// this error a second time against an unrelated call.
void check_runtime(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  (void)cudaGetLastError();
  throw Error(std::string(what) + " failed: " + cudaGetErrorString(err) + " (" + cudaGetErrorName(err) +
              ", error " + std::to_string(static_cast<int>(err)) + ")");
}

// Makes `context` (a device's primary context) current to the calling thread
// for the scope and gives the thread back the context it had, none included.
// Runtime calls act on the current context, and cuMemHostAlloc,
// cuMemHostGetDevicePointer and cuMemFreeHost fail without one
// (CUDA_ERROR_INVALID_CONTEXT): a thread that never made a runtime call has
// none, whatever cudaGetDevice says. The context is switched, not the
// runtime's device: cudaSetDevice initializes the primary context of the
// device it names, so giving a fresh thread back its "device 0" that way
// would put a context, and its device memory, on a GPU the job does not use.
// One cuCtxGetCurrent when the context is current already (the usual case).
class CurrentContext {
 public:
  explicit CurrentContext(void* context) : context_(static_cast<CUcontext>(context)) {
    check_driver(driver().cuCtxGetCurrent(&previous_), "cuCtxGetCurrent");
    if (previous_ != context_) {
      check_driver(driver().cuCtxSetCurrent(context_), "cuCtxSetCurrent");
      switched_ = true;
    }
  }
  ~CurrentContext() {
    if (switched_) driver().cuCtxSetCurrent(previous_);
  }
  CurrentContext(const CurrentContext&) = delete;
  CurrentContext& operator=(const CurrentContext&) = delete;

 private:
  CUcontext context_ = nullptr;
  CUcontext previous_ = nullptr;
  bool switched_ = false;
};

CUmemAllocationProp page_properties(CUmemLocationType type, int id) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = type;
  prop.location.id = id;
  return prop;
}

int device_attribute(CUdevice dev, CUdevice_attribute attribute) {
  int value = 0;
  // An attribute this driver does not know reads as "unsupported".
  if (driver().cuDeviceGetAttribute(&value, attribute, dev) != CUDA_SUCCESS) return 0;
  return value;
}

}  // namespace

CudaBackend::CudaBackend(int device) : device_(device) {
  const DriverApi& api = driver();  // throws the no-GPU message
  int count = 0;
  check_runtime(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  if (device < 0 || device >= count) {
    throw Error("cotenant was asked for cuda:" + std::to_string(device) + " but this process sees " +
                std::to_string(count) + " CUDA device(s); pass a device index below " +
                std::to_string(count) + " (CUDA_VISIBLE_DEVICES renumbers devices from 0).");
  }
  CUdevice dev = 0;
  check_driver(api.cuDeviceGet(&dev, device_), "cuDeviceGet");
  // The primary context torch uses, kept for the backend's life.
  CUcontext context = nullptr;
  check_driver(api.cuDevicePrimaryCtxRetain(&context, dev), "cuDevicePrimaryCtxRetain");
  context_ = context;
  try {
    set_up(dev);
  } catch (...) {
    api.cuDevicePrimaryCtxRelease(dev);
    throw;
  }
}

void CudaBackend::set_up(int dev) {
  const DriverApi& api = driver();
  CurrentContext current(context_);
  check_runtime(cudaFree(nullptr), "initializing the CUDA runtime on the device's context");
  if (!device_attribute(dev, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)) {
    throw Error("cuda:" + std::to_string(device_) +
                " does not support CUDA virtual memory management (cuMemCreate/cuMemMap), which "
                "cotenant's allocator is built on; run without cotenant on this device.");
  }
  int numa_id = device_attribute(dev, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID);
  if (device_attribute(dev, CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) &&
      numa_id >= 0) {
    host_location_ = HostLocation::kHostNuma;
    host_numa_id_ = numa_id;
  } else if (device_attribute(dev, CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)) {
    host_location_ = HostLocation::kHost;
  }
  // COTENANT_HOST_PAGES=pinned: use the pinned fallback even where host VMM
  // exists (to run, on any GPU, the path that older drivers take).
  if (const char* host_pages = std::getenv("COTENANT_HOST_PAGES");
      host_pages != nullptr && std::string(host_pages) == "pinned") {
    host_location_ = HostLocation::kNone;
  }

  // One page size for both residencies: the larger of the two minimum
  // granularities (both are powers of two, so it is a multiple of the other).
  CUmemAllocationProp device_prop = page_properties(CU_MEM_LOCATION_TYPE_DEVICE, device_);
  std::size_t gran = 0;
  check_driver(api.cuMemGetAllocationGranularity(&gran, &device_prop,
                                                 CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
               "cuMemGetAllocationGranularity (device)");
  if (host_location_ != HostLocation::kNone) {
    CUmemAllocationProp host_prop = page_properties(
        host_location_ == HostLocation::kHostNuma ? CU_MEM_LOCATION_TYPE_HOST_NUMA
                                                  : CU_MEM_LOCATION_TYPE_HOST,
        host_location_ == HostLocation::kHostNuma ? host_numa_id_ : 0);
    std::size_t host_gran = 0;
    if (api.cuMemGetAllocationGranularity(&host_gran, &host_prop,
                                          CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) == CUDA_SUCCESS) {
      if (host_gran > gran) gran = host_gran;
    } else {
      host_location_ = HostLocation::kNone;  // the attribute lied: use the pinned fallback
    }
  }
  granularity_ = gran;

  cudaStream_t stream = nullptr;
  check_runtime(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  copy_stream_ = stream;
}

CudaBackend::~CudaBackend() {
  // Best effort: at process exit the driver may already be shutting down.
  // The device's context is made current without CurrentContext, which throws.
  CUcontext previous = nullptr;
  const auto context = static_cast<CUcontext>(context_);
  const bool switched = driver().cuCtxGetCurrent(&previous) == CUDA_SUCCESS && previous != context &&
                        driver().cuCtxSetCurrent(context) == CUDA_SUCCESS;
  give_back_everything();
  if (switched) driver().cuCtxSetCurrent(previous);
  CUdevice dev = 0;
  if (driver().cuDeviceGet(&dev, device_) == CUDA_SUCCESS) driver().cuDevicePrimaryCtxRelease(dev);
}

void CudaBackend::give_back_everything() {
  if (copy_stream_ != nullptr) {
    cudaStreamSynchronize(static_cast<cudaStream_t>(copy_stream_));  // copies still reading shadows
    cudaStreamDestroy(static_cast<cudaStream_t>(copy_stream_));
  }
  for (void* event : spare_marks_) cudaEventDestroy(static_cast<cudaEvent_t>(event));
  for (void* event : recorded_marks_) cudaEventDestroy(static_cast<cudaEvent_t>(event));
  for (PageHandle page : releases_after_copies_) {
    try {
      release_host_page(page);
    } catch (const Error&) {
    }
  }
  // Host pages still alive (a release the driver refused) lose their copy
  // mappings here, so that the ranges can go back.
  for (auto& [id, address] : shadows_) driver().cuMemUnmap(static_cast<CUdeviceptr>(address), granularity_);
  for (DevicePtr address : refused_shadows_) driver().cuMemUnmap(static_cast<CUdeviceptr>(address), granularity_);
  for (DevicePtr range : shadow_ranges_) driver().cuMemAddressFree(range, kShadowRangePages * granularity_);
  std::lock_guard<std::mutex> lock(pinned_mutex_);
  for (auto& [address, host] : pinned_host_) driver().cuMemFreeHost(host);
}

const char* CudaBackend::host_page_kind() const {
  switch (host_location_) {
    case HostLocation::kHostNuma: return "host-numa";
    case HostLocation::kHost: return "host";
    case HostLocation::kNone: break;
  }
  return "pinned-fallback";
}

std::size_t CudaBackend::device_total_bytes() const {
  CurrentContext current(context_);
  std::size_t free = 0, total = 0;
  check_runtime(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return total;
}

std::size_t CudaBackend::device_free_bytes() const {
  CurrentContext current(context_);
  std::size_t free = 0, total = 0;
  check_runtime(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return free;
}

std::optional<std::size_t> CudaBackend::host_available_bytes() const { return read_host_available(); }

DevicePtr CudaBackend::reserve(std::size_t bytes) {
  CUdeviceptr base = 0;
  // Alignment = granularity; no fixed address.
  CUresult r = driver().cuMemAddressReserve(&base, bytes, granularity_, 0, 0);
  if (r == CUDA_ERROR_OUT_OF_MEMORY) return 0;
  check_driver(r, "cuMemAddressReserve");
  return static_cast<DevicePtr>(base);
}

void CudaBackend::release(DevicePtr base, std::size_t bytes) {
  check_driver(driver().cuMemAddressFree(static_cast<CUdeviceptr>(base), bytes), "cuMemAddressFree");
}

// ---- driver call times ------------------------------------------------------------------

class CudaBackend::Timed {
 public:
  Timed(CudaBackend& backend, DriverCall call)
      : times_(backend.times_[static_cast<std::size_t>(call)]), start_(std::chrono::steady_clock::now()) {}
  ~Timed() {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_);
    times_.calls.fetch_add(1, std::memory_order_relaxed);
    times_.ns.fetch_add(static_cast<std::uint64_t>(ns.count()), std::memory_order_relaxed);
  }
  Timed(const Timed&) = delete;
  Timed& operator=(const Timed&) = delete;

 private:
  CallTimes& times_;
  std::chrono::steady_clock::time_point start_;
};

const char* CudaBackend::driver_call_name(DriverCall call) {
  switch (call) {
    case DriverCall::kCreateDevicePage: return "create_device_page";
    case DriverCall::kCreateHostPage: return "create_host_page";
    case DriverCall::kReleaseDevicePage: return "release_device_page";
    case DriverCall::kReleaseHostPage: return "release_host_page";
    case DriverCall::kMap: return "map";
    case DriverCall::kSetAccess: return "set_access";
    case DriverCall::kUnmap: return "unmap";
    case DriverCall::kCopyIssue: return "copy_issue";
    case DriverCall::kCopyWait: return "copy_wait";
    case DriverCall::kDeviceSynchronize: return "device_synchronize";
    case DriverCall::kZero: return "zero";
    case DriverCall::kCount: break;
  }
  return "unknown";
}

CudaBackend::DriverCallTime CudaBackend::driver_call_time(DriverCall call) const {
  const CallTimes& times = times_.at(static_cast<std::size_t>(call));
  return {times.calls.load(std::memory_order_relaxed), times.ns.load(std::memory_order_relaxed)};
}

void CudaBackend::reset_driver_call_times() {
  for (CallTimes& times : times_) {
    times.calls.store(0, std::memory_order_relaxed);
    times.ns.store(0, std::memory_order_relaxed);
  }
}

// ---- pages ------------------------------------------------------------------------------

namespace {

CUmemAccessDesc read_write_for(int device) {
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return access;
}

}  // namespace

PageHandle CudaBackend::create_page(Residency where) {
  CUmemAllocationProp prop{};
  if (where == Residency::kDevice) {
    prop = page_properties(CU_MEM_LOCATION_TYPE_DEVICE, device_);
  } else if (host_location_ == HostLocation::kHostNuma) {
    prop = page_properties(CU_MEM_LOCATION_TYPE_HOST_NUMA, host_numa_id_);
  } else if (host_location_ == HostLocation::kHost) {
    prop = page_properties(CU_MEM_LOCATION_TYPE_HOST, 0);
  } else {
    return {};  // no host VMM: the caller uses allocate_pinned_host
  }
  CUmemGenericAllocationHandle handle = 0;
  CUresult r;
  {
    Timed timed(*this, where == Residency::kDevice ? DriverCall::kCreateDevicePage : DriverCall::kCreateHostPage);
    r = driver().cuMemCreate(&handle, granularity_, &prop, 0);
  }
  if (r == CUDA_ERROR_OUT_OF_MEMORY) return {};
  check_driver(r, where == Residency::kDevice ? "cuMemCreate (device page)" : "cuMemCreate (host page)");
  PageHandle page;
  page.id = static_cast<std::uint64_t>(handle);
  page.where = where;
  if (where == Residency::kHost) {
    try {
      map_shadow(page);
    } catch (...) {
      driver().cuMemRelease(handle);
      throw;
    }
  }
  return page;
}

void CudaBackend::release_page(PageHandle page) {
  if (page.where == Residency::kHost) {
    {
      // A copy in flight may still read its shadow: released once copies finish.
      std::lock_guard<std::mutex> lock(copy_mutex_);
      if (copies_pending_) {
        releases_after_copies_.push_back(page);
        return;
      }
    }
    release_host_page(page);
    return;
  }
  Timed timed(*this, DriverCall::kReleaseDevicePage);
  check_driver(driver().cuMemRelease(static_cast<CUmemGenericAllocationHandle>(page.id)), "cuMemRelease");
}

// ---- host pages' shadow addresses ----------------------------------------------------------

DevicePtr CudaBackend::shadow_of(PageHandle page) {
  {
    std::lock_guard<std::mutex> lock(shadow_mutex_);
    auto it = shadows_.find(page.id);
    if (page.where == Residency::kHost && it != shadows_.end()) return it->second;
  }
  throw Error("a page copy goes between a live page and a host page of this backend's; got " +
              std::string(page.where == Residency::kHost ? "a host page it did not create" : "a device page") +
              " (page moves go between device and host).");
}

void CudaBackend::map_shadow(PageHandle page) {
  DevicePtr address = 0;
  {
    std::lock_guard<std::mutex> lock(shadow_mutex_);
    if (free_shadows_.empty()) {
      const DevicePtr range = reserve(kShadowRangePages * granularity_);
      if (range == 0) throw Error("cotenant could not reserve address space for host pages' copies.");
      shadow_ranges_.push_back(range);
      for (std::size_t i = kShadowRangePages; i-- > 0;) free_shadows_.push_back(range + i * granularity_);
    }
    address = free_shadows_.back();
    free_shadows_.pop_back();
  }
  const CUmemAccessDesc access = read_write_for(device_);
  CUresult r;
  {
    Timed timed(*this, DriverCall::kMap);
    r = driver().cuMemMap(static_cast<CUdeviceptr>(address), granularity_, 0,
                          static_cast<CUmemGenericAllocationHandle>(page.id), 0);
  }
  if (r == CUDA_SUCCESS) {
    Timed timed(*this, DriverCall::kSetAccess);
    r = driver().cuMemSetAccess(static_cast<CUdeviceptr>(address), granularity_, &access, 1);
    if (r != CUDA_SUCCESS) driver().cuMemUnmap(static_cast<CUdeviceptr>(address), granularity_);
  }
  std::lock_guard<std::mutex> lock(shadow_mutex_);
  if (r != CUDA_SUCCESS) {
    free_shadows_.push_back(address);
    check_driver(r, "mapping a host page for copies (cuMemMap, cuMemSetAccess)");
  }
  shadows_.emplace(page.id, address);
}

void CudaBackend::release_host_page(PageHandle page) {
  DevicePtr address = 0;
  {
    std::lock_guard<std::mutex> lock(shadow_mutex_);
    if (auto it = shadows_.find(page.id); it != shadows_.end()) address = it->second;
  }
  if (address != 0) {
    CUresult unmapped;
    {
      Timed timed(*this, DriverCall::kUnmap);
      unmapped = driver().cuMemUnmap(static_cast<CUdeviceptr>(address), granularity_);
    }
    std::lock_guard<std::mutex> lock(shadow_mutex_);
    shadows_.erase(page.id);
    if (unmapped == CUDA_SUCCESS) {
      free_shadows_.push_back(address);
    } else {
      // The page stays mapped there until the backend's end tries again; its
      // handle goes now (the caller has given the page up), so the memory
      // goes with that last mapping instead of staying with the process.
      refused_shadows_.push_back(address);
      driver().cuMemRelease(static_cast<CUmemGenericAllocationHandle>(page.id));
      check_driver(unmapped, "cuMemUnmap (a host page's copy address)");
    }
  }
  Timed timed(*this, DriverCall::kReleaseHostPage);
  check_driver(driver().cuMemRelease(static_cast<CUmemGenericAllocationHandle>(page.id)), "cuMemRelease");
}

// access_mutex_ held.
void CudaBackend::set_device_access(DevicePtr address, std::size_t bytes) {
  std::vector<CUmemAccessDesc> access{read_write_for(device_)};
  for (int peer : peers_) access.push_back(read_write_for(peer));
  Timed timed(*this, DriverCall::kSetAccess);
  check_driver(driver().cuMemSetAccess(static_cast<CUdeviceptr>(address), bytes, access.data(), access.size()),
               "cuMemSetAccess");
}

void CudaBackend::grant_access(int peer) {
  std::lock_guard<std::mutex> lock(access_mutex_);
  if (peer == device_ || std::find(peers_.begin(), peers_.end(), peer) != peers_.end()) return;
  const CUmemAccessDesc access = read_write_for(peer);
  for (DevicePtr address : mapped_) {
    check_driver(driver().cuMemSetAccess(static_cast<CUdeviceptr>(address), granularity_, &access, 1),
                 "cuMemSetAccess for a peer device");
  }
  peers_.push_back(peer);
}

void CudaBackend::map(DevicePtr address, PageHandle page) { map_pages(address, &page, 1); }

void CudaBackend::map_pages(DevicePtr address, const PageHandle* pages, std::size_t count) {
  std::lock_guard<std::mutex> lock(access_mutex_);
  std::size_t mapped = 0;
  auto unmap_mapped = [&] {  // not left half-mapped
    for (std::size_t i = 0; i < mapped; ++i) {
      driver().cuMemUnmap(static_cast<CUdeviceptr>(address + i * granularity_), granularity_);
    }
  };
  for (; mapped < count; ++mapped) {
    CUresult r;
    {
      Timed timed(*this, DriverCall::kMap);
      r = driver().cuMemMap(static_cast<CUdeviceptr>(address + mapped * granularity_), granularity_, 0,
                            static_cast<CUmemGenericAllocationHandle>(pages[mapped].id), 0);
    }
    if (r != CUDA_SUCCESS) {
      unmap_mapped();
      check_driver(r, "cuMemMap");
    }
  }
  try {
    set_device_access(address, count * granularity_);  // one call for the run of mappings
  } catch (...) {
    unmap_mapped();
    throw;
  }
  for (std::size_t i = 0; i < count; ++i) mapped_.insert(address + i * granularity_);
}

void CudaBackend::wait_for_launched_work(const char* why) {
  if (quiescent_here()) return;  // this thread's safe point synchronized already
  CurrentContext current(context_);
  Timed timed(*this, DriverCall::kDeviceSynchronize);
  check_runtime(cudaDeviceSynchronize(), why);
}

void CudaBackend::unmap(DevicePtr address) {
  if (!graph_capture_.load(std::memory_order_acquire)) {
    wait_for_launched_work("cudaDeviceSynchronize before unmapping a page");
  }
  unmap_now(address);
}

bool CudaBackend::synchronize_for_unmap() {
  if (graph_capture_.load(std::memory_order_acquire)) return false;  // keep the cache until the capture ends
  wait_for_launched_work("cudaDeviceSynchronize before unmapping cached pages");
  return true;
}

void CudaBackend::unmap_synchronized(DevicePtr address) { unmap_now(address); }

void CudaBackend::unmap_now(DevicePtr address) {
  // Under access_mutex_, so grant_access never sets access on a page between
  // its unmap and its leaving mapped_; a refused unmap leaves the page mapped,
  // and in mapped_, for a peer granted access later.
  std::lock_guard<std::mutex> lock(access_mutex_);
  CUresult r;
  {
    Timed timed(*this, DriverCall::kUnmap);
    r = driver().cuMemUnmap(static_cast<CUdeviceptr>(address), granularity_);
  }
  check_driver(r, "cuMemUnmap");
  mapped_.erase(address);
}

void CudaBackend::copy_into(DevicePtr address, PageHandle src) {
  const DevicePtr shadow = shadow_of(src);
  std::lock_guard<std::mutex> lock(copy_mutex_);
  copy_page(address, shadow);
}

void CudaBackend::copy_out(DevicePtr address, PageHandle dst) {
  const DevicePtr shadow = shadow_of(dst);
  std::lock_guard<std::mutex> lock(copy_mutex_);
  copy_page(shadow, address);
}

void CudaBackend::copy_page(DevicePtr dst, DevicePtr src) {
  CurrentContext current(context_);
  auto stream = static_cast<cudaStream_t>(copy_stream_);
  cudaError_t err;
  {
    Timed timed(*this, DriverCall::kCopyIssue);
    err = cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<void*>(src), granularity_,
                          cudaMemcpyDefault, stream);
  }
  check_runtime(err, "copying a page between device and host (cudaMemcpyAsync)");
  if (quiescent_here()) {
    copies_pending_ = true;  // finish_copies() waits for it with the rest of the batch
    return;
  }
  cudaError_t waited;
  {
    Timed timed(*this, DriverCall::kCopyWait);
    waited = cudaStreamSynchronize(stream);
  }
  // Not waited for: the copy may still run, and host pages released meanwhile
  // wait for a finish_copies() that waits for it.
  if (waited != cudaSuccess) copies_pending_ = true;
  check_runtime(waited, "copying a page between device and host");
}

void CudaBackend::zero(DevicePtr address, std::size_t bytes) {
  // On the copy stream, which copy_mutex_ serialises; waited for here, so
  // the bytes read as zero before any launch that follows.
  std::lock_guard<std::mutex> lock(copy_mutex_);
  CurrentContext current(context_);
  auto stream = static_cast<cudaStream_t>(copy_stream_);
  Timed timed(*this, DriverCall::kZero);
  cudaError_t err = cudaMemsetAsync(reinterpret_cast<void*>(address), 0, bytes, stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  check_runtime(err, "zeroing a page");
}

void CudaBackend::finish_copies() {
  std::lock_guard<std::mutex> lock(copy_mutex_);
  if (copies_pending_) {
    CurrentContext current(context_);
    cudaError_t err;
    {
      Timed timed(*this, DriverCall::kCopyWait);
      err = cudaStreamSynchronize(static_cast<cudaStream_t>(copy_stream_));
    }
    // Not waited for: the copies may still run, so the host pages released
    // meanwhile stay until a later call (or the backend's end) waits.
    check_runtime(err, "copying pages between device and host");
    copies_pending_ = false;
    // Every mark is behind: reusable.
    spare_marks_.insert(spare_marks_.end(), recorded_marks_.begin(), recorded_marks_.end());
    recorded_marks_.clear();
  }
  // Host pages released while copies ran: nothing reads their shadows now.
  std::vector<PageHandle> releases;
  releases.swap(releases_after_copies_);
  std::string first_error;
  for (PageHandle page : releases) {
    try {
      release_host_page(page);
    } catch (const Error& e) {
      if (first_error.empty()) first_error = e.what();
    }
  }
  if (!first_error.empty()) throw Error(first_error);
}

Backend::CopyMark CudaBackend::mark_copies() {
  std::lock_guard<std::mutex> lock(copy_mutex_);
  if (!copies_pending_) return 0;  // nothing in flight: a wait has nothing to wait for
  CurrentContext current(context_);
  cudaEvent_t event = nullptr;
  if (!spare_marks_.empty()) {
    event = static_cast<cudaEvent_t>(spare_marks_.back());
    spare_marks_.pop_back();
  } else if (cudaEventCreateWithFlags(&event, cudaEventDisableTiming) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;  // no mark: its wait waits for every copy instead
  }
  if (cudaEventRecord(event, static_cast<cudaStream_t>(copy_stream_)) != cudaSuccess) {
    (void)cudaGetLastError();
    spare_marks_.push_back(event);
    return 0;
  }
  recorded_marks_.push_back(event);
  return reinterpret_cast<CopyMark>(event);
}

void CudaBackend::wait_for_copies(CopyMark mark) {
  if (mark == 0) {
    finish_copies();
    return;
  }
  std::lock_guard<std::mutex> lock(copy_mutex_);
  auto event = reinterpret_cast<cudaEvent_t>(mark);
  auto it = std::find(recorded_marks_.begin(), recorded_marks_.end(), static_cast<void*>(event));
  if (it == recorded_marks_.end()) return;  // a finish_copies() since waited for it
  CurrentContext current(context_);
  cudaError_t err;
  {
    Timed timed(*this, DriverCall::kCopyWait);
    err = cudaEventSynchronize(event);
  }
  if (err != cudaSuccess) {
    // Not waited for: it stays recorded, and finish_copies() waits for all.
    check_runtime(err, "copying pages between device and host (cudaEventSynchronize)");
  }
  recorded_marks_.erase(it);
  spare_marks_.push_back(event);
}

DevicePtr CudaBackend::allocate_pinned_host(std::size_t bytes) {
  CurrentContext current(context_);
  void* host = nullptr;
  CUresult r = driver().cuMemHostAlloc(&host, bytes, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE);
  if (r == CUDA_ERROR_OUT_OF_MEMORY) return 0;
  check_driver(r, "cuMemHostAlloc");
  CUdeviceptr device_address = 0;
  r = driver().cuMemHostGetDevicePointer(&device_address, host, 0);
  if (r != CUDA_SUCCESS) {
    driver().cuMemFreeHost(host);
    check_driver(r, "cuMemHostGetDevicePointer");
  }
  std::lock_guard<std::mutex> lock(pinned_mutex_);
  pinned_host_[static_cast<DevicePtr>(device_address)] = host;
  return static_cast<DevicePtr>(device_address);
}

void CudaBackend::free_pinned_host(DevicePtr address, std::size_t bytes) {
  // Kernels launched before the block was freed may still read it.
  wait_for_launched_work("cudaDeviceSynchronize before freeing pinned host memory");
  free_pinned_host_synchronized(address, bytes);
}

void CudaBackend::free_pinned_host_synchronized(DevicePtr address, std::size_t /*bytes*/) {
  CurrentContext current(context_);
  void* host = nullptr;
  {
    std::lock_guard<std::mutex> lock(pinned_mutex_);
    auto it = pinned_host_.find(address);
    if (it == pinned_host_.end()) {
      throw Error("free_pinned_host: address is not a pinned-fallback allocation of this backend.");
    }
    host = it->second;
    pinned_host_.erase(it);
  }
  check_driver(driver().cuMemFreeHost(host), "cuMemFreeHost");
}

EventHandle CudaBackend::create_event() {
  CurrentContext current(context_);
  cudaEvent_t event = nullptr;
  check_runtime(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
  return EventHandle{reinterpret_cast<std::uint64_t>(event)};
}

void CudaBackend::destroy_event(EventHandle event) {
  try {
    CurrentContext current(context_);
    cudaEventDestroy(reinterpret_cast<cudaEvent_t>(event.id));
  } catch (const Error&) {
    // Never throws, as before: the driver is going (process exit) and takes the event with it.
  }
}

void CudaBackend::record_event(EventHandle event, StreamId stream) {
  CurrentContext current(context_);
  check_runtime(cudaEventRecord(reinterpret_cast<cudaEvent_t>(event.id),
                                reinterpret_cast<cudaStream_t>(stream)),
                "cudaEventRecord");
}

bool CudaBackend::query_event(EventHandle event) {
  CurrentContext current(context_);
  cudaError_t err = cudaEventQuery(reinterpret_cast<cudaEvent_t>(event.id));
  if (err == cudaErrorNotReady) {
    cudaGetLastError();  // not an error: clear it so it does not surface later
    return false;
  }
  check_runtime(err, "cudaEventQuery");
  return true;
}

void CudaBackend::synchronize_event(EventHandle event) {
  CurrentContext current(context_);
  check_runtime(cudaEventSynchronize(reinterpret_cast<cudaEvent_t>(event.id)), "cudaEventSynchronize");
}

void CudaBackend::synchronize_device() {
  CurrentContext current(context_);
  Timed timed(*this, DriverCall::kDeviceSynchronize);
  check_runtime(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

}  // namespace cotenant::cuda

// ---- the virtual memory probe -----------------------------------------------------------

namespace cotenant::cuda {
namespace {

// What one probe pass made, given back when it ends however it ends.
struct ProbePass {
  explicit ProbePass(const DriverApi& api) : api(api) {}
  ~ProbePass() {
    bool unmapped = true;  // an address range that keeps a mapping is not freed
    for (const auto& [address, bytes] : mapped) unmapped = api.cuMemUnmap(address, bytes) == CUDA_SUCCESS && unmapped;
    for (CUmemGenericAllocationHandle handle : handles) api.cuMemRelease(handle);
    if (!unmapped) return;
    for (const auto& [address, bytes] : reserved) api.cuMemAddressFree(address, bytes);
  }
  ProbePass(const ProbePass&) = delete;
  ProbePass& operator=(const ProbePass&) = delete;

  const DriverApi& api;
  std::vector<CUmemGenericAllocationHandle> handles;
  std::vector<std::pair<CUdeviceptr, std::size_t>> mapped;
  std::vector<std::pair<CUdeviceptr, std::size_t>> reserved;
};

// Runs `call(i)` for i in [0, count) timed into a row of `step`; false (the
// driver's refusal in the row) at the first call that fails.
template <class Call>
bool probe_step(std::vector<CudaBackend::VmmProbeRow>& rows, const CudaBackend::VmmProbeRow& pass,
                const char* step, std::size_t count, Call call) {
  CudaBackend::VmmProbeRow row = pass;
  row.step = step;
  for (std::size_t i = 0; i < count; ++i) {
    const auto start = std::chrono::steady_clock::now();
    const CUresult r = call(i);
    row.ns += static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count());
    if (r != CUDA_SUCCESS) {
      const char* name = nullptr;
      driver().cuGetErrorName(r, &name);
      row.error = name != nullptr ? name : "CUDA error " + std::to_string(static_cast<int>(r));
      rows.push_back(row);
      return false;
    }
    ++row.calls;
  }
  rows.push_back(row);
  return true;
}

}  // namespace

std::vector<CudaBackend::VmmProbeRow> CudaBackend::probe_vmm_costs(std::size_t total_bytes,
                                                                  const std::vector<std::size_t>& extents) {
  for (std::size_t extent : extents) {
    if (extent == 0 || extent % granularity_ != 0 || total_bytes % extent != 0) {
      throw Error("probe_vmm_costs: an extent of " + std::to_string(extent) + " bytes does not fit: each extent " +
                  "must be a multiple of the page (" + std::to_string(granularity_) + " bytes) and divide " +
                  "total_bytes (" + std::to_string(total_bytes) + ").");
    }
  }
  const DriverApi& api = driver();
  CurrentContext current(context_);
  std::vector<std::pair<std::string, CUmemAllocationProp>> sides{
      {"device", page_properties(CU_MEM_LOCATION_TYPE_DEVICE, device_)}};
  if (host_location_ == HostLocation::kHostNuma) {
    sides.emplace_back("host", page_properties(CU_MEM_LOCATION_TYPE_HOST_NUMA, host_numa_id_));
  } else if (host_location_ == HostLocation::kHost) {
    sides.emplace_back("host", page_properties(CU_MEM_LOCATION_TYPE_HOST, 0));
  }
  const CUmemAccessDesc access = read_write_for(device_);
  std::vector<VmmProbeRow> rows;
  for (const auto& [side, prop] : sides) {
    for (std::size_t extent : extents) {
      ProbePass pass(api);
      VmmProbeRow key;
      key.side = side;
      key.extent_bytes = extent;
      const std::size_t count = total_bytes / extent;
      CUdeviceptr base = 0;
      if (!probe_step(rows, key, "reserve", 1, [&](std::size_t) {
            return api.cuMemAddressReserve(&base, total_bytes, 0, 0, 0);
          })) {
        continue;
      }
      rows.pop_back();  // reserving address space is not one of the steps
      pass.reserved.emplace_back(base, total_bytes);
      auto at = [&](std::size_t i) { return base + i * extent; };
      auto map_each = [&](std::size_t i) {
        const CUresult r = api.cuMemMap(at(i), extent, 0, pass.handles[i], 0);
        if (r == CUDA_SUCCESS) pass.mapped.emplace_back(at(i), extent);
        return r;
      };
      auto unmap_each = [&](std::size_t i) {
        const CUresult r = api.cuMemUnmap(at(i), extent);
        if (r == CUDA_SUCCESS) {
          pass.mapped.erase(std::find(pass.mapped.begin(), pass.mapped.end(), std::make_pair(at(i), extent)));
        }
        return r;
      };
      auto set_access_each = [&](std::size_t i) { return api.cuMemSetAccess(at(i), extent, &access, 1); };
      std::vector<VmmProbeRow> untimed;  // steps that only set the next one up
      const bool ran =
          probe_step(rows, key, "create", count, [&](std::size_t) {
            CUmemGenericAllocationHandle handle = 0;
            const CUresult r = api.cuMemCreate(&handle, extent, &prop, 0);
            if (r == CUDA_SUCCESS) pass.handles.push_back(handle);
            return r;
          }) &&
          probe_step(rows, key, "map", count, map_each) &&
          probe_step(rows, key, "set_access", count, set_access_each) &&
          probe_step(rows, key, "unmap", count, unmap_each) &&
          probe_step(rows, key, "map_again", count, map_each) &&
          probe_step(rows, key, "set_access_again", count, set_access_each) &&
          probe_step(untimed, key, "unmap", count, unmap_each) &&
          probe_step(untimed, key, "map_again", count, map_each) &&
          probe_step(rows, key, "set_access_whole", 1, [&](std::size_t) {
            return api.cuMemSetAccess(base, total_bytes, &access, 1);
          }) &&
          probe_step(untimed, key, "unmap", count, unmap_each) &&
          probe_step(rows, key, "release", count, [&](std::size_t i) {
            const CUresult r = api.cuMemRelease(pass.handles[i]);
            if (r == CUDA_SUCCESS) pass.handles[i] = 0;
            return r;
          });
      for (const VmmProbeRow& row : untimed) {
        if (!row.error.empty()) rows.push_back(row);  // a refusal there ended the pass: say so
      }
      pass.handles.erase(std::remove(pass.handles.begin(), pass.handles.end(), CUmemGenericAllocationHandle{0}),
                         pass.handles.end());
      if (!ran || extent == granularity_) continue;
      // Pieces: one allocation of `extent`, each page of it mapped at its own
      // address with a free page between (so no two pieces form one range).
      const std::size_t pieces = extent / granularity_;
      CUdeviceptr piece_base = 0;
      CUmemGenericAllocationHandle whole = 0;
      std::vector<VmmProbeRow> setup;  // untimed; a refusal there ends the pieces: say so
      const bool set_up =
          probe_step(setup, key, "piece_reserve", 1, [&](std::size_t) {
            const CUresult r = api.cuMemAddressReserve(&piece_base, 2 * extent, 0, 0, 0);
            if (r == CUDA_SUCCESS) pass.reserved.emplace_back(piece_base, 2 * extent);
            return r;
          }) &&
          probe_step(setup, key, "piece_create", 1, [&](std::size_t) {
            const CUresult r = api.cuMemCreate(&whole, extent, &prop, 0);
            if (r == CUDA_SUCCESS) pass.handles.push_back(whole);
            return r;
          });
      if (!set_up) {
        rows.push_back(setup.back());
        continue;
      }
      auto piece_at = [&](std::size_t j) { return piece_base + 2 * j * granularity_; };
      probe_step(rows, key, "map_piece", pieces, [&](std::size_t j) {
        const CUresult r = api.cuMemMap(piece_at(j), granularity_, j * granularity_, whole, 0);
        if (r == CUDA_SUCCESS) pass.mapped.emplace_back(piece_at(j), granularity_);
        return r;
      }) && probe_step(rows, key, "set_access_piece", pieces, [&](std::size_t j) {
        return api.cuMemSetAccess(piece_at(j), granularity_, &access, 1);
      });
    }
  }
  return rows;
}

}  // namespace cotenant::cuda
