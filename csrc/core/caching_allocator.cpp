#include "cotenant/caching_allocator.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <exception>
#include <map>
#include <mutex>

#include "cotenant/address_map.h"
#include "cotenant/errors.h"
#include "cotenant/size.h"
#include "cotenant/spill_policy.h"
#include "segment.h"
#include "step_plan.h"

namespace cotenant {

using detail::Block;
using detail::BlockPool;
using detail::Page;
using detail::Segment;
using detail::StepPlan;

namespace {

// `multiple` is a power of two (the page granularity, or the rounding that
// divides it: the State's constructor checks both); a mask, not a division,
// since every allocation rounds twice.
std::size_t round_up(std::size_t value, std::size_t multiple) {
  return (value + multiple - 1) & ~(multiple - 1);
}

}  // namespace

// Everything behind the mutex. The fast path of allocate() is: best fit in a
// pool, split, check the block's pages are mapped, count; once a loop is
// warm it and free() ask the heap for nothing (spare_blocks, the live
// map's slots, the pools' kept nodes; tests/cpp/heap counts it). Page
// creation, cache release, spilling and migration are the slow paths.
struct CachingAllocator::State {
  State(Backend& backend, AllocatorOptions options, std::shared_ptr<HostPagePool> shared_host_pages)
      : backend(backend),
        options(options),
        page_bytes(backend.granularity()),
        page_shift(static_cast<unsigned>(__builtin_ctzll(page_bytes | (std::size_t{1} << 63)))),
        device_total(backend.device_total_bytes()),
        host_pages(shared_host_pages ? std::move(shared_host_pages) : std::make_shared<HostPagePool>(backend)) {
    if (&host_pages->backend() != &backend) {
      throw Error("an allocator's host page pool must be of the allocator's own backend (one pool per device)");
    }
    if (!is_page_size(page_bytes)) {
      throw Error(fmt::format("the backend's page granularity ({} bytes) is not a power of two; a driver's "
                              "always is (2 MiB on current GPUs): check the backend's granularity()",
                              page_bytes));
    }
    if (options.round_bytes == 0 || page_bytes % options.round_bytes != 0) {
      throw Error(fmt::format("the allocator's rounding ({} bytes) must divide the page granularity ({} bytes)",
                              options.round_bytes, page_bytes));
    }
  }

  Backend& backend;
  const AllocatorOptions options;
  const std::size_t page_bytes;
  const unsigned page_shift;  // page_bytes == 1 << page_shift: a page's index is a shift, not a division
  // The device's size, read once: it does not change, and every allocation
  // compares with it (on the CUDA backend the query is a cudaMemGetInfo).
  const std::size_t device_total;

  mutable std::mutex mutex;
  std::map<DevicePtr, std::unique_ptr<Segment>> segments;  // by base address
  BlockPool free_blocks;                                   // best fit over every arena
  StepPlan step_plan;                                      // the step before, once the loop repeats
  bool mapped_this_step = false;                           // an allocation mapped a page since the last mark
  // The same free blocks by address, kept while step_plan is active (it
  // finds the hole holding a planned range); empty otherwise.
  detail::BlockSet<detail::ByAddress> free_by_address;
  BlockPool pinned_free;                                   // freed pinned fallback segments, kept
  // Live blocks by address (a std::unordered_map took a division by a prime
  // per lookup and a node per entry: a fifth of an alloc+free pair's time).
  using LiveMap = AddressMap<DevicePtr, Block*>;
  LiveMap allocated;
  // Blocks that a merge or a free gave up, reused by the next cut: the fast
  // path then asks the heap for nothing once the job's layout has been
  // reached.
  std::vector<std::unique_ptr<Block>> spare_blocks;
  std::vector<Block*> waiting;                             // freed, held back by events
  std::vector<EventHandle> spare_events;
  AllocatorStats stats;
  std::uint64_t cap = kNoCap;
  bool spill_everything = false;  // spill_all() in force until restore_all()
  std::uint64_t tick = 0;         // counts allocations and marks; a page's heat is the tick of its last use
  // Bytes of mapped pages no live block touches, by residency: lets the
  // allocation slow path skip a scan for cache when there is none.
  std::size_t cached_bytes[2] = {0, 0};
  // The tick of the last iteration mark: a cached page last used before it
  // is cold. 0: no mark yet.
  std::uint64_t cold_before = 0;
  // The tick of the mark before that one (0 until two marks): a cached page
  // used since then is part of the loop's layout (unused_before()).
  std::uint64_t previous_mark = 0;
  // Reserved bytes the cold-cache rule lets the arena reach whatever the
  // live peak: where the rule's releases keep coming back, it stops at the
  // footprint the loop showed it needs (back_block). 0 until then, and
  // again after empty_cache().
  std::int64_t cold_rule_floor = 0;
  // Peak allocated bytes since the last iteration mark, and over the
  // iteration before it (-1 before the first mark): how much a step still
  // allocates from any point on, if it repeats the last one.
  std::int64_t iteration_peak = 0, last_iteration_peak = -1;
  // A safe point that must spill also spills this share of what the step
  // still allocates (at most kSpillAheadCapShare of the cap): those
  // allocations then find room without a safe point (a device synchronize)
  // each. Measured on the bundled traces (docs/allocator.md, "Temperature
  // under a cap").
  static constexpr double kSpillAheadShare = 0.25;
  static constexpr double kSpillAheadCapShare = 0.125;
  static constexpr double kGrowthSlack = 0.05;
  // A safe point is called for once this share of the cap of live host
  // pages could come to the device (see live_host_pages_fit_on_the_device()).
  static constexpr double kFillShare = 1.0 / 32;
  // Host pages taken at allocation for the spills the next safe point owes.
  std::vector<PageHandle> spill_targets;
  // Host pages kept after their last use (options.keep_host_pages, the
  // host reserve): the next page the host needs comes from here before the
  // driver pins one. The device's pool when shared, else this allocator's.
  const std::shared_ptr<HostPagePool> host_pages;
  AllocatorEventSink* sink = nullptr;  // set_event_sink(); null: no events

  // Tells the sink, if any (allocator_events.h): one pointer test when none.
  void emit(AllocatorEvent::Kind kind, DevicePtr address, std::size_t bytes, StreamId stream,
            Residency where = Residency::kDevice) {
    if (sink == nullptr) return;
    AllocatorEvent event;
    event.kind = kind;
    event.address = address;
    event.bytes = bytes;
    event.stream = stream;
    event.where = where;
    sink->on_event(event);
  }

  // A block with every field at its default, a spare one when there is one.
  Block* new_block() {
    if (spare_blocks.empty()) return new Block;
    Block* block = spare_blocks.back().release();
    spare_blocks.pop_back();
    // Its lists keep their capacity (a record_stream'd block's streams and
    // events then need no heap either).
    std::vector<StreamId> used_on = std::move(block->used_on);
    std::vector<EventHandle> events = std::move(block->events);
    *block = Block{};
    used_on.clear();
    events.clear();
    block->used_on = std::move(used_on);
    block->events = std::move(events);
    return block;
  }
  void recycle(Block* block) { spare_blocks.emplace_back(block); }

  // discard_pages() in force until back_discarded_pages(): live blocks may
  // sit on unmapped pages, and allocation is refused.
  bool discarded = false;

  // ---- accounting ---------------------------------------------------------

  std::uint64_t device_bytes() const { return static_cast<std::uint64_t>(stats.device_resident_bytes.current); }
  std::uint64_t effective_cap() const { return spill_everything ? 0 : cap; }
  bool device_has_room_for_a_page() const {
    const std::uint64_t limit = effective_cap();
    return limit == kNoCap || (device_bytes() <= limit && limit - device_bytes() >= page_bytes);
  }
  SpillMode mode() const { return backend.host_pages_mappable() ? SpillMode::kRemap : SpillMode::kPinnedFallback; }
  // Whether a new allocation that finds no room on the device may go to the
  // host: only under a cap (or spill_all), unless the user opted in without one.
  bool may_spill_allocation() const {
    return options.spill_to_host && (effective_cap() != kNoCap || options.spill_without_cap);
  }

  // More bytes of pages than one block could ever have: the device's, and
  // where the block may spill, the host's too (what it has available, the
  // kept pages, this allocator's host pages) when the backend knows them.
  std::size_t most_one_block_could_hold() const {
    const std::size_t device = device_total;
    if (!may_spill_allocation()) return device;
    const std::optional<std::size_t> host = backend.host_available_bytes();
    if (!host) return std::numeric_limits<std::size_t>::max();
    const std::size_t quarter = std::numeric_limits<std::size_t>::max() / 4;  // no sum below wraps around
    return std::min(device, quarter) + std::min(*host, quarter) +
           std::min(static_cast<std::size_t>(host_pages->kept().current), quarter) +
           std::min(static_cast<std::size_t>(stats.host_resident_bytes.current), quarter);
  }

  void count_mapped(const Segment& segment, Residency where, bool mapped) {
    const auto bytes = static_cast<std::int64_t>(page_bytes);
    Stat& residency = where == Residency::kDevice ? stats.device_resident_bytes : stats.host_resident_bytes;
    if (mapped) {
      residency.increase(bytes);
      stats.reserved_bytes.increase(segment.pool, bytes);
    } else {
      residency.decrease(bytes);
      stats.reserved_bytes.decrease(segment.pool, bytes);
    }
  }

  // A block joins or leaves the free pools. `resized`: it leaves only to
  // come back with another size at the same address, so its place in
  // free_by_address stays as it is.
  void pool_insert(Block* block, bool resized = false) {
    block->in_pool = true;
    free_blocks.insert(block);
    if (!resized && step_plan.active()) free_by_address.insert(block);
    if (block->is_split()) {
      stats.inactive_split.increase(block->segment->pool, 1);
      stats.inactive_split_bytes.increase(block->segment->pool, static_cast<std::int64_t>(block->size));
    }
  }

  void pool_erase(Block* block, bool resized = false) {
    free_blocks.erase(block);
    if (!resized && step_plan.active()) free_by_address.erase(block);
    block->in_pool = false;
    if (block->is_split()) {
      stats.inactive_split.decrease(block->segment->pool, 1);
      stats.inactive_split_bytes.decrease(block->segment->pool, static_cast<std::int64_t>(block->size));
    }
  }

  // Index range [first, last] of the pages [address, address + size) of `segment` overlaps.
  std::pair<std::size_t, std::size_t> page_range(const Segment& segment, DevicePtr address, std::size_t size) const {
    return {(address - segment.base) >> page_shift, (address + size - 1 - segment.base) >> page_shift};
  }
  std::pair<std::size_t, std::size_t> page_range(const Block& block) const {
    return page_range(*block.segment, block.address, block.size);
  }

  // Bytes of `block` on mapped pages of residency `where` (not for a pinned fallback segment).
  std::size_t bytes_on(const Block& block, Residency where) const {
    const Segment& segment = *block.segment;
    std::size_t bytes = 0;
    const auto [first, last] = page_range(block);
    for (std::size_t i = first; i <= last; ++i) {
      const PageHandle& handle = segment.pages[i].handle;
      if (!handle || handle.where != where) continue;
      const DevicePtr page_start = segment.base + i * page_bytes;
      bytes += std::min(page_start + page_bytes, block.address + block.size) - std::max(page_start, block.address);
    }
    return bytes;
  }

  // ---- pages --------------------------------------------------------------

  std::size_t& cached_of(Residency where) { return cached_bytes[static_cast<int>(where)]; }

  // A block starts or stops touching page i; keeps cached_bytes true.
  void page_gains_live(Segment& segment, std::size_t i) {
    Page& page = segment.pages[i];
    if (page.live_blocks++ == 0 && page.handle) cached_of(page.handle.where) -= page_bytes;
  }
  void page_loses_live(Segment& segment, std::size_t i) {
    Page& page = segment.pages[i];
    if (--page.live_blocks == 0 && page.handle) cached_of(page.handle.where) += page_bytes;
  }

