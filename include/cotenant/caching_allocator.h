// CachingAllocator: a caching block allocator over page-backed segments, with
// a device-memory cap that can move at any time and spills to host instead of
// failing.
//
// Placement (docs/allocator.md, "Placement"):
//  - each stream has an arena: a reserved address range as large as the
//    device (address space costs nothing until a page is mapped), tiled by
//    blocks; requests of every size share it, by address-ordered best fit,
//    split to the rounded size, coalesced with free neighbours on free;
//  - pages are mapped when a block first needs them and stay mapped when its
//    blocks are freed, so a loop that repeats its allocations maps nothing
//    once warm. Pages are unmapped only under pressure: a lower cap, a full
//    device, empty_cache(), release_cached_pages();
//  - stream-ordered reuse: a block freed on stream S is reusable by S at once;
//    if it was used on other streams (record_stream), it is reusable only after
//    events recorded on those streams at free time have completed.
//  Statistics split allocations by PyTorch's size classes (small_pool for
//  requests up to 1 MiB); segments and reserved bytes are the arenas', all
//  counted in large_pool.
//
// The cap bounds device-resident bytes at every safe point. Temperature
// decides where a page lives: a page's heat is the time of the last
// allocation or free on its blocks. An allocation that finds no room under
// the cap still gets device pages when as many colder live device pages can
// move out at the next safe point; only otherwise are its pages placed on the
// host (spill), and only when host memory also fails is there an
// OutOfMemoryError. Lowering the cap releases cache, then marks live pages to
// move to the host, coldest first; raising it marks host pages to come back,
// hottest first; a host page hotter than a device page swaps places with it.
// Marked pages move in apply_pending_migrations(), which the caller runs at a
// safe point (below). A page keeps its address and its bytes across moves.
//
// The safe point (the one note on it; every other place points here):
//   A page may change residency only while no kernel can touch it: no op of
//   the process is between entry and the end of its launch, and the device
//   has finished what was launched. Who provides that:
//   - real jobs (csrc/torch): CotenantCudaAllocator::run_safe_point() pauses
//     launches at ATen op entry (op_interceptor.h; CUDA graph replays and
//     torch.compile's Triton launches count as ops), synchronizes the device,
//     then calls apply_pending_migrations(). It runs at op entry when
//     has_pending_migrations() is set (with backoff), after each optimizer
//     step, from the job channel's thread after a coordinator command, and
//     from cotenant.safe_point();
//   - the simulated backend has no kernels: any moment is a safe point.
//   Moves that find no page stay pending (has_pending_migrations() stays
//   true) and the next safe point retries them; nothing else needs to.
//
// Thread safety: every public method may be called from any thread.
// has_pending_migrations() is lock-free so it can be polled on a hot path.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

#include "cotenant/allocator_events.h"
#include "cotenant/backend.h"
#include "cotenant/cap.h"
#include "cotenant/host_page_pool.h"
#include "cotenant/stats.h"

