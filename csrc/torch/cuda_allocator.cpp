#include "cuda_allocator.h"

#include <c10/core/Allocator.h>
#include <c10/core/impl/GPUTrace.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <utility>

#include "../cuda/cuda_backend.h"
#include "cotenant/errors.h"
#include "cotenant/size.h"
#include "op_interceptor.h"

namespace cotenant::torch_ext {
namespace {

constexpr c10::MempoolId_t kDefaultPool{0, 0};

// At op entry: how long a safe point waits for other threads' ops to finish,
// and how long it then leaves the job alone after it gave up.
constexpr std::chrono::microseconds kOpEntryDrainTimeout{5'000};
constexpr std::chrono::nanoseconds kOpEntryRetryBackoff{std::chrono::milliseconds(20)};
// Pages that could not move (no host or device page to be had) stay pending;
// retries back off from kOpEntryRetryBackoff, doubling up to this.
constexpr std::chrono::nanoseconds kOpEntryRetryBackoffMax{std::chrono::seconds(1)};

std::int64_t steady_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A tensor's deleter. It runs in destructors (at interpreter exit too), so
// it must not throw: raw_delete reports a failed free instead.
void delete_with_cotenant(void* ptr) noexcept { CotenantCudaAllocator::instance().raw_delete(ptr); }
static_assert(noexcept(delete_with_cotenant(nullptr)));
static_assert(noexcept(std::declval<CotenantCudaAllocator&>().raw_delete(nullptr)),
              "raw_delete runs from destructors (thrust's, cuDNN's workspaces): it must not throw");

// Runs `fn`, turning cotenant's C++ errors into the c10 errors PyTorch maps
// to Python exceptions (torch.OutOfMemoryError, RuntimeError).
template <typename Fn>
auto translate_errors(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const OutOfMemoryError& e) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, e.what());
  } catch (const Error& e) {
    TORCH_CHECK(false, e.what());
  }
}

void add_stat(c10::CachingAllocator::Stat& to, const Stat& from) {
  to.current += from.current;
  to.peak += from.peak;
  to.allocated += from.allocated;
  to.freed += from.freed;
}

void add_pooled(c10::CachingAllocator::StatArray& to, const PooledStat& from) {
  using c10::CachingAllocator::StatType;
  add_stat(to[static_cast<size_t>(StatType::AGGREGATE)], from.all);
  add_stat(to[static_cast<size_t>(StatType::SMALL_POOL)], from.small_pool);
  add_stat(to[static_cast<size_t>(StatType::LARGE_POOL)], from.large_pool);
}

void add_stats(c10::CachingDeviceAllocator::DeviceStats& to, const AllocatorStats& from) {
  add_pooled(to.allocation, from.allocation);
  add_pooled(to.segment, from.segment);
  add_pooled(to.active, from.active);
  add_pooled(to.inactive_split, from.inactive_split);
  add_pooled(to.allocated_bytes, from.allocated_bytes);
  add_pooled(to.reserved_bytes, from.reserved_bytes);
  add_pooled(to.active_bytes, from.active_bytes);
  add_pooled(to.inactive_split_bytes, from.inactive_split_bytes);
  add_pooled(to.requested_bytes, from.requested_bytes);
  to.num_alloc_retries += from.num_alloc_retries;
  to.num_ooms += from.num_ooms;
  to.num_device_alloc += from.num_device_alloc;
  to.num_device_free += from.num_device_free;
}

// Calls fn with the same StatArray of each DeviceStats given, for every
// StatArray that add_stats fills.
template <typename Fn, typename... Stats>
void for_each_stat_array(Fn&& fn, Stats&... stats) {
  fn(stats.allocation...);
  fn(stats.segment...);
  fn(stats.active...);
  fn(stats.inactive_split...);
  fn(stats.allocated_bytes...);
  fn(stats.reserved_bytes...);
  fn(stats.active_bytes...);
  fn(stats.inactive_split_bytes...);
  fn(stats.requested_bytes...);
}

PoolId pool_id(c10::MempoolId_t id) { return {id.first, id.second}; }

// What PyTorch's allocator tells the rest of torch about each allocation and
// free, outside its lock: torch.profiler.profile(profile_memory=True) gets
// the bytes (as allocated, rounded; negative for a free) with the device's
// allocated and reserved totals after the change, and the GPU trace hooks
// (torch.cuda._sanitizer, torch.cuda._gpu_trace) the address. Each costs a
// flag test while neither listens; the totals, which walk every allocator of
// the device, are gathered only while the profiler records memory.
struct DeviceTotals {
  std::size_t allocated, reserved;
};

DeviceTotals device_totals(c10::DeviceIndex device) {
  const auto stats = CotenantCudaAllocator::instance().getDeviceStats(device);
  const auto all = static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  return {static_cast<std::size_t>(stats.allocated_bytes[all].current),
          static_cast<std::size_t>(stats.reserved_bytes[all].current)};
}

void report_to_profiler(c10::DeviceIndex device, void* ptr, std::int64_t bytes) {
  const DeviceTotals totals = device_totals(device);
  c10::reportMemoryUsageToProfiler(ptr, bytes, totals.allocated, totals.reserved,
                                   c10::Device(c10::DeviceType::CUDA, device));
}

void report_out_of_memory_to_profiler(c10::DeviceIndex device, std::size_t bytes) {
  if (!c10::memoryProfilingEnabled()) return;
  const DeviceTotals totals = device_totals(device);
  c10::reportOutOfMemoryToProfiler(static_cast<std::int64_t>(bytes), totals.allocated, totals.reserved,
                                   c10::Device(c10::DeviceType::CUDA, device));
}

void trace_allocation(void* ptr) {
  if (const c10::impl::PyInterpreter* trace = c10::impl::GPUTrace::get_trace()) {
    (*trace)->trace_gpu_memory_allocation(c10::kCUDA, reinterpret_cast<std::uintptr_t>(ptr));
  }
}

void trace_deallocation(void* ptr) {
  if (const c10::impl::PyInterpreter* trace = c10::impl::GPUTrace::get_trace()) {
    (*trace)->trace_gpu_memory_deallocation(c10::kCUDA, reinterpret_cast<std::uintptr_t>(ptr));
  }
}

// The capped allocator's options: COTENANT_SPILL_WITHOUT_CAP=1 spills to the
// host when the device is full with no cap set (else that is an
// OutOfMemoryError, as with PyTorch's allocator); COTENANT_KEEP_HOST_PAGES=0
// gives host pages back to the driver as soon as nothing uses them.
AllocatorOptions main_options() {
  AllocatorOptions options;
  const char* spill = std::getenv("COTENANT_SPILL_WITHOUT_CAP");
  options.spill_without_cap = spill != nullptr && std::string(spill) == "1";
  const char* keep = std::getenv("COTENANT_KEEP_HOST_PAGES");
  options.keep_host_pages = keep == nullptr || std::string(keep) != "0";
  return options;
}

}  // namespace

