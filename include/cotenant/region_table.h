// Named memory regions of one device that a job pauses and resumes as a
// whole, as torch_memory_saver does to co-locate RL training with rollout
// engines: a KV cache or a copy of the weights gives its device memory back
// while the other phase runs, and gets it back later at the same addresses.
//
// Model:
//  - A region is a name and a CachingAllocator of its own, so its blocks
//    never share a page (or a segment) with any other block: pausing a region
//    moves or drops only its own bytes. Region allocators are made like the
//    graph pools' (PoolTable::pool_options()) and are not under the memory
//    cap; their bytes count in the device's statistics.
//  - A thread tags its allocations by entering a region (RegionScope, the
//    Python `with cotenant.region("kv_cache"):`). The tag is per thread and
//    process-wide (every device's table reads it); entering the region a
//    thread is already in nests (counted); entering a different one inside
//    it is an Error. allocate() serves the calling thread's region, and a
//    region comes into being in a device's table with its first allocation
//    there.
//  - pause(name, keep=true): every page of the region moves to the host
//    (CachingAllocator::spill_all() and the page moves of a safe point):
//    same addresses, contents kept, device memory freed. resume() brings the
//    pages back to the device. The host pages come from the table's
//    HostPagePool when it has one (the device's, with its host reserve) and
//    go back to it on resume.
//  - pause(name, keep=false): every page is released
//    (CachingAllocator::discard_pages()); the addresses stay reserved, and
//    resume() backs the live blocks again with zeroed device pages.
//  - While a region is paused, allocating in it is an Error (resume first);
//    freeing its tensors works (their bytes are gone with them); kernels must
//    not touch its memory with keep=false (unmapped: an illegal address), and
//    reach it over the host link with keep=true.
//
// pause() and resume() move or release pages: the caller runs them at a safe
// point (caching_allocator.h, "The safe point"); both refuse while a CUDA
// graph is being captured (set_graph_capture), with the fix in the message.
//
// Thread-safe: every method takes the table's mutex (allocate() too, so a
// pause never races an allocation into the same region).
#pragma once

#include <atomic>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cotenant/backend.h"
#include "cotenant/caching_allocator.h"

namespace cotenant {

enum class RegionState : std::uint8_t { kActive, kPausedKept, kPausedDiscarded };
const char* region_state_name(RegionState state);  // "active", "paused (kept)", "paused (discarded)"

struct RegionInfo {
  std::string name;
  RegionState state = RegionState::kActive;
  std::size_t allocated_bytes = 0;  // live blocks
  std::size_t device_bytes = 0;     // pages on the device
  std::size_t host_bytes = 0;       // pages on the host
};

// The calling thread's region tag.
class RegionScope {
 public:
  // The calling thread's allocations go to region `name` until the matching
  // exit(). Throws Error when the thread is inside another region, or when
  // `name` is empty.
  static void enter(const std::string& name);
  // Ends the innermost enter(name) of this thread. Throws Error when the
  // thread is not inside `name`.
  static void exit(const std::string& name);
  // Whether the calling thread is inside a region. Lock-free, and a single
  // atomic load while no thread of the process is inside one.
  static bool inside();
  // The calling thread's region's name, or "" outside every region.
  static const std::string& current();
};

class RegionTable {
 public:
  // `host_pages`: the device's host page pool, shared by the allocators
  // made here (null: each gets one of its own).
  explicit RegionTable(Backend& backend, std::shared_ptr<HostPagePool> host_pages = nullptr);
  ~RegionTable();
  RegionTable(const RegionTable&) = delete;
  RegionTable& operator=(const RegionTable&) = delete;

  // Allocates in the calling thread's region. Throws Error when the thread
  // is in no region or the region is paused; OutOfMemoryError as
  // CachingAllocator::allocate does. `allocator` receives the region's
  // allocator (the one free() and record_stream() go to).
  // `on_oom` as CachingAllocator::allocate's.
  DevicePtr allocate(std::size_t bytes, StreamId stream, CachingAllocator** allocator,
                     OnOutOfMemory on_oom = OnOutOfMemory::kThrow);

  // See the class comment. pause() of a paused region and resume() of an
  // active one throw Error, as does an unknown name (the message lists the
  // regions). pause(keep=true) needs host pages (SpillMode::kRemap): without
  // host virtual memory management it throws Error naming keep=false.
  // Returns the bytes moved, released or mapped.
  std::size_t pause(const std::string& name, bool keep);
  std::size_t resume(const std::string& name);

  // A job's suspend (the coordinator's, the queue's preemption): every
  // active region's pages are marked to go to the host as the job's main
  // allocator's are (CachingAllocator::spill_all()). The regions stay
  // active: an allocation in one lands on the host. Returns their names,
  // for restore_spilled(). The moves happen at the caller's safe point
  // (apply_pending_migrations()). In a device without host virtual memory
  // management nothing is marked.
  std::vector<std::string> spill_active();
  // The job's resume: of the regions `names` lists, those still active (not
  // paused since: a paused one stays on the host until its own resume) are
  // marked to come back.
  void restore_spilled(const std::vector<std::string>& names);
  bool has_pending_migrations() const;
  // Moves every region's marked pages (at a safe point); returns the bytes.
  std::size_t apply_pending_migrations();

  // While a CUDA graph is being captured, pause() and resume() refuse.
  void set_graph_capture(bool capturing) { graph_capture_.store(capturing, std::memory_order_release); }

  bool contains(const std::string& name) const;
  RegionState state(const std::string& name) const;  // throws Error for an unknown name
  std::vector<RegionInfo> regions() const;           // by name
  // Every region's allocator, by name (statistics, snapshots, empty_cache).
  std::vector<std::pair<std::string, CachingAllocator*>> allocators() const;
  // Where every region's allocator, made now or later, sends its events
  // (CachingAllocator::set_event_sink; null: nowhere): the device's memory
  // history, as for its other allocators.
  void set_event_sink(AllocatorEventSink* sink);

 private:
  struct Region {
    std::unique_ptr<CachingAllocator> allocator;
    RegionState state = RegionState::kActive;
  };
  Region& find_locked(const std::string& name, const char* what);
  const Region& find_locked(const std::string& name, const char* what) const;
  void refuse_during_capture(const std::string& name, const char* what) const;

  Backend& backend_;
  const std::shared_ptr<HostPagePool> host_pages_;
  mutable std::mutex mutex_;
  AllocatorEventSink* event_sink_ = nullptr;  // given to each region's allocator
  std::map<std::string, Region> regions_;
  std::atomic<bool> graph_capture_{false};
};

}  // namespace cotenant
