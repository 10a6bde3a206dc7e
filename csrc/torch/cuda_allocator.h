// The c10 CUDA allocator adapter: cotenant's CachingAllocator behind
// PyTorch's c10::cuda::CUDACachingAllocator::CUDAAllocator interface.
//
// Once installed (before the first CUDA allocation), every CUDA tensor,
// cuBLAS workspace and torch.cuda.caching_allocator_alloc buffer comes from
// cotenant, and torch.cuda.memory_allocated / memory_reserved /
// memory_stats / memory_snapshot / empty_cache report and act on it.
//
// Per device: one CudaBackend and one capped CachingAllocator (the "main"
// allocator, which the memory cap governs), plus one uncapped
// CachingAllocator per CUDA-graph memory pool, so memory that a captured
// graph uses is never reused outside it (the graph replays against fixed
// addresses). Allocations on a stream that a beginAllocateToPool filter
// accepts go to that pool's allocator until endAllocateToPool. Allocations
// of a thread inside a region (region_table.h) go to that region's own
// uncapped allocator. All of them draw host pages from the device's one
// HostPagePool (kept pinned pages and the host reserve).
//
// Page moves (spill/restore) happen only at safe points: see "The safe
// point" in include/cotenant/caching_allocator.h.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <unordered_set>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "cotenant/address_map.h"
#include "cotenant/caching_allocator.h"
#include "cotenant/memory_history.h"
#include "cotenant/pool_table.h"
#include "cotenant/region_table.h"

namespace cotenant::cuda {
class CudaBackend;
}

namespace cotenant::torch_ext {

namespace c10_alloc = c10::cuda::CUDACachingAllocator;

// One device's allocators. Created on the device's first use.
struct DeviceAllocators {
  explicit DeviceAllocators(c10::DeviceIndex device);
  ~DeviceAllocators();

  c10::DeviceIndex device;
  std::unique_ptr<cuda::CudaBackend> backend;
  // Pinned host pages kept for reuse and the host reserve, shared by every
  // allocator below: a reserve serves a squeeze and a region's pause alike.
  std::shared_ptr<HostPagePool> host_pages;
  std::unique_ptr<CachingAllocator> main;  // capped; owns every non-graph allocation
  // CUDA-graph and MemPool pools, their holders and the capture routes.
  // pools.routing() is read lock-free on the allocation fast path.
  std::unique_ptr<PoolTable> pools;
  // torch.cuda.memory._record_memory_history() for this device: every
  // allocator above reports to it while it is active (cuda_allocator_history.cpp).
  std::unique_ptr<MemoryHistory> history;
  bool history_feeds_trace_trackers = false;  // its listener for attachAllocatorTraceTracker is in

  // Named regions (cotenant.region): allocations of a thread inside one go
  // to the region's own allocator, outside a graph capture (regions.cpp).
  std::unique_ptr<RegionTable> regions;

  // MemPools made with an allocator of their own (torch.cuda.MemPool(allocator),
  // as NCCL's registered buffers and vLLM's sleep mode make them): an
  // allocation routed to one is one call to that allocator, and its free one
  // call back. That memory is the other allocator's: never capped, spilled or
  // cached by cotenant; memory_stats and memory_snapshot count it, as
  // PyTorch's allocator does (each allocation a segment of its pool).
  struct ForeignBlock {
    c10_alloc::CUDAAllocator* allocator = nullptr;  // kept alive by foreign_pools
    PoolId pool{};
    std::size_t bytes = 0;
    std::vector<cudaStream_t> streams;  // record_stream's: waited for before the free
  };
  std::mutex foreign_mutex;  // the three below
  // Every such pool this device saw, kept: PyTorch never reuses a pool id,
  // and a live block may outlive its MemPool.
  std::map<PoolId, std::shared_ptr<c10_alloc::CUDAAllocator>> foreign_pools;
  std::unordered_map<void*, ForeignBlock> foreign_blocks;  // live
  AllocatorStats foreign_stats;

  // PyTorch keeps one set of statistics per device, whatever pool a block
  // is in, so torch.cuda.max_memory_allocated() is the peak of the device's
  // total; each allocator above keeps its own peaks, and their sum would
  // count memory that was never held at once. Once an allocator other than
  // `main` has allocated (a graph pool, a MemPool, a region), the device's
  // totals are read after each allocation and their highest values kept
  // here (note_device_peaks); until then `main`'s own peaks are the
  // device's.
  std::atomic<bool> several_allocators{false};
  std::mutex peaks_mutex;
  c10::CachingDeviceAllocator::DeviceStats peaks;  // only the `peak` fields are kept