// ---- DeviceAllocators ---------------------------------------------------------

DeviceAllocators::DeviceAllocators(c10::DeviceIndex device_index)
    : device(device_index),
      backend(std::make_unique<cuda::CudaBackend>(device_index)),
      host_pages(std::make_shared<HostPagePool>(*backend)),
      main(std::make_unique<CachingAllocator>(*backend, main_options(), host_pages)),
      pools(std::make_unique<PoolTable>(*backend, host_pages)),
      history(std::make_unique<MemoryHistory>()),
      regions(std::make_unique<RegionTable>(*backend, host_pages)) {}

DeviceAllocators::~DeviceAllocators() = default;

// ---- installation and per-device state ------------------------------------------

CotenantCudaAllocator& CotenantCudaAllocator::instance() {
  // Never destroyed: tensors may be freed during interpreter shutdown, after
  // static destructors would have run.
  static auto* allocator = new CotenantCudaAllocator();
  return *allocator;
}

void CotenantCudaAllocator::install() {
  if (installed()) return;
  c10_alloc::CUDAAllocator* current = c10_alloc::allocator.load();
  int count = c10::cuda::device_count();
  if (count <= 0) {
    on(0);  // throws the no-GPU message
  }
  if (current != nullptr && current != this && current->initialized()) {
    for (c10::DeviceIndex d = 0; d < count; ++d) {
      auto stats = current->getDeviceStats(d);
      const auto& allocations = stats.allocation[0];
      const auto& allocated = stats.allocated_bytes[0];
      if (allocations.current > 0) {
        throw Error(fmt::format(
            "cotenant.enable() must run before the first CUDA allocation; {} allocation(s) ({}) from "
            "PyTorch's own allocator already exist on cuda:{}. Call cotenant.enable() at the top of "
            "the script, before any tensor or model is moved to the GPU, or start the script with "
            "`cotenant run -- python script.py`.",
            allocations.current, format_size(static_cast<std::uint64_t>(allocated.current)),
            static_cast<int>(d)));
      }
    }
    current->emptyCache();  // cached but unused memory: give it back before switching
  }
  init(count);
  c10_alloc::allocator.store(this);
  // at::empty and friends reach the CUDA allocator through this registry too.
  c10::SetAllocator(c10::DeviceType::CUDA, this, /*priority=*/255);
  installed_.store(true, std::memory_order_release);
}

bool CotenantCudaAllocator::installed() const {
  return installed_.load(std::memory_order_acquire) && c10_alloc::allocator.load() == this;
}

DeviceAllocators& CotenantCudaAllocator::on(c10::DeviceIndex device) {
  if (device >= 0 && device < static_cast<c10::DeviceIndex>(devices_.size())) {
    if (DeviceAllocators* d = devices_[device].load(std::memory_order_acquire)) return *d;
  }
  std::lock_guard<std::mutex> lock(devices_mutex_);
  if (device < 0 || device >= static_cast<c10::DeviceIndex>(devices_.size())) {
    throw Error("cotenant was asked for cuda:" + std::to_string(device) +
                ", which is not a valid CUDA device index.");
  }
  if (DeviceAllocators* d = devices_[device].load(std::memory_order_acquire)) return *d;
  note_cuda_in_use();  // before the backend makes the device's context current: a child forked from now cannot use it
  auto created = std::make_unique<DeviceAllocators>(device);
  created->host_pages->set_headroom(host_headroom_.load(std::memory_order_relaxed));
  DeviceAllocators* raw = created.get();
  owned_devices_.push_back(std::move(created));
  devices_[device].store(raw, std::memory_order_release);
  attach_history(*raw, /*configure=*/true);  // after the store: recordHistory() meanwhile sees the device
  return *raw;
}

DeviceAllocators* CotenantCudaAllocator::existing(c10::DeviceIndex device) const {
  if (device < 0 || device >= static_cast<c10::DeviceIndex>(devices_.size())) return nullptr;
  return devices_[device].load(std::memory_order_acquire);
}

void CotenantCudaAllocator::set_host_headroom(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(devices_mutex_);  // a device created meanwhile gets the new one
  host_headroom_.store(bytes, std::memory_order_relaxed);
  for (const auto& d : owned_devices_) d->host_pages->set_headroom(bytes);
}

bool CotenantCudaAllocator::has_pending_migrations() const {
  const int count = device_count_.load(std::memory_order_relaxed);
  for (int d = 0; d < count && d < static_cast<int>(devices_.size()); ++d) {
    DeviceAllocators* state = devices_[d].load(std::memory_order_acquire);
    if (state != nullptr && state->main->has_pending_migrations()) return true;
  }
  return false;
}

void CotenantCudaAllocator::mark_iteration() {
  const int count = device_count_.load(std::memory_order_relaxed);
  for (int d = 0; d < count && d < static_cast<int>(devices_.size()); ++d) {
    DeviceAllocators* state = devices_[d].load(std::memory_order_acquire);
    if (state == nullptr) continue;
    state->main->mark_iteration();
    // The job's cap follows its pools and regions once a step, coordinator or not.
    if (state->several_allocators.load(std::memory_order_acquire)) follow_job_cap(*state);
  }
}

void CotenantCudaAllocator::set_job_cap(DeviceAllocators& d, CapSource source, std::uint64_t cap_word) {
  std::lock_guard<std::mutex> lock(d.cap_mutex);
  (source == CapSource::kUser ? d.user_cap : d.coordinator_cap) = cap_word;
}

namespace {
// The lower of the user's and the coordinator's cap words (kNoCap is the
// largest word, so no cap loses to any cap). Under d.cap_mutex.
std::uint64_t job_cap_locked(const DeviceAllocators& d) { return std::min(d.user_cap, d.coordinator_cap); }
}  // namespace

std::uint64_t CotenantCudaAllocator::job_cap(DeviceAllocators& d) {
  std::lock_guard<std::mutex> lock(d.cap_mutex);
  return job_cap_locked(d);
}

bool CotenantCudaAllocator::follow_job_cap(DeviceAllocators& d, bool always) {
  std::lock_guard<std::mutex> lock(d.cap_mutex);
  const std::uint64_t cap = job_cap_locked(d);
  std::uint64_t want = kNoCap;
  if (cap != kNoCap) {
    const AllocatorStats others = stats_besides_main(d);
    const auto held = static_cast<std::uint64_t>(std::max<std::int64_t>(others.device_resident_bytes.current, 0));
    want = cap > held ? cap - held : 1;  // 0 is no cap word: 1 byte holds no page
  }
  if (!always && want == d.main_cap) return false;
  d.main->set_memory_cap(want);
  d.main_cap = want;
  return true;
}