namespace cotenant {

struct AllocatorOptions {
  std::size_t round_bytes = 512;                 // every size rounds up to this
  std::size_t small_request_max = 1u << 20;      // the small_pool statistics count requests up to this
  // Address space reserved per arena; 0: the device's total memory. A
  // request larger than an arena gets an arena of its own size.
  std::size_t arena_bytes = 0;
  // false: an allocation that cannot fit under the cap raises OutOfMemoryError
  // instead of spilling (what a user who wants a hard cap asks for).
  bool spill_to_host = true;
  // With no cap set, a full device raises OutOfMemoryError as PyTorch's
  // allocator does (torch.cuda.OutOfMemoryError, snapshots still possible).
  // true: spill to the host then too (COTENANT_SPILL_WITHOUT_CAP=1).
  bool spill_without_cap = false;
  // Host pages a page move or a free gives up stay with the allocator (pinned,
  // mapped nowhere) while a cap is set, and the next page the host needs is
  // one of them: pinning host memory costs more than copying it over PCIe,
  // so a job squeezed again and again pins once. empty_cache() and lifting
  // the cap give them back. false: every host page goes back to the driver
  // at once (COTENANT_KEEP_HOST_PAGES=0).
  bool keep_host_pages = true;
};

// One block as a snapshot shows it.
struct BlockInfo {
  DevicePtr address = 0;
  std::size_t size = 0;
  std::size_t requested_size = 0;  // 0 for free blocks
  bool allocated = false;
  bool waiting_on_events = false;  // freed, held back by record_stream events
};

// One segment (a reserved address range) as a snapshot shows it.
struct SegmentInfo {
  DevicePtr address = 0;
  std::size_t size = 0;
  StreamId stream = 0;
  PoolKind pool = PoolKind::kLarge;
  bool pinned_fallback = false;  // a kPinnedFallback host allocation, not a VMM segment
  std::size_t device_bytes = 0;  // mapped on the device
  std::size_t host_bytes = 0;    // mapped on the host
  std::vector<BlockInfo> blocks; // in address order, covering the segment
  // Maximal runs of mapped pages of one residency, in address order (empty
  // for a pinned fallback segment: all of it is host memory).
  struct MappedRun {
    DevicePtr address = 0;
    std::size_t size = 0;
    Residency where = Residency::kDevice;
  };
  std::vector<MappedRun> mapped_runs;
};

// What CachingAllocator::allocate() does when nothing can hold the block.
enum class OnOutOfMemory : std::uint8_t { kThrow, kReturnZero };

class CachingAllocator {
 public:
  // `host_pages`: the device's pool of kept host pages (host_page_pool.h),
  // shared with the device's other allocators; null: a pool of its own,
  // released with the allocator. A shared pool must be of `backend`.
  explicit CachingAllocator(Backend& backend, AllocatorOptions options = {},
                            std::shared_ptr<HostPagePool> host_pages = nullptr);
  ~CachingAllocator();  // releases all memory back to the backend (a shared host pool stays)
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // Returns 0 for a 0-byte request. Throws OutOfMemoryError with the numbers
  // when neither device memory under the cap nor host memory can hold it;
  // with OnOutOfMemory::kReturnZero it returns 0 instead and counts no OOM
  // (num_ooms, the event sink's), for a caller that frees memory elsewhere
  // (the device's other allocators' caches) and asks again. A block larger
  // than both the device and the host's room throws either way.
  DevicePtr allocate(std::size_t bytes, StreamId stream, OnOutOfMemory on_oom = OnOutOfMemory::kThrow);
  // Throws Error (and changes nothing) for an address that is not live, and
  // when the backend cannot record an event on a stream the block was used
  // on (record_stream): the block then stays allocated, the books unchanged.
  void free(DevicePtr address);
  // The block at `address` is used on `stream` too: do not reuse it until
  // that stream's work submitted before free() is done.
  void record_stream(DevicePtr address, StreamId stream);
  // Releases cached pages (see class comment).
  void empty_cache();

  // The end of one step of the job's loop (cotenant.iteration(), an
  // optimizer step): cached pages no allocation or free touched since the
  // previous mark are cold, and growth past the peak of live bytes releases
  // them instead of mapping more (docs/allocator.md, "Placement").
  void mark_iteration();

  // Size of the live allocation at `address` (rounded), or 0 if none.
  std::size_t allocation_size(DevicePtr address) const;
  // Where the page holding `address` lives, if it is mapped.
  bool is_device_resident(DevicePtr address) const;
  // Bytes of the live allocation at `address` that lie on host pages (all of
  // it for a pinned fallback allocation); 0 for an address that is not live.
  std::size_t host_bytes_of(DevicePtr address) const;
  // Bytes of host pages that hold a live block, and of pinned fallback
  // allocations in use: what kernels reach across the bus (stats()'s
  // host_live_bytes). Host pages kept mapped with no live block are not counted.
  std::size_t host_live_bytes() const;

  // The cap on device-resident bytes, as a resolved word (Cap::to_word():
  // kNoCap removes it), or as a Cap (a fraction resolves against the
  // backend's device size). Cap 0 is refused (use spill_all() to move
  // everything to the host). The cap and spill_all() are independent: a cap
  // set while everything is spilled takes effect at restore_all().
  void set_memory_cap(std::uint64_t bytes);
  void set_memory_cap(const Cap& cap);
  std::uint64_t memory_cap() const;  // the word form; kNoCap when none
  // Marks every live device page to move to the host / every host page to
  // come back (within the cap). Moves happen in apply_pending_migrations().
  // spill_all() holds until restore_all(): allocations meanwhile get host
  // pages, and cap changes move nothing back.
  void spill_all();
  void restore_all();
  bool spilled_all() const;
  // True when marked pages wait for a safe point.
  bool has_pending_migrations() const {
    return pending_migrations_.load(std::memory_order_acquire);
  }
  // Moves every marked page, re-planned against the current cap. Call it
  // with no kernel in flight that touches this allocator's memory. Returns
  // the bytes moved. Pages that found no page to move to stay marked, and
  // has_pending_migrations() stays true until a later call moves them.
  std::size_t apply_pending_migrations();

