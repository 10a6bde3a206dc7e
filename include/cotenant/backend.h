// The device backend: the only thing the allocator core knows about a GPU.
//
// The core (allocator, page table, cap, spill policy) talks to a device only
// through this interface, so the same code runs on the simulated device in
// tests and on CUDA's virtual memory management in a real job.
//
// Model: the allocator reserves virtual address ranges and backs them page by
// page. A page is one unit of physical memory of `granularity()` bytes, on the
// device or on the host. Mapping a page at an address makes that address
// range reachable by kernels; a page can be unmapped and another mapped at the
// same address, which is how a spill or restore keeps tensors' addresses.
//
// Thread safety: every method may be called from any thread; the allocator
// serialises its own calls, but events and streams are also used by callers
// outside it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

namespace cotenant {

// An address in the device's virtual address space.
using DevicePtr = std::uintptr_t;

// A stream as the caller knows it (a cudaStream_t cast to an integer in the
// CUDA backend; any number on the simulated device). 0 is the default stream.
using StreamId = std::uint64_t;

// Where a page's bytes live.
enum class Residency : std::uint8_t { kDevice, kHost };

const char* residency_name(Residency where);

// A physical page, opaque to the core. `id` is backend-defined and nonzero.
struct PageHandle {
  std::uint64_t id = 0;
  Residency where = Residency::kDevice;
  explicit operator bool() const { return id != 0; }
};

// An event, opaque to the core. `id` is backend-defined and nonzero.
struct EventHandle {
  std::uint64_t id = 0;
  explicit operator bool() const { return id != 0; }
};

// Whether `bytes` can be a page's size: a power of two, as every driver's
// granularity is (2 MiB on current GPUs).
constexpr bool is_page_size(std::size_t bytes) { return bytes != 0 && (bytes & (bytes - 1)) == 0; }

class Backend {
 public:
  virtual ~Backend() = default;

  // Bytes in one page (is_page_size); every reservation and mapping is a multiple of it.
  virtual std::size_t granularity() const = 0;

  // Total and currently free device memory, in bytes, as the device reports
  // it (cudaMemGetInfo on a GPU). Used for fractional caps and the
  // coordinator's numbers, never for the cap itself.
  virtual std::size_t device_total_bytes() const = 0;
  virtual std::size_t device_free_bytes() const = 0;

  // Whether host pages can be mapped into a reserved range (host VMM). When
  // false, over-cap memory comes from `allocate_pinned_host` instead and
  // live pages cannot move between device and host.
  virtual bool host_pages_mappable() const = 0;

  // Host memory the system could still give this process (Linux's
  // MemAvailable, less where the process's memory cgroup is nearer its
  // limit: read_host_available()), or nullopt when the backend cannot tell. Pinning more
  // than this pushes the system towards its OOM killer: the host page pool
  // stops pinning at a headroom above it (HostPagePool::set_headroom).
  virtual std::optional<std::size_t> host_available_bytes() const { return std::nullopt; }

  // Reserves `bytes` (a multiple of granularity) of virtual address space
  // with nothing mapped. Returns 0 when the address space is exhausted.
  virtual DevicePtr reserve(std::size_t bytes) = 0;
  // Releases a range returned by reserve(); every page in it must be unmapped.
  virtual void release(DevicePtr base, std::size_t bytes) = 0;

  // Creates one physical page. Returns an empty handle when that memory is
  // exhausted (the device is full, or pinned host memory is): the caller
  // decides whether to spill or to fail.
  virtual PageHandle create_page(Residency where) = 0;
  virtual void release_page(PageHandle page) = 0;