void CotenantCudaAllocator::run_safe_point_at_op_entry() {
  const std::int64_t now = steady_now_ns();
  if (now < next_op_entry_attempt_ns_.load(std::memory_order_relaxed)) return;
  const std::size_t moved = run_safe_point(kOpEntryDrainTimeout);
  if (!has_pending_migrations()) {
    op_entry_backoff_ns_.store(kOpEntryRetryBackoff.count(), std::memory_order_relaxed);
    return;
  }
  // Still pending: the ops did not drain, or a move found no page. Retry
  // later, and later still while retries move nothing.
  std::int64_t backoff = op_entry_backoff_ns_.load(std::memory_order_relaxed);
  next_op_entry_attempt_ns_.store(now + backoff, std::memory_order_relaxed);
  backoff = moved > 0 ? kOpEntryRetryBackoff.count() : std::min<std::int64_t>(2 * backoff, kOpEntryRetryBackoffMax.count());
  op_entry_backoff_ns_.store(backoff, std::memory_order_relaxed);
}

std::size_t CotenantCudaAllocator::run_safe_point(std::chrono::microseconds drain_timeout) {
  std::unique_lock<std::mutex> one_at_a_time(safe_point_mutex_, std::try_to_lock);
  if (!one_at_a_time.owns_lock()) return 0;  // another thread is moving pages right now
  if (!has_pending_migrations()) return 0;
  const int count = device_count_.load(std::memory_order_relaxed);
  // Synchronizing inside a graph capture would invalidate it; captured
  // graphs hold pool memory only, which is never moved.
  for (int d = 0; d < count; ++d) {
    DeviceAllocators* state = existing(static_cast<c10::DeviceIndex>(d));
    if (state != nullptr && state->pools->routing()) return 0;
  }
  // A safe point runs at op entry, where the GIL may be held: the device
  // synchronize and the page moves need no Python, and the job's other
  // Python threads (a DataLoader's pin-memory thread) run on meanwhile.
  GilReleasedForWait without_gil;  // before the pause: taken back after it ends
  LaunchPause pause(drain_timeout);
  if (!pause) return 0;
  std::size_t moved = 0;
  for (int d = 0; d < count; ++d) {
    DeviceAllocators* state = existing(static_cast<c10::DeviceIndex>(d));
    if (state == nullptr || !state->main->has_pending_migrations()) continue;
    state->backend->synchronize_device();
    state->backend->set_quiescent(true);
    try {
      moved += state->main->apply_pending_migrations();
      state->backend->finish_copies();  // before any launch may touch the moved pages
    } catch (...) {
      try {
        state->backend->finish_copies();
      } catch (...) {
      }
      state->backend->set_quiescent(false);
      throw;
    }
    state->backend->set_quiescent(false);
  }
  return moved;
}

// ---- allocation -------------------------------------------------------------------

void* CotenantCudaAllocator::allocate_on(c10::DeviceIndex device, size_t nbytes, cudaStream_t stream) {
  DeviceAllocators& d = translate_errors([&]() -> DeviceAllocators& { return on(device); });
  CachingAllocator* target = d.main.get();
  std::shared_ptr<CachingAllocator> held_pool;  // the pool allocated in, held (Owner::pool)
  bool graph_pool = false;
  std::optional<c10::cuda::CUDAStreamCaptureModeGuard> relaxed;
  if (d.pools->routing()) {
    // Creating and mapping pages is not capturable; relaxed mode lets this
    // thread call the driver while another stream captures.
    relaxed.emplace(cudaStreamCaptureModeRelaxed);
    PoolId routed{};
    if (std::shared_ptr<CachingAllocator> pool =
            d.pools->route_for(static_cast<StreamId>(reinterpret_cast<std::uintptr_t>(stream)), &routed)) {
      if (std::optional<void*> ptr = allocate_foreign(d, routed, nbytes, stream)) {
        if (*ptr != nullptr) {
          d.several_allocators.store(true, std::memory_order_release);
          note_device_peaks(d);
          if (c10::memoryProfilingEnabled()) report_to_profiler(device, *ptr, static_cast<std::int64_t>(nbytes));
          trace_allocation(*ptr);
        }
        return *ptr;
      }
      target = pool.get();
      held_pool = std::move(pool);
      graph_pool = true;
    }
  }
  // Gathered here, outside the allocator's lock (it takes Python's).
  const HistoryContext context = d.history->gather(ContextLevel::kState);
  MemoryHistory::ContextScope lend_context(context);
  const auto stream_id = static_cast<StreamId>(reinterpret_cast<std::uintptr_t>(stream));
  const bool in_region = !graph_pool && RegionScope::inside();
  auto allocate_once = [&](OnOutOfMemory on_oom) {
    return in_region ? d.regions->allocate(nbytes, stream_id, &target, on_oom)
                     : target->allocate(nbytes, stream_id, on_oom);
  };
  DevicePtr address = 0;
  try {
    address = allocate_once(OnOutOfMemory::kReturnZero);
    if (address == 0 && nbytes > 0) {
      // As PyTorch's allocator does before it reports an OOM, the device's
      // cached memory goes back first: an allocator finds room in its own
      // cache, but the cache of the default pool, a region or a pool nobody
      // holds may be what fills the device. Not while allocations are routed
      // to a pool (a capture): nothing may synchronize then.
      if (!d.pools->routing()) empty_device_cache(d);
      address = allocate_once(OnOutOfMemory::kThrow);
    }
  } catch (const OutOfMemoryError& e) {
    std::vector<c10_alloc::OutOfMemoryObserver> observers;
    {
      std::lock_guard<std::mutex> lock(observers_mutex_);
      observers = oom_observers_;
    }
    if (!observers.empty()) {
      // As PyTorch's allocator calls them: the size that failed, the memory
      // the process may use (the cap where one is set), the device's free.
      const std::uint64_t cap = target->memory_cap();
      std::size_t total = d.backend->device_total_bytes();
      if (cap != kNoCap) total = static_cast<std::size_t>(std::min<std::uint64_t>(cap, total));
      std::size_t free = d.backend->device_free_bytes();
      for (auto& observer : observers) observer(device, nbytes, total, free);
    }
    report_out_of_memory_to_profiler(device, nbytes);
    TORCH_CHECK_WITH(OutOfMemoryError, false, e.what());
  } catch (const Error& e) {
    TORCH_CHECK(false, e.what());
  }
  void* ptr = reinterpret_cast<void*>(address);
  if (ptr != nullptr) {
    {
      std::lock_guard<std::mutex> lock(owners_mutex_);
      owners_[ptr] = Owner{target, std::move(held_pool), device, graph_pool};
    }
    if (target != d.main.get()) d.several_allocators.store(true, std::memory_order_release);
    note_device_peaks(d);
    if (c10::memoryProfilingEnabled()) {
      report_to_profiler(device, ptr, static_cast<std::int64_t>(target->allocation_size(address)));
    }
    trace_allocation(ptr);
  }
  return ptr;
}

c10::DataPtr CotenantCudaAllocator::allocate(size_t nbytes) {
  c10::DeviceIndex device = c10::cuda::current_device();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  void* ptr = allocate_on(device, nbytes, stream);
  return {ptr, ptr, &delete_with_cotenant, c10::Device(c10::DeviceType::CUDA, device)};
}