  // Discarding pages (a region paused without keeping its contents,
  // region_table.h). discard_pages() unmaps and releases every page, live
  // blocks' included: their memory goes back to the device (or host), while
  // the address ranges and the blocks stay. Call it at a safe point. Until
  // back_discarded_pages(), allocate() throws Error; free() and
  // record_stream() work as before (a block freed meanwhile had no bytes).
  // Throws Error, changing nothing, when the device cannot synchronize now
  // (a CUDA graph is being captured). Returns the bytes released.
  std::size_t discard_pages();
  // Maps a zeroed device page under every page a live block overlaps, at
  // its old address, and ends the discarded state. Throws OutOfMemoryError
  // when the device has no page for one: the pages mapped so far stay
  // (zeroed), the allocator stays discarded, and a later call maps the rest.
  // Returns the bytes mapped.
  std::size_t back_discarded_pages();
  bool discarded() const;

  // Pins host pages now until `bytes` (rounded up to whole pages) are kept
  // in the host pool, and keeps at least that many through empty_cache(),
  // cap changes and discard_pages(), until a lower reserve or the pool's
  // end: a job's first squeeze then pins nothing, as one squeezed before
  // (pinning costs more than the copy), and so does a pause of a region
  // that shares the pool. A spill takes reserve pages like any kept page;
  // they return when given up. 0 gives the reserve back (kept pages beyond
  // it follow keep_host_pages). Returns the bytes reserved. Throws Error,
  // keeping the reserve as it was, when the host cannot pin that much, and
  // in pinned fallback mode (no host pages to keep). Pins without the
  // allocator's lock: other threads allocate, free and move pages meanwhile.
  std::size_t reserve_host_memory(std::size_t bytes);
  std::size_t host_reserve() const;  // bytes
  // What this allocator's host page pool may still pin (HostPagePool::room():
  // the host's available memory less the headroom); nullopt where unknown.
  std::optional<std::size_t> host_room() const;

  SpillMode mode() const;
  AllocatorStats stats() const;
  // Recomputes the books from the blocks and pages (blocks tile their
  // segment, each in exactly one state, no free neighbours, live counts per
  // page, every live page mapped, residency and reserved bytes, counts) and
  // throws Error naming the first broken invariant. O(pages): for tests and
  // the sanitizer builds, not for a hot path.
  void check_invariants() const;
  void reset_peak_stats();
  void reset_accumulated_stats();
  std::vector<SegmentInfo> snapshot() const;
  // The largest request on `stream` one free block could serve from device
  // memory now: its bytes on mapped device pages, and at most `room` bytes
  // of the rest (what new device pages may still take: the device's free
  // memory, the room under a cap). At least `room`: a request finding no
  // block gets new pages. Blocks waiting on record_stream events, and
  // pinned fallback segments (host memory), count for nothing. What
  // torch.cuda's cacheInfo() asks (cuDNN sizes its workspace by it); an
  // arena's free tail is as large as the device, so its size alone says nothing.
  std::size_t largest_free_block(StreamId stream, std::size_t room) const;

  // What restore_allocations() changed: the addresses it freed and the
  // addresses it allocated, in address order.
  struct Restored {
    std::vector<DevicePtr> freed;
    std::vector<DevicePtr> allocated;
  };
  // Puts the allocations back as `checkpoint` (a snapshot() of this
  // allocator) shows them, as CUDA graph trees need of a graph pool: frees
  // every live allocation, waits for the streams that used them, then
  // allocates each block the checkpoint shows allocated, at its address,
  // with its size and requested bytes. Segments that came since stay, free.
  // Maps no page: throws Error, changing nothing, when a segment of the
  // checkpoint is gone, a block of it leaves its segment, or a page under
  // one of its blocks is unmapped (a graph pool keeps its pages while held).
  Restored restore_allocations(const std::vector<SegmentInfo>& checkpoint);

  Backend& backend() const { return backend_; }

  // Where to report what the allocator does (allocator_events.h); nullptr
  // stops it. The sink must outlive its use here: unset it before it dies.
  void set_event_sink(AllocatorEventSink* sink);

 private:
  struct State;
  Backend& backend_;
  std::unique_ptr<State> state_;
  std::atomic<bool> pending_migrations_{false};
};

}  // namespace cotenant