  // Takes `handle`: when mapping fails the page is released before the error goes on.
  void map_page(Segment& segment, std::size_t index, PageHandle handle) {
    try {
      backend.map(segment.base + index * page_bytes, handle);
    } catch (...) {
      give_back_page(handle);
      throw;
    }
    segment.pages[index].handle = handle;
    segment.pages[index].released_cold = 0;
    count_mapped(segment, handle.where, true);
    ++stats.num_device_alloc;
    mapped_this_step = true;
    emit(AllocatorEvent::Kind::kPageMapped, segment.base + index * page_bytes, page_bytes, segment.stream, handle.where);
  }

  // `synchronized`: the caller ran backend.synchronize_for_unmap() for this batch.
  void unmap_page(Segment& segment, std::size_t index, bool synchronized = false) {
    Page& page = segment.pages[index];
    if (synchronized) backend.unmap_synchronized(segment.base + index * page_bytes);
    else backend.unmap(segment.base + index * page_bytes);
    const PageHandle handle = page.handle;
    count_mapped(segment, handle.where, false);
    if (page.live_blocks == 0) cached_of(handle.where) -= page_bytes;
    emit(AllocatorEvent::Kind::kPageUnmapped, segment.base + index * page_bytes, page_bytes, segment.stream,
         handle.where);
    page.handle = {};
    ++stats.num_device_free;
    // Last: the books already say the page is gone. A release the driver
    // refuses leaves the page with the process until it exits.
    give_back_page(handle);
  }

  // Cached pages last used before this tick are none of the loop's layout:
  // no allocation or free has touched them through a whole step (since the
  // mark before the last). A warm loop under a cap needs the rest again
  // within a step: released, each comes back as a new page, and its release
  // waits for the device (docs/allocator.md, "A warm loop under a cap keeps
  // its layout").
  // Before any mark no loop is known, and every cached page counts as unused.
  static constexpr std::uint64_t kAnyCachedPage = std::numeric_limits<std::uint64_t>::max();
  std::uint64_t unused_before() const { return cold_before == 0 ? kAnyCachedPage : previous_mark; }

  // Releases mapped pages no live block touches, on `where` (or both when
  // null) and last used before `used_before` (any by default), at least
  // `limit` bytes of them where there are (the coldest), all by default.
  // Address ranges stay reserved. Returns the bytes released. One device
  // synchronize covers the whole batch (none when the caller already ran it:
  // `synchronized`, or when no page qualifies); when the device cannot
  // synchronize now (graph capture) nothing is released.
  std::size_t release_cached_pages(const Residency* where, std::size_t limit = SIZE_MAX,
                                   bool synchronized = false, std::uint64_t used_before = kAnyCachedPage) {
    const std::size_t available = where ? cached_of(*where) : cached_bytes[0] + cached_bytes[1];
    if (available == 0 || limit == 0) return 0;
    // Part of the cache: the coldest pages, so what a loop reuses soonest stays.
    std::vector<CachedPage> pages = cached_pages(where, used_before);
    if (pages.empty() || (!synchronized && !backend.synchronize_for_unmap())) return 0;
    if (limit < available || used_before != kAnyCachedPage) {
      std::sort(pages.begin(), pages.end(),
                [](const CachedPage& a, const CachedPage& b) { return a.page().last_use < b.page().last_use; });
    }
    std::size_t released = 0;
    for (const CachedPage& page : pages) {
      if (released >= limit) break;
      unmap_page(*page.segment, page.index, /*synchronized=*/true);
      released += page_bytes;
    }
    return released;
  }

  // A mapped page no live block touches.
  struct CachedPage {
    Segment* segment;
    std::size_t index;
    const Page& page() const { return segment->pages[index]; }
  };
  // The cached pages on `where` (or both when null) last used before
  // `used_before`, in address order.
  std::vector<CachedPage> cached_pages(const Residency* where, std::uint64_t used_before) {
    std::vector<CachedPage> pages;
    for (auto& [base, segment] : segments) {
      for (std::size_t i = 0; i < segment->pages.size(); ++i) {
        const Page& page = segment->pages[i];
        if (!page.handle || page.live_blocks != 0 || page.last_use >= used_before) continue;
        if (where && page.handle.where != *where) continue;
        pages.push_back({segment.get(), i});
      }
    }
    return pages;
  }

  // A new page on `where`: a kept host page when there is one, else the
  // backend's (an empty handle when that memory is exhausted, or a host page
  // would take the host below its headroom).
  PageHandle new_page(Residency where) {
    if (where == Residency::kHost) return host_pages->take_or_pin();
    return backend.create_page(where);
  }
  // Whether host pages given up are kept: while the job may need host pages
  // again (a cap, or spilling without one).
  bool keeping_host_pages() const {
    return options.keep_host_pages && mode() == SpillMode::kRemap &&
           (effective_cap() != kNoCap || options.spill_without_cap);
  }
  // A page nothing maps and nothing will read: a host page goes to the host
  // pool (kept while this or another allocator keeps host pages, or below
  // the reserve), a device page back to the driver.
  void give_back_page(PageHandle page) {
    if (page.where == Residency::kHost) {
      host_pages->give(page);
      return;
    }
    backend.release_page(page);
  }
  // After the cap or spill_all() changed: tells the pool whether this
  // allocator keeps host pages (with no keeper left, it gives back what
  // lies beyond the reserve).
  void update_host_keeping() { host_pages->set_keeping(this, keeping_host_pages()); }

  // A new page for an allocation that has `own_device_bytes` on the device
  // so far: on the device if it fits under the cap (after releasing cached
  // device pages the loop no longer uses if need be), or if a colder live
  // device page can move out at the next safe point in its place; else,
  // after releasing the loop's own cached device pages, on the device if it
  // then fits, or on the host. The loop's cache goes last: released, a warm
  // loop maps it again in the same or the next step, every step (see
  // unused_before()), where a colder page moved out once settles.
  // Returns an empty handle when the allocation cannot be placed here: the
  // host is exhausted too, spilling is off, or (pinned fallback mode) the
  // caller must take pinned memory instead.
  PageHandle create_page_for_allocation(std::size_t own_device_bytes, std::size_t needed_bytes,
                                        bool* released_cache) {
    const Residency device = Residency::kDevice;
    // Enough cache for the rest of this allocation, in one batch each.
    if (!device_has_room_for_a_page() &&
        release_cached_pages(&device, needed_bytes, /*synchronized=*/false, unused_before()) > 0) {
      *released_cache = true;
    }
    if (!device_has_room_for_a_page() && !colder_page_can_make_room(own_device_bytes) &&
        release_cached_pages(&device, needed_bytes) > 0) {
      *released_cache = true;
    }
    if (device_has_room_for_a_page()) {
      if (PageHandle page = backend.create_page(Residency::kDevice)) return page;
      // The device itself is full (other processes): free our cache and retry.
      if (release_cached_pages(&device, needed_bytes) > 0) {
        *released_cache = true;
        if (PageHandle page = backend.create_page(Residency::kDevice)) return page;
      }
    } else if (colder_page_can_make_room(own_device_bytes)) {
      // The host page the colder page will move to is taken now, so that the
      // next safe point can always bring the device back under the cap.
      const bool have_target = spill_targets.size() * page_bytes >= device_bytes() + page_bytes - effective_cap();
      PageHandle target = have_target ? PageHandle{} : new_page(Residency::kHost);
      if (!have_target && !target) {
        // The host is exhausted: no colder page can move out, and no host
        // page can hold this one. The loop's cached device pages make room
        // instead, where there are.
        if (release_cached_pages(&device, needed_bytes) == 0) return {};
        *released_cache = true;
        if (!device_has_room_for_a_page()) return {};
        return backend.create_page(Residency::kDevice);
      }
      PageHandle page;
      try {
        page = backend.create_page(Residency::kDevice);
      } catch (...) {
        if (target) give_back_page(target);  // not lost to a failing driver call
        throw;
      }
      if (page) {
        if (target) hold_spill_target(target, true);
        return page;
      }
      if (target) return target;  // the device is full: the new page lives on the host
    }
    if (!may_spill_allocation() || mode() != SpillMode::kRemap) return {};
    return new_page(Residency::kHost);
  }

  // Host pages taken for spills the next safe point owes (see above): held
  // host memory, counted as host-resident and reserved until a move maps them.
  void hold_spill_target(PageHandle target, bool hold) {
    const auto bytes = static_cast<std::int64_t>(page_bytes);
    if (hold) {
      spill_targets.push_back(target);
      stats.host_resident_bytes.increase(bytes);
      stats.reserved_bytes.increase(PoolKind::kLarge, bytes);
    } else {
      stats.host_resident_bytes.decrease(bytes);
      stats.reserved_bytes.decrease(PoolKind::kLarge, bytes);
    }
  }
  PageHandle take_spill_target() {
    const PageHandle target = spill_targets.back();
    spill_targets.pop_back();
    hold_spill_target(target, false);
    return target;
  }
  void release_spill_targets() {
    while (!spill_targets.empty()) give_back_page(take_spill_target());
  }
  // Keeps only the targets the device's bytes over the cap still need.
  void trim_spill_targets() {
    const std::uint64_t over = device_bytes() > effective_cap() ? device_bytes() - effective_cap() : 0;
    while (spill_targets.size() * page_bytes >= over + page_bytes) give_back_page(take_spill_target());
  }

  // Bytes of host pages that hold a live block, and pinned fallback
  // allocations in use: what kernels reach over the bus.
  std::size_t host_live_bytes() const {
    std::size_t pinned_in_use = 0;  // pinned fallback segments, one block each, that are not kept free
    if (stats.pinned_fallback_bytes.current != 0) {
      for (const auto& [base, segment] : segments) {
        if (segment->pinned_fallback && !segment->first->in_pool) pinned_in_use += segment->size;
      }
    }
    return live_host_page_bytes() + pinned_in_use;
  }
  // Bytes of host pages that hold a live block (kRemap).
  std::size_t live_host_page_bytes() const {
    return static_cast<std::size_t>(stats.host_resident_bytes.current - stats.pinned_fallback_bytes.current) -
           cached_bytes[static_cast<int>(Residency::kHost)] - spill_targets.size() * page_bytes;
  }
  // Whether a safe point would bring at least kFillShare of the cap (and
  // kPagesPerWait pages) of live host pages to the device, into free device
  // pages' places (plan_migrations' into_free) or room under the cap: a
  // free device page appears when a step frees a block, and a live host
  // page when the step places a block on a host page of its layout; one
  // without the other calls for no safe point, which on a GPU waits for
  // the device. O(1): the allocation and free paths ask.
  bool live_host_pages_fit_on_the_device() const {
    if (stats.host_resident_bytes.current == 0 || mode() != SpillMode::kRemap || spill_everything) return false;
    const std::uint64_t limit = effective_cap();
    const std::uint64_t room = limit == kNoCap ? kNoCap : limit > device_bytes() ? limit - device_bytes() : 0;
    const std::uint64_t free_device = cached_bytes[static_cast<int>(Residency::kDevice)];
    const std::uint64_t fits = room == kNoCap ? kNoCap : room + free_device;
    const double least = std::max(static_cast<double>(kPagesPerWait * page_bytes),
                                  limit == kNoCap ? 0.0 : static_cast<double>(limit) * kFillShare);
    return static_cast<double>(std::min<std::uint64_t>(fits, live_host_page_bytes())) >= least;
  }