c10::DeleterFnPtr CotenantCudaAllocator::raw_deleter() const { return &delete_with_cotenant; }

void CotenantCudaAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
}

void* CotenantCudaAllocator::raw_alloc(size_t nbytes) {
  c10::DeviceIndex device = c10::cuda::current_device();
  return allocate_on(device, nbytes, c10::cuda::getCurrentCUDAStream(device).stream());
}

void* CotenantCudaAllocator::raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) {
  return allocate_on(c10::cuda::current_device(), nbytes, stream);
}

CotenantCudaAllocator::Owner CotenantCudaAllocator::owner_of(void* ptr) const {
  std::lock_guard<std::mutex> lock(owners_mutex_);
  auto it = owners_.find(ptr);
  return it == owners_.end() ? Owner{} : it->second;
}

void CotenantCudaAllocator::raw_delete(void* ptr) noexcept {
  if (ptr == nullptr) return;
  try {
    free_owned(ptr);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cotenant: freeing CUDA memory at %p failed, so it stays allocated: %s\n", ptr,
                 e.what());
  } catch (...) {
    std::fprintf(stderr, "cotenant: freeing CUDA memory at %p failed, so it stays allocated\n", ptr);
  }
}

void CotenantCudaAllocator::free_owned(void* ptr) {
  Owner owner;
  {
    std::lock_guard<std::mutex> lock(owners_mutex_);
    auto it = owners_.find(ptr);
    if (it == owners_.end()) {
      throw Error("cotenant's CUDA allocator was asked to free an address it did not allocate. This happens "
                  "when memory from PyTorch's own allocator outlives the switch to cotenant; call "
                  "cotenant.enable() before the first CUDA allocation.");
    }
    owner = std::move(it.value());
    owners_.erase(it);
  }
  // As PyTorch's allocator: the trace hooks hear of the free before it
  // happens. A hook that throws does not keep the memory.
  try {
    trace_deallocation(ptr);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cotenant: a GPU trace hook failed on the free of %p: %s\n", ptr, e.what());
  }
  if (owner.used_on_other_streams && !owner.foreign && defer_free_until_routes_end(ptr, owner)) return;
  release_owned(ptr, owner);
}

void CotenantCudaAllocator::release_owned(void* ptr, const Owner& owner) {
  // The bytes the profiler hears of are the allocation's as allocated
  // (rounded), read while it is live.
  const bool profiling = c10::memoryProfilingEnabled();
  std::int64_t freed_bytes = 0;
  try {
    DeviceAllocators* d = existing(owner.device);
    std::optional<c10::cuda::CUDAStreamCaptureModeGuard> relaxed;
    if (d != nullptr && d->pools->routing()) relaxed.emplace(cudaStreamCaptureModeRelaxed);
    if (owner.foreign) {
      if (profiling) {
        std::lock_guard<std::mutex> lock(d->foreign_mutex);
        auto it = d->foreign_blocks.find(ptr);
        if (it != d->foreign_blocks.end()) freed_bytes = static_cast<std::int64_t>(it->second.bytes);
      }
      free_foreign(*d, ptr);
    } else {
      const auto address = reinterpret_cast<DevicePtr>(ptr);
      if (profiling) freed_bytes = static_cast<std::int64_t>(owner.allocator->allocation_size(address));
      const HistoryContext context = d != nullptr ? d->history->gather(ContextLevel::kAll) : HistoryContext{};
      MemoryHistory::ContextScope lend_context(context);
      owner.allocator->free(address);
    }
  } catch (...) {
    // The block is still allocated (CachingAllocator::free changes nothing
    // when it throws), so no allocation can have reused the address.
    std::lock_guard<std::mutex> lock(owners_mutex_);
    owners_.emplace(ptr, owner);
    throw;
  }
  if (profiling) report_to_profiler(owner.device, ptr, -freed_bytes);
}

bool CotenantCudaAllocator::defer_free_until_routes_end(void* ptr, const Owner& owner) {
  DeviceAllocators* d = existing(owner.device);
  // Checked and queued under the one lock that release_deferred_frees
  // drains under, after the last route ended: a free queued here is drained.
  std::lock_guard<std::mutex> lock(deferred_mutex_);
  if (d == nullptr || !d->pools->routing()) return false;
  deferred_frees_.emplace_back(ptr, owner);
  return true;
}

void CotenantCudaAllocator::release_deferred_frees(c10::DeviceIndex device) {
  DeviceAllocators* d = existing(device);
  std::vector<std::pair<void*, Owner>> ready;
  {
    std::lock_guard<std::mutex> lock(deferred_mutex_);
    if (d == nullptr || d->pools->routing()) return;
    auto kept = std::stable_partition(deferred_frees_.begin(), deferred_frees_.end(),
                                      [device](const auto& entry) { return entry.second.device != device; });
    ready.assign(kept, deferred_frees_.end());
    deferred_frees_.erase(kept, deferred_frees_.end());
  }
  for (const auto& [ptr, owner] : ready) {
    try {
      release_owned(ptr, owner);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "cotenant: freeing CUDA memory at %p failed, so it stays allocated: %s\n", ptr,
                   e.what());
    }
  }
}

void CotenantCudaAllocator::recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) {
  if (ptr.get() == nullptr) return;
  // Views and storages made with a custom deleter are not ours to track.
  if (ptr.get_deleter() != &delete_with_cotenant) return;
  Owner owner = owner_of(ptr.get());
  DeviceAllocators* d = existing(owner.device);
  if (owner.foreign && d != nullptr) {
    // Waited for at its free (the pool's allocator frees at once).
    std::lock_guard<std::mutex> lock(d->foreign_mutex);
    auto it = d->foreign_blocks.find(ptr.get());
    if (it != d->foreign_blocks.end() &&
        std::find(it->second.streams.begin(), it->second.streams.end(), stream.stream()) == it->second.streams.end()) {
      it->second.streams.push_back(stream.stream());
    }
    return;
  }
  if (owner.allocator == nullptr) return;
  // Bookkeeping only, even inside a capture: the events are recorded at the
  // free, which waits for the end of the routes when one is active
  // (defer_free_until_routes_end).
  translate_errors([&] {
    owner.allocator->record_stream(reinterpret_cast<DevicePtr>(ptr.get()),
                                   static_cast<StreamId>(reinterpret_cast<std::uintptr_t>(stream.stream())));
  });
  std::lock_guard<std::mutex> lock(owners_mutex_);
  auto it = owners_.find(ptr.get());
  if (it != owners_.end()) it.value().used_on_other_streams = true;
}

// ---- device-wide operations ---------------------------------------------------------

bool CotenantCudaAllocator::initialized() { return device_count_.load(std::memory_order_acquire) > 0; }

void CotenantCudaAllocator::init(int device_count) {
  TORCH_CHECK(device_count <= static_cast<int>(devices_.size()), "cotenant supports at most ",
              devices_.size(), " CUDA devices per process; this process sees ", device_count, ".");
  device_count_.store(device_count, std::memory_order_release);
}

