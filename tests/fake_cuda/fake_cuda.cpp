// A fake CUDA runtime and driver for tests: see fake_cuda.h for the model.
//
// Everything is guarded by one mutex (state().mutex), except the bytes that
// a stream's worker copies: a worker takes its next operation under the
// mutex, copies without it, and pops the operation under it again. An
// operation stays at the front of its queue until its copy is done, so an
// unmap that overlaps a queue entry knows the bytes are still in use.
#include "fake_cuda.h"

#include <cuda.h>
#include <cuda_profiler_api.h>
#include <cuda_runtime_api.h>
#include <sys/mman.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>
#include <vector>

namespace fake_cuda {
namespace {

using Address = std::uintptr_t;

// A queued cudaMemcpyAsync, or a cudaMemsetAsync (src null: fill with `value`).
struct Copy {
  void* dst = nullptr;
  const void* src = nullptr;
  std::size_t bytes = 0;
  int value = 0;
};

// A stream: a worker thread that runs its queue in order. `completed`
// counts finished operations; an event recorded after operation k of the
// stream is complete once completed >= k.
struct Stream {
  std::deque<Copy> queue;  // front: running (or next to run)
  std::uint64_t submitted = 0;
  std::uint64_t completed = 0;
  bool stop = false;
  std::condition_variable work;
  std::thread worker;
};

struct Event {
  Stream* stream = nullptr;  // null: never recorded (complete)
  std::uint64_t after = 0;   // complete when stream->completed >= after
};

// A physical page allocation: a memfd of `bytes`. It is destroyed when
// released and no longer mapped anywhere (the driver's rule).
struct Handle {
  int fd = -1;
  std::size_t bytes = 0;
  bool on_device = false;
  bool released = false;
  int mappings = 0;
};

struct Mapping {
  std::size_t bytes = 0;
  CUmemGenericAllocationHandle handle = 0;
  std::uint32_t devices = 0;  // bit d: device d may access it (cuMemSetAccess)
  bool accessible() const { return devices != 0; }
};

struct Failure {
  int remaining = 0;  // fails when it counts down to 0
  int code = 0;
};

struct State {
  std::mutex mutex;
  std::condition_variable progress;  // a stream finished an operation
  Config config;
  // The device's virtual address space: one PROT_NONE arena, carved first
  // fit from the bottom, so reservations come out in ascending order as they
  // do from the CUDA driver (mmap alone would hand them out descending).
  Address arena = 0;
  std::map<Address, std::size_t> arena_free;    // base -> bytes, coalesced
  std::map<Address, std::size_t> reservations;  // base -> bytes
  std::map<Address, Mapping> mappings;          // address -> mapping
  std::unordered_map<CUmemGenericAllocationHandle, Handle> handles;
  CUmemGenericAllocationHandle next_handle = 1;
  std::map<Address, std::size_t> pinned;  // host pointer -> bytes (rounded to pages)
  std::map<Address, std::size_t> malloced;  // cudaMalloc pointer -> bytes (rounded to the granularity)
  std::size_t device_bytes = 0;  // device pages alive
  std::uint64_t device_bytes_created = 0;  // every byte of device memory handed out since reset
  std::size_t host_bytes = 0;    // host pages alive plus pinned host allocations
  std::set<Stream*> streams;  // created by cudaStreamCreate*, not destroyed
  Stream* default_stream = nullptr;
  std::set<Event*> events;
  std::map<std::string, std::uint64_t> calls;
  std::map<std::string, Failure> failures;
  Violations violations;
  std::chrono::microseconds delay{0};
  std::uint64_t operations_completed = 0;  // by every stream since reset
  bool held = false;  // hold_streams(): workers start nothing until a wait releases it
  std::uint32_t primary_contexts = 0;  // bit d: device d's primary context was initialized
  int primary_retains[32] = {};        // cuDevicePrimaryCtxRetain calls not released, per device
};

// Never destroyed: stream workers may outlive static destruction.
State& state() {
  static State* s = new State;
  return *s;
}

thread_local int current_device = 0;    // the runtime's device for this thread (cudaSetDevice)
thread_local int current_context = -1;  // the device whose primary context is current here; -1: none

// A primary context's handle: an address per device, never dereferenced.
char primary_context_handles[32];
CUcontext primary_context(int device) { return reinterpret_cast<CUcontext>(&primary_context_handles[device]); }

// The runtime binds a context lazily: "If no CUcontext is current to the
// calling thread when a CUDA Runtime API call which requires an active
// context is made, then the primary context for a device will be selected,
// made current to the calling thread, and initialized" (CUDA Runtime API,
// Interactions with the CUDA Driver API). The device is the thread's runtime
// device: on a thread that never set one, device 0.
void bind_runtime_context(State& s) {
  if (current_context >= 0) return;
  current_context = current_device;
  s.primary_contexts |= std::uint32_t{1} << current_device;
}
thread_local cudaError_t last_error = cudaSuccess;

using Lock = std::unique_lock<std::mutex>;

void violate(State& s, std::string message) {
  ++s.violations.count;
  s.violations.messages.push_back(std::move(message));
}

std::string hex(Address a) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%zx", static_cast<std::size_t>(a));
  return buf;
}

// Counts the call, and returns true (with the injected code) when it fails.
bool injected(State& s, const char* entry, int* code) {
  ++s.calls[entry];
  auto it = s.failures.find(entry);
  if (it == s.failures.end()) return false;
  if (--it->second.remaining > 0) return false;
  *code = it->second.code;
  s.failures.erase(it);
  return true;
}

bool overlaps(Address a, std::size_t a_bytes, Address b, std::size_t b_bytes) {
  return a < b + b_bytes && b < a + a_bytes;
}

bool copy_touches(const Copy& c, Address a, std::size_t bytes) {
  return overlaps(reinterpret_cast<Address>(c.dst), c.bytes, a, bytes) ||
         overlaps(reinterpret_cast<Address>(c.src), c.bytes, a, bytes);
}

std::vector<Stream*> all_streams(State& s) {
  std::vector<Stream*> out(s.streams.begin(), s.streams.end());
  if (s.default_stream != nullptr) out.push_back(s.default_stream);
  return out;
}

bool work_touches(State& s, Address a, std::size_t bytes) {
  for (Stream* stream : all_streams(s)) {
    for (const Copy& c : stream->queue) {
      if (copy_touches(c, a, bytes)) return true;
    }
  }
  return false;
}

// Whoever waits for work releases hold_streams().
void release_hold(State& s) {
  if (!s.held) return;
  s.held = false;
  for (Stream* stream : all_streams(s)) stream->work.notify_all();
}

// `what` of [a, a + bytes) while queued copies still touch it: a missing
// synchronization. Counted, then waited out so the copy does not fault.
void wait_for_work_on(State& s, Lock& lock, Address a, std::size_t bytes, const char* what) {
  if (!work_touches(s, a, bytes)) return;
  violate(s, std::string(what) + " of [" + hex(a) + ", " + hex(a + bytes) +
                 ") while a copy queued on a stream still touches it (missing synchronization)");
  release_hold(s);
  s.progress.wait(lock, [&] { return !work_touches(s, a, bytes); });
}

void drain(State& s, Lock& lock, Stream* stream) {
  release_hold(s);
  s.progress.wait(lock, [&] { return stream->queue.empty(); });
}

void drain_all(State& s, Lock& lock) {
  release_hold(s);
  s.progress.wait(lock, [&] {
    for (Stream* stream : all_streams(s)) {
      if (!stream->queue.empty()) return false;
    }
    return true;
  });
}

void run_worker(Stream* stream) {
  State& s = state();
  Lock lock(s.mutex);
  for (;;) {
    stream->work.wait(lock, [&] { return stream->stop || (!stream->queue.empty() && !s.held); });
    if (stream->queue.empty()) return;  // stopped and drained
    const Copy copy = stream->queue.front();
    const auto delay = s.delay;
    lock.unlock();
    if (delay.count() > 0) std::this_thread::sleep_for(delay);
    if (copy.src != nullptr) std::memcpy(copy.dst, copy.src, copy.bytes);
    else std::memset(copy.dst, copy.value, copy.bytes);
    lock.lock();
    stream->queue.pop_front();
    ++stream->completed;
    ++s.operations_completed;
    s.progress.notify_all();
  }
}

Stream* start_stream() {
  auto* stream = new Stream;
  stream->worker = std::thread(run_worker, stream);
  return stream;
}

// Stops and frees a stream; the mutex must not be held (the worker takes it).
void stop_stream(Stream* stream) {
  {
    Lock lock(state().mutex);
    drain(state(), lock, stream);
    stream->stop = true;
    stream->work.notify_all();
  }
  stream->worker.join();
  delete stream;
}

// cudaStreamLegacy (1) and cudaStreamPerThread (2) are the default stream too.
bool is_default(cudaStream_t stream) { return reinterpret_cast<Address>(stream) <= 2; }

Stream* find_stream(State& s, cudaStream_t handle) {
  if (is_default(handle)) {
    if (s.default_stream == nullptr) s.default_stream = start_stream();
    return s.default_stream;
  }
  auto* stream = reinterpret_cast<Stream*>(handle);
  return s.streams.count(stream) ? stream : nullptr;
}

bool event_complete(const Event& e) { return e.stream == nullptr || e.stream->completed >= e.after; }

// ---- virtual address space ----------------------------------------------------

constexpr std::size_t kArenaBytes = std::size_t{64} << 30;

void make_arena(State& s) {
  if (s.arena != 0) return;
  void* p = mmap(nullptr, kArenaBytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return;
  s.arena = reinterpret_cast<Address>(p);
  s.arena_free.emplace(s.arena, kArenaBytes);
}

// First fit, lowest address: returns 0 when nothing fits.
Address carve(State& s, std::size_t bytes, std::size_t align) {
  make_arena(s);
  for (auto it = s.arena_free.begin(); it != s.arena_free.end(); ++it) {
    const Address start = it->first;
    const std::size_t size = it->second;
    const Address base = (start + align - 1) / align * align;
    if (base + bytes > start + size) continue;
    s.arena_free.erase(it);
    if (base > start) s.arena_free.emplace(start, base - start);
    if (base + bytes < start + size) s.arena_free.emplace(base + bytes, start + size - (base + bytes));
    return base;
  }
  return 0;
}

void give_back(State& s, Address base, std::size_t bytes) {
  auto next = s.arena_free.lower_bound(base);
  if (next != s.arena_free.end() && next->first == base + bytes) {
    bytes += next->second;
    next = s.arena_free.erase(next);
  }
  if (next != s.arena_free.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == base) {
      prev->second += bytes;
      return;
    }
  }
  s.arena_free.emplace(base, bytes);
}

// ---- memory rules -------------------------------------------------------------

bool aligned(State& s, Address a) { return a % s.config.granularity == 0; }

const std::pair<const Address, std::size_t>* reservation_holding(State& s, Address a, std::size_t bytes) {
  auto it = s.reservations.upper_bound(a);
  if (it == s.reservations.begin()) return nullptr;
  --it;
  if (a >= it->first && a + bytes <= it->first + it->second) return &*it;
  return nullptr;
}

bool any_reservation_overlaps(State& s, Address a, std::size_t bytes) {
  for (const auto& [base, size] : s.reservations) {
    if (overlaps(base, size, a, bytes)) return true;
  }
  return false;
}

// Whether [a, a + bytes) is covered, without gaps, by mappings; with
// `accessible`, by accessible ones.
bool fully_mapped(State& s, Address a, std::size_t bytes, bool accessible) {
  Address at = a;
  auto it = s.mappings.upper_bound(a);
  if (it != s.mappings.begin()) --it;
  while (at < a + bytes) {
    if (it == s.mappings.end() || it->first > at || it->first + it->second.bytes <= at) return false;
    if (accessible && !it->second.accessible()) return false;
    at = it->first + it->second.bytes;
    ++it;
  }
  return true;
}

bool any_mapping_overlaps(State& s, Address a, std::size_t bytes) {
  auto it = s.mappings.lower_bound(a);
  if (it != s.mappings.end() && it->first < a + bytes) return true;
  if (it != s.mappings.begin()) {
    --it;
    if (it->first + it->second.bytes > a) return true;
  }
  return false;
}

void destroy_handle_if_unused(State& s, CUmemGenericAllocationHandle id) {
  Handle& h = s.handles.at(id);
  if (!h.released || h.mappings != 0) return;
  close(h.fd);
  (h.on_device ? s.device_bytes : s.host_bytes) -= h.bytes;
  s.handles.erase(id);
}

void remap_inaccessible(Address a, std::size_t bytes) {
  mmap(reinterpret_cast<void*>(a), bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
       -1, 0);
}

// Whether a copy may touch [p, p + bytes): outside every reservation (plain
// or pinned host memory), or mapped and accessible inside one.
bool copy_range_ok(State& s, const void* p, std::size_t bytes) {
  const auto a = reinterpret_cast<Address>(p);
  if (!any_reservation_overlaps(s, a, bytes)) return true;
  return fully_mapped(s, a, bytes, true);
}

// ---- driver entry points --------------------------------------------------------

const char* driver_error_name(CUresult r) {
  switch (r) {
    case CUDA_SUCCESS: return "no error";
    case CUDA_ERROR_INVALID_VALUE: return "invalid argument";
    case CUDA_ERROR_OUT_OF_MEMORY: return "out of memory";
    case CUDA_ERROR_INVALID_DEVICE: return "invalid device ordinal";
    case CUDA_ERROR_INVALID_HANDLE: return "invalid resource handle";
    case CUDA_ERROR_NOT_SUPPORTED: return "operation not supported";
    case CUDA_ERROR_ILLEGAL_ADDRESS: return "an illegal memory access was encountered";
    case CUDA_ERROR_INVALID_CONTEXT: return "invalid device context";
    default: return nullptr;
  }
}

#define FAKE_DRIVER_ENTRY(name)                          \
  State& s = state();                                    \
  Lock lock(s.mutex);                                    \
  if (int code = 0; injected(s, name, &code)) return static_cast<CUresult>(code)

CUresult fake_cuGetErrorString(CUresult error, const char** str) {
  const char* name = driver_error_name(error);
  *str = name;
  return name != nullptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult fake_cuGetErrorName(CUresult error, const char** str) {
  const char* name = nullptr;
  switch (error) {
    case CUDA_SUCCESS: name = "CUDA_SUCCESS"; break;
    case CUDA_ERROR_INVALID_VALUE: name = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: name = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case CUDA_ERROR_INVALID_DEVICE: name = "CUDA_ERROR_INVALID_DEVICE"; break;
    case CUDA_ERROR_INVALID_HANDLE: name = "CUDA_ERROR_INVALID_HANDLE"; break;
    case CUDA_ERROR_NOT_SUPPORTED: name = "CUDA_ERROR_NOT_SUPPORTED"; break;
    case CUDA_ERROR_ILLEGAL_ADDRESS: name = "CUDA_ERROR_ILLEGAL_ADDRESS"; break;
    case CUDA_ERROR_INVALID_CONTEXT: name = "CUDA_ERROR_INVALID_CONTEXT"; break;
    default: break;
  }
  *str = name;
  return name != nullptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult fake_cuInit(unsigned int flags) {
  FAKE_DRIVER_ENTRY("cuInit");
  return flags == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult fake_cuDeviceGetCount(int* count) {
  FAKE_DRIVER_ENTRY("cuDeviceGetCount");
  *count = s.config.device_count;
  return CUDA_SUCCESS;
}

// Reported active whether or not primary_context_initialized() says so:
// torch asks before it sets a device, and sets devices as it does on a GPU
// whose context exists.
CUresult fake_cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int* flags, int* active) {
  FAKE_DRIVER_ENTRY("cuDevicePrimaryCtxGetState");
  if (dev < 0 || dev >= s.config.device_count) return CUDA_ERROR_INVALID_DEVICE;
  *flags = 0;
  *active = 1;
  return CUDA_SUCCESS;
}

CUresult fake_cuDeviceGet(CUdevice* device, int ordinal) {
  FAKE_DRIVER_ENTRY("cuDeviceGet");
  if (ordinal < 0 || ordinal >= s.config.device_count) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

// cuDevicePrimaryCtxRetain makes the device's primary context active (it
// initializes it when it is not); the context stays until released as often.
CUresult fake_cuDevicePrimaryCtxRetain(CUcontext* context, CUdevice dev) {
  FAKE_DRIVER_ENTRY("cuDevicePrimaryCtxRetain");
  if (dev < 0 || dev >= s.config.device_count) return CUDA_ERROR_INVALID_DEVICE;
  s.primary_contexts |= std::uint32_t{1} << dev;
  ++s.primary_retains[dev];
  *context = primary_context(dev);
  return CUDA_SUCCESS;
}

CUresult fake_cuDevicePrimaryCtxRelease(CUdevice dev) {
  FAKE_DRIVER_ENTRY("cuDevicePrimaryCtxRelease");
  if (dev < 0 || dev >= s.config.device_count) return CUDA_ERROR_INVALID_DEVICE;
  if (s.primary_retains[dev] == 0) {
    violate(s, "cuDevicePrimaryCtxRelease of device " + std::to_string(dev) + " without a retain to match");
    return CUDA_ERROR_INVALID_CONTEXT;
  }
  --s.primary_retains[dev];
  return CUDA_SUCCESS;
}

CUresult fake_cuCtxGetCurrent(CUcontext* context) {
  FAKE_DRIVER_ENTRY("cuCtxGetCurrent");
  *context = current_context >= 0 ? primary_context(current_context) : nullptr;
  return CUDA_SUCCESS;
}

// Null unbinds: the thread has no context current, as before its first call.
CUresult fake_cuCtxSetCurrent(CUcontext context) {
  FAKE_DRIVER_ENTRY("cuCtxSetCurrent");
  if (context == nullptr) {
    current_context = -1;
    return CUDA_SUCCESS;
  }
  for (int d = 0; d < s.config.device_count; ++d) {
    if (context != primary_context(d)) continue;
    if ((s.primary_contexts & (std::uint32_t{1} << d)) == 0) {
      violate(s, "cuCtxSetCurrent of device " + std::to_string(d) + "'s primary context, which is not active");
      return CUDA_ERROR_INVALID_CONTEXT;
    }
    current_context = d;
    return CUDA_SUCCESS;
  }
  violate(s, "cuCtxSetCurrent of a context that does not exist");
  return CUDA_ERROR_INVALID_CONTEXT;
}

// cuMemHostAlloc, cuMemHostGetDevicePointer and cuMemFreeHost act in the
// calling thread's context and return CUDA_ERROR_INVALID_CONTEXT without one
// (cuda.h: each lists it among its results; the virtual memory calls do not
// and need no context).
bool context_current(State& s, const char* entry) {
  if (current_context >= 0) return true;
  violate(s, std::string(entry) + " on a thread with no CUDA context current");
  return false;
}

CUresult fake_cuDeviceGetAttribute(int* value, CUdevice_attribute attribute, CUdevice device) {
  FAKE_DRIVER_ENTRY("cuDeviceGetAttribute");
  if (device < 0 || device >= s.config.device_count) return CUDA_ERROR_INVALID_DEVICE;
  switch (attribute) {
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: *value = s.config.vmm; break;
    case CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: *value = s.config.host_vmm; break;
    case CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: *value = s.config.host_numa_vmm; break;
    case CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID: *value = s.config.host_numa_vmm ? s.config.host_numa_id : -1; break;
    default: *value = 0; break;
  }
  return CUDA_SUCCESS;
}

// The allocation properties' rules; `entry` names the caller in messages.
CUresult check_properties(State& s, const CUmemAllocationProp* prop, const char* entry) {
  if (prop == nullptr || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED) {
    violate(s, std::string(entry) + ": allocation type is not CU_MEM_ALLOCATION_TYPE_PINNED");
    return CUDA_ERROR_INVALID_VALUE;
  }
  switch (prop->location.type) {
    case CU_MEM_LOCATION_TYPE_DEVICE:
      if (prop->location.id < 0 || prop->location.id >= s.config.device_count) {
        violate(s, std::string(entry) + ": device location " + std::to_string(prop->location.id) + " does not exist");
        return CUDA_ERROR_INVALID_DEVICE;
      }
      return CUDA_SUCCESS;
    case CU_MEM_LOCATION_TYPE_HOST:
      if (s.config.host_vmm) return CUDA_SUCCESS;
      violate(s, std::string(entry) + ": CU_MEM_LOCATION_TYPE_HOST on a device without host VMM support");
      return CUDA_ERROR_NOT_SUPPORTED;
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
      if (s.config.host_numa_vmm && prop->location.id == s.config.host_numa_id) return CUDA_SUCCESS;
      violate(s, std::string(entry) + ": CU_MEM_LOCATION_TYPE_HOST_NUMA " + std::to_string(prop->location.id) +
                     " without host NUMA VMM support for that node");
      return CUDA_ERROR_NOT_SUPPORTED;
    default:
      violate(s, std::string(entry) + ": unsupported location type");
      return CUDA_ERROR_INVALID_VALUE;
  }
}

CUresult fake_cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                                            CUmemAllocationGranularity_flags /*option*/) {
  FAKE_DRIVER_ENTRY("cuMemGetAllocationGranularity");
  if (CUresult r = check_properties(s, prop, "cuMemGetAllocationGranularity"); r != CUDA_SUCCESS) return r;
  *granularity = s.config.granularity;
  return CUDA_SUCCESS;
}

CUresult fake_cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr /*addr*/,
                                  unsigned long long flags) {
  FAKE_DRIVER_ENTRY("cuMemAddressReserve");
  if (size == 0 || size % s.config.granularity != 0 || flags != 0 ||
      (alignment != 0 && (alignment & (alignment - 1)) != 0)) {
    violate(s, "cuMemAddressReserve of " + std::to_string(size) + " bytes (alignment " + std::to_string(alignment) +
                   "): size must be a nonzero multiple of the granularity, alignment a power of two");
    return CUDA_ERROR_INVALID_VALUE;
  }
  const std::size_t align = alignment > s.config.granularity ? alignment : s.config.granularity;
  const Address base = carve(s, size, align);
  if (base == 0) return CUDA_ERROR_OUT_OF_MEMORY;
  s.reservations.emplace(base, size);
  *ptr = static_cast<CUdeviceptr>(base);
  return CUDA_SUCCESS;
}

CUresult fake_cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  FAKE_DRIVER_ENTRY("cuMemAddressFree");
  const auto a = static_cast<Address>(ptr);
  auto it = s.reservations.find(a);
  if (it == s.reservations.end() || it->second != size) {
    violate(s, "cuMemAddressFree of [" + hex(a) + ", +" + std::to_string(size) +
                   ") which is not a reservation (base and size must match cuMemAddressReserve)");
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (any_mapping_overlaps(s, a, size)) {
    violate(s, "cuMemAddressFree of [" + hex(a) + ", +" + std::to_string(size) + ") while pages are still mapped in it");
    return CUDA_ERROR_INVALID_VALUE;
  }
  wait_for_work_on(s, lock, a, size, "cuMemAddressFree");
  s.reservations.erase(it);
  give_back(s, a, size);  // already PROT_NONE: nothing is mapped in it
  return CUDA_SUCCESS;
}

CUresult fake_cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size, const CUmemAllocationProp* prop,
                          unsigned long long flags) {
  FAKE_DRIVER_ENTRY("cuMemCreate");
  if (size == 0 || size % s.config.granularity != 0 || flags != 0) {
    violate(s, "cuMemCreate of " + std::to_string(size) + " bytes: not a nonzero multiple of the granularity");
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (CUresult r = check_properties(s, prop, "cuMemCreate"); r != CUDA_SUCCESS) return r;
  const bool on_device = prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE;
  if (on_device && s.device_bytes + size > s.config.device_capacity) return CUDA_ERROR_OUT_OF_MEMORY;
  if (!on_device && s.host_bytes + size > s.config.host_capacity) return CUDA_ERROR_OUT_OF_MEMORY;
  const int fd = memfd_create("fake_cuda_page", MFD_CLOEXEC);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  if (s.config.garbage_in_new_pages) {
    // The driver does not promise zeros in a new page: model a page that
    // held someone's bytes before.
    const std::vector<char> garbage(size, static_cast<char>(0xA5));
    if (pwrite(fd, garbage.data(), size, 0) != static_cast<ssize_t>(size)) {
      close(fd);
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
  }
  const CUmemGenericAllocationHandle id = s.next_handle++;
  s.handles.emplace(id, Handle{fd, size, on_device, false, 0});
  (on_device ? s.device_bytes : s.host_bytes) += size;
  if (on_device) s.device_bytes_created += size;
  *handle = id;
  return CUDA_SUCCESS;
}

CUresult fake_cuMemRelease(CUmemGenericAllocationHandle handle) {
  FAKE_DRIVER_ENTRY("cuMemRelease");
  auto it = s.handles.find(handle);
  if (it == s.handles.end() || it->second.released) {
    violate(s, "cuMemRelease of handle " + std::to_string(handle) + " which is not a live cuMemCreate handle");
    return CUDA_ERROR_INVALID_VALUE;
  }
  it->second.released = true;  // a mapped page lives on until unmapped
  destroy_handle_if_unused(s, handle);
  return CUDA_SUCCESS;
}

CUresult fake_cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                       unsigned long long flags) {
  FAKE_DRIVER_ENTRY("cuMemMap");
  const auto a = static_cast<Address>(ptr);
  const std::string range = "[" + hex(a) + ", +" + std::to_string(size) + ")";
  auto h = s.handles.find(handle);
  if (h == s.handles.end() || h->second.released) {
    violate(s, "cuMemMap of handle " + std::to_string(handle) + " which is not a live cuMemCreate handle");
    return CUDA_ERROR_INVALID_HANDLE;
  }
  if (flags != 0 || size == 0 || !aligned(s, a) || size % s.config.granularity != 0 ||
      offset % s.config.granularity != 0 || offset + size > h->second.bytes) {
    violate(s, "cuMemMap of " + range + " at offset " + std::to_string(offset) +
                   ": address, size and offset must be granularity-aligned and inside the allocation");
    return CUDA_ERROR_INVALID_VALUE;
  }
  // "offset - Offset into the memory represented by handle from which to
  // start mapping. Note: currently must be zero." (cuMemMap, cuda.h); an
  // H200's driver refused an offset with CUDA_ERROR_NOT_SUPPORTED, device and
  // host allocations alike (benchmarks/results/allocator-nvidia-h200-*.json).
  // That run refused even a first page-sized piece at offset 0, which the
  // documentation does not say; the fake maps that one.
  // Refused and not counted as a violation: the driver probe
  // (CudaBackend::probe_vmm_costs) asks on purpose, to learn whether a page
  // can be mapped from part of a larger allocation.
  if (offset != 0) return CUDA_ERROR_NOT_SUPPORTED;
  if (reservation_holding(s, a, size) == nullptr) {
    violate(s, "cuMemMap of " + range + " outside any single reserved range");
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (any_mapping_overlaps(s, a, size)) {
    violate(s, "cuMemMap of " + range + " over an existing mapping (double map)");
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (mmap(reinterpret_cast<void*>(a), size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->second.fd,
           static_cast<off_t>(offset)) == MAP_FAILED) {
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  s.mappings.emplace(a, Mapping{size, handle, 0});
  ++h->second.mappings;
  return CUDA_SUCCESS;
}

CUresult fake_cuMemUnmap(CUdeviceptr ptr, size_t size) {
  FAKE_DRIVER_ENTRY("cuMemUnmap");
  const auto a = static_cast<Address>(ptr);
  // The range must be made of whole mappings, the first starting at ptr.
  if (size == 0 || s.mappings.count(a) == 0 || !fully_mapped(s, a, size, false)) {
    violate(s, "cuMemUnmap of [" + hex(a) + ", +" + std::to_string(size) + ") which is not a mapped range");
    return CUDA_ERROR_INVALID_VALUE;
  }
  auto last = s.mappings.lower_bound(a + size);
  --last;
  if (last->first + last->second.bytes != a + size) {
    violate(s, "cuMemUnmap of [" + hex(a) + ", +" + std::to_string(size) + ") ends inside a mapping");
    return CUDA_ERROR_INVALID_VALUE;
  }
  wait_for_work_on(s, lock, a, size, "cuMemUnmap");
  remap_inaccessible(a, size);
  for (auto it = s.mappings.lower_bound(a); it != s.mappings.end() && it->first < a + size;) {
    const CUmemGenericAllocationHandle id = it->second.handle;
    it = s.mappings.erase(it);
    --s.handles.at(id).mappings;
    destroy_handle_if_unused(s, id);
  }
  return CUDA_SUCCESS;
}

CUresult fake_cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  FAKE_DRIVER_ENTRY("cuMemSetAccess");
  const auto a = static_cast<Address>(ptr);
  const std::string range = "[" + hex(a) + ", +" + std::to_string(size) + ")";
  if (size == 0 || !aligned(s, a) || size % s.config.granularity != 0 || !fully_mapped(s, a, size, false)) {
    violate(s, "cuMemSetAccess of " + range + " which is not a granularity-aligned, fully mapped range");
    return CUDA_ERROR_INVALID_VALUE;
  }
  for (std::size_t i = 0; i < count; ++i) {
    if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE || desc[i].location.id < 0 ||
        desc[i].location.id >= s.config.device_count) {
      violate(s, "cuMemSetAccess of " + range + " for a location that is not a device");
      return CUDA_ERROR_INVALID_DEVICE;
    }
  }
  // Each descriptor sets one device's access and leaves the others' alone.
  // The CPU stands in for every device: the range is readable and writable
  // while any device may access it.
  for (auto it = s.mappings.lower_bound(a); it != s.mappings.end() && it->first < a + size; ++it) {
    for (std::size_t i = 0; i < count; ++i) {
      const std::uint32_t bit = std::uint32_t{1} << desc[i].location.id;
      if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_NONE) it->second.devices &= ~bit;
      else it->second.devices |= bit;
    }
    mprotect(reinterpret_cast<void*>(it->first), it->second.bytes,
             it->second.accessible() ? PROT_READ | PROT_WRITE : PROT_NONE);
  }
  return CUDA_SUCCESS;
}

CUresult fake_cuMemHostAlloc(void** pp, size_t bytes, unsigned int /*flags*/) {
  FAKE_DRIVER_ENTRY("cuMemHostAlloc");
  if (!context_current(s, "cuMemHostAlloc")) return CUDA_ERROR_INVALID_CONTEXT;
  if (bytes == 0) {
    violate(s, "cuMemHostAlloc of 0 bytes");
    return CUDA_ERROR_INVALID_VALUE;
  }
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  const std::size_t rounded = (bytes + page - 1) / page * page;
  if (s.host_bytes + rounded > s.config.host_capacity) return CUDA_ERROR_OUT_OF_MEMORY;
  void* p = mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  s.pinned.emplace(reinterpret_cast<Address>(p), rounded);
  s.host_bytes += rounded;
  *pp = p;
  return CUDA_SUCCESS;
}

CUresult fake_cuMemHostGetDevicePointer(CUdeviceptr* dptr, void* p, unsigned int flags) {
  FAKE_DRIVER_ENTRY("cuMemHostGetDevicePointer");
  if (!context_current(s, "cuMemHostGetDevicePointer")) return CUDA_ERROR_INVALID_CONTEXT;
  const auto a = reinterpret_cast<Address>(p);
  auto it = s.pinned.upper_bound(a);
  if (flags != 0 || it == s.pinned.begin() || a >= std::prev(it)->first + std::prev(it)->second) {
    violate(s, "cuMemHostGetDevicePointer of " + hex(a) + " which is not in a cuMemHostAlloc allocation");
    return CUDA_ERROR_INVALID_VALUE;
  }
  *dptr = static_cast<CUdeviceptr>(a);  // unified addressing: the same address
  return CUDA_SUCCESS;
}

CUresult fake_cuMemFreeHost(void* p) {
  FAKE_DRIVER_ENTRY("cuMemFreeHost");
  if (!context_current(s, "cuMemFreeHost")) return CUDA_ERROR_INVALID_CONTEXT;
  auto it = s.pinned.find(reinterpret_cast<Address>(p));
  if (it == s.pinned.end()) {
    violate(s, "cuMemFreeHost of " + hex(reinterpret_cast<Address>(p)) + " which cuMemHostAlloc did not return");
    return CUDA_ERROR_INVALID_VALUE;
  }
  wait_for_work_on(s, lock, it->first, it->second, "cuMemFreeHost");
  munmap(p, it->second);
  s.host_bytes -= it->second;
  s.pinned.erase(it);
  return CUDA_SUCCESS;
}

// Entry points PyTorch's c10 looks up (c10/cuda/driver_api.h) that nothing
// here models: each counts a violation, so a run that reaches one fails.
CUresult not_modelled(const char* entry) {
  State& s = state();
  Lock lock(s.mutex);
  ++s.calls[entry];
  violate(s, std::string(entry) + " is not modelled by the fake CUDA driver");
  return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult fake_cuMemExportToShareableHandle(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                                           unsigned long long) {
  return not_modelled("cuMemExportToShareableHandle");
}
CUresult fake_cuMemImportFromShareableHandle(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType) {
  return not_modelled("cuMemImportFromShareableHandle");
}
CUresult fake_cuMemRetainAllocationHandle(CUmemGenericAllocationHandle*, void*) {
  return not_modelled("cuMemRetainAllocationHandle");
}
CUresult fake_cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp*, CUmemGenericAllocationHandle) {
  return not_modelled("cuMemGetAllocationPropertiesFromHandle");
}
CUresult fake_cuMemsetD32Async(CUdeviceptr, unsigned int, size_t, CUstream) { return not_modelled("cuMemsetD32Async"); }
CUresult fake_cuStreamWriteValue32(CUstream, CUdeviceptr, cuuint32_t, unsigned int) {
  return not_modelled("cuStreamWriteValue32");
}

#undef FAKE_DRIVER_ENTRY

const std::map<std::string, void*>& driver_entry_points() {
  static const std::map<std::string, void*> table = {
      {"cuGetErrorString", reinterpret_cast<void*>(&fake_cuGetErrorString)},
      {"cuGetErrorName", reinterpret_cast<void*>(&fake_cuGetErrorName)},
      {"cuDeviceGet", reinterpret_cast<void*>(&fake_cuDeviceGet)},
      {"cuDeviceGetAttribute", reinterpret_cast<void*>(&fake_cuDeviceGetAttribute)},
      {"cuDevicePrimaryCtxRetain", reinterpret_cast<void*>(&fake_cuDevicePrimaryCtxRetain)},
      {"cuDevicePrimaryCtxRelease", reinterpret_cast<void*>(&fake_cuDevicePrimaryCtxRelease)},
      {"cuCtxGetCurrent", reinterpret_cast<void*>(&fake_cuCtxGetCurrent)},
      {"cuCtxSetCurrent", reinterpret_cast<void*>(&fake_cuCtxSetCurrent)},
      {"cuMemGetAllocationGranularity", reinterpret_cast<void*>(&fake_cuMemGetAllocationGranularity)},
      {"cuMemAddressReserve", reinterpret_cast<void*>(&fake_cuMemAddressReserve)},
      {"cuMemAddressFree", reinterpret_cast<void*>(&fake_cuMemAddressFree)},
      {"cuMemCreate", reinterpret_cast<void*>(&fake_cuMemCreate)},
      {"cuMemRelease", reinterpret_cast<void*>(&fake_cuMemRelease)},
      {"cuMemMap", reinterpret_cast<void*>(&fake_cuMemMap)},
      {"cuMemUnmap", reinterpret_cast<void*>(&fake_cuMemUnmap)},
      {"cuMemSetAccess", reinterpret_cast<void*>(&fake_cuMemSetAccess)},
      {"cuMemHostAlloc", reinterpret_cast<void*>(&fake_cuMemHostAlloc)},
      {"cuMemHostGetDevicePointer", reinterpret_cast<void*>(&fake_cuMemHostGetDevicePointer)},
      {"cuMemFreeHost", reinterpret_cast<void*>(&fake_cuMemFreeHost)},
      {"cuMemExportToShareableHandle", reinterpret_cast<void*>(&fake_cuMemExportToShareableHandle)},
      {"cuMemImportFromShareableHandle", reinterpret_cast<void*>(&fake_cuMemImportFromShareableHandle)},
      {"cuMemRetainAllocationHandle", reinterpret_cast<void*>(&fake_cuMemRetainAllocationHandle)},
      {"cuMemGetAllocationPropertiesFromHandle",
       reinterpret_cast<void*>(&fake_cuMemGetAllocationPropertiesFromHandle)},
      {"cuMemsetD32Async", reinterpret_cast<void*>(&fake_cuMemsetD32Async)},
      {"cuStreamWriteValue32", reinterpret_cast<void*>(&fake_cuStreamWriteValue32)},
  };
  return table;
}

// Releases what a previous test left behind (the mutex is held).
void forget_memory(State& s) {
  for (const auto& [a, m] : s.mappings) remap_inaccessible(a, m.bytes);
  s.mappings.clear();
  for (const auto& [id, h] : s.handles) close(h.fd);
  s.handles.clear();
  for (const auto& [a, bytes] : s.reservations) give_back(s, a, bytes);
  s.reservations.clear();
  for (const auto& [a, bytes] : s.pinned) munmap(reinterpret_cast<void*>(a), bytes);
  s.pinned.clear();
  for (const auto& [a, bytes] : s.malloced) {
    remap_inaccessible(a, bytes);
    give_back(s, a, bytes);
  }
  s.malloced.clear();
  s.device_bytes = 0;
  s.host_bytes = 0;
  for (Event* e : s.events) delete e;
  s.events.clear();
}

}  // namespace

// ---- control API -------------------------------------------------------------------

void reset(const Config& config) {
  State& s = state();
  std::set<Stream*> leftover;
  {
    Lock lock(s.mutex);
    drain_all(s, lock);
    leftover.swap(s.streams);
  }
  for (Stream* stream : leftover) stop_stream(stream);
  Lock lock(s.mutex);
  forget_memory(s);
  s.config = config;
  s.calls.clear();
  s.device_bytes_created = 0;
  s.failures.clear();
  s.violations = Violations{};
  s.delay = std::chrono::microseconds{0};
  s.operations_completed = 0;
  s.held = false;
  s.primary_contexts = 0;
  for (int& retains : s.primary_retains) retains = 0;
  current_device = 0;
  current_context = -1;
  last_error = cudaSuccess;
}

Violations violations() {
  Lock lock(state().mutex);
  return state().violations;
}

Leaks leaks() {
  State& s = state();
  Lock lock(s.mutex);
  Leaks out;
  out.mappings = s.mappings.size();
  for (const auto& [id, h] : s.handles) out.handles += h.released ? 0 : 1;
  out.reservations = s.reservations.size();
  out.pinned_host = s.pinned.size();
  out.device_allocations = s.malloced.size();
  out.streams = s.streams.size();
  out.events = s.events.size();
  return out;
}

std::string Leaks::describe() const {
  return std::to_string(mappings) + " mappings, " + std::to_string(handles) + " handles, " +
         std::to_string(reservations) + " reservations, " + std::to_string(pinned_host) + " pinned host, " +
         std::to_string(device_allocations) + " cudaMalloc allocations, " +
         std::to_string(streams) + " streams, " + std::to_string(events) + " events";
}

void set_delay(std::chrono::microseconds per_operation) {
  Lock lock(state().mutex);
  state().delay = per_operation;
}

void hold_streams() {
  Lock lock(state().mutex);
  state().held = true;
}

void fail_nth(const std::string& entry, int n, int code) {
  Lock lock(state().mutex);
  state().failures[entry] = Failure{n, code};
}

std::uint64_t calls(const std::string& entry) {
  Lock lock(state().mutex);
  auto it = state().calls.find(entry);
  return it == state().calls.end() ? 0 : it->second;
}

std::map<std::string, std::uint64_t> all_calls() {
  Lock lock(state().mutex);
  return state().calls;
}

bool device_can_access(int device, const void* p, std::size_t bytes) {
  State& s = state();
  Lock lock(s.mutex);
  const auto a = reinterpret_cast<Address>(p);
  if (!fully_mapped(s, a, bytes, false)) return false;
  for (auto it = std::prev(s.mappings.upper_bound(a)); it != s.mappings.end() && it->first < a + bytes; ++it) {
    if ((it->second.devices & (std::uint32_t{1} << device)) == 0) return false;
  }
  return true;
}

bool primary_context_initialized(int device) {
  Lock lock(state().mutex);
  return device >= 0 && device < 32 && (state().primary_contexts & (std::uint32_t{1} << device)) != 0;
}

bool accessible(const void* p, std::size_t bytes) {
  Lock lock(state().mutex);
  return copy_range_ok(state(), p, bytes);
}

std::size_t device_bytes_in_use() {
  Lock lock(state().mutex);
  return state().device_bytes;
}

std::uint64_t device_bytes_created() {
  Lock lock(state().mutex);
  return state().device_bytes_created;
}

std::size_t host_bytes_in_use() {
  Lock lock(state().mutex);
  return state().host_bytes;
}

std::uint64_t operations_completed() {
  Lock lock(state().mutex);
  return state().operations_completed;
}

}  // namespace fake_cuda