  // The job's cap on this device, from its two sources: the user's
  // (cotenant.set_memory_cap, torch.cuda.set_per_process_memory_fraction)
  // and the coordinator's; the lower holds. It covers every allocator above:
  // graph pools, regions and MemPools' own allocators are never capped or
  // moved, so `main`'s cap is the job's less what they hold on the device
  // (at least one byte: then every page of main is on the host), followed
  // as they grow and shrink (CotenantCudaAllocator::follow_job_cap). Only
  // follow_job_cap sets main's cap.
  std::mutex cap_mutex;                    // the three below, and main's cap
  std::uint64_t user_cap = kNoCap;         // cap words (kNoCap: none)
  std::uint64_t coordinator_cap = kNoCap;
  std::uint64_t main_cap = kNoCap;         // what follow_job_cap last set on main
};

class CotenantCudaAllocator final : public c10_alloc::CUDAAllocator {
 public:
  static CotenantCudaAllocator& instance();

  // Makes this the process's CUDA allocator. Throws cotenant::Error when
  // PyTorch's own allocator already holds live memory (the message says how
  // to fix it) or when there is no GPU.
  void install();
  bool installed() const;

  // The device's allocators, created on first use (throws cotenant::Error
  // when the device is unusable).
  DeviceAllocators& on(c10::DeviceIndex device);
  // Already-created devices only (nullptr otherwise); lock-free.
  DeviceAllocators* existing(c10::DeviceIndex device) const;
  // Calls fn(DeviceAllocators&) on each device created so far, in index order.
  template <typename Fn>
  void for_each_device(Fn&& fn) const {
    const int count = device_count_.load(std::memory_order_acquire);
    for (int dev = 0; dev < count; ++dev) {
      if (DeviceAllocators* d = existing(static_cast<c10::DeviceIndex>(dev))) fn(*d);
    }
  }

  // Host memory no device's host pool pins into (HostPagePool::set_headroom):
  // for every device now and every device created later.
  void set_host_headroom(std::size_t bytes);
  std::size_t host_headroom() const { return host_headroom_.load(std::memory_order_relaxed); }

  // The statistics of every allocator of `d` but its main one (graph and
  // MemPool pools, regions, MemPools with an allocator of their own),
  // added up (AllocatorStats::add): what the job holds outside its cap. A
  // MemPool's own allocator's memory counts as device-resident.
  AllocatorStats stats_besides_main(DeviceAllocators& d);

  // The job's cap on `d` (see DeviceAllocators::user_cap): one source's
  // cap word set, main's cap follows at once. May spill or restore pages.
  enum class CapSource { kUser, kCoordinator };
  void set_job_cap(DeviceAllocators& d, CapSource source, std::uint64_t cap_word);
  // The lower of the two (kNoCap: none).
  std::uint64_t job_cap(DeviceAllocators& d);
  // Main's cap for the job's cap and what the others hold now; true when it
  // changed (always: set it even if unchanged).
  bool follow_job_cap(DeviceAllocators& d, bool always = false);

  // True when some device has pages waiting for a safe point (lock-free).
  bool has_pending_migrations() const;
  // The end of one step of the job's loop, on every device's main
  // allocator (CachingAllocator::mark_iteration).
  void mark_iteration();
  // Pauses launches, synchronizes and applies pending page moves on every
  // device. Skips (returns 0) during CUDA graph capture, when another thread
  // is already doing it, or when other threads' ops did not drain in time.
  // Returns the bytes moved. `drain_timeout` bounds the wait for other
  // threads' running ops.
  std::size_t run_safe_point(std::chrono::microseconds drain_timeout = std::chrono::milliseconds(100));

  // The safe point as the op-entry hook (and the job channel's retry, for a
  // job that idles) runs it: the same, with a short drain timeout, and after
  // a failed attempt no retry for a while, so ops do not each pay a timeout
  // when another thread cannot finish its op (e.g. it waits for the GIL this
  // thread holds).
  void run_safe_point_at_op_entry();

  // ---- c10::Allocator ------------------------------------------------------
  c10::DataPtr allocate(size_t nbytes) override;
  c10::DeleterFnPtr raw_deleter() const override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;