  // Whether one more device page over the cap is matched by a live device
  // page, outside the allocation being placed, that the next safe point
  // spills in its place: every such page is colder than the new one. Only
  // where pages can move (kRemap), and not under spill_all().
  bool colder_page_can_make_room(std::size_t own_device_bytes) const {
    const std::uint64_t limit = effective_cap();
    if (limit == kNoCap || spill_everything || mode() != SpillMode::kRemap || !options.spill_to_host) return false;
    const std::uint64_t live_device = device_bytes() - cached_bytes[static_cast<int>(Residency::kDevice)];
    const std::uint64_t others = live_device > own_device_bytes ? live_device - own_device_bytes : 0;
    const std::uint64_t over_after = device_bytes() + page_bytes > limit ? device_bytes() + page_bytes - limit : 0;
    return over_after <= others;
  }

  // Before mapping `new_bytes` for a block of `block_bytes`: when reserved
  // bytes would pass the peak of live bytes by more than kGrowthSlack (and
  // cold_rule_floor), release cached pages that no allocation or free
  // touched since the last iteration mark (cold cache), host ones first,
  // then coldest first. A warm loop maps nothing, so it never comes here;
  // without iteration marks nothing is cold and the arena only grows.
  void release_cold_cache_to_grow(std::size_t new_bytes, std::size_t block_bytes) {
    if (cold_before == 0 || cached_bytes[0] + cached_bytes[1] == 0) return;
    const std::int64_t live_after = stats.allocated_bytes.all.current + static_cast<std::int64_t>(block_bytes);
    const double allowed =
        std::max(static_cast<double>(std::max(stats.allocated_bytes.all.peak, live_after)) * (1.0 + kGrowthSlack),
                 static_cast<double>(cold_rule_floor));
    double excess = static_cast<double>(stats.reserved_bytes.all.current) + static_cast<double>(new_bytes) - allowed;
    if (excess <= 0) return;
    std::vector<CachedPage> cold = cached_pages(nullptr, cold_before);
    if (cold.empty() || !backend.synchronize_for_unmap()) return;  // one synchronize for the batch
    const auto order = [](const CachedPage& cached) {  // host pages first, then the coldest
      const Page& page = cached.page();
      return page.handle.where == Residency::kHost ? 0 : page.last_use + 1;
    };
    std::sort(cold.begin(), cold.end(), [&](const CachedPage& a, const CachedPage& b) { return order(a) < order(b); });
    for (const CachedPage& page : cold) {
      if (excess <= 0) break;
      unmap_page(*page.segment, page.index, /*synchronized=*/true);
      page.segment->pages[page.index].released_cold = cold_before;
      excess -= static_cast<double>(page_bytes);
    }
  }

  // Whether mapping `page` now brings back a page the cold-cache rule
  // released in an earlier step.
  bool comes_back(const Page& page) const { return page.released_cold != 0 && page.released_cold < cold_before; }

  // Maps every unmapped page of `block` and marks its pages live. When no
  // page can be had it undoes the live marks, gives back the pages it mapped
  // (a request larger than the device would otherwise leave the device full
  // of this process's cache, for every other process too) and returns false.
  // When a driver call fails, pages mapped so far stay, as cache.
  bool back_block(Block& block, bool* spilled, bool* released_cache) {
    Segment& segment = *block.segment;
    const auto [first, last] = page_range(block);
    // Live before anything is released or mapped, so no cache release for
    // this allocation can take back a page of this same block.
    std::size_t unmapped = 0;
    for (std::size_t i = first; i <= last; ++i) {
      page_gains_live(segment, i);
      if (!segment.pages[i].handle) ++unmapped;
    }
    // A warm loop's blocks find their pages mapped: nothing more to do.
    if (unmapped > 0 && !map_unmapped_pages(block, first, last, unmapped, spilled, released_cache)) return false;
    for (std::size_t i = first; i <= last; ++i) segment.pages[i].last_use = tick;
    return true;
  }

  // back_block's slow path: maps the `unmapped` pages of `block`'s pages
  // [first, last], which are marked live already.
  bool map_unmapped_pages(Block& block, std::size_t first, std::size_t last, std::size_t unmapped, bool* spilled,
                          bool* released_cache) {
    Segment& segment = *block.segment;
    bool marked_live = true;  // until undone, once: an error while undoing must not undo again
    try {
      bool churns = false;  // a page the cold-cache rule released and a later step needs again
      for (std::size_t i = first; i <= last; ++i) {
        const Page& page = segment.pages[i];
        churns = churns || (!page.handle && comes_back(page));
      }
      if (!churns) release_cold_cache_to_grow(unmapped * page_bytes, block.size);
      // Bytes of this block's pages on the device so far: no colder page.
      std::size_t own_device_bytes = 0;
      for (std::size_t i = first; i <= last; ++i) {
        const PageHandle& handle = segment.pages[i].handle;
        if (handle && handle.where == Residency::kDevice) own_device_bytes += page_bytes;
      }
      std::vector<std::size_t> mapped_here;
      for (std::size_t i = first; i <= last; ++i) {
        if (segment.pages[i].handle) continue;
        PageHandle handle = create_page_for_allocation(own_device_bytes, unmapped * page_bytes, released_cache);
        --unmapped;
        if (handle && handle.where == Residency::kDevice) own_device_bytes += page_bytes;
        if (!handle) {
          for (std::size_t j = first; j <= last; ++j) page_loses_live(segment, j);
          marked_live = false;
          // The block was never handed out, so no work on any stream can
          // touch these pages: no synchronize before they go.
          for (std::size_t j : mapped_here) unmap_page(segment, j, /*synchronized=*/true);
          return false;
        }
        if (handle.where == Residency::kHost) *spilled = true;
        map_page(segment, i, handle);
        mapped_here.push_back(i);
      }
      // The rule released a page this loop needs again: it stops where the
      // arena is now instead of releasing the loop's layouts step after step.
      if (churns) cold_rule_floor = std::max(cold_rule_floor, stats.reserved_bytes.all.current);
    } catch (...) {
      // A driver call failed: pages mapped so far stay, as cache.
      if (marked_live) {
        for (std::size_t j = first; j <= last; ++j) page_loses_live(segment, j);
      }
      throw;
    }
    return true;
  }

  // ---- blocks and segments ------------------------------------------------

  // An arena's reserved bytes for a first request of `size`.
  std::size_t arena_size_for(std::size_t size) const {
    const std::size_t arena = options.arena_bytes != 0 ? options.arena_bytes : backend.device_total_bytes();
    return round_up(std::max({arena, size, page_bytes}), page_bytes);
  }

  // Records a segment at [base, base + bytes) covered by one block (not in
  // a pool) and returns that block.
  Block* add_segment(DevicePtr base, std::size_t bytes, StreamId stream, PoolKind pool, bool pinned_fallback) {
    auto segment = std::make_unique<Segment>();
    segment->base = base;
    segment->size = bytes;
    segment->stream = stream;
    segment->pool = pool;
    segment->pinned_fallback = pinned_fallback;
    if (!pinned_fallback) segment->pages.resize(bytes / page_bytes);
    Block* block = new_block();
    block->segment = segment.get();
    block->address = base;
    block->size = bytes;
    segment->first = block;
    segments.emplace(base, std::move(segment));
    stats.segment.increase(pool, 1);
    return block;
  }

  // A new arena with nothing mapped, as one free block (not in a pool).
  // When the address space for a whole arena cannot be had, one just large
  // enough for the request.
  Block* new_arena(std::size_t size, StreamId stream) {
    std::size_t bytes = arena_size_for(size);
    DevicePtr base = backend.reserve(bytes);
    if (base == 0 && bytes > round_up(size, page_bytes)) {
      bytes = round_up(size, page_bytes);
      base = backend.reserve(bytes);
    }
    if (base == 0) return nullptr;
    return add_segment(base, bytes, stream, PoolKind::kLarge, /*pinned_fallback=*/false);
  }

  void delete_segment(Segment& segment) {
    stats.segment.decrease(segment.pool, 1);
    const DevicePtr base = segment.base;
    recycle(segment.first);
    segments.erase(base);
  }

  bool should_split(const Block& block, std::size_t size) const {
    return block.size - size >= options.round_bytes;
  }

  // Cuts `block` to `size` bytes and returns the rest, a new block after it
  // in the segment's list (in no pool).
  Block* cut(Block* block, std::size_t size) {
    Block* rest = new_block();
    rest->segment = block->segment;
    rest->address = block->address + size;
    rest->size = block->size - size;
    rest->prev = block;
    rest->next = block->next;
    if (block->next) block->next->prev = rest;
    block->next = rest;
    block->size = size;
    return rest;
  }

  // Cuts `block` (not in a pool) to `size`; the rest goes back to the pool.
  void split(Block* block, std::size_t size) {
    if (should_split(*block, size)) pool_insert(cut(block, size));
  }

  // Takes [address, address + size) out of `block`, a free block in the
  // pool that holds it; the bytes before and after go back to the pool.
  Block* carve(Block* block, DevicePtr address, std::size_t size) {
    const bool keeps_front = address > block->address;
    pool_erase(block, /*resized=*/keeps_front);
    if (keeps_front) {
      Block* rest = cut(block, address - block->address);
      pool_insert(block, /*resized=*/true);
      block = rest;
    }
    split(block, size);
    return block;
  }

  // The free block of `stream` that holds [address, address + size), or null.
  Block* free_block_holding(DevicePtr address, std::size_t size, StreamId stream) const {
    Block key;
    key.address = address;
    auto it = free_by_address.set().upper_bound(&key);
    if (it == free_by_address.set().begin()) return nullptr;
    Block* block = *std::prev(it);  // the last free block starting at or before `address`
    const bool holds = block->address + block->size >= address + size;
    return holds && block->segment->stream == stream ? block : nullptr;
  }

  // Whether every page under [address, address + size) is mapped (to a
  // device page, where `device_only`).
  bool all_mapped(const Segment& segment, DevicePtr address, std::size_t size, bool device_only = false) const {
    const auto [first, last] = page_range(segment, address, size);
    for (std::size_t i = first; i <= last; ++i) {
      const PageHandle& handle = segment.pages[i].handle;
      if (!handle || (device_only && handle.where != Residency::kDevice)) return false;
    }
    return true;
  }

  // Best fit, but without a cap a request that best fit would place over a
  // page not yet mapped goes instead to the best-fitting of the next holes
  // (at most kMappedFitCandidates in best-fit order, an arena's untouched
  // end excepted) whose range lies on device pages already mapped: the cache
  // is used before the device is asked for more. Under a cap, best fit: a
  // new page there is a colder page's move, which temperature decides
  // (docs/allocator.md, "Placement"). Null when no block fits.
  static constexpr std::size_t kMappedFitCandidates = 64;
  Block* best_fit_mapped_first(StreamId stream, std::size_t size) const {
    Block* block = free_blocks.best_fit(stream, size);
    if (block == nullptr || effective_cap() != kNoCap || all_mapped(*block->segment, block->address, size)) {
      return block;
    }
    Block* mapped = free_blocks.find_fit(stream, size, kMappedFitCandidates, [&](const Block* candidate) {
      return candidate->next != nullptr && all_mapped(*candidate->segment, candidate->address, size, true);
    });
    return mapped != nullptr ? mapped : block;
  }

  // Placement by the plan, once the loop repeats (step_plan.h): the range
  // the same request had in the step before, when it is free; else, in
  // best-fit order over the holes (an arena's untouched end excepted), the
  // lowest mapped range that no later request of the step is planned to.
  // Null when neither exists: best fit places it.
  static constexpr std::size_t kPlannedFitCandidates = 64;
  Block* take_planned(std::size_t size, StreamId stream) {
    if (!step_plan.active()) return nullptr;
    if (const DevicePtr hint = step_plan.hint(size, stream)) {
      if (Block* hole = free_block_holding(hint, size, stream)) return carve(hole, hint, size);
    }
    DevicePtr at = 0;
    Block* hole = free_blocks.find_fit(stream, size, kPlannedFitCandidates, [&](const Block* candidate) {
      if (candidate->next == nullptr) return false;
      auto mapped = [&](DevicePtr start) { return all_mapped(*candidate->segment, start, size); };
      at = step_plan.unclaimed(candidate->address, candidate->address + candidate->size, size, mapped);
      return at != 0;
    });
    return hole ? carve(hole, at, size) : nullptr;
  }