// ---- runtime entry points -------------------------------------------------------------

using fake_cuda::Lock;
using fake_cuda::state;

namespace {

cudaError_t fail(cudaError_t err) {
  fake_cuda::last_error = err;
  return err;
}

}  // namespace

#define FAKE_RUNTIME_ENTRY(name)                     \
  fake_cuda::State& s = state();                     \
  Lock lock(s.mutex);                                \
  if (int code = 0; fake_cuda::injected(s, name, &code)) return fail(static_cast<cudaError_t>(code))

// An entry that acts in a context: binds the thread's device's primary
// context first when none is current (bind_runtime_context).
#define FAKE_RUNTIME_CONTEXT_ENTRY(name) \
  FAKE_RUNTIME_ENTRY(name);              \
  fake_cuda::bind_runtime_context(s)

cudaError_t cudaGetDeviceCount(int* count) {
  FAKE_RUNTIME_ENTRY("cudaGetDeviceCount");
  *count = s.config.device_count;
  return s.config.device_count > 0 ? cudaSuccess : fail(cudaErrorNoDevice);
}

cudaError_t cudaSetDevice(int device) {
  FAKE_RUNTIME_ENTRY("cudaSetDevice");
  if (device < 0 || device >= s.config.device_count) return fail(cudaErrorInvalidDevice);
  // "This call will bind the primary context of the specified device to the
  // calling thread ... This function will also immediately initialize the
  // runtime state on the primary context" (cudaSetDevice, CUDA 12 and later).
  fake_cuda::current_device = device;
  fake_cuda::current_context = device;
  s.primary_contexts |= std::uint32_t{1} << device;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  FAKE_RUNTIME_ENTRY("cudaGetDevice");
  // The current context's device; binds none.
  *device = fake_cuda::current_context >= 0 ? fake_cuda::current_context : fake_cuda::current_device;
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  FAKE_RUNTIME_CONTEXT_ENTRY("cudaFree");
  if (ptr == nullptr) return cudaSuccess;  // creates the context
  const auto a = reinterpret_cast<fake_cuda::Address>(ptr);
  auto it = s.malloced.find(a);
  if (it == s.malloced.end()) {
    fake_cuda::violate(s, "cudaFree of a pointer cudaMalloc did not return");
    return fail(cudaErrorInvalidValue);
  }
  fake_cuda::drain_all(s, lock);  // cudaFree synchronizes the device
  const std::size_t bytes = it->second;
  s.malloced.erase(it);
  fake_cuda::remap_inaccessible(a, bytes);
  fake_cuda::give_back(s, a, bytes);
  s.device_bytes -= bytes;
  return cudaSuccess;
}