  // ---- c10::DeviceAllocator --------------------------------------------------
  bool initialized() override;
  void emptyCache(c10::MempoolId_t mempool_id = {0, 0}) override;
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override;
  void resetAccumulatedStats(c10::DeviceIndex device) override;
  void resetPeakStats(c10::DeviceIndex device) override;

  // ---- CUDAAllocator ---------------------------------------------------------
  void* raw_alloc(size_t nbytes) override;
  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override;
  // Never throws (it runs from destructors): a free that fails, or a pointer
  // this allocator did not make, is reported on stderr and the memory stays
  // allocated.
  void raw_delete(void* ptr) noexcept override;
  void init(int device_count) override;
  double getMemoryFraction(c10::DeviceIndex device) override;
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override;
  std::vector<c10_alloc::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex device) override;
  void enable(bool value) override;
  bool isEnabled() const override;
  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override;
  void* getBaseAllocation(void* ptr, size_t* size) override;
  using c10_alloc::CUDAAllocator::recordStream;
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override;
  c10_alloc::SnapshotInfo snapshot(c10::MempoolId_t mempool_id = {0, 0},
                                   bool include_traces = true) override;
  void beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override;
  void endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  void releasePool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  int getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  void createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                          std::shared_ptr<c10_alloc::CUDAAllocator> allocator = nullptr) override;
  void setUseOnOOM(c10::DeviceIndex device, c10::MempoolId_t mempool_id, bool use_on_oom) override;
  void setNoSplit(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                                const std::unordered_set<void*>& expected_live_allocations) override;
  c10_alloc::ShareableHandle shareIpcHandle(void* ptr) override;
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override;
  bool isHistoryEnabled() override;
  void recordHistory(bool enabled, c10_alloc::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, c10_alloc::RecordContext when,
                     bool clearHistory, const std::vector<std::string>& skip_actions) override;
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override;
  void pushCompileContext(std::string& md) override;
  void popCompileContext() override;
  void setUserMetadata(const std::string& metadata) override;
  std::string getUserMetadata() override;
  void attachOutOfMemoryObserver(c10_alloc::OutOfMemoryObserver observer) override;
  void attachAllocatorTraceTracker(c10_alloc::AllocatorTraceTracker tracker) override;
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override;
  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override;
  std::shared_ptr<c10_alloc::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                                c10::MempoolId_t id) override;
  c10_alloc::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device, std::shared_ptr<c10_alloc::AllocatorState> pps) override;
  std::string name() override { return "cotenant"; }

 private:
  CotenantCudaAllocator() = default;

  struct Owner {
    CachingAllocator* allocator = nullptr;  // null for a block of a MemPool's own allocator
    // A graph or MemPool pool's allocator, held until the block's free has
    // returned: the table may drop the pool once its last block is freed.
    std::shared_ptr<CachingAllocator> pool;
    c10::DeviceIndex device = 0;
    bool graph_pool = false;
    bool foreign = false;  // the block is in the device's foreign_blocks
    bool used_on_other_streams = false;  // recordStream named a stream: its free records events
  };

  void* allocate_on(c10::DeviceIndex device, size_t nbytes, cudaStream_t stream);
  // The device's caches, as emptyCache() gives them back: the default pool's,
  // each region's and those of the pools no graph or MemPool holds.
  void empty_device_cache(DeviceAllocators& d);
  // The device's statistics summed over its allocators (peaks: see
  // DeviceAllocators::peaks).
  c10::CachingDeviceAllocator::DeviceStats device_stats(DeviceAllocators& d);
  // The sums alone; `highest_own`, when given, receives the highest peak
  // each counter reached in any one allocator.
  c10::CachingDeviceAllocator::DeviceStats summed_stats(DeviceAllocators& d,
                                                        c10::CachingDeviceAllocator::DeviceStats* highest_own = nullptr);
  // After an allocation: raises the device's kept peaks to its totals now,
  // once several allocators hold its memory.
  void note_device_peaks(DeviceAllocators& d);
  // An allocation routed to a MemPool with its own allocator; nullptr when
  // the pool has none (the pool's CachingAllocator serves it then).
  std::optional<void*> allocate_foreign(DeviceAllocators& d, PoolId pool, size_t nbytes, cudaStream_t stream);
  void free_foreign(DeviceAllocators& d, void* ptr);
  Owner owner_of(void* ptr) const;  // allocator == nullptr and !foreign when unknown
  void free_owned(void* ptr);       // raw_delete's work; throws, changing nothing, on failure
  // The free itself, once `ptr` is out of owners_; on failure `ptr` is back
  // in owners_ and the error propagates.
  void release_owned(void* ptr, const Owner& owner);
  // Holds back the free of a block that recordStream marked as used on other
  // streams while allocations on its device are routed to a pool (a graph
  // capture, torch.cuda.use_mem_pool), as PyTorch's allocator does: its
  // events cannot be recorded on a capturing stream, and the block must not
  // be reused before the other streams' work is done. False when nothing is
  // routed (free it now).
  bool defer_free_until_routes_end(void* ptr, const Owner& owner);
  // The held-back frees of `device`, once nothing is routed there.
  void release_deferred_frees(c10::DeviceIndex device);
  // The allocators of one device (main first, then every pool and region),
  // or of one pool when `mempool_id` is not {0, 0}. Each is held: a pool
  // dropped meanwhile on another thread lives until the caller lets it go
  // (main and the regions' live as long as the device).
  std::vector<std::shared_ptr<CachingAllocator>> allocators_of(DeviceAllocators& d, c10::MempoolId_t mempool_id);

  // ---- memory history (cuda_allocator_history.cpp) ----------------------------
  // Adds the trace trackers' listener to the device's history (and, with
  // `configure`, applies the recorded settings to it: a new device), then
  // points each of the device's allocators at the history while it is
  // active, at nothing otherwise, so recording off costs nothing. Runs on
  // device creation and whenever a pool may have been created.
  void attach_history(DeviceAllocators& d, bool configure = false);
  // The snapshot's segments and traces of one device.
  void add_history_to_snapshot(DeviceAllocators& d, c10_alloc::SnapshotInfo& out, bool include_traces);
  // Segments of `allocator` as a snapshot reports them (one per run of
  // mapped pages of one residency; host memory on kHostStream).
  void add_segments_to_snapshot(DeviceAllocators& d, CachingAllocator& allocator, c10::MempoolId_t pool,
                                c10_alloc::SnapshotInfo& out);
  // The live blocks of MemPools with their own allocator (all of them, or
  // those of `mempool_id`), one segment each.
  void add_foreign_segments_to_snapshot(DeviceAllocators& d, c10::MempoolId_t mempool_id,
                                        c10_alloc::SnapshotInfo& out);
  // Hands the compile context and user metadata in force to every device's
  // history (with `only`, to that device's alone: a new device).
  void apply_history_labels(DeviceAllocators* only = nullptr);
  std::mutex history_mutex_;     // the settings below, and attaching
  HistorySettings history_settings_;
  std::vector<std::string> compile_contexts_;  // pushCompileContext's stack; the top labels entries
  std::string user_metadata_;                  // setUserMetadata's; labels entries

  std::atomic<bool> installed_{false};
  std::atomic<bool> enabled_{true};
  std::atomic<int> device_count_{0};

  std::mutex devices_mutex_;  // creation of DeviceAllocators, the host headroom's changes
  std::atomic<std::size_t> host_headroom_{0};
  std::array<std::atomic<DeviceAllocators*>, C10_COMPILE_TIME_MAX_GPUS> devices_{};
  std::vector<std::unique_ptr<DeviceAllocators>> owned_devices_;

  mutable std::mutex owners_mutex_;
  AddressMap<void*, Owner> owners_;  // every live pointer -> the allocator that made it

  // Frees held back until the routes of their device end
  // (defer_free_until_routes_end): still allocated in their allocator, no
  // longer in owners_.
  std::mutex deferred_mutex_;
  std::vector<std::pair<void*, Owner>> deferred_frees_;

  std::mutex observers_mutex_;
  std::vector<c10_alloc::OutOfMemoryObserver> oom_observers_;
  std::vector<c10_alloc::AllocatorTraceTracker> trace_trackers_;

  std::mutex safe_point_mutex_;
  // steady_clock nanoseconds before which the op-entry safe point does not retry.
  std::atomic<std::int64_t> next_op_entry_attempt_ns_{0};
  std::atomic<std::int64_t> op_entry_backoff_ns_{20'000'000};  // the next retry's delay
};

}  // namespace cotenant::torch_ext