std::vector<std::shared_ptr<CachingAllocator>> CotenantCudaAllocator::allocators_of(DeviceAllocators& d,
                                                                                    c10::MempoolId_t mempool_id) {
  // Not owned: the device's own allocators (an empty owner, the pointer kept).
  auto device_owned = [](CachingAllocator* allocator) {
    return std::shared_ptr<CachingAllocator>(std::shared_ptr<void>(), allocator);
  };
  std::vector<std::shared_ptr<CachingAllocator>> out;
  if (mempool_id == kDefaultPool) {
    out.push_back(device_owned(d.main.get()));
    for (auto& [id, pool] : d.pools->pools()) out.push_back(std::move(pool));
    for (auto& [name, region] : d.regions->allocators()) out.push_back(device_owned(region));
  } else if (std::shared_ptr<CachingAllocator> pool = d.pools->find(pool_id(mempool_id))) {
    out.push_back(std::move(pool));
  }
  return out;
}

void CotenantCudaAllocator::empty_device_cache(DeviceAllocators& d) {
  d.main->empty_cache();
  d.pools->empty_freeable();
  for (auto& [name, region] : d.regions->allocators()) region->empty_cache();
}

void CotenantCudaAllocator::emptyCache(c10::MempoolId_t mempool_id) {
  // As PyTorch does: the default pool's cache, and the pools no graph or
  // MemPool holds any more. A held pool keeps its pages: its graphs replay
  // on them, freed blocks included.
  for_each_device([&](DeviceAllocators& d) {
    translate_errors([&] {
      if (mempool_id == kDefaultPool) {
        empty_device_cache(d);
      } else {
        const PoolId only = pool_id(mempool_id);
        d.pools->empty_freeable(&only);
      }
    });
  });
}

c10::CachingDeviceAllocator::DeviceStats CotenantCudaAllocator::getDeviceStats(c10::DeviceIndex device) {
  DeviceAllocators* d = existing(device);
  if (d == nullptr) {  // nothing allocated on it yet
    c10::CachingDeviceAllocator::DeviceStats none;
    none.max_split_size = -1;  // as device_stats() says it, and PyTorch before its first allocation
    return none;
  }
  return device_stats(*d);
}

namespace {

// Calls fn(const AllocatorStats&) for each allocator of `d` but its main one:
// each pool read under the pool table's lock (this runs on every allocation,
// beside threads that may drop a pool), the regions, and the MemPools with
// an allocator of their own, whose memory counts as device-resident.
template <typename Fn>
void for_each_allocator_besides_main(DeviceAllocators& d, Fn&& fn) {
  d.pools->for_each_pool([&](PoolId, const CachingAllocator& pool) { fn(pool.stats()); });
  for (auto& [name, region] : d.regions->allocators()) fn(region->stats());  // regions are never dropped
  std::lock_guard<std::mutex> lock(d.foreign_mutex);
  AllocatorStats foreign = d.foreign_stats;
  foreign.device_resident_bytes.current = foreign.reserved_bytes.all.current;
  foreign.device_resident_bytes.peak = foreign.reserved_bytes.all.peak;
  fn(foreign);
}

}  // namespace

c10::CachingDeviceAllocator::DeviceStats CotenantCudaAllocator::summed_stats(
    DeviceAllocators& d, c10::CachingDeviceAllocator::DeviceStats* highest_own) {
  using c10::CachingAllocator::StatArray;
  c10::CachingDeviceAllocator::DeviceStats out;
  auto add = [&](const AllocatorStats& stats) {
    add_stats(out, stats);
    if (highest_own == nullptr) return;
    c10::CachingDeviceAllocator::DeviceStats own;
    add_stats(own, stats);
    for_each_stat_array([](StatArray& highest, const StatArray& one) {
      for (std::size_t i = 0; i < highest.size(); ++i) highest[i].peak = std::max(highest[i].peak, one[i].peak);
    }, *highest_own, own);
  };
  // As allocators_of(d, kDefaultPool), each read under its table's lock.
  add(d.main->stats());
  for_each_allocator_besides_main(d, add);
  return out;
}

AllocatorStats CotenantCudaAllocator::stats_besides_main(DeviceAllocators& d) {
  AllocatorStats out;
  for_each_allocator_besides_main(d, [&](const AllocatorStats& stats) { out.add(stats); });
  return out;
}

c10::CachingDeviceAllocator::DeviceStats CotenantCudaAllocator::device_stats(DeviceAllocators& d) {
  using c10::CachingAllocator::StatArray;
  c10::CachingDeviceAllocator::DeviceStats highest_own;
  c10::CachingDeviceAllocator::DeviceStats out = summed_stats(d, &highest_own);
  // The device's peak is at least each allocator's own, the highest total
  // seen after an allocation, and the total now.
  std::lock_guard<std::mutex> lock(d.peaks_mutex);
  for_each_stat_array([](StatArray& sum, const StatArray& own, const StatArray& kept) {
    for (std::size_t i = 0; i < sum.size(); ++i) sum[i].peak = std::max({own[i].peak, kept[i].peak, sum[i].current});
  }, out, highest_own, d.peaks);
  out.max_split_size = -1;  // blocks of any size may split: PyTorch's default, SIZE_MAX as int64
  return out;
}

void CotenantCudaAllocator::note_device_peaks(DeviceAllocators& d) {
  using c10::CachingAllocator::StatArray;
  if (!d.several_allocators.load(std::memory_order_acquire)) return;
  c10::CachingDeviceAllocator::DeviceStats now = summed_stats(d);
  std::lock_guard<std::mutex> lock(d.peaks_mutex);
  for_each_stat_array([](StatArray& kept, const StatArray& total) {
    for (std::size_t i = 0; i < kept.size(); ++i) kept[i].peak = std::max(kept[i].peak, total[i].current);
  }, d.peaks, now);
}

void CotenantCudaAllocator::resetAccumulatedStats(c10::DeviceIndex device) {
  if (DeviceAllocators* d = existing(device)) {
    for (const auto& a : allocators_of(*d, kDefaultPool)) a->reset_accumulated_stats();
    std::lock_guard<std::mutex> lock(d->foreign_mutex);
    d->foreign_stats.reset_accumulated();
  }
}

void CotenantCudaAllocator::resetPeakStats(c10::DeviceIndex device) {
  using c10::CachingAllocator::StatArray;
  DeviceAllocators* d = existing(device);
  if (d == nullptr) return;
  for (const auto& a : allocators_of(*d, kDefaultPool)) a->reset_peak_stats();
  {
    std::lock_guard<std::mutex> lock(d->foreign_mutex);
    d->foreign_stats.reset_peaks();
  }
  c10::CachingDeviceAllocator::DeviceStats now = summed_stats(*d);
  std::lock_guard<std::mutex> lock(d->peaks_mutex);
  for_each_stat_array([](StatArray& kept, const StatArray& total) {
    for (std::size_t i = 0; i < kept.size(); ++i) kept[i].peak = total[i].current;
  }, d->peaks, now);
}

