// Test control for the fake CUDA runtime (fake_cuda.cpp).
//
// The fake defines the CUDA runtime entry points that csrc/cuda uses, and
// hands out fake driver functions through cudaGetDriverEntryPointByVersion,
// so that the real CudaBackend runs on the CPU. Its "device memory" is host
// memory with the driver's rules made physical:
//  - an address reservation is PROT_NONE memory (carved in ascending order
//    from one arena, as the driver hands out addresses): touching it faults;
//  - a physical page (cuMemCreate) is a memfd of the granularity size;
//  - cuMemMap maps the memfd at the address (from its start: an offset into
//    the allocation is refused, uncounted), still PROT_NONE; cuMemSetAccess
//    makes it readable and writable; cuMemUnmap puts PROT_NONE memory back.
//  - each thread has a current context, or none: cudaSetDevice binds (and
//    initializes) its device's primary context, a runtime call that needs a
//    context binds the thread's device's when none is current, cuCtxSetCurrent
//    binds or unbinds one; cuMemHostAlloc, cuMemHostGetDevicePointer and
//    cuMemFreeHost refuse to run without one (the virtual memory calls need none);
//  - every stream (and the default stream) is a worker thread; cudaMemcpyAsync
//    (cudaMemsetAsync) runs memcpy (memset) there, events complete when the worker reaches them.
//
// A misuse the real driver refuses returns the driver's error code and is
// counted as a violation (never a crash); tests assert the count is zero.
// Unmapping, freeing or releasing memory that queued or running copies still
// touch is counted too (the fake then waits for those copies, so the test
// does not fault).
//
// cudaMalloc memory is a range of the same address space made readable and
// writable at once, counted against the device's capacity; cudaFree waits
// for every stream first, as the runtime does. The rest of what PyTorch's
// libc10_cuda links (benchmarks/pytorch_allocator) is answered for one
// device with no peer access and no stream capture; a call nothing here
// models (IPC, memory pools, cudaMallocAsync, ...) counts a violation.
// Built as the wheel's libcudart.so.N (benchmarks/pytorch_allocator) and
// preloaded, it carries torch itself: the rest of the wheel's libraries
// register their kernels with it (registration keeps nothing), a kernel
// launch counts a violation, and the few driver entry points looked up by
// name in libcuda.so.1 (cuInit, cuDeviceGetCount, cuGetErrorName,
// cuDevicePrimaryCtxGetState) are exported under their own names.
//
// Not modelled: the legacy default stream's implicit synchronization with
// other blocking streams (each stream, the default one too, runs on its own),
// cudaMemcpyKind (every copy is a memcpy), event timing, and kernels (a test
// queues a cudaMemcpyAsync where a kernel would touch memory).
//
// Thread safety: every function here may be called from any thread.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fake_cuda {

struct Config {
  std::size_t device_capacity = std::size_t{1} << 30;  // bytes of device pages cuMemCreate may hold
  std::size_t host_capacity = SIZE_MAX;                 // bytes of host pages and pinned host memory
  std::size_t granularity = std::size_t{2} << 20;      // bytes; a multiple of the system page size
  int device_count = 1;  // at most 32
  bool vmm = true;            // CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
  bool host_vmm = true;       // CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
  bool host_numa_vmm = false; // CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
  int host_numa_id = 0;       // CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID
  // true: cuMemCreate fills a new page with 0xA5 bytes, since the driver
  // does not promise zeros; a test then sees whether the backend zeroed it.
  bool garbage_in_new_pages = false;
};

// Waits for every stream, then forgets all state (counters, violations,
// failure injections, delay) and takes `config`. Memory still held from an
// earlier test stays mapped (it is reported by leaks() before the reset).
void reset(const Config& config = Config{});

struct Violations {
  std::size_t count = 0;
  std::vector<std::string> messages;  // one sentence per violation, in order
};
Violations violations();

// What is still held: the driver would free it at process exit, but a correct
// CudaBackend + CachingAllocator returns all of it when destroyed.
struct Leaks {
  std::size_t mappings = 0;      // mapped ranges
  std::size_t handles = 0;       // cuMemCreate handles not released
  std::size_t reservations = 0;  // cuMemAddressReserve ranges not freed
  std::size_t pinned_host = 0;   // cuMemHostAlloc allocations not freed
  std::size_t device_allocations = 0;  // cudaMalloc allocations not freed
  std::size_t streams = 0;       // streams created and not destroyed
  std::size_t events = 0;        // events created and not destroyed
  bool any() const {
    return mappings + handles + reservations + pinned_host + device_allocations + streams + events != 0;
  }
  std::string describe() const;
};
Leaks leaks();

// Each queued operation (a copy) sleeps this long on its stream's worker
// before it runs, so that a missing synchronization leaves work in flight.
void set_delay(std::chrono::microseconds per_operation);

// Holds every stream's queued work, as a GPU busy with it would, until some
// caller waits for work (a synchronize, an event wait, or the fake's own wait
// after a violation), which releases the hold. Deterministic where set_delay
// depends on timing: work queued while held is still pending for sure.
void hold_streams();

// The `n`th call (1 = the next one) of `entry` ("cuMemMap", "cudaMemcpyAsync",
// ...) from now returns `code` (a CUresult or cudaError_t) and does nothing.
void fail_nth(const std::string& entry, int n, int code);

// How many times `entry` was called since reset().
std::uint64_t calls(const std::string& entry);
// Every entry called since reset(), with its count.
std::map<std::string, std::uint64_t> all_calls();

// Whether `device`'s primary context was initialized since reset(): by
// cudaSetDevice, cuDevicePrimaryCtxRetain, or a runtime call on a thread with
// no context current whose runtime device it is. On a GPU that context holds
// device memory (hundreds of MiB) for the rest of the process.
bool primary_context_initialized(int device);

// Whether [p, p + bytes) is safe to touch from the CPU: outside every
// reservation, or mapped and made accessible. Tests ask before reading
// memory whose mapping a failure may have lost, instead of faulting.
bool accessible(const void* p, std::size_t bytes);

// Whether kernels on `device` may touch [p, p + bytes): mapped, and granted
// to that device by cuMemSetAccess (peer access included).
bool device_can_access(int device, const void* p, std::size_t bytes);

// Bytes of device pages alive now (created, and released only when unmapped),
// and of host pages plus pinned host allocations.
std::size_t device_bytes_in_use();
// Bytes of device memory handed out since reset() (cudaMalloc, cuMemCreate
// on the device), freed or not.
std::uint64_t device_bytes_created();
std::size_t host_bytes_in_use();

// Queued operations (copies, memsets) every stream has finished since reset().
std::uint64_t operations_completed();

}  // namespace fake_cuda