  // A backed block becomes a live allocation of `bytes` requested bytes.
  void hand_out(Block* block, std::size_t bytes, PoolKind pool) {
    block->allocated = true;
    block->requested = bytes;
    block->size_class = pool;
    allocated.emplace(block->address, block);
    const auto block_bytes = static_cast<std::int64_t>(block->size);
    stats.allocation.increase(pool, 1);
    stats.allocated_bytes.increase(pool, block_bytes);
    iteration_peak = std::max(iteration_peak, stats.allocated_bytes.all.current);
    stats.requested_bytes.increase(pool, static_cast<std::int64_t>(bytes));
    stats.active.increase(pool, 1);
    stats.active_bytes.increase(pool, block_bytes);
    emit(AllocatorEvent::Kind::kAlloc, block->address, bytes, block->segment->stream);
  }

  // Frees the live allocation at `it`: it retires now, or once the events
  // recorded on the other streams that used it complete. When an event
  // cannot be recorded it throws, leaving the allocation live.
  void free_live(LiveMap::iterator it) {
    Block* block = it->second;
    // Into the block's own list (empty while it is live, its capacity kept
    // from earlier waits), so a warm free asks the heap for nothing.
    std::vector<EventHandle>& events = block->events;
    try {
      for (StreamId stream : block->used_on) {
        events.push_back(take_event());
        backend.record_event(events.back(), stream);
      }
    } catch (...) {
      spare_events.insert(spare_events.end(), events.begin(), events.end());
      events.clear();
      throw;
    }
    emit(AllocatorEvent::Kind::kFreeRequested, block->address, block->requested, block->segment->stream);
    allocated.erase(it);
    block->allocated = false;
    const PoolKind pool = block->size_class;
    stats.allocation.decrease(pool, 1);
    stats.allocated_bytes.decrease(pool, static_cast<std::int64_t>(block->size));
    stats.requested_bytes.decrease(pool, static_cast<std::int64_t>(block->requested));
    if (events.empty()) {
      retire(block);
      return;
    }
    waiting.push_back(block);
  }

  // A block that is neither allocated nor waiting becomes free: its pages
  // lose a live block, it merges with free neighbours and joins its pool.
  void make_free(Block* block) {
    const auto [first, last] = page_range(*block);
    for (std::size_t i = first; i <= last; ++i) {
      page_loses_live(*block->segment, i);
      block->segment->pages[i].last_use = tick;  // a free is a use: the page is hot
    }
    return_to_pool(block);
  }

  // Merges a block that touches no page as live into its pool.
  void return_to_pool(Block* block) {
    block->used_on.clear();
    block->requested = 0;
    bool into_prev = false;
    if (Block* prev = block->prev; prev && prev->in_pool) {
      pool_erase(prev, /*resized=*/true);
      prev->size += block->size;
      prev->next = block->next;
      if (block->next) block->next->prev = prev;
      recycle(block);
      block = prev;
      into_prev = true;
    }
    if (Block* next = block->next; next && next->in_pool) {
      pool_erase(next);
      block->size += next->size;
      block->next = next->next;
      if (next->next) next->next->prev = block;
      recycle(next);
    }
    pool_insert(block, /*resized=*/into_prev);
  }

  // The end of a block's life as "active": free it, or for a pinned
  // fallback allocation, keep it pinned in pinned_free for reuse.
  void retire(Block* block) {
    emit(AllocatorEvent::Kind::kFreeCompleted, block->address, block->requested, block->segment->stream);
    stats.active.decrease(block->size_class, 1);
    stats.active_bytes.decrease(block->size_class, static_cast<std::int64_t>(block->size));
    if (block->segment->pinned_fallback) {
      // Kept pinned for the next over-cap allocation: pinning costs far more
      // than an allocation should (empty_cache() gives it back).
      block->used_on.clear();
      block->requested = 0;
      block->in_pool = true;
      pinned_free.insert(block);
      return;
    }
    make_free(block);
  }

  // Gives back every cached pinned fallback segment, after one wait for the
  // work that may still read them (none when the caller already ran it:
  // `synchronized`; nothing is given back while the device cannot
  // synchronize: a graph capture).
  void release_pinned_cache(bool synchronized = false) {
    if (pinned_free.empty() || (!synchronized && !backend.synchronize_for_unmap())) return;
    for (auto it = segments.begin(); it != segments.end();) {
      Segment& segment = *it->second;
      ++it;
      if (!segment.pinned_fallback || !segment.first->in_pool) continue;
      backend.free_pinned_host_synchronized(segment.base, segment.size);  // a refusal: the segment stays cached
      pinned_free.erase(segment.first);
      emit(AllocatorEvent::Kind::kSegmentFreed, segment.base, segment.size, segment.stream, Residency::kHost);
      const auto bytes = static_cast<std::int64_t>(segment.size);
      stats.host_resident_bytes.decrease(bytes);
      stats.pinned_fallback_bytes.decrease(bytes);
      stats.reserved_bytes.decrease(segment.pool, bytes);
      delete_segment(segment);
    }
  }

  // Over-cap memory in pinned fallback mode: a pinned host allocation that
  // kernels reach directly, as one block in a segment of its own.
  // A cached one of the stream's if one fits without wasting more than the
  // request; sizes round up to a page so that freed ones fit again.
  Block* allocate_pinned_fallback(std::size_t size, StreamId stream) {
    if (Block* cached = pinned_free.best_fit(stream, size); cached && cached->size <= 2 * size) {
      pinned_free.erase(cached);
      cached->in_pool = false;
      return cached;
    }
    const PoolKind pool = PoolKind::kLarge;
    size = round_up(size, page_bytes);
    DevicePtr base = host_pages->may_pin(size) ? backend.allocate_pinned_host(size) : 0;
    if (base == 0 && !pinned_free.empty()) {
      // Host memory is short: the cached blocks (other streams', or too
      // large to reuse) go back first, then one more try.
      release_pinned_cache();
      if (host_pages->may_pin(size)) base = backend.allocate_pinned_host(size);
    }
    if (base == 0) return nullptr;
    Block* block = add_segment(base, size, stream, pool, /*pinned_fallback=*/true);
    emit(AllocatorEvent::Kind::kSegmentAllocated, base, size, stream, Residency::kHost);
    const auto bytes = static_cast<std::int64_t>(size);
    stats.host_resident_bytes.increase(bytes);
    stats.pinned_fallback_bytes.increase(bytes);
    stats.reserved_bytes.increase(pool, bytes);
    return block;
  }

  // Retires, in the order they were freed, the waiting blocks whose events
  // have all completed; the rest keep their order. In place: every
  // allocation runs this while a block waits, so it asks the heap for nothing.
  void process_events() {
    std::size_t kept = 0;
    for (std::size_t i = 0; i < waiting.size(); ++i) {
      Block* block = waiting[i];
      const bool done = std::all_of(block->events.begin(), block->events.end(),
                                    [&](EventHandle event) { return backend.query_event(event); });
      if (!done) {
        waiting[kept++] = block;
        continue;
      }
      spare_events.insert(spare_events.end(), block->events.begin(), block->events.end());
      block->events.clear();
      retire(block);  // touches neither `waiting` nor another waiting block's events
    }
    waiting.resize(kept);
  }

  void synchronize_waiting() {
    for (Block* block : waiting) {
      for (EventHandle event : block->events) backend.synchronize_event(event);
    }
    process_events();
  }

  EventHandle take_event() {
    if (spare_events.empty()) return backend.create_event();
    EventHandle event = spare_events.back();
    spare_events.pop_back();
    return event;
  }

  [[noreturn]] void out_of_memory(std::size_t requested, StreamId stream) {
    ++stats.num_ooms;
    if (sink != nullptr) {
      AllocatorEvent event;
      event.kind = AllocatorEvent::Kind::kOutOfMemory;
      event.bytes = requested;
      event.stream = stream;
      event.device_free_bytes = backend.device_free_bytes();
      sink->on_event(event);
    }
    const std::uint64_t limit = effective_cap();
    if (limit == kNoCap && !options.spill_without_cap) {
      // No cap: the device itself is full, as PyTorch's allocator reports it.
      throw OutOfMemoryError(fmt::format(
          "CUDA out of memory. Tried to allocate {}. The GPU has a total capacity of {} of which {} is free. "
          "Of the memory cotenant holds for this process, {} is allocated and {} reserved but unallocated. "
          "cotenant spills to host memory only under a cap: set one with cotenant.set_memory_cap() (or "
          "COTENANT_SPILL_WITHOUT_CAP=1 to spill when the device is full), or free tensors.",
          format_size(requested), format_size(backend.device_total_bytes()), format_size(backend.device_free_bytes()),
          format_size(static_cast<std::uint64_t>(stats.allocated_bytes.all.current)),
          format_size(static_cast<std::uint64_t>(
              std::max<std::int64_t>(stats.reserved_bytes.all.current - stats.allocated_bytes.all.current, 0)))));
    }
    std::string host_note = host_pages->headroom_note();
    if (!host_note.empty()) host_note = ": " + host_note;
    throw OutOfMemoryError(fmt::format(
        "cotenant: out of memory allocating {} on stream {:#x}: the device cap is {} with {} device-resident "
        "({} allocated by this process, {} reserved), the device reports {} free of {}, and host memory "
        "for spilling is exhausted or disabled ({} host-resident{}). Free tensors, raise the cap with "
        "cotenant.set_memory_cap(), or make more host memory available.",
        format_size(requested), stream, limit == kNoCap ? std::string("unset") : format_size(limit),
        format_size(device_bytes()), format_size(static_cast<std::uint64_t>(stats.allocated_bytes.all.current)),
        format_size(static_cast<std::uint64_t>(stats.reserved_bytes.all.current)),
        format_size(backend.device_free_bytes()), format_size(backend.device_total_bytes()),
        format_size(static_cast<std::uint64_t>(stats.host_resident_bytes.current)), host_note));
  }

  // ---- migration ----------------------------------------------------------

  struct LivePage {
    Segment* segment;
    std::size_t index;
  };

  // Plans moves over the live pages and the free device pages against the
  // effective cap.
  MigrationPlan plan(std::vector<LivePage>* pages) const {
    std::vector<PageCandidate> candidates;
    for (const auto& [base, segment] : segments) {
      for (std::size_t i = 0; i < segment->pages.size(); ++i) {
        const Page& page = segment->pages[i];
        if (!page.handle) continue;
        const bool live = page.live_blocks != 0;
        if (!live && page.handle.where != Residency::kDevice) continue;
        candidates.push_back({pages->size(), page.handle.where, page.last_use, live});
        pages->push_back({segment.get(), i});
      }
    }
    return plan_migrations(candidates, device_bytes(), effective_cap(), page_bytes, spill_ahead());
  }

  // The bytes a safe point spills beyond the cap's need (see kSpillAheadShare).
  std::uint64_t spill_ahead() const {
    const std::uint64_t limit = effective_cap();
    const std::int64_t still = last_iteration_peak - stats.allocated_bytes.all.current;
    if (limit == kNoCap || last_iteration_peak < 0 || still <= 0) return 0;
    return static_cast<std::uint64_t>(std::min(static_cast<double>(still) * kSpillAheadShare,
                                               static_cast<double>(limit) * kSpillAheadCapShare));
  }

  // Recomputes what waits for a safe point, for stats and the pending flag.
  void mark_pending(std::atomic<bool>& flag) {
    stats.pending_spill_bytes = stats.pending_restore_bytes = 0;
    if (mode() == SpillMode::kRemap) {
      std::vector<LivePage> pages;
      const MigrationPlan moves = plan(&pages);
      stats.pending_spill_bytes = static_cast<std::int64_t>(moves.to_host.size() * page_bytes);
      stats.pending_restore_bytes =
          static_cast<std::int64_t>((moves.to_device.size() + moves.into_free.size()) * page_bytes);
    }
    flag.store(stats.pending_spill_bytes + stats.pending_restore_bytes > 0, std::memory_order_release);
  }