// Device memory in one piece: the range is carved from the device's address
// space and made readable and writable at once; its bytes count against the
// device's capacity, rounded up to the granularity.
cudaError_t cudaMalloc(void** ptr, size_t size) {
  FAKE_RUNTIME_CONTEXT_ENTRY("cudaMalloc");
  *ptr = nullptr;
  if (size == 0) return cudaSuccess;
  const std::size_t g = s.config.granularity;
  const std::size_t bytes = (size + g - 1) / g * g;
  if (s.device_bytes + bytes > s.config.device_capacity) return fail(cudaErrorMemoryAllocation);
  const fake_cuda::Address a = fake_cuda::carve(s, bytes, g);
  if (a == 0) return fail(cudaErrorMemoryAllocation);
  mmap(reinterpret_cast<void*>(a), bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
       -1, 0);
  s.malloced.emplace(a, bytes);
  s.device_bytes += bytes;
  s.device_bytes_created += bytes;
  *ptr = reinterpret_cast<void*>(a);
  return cudaSuccess;
}

cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** funcPtr, unsigned int /*cudaVersion*/,
                                             unsigned long long /*flags*/,
                                             cudaDriverEntryPointQueryResult* driverStatus) {
  FAKE_RUNTIME_ENTRY("cudaGetDriverEntryPointByVersion");
  const auto& table = fake_cuda::driver_entry_points();
  auto it = table.find(symbol);
  *funcPtr = it == table.end() ? nullptr : it->second;
  if (driverStatus != nullptr) {
    *driverStatus = it == table.end() ? cudaDriverEntryPointSymbolNotFound : cudaDriverEntryPointSuccess;
  }
  return cudaSuccess;
}

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorNotSupported: return "operation not supported";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorCudartUnloading: return "driver shutting down";
    default: return "unrecognized error code";
  }
}