double CotenantCudaAllocator::getMemoryFraction(c10::DeviceIndex device) {
  DeviceAllocators& d = translate_errors([&]() -> DeviceAllocators& { return on(device); });
  std::uint64_t cap = job_cap(d);
  if (cap == kNoCap) return 1.0;
  return static_cast<double>(cap) / static_cast<double>(d.backend->device_total_bytes());
}

void CotenantCudaAllocator::setMemoryFraction(double fraction, c10::DeviceIndex device) {
  TORCH_CHECK(fraction > 0.0 && fraction <= 1.0, "torch.cuda.set_per_process_memory_fraction(",
              fraction, ") is outside (0, 1]; pass a fraction of the device's memory, e.g. 0.5.");
  DeviceAllocators& d = translate_errors([&]() -> DeviceAllocators& { return on(device); });
  // Under cotenant the fraction is the user's memory cap on the job: memory
  // above it spills to the host instead of raising OutOfMemoryError.
  translate_errors([&] {
    set_job_cap(d, CapSource::kUser, Cap::of_fraction(fraction).to_word(d.backend->device_total_bytes()));
    follow_job_cap(d, /*always=*/true);
  });
}

std::vector<c10_alloc::StreamSegmentSize> CotenantCudaAllocator::getExpandableSegmentSizes(
    c10::DeviceIndex /*device*/) {
  return {};  // cotenant has no expandable segments: every segment is page-mapped from the start
}

void CotenantCudaAllocator::enable(bool value) { enabled_.store(value); }
bool CotenantCudaAllocator::isEnabled() const { return enabled_.load(); }

void CotenantCudaAllocator::cacheInfo(c10::DeviceIndex device, size_t* largestBlock) {
  DeviceAllocators& d = translate_errors([&]() -> DeviceAllocators& { return on(device); });
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  const auto stream_id = static_cast<StreamId>(reinterpret_cast<std::uintptr_t>(stream));
  // The allocator this thread's next allocation on the current stream goes
  // to, as allocate_on() picks it: a captured or MemPool route, the
  // thread's region, else the main one. PyTorch's own reads every pool, but
  // a block of another pool cannot serve the workspace cuDNN sizes by this.
  CachingAllocator* target = d.main.get();
  std::shared_ptr<CachingAllocator> held_pool;
  PoolId routed{};
  if (d.pools->routing() && (held_pool = d.pools->route_for(stream_id, &routed))) {
    std::lock_guard<std::mutex> lock(d.foreign_mutex);
    // Another allocator's pool: its blocks are not cotenant's to read.
    target = d.foreign_pools.count(routed) != 0 ? nullptr : held_pool.get();
  } else if (RegionScope::inside()) {
    target = nullptr;  // a region not yet allocated in holds no block
    for (auto& [name, region] : d.regions->allocators()) {
      if (name == RegionScope::current()) target = region;
    }
  }
  translate_errors([&] {
    // PyTorch's convention: a zero input asks for an initial guess, the
    // free device memory; under a cap, no more than the room below it
    // (beyond it an allocation lands on the host).
    std::size_t room = d.backend->device_free_bytes();
    if (target != nullptr) {
      AllocatorStats s = target->stats();
      if (s.memory_cap != kNoCap) {
        auto resident = static_cast<std::uint64_t>(std::max<std::int64_t>(s.device_resident_bytes.current, 0));
        room = std::min<std::size_t>(room, s.memory_cap > resident ? s.memory_cap - resident : 0);
      }
    }
    if (*largestBlock == 0) *largestBlock = room;
    if (target != nullptr) *largestBlock = std::max(*largestBlock, target->largest_free_block(stream_id, room));
  });
}

void* CotenantCudaAllocator::getBaseAllocation(void* ptr, size_t* size) {
  Owner owner = owner_of(ptr);
  if (owner.foreign) {
    // What the pool's allocator returned is all cotenant knows of it.
    DeviceAllocators* d = existing(owner.device);
    std::lock_guard<std::mutex> lock(d->foreign_mutex);
    auto it = d->foreign_blocks.find(ptr);
    TORCH_CHECK(it != d->foreign_blocks.end(), "getBaseAllocation: ", ptr, " was freed.");
    if (size != nullptr) *size = it->second.bytes;
    return ptr;
  }
  TORCH_CHECK(owner.allocator != nullptr, "getBaseAllocation: ", ptr,
              " is not a live allocation of cotenant's CUDA allocator.");
  const auto address = reinterpret_cast<DevicePtr>(ptr);
  for (const SegmentInfo& segment : owner.allocator->snapshot()) {
    if (address >= segment.address && address < segment.address + segment.size) {
      if (size != nullptr) *size = segment.size;
      return reinterpret_cast<void*>(segment.address);
    }
  }
  TORCH_CHECK(false, "getBaseAllocation: no segment holds ", ptr, ".");
}

c10_alloc::SnapshotInfo CotenantCudaAllocator::snapshot(c10::MempoolId_t mempool_id, bool include_traces) {
  c10_alloc::SnapshotInfo out;
  const int count = device_count_.load();
  out.device_traces.resize(static_cast<size_t>(std::max(count, 0)));
  for (int dev = 0; dev < count; ++dev) {
    DeviceAllocators* d = existing(static_cast<c10::DeviceIndex>(dev));
    if (d == nullptr) continue;
    std::vector<std::pair<c10::MempoolId_t, CachingAllocator*>> sources;
    if (mempool_id == kDefaultPool) {
      sources.emplace_back(kDefaultPool, d->main.get());
      for (auto& [name, region] : d->regions->allocators()) sources.emplace_back(kDefaultPool, region);
    }
    const auto pools = d->pools->pools();  // held while their segments are read
    for (const auto& [id, pool] : pools) {
      const c10::MempoolId_t torch_id{id.first, id.second};
      if (mempool_id == kDefaultPool || mempool_id == torch_id) sources.emplace_back(torch_id, pool.get());
    }
    for (auto& [id, allocator] : sources) add_segments_to_snapshot(*d, *allocator, id, out);
    add_foreign_segments_to_snapshot(*d, mempool_id, out);
    add_history_to_snapshot(*d, out, include_traces);
  }
  out.config_metadata.garbage_collection_threshold = 0.0;
  out.config_metadata.max_split_size = std::numeric_limits<size_t>::max();
  out.config_metadata.pinned_num_register_threads = 1;
  out.config_metadata.expandable_segments = false;
  out.config_metadata.release_lock_on_malloc = false;
  out.config_metadata.pinned_use_host_register = false;
  out.config_metadata.graph_capture_record_stream_reuse = false;
  out.config_metadata.last_allocator_settings = "cotenant";
  return out;
}

// ---- CUDA graph pools -----------------------------------------------------------------

