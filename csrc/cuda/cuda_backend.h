// CudaBackend: cotenant::Backend on a real GPU, through CUDA virtual memory
// management.
//
//  - Address ranges: cuMemAddressReserve / cuMemAddressFree.
//  - Device pages: cuMemCreate on the device; host pages: cuMemCreate with
//    CU_MEM_LOCATION_TYPE_HOST_NUMA (or HOST) where the device supports host
//    VMM (attributes 141 / 145). Both map with cuMemMap and are made reachable
//    by the device with cuMemSetAccess, so a page can change residency and
//    keep its virtual address.
//  - Without host VMM, host_pages_mappable() is false, create_page(kHost)
//    returns an empty handle and over-cap memory comes from mapped pinned
//    host memory (cuMemHostAlloc with DEVICEMAP): AntMan's scheme.
//  - A host page stays mapped at a private "shadow" address from its
//    creation to its release, where the device's copy engine reaches it: a
//    page move copies between it there and the live page's address
//    (cudaMemcpyAsync on a private stream), mapping nothing for the copy.
//    The stream is synchronized after each copy, or at a safe point
//    (set_quiescent()) once for the whole batch.
//  - unmap() synchronizes the device first: kernels launched before a block
//    was freed may still touch its page, and cuMemUnmap does not wait for
//    them (PyTorch's expandable segments synchronize for the same reason).
//    When the GPU is idle (safe points, repeated unmaps) this costs a few us.
//  - Events and streams are the CUDA runtime's (the runtime torch loads);
//    a StreamId is a cudaStream_t cast to an integer.
//  - The backend retains its device's primary context (the one torch and the
//    runtime use) and makes it current to the calling thread for each call
//    that needs a context, giving the thread back the one it had (or none);
//    it never sets the runtime's current device, which would create a
//    context on the device it names. The virtual memory calls need none.
//
// One CudaBackend serves one device. Thread-safe: the copy stream and the
// shadows are guarded by mutexes; everything else is stateless or the driver's.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "cotenant/backend.h"

namespace cotenant::cuda {

class CudaBackend final : public Backend {
 public:
  // Throws cotenant::Error when there is no usable GPU, when `device` is out
  // of range, or when the device does not support virtual memory management.
  explicit CudaBackend(int device);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  int device() const { return device_; }

  // While a CUDA graph is being captured on the device, unmap() must not
  // synchronize (that would invalidate the capture). The adapter sets this
  // between beginAllocateToPool and endAllocateToPool.
  void set_graph_capture(bool capturing) { graph_capture_.store(capturing, std::memory_order_release); }

  // At a safe point the caller has synchronized the device and no launch can
  // start, so unmap() need not synchronize again for every page it moves.
  // Set only by the thread holding the launch pause, around the page moves,
  // and it holds for that thread alone: another thread (one calling
  // set_memory_cap() from Python, outside any op, while a tensor whose page
  // a move still copies is freed) synchronizes as usual before it unmaps.
  // While quiescent, that thread's copy_into() and copy_out() also return
  // before their copy finished: copies run back to back on the copy stream
  // while the next pages are mapped. finish_copies() must run before
  // launches resume (and before set_quiescent(false)); it waits for them.
  void set_quiescent(bool quiescent) {
    quiescent_thread_.store(quiescent ? std::this_thread::get_id() : std::thread::id{}, std::memory_order_release);
  }
  void finish_copies() override;
  CopyMark mark_copies() override;
  void wait_for_copies(CopyMark mark) override;
  // "host-numa" / "host" (host VMM) or "pinned-fallback".
  const char* host_page_kind() const;