const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorCudartUnloading: return "cudaErrorCudartUnloading";
    default: return "cudaErrorUnknown";
  }
}

cudaError_t cudaGetLastError() {
  const cudaError_t err = fake_cuda::last_error;
  fake_cuda::last_error = cudaSuccess;
  return err;
}

cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
  FAKE_RUNTIME_CONTEXT_ENTRY("cudaMemGetInfo");
  *total = s.config.device_capacity;
  *free = s.config.device_capacity - s.device_bytes;
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int /*flags*/) {
  FAKE_RUNTIME_CONTEXT_ENTRY("cudaEventCreateWithFlags");
  auto* e = new fake_cuda::Event;
  s.events.insert(e);
  *event = reinterpret_cast<cudaEvent_t>(e);
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, 0); }

// Finds a live event, counting a violation for anything else.
static fake_cuda::Event* find_event(fake_cuda::State& s, cudaEvent_t event, const char* entry) {
  auto* e = reinterpret_cast<fake_cuda::Event*>(event);
  if (s.events.count(e) != 0) return e;
  fake_cuda::violate(s, std::string(entry) + " of an event that does not exist (destroyed or never created)");
  return nullptr;
}

// Finds a stream (null: the default stream), counting a violation for one
// that does not exist; `what` begins the message ("cudaMemcpyAsync on").
static fake_cuda::Stream* find_live_stream(fake_cuda::State& s, cudaStream_t stream, const char* what) {
  fake_cuda::Stream* target = fake_cuda::find_stream(s, stream);
  if (target == nullptr) fake_cuda::violate(s, std::string(what) + " a stream that does not exist");
  return target;
}