  DevicePtr address_of(const LivePage& live) const { return live.segment->base + live.index * page_bytes; }
  static bool holds_no_block(const LivePage& live) { return live.segment->pages[live.index].live_blocks == 0; }
  // The page backing a live page in the books (the old one until moved_page()).
  static PageHandle backing(const LivePage& live) { return live.segment->pages[live.index].handle; }

  // Pages move kPagesPerWait at a time: a spill waits for that many copies
  // at once, a restore remaps that many before it copies.
  static constexpr std::size_t kPagesPerWait = 8;

  // A page move: `target` is to back the live page.
  struct Move {
    const LivePage* live;
    PageHandle target;
  };
  static bool by_address(const Move& a, const Move& b) {
    return a.live->segment->base != b.live->segment->base ? a.live->segment->base < b.live->segment->base
                                                          : a.live->index < b.live->index;
  }
  // How many of the `count` moves from `moves` on are pages that follow one
  // another in one segment (moves sorted by_address).
  static std::size_t run_length(const Move* moves, std::size_t count) {
    std::size_t length = 1;
    while (length < count && moves[length].live->segment == moves[0].live->segment &&
           moves[length].live->index == moves[0].live->index + length) {
      ++length;
    }
    return length;
  }

  // Puts each target of a run of `count` moves (pages that follow one another
  // in one segment) at its live page's address in that page's place: the old
  // pages are unmapped, then the targets mapped with one access call for the
  // whole run (Backend::map_pages). A failed driver call puts every old page
  // of the run back where it was, bytes unchanged, and gives the targets
  // back; the error goes on to the caller.
  void remap_run(const Move* run, std::size_t count) {
    const DevicePtr first = address_of(*run[0].live);
    std::vector<PageHandle> targets;
    for (std::size_t i = 0; i < count; ++i) targets.push_back(run[i].target);
    std::size_t unmapped = 0;
    try {
      for (; unmapped < count; ++unmapped) backend.unmap(first + unmapped * page_bytes);
      backend.map_pages(first, targets.data(), count);
    } catch (...) {
      for (PageHandle target : targets) give_back_page(target);
      for (std::size_t i = 0; i < unmapped; ++i) {
        backend.map(first + i * page_bytes, backing(*run[i].live));
      }
      throw;
    }
  }

  // Gives back the targets of moves that will not happen.
  void give_back_targets(const std::vector<Move>& moves, std::size_t from) {
    for (std::size_t i = from; i < moves.size(); ++i) {
      try {
        give_back_page(moves[i].target);
      } catch (...) {
      }
    }
  }

  // Device pages for up to kPagesPerWait of `ids` from `begin` on, hottest
  // first, as far as the cap and the device allow (`*stopped` when they do
  // not): pages `given_up` by the batch's spills first, then new ones.
  std::vector<Move> restore_targets(const std::vector<std::size_t>& ids, std::size_t begin,
                                    const std::vector<LivePage>& pages, std::vector<PageHandle>& given_up,
                                    bool* stopped) {
    std::vector<Move> moves;
    try {
      for (std::size_t i = begin; i < std::min(ids.size(), begin + kPagesPerWait); ++i) {
        // A spill that stopped early leaves no room under the cap.
        if (device_bytes() + (moves.size() + 1) * page_bytes > effective_cap()) break;
        PageHandle target;
        if (!given_up.empty()) {
          target = given_up.back();
          given_up.pop_back();
        } else {
          target = new_page(Residency::kDevice);
        }
        if (!target) break;  // the device is taken by others: the next safe point tries again
        moves.push_back({&pages[ids[i]], target});
      }
    } catch (...) {
      give_back_targets(moves, 0);
      throw;
    }
    *stopped = moves.size() < std::min(ids.size() - begin, kPagesPerWait);
    return moves;
  }

  // Restores a run of `count` moves (pages that follow one another in one
  // segment): the device pages take the host pages' place, then the bytes
  // follow from the host pages, which the backend reaches without a mapping
  // of ours. When a copy fails, that page and the rest of the run go back to
  // their host pages and the error goes on. Returns the bytes moved.
  std::size_t restore_run(const Move* run, std::size_t count, std::vector<PageHandle>& given_up) {
    remap_run(run, count);
    std::size_t moved = 0;
    for (std::size_t i = 0; i < count; ++i) {
      try {
        backend.copy_into(address_of(*run[i].live), backing(*run[i].live));
      } catch (...) {
        for (std::size_t k = i; k < count; ++k) {  // not in the books yet: backing() is the host page
          const DevicePtr address = address_of(*run[k].live);
          backend.unmap(address);
          give_back_page(run[k].target);
          backend.map(address, backing(*run[k].live));
        }
        throw;
      }
      moved_page(*run[i].live, run[i].target, given_up);
      moved += page_bytes;
    }
    return moved;
  }

  // Moves pages to the device, keeping their addresses and bytes, hottest
  // first, kPagesPerWait at a time, each group in runs of neighbouring
  // pages; stops when the cap is full or no device page can be had. The
  // copies of one group run while the next group's pages are remapped. A
  // failed driver call leaves the pages not yet moved where they were.
  // Returns the bytes moved.
  std::size_t restore_pages(const std::vector<std::size_t>& ids, const std::vector<LivePage>& pages,
                            std::vector<PageHandle>& given_up) {
    std::size_t moved = 0;
    bool stopped = false;
    for (std::size_t begin = 0; begin < ids.size() && !stopped; begin += kPagesPerWait) {
      std::vector<Move> moves = restore_targets(ids, begin, pages, given_up, &stopped);
      std::sort(moves.begin(), moves.end(), by_address);
      for (std::size_t i = 0; i < moves.size();) {
        const std::size_t length = run_length(&moves[i], moves.size() - i);
        try {
          moved += restore_run(&moves[i], length, given_up);
        } catch (...) {
          give_back_targets(moves, i + length);
          throw;
        }
        i += length;
      }
    }
    return moved;
  }

  // A host page for a spill: one taken at allocation, else a new one. Where
  // the host has none left and the spill is owed to the cap (`for_the_cap`),
  // a cached host page is given up for it: the loop's host cache stays
  // mapped under the cap (apply_migrations), and a live page over the cap
  // outranks a free page's place in the loop's layout. Its release asks
  // synchronize_for_unmap() (none during a graph capture; on a GPU the safe
  // point's own synchronize covers it).
  PageHandle spill_target(bool for_the_cap) {
    if (!spill_targets.empty()) return take_spill_target();
    if (PageHandle page = new_page(Residency::kHost)) return page;
    const Residency host = Residency::kHost;
    if (!for_the_cap || release_cached_pages(&host, page_bytes) == 0) return {};
    return new_page(Residency::kHost);
  }

  // Moves live pages to the host, keeping their addresses and bytes; stops
  // early when the host has no page left. Copies first, then remaps: the
  // host page a spill fills is reachable without a mapping of ours, so the
  // batch's copies run back to back, and the pages take their host pages
  // once their copies are done (no page mapped twice for a copy). The copies
  // are waited for kPagesPerWait at a time, so the first pages are remapped
  // while the later ones still copy; each run of neighbouring pages among
  // them is remapped with one access call. The device pages given up go to
  // `given_up`. A failed copy or wait leaves the pages not yet remapped
  // where they were; a failed remap, that run and the pages after it.
  // Returns the bytes moved.
  std::size_t spill_pages(const std::vector<std::size_t>& ids, const std::vector<LivePage>& pages,
                          std::vector<PageHandle>& given_up) {
    // Targets not (yet) remapped go back, also when a step throws.
    struct Targets {
      State& state;
      std::vector<Move> copied;
      std::size_t taken = 0;  // copied[0, taken) belong to remap_run now
      ~Targets() { state.give_back_targets(copied, taken); }
    } targets{*this, {}};
    // After every kPagesPerWait copies: how many were issued, and the mark to wait for.
    std::vector<std::pair<std::size_t, Backend::CopyMark>> marks;
    std::exception_ptr failed_copy;
    const std::uint64_t over = device_bytes() > effective_cap() ? device_bytes() - effective_cap() : 0;
    for (std::size_t id : ids) {
      const PageHandle target = spill_target(targets.copied.size() * page_bytes < over);
      if (!target) break;  // the host is exhausted: the device stays over the cap
      targets.copied.push_back({&pages[id], target});
      if (holds_no_block(pages[id])) continue;  // a free device page: nothing to copy
      try {
        backend.copy_out(address_of(pages[id]), target);
      } catch (...) {
        failed_copy = std::current_exception();  // the pages copied so far still move
        targets.copied.pop_back();
        give_back_page(target);
        break;
      }
      if (targets.copied.size() % kPagesPerWait == 0) marks.emplace_back(targets.copied.size(), backend.mark_copies());
    }
    std::size_t moved = 0, done = 0;  // done: pages whose copies were waited for
    auto mark = marks.begin();
    while (targets.taken < targets.copied.size()) {
      if (mark != marks.end()) {
        backend.wait_for_copies(mark->second);
        done = mark->first;
        ++mark;
      } else {
        backend.finish_copies();  // the last copies (a copy that failed above moves nothing)
        done = targets.copied.size();
      }
      std::sort(targets.copied.begin() + static_cast<std::ptrdiff_t>(targets.taken),
                targets.copied.begin() + static_cast<std::ptrdiff_t>(done), by_address);
      while (targets.taken < done) {
        const std::size_t first = targets.taken;
        const std::size_t length = run_length(&targets.copied[first], done - first);
        targets.taken += length;  // remap_run gives them back if it fails
        remap_run(&targets.copied[first], length);
        for (std::size_t i = first; i < first + length; ++i) {
          moved_page(*targets.copied[i].live, targets.copied[i].target, given_up);
          moved += page_bytes;
        }
      }
    }
    if (failed_copy) std::rethrow_exception(failed_copy);
    return moved;
  }

  // The books of a page move that is done: `target` backs the live page now.
  void moved_page(const LivePage& live, PageHandle target, std::vector<PageHandle>& given_up) {
    Segment& segment = *live.segment;
    Page& page = segment.pages[live.index];
    const DevicePtr address = address_of(live);
    const Residency where = target.where;
    const PageHandle old = page.handle;
    count_mapped(segment, old.where, false);
    count_mapped(segment, where, true);
    page.handle = target;
    emit(AllocatorEvent::Kind::kPageMoved, address, page_bytes, segment.stream, where);
    if (page.live_blocks == 0) {  // a free page: its place moved, no bytes were copied
      cached_of(old.where) -= page_bytes;
      cached_of(where) += page_bytes;
    } else {
      const auto bytes = static_cast<std::int64_t>(page_bytes);
      (where == Residency::kHost ? stats.spilled_bytes : stats.restored_bytes) += bytes;
      ++stats.num_migrations;
    }
    // Last: the move is in the books. A release the driver refuses leaves the
    // old page with the process until it exits, and the error goes on.
    if (old.where == Residency::kDevice) {
      given_up.push_back(old);
    } else {
      give_back_page(old);  // the copy just issued may still read it: the backend keeps it till then
    }
  }