void CotenantCudaAllocator::createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                                               std::shared_ptr<c10_alloc::CUDAAllocator> allocator) {
  DeviceAllocators& d = translate_errors([&]() -> DeviceAllocators& { return on(device); });
  if (allocator != nullptr && allocator.get() != this) {
    std::lock_guard<std::mutex> lock(d.foreign_mutex);
    d.foreign_pools.emplace(pool_id(mempool_id), std::move(allocator));
  }
  d.pools->create_or_incref(pool_id(mempool_id));
  attach_history(d);  // a new pool's allocator reports to the history too
}

void CotenantCudaAllocator::beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                                                std::function<bool(cudaStream_t)> filter) {
  DeviceAllocators& d = translate_errors([&]() -> DeviceAllocators& { return on(device); });
  translate_errors([&] {
    d.pools->begin_route(pool_id(mempool_id), [filter = std::move(filter)](StreamId stream) {
      return filter(reinterpret_cast<cudaStream_t>(static_cast<std::uintptr_t>(stream)));
    });
  });
  d.backend->set_graph_capture(true);
  attach_history(d);
}

void CotenantCudaAllocator::endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) {
  DeviceAllocators* d = existing(device);
  if (d == nullptr) return;
  d->pools->end_route(pool_id(mempool_id));
  d->backend->set_graph_capture(d->pools->routing());
  release_deferred_frees(device);
}

void CotenantCudaAllocator::releasePool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) {
  DeviceAllocators* d = existing(device);
  if (d == nullptr) return;
  translate_errors([&] { d->pools->release(pool_id(mempool_id)); });
}

int CotenantCudaAllocator::getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t mempool_id) {
  DeviceAllocators* d = existing(device);
  return d == nullptr ? 0 : d->pools->use_count(pool_id(mempool_id));
}

void CotenantCudaAllocator::setUseOnOOM(c10::DeviceIndex, c10::MempoolId_t, bool use_on_oom) {
  // ~MemPool calls this with false: that must never throw.
  TORCH_CHECK(!use_on_oom,
              "torch.cuda.MemPool(use_on_oom=True) is not supported while cotenant manages CUDA "
              "memory: cotenant never runs out of device memory under its cap, it spills to host "
              "memory instead. Create the MemPool without use_on_oom.");
}

void CotenantCudaAllocator::setNoSplit(c10::DeviceIndex device, c10::MempoolId_t mempool_id) {
  // A pool with its own allocator splits nothing already: each allocation is
  // one call to that allocator.
  if (DeviceAllocators* d = existing(device)) {
    std::lock_guard<std::mutex> lock(d->foreign_mutex);
    if (d->foreign_pools.count(pool_id(mempool_id)) != 0) return;
  }
  TORCH_CHECK(false,
              "torch.cuda.MemPool(no_split=True) is not supported while cotenant manages CUDA "
              "memory; create the MemPool without no_split.");
}

// ---- MemPools with their own allocator ---------------------------------------------------

namespace {
PoolKind foreign_pool_kind(std::size_t bytes) {
  return bytes <= AllocatorOptions{}.small_request_max ? PoolKind::kSmall : PoolKind::kLarge;
}

// An allocation of a MemPool's own allocator, as memory_stats counts a
// segment that holds one block (+1) or its free (-1).
void count_foreign(AllocatorStats& stats, std::size_t bytes, int sign) {
  const PoolKind pool = foreign_pool_kind(bytes);
  const auto amount = static_cast<std::int64_t>(bytes);
  for (PooledStat* counter : {&stats.allocated_bytes, &stats.reserved_bytes, &stats.active_bytes,
                              &stats.requested_bytes}) {
    if (sign > 0) counter->increase(pool, amount);
    else counter->decrease(pool, amount);
  }
  for (PooledStat* counter : {&stats.allocation, &stats.segment, &stats.active}) {
    if (sign > 0) counter->increase(pool, 1);
    else counter->decrease(pool, 1);
  }
}
}  // namespace

std::optional<void*> CotenantCudaAllocator::allocate_foreign(DeviceAllocators& d, PoolId pool, size_t nbytes,
                                                             cudaStream_t stream) {
  c10_alloc::CUDAAllocator* allocator = nullptr;
  {
    std::lock_guard<std::mutex> lock(d.foreign_mutex);
    auto it = d.foreign_pools.find(pool);
    if (it == d.foreign_pools.end()) return std::nullopt;
    allocator = it->second.get();
  }
  if (nbytes == 0) return nullptr;
  // Outside every lock of cotenant's: the allocator may call back into
  // Python (a ctypes function) or into the CUDA driver.
  void* ptr = allocator->raw_alloc_with_stream(nbytes, stream);
  TORCH_CHECK_WITH(OutOfMemoryError, ptr != nullptr, "The allocator of the torch.cuda.MemPool in use (",
                   allocator->name(), ") returned no memory for ", nbytes,
                   " bytes. That memory is the pool's allocator's, not cotenant's: free some of it, or "
                   "allocate outside the pool.");
  {
    std::lock_guard<std::mutex> lock(d.foreign_mutex);
    d.foreign_blocks[ptr] = DeviceAllocators::ForeignBlock{allocator, pool, nbytes, {}};
    count_foreign(d.foreign_stats, nbytes, +1);
  }
  std::lock_guard<std::mutex> lock(owners_mutex_);
  owners_[ptr] = Owner{nullptr, nullptr, d.device, /*graph_pool=*/true, /*foreign=*/true};
  return ptr;
}

void CotenantCudaAllocator::free_foreign(DeviceAllocators& d, void* ptr) {
  DeviceAllocators::ForeignBlock block;
  {
    std::lock_guard<std::mutex> lock(d.foreign_mutex);
    block = d.foreign_blocks.at(ptr);
  }
  // The pool's allocator frees at once: work queued on other streams that
  // use the block (record_stream) finishes first.
  for (cudaStream_t stream : block.streams) C10_CUDA_CHECK(cudaStreamSynchronize(stream));
  block.allocator->raw_delete(ptr);
  std::lock_guard<std::mutex> lock(d.foreign_mutex);
  d.foreign_blocks.erase(ptr);
  count_foreign(d.foreign_stats, block.bytes, -1);
}

void CotenantCudaAllocator::add_foreign_segments_to_snapshot(DeviceAllocators& d, c10::MempoolId_t mempool_id,
                                                             c10_alloc::SnapshotInfo& out) {
  std::lock_guard<std::mutex> lock(d.foreign_mutex);
  std::vector<std::pair<void*, const DeviceAllocators::ForeignBlock*>> blocks;
  for (const auto& [ptr, block] : d.foreign_blocks) {
    const c10::MempoolId_t torch_id{block.pool.first, block.pool.second};
    if (mempool_id == kDefaultPool || mempool_id == torch_id) blocks.emplace_back(ptr, &block);
  }
  std::sort(blocks.begin(), blocks.end());
  for (const auto& [ptr, block] : blocks) {
    c10::CachingDeviceAllocator::SegmentInfo segment;
    segment.device = d.device;
    segment.address = reinterpret_cast<std::size_t>(ptr);
    segment.total_size = segment.allocated_size = segment.active_size = segment.requested_size = block->bytes;
    segment.is_large = foreign_pool_kind(block->bytes) == PoolKind::kLarge;
    segment.owner_private_pool_id = {block->pool.first, block->pool.second};
    c10::CachingDeviceAllocator::BlockInfo info;
    info.size = info.requested_size = block->bytes;
    info.allocated = info.active = true;
    segment.blocks.push_back(std::move(info));
    out.segments.push_back(std::move(segment));
  }
}