// Waits, on the host, until `e` completes or is destroyed.
static void wait_for_event(fake_cuda::State& s, fake_cuda::Lock& lock, fake_cuda::Event* e) {
  fake_cuda::release_hold(s);
  s.progress.wait(lock, [&] { return s.events.count(e) == 0 || fake_cuda::event_complete(*e); });
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  FAKE_RUNTIME_CONTEXT_ENTRY("cudaEventDestroy");
  fake_cuda::Event* e = find_event(s, event, "cudaEventDestroy");
  if (e == nullptr) return fail(cudaErrorInvalidResourceHandle);
  s.events.erase(e);  // legal with work pending: the event is released when it completes
  delete e;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  FAKE_RUNTIME_CONTEXT_ENTRY("cudaEventRecord");
  fake_cuda::Event* e = find_event(s, event, "cudaEventRecord");
  if (e == nullptr) return fail(cudaErrorInvalidResourceHandle);
  fake_cuda::Stream* target = find_live_stream(s, stream, "cudaEventRecord on");
  if (target == nullptr) return fail(cudaErrorInvalidResourceHandle);
  e->stream = target;
  e->after = target->submitted;
  return cudaSuccess;
}

// PyTorch records its events this way (torch.cuda.Event.record). With the
// default flag it is cudaEventRecord; cudaEventRecordExternal belongs to
// graph capture, which the fake does not model.
cudaError_t cudaEventRecordWithFlags(cudaEvent_t event, cudaStream_t stream, unsigned int flags) {
  if (flags != cudaEventRecordDefault) {
    FAKE_RUNTIME_ENTRY("cudaEventRecordWithFlags");
    fake_cuda::violate(s, "cudaEventRecordWithFlags with flags " + std::to_string(flags) +
                              " (only cudaEventRecordDefault is modelled)");
    return fail(cudaErrorNotSupported);
  }
  return cudaEventRecord(event, stream);
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  FAKE_RUNTIME_CONTEXT_ENTRY("cudaEventQuery");
  fake_cuda::Event* e = find_event(s, event, "cudaEventQuery");
  if (e == nullptr) return fail(cudaErrorInvalidResourceHandle);
  return fake_cuda::event_complete(*e) ? cudaSuccess : fail(cudaErrorNotReady);
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  FAKE_RUNTIME_CONTEXT_ENTRY("cudaEventSynchronize");
  fake_cuda::Event* e = find_event(s, event, "cudaEventSynchronize");
  if (e == nullptr) return fail(cudaErrorInvalidResourceHandle);
  wait_for_event(s, lock, e);
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int /*flags*/) {
  fake_cuda::Stream* created = nullptr;
  {
    FAKE_RUNTIME_CONTEXT_ENTRY("cudaStreamCreateWithFlags");
    created = fake_cuda::start_stream();
    s.streams.insert(created);
  }
  *stream = reinterpret_cast<cudaStream_t>(created);
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) { return cudaStreamCreateWithFlags(stream, 0); }

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  auto* target = reinterpret_cast<fake_cuda::Stream*>(stream);
  {
    FAKE_RUNTIME_CONTEXT_ENTRY("cudaStreamDestroy");
    if (s.streams.count(target) == 0) {
      fake_cuda::violate(s, "cudaStreamDestroy of a stream that does not exist (or the default stream)");
      return fail(cudaErrorInvalidResourceHandle);
    }
    s.streams.erase(target);  // queued work still runs: stop_stream drains it
  }
  fake_cuda::stop_stream(target);
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  FAKE_RUNTIME_CONTEXT_ENTRY("cudaStreamSynchronize");
  fake_cuda::Stream* target = find_live_stream(s, stream, "cudaStreamSynchronize of");
  if (target == nullptr) return fail(cudaErrorInvalidResourceHandle);
  fake_cuda::drain(s, lock, target);
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize() {
  FAKE_RUNTIME_CONTEXT_ENTRY("cudaDeviceSynchronize");
  fake_cuda::drain_all(s, lock);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind /*kind*/,
                            cudaStream_t stream) {
  FAKE_RUNTIME_CONTEXT_ENTRY("cudaMemcpyAsync");
  fake_cuda::Stream* target = find_live_stream(s, stream, "cudaMemcpyAsync on");
  if (target == nullptr) return fail(cudaErrorInvalidResourceHandle);
  if (!fake_cuda::copy_range_ok(s, src, count) || !fake_cuda::copy_range_ok(s, dst, count)) {
    // On a GPU the copy would fault on the device and poison the context.
    fake_cuda::violate(s, "cudaMemcpyAsync of " + std::to_string(count) +
                              " bytes touching reserved memory that is not mapped and accessible");
    return fail(cudaErrorIllegalAddress);
  }
  target->queue.push_back(fake_cuda::Copy{dst, src, count});
  ++target->submitted;
  target->work.notify_all();
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* dst, int value, size_t count, cudaStream_t stream) {
  FAKE_RUNTIME_CONTEXT_ENTRY("cudaMemsetAsync");
  fake_cuda::Stream* target = find_live_stream(s, stream, "cudaMemsetAsync on");
  if (target == nullptr) return fail(cudaErrorInvalidResourceHandle);
  if (!fake_cuda::copy_range_ok(s, dst, count)) {
    fake_cuda::violate(s, "cudaMemsetAsync of " + std::to_string(count) +
                              " bytes touching reserved memory that is not mapped and accessible");
    return fail(cudaErrorIllegalAddress);
  }
  target->queue.push_back(fake_cuda::Copy{dst, nullptr, count, value});
  ++target->submitted;
  target->work.notify_all();
  return cudaSuccess;
}