  // Live host pages take free device pages' places (plan_migrations'
  // into_free), kPagesPerWait at a time: the host page's bytes are copied
  // into the free device page where it is mapped, then the two trade
  // addresses, the device page backing the live one and the host page the
  // free one. No page is created or released and the device's bytes stay
  // as they are; the layout stays mapped. A failed copy moves nothing of
  // its group; a failed remap puts that pair's pages back where they were.
  // Returns the bytes moved to the device.
  std::size_t fill_free_device_pages(const std::vector<PageSwap>& swaps, const std::vector<LivePage>& pages) {
    std::size_t moved = 0;
    std::vector<const PageSwap*> copied;
    for (std::size_t begin = 0; begin < swaps.size(); begin += kPagesPerWait) {
      copied.clear();
      for (std::size_t i = begin; i < std::min(swaps.size(), begin + kPagesPerWait); ++i) {
        const LivePage &live = pages[swaps[i].host_page], &free = pages[swaps[i].free_device_page];
        // Planned before this safe point's spills: a free page released
        // since (the host could not take a spill) stays out of the swap.
        const Page& free_page = free.segment->pages[free.index];
        if (!free_page.handle || free_page.handle.where != Residency::kDevice || free_page.live_blocks != 0) continue;
        backend.copy_into(address_of(free), backing(live));
        copied.push_back(&swaps[i]);
      }
      backend.finish_copies();
      for (const PageSwap* swap : copied) {
        trade_backings(pages[swap->host_page], pages[swap->free_device_page]);
        moved += page_bytes;
      }
    }
    return moved;
  }

  // The live host page `live` and the free device page `free` trade
  // addresses (the copy is done). On a failed driver call both pages go
  // back where they were, and the error goes on.
  void trade_backings(const LivePage& live, const LivePage& free) {
    Page& host_page = live.segment->pages[live.index];
    Page& device_page = free.segment->pages[free.index];
    const PageHandle host = host_page.handle, device = device_page.handle;
    const DevicePtr live_address = address_of(live), free_address = address_of(free);
    int step = 0;  // driver calls done: unmap live, unmap free, map device at live, map host at free
    try {
      backend.unmap(live_address);
      ++step;
      backend.unmap(free_address);
      ++step;
      backend.map(live_address, device);
      ++step;
      backend.map(free_address, host);
      ++step;
    } catch (...) {
      if (step >= 3) backend.unmap(live_address);
      if (step >= 2) backend.map(free_address, device);
      if (step >= 1) backend.map(live_address, host);
      throw;
    }
    host_page.handle = device;
    device_page.handle = host;
    count_mapped(*live.segment, Residency::kHost, false);
    count_mapped(*live.segment, Residency::kDevice, true);
    count_mapped(*free.segment, Residency::kDevice, false);
    count_mapped(*free.segment, Residency::kHost, true);
    cached_of(Residency::kDevice) -= page_bytes;
    cached_of(Residency::kHost) += page_bytes;
    emit(AllocatorEvent::Kind::kPageMoved, live_address, page_bytes, live.segment->stream, Residency::kDevice);
    emit(AllocatorEvent::Kind::kPageMoved, free_address, page_bytes, free.segment->stream, Residency::kHost);
    stats.restored_bytes += static_cast<std::int64_t>(page_bytes);
    ++stats.num_migrations;
  }

  // Releases the cached host pages, coldest first, as far as the device has
  // room for them under the cap (less what a safe point spills ahead), all
  // of them without a cap: a block reusing one would run on the host where
  // the device could hold it. The rest stays mapped (see apply_migrations).
  void release_host_cache_the_device_has_room_for() {
    const Residency host = Residency::kHost;
    const std::uint64_t limit = effective_cap();
    const std::uint64_t room = limit == kNoCap ? kNoCap
                             : device_bytes() + spill_ahead() < limit ? limit - device_bytes() - spill_ahead() : 0;
    if (room >= page_bytes) release_cached_pages(&host, room);
  }

  // Moves what the plan says and returns the bytes moved; `*planned` is the
  // bytes the plan would move.
  std::size_t apply_migrations(std::size_t* planned) {
    *planned = 0;
    if (mode() != SpillMode::kRemap) return 0;
    struct ReleaseTargets {
      State& state;
      ~ReleaseTargets() {
        try {
          state.release_spill_targets();  // what the moves did not use
        } catch (...) {
        }
      }
    } release_targets{*this};
    // Cached pages hold no data: release instead of moving them. Host cache
    // stays mapped while host pages are kept (released, a page would only
    // go to the host pool, pinned still, and the loop's next block there
    // would map it again); otherwise what the loop no longer uses
    // (unused_before()) goes. A block placed on a host page of the layout
    // moves to the device at a safe point, into room under the cap or a
    // free device page's place (plan_migrations). Over the cap, the loop's
    // device cache goes only for what the live device pages cannot spill.
    const Residency host = Residency::kHost, device = Residency::kDevice;
    if (!keeping_host_pages()) release_cached_pages(&host, SIZE_MAX, /*synchronized=*/false, unused_before());
    if (spill_everything) release_cached_pages(&device);  // the device is to be left, not its cache kept on the host
    if (device_bytes() > effective_cap()) {
      release_cached_pages(&device, device_bytes() - effective_cap(), /*synchronized=*/false, unused_before());
    }
    const std::uint64_t live_device = device_bytes() - cached_of(device);
    if (device_bytes() > effective_cap() && device_bytes() - effective_cap() > live_device) {
      release_cached_pages(&device, device_bytes() - effective_cap() - live_device);
    }
    std::vector<LivePage> pages;
    const MigrationPlan moves = plan(&pages);
    if (moves.empty()) return 0;
    *planned = (moves.to_host.size() + moves.to_device.size() + moves.into_free.size()) * page_bytes;
    backend.synchronize_device();
    // Device pages the spills give up back the restores of the batch (a
    // host page hotter than a device page swaps places with it): a page
    // creation and a release fewer per swap. What is left goes back to the
    // driver, also when a move throws.
    struct GivenUp {
      State& state;
      std::vector<PageHandle> pages;
      ~GivenUp() {
        for (PageHandle page : pages) {
          try {
            state.backend.release_page(page);
          } catch (...) {
          }
        }
      }
    } given_up{*this, {}};
    const std::size_t spilled = spill_pages(moves.to_host, pages, given_up.pages);
    // Spills the host could not take (its headroom): the loop's cache goes instead.
    if (device_bytes() > effective_cap()) release_cached_pages(&device, device_bytes() - effective_cap());
    const std::size_t restored = restore_pages(moves.to_device, pages, given_up.pages);
    // A spill the host could not take left the device over the cap: its free
    // pages went above, and the swaps wait for the next safe point.
    if (device_bytes() > effective_cap()) return spilled + restored;
    return spilled + restored + fill_free_device_pages(moves.into_free, pages);
  }

  // ---- invariants ---------------------------------------------------------

  // The allocator's books, recomputed from the blocks and pages and compared
  // with what the fast paths keep incrementally. Throws Error naming the
  // first invariant that does not hold.
  void check_invariants() const {
    auto fail = [](const std::string& what) {
      throw Error(fmt::format("allocator invariant broken: {}", what));
    };
    const auto page = static_cast<std::int64_t>(page_bytes);
    std::int64_t device_mapped = 0, host_mapped = 0, pinned = 0, allocated_bytes = 0, allocated_count = 0;
    std::size_t cached[2] = {0, 0}, free_count = 0, pinned_free_count = 0;
    for (const auto& [base, segment] : segments) {
      if (segment->base != base) fail(fmt::format("segment {:#x} is filed under {:#x}", segment->base, base));
      DevicePtr expected = segment->base;
      std::vector<std::uint32_t> live(segment->pages.size(), 0);
      const Block* previous = nullptr;
      for (const Block* block = segment->first; block; block = block->next) {
        if (block->segment != segment.get()) fail(fmt::format("block {:#x} names another segment", block->address));
        if (block->prev != previous) fail(fmt::format("block {:#x}: prev link broken", block->address));
        if (block->address != expected) fail(fmt::format("blocks of segment {:#x} leave a gap or overlap at {:#x}", base, expected));
        if (block->size == 0 || block->size % options.round_bytes != 0) {
          fail(fmt::format("block {:#x} has size {}, not a positive multiple of {}", block->address, block->size, options.round_bytes));
        }
        const bool waiting_now = std::find(waiting.begin(), waiting.end(), block) != waiting.end();
        if (int(block->allocated) + int(block->in_pool) + int(waiting_now) != 1) {
          fail(fmt::format("block {:#x} is not in exactly one of allocated, free, waiting", block->address));
        }
        const auto it = allocated.find(block->address);
        if (block->allocated != (it != allocated.end() && it->second == block)) {
          fail(fmt::format("block {:#x}: allocated flag and the live map disagree", block->address));
        }
        if (block->in_pool && previous && previous->in_pool && !segment->pinned_fallback) {
          fail(fmt::format("free blocks {:#x} and {:#x} are neighbours: they should have merged", previous->address, block->address));
        }
        if (block->in_pool) ++(segment->pinned_fallback ? pinned_free_count : free_count);
        if (block->allocated) {
          allocated_bytes += static_cast<std::int64_t>(block->size);
          ++allocated_count;
        }
        if (!segment->pinned_fallback && !block->in_pool) {
          const auto [first, last] = page_range(*block);
          for (std::size_t i = first; i <= last; ++i) ++live[i];
        }
        expected = block->address + block->size;
        previous = block;
      }
      if (expected != segment->base + segment->size) fail(fmt::format("blocks of segment {:#x} do not cover it", base));
      if (segment->pinned_fallback) {
        pinned += static_cast<std::int64_t>(segment->size);
        continue;
      }
      for (std::size_t i = 0; i < segment->pages.size(); ++i) {
        const Page& p = segment->pages[i];
        if (p.live_blocks != live[i]) {
          fail(fmt::format("page {} of segment {:#x} counts {} live blocks, {} overlap it", i, base, p.live_blocks, live[i]));
        }
        if (p.live_blocks > 0 && !p.handle && !discarded) fail(fmt::format("page {} of segment {:#x} holds live blocks but is not mapped", i, base));
        if (!p.handle) continue;
        (p.handle.where == Residency::kDevice ? device_mapped : host_mapped) += page;
        if (p.live_blocks == 0) cached[static_cast<int>(p.handle.where)] += page_bytes;
      }
    }
    for (PageHandle target : spill_targets) {
      if (target.where != Residency::kHost) fail("a spill target is not a host page");
    }
    const auto targets = static_cast<std::int64_t>(spill_targets.size()) * page;
    if (free_count != free_blocks.size() || (step_plan.active() ? free_count : 0) != free_by_address.set().size() ||
        pinned_free_count != pinned_free.size()) {
      fail("free blocks and the free pools disagree in number");
    }
    if (cached[0] != cached_bytes[0] || cached[1] != cached_bytes[1]) fail("the cached byte counters drifted");
    if (stats.device_resident_bytes.current != device_mapped) fail("device_resident_bytes is not the mapped device pages");
    if (stats.host_resident_bytes.current != host_mapped + pinned + targets) {
      fail("host_resident_bytes is not the mapped host pages, pinned fallback memory and spill targets");
    }
    if (stats.pinned_fallback_bytes.current != pinned) fail("pinned_fallback_bytes is not the pinned segments");
    if (stats.reserved_bytes.all.current != device_mapped + host_mapped + pinned + targets) {
      fail("reserved_bytes is not device plus host memory held");
    }
    if (stats.allocated_bytes.all.current != allocated_bytes || stats.allocation.all.current != allocated_count ||
        allocated.size() != static_cast<std::size_t>(allocated_count)) {
      fail("allocated bytes or count drifted from the live blocks");
    }
    if (stats.active.all.current != allocated_count + static_cast<std::int64_t>(waiting.size())) {
      fail("active count is not allocated plus waiting blocks");
    }
    if (stats.segment.all.current != static_cast<std::int64_t>(segments.size())) fail("segment count drifted");
  }