bool CotenantCudaAllocator::checkPoolLiveAllocations(
    c10::DeviceIndex device, c10::MempoolId_t mempool_id,
    const std::unordered_set<void*>& expected_live_allocations) {
  DeviceAllocators* d = existing(device);
  if (d == nullptr) return expected_live_allocations.empty();
  std::size_t live = 0;
  for (const auto& a : allocators_of(*d, mempool_id)) {
    if (mempool_id == kDefaultPool && a.get() != d->main.get()) continue;
    for (const SegmentInfo& segment : a->snapshot()) {
      for (const BlockInfo& block : segment.blocks) {
        if (!block.allocated) continue;
        ++live;
        if (!expected_live_allocations.count(reinterpret_cast<void*>(block.address))) return false;
      }
    }
  }
  return live == expected_live_allocations.size();
}

namespace {
// A graph pool's allocations as CUDA graph trees checkpoint them: the
// pool's snapshot, restored by CachingAllocator::restore_allocations.
struct PoolCheckpoint final : c10_alloc::AllocatorState {
  c10::DeviceIndex device = 0;
  c10::MempoolId_t pool{0, 0};
  std::vector<SegmentInfo> segments;
};
}  // namespace

std::shared_ptr<c10_alloc::AllocatorState> CotenantCudaAllocator::getCheckpointState(c10::DeviceIndex device,
                                                                                   c10::MempoolId_t id) {
  DeviceAllocators* d = existing(device);
  const std::shared_ptr<CachingAllocator> pool =
      d != nullptr && id != kDefaultPool ? d->pools->find(pool_id(id)) : nullptr;
  TORCH_CHECK(pool != nullptr, "cannot checkpoint memory pool (", id.first, ", ", id.second, ") of CUDA device ",
              static_cast<int>(device), ": cotenant knows no such graph pool there (checkpoints are of the pools "
              "CUDA graphs and torch.cuda.MemPool create)");
  auto checkpoint = std::make_shared<PoolCheckpoint>();
  checkpoint->device = device;
  checkpoint->pool = id;
  checkpoint->segments = pool->snapshot();
  return checkpoint;
}

c10_alloc::CheckpointDelta CotenantCudaAllocator::setCheckpointPoolState(
    c10::DeviceIndex device, std::shared_ptr<c10_alloc::AllocatorState> state) {
  auto checkpoint = std::dynamic_pointer_cast<PoolCheckpoint>(state);
  TORCH_CHECK(checkpoint != nullptr && checkpoint->device == device,
              "cannot restore a memory pool checkpoint that cotenant did not take on CUDA device ",
              static_cast<int>(device), "; take it with torch._C._cuda_getCheckpointState on the same device");
  DeviceAllocators* d = existing(device);
  const std::shared_ptr<CachingAllocator> pool = d != nullptr ? d->pools->find(pool_id(checkpoint->pool)) : nullptr;
  TORCH_CHECK(pool != nullptr, "cannot restore the checkpoint of memory pool (", checkpoint->pool.first, ", ",
              checkpoint->pool.second, "): the pool was released since");
  CachingAllocator::Restored restored;
  {
    // Gathered outside the allocator's lock (it takes Python's).
    const HistoryContext context = d->history->gather(ContextLevel::kState);
    MemoryHistory::ContextScope lend_context(context);
    translate_errors([&] { restored = pool->restore_allocations(checkpoint->segments); });
  }
  {
    // The pool's addresses change owners as its blocks did (only the graph
    // tree that owns the pool allocates from it meanwhile).
    std::lock_guard<std::mutex> lock(owners_mutex_);
    for (DevicePtr address : restored.freed) owners_.erase(reinterpret_cast<void*>(address));
    for (DevicePtr address : restored.allocated) {
      owners_[reinterpret_cast<void*>(address)] = Owner{pool.get(), pool, device, /*graph_pool=*/true};
    }
  }
  d->several_allocators.store(true, std::memory_order_release);
  note_device_peaks(*d);
  c10_alloc::CheckpointDelta delta;
  for (DevicePtr address : restored.freed) delta.ptrs_freed.push_back(reinterpret_cast<void*>(address));
  for (DevicePtr address : restored.allocated) {
    void* ptr = reinterpret_cast<void*>(address);
    delta.dataptrs_allocd.emplace_back(ptr, ptr, &delete_with_cotenant, c10::Device(c10::DeviceType::CUDA, device));
  }
  return delta;
}

// ---- IPC, observers, peers (memory history: cuda_allocator_history.cpp) ------------------------------------------------------

c10_alloc::ShareableHandle CotenantCudaAllocator::shareIpcHandle(void* /*ptr*/) {
  TORCH_CHECK(false,
              "Sharing a CUDA tensor with another process (torch.multiprocessing, IPC handles) is "
              "not supported while cotenant manages CUDA memory: its pages may move to the host "
              "at any safe point. Share CPU tensors instead, or run this process without cotenant "
              "(COTENANT_DISABLE=1).");
}

std::shared_ptr<void> CotenantCudaAllocator::getIpcDevPtr(std::string /*handle*/) {
  TORCH_CHECK(false,
              "Opening a CUDA tensor shared by another process (torch.multiprocessing, IPC handles) "
              "is not supported while cotenant manages CUDA memory in this process. Receive CPU "
              "tensors instead, or run this process without cotenant (COTENANT_DISABLE=1).");
}

void CotenantCudaAllocator::attachOutOfMemoryObserver(c10_alloc::OutOfMemoryObserver observer) {
  std::lock_guard<std::mutex> lock(observers_mutex_);
  oom_observers_.push_back(std::move(observer));
}

void CotenantCudaAllocator::enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) {
  {
    c10::cuda::CUDAGuard guard(dev);
    cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
    } else {
      C10_CUDA_CHECK(err);
    }
  }
  // Runtime peer access does not reach VMM mappings: kernels on `dev` reach
  // `dev_to_access`'s pages only once those pages grant it access.
  DeviceAllocators& target = translate_errors([&]() -> DeviceAllocators& { return on(dev_to_access); });
  translate_errors([&] { target.backend->grant_access(dev); });
}

cudaError_t CotenantCudaAllocator::memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice,
                                               size_t count, cudaStream_t stream, bool /*p2p_enabled*/) {
  // cotenant's memory is VMM-mapped for its own device only, so copies
  // between devices always take the peer path, which works for it.
  if (dstDevice == srcDevice) return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
  return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
}

}  // namespace cotenant::torch_ext