  // Maps `page` at `address` (granularity-aligned, inside a reserved range,
  // currently unmapped) and makes it accessible to the device.
  virtual void map(DevicePtr address, PageHandle page) = 0;
  // Maps `count` pages at the addresses that follow one another from
  // `address`, as map() each, with one access call for them all where the
  // backend can (CudaBackend: one cuMemSetAccess). When it throws, none of
  // them is left mapped.
  virtual void map_pages(DevicePtr address, const PageHandle* pages, std::size_t count) {
    std::size_t mapped = 0;
    try {
      for (; mapped < count; ++mapped) map(address + mapped * granularity(), pages[mapped]);
    } catch (...) {
      while (mapped > 0) {
        --mapped;
        unmap_synchronized(address + mapped * granularity());  // nothing ran on them yet
      }
      throw;
    }
  }
  // Unmaps one page, first making sure no kernel still touches it (on a GPU:
  // a device synchronize, unless the caller's safe point already did one).
  virtual void unmap(DevicePtr address) = 0;

  // Releasing cached pages (no live block on them) in a batch: one call
  // waits until no kernel launched so far can touch them, then
  // unmap_synchronized() unmaps each without waiting again. Returns false
  // when the device cannot be synchronized now (a CUDA graph is being
  // captured): the caller then keeps its cached pages.
  virtual bool synchronize_for_unmap() {
    synchronize_device();
    return true;
  }
  virtual void unmap_synchronized(DevicePtr address) { unmap(address); }

  // Copies page `src`'s bytes into the page mapped at `address`. `src` need
  // not be mapped anywhere (a page move unmaps it first and maps its
  // replacement in its place); the caller may release it as soon as this
  // returns (the backend keeps what a copy in flight still reads).
  virtual void copy_into(DevicePtr address, PageHandle src) = 0;
  // The other way: copies the bytes of the page mapped at `address` into page
  // `dst`, which the caller has mapped nowhere (a spill copies before it
  // remaps: a host page is reachable without a mapping of the caller's).
  virtual void copy_out(DevicePtr address, PageHandle dst) = 0;
  // Both copies are done when they return, except at a safe point on a GPU
  // (CudaBackend::set_quiescent): there they run on until finish_copies(),
  // which waits for them and throws when one failed. Until then the copies'
  // pages must stay mapped where they are and unused.
  virtual void finish_copies() {}
  // A point in the copies issued so far: wait_for_copies(mark) returns once
  // every copy issued before mark_copies() is done, while later ones may run
  // on (a spill remaps the pages copied first while the rest still copy).
  // Each mark is waited for once. mark_copies() does not throw: when it
  // cannot mark it returns 0, whose wait waits for every copy (as does the
  // default: no marks).
  using CopyMark = std::uint64_t;
  virtual CopyMark mark_copies() { return 0; }
  virtual void wait_for_copies(CopyMark /*mark*/) { finish_copies(); }

  // Sets `bytes` at `address` (mapped, accessible) to zero. Synchronous. A
  // new page's bytes are unspecified (the driver does not promise zeros), so
  // a page that must read as zero is zeroed through this.
  virtual void zero(DevicePtr address, std::size_t bytes) = 0;

  // Fallback spill path (no host VMM): `bytes` of pinned host memory that
  // kernels reach through the returned device address. Returns 0 when host
  // memory is exhausted. free_pinned_host() first waits until no kernel
  // launched so far can touch it (a device synchronize on a GPU);
  // free_pinned_host_synchronized() does not wait again, for a batch the
  // caller covered with one synchronize_for_unmap().
  virtual DevicePtr allocate_pinned_host(std::size_t bytes) = 0;
  virtual void free_pinned_host(DevicePtr address, std::size_t bytes) = 0;
  virtual void free_pinned_host_synchronized(DevicePtr address, std::size_t bytes) {
    free_pinned_host(address, bytes);
  }

  // Events: record on a stream, poll, wait. An event recorded on a stream
  // completes when all work submitted to that stream before it is done.
  virtual EventHandle create_event() = 0;
  virtual void destroy_event(EventHandle event) = 0;
  virtual void record_event(EventHandle event, StreamId stream) = 0;
  virtual bool query_event(EventHandle event) = 0;
  virtual void synchronize_event(EventHandle event) = 0;

  // Waits until all work on every stream of the device is done.
  virtual void synchronize_device() = 0;
};

}  // namespace cotenant