  // Gives everything back. A call the driver refuses does not stop the
  // rest: what it refused stays with the process, and the first error goes
  // on once everything else is released.
  void release_everything() {
    std::exception_ptr first_error;
    auto attempt = [&](auto&& release) {
      try {
        release();
      } catch (...) {
        if (!first_error) first_error = std::current_exception();
      }
    };
    attempt([&] { synchronize_waiting(); });
    // This allocator keeps no more host pages (a shared pool stays with the
    // device; one of its own goes with the allocator).
    attempt([&] { host_pages->set_keeping(this, false); });
    attempt([&] { release_spill_targets(); });
    // One wait covers every page and pinned segment (none is possible during
    // a graph capture: then each release waits as it can).
    bool synchronized = false;
    attempt([&] { synchronized = !segments.empty() && backend.synchronize_for_unmap(); });
    for (auto& [base, segment] : segments) {
      bool all_unmapped = true;
      for (std::size_t i = 0; i < segment->pages.size(); ++i) {
        const PageHandle handle = segment->pages[i].handle;
        if (!handle) continue;
        const DevicePtr address = segment->base + i * page_bytes;
        bool unmapped = false;
        attempt([&] {
          if (synchronized) backend.unmap_synchronized(address);
          else backend.unmap(address);
          unmapped = true;
        });
        if (unmapped) attempt([&] { backend.release_page(handle); });
        all_unmapped = all_unmapped && unmapped;
      }
      // A range that still has a page mapped in it cannot be given back.
      if (all_unmapped) attempt([&] {
        if (!segment->pinned_fallback) {
          backend.release(segment->base, segment->size);
        } else if (synchronized) {
          backend.free_pinned_host_synchronized(segment->base, segment->size);
        } else {
          backend.free_pinned_host(segment->base, segment->size);
        }
      });
      for (Block* block = segment->first; block;) {
        Block* next = block->next;
        delete block;
        block = next;
      }
    }
    segments.clear();
    for (EventHandle event : spare_events) attempt([&] { backend.destroy_event(event); });
    spare_events.clear();
    if (first_error) std::rethrow_exception(first_error);
  }
};

CachingAllocator::CachingAllocator(Backend& backend, AllocatorOptions options,
                                   std::shared_ptr<HostPagePool> host_pages)
    : backend_(backend), state_(std::make_unique<State>(backend, options, std::move(host_pages))) {
  state_->stats.memory_cap = kNoCap;
  state_->stats.mode = state_->mode();
  state_->update_host_keeping();  // spill_without_cap keeps from the start
}

CachingAllocator::~CachingAllocator() {
  std::lock_guard lock(state_->mutex);
  state_->sink = nullptr;  // what tearing down releases is no event of the allocator's life
  try {
    state_->release_everything();
  } catch (...) {
    // A destructor must not throw (that terminates the process): what the
    // driver refused to release stays with the process until it exits.
  }
}

DevicePtr CachingAllocator::allocate(std::size_t bytes, StreamId stream, OnOutOfMemory on_oom) {
  if (bytes == 0) return 0;
  State& s = *state_;
  std::lock_guard lock(s.mutex);
  if (s.discarded) {
    throw Error(fmt::format("cannot allocate {}: this allocator's pages are discarded; back them "
                            "(back_discarded_pages, a region's resume) before allocating",
                            format_size(bytes)));
  }
  s.process_events();
  // More than half the address space can never be had, and rounding a size
  // this close to 2**64 up to a block or page would wrap around to a small one.
  if (bytes > std::numeric_limits<std::size_t>::max() / 2) s.out_of_memory(bytes, stream);
  const std::size_t size = round_up(bytes, s.options.round_bytes);
  // A block no residency could hold fails at once, before it maps the
  // device full (and takes it from other processes) only to give it back.
  // Only a block larger than the device asks for the host's room (a read of
  // /proc/meminfo and the cgroup's files on the CUDA backend): the warm path
  // makes no query.
  const std::size_t pages_bytes = round_up(size, s.page_bytes);
  // The device's other caches could not make room for it either: it throws whatever `on_oom` says.
  if (pages_bytes > s.device_total && pages_bytes > s.most_one_block_could_hold()) s.out_of_memory(bytes, stream);
  const PoolKind pool = size <= s.options.small_request_max ? PoolKind::kSmall : PoolKind::kLarge;
  const bool quiet = on_oom == OnOutOfMemory::kReturnZero;
  ++s.tick;

  Block* block = s.take_planned(size, stream);
  if (!block) {
    block = s.best_fit_mapped_first(stream, size);
    if (block) s.pool_erase(block);
    else block = s.new_arena(size, stream);
    if (!block) {
      if (quiet) return 0;
      s.out_of_memory(size, stream);
    }
    s.split(block, size);
  }

  bool spilled = false, released_cache = false, backed = false;
  try {
    backed = s.back_block(*block, &spilled, &released_cache);
  } catch (...) {
    s.return_to_pool(block);  // the block is free again; the caller gets the driver's error
    throw;
  }
  if (!backed) {
    s.return_to_pool(block);  // back_block undid its page marks; nothing of the caller's is touched
    if (released_cache) ++s.stats.num_alloc_retries;
    block = nullptr;
    if (s.may_spill_allocation() && s.mode() == SpillMode::kPinnedFallback) {
      block = s.allocate_pinned_fallback(size, stream);
      spilled = block != nullptr;
    }
    if (!block) {
      if (quiet) return 0;
      s.out_of_memory(size, stream);
    }
  } else if (released_cache) {
    ++s.stats.num_alloc_retries;
  }

  s.hand_out(block, bytes, pool);
  s.step_plan.record(size, stream, block->address);
  if (spilled) ++s.stats.num_spilled_allocations;
  if (s.device_bytes() > s.effective_cap()) {
    // Placed over the cap in colder pages' stead: they move at the next safe point.
    s.stats.pending_spill_bytes = static_cast<std::int64_t>(s.device_bytes() - s.effective_cap());
    pending_migrations_.store(true, std::memory_order_release);
  } else if (s.live_host_pages_fit_on_the_device()) {
    pending_migrations_.store(true, std::memory_order_release);  // placed on the host while device pages are free
  }
  return block->address;
}

void CachingAllocator::free(DevicePtr address) {
  State& s = *state_;
  std::lock_guard lock(s.mutex);
  auto it = s.allocated.find(address);
  if (it == s.allocated.end()) {
    throw Error(fmt::format(
        "free({:#x}): no live allocation starts at this address; it was freed already or did not come from "
        "this allocator, so nothing was freed",
        address));
  }
  // The events first: a backend that cannot record one (the driver shutting
  // down, a stream of another device) leaves the block allocated and the
  // books as they were, so a caller that must not throw (a tensor's deleter)
  // can report the error and go on.
  s.free_live(it);
  // Device pages freed while live pages sit on the host: they trade places
  // at the next safe point.
  if (s.live_host_pages_fit_on_the_device()) {
    pending_migrations_.store(true, std::memory_order_release);
  }
}

void CachingAllocator::record_stream(DevicePtr address, StreamId stream) {
  State& s = *state_;
  std::lock_guard lock(s.mutex);
  auto it = s.allocated.find(address);
  if (it == s.allocated.end()) {
    throw Error(fmt::format("record_stream({:#x}): no live allocation starts at this address", address));
  }
  Block* block = it->second;
  if (stream == block->segment->stream) return;
  if (std::find(block->used_on.begin(), block->used_on.end(), stream) == block->used_on.end()) {
    block->used_on.push_back(stream);
  }
}

void CachingAllocator::empty_cache() {
  State& s = *state_;
  std::lock_guard lock(s.mutex);
  s.synchronize_waiting();
  // The footprint grows again from what the job keeps: the rule's stop and
  // its releases so far are forgotten (a page it released before is no
  // release of the new footprint coming back).
  s.cold_rule_floor = 0;
  for (auto& [base, segment] : s.segments) {
    for (Page& page : segment->pages) page.released_cold = 0;
  }
  // One wait covers the cached pages and the cached pinned segments.
  const bool any_cache = s.cached_bytes[0] + s.cached_bytes[1] > 0 || !s.pinned_free.empty();
  if (any_cache && s.backend.synchronize_for_unmap()) {
    s.release_cached_pages(nullptr, SIZE_MAX, /*synchronized=*/true);
    s.release_pinned_cache(/*synchronized=*/true);
  }
  s.trim_spill_targets();
  s.host_pages->trim();
  // Whole free segments give their address range back too.
  for (auto it = s.segments.begin(); it != s.segments.end();) {
    Segment& segment = *it->second;
    ++it;
    Block* only = segment.first;
    if (segment.pinned_fallback || !only->in_pool || only->next) continue;
    // Pages kept because the device could not synchronize keep their range.
    if (std::any_of(segment.pages.begin(), segment.pages.end(), [](const Page& page) { return bool(page.handle); })) {
      continue;
    }
    // Given back first: a range the driver refuses to free stays a free
    // arena in its pool, for a later empty_cache() or an allocation.
    s.backend.release(segment.base, segment.size);
    s.pool_erase(only);
    s.delete_segment(segment);
  }
  s.mark_pending(pending_migrations_);  // released room may let host pages come back
}

std::size_t CachingAllocator::allocation_size(DevicePtr address) const {
  std::lock_guard lock(state_->mutex);
  auto it = state_->allocated.find(address);
  return it == state_->allocated.end() ? 0 : it->second->size;
}

bool CachingAllocator::is_device_resident(DevicePtr address) const {
  const State& s = *state_;
  std::lock_guard lock(s.mutex);
  auto it = s.segments.upper_bound(address);
  if (it == s.segments.begin()) return false;
  const Segment& segment = *std::prev(it)->second;
  if (address >= segment.base + segment.size || segment.pinned_fallback) return false;
  const Page& page = segment.pages[(address - segment.base) / s.page_bytes];
  return page.handle && page.handle.where == Residency::kDevice;
}

void CachingAllocator::mark_iteration() {
  State& s = *state_;
  std::lock_guard lock(s.mutex);
  // A tick of its own: a free between this mark and the next allocation
  // stamps its pages with it, so they are not cold.
  s.previous_mark = s.cold_before;
  s.cold_before = ++s.tick;
  s.last_iteration_peak = s.iteration_peak;
  s.iteration_peak = s.stats.allocated_bytes.all.current;
  const bool was_active = s.step_plan.active();
  s.step_plan.mark(s.mapped_this_step);
  s.mapped_this_step = false;
  if (s.step_plan.active() == was_active) return;  // free_by_address is kept while the plan is active
  s.free_by_address.clear();
  if (!s.step_plan.active()) return;
  for (const auto& [base, segment] : s.segments) {
    if (segment->pinned_fallback) continue;
    for (Block* block = segment->first; block; block = block->next) {
      if (block->in_pool) s.free_by_address.insert(block);
    }
  }
}

std::size_t CachingAllocator::host_bytes_of(DevicePtr address) const {
  const State& s = *state_;
  std::lock_guard lock(s.mutex);
  auto it = s.allocated.find(address);
  if (it == s.allocated.end()) return 0;
  const Block& block = *it->second;
  const Segment& segment = *block.segment;
  if (segment.pinned_fallback) return block.size;
  return s.bytes_on(block, Residency::kHost);
}

std::size_t CachingAllocator::host_live_bytes() const {
  std::lock_guard lock(state_->mutex);
  return state_->host_live_bytes();
}

void CachingAllocator::set_memory_cap(std::uint64_t bytes) {
  if (bytes == 0) Cap::of_bytes(0);  // throws the one message for a zero cap
  State& s = *state_;
  std::lock_guard lock(s.mutex);
  s.cap = bytes;
  s.stats.memory_cap = bytes;
  if (s.spill_everything) return;  // everything stays on the host until restore_all()
  if (s.device_bytes() > bytes) {
    const Residency device = Residency::kDevice;
    s.release_cached_pages(&device, s.device_bytes() - bytes);  // cache goes first: it costs no copy
  }
  // A cap raised or lifted gives the device room for the loop's host cache,
  // which safe points under the lower cap kept mapped: released now, the
  // blocks placed there come back on the device. No safe point may follow:
  // with no live page on the host, nothing is pending.
  s.release_host_cache_the_device_has_room_for();
  s.trim_spill_targets();
  s.update_host_keeping();
  s.mark_pending(pending_migrations_);
}

void CachingAllocator::set_memory_cap(const Cap& cap) { set_memory_cap(cap.to_word(backend_.device_total_bytes())); }

std::uint64_t CachingAllocator::memory_cap() const {
  std::lock_guard lock(state_->mutex);
  return state_->cap;
}

bool CachingAllocator::spilled_all() const {
  std::lock_guard lock(state_->mutex);
  return state_->spill_everything;
}

void CachingAllocator::spill_all() {
  State& s = *state_;
  std::lock_guard lock(s.mutex);
  s.spill_everything = true;
  s.update_host_keeping();
  const Residency device = Residency::kDevice;
  s.release_cached_pages(&device);
  s.mark_pending(pending_migrations_);
}

void CachingAllocator::restore_all() {
  State& s = *state_;
  std::lock_guard lock(s.mutex);
  s.spill_everything = false;
  s.trim_spill_targets();
  s.update_host_keeping();
  s.mark_pending(pending_migrations_);
}

std::size_t CachingAllocator::apply_pending_migrations() {
  State& s = *state_;
  std::lock_guard lock(s.mutex);
  std::size_t planned = 0;
  const std::size_t moved = s.apply_migrations(&planned);
  if (moved == planned) {
    // The whole plan moved: planning again would find nothing to move (the
    // spills left the device under the cap, the restores filled what room
    // was left, and what stayed on the host is colder than what stayed on
    // the device), so nothing is pending. Skips a second pass over every
    // live page at each safe point.
    s.stats.pending_spill_bytes = s.stats.pending_restore_bytes = 0;
    pending_migrations_.store(false, std::memory_order_release);
    return moved;
  }
  // Whatever could not move now (no host or device page to be had) stays
  // pending, and the next safe point retries it; a caller polling the flag
  // on a hot path backs off between retries (the torch layer does).
  s.mark_pending(pending_migrations_);
  return moved;
}

std::optional<std::size_t> CachingAllocator::host_room() const { return state_->host_pages->room(); }

std::size_t CachingAllocator::reserve_host_memory(std::size_t bytes) {
  State& s = *state_;
  // Pinned without the allocator's lock (nor the pool's): allocations, safe
  // points and the job channel's reads of the statistics go on meanwhile.
  return s.host_pages->reserve(bytes);
}

std::size_t CachingAllocator::host_reserve() const { return state_->host_pages->reserve_bytes(); }

SpillMode CachingAllocator::mode() const { return state_->mode(); }

void CachingAllocator::check_invariants() const {
  std::lock_guard lock(state_->mutex);
  state_->check_invariants();
}

AllocatorStats CachingAllocator::stats() const {
  std::lock_guard lock(state_->mutex);
  AllocatorStats out = state_->stats;
  out.host_pool_bytes = state_->host_pages->kept();
  out.num_host_headroom_refusals = state_->host_pages->headroom_refusals();
  out.host_live_bytes = static_cast<std::int64_t>(state_->host_live_bytes());
  out.memory_cap = state_->cap;
  out.spilled_all = state_->spill_everything;
  out.mode = state_->mode();
  return out;
}

void CachingAllocator::reset_peak_stats() {
  std::lock_guard lock(state_->mutex);
  state_->stats.reset_peaks();
  state_->host_pages->reset_peak();
}

void CachingAllocator::reset_accumulated_stats() {
  std::lock_guard lock(state_->mutex);
  state_->stats.reset_accumulated();
  state_->host_pages->reset_accumulated();
}

void CachingAllocator::set_event_sink(AllocatorEventSink* sink) {
  std::lock_guard lock(state_->mutex);
  state_->sink = sink;
}

std::size_t CachingAllocator::largest_free_block(StreamId stream, std::size_t room) const {
  const State& s = *state_;
  std::lock_guard lock(s.mutex);
  std::size_t largest = room;
  for (const auto& [base, segment] : s.segments) {
    if (segment->stream != stream || segment->pinned_fallback) continue;  // pinned: host memory
    for (const Block* block = segment->first; block; block = block->next) {
      if (block->allocated || !block->in_pool || block->size <= largest) continue;
      const std::size_t on_device = s.bytes_on(*block, Residency::kDevice);
      largest = std::max(largest, on_device + std::min(block->size - on_device, room));
    }
  }
  return largest;
}

std::vector<SegmentInfo> CachingAllocator::snapshot() const {
  const State& s = *state_;
  std::lock_guard lock(s.mutex);
  std::vector<SegmentInfo> out;
  out.reserve(s.segments.size());
  for (const auto& [base, segment] : s.segments) {
    SegmentInfo info;
    info.address = segment->base;
    info.size = segment->size;
    info.stream = segment->stream;
    info.pool = segment->pool;
    info.pinned_fallback = segment->pinned_fallback;
    if (segment->pinned_fallback) info.host_bytes = segment->size;
    for (std::size_t i = 0; i < segment->pages.size(); ++i) {
      const Page& page = segment->pages[i];
      if (!page.handle) continue;
      (page.handle.where == Residency::kDevice ? info.device_bytes : info.host_bytes) += s.page_bytes;
      const DevicePtr address = segment->base + i * s.page_bytes;
      auto& runs = info.mapped_runs;
      if (!runs.empty() && runs.back().where == page.handle.where && runs.back().address + runs.back().size == address) {
        runs.back().size += s.page_bytes;
      } else {
        runs.push_back({address, s.page_bytes, page.handle.where});
      }
    }
    for (const Block* block = segment->first; block; block = block->next) {
      info.blocks.push_back({block->address, block->size, block->requested, block->allocated,
                             !block->allocated && !block->in_pool});
    }
    out.push_back(std::move(info));
  }
  return out;
}

CachingAllocator::Restored CachingAllocator::restore_allocations(const std::vector<SegmentInfo>& checkpoint) {
  State& s = *state_;
  std::lock_guard lock(s.mutex);
  // Everything checked before anything changes.
  std::vector<std::pair<Segment*, const BlockInfo*>> wanted;
  for (const SegmentInfo& info : checkpoint) {
    auto found = s.segments.find(info.address);
    if (found == s.segments.end() || found->second->size != info.size || found->second->pinned_fallback ||
        found->second->stream != info.stream) {
      throw Error(fmt::format("cannot restore the checkpoint: its segment at {:#x} ({}) is no longer this "
                              "allocator's (its memory was released since); take a new checkpoint",
                              info.address, format_size(info.size)));
    }
    Segment& segment = *found->second;
    for (const BlockInfo& block : info.blocks) {
      if (!block.allocated) continue;
      if (block.size == 0 || block.address < segment.base || block.address + block.size > segment.base + segment.size ||
          block.address % s.options.round_bytes != 0 || block.size % s.options.round_bytes != 0) {
        throw Error(fmt::format("cannot restore the checkpoint: its block at {:#x} ({}) does not lie on the "
                                "rounding inside its segment; give a snapshot() of this allocator",
                                block.address, format_size(block.size)));
      }
      if (!s.all_mapped(segment, block.address, block.size)) {
        throw Error(fmt::format("cannot restore the checkpoint: pages under its block at {:#x} ({}) were "
                                "released since (empty_cache() on a pool no graph held); take a new checkpoint",
                                block.address, format_size(block.size)));
      }
      wanted.emplace_back(&segment, &block);
    }
  }
  std::sort(wanted.begin(), wanted.end(),
            [](const auto& a, const auto& b) { return a.second->address < b.second->address; });
  for (std::size_t i = 1; i < wanted.size(); ++i) {
    if (wanted[i - 1].second->address + wanted[i - 1].second->size > wanted[i].second->address) {
      throw Error(fmt::format("cannot restore the checkpoint: its blocks at {:#x} and {:#x} overlap",
                              wanted[i - 1].second->address, wanted[i].second->address));
    }
  }

  Restored out;
  out.freed.reserve(s.allocated.size());
  for (const auto& [address, block] : s.allocated) out.freed.push_back(address);
  std::sort(out.freed.begin(), out.freed.end());
  for (DevicePtr address : out.freed) s.free_live(s.allocated.find(address));
  s.synchronize_waiting();  // every block free: each segment is its free blocks

  out.allocated.reserve(wanted.size());
  Block* placed = nullptr;  // the last block placed; the next one lies after it
  for (const auto& [segment, info] : wanted) {
    Block* hole = placed != nullptr && placed->segment == segment ? placed->next : segment->first;
    while (hole->address + hole->size <= info->address) hole = hole->next;
    placed = s.carve(hole, info->address, info->size);
    bool spilled = false, released_cache = false;
    s.back_block(*placed, &spilled, &released_cache);  // maps nothing: checked above
    const std::size_t rounded = round_up(info->requested_size, s.options.round_bytes);
    s.hand_out(placed, info->requested_size,
               rounded <= s.options.small_request_max ? PoolKind::kSmall : PoolKind::kLarge);
    out.allocated.push_back(info->address);
  }
  return out;
}

// ---- discarding pages ----------------------------------------------------------

std::size_t CachingAllocator::discard_pages() {
  State& s = *state_;
  std::lock_guard lock(s.mutex);
  if (!s.backend.synchronize_for_unmap()) {
    throw Error("cannot discard pages while a CUDA graph is being captured on the device: kernels "
                "captured so far may use them. Discard after the capture ends.");
  }
  s.release_spill_targets();
  // Discarded from the first page on: when the driver refuses an unmap part
  // way, the allocator still refuses allocations and back_discarded_pages()
  // backs (and zeroes) what is gone.
  s.discarded = true;
  std::size_t released = 0;
  for (auto& [base, segment] : s.segments) {
    for (std::size_t i = 0; i < segment->pages.size(); ++i) {
      if (!segment->pages[i].handle) continue;
      s.unmap_page(*segment, i, /*synchronized=*/true);
      released += s.page_bytes;
    }
  }
  s.mark_pending(pending_migrations_);
  return released;
}

std::size_t CachingAllocator::back_discarded_pages() {
  State& s = *state_;
  std::lock_guard lock(s.mutex);
  if (!s.discarded) return 0;
  // Pages are zeroed in runs of neighbours once mapped: one zero() per run.
  std::vector<std::pair<DevicePtr, std::size_t>> runs;
  auto zero_runs = [&] {
    for (const auto& [address, bytes] : runs) s.backend.zero(address, bytes);
    runs.clear();
  };
  std::size_t mapped = 0;
  for (auto& [base, segment] : s.segments) {
    if (segment->pinned_fallback) continue;
    for (std::size_t i = 0; i < segment->pages.size(); ++i) {
      Page& page = segment->pages[i];
      if (page.live_blocks == 0) continue;
      // A page a failed discard left mapped is not backed again, but zeroed too.
      if (!page.handle) {
        const PageHandle handle = s.backend.create_page(Residency::kDevice);
        if (!handle) {
          zero_runs();
          ++s.stats.num_ooms;
          throw OutOfMemoryError(fmt::format(
              "cotenant: the device has no room to back discarded memory again: {} mapped, more needed, "
              "the device reports {} free of {}. Free device memory (tensors, torch.cuda.empty_cache()) "
              "and resume again; what is mapped so far stays.",
              format_size(mapped), format_size(s.backend.device_free_bytes()),
              format_size(s.backend.device_total_bytes())));
        }
        s.map_page(*segment, i, handle);
        page.last_use = s.tick;
        mapped += s.page_bytes;
      }
      const DevicePtr address = segment->base + i * s.page_bytes;
      if (!runs.empty() && runs.back().first + runs.back().second == address) runs.back().second += s.page_bytes;
      else runs.emplace_back(address, s.page_bytes);
    }
  }
  zero_runs();
  s.discarded = false;
  s.mark_pending(pending_migrations_);
  return mapped;
}

bool CachingAllocator::discarded() const {
  std::lock_guard lock(state_->mutex);
  return state_->discarded;
}

}  // namespace cotenant