  // Time spent in each kind of driver call since construction or the last
  // reset: where a page move's time goes (bench_allocator.py prints it).
  // Counting costs two clock reads per call, against microseconds of driver.
  enum class DriverCall {
    kCreateDevicePage,   // cuMemCreate on the device
    kCreateHostPage,     // cuMemCreate on the host (pins host memory)
    kReleaseDevicePage,  // cuMemRelease
    kReleaseHostPage,
    kMap,                // cuMemMap
    kSetAccess,          // cuMemSetAccess
    kUnmap,              // cuMemUnmap
    kCopyIssue,          // cudaMemcpyAsync (and its event) for a page copy
    kCopyWait,           // waiting for page copies to finish
    kDeviceSynchronize,  // cudaDeviceSynchronize before unmapping or freeing
    kZero,               // cudaMemsetAsync and its wait
    kCount
  };
  static const char* driver_call_name(DriverCall call);
  struct DriverCallTime {
    std::uint64_t calls = 0;
    std::uint64_t ns = 0;
  };
  DriverCallTime driver_call_time(DriverCall call) const;
  void reset_driver_call_times();

  // What the driver's virtual memory calls cost as the unit grows: whether a
  // page move's driver time (Known limits in docs/allocator.md) is per call,
  // per mapping or per byte, which decides whether moving extents of many
  // pages would reach the bus. A measurement the allocator never runs
  // (bench_allocator.py records it). For each side (the device; the host
  // where host VMM exists) and each extent size (a multiple of the page),
  // `total_bytes` of memory as allocations of that size go through these
  // steps, each timed over all its calls:
  //   create            cuMemCreate of each allocation
  //   map               cuMemMap of each at a fresh address
  //   set_access        cuMemSetAccess of each mapping (a fresh address)
  //   unmap             cuMemUnmap of each
  //   map_again         cuMemMap of each at the address it had (as a page
  //                     that moves keeps its address)
  //   set_access_again  cuMemSetAccess of each mapping there
  //   set_access_whole  one cuMemSetAccess over all of them (unmapped and
  //                     mapped again before)
  //   release           cuMemRelease of each (unmapped before)
  //   map_piece         cuMemMap of each page-sized piece of one allocation
  //                     (offsets into it) at its own address, a page apart:
  //                     a page backed by part of a larger allocation
  //   set_access_piece  cuMemSetAccess of each piece
  // A step the driver refuses ends its pass with the refusal in `error`
  // (its calls so far counted); every allocation, mapping and address range
  // the pass made goes back. Throws cotenant::Error for an extent that is
  // not a multiple of the page or does not divide `total_bytes`.
  struct VmmProbeRow {
    std::string side;  // "device" or "host"
    std::size_t extent_bytes = 0;
    std::string step;
    std::uint64_t calls = 0;
    std::uint64_t ns = 0;
    std::string error;  // empty unless the driver refused this step
  };
  std::vector<VmmProbeRow> probe_vmm_costs(std::size_t total_bytes, const std::vector<std::size_t>& extents);

  // Kernels running on device `peer` may read and write this device's pages:
  // every page mapped now and every page mapped later (cuMemSetAccess for
  // the peer; PyTorch's enablePeerAccess(peer, this device)).
  void grant_access(int peer);

  std::size_t granularity() const override { return granularity_; }
  std::size_t device_total_bytes() const override;
  std::size_t device_free_bytes() const override;
  bool host_pages_mappable() const override { return host_location_ != HostLocation::kNone; }
  // read_host_available(): the least of MemAvailable and the room the
  // process's memory cgroups leave (read at each call: a pin costs far more).
  std::optional<std::size_t> host_available_bytes() const override;

  DevicePtr reserve(std::size_t bytes) override;
  void release(DevicePtr base, std::size_t bytes) override;
  PageHandle create_page(Residency where) override;
  void release_page(PageHandle page) override;
  void map(DevicePtr address, PageHandle page) override;
  void map_pages(DevicePtr address, const PageHandle* pages, std::size_t count) override;
  void unmap(DevicePtr address) override;
  bool synchronize_for_unmap() override;
  void unmap_synchronized(DevicePtr address) override;
  void copy_into(DevicePtr address, PageHandle src) override;
  void copy_out(DevicePtr address, PageHandle dst) override;
  // cudaMemsetAsync on the copy stream, waited for before it returns.
  void zero(DevicePtr address, std::size_t bytes) override;

  DevicePtr allocate_pinned_host(std::size_t bytes) override;
  void free_pinned_host(DevicePtr address, std::size_t bytes) override;
  void free_pinned_host_synchronized(DevicePtr address, std::size_t bytes) override;