// ---- what PyTorch's c10 (libc10_cuda) links beyond the above ------------------------
// Queries answer for one device of this fake; a call nothing here models
// counts a violation and fails, so a run that needs it cannot pass unseen.

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  FAKE_RUNTIME_ENTRY("cudaGetDeviceProperties");
  if (device < 0 || device >= s.config.device_count) return fail(cudaErrorInvalidDevice);
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof prop->name, "fake CUDA device (cotenant tests)");
  prop->totalGlobalMem = s.config.device_capacity;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 132;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->textureAlignment = 512;
  return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int* driverVersion) {
  FAKE_RUNTIME_ENTRY("cudaDriverGetVersion");
  *driverVersion = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetStreamPriorityRange(int* leastPriority, int* greatestPriority) {
  FAKE_RUNTIME_ENTRY("cudaDeviceGetStreamPriorityRange");
  if (leastPriority != nullptr) *leastPriority = 0;
  if (greatestPriority != nullptr) *greatestPriority = -5;
  return cudaSuccess;
}

cudaError_t cudaDeviceCanAccessPeer(int* canAccessPeer, int device, int peerDevice) {
  FAKE_RUNTIME_ENTRY("cudaDeviceCanAccessPeer");
  const int n = s.config.device_count;
  if (device < 0 || device >= n || peerDevice < 0 || peerDevice >= n) return fail(cudaErrorInvalidDevice);
  *canAccessPeer = 0;  // peer access through the runtime is not modelled
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithPriority(cudaStream_t* stream, unsigned int flags, int /*priority*/) {
  return cudaStreamCreateWithFlags(stream, flags);
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  FAKE_RUNTIME_CONTEXT_ENTRY("cudaStreamQuery");
  fake_cuda::Stream* target = find_live_stream(s, stream, "cudaStreamQuery of");
  if (target == nullptr) return fail(cudaErrorInvalidResourceHandle);
  return target->queue.empty() ? cudaSuccess : fail(cudaErrorNotReady);
}

// The fake's streams run on their own threads, so the stream's later work
// waiting for the event is modelled by waiting here, on the host: an order a
// GPU may also take.
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int /*flags*/) {
  FAKE_RUNTIME_CONTEXT_ENTRY("cudaStreamWaitEvent");
  if (find_live_stream(s, stream, "cudaStreamWaitEvent on") == nullptr) return fail(cudaErrorInvalidResourceHandle);
  fake_cuda::Event* e = find_event(s, event, "cudaStreamWaitEvent");
  if (e == nullptr) return fail(cudaErrorInvalidResourceHandle);
  wait_for_event(s, lock, e);
  return cudaSuccess;
}

// Stream capture is not modelled: no stream is ever capturing.
cudaError_t cudaStreamIsCapturing(cudaStream_t /*stream*/, cudaStreamCaptureStatus* status) {
  FAKE_RUNTIME_ENTRY("cudaStreamIsCapturing");
  *status = cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

cudaError_t cudaStreamGetCaptureInfo(cudaStream_t /*stream*/, cudaStreamCaptureStatus* status,
                                     unsigned long long* id, cudaGraph_t* graph,
                                     const cudaGraphNode_t** dependencies, const cudaGraphEdgeData** edgeData,
                                     size_t* numDependencies) {
  FAKE_RUNTIME_ENTRY("cudaStreamGetCaptureInfo");
  *status = cudaStreamCaptureStatusNone;
  if (id != nullptr) *id = 0;
  if (graph != nullptr) *graph = nullptr;
  if (dependencies != nullptr) *dependencies = nullptr;
  if (edgeData != nullptr) *edgeData = nullptr;
  if (numDependencies != nullptr) *numDependencies = 0;
  return cudaSuccess;
}

cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* /*mode*/) {
  FAKE_RUNTIME_ENTRY("cudaThreadExchangeStreamCaptureMode");
  return cudaSuccess;
}

// Synchronous: waits for every stream (the legacy default stream's rule), then copies.
cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind /*kind*/) {
  FAKE_RUNTIME_CONTEXT_ENTRY("cudaMemcpy");
  fake_cuda::drain_all(s, lock);
  if (!fake_cuda::copy_range_ok(s, src, count) || !fake_cuda::copy_range_ok(s, dst, count)) {
    fake_cuda::violate(s, "cudaMemcpy of " + std::to_string(count) +
                              " bytes touching reserved memory that is not mapped and accessible");
    return fail(cudaErrorIllegalAddress);
  }
  std::memcpy(dst, src, count);
  return cudaSuccess;
}

#define FAKE_RUNTIME_NOT_MODELLED(name, params)                                   \
  cudaError_t name params {                                                      \
    FAKE_RUNTIME_ENTRY(#name);                                                   \
    fake_cuda::violate(s, #name " is not modelled by the fake CUDA runtime");   \
    return fail(cudaErrorNotSupported);                                          \
  }

FAKE_RUNTIME_NOT_MODELLED(cudaDeviceEnablePeerAccess, (int, unsigned int))
FAKE_RUNTIME_NOT_MODELLED(cudaDeviceGetDefaultMemPool, (cudaMemPool_t*, int))
FAKE_RUNTIME_NOT_MODELLED(cudaEventElapsedTime, (float*, cudaEvent_t, cudaEvent_t))
FAKE_RUNTIME_NOT_MODELLED(cudaMallocAsync, (void**, size_t, cudaStream_t))
FAKE_RUNTIME_NOT_MODELLED(cudaFreeAsync, (void*, cudaStream_t))
FAKE_RUNTIME_NOT_MODELLED(cudaMemPoolGetAttribute, (cudaMemPool_t, cudaMemPoolAttr, void*))
FAKE_RUNTIME_NOT_MODELLED(cudaMemPoolSetAttribute, (cudaMemPool_t, cudaMemPoolAttr, void*))
FAKE_RUNTIME_NOT_MODELLED(cudaMemPoolSetAccess, (cudaMemPool_t, const cudaMemAccessDesc*, size_t))
FAKE_RUNTIME_NOT_MODELLED(cudaMemPoolTrimTo, (cudaMemPool_t, size_t))
FAKE_RUNTIME_NOT_MODELLED(cudaGraphNodeGetDependencies,
                          (cudaGraphNode_t, cudaGraphNode_t*, cudaGraphEdgeData*, size_t*))
FAKE_RUNTIME_NOT_MODELLED(cudaIpcGetMemHandle, (cudaIpcMemHandle_t*, void*))
FAKE_RUNTIME_NOT_MODELLED(cudaIpcOpenMemHandle, (void**, cudaIpcMemHandle_t, unsigned int))
FAKE_RUNTIME_NOT_MODELLED(cudaIpcCloseMemHandle, (void*))
FAKE_RUNTIME_NOT_MODELLED(cudaMemcpyPeerAsync, (void*, int, const void*, int, size_t, cudaStream_t))

// ---- what the rest of the torch wheel (libtorch_cuda and friends) links -------------
// Loading a CUDA library registers its kernels; the fake holds no code, so
// registration succeeds and keeps nothing, and a launch fails as a violation.
// With these, `import torch` over the fake runs, and PyTorch's allocator can be
// driven from Python (torch.empty on a CUDA device launches no kernel).
FAKE_RUNTIME_NOT_MODELLED(cudaDeviceGetAttribute, (int*, cudaDeviceAttr, int))
FAKE_RUNTIME_NOT_MODELLED(cudaDeviceGetPCIBusId, (char*, int, int))
FAKE_RUNTIME_NOT_MODELLED(cudaFreeHost, (void*))
FAKE_RUNTIME_NOT_MODELLED(cudaFuncGetAttributes, (cudaFuncAttributes*, const void*))
FAKE_RUNTIME_NOT_MODELLED(cudaFuncSetAttribute, (const void*, cudaFuncAttribute, int))
FAKE_RUNTIME_NOT_MODELLED(cudaGetSymbolAddress, (void**, const void*))
FAKE_RUNTIME_NOT_MODELLED(cudaGraphDebugDotPrint, (cudaGraph_t, const char*, unsigned int))
FAKE_RUNTIME_NOT_MODELLED(cudaGraphDestroy, (cudaGraph_t))
FAKE_RUNTIME_NOT_MODELLED(cudaGraphExecDestroy, (cudaGraphExec_t))
FAKE_RUNTIME_NOT_MODELLED(cudaGraphGetNodes, (cudaGraph_t, cudaGraphNode_t*, size_t*))
FAKE_RUNTIME_NOT_MODELLED(cudaGraphInstantiateWithFlags, (cudaGraphExec_t*, cudaGraph_t, unsigned long long))
FAKE_RUNTIME_NOT_MODELLED(cudaGraphLaunch, (cudaGraphExec_t, cudaStream_t))
FAKE_RUNTIME_NOT_MODELLED(cudaHostAlloc, (void**, size_t, unsigned int))
FAKE_RUNTIME_NOT_MODELLED(cudaHostRegister, (void*, size_t, unsigned int))
FAKE_RUNTIME_NOT_MODELLED(cudaHostUnregister, (void*))
FAKE_RUNTIME_NOT_MODELLED(cudaIpcGetEventHandle, (cudaIpcEventHandle_t*, cudaEvent_t))
FAKE_RUNTIME_NOT_MODELLED(cudaIpcOpenEventHandle, (cudaEvent_t*, cudaIpcEventHandle_t))
FAKE_RUNTIME_NOT_MODELLED(cudaLaunchCooperativeKernel, (const void*, dim3, dim3, void**, size_t, cudaStream_t))
FAKE_RUNTIME_NOT_MODELLED(cudaLaunchHostFunc, (cudaStream_t, cudaHostFn_t, void*))
FAKE_RUNTIME_NOT_MODELLED(cudaLaunchKernel, (const void*, dim3, dim3, void**, size_t, cudaStream_t))
FAKE_RUNTIME_NOT_MODELLED(cudaLaunchKernelExC, (const cudaLaunchConfig_t*, const void*, void**))
FAKE_RUNTIME_NOT_MODELLED(cudaMemcpy2DAsync,
                          (void*, size_t, const void*, size_t, size_t, size_t, cudaMemcpyKind, cudaStream_t))
FAKE_RUNTIME_NOT_MODELLED(cudaMemcpyToSymbol, (const void*, const void*, size_t, size_t, cudaMemcpyKind))
FAKE_RUNTIME_NOT_MODELLED(cudaMemset, (void*, int, size_t))
FAKE_RUNTIME_NOT_MODELLED(cudaOccupancyMaxActiveBlocksPerMultiprocessor, (int*, const void*, int, size_t))
FAKE_RUNTIME_NOT_MODELLED(cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags,
                          (int*, const void*, int, size_t, unsigned int))
FAKE_RUNTIME_NOT_MODELLED(cudaPointerGetAttributes, (cudaPointerAttributes*, const void*))
FAKE_RUNTIME_NOT_MODELLED(cudaProfilerStart, ())
FAKE_RUNTIME_NOT_MODELLED(cudaProfilerStop, ())
FAKE_RUNTIME_NOT_MODELLED(cudaStreamAddCallback, (cudaStream_t, cudaStreamCallback_t, void*, unsigned int))
FAKE_RUNTIME_NOT_MODELLED(cudaStreamBeginCapture, (cudaStream_t, cudaStreamCaptureMode))
FAKE_RUNTIME_NOT_MODELLED(cudaStreamEndCapture, (cudaStream_t, cudaGraph_t*))

cudaError_t cudaRuntimeGetVersion(int* runtimeVersion) {
  FAKE_RUNTIME_ENTRY("cudaRuntimeGetVersion");
  *runtimeVersion = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaPeekAtLastError() { return fake_cuda::last_error; }

cudaError_t cudaStreamGetPriority(cudaStream_t stream, int* priority) {
  FAKE_RUNTIME_ENTRY("cudaStreamGetPriority");
  if (find_live_stream(s, stream, "cudaStreamGetPriority of") == nullptr) return fail(cudaErrorInvalidResourceHandle);
  *priority = 0;  // priorities are not modelled: every stream has the lowest
  return cudaSuccess;
}

// The registration entry points nvcc's host code calls while a library loads
// (declared in crt/host_runtime.h and crt/device_functions.h, which the fake
// does not include). They run before main, so they touch no fake state.
extern "C" {
void** __cudaRegisterFatBinary(void* /*fatCubin*/) {
  static void* handle = nullptr;
  return &handle;
}
void __cudaRegisterFatBinaryEnd(void** /*handle*/) {}
void __cudaUnregisterFatBinary(void** /*handle*/) {}
void __cudaRegisterVar(void** /*handle*/, char* /*hostVar*/, char* /*deviceAddress*/, const char* /*deviceName*/,
                       int /*ext*/, size_t /*size*/, int /*constant*/, int /*global*/) {}
void __cudaRegisterFunction(void** /*handle*/, const char* /*hostFun*/, char* /*deviceFun*/,
                            const char* /*deviceName*/, int /*threadLimit*/, uint3* /*tid*/, uint3* /*bid*/,
                            dim3* /*bDim*/, dim3* /*gDim*/, int* /*wSize*/) {}
char __cudaInitModule(void** /*handle*/) { return 1; }
unsigned __cudaPushCallConfiguration(dim3 /*gridDim*/, dim3 /*blockDim*/, size_t /*sharedMem*/, void* /*stream*/) {
  return 0;
}
FAKE_RUNTIME_NOT_MODELLED(__cudaPopCallConfiguration, (dim3*, dim3*, size_t*, void*))
FAKE_RUNTIME_NOT_MODELLED(__cudaGetKernel, (cudaKernel_t*, const void*))
FAKE_RUNTIME_NOT_MODELLED(__cudaLaunchKernel, (cudaKernel_t, dim3, dim3, void**, size_t, cudaStream_t))
}  // extern "C"

#undef FAKE_RUNTIME_NOT_MODELLED
#undef FAKE_RUNTIME_ENTRY

// ---- driver entry points torch looks up by name ------------------------------------
// PyTorch's lazy driver stubs (ATen's LazyNVRTC) dlopen libcuda.so.1 and look
// each entry up with dlsym on first use, and `cotenant run` asks the driver
// whether it sees the GPU before it starts a job; with a link libcuda.so.1 ->
// this library on the search path, they find these.

CUresult cuInit(unsigned int flags) { return fake_cuda::fake_cuInit(flags); }
CUresult cuDeviceGetCount(int* count) { return fake_cuda::fake_cuDeviceGetCount(count); }
CUresult cuGetErrorName(CUresult error, const char** str) { return fake_cuda::fake_cuGetErrorName(error, str); }
CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int* flags, int* active) {
  return fake_cuda::fake_cuDevicePrimaryCtxGetState(dev, flags, active);
}