  EventHandle create_event() override;
  void destroy_event(EventHandle event) override;
  void record_event(EventHandle event, StreamId stream) override;
  bool query_event(EventHandle event) override;
  void synchronize_event(EventHandle event) override;
  void synchronize_device() override;

 private:
  enum class HostLocation { kNone, kHost, kHostNuma };

  class Timed;  // adds a call's duration to times_ when it goes out of scope
  struct CallTimes {
    std::atomic<std::uint64_t> calls{0};
    std::atomic<std::uint64_t> ns{0};
  };
  std::array<CallTimes, static_cast<std::size_t>(DriverCall::kCount)> times_;

  void set_device_access(DevicePtr address, std::size_t bytes);
  void unmap_now(DevicePtr address);  // no synchronization: the caller knows the page is idle
  // Waits for every kernel launched so far, unless a safe point already did
  // (quiescent); `why` names the wait in the error.
  void wait_for_launched_work(const char* why);

  void set_up(int dev);          // the constructor's work, in the device's context
  void give_back_everything();  // the destructor's work, in the device's context

  int device_ = 0;
  void* context_ = nullptr;  // CUcontext: device_'s primary context, retained until the backend goes
  HostLocation host_location_ = HostLocation::kNone;
  int host_numa_id_ = 0;
  std::size_t granularity_ = 0;
  std::atomic<bool> graph_capture_{false};
  std::atomic<std::thread::id> quiescent_thread_{};  // the safe point's thread, while it moves pages
  bool quiescent_here() const {
    return quiescent_thread_.load(std::memory_order_acquire) == std::this_thread::get_id();
  }

  // Copies between a host page's shadow and a live page's address, on
  // copy_stream_. copy_mutex_ serialises them and guards copies_pending_:
  // copies issued at a safe point and not waited for yet.
  // One page from `src` to `dst` (addresses).
  void copy_page(DevicePtr dst, DevicePtr src);  // copy_mutex_ held
  std::mutex copy_mutex_;
  bool copies_pending_ = false;
  // Marks are events recorded on the copy stream (a CopyMark is the
  // cudaEvent_t): spare ones for reuse, and those recorded and not yet
  // waited for (spare again once finish_copies() waited for everything).
  std::vector<void*> spare_marks_;
  std::vector<void*> recorded_marks_;
  void* copy_stream_ = nullptr;  // cudaStream_t

  // Devices besides device_ whose kernels may touch our pages, and the
  // pages mapped now (the addresses a late grant_access must reach).
  std::mutex access_mutex_;
  std::vector<int> peers_;
  std::unordered_set<DevicePtr> mapped_;

  // Host pages' shadow addresses (host VMM only). Slots come from ranges of
  // kShadowRangePages pages reserved as needed and kept until the backend
  // goes. A host page released while a copy in flight may still read its
  // shadow is unmapped and released in finish_copies().
  static constexpr std::size_t kShadowRangePages = 512;
  DevicePtr shadow_of(PageHandle page);            // throws for a page without one (a device page)
  void map_shadow(PageHandle page);                // throws; the page keeps no shadow then
  void release_host_page(PageHandle page);         // unmaps its shadow, then cuMemRelease
  std::mutex shadow_mutex_;
  std::vector<DevicePtr> shadow_ranges_;
  std::vector<DevicePtr> free_shadows_;
  std::unordered_map<std::uint64_t, DevicePtr> shadows_;  // host page id -> shadow address
  // Shadows whose unmap the driver refused at their page's release: the
  // page's handle is released all the same (its memory goes when the last
  // mapping does), and they are unmapped again at the backend's end.
  std::vector<DevicePtr> refused_shadows_;
  std::vector<PageHandle> releases_after_copies_;         // guarded by copy_mutex_

  // Pinned-fallback allocations: device address -> host pointer for cuMemFreeHost.
  std::mutex pinned_mutex_;
  std::unordered_map<DevicePtr, void*> pinned_host_;
};

}  // namespace cotenant::cuda
