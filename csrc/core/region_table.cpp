#include "cotenant/region_table.h"

#include <fmt/format.h>

#include "cotenant/errors.h"
#include "cotenant/pool_table.h"
#include "cotenant/size.h"

namespace cotenant {
namespace {

// The calling thread's region: its name and how many enter() calls are open.
struct ThreadRegion {
  std::string name;
  int depth = 0;
};
thread_local ThreadRegion t_region;
// Threads inside some region, so that allocations outside regions pay one
// relaxed load and no thread-local access.
std::atomic<int> g_threads_inside{0};

template <typename Region>
std::string quoted_names(const std::map<std::string, Region>& regions) {
  if (regions.empty()) return "none yet";
  std::string out;
  for (const auto& [name, region] : regions) out += (out.empty() ? "'" : ", '") + name + "'";
  return out;
}

}  // namespace

const char* region_state_name(RegionState state) {
  switch (state) {
    case RegionState::kActive: return "active";
    case RegionState::kPausedKept: return "paused (kept)";
    case RegionState::kPausedDiscarded: return "paused (discarded)";
  }
  return "unknown";
}

// ---- RegionScope -----------------------------------------------------------------

void RegionScope::enter(const std::string& name) {
  if (name.empty()) throw Error("a region needs a name, e.g. cotenant.region(\"kv_cache\")");
  if (t_region.depth > 0 && t_region.name != name) {
    throw Error(fmt::format("cannot enter region '{}' inside region '{}': regions do not nest, so an "
                            "allocation belongs to exactly one. Leave '{}' first.",
                            name, t_region.name, t_region.name));
  }
  if (t_region.depth++ == 0) {
    t_region.name = name;
    g_threads_inside.fetch_add(1, std::memory_order_relaxed);
  }
}

void RegionScope::exit(const std::string& name) {
  if (t_region.depth == 0 || t_region.name != name) {
    throw Error(fmt::format("cannot leave region '{}': this thread is {}", name,
                            t_region.depth == 0 ? std::string("in no region")
                                                : fmt::format("in region '{}'", t_region.name)));
  }
  if (--t_region.depth == 0) {
    t_region.name.clear();
    g_threads_inside.fetch_sub(1, std::memory_order_relaxed);
  }
}

bool RegionScope::inside() {
  return g_threads_inside.load(std::memory_order_relaxed) > 0 && t_region.depth > 0;
}

const std::string& RegionScope::current() { return t_region.name; }

// ---- RegionTable -----------------------------------------------------------------

RegionTable::RegionTable(Backend& backend, std::shared_ptr<HostPagePool> host_pages)
    : backend_(backend), host_pages_(std::move(host_pages)) {}

RegionTable::~RegionTable() = default;

RegionTable::Region& RegionTable::find_locked(const std::string& name, const char* what) {
  return const_cast<Region&>(static_cast<const RegionTable*>(this)->find_locked(name, what));
}

const RegionTable::Region& RegionTable::find_locked(const std::string& name, const char* what) const {
  auto it = regions_.find(name);
  if (it == regions_.end()) {
    throw Error(fmt::format("cannot {} region '{}': no allocation was made in a region of that name "
                            "(regions: {}). A region comes into being with its first allocation inside "
                            "`with cotenant.region(\"{}\"):`.",
                            what, name, quoted_names(regions_), name));
  }
  return it->second;
}

void RegionTable::refuse_during_capture(const std::string& name, const char* what) const {
  if (!graph_capture_.load(std::memory_order_acquire)) return;
  throw Error(fmt::format("cannot {} region '{}' while a CUDA graph is being captured: its pages move, "
                          "and the capture may record kernels on them. {} the region after the capture "
                          "(outside `with torch.cuda.graph(...)`).",
                          what, name, what[0] == 'p' ? "Pause" : "Resume"));
}

DevicePtr RegionTable::allocate(std::size_t bytes, StreamId stream, CachingAllocator** allocator,
                                OnOutOfMemory on_oom) {
  const std::string& name = RegionScope::current();
  if (name.empty()) throw Error("RegionTable::allocate called outside every region");
  std::lock_guard lock(mutex_);
  Region& region = regions_[name];
  if (!region.allocator) {
    region.allocator = std::make_unique<CachingAllocator>(backend_, PoolTable::pool_options(), host_pages_);
    if (event_sink_ != nullptr) region.allocator->set_event_sink(event_sink_);
  }
  if (region.state != RegionState::kActive) {
    throw Error(fmt::format("cannot allocate {} in region '{}': it is {}. Resume it first with "
                            "cotenant.resume_region(\"{}\"), or allocate outside the region.",
                            format_size(bytes), name, region_state_name(region.state), name));
  }
  *allocator = region.allocator.get();
  return region.allocator->allocate(bytes, stream, on_oom);
}

void RegionTable::set_event_sink(AllocatorEventSink* sink) {
  std::lock_guard lock(mutex_);
  event_sink_ = sink;
  for (auto& [name, region] : regions_) {
    if (region.allocator) region.allocator->set_event_sink(sink);
  }
}

namespace {

// Applies the moves a pause (spill_all) or a resume (restore_all) asked for.
// When the driver fails one part way, the pages that moved go back where
// they were (to the host when `back_to_host`), so the region is whole where
// it was, and the first error goes on (a failure of the way back is not
// the caller's error).
std::size_t apply_or_move_back(CachingAllocator& a, bool back_to_host) {
  try {
    return a.apply_pending_migrations();
  } catch (const Error&) {
    try {
      if (back_to_host) {
        a.spill_all();
      } else {
        a.restore_all();
      }
      a.apply_pending_migrations();
    } catch (const Error&) {
    }
    throw;
  }
}

}  // namespace

std::size_t RegionTable::pause(const std::string& name, bool keep) {
  std::lock_guard lock(mutex_);
  Region& region = find_locked(name, "pause");
  if (region.state != RegionState::kActive) {
    throw Error(fmt::format("cannot pause region '{}': it is {} already. Resume it with "
                            "cotenant.resume_region(\"{}\") first.",
                            name, region_state_name(region.state), name));
  }
  refuse_during_capture(name, "pause");
  CachingAllocator& a = *region.allocator;
  if (!keep) {
    std::size_t released = 0;
    try {
      released = a.discard_pages();
    } catch (const Error&) {
      // Part of it is gone: the region is paused, and resume() backs all of it again, zeroed.
      if (a.discarded()) region.state = RegionState::kPausedDiscarded;
      throw;
    }
    region.state = RegionState::kPausedDiscarded;
    return released;
  }
  if (a.mode() != SpillMode::kRemap) {
    throw Error(fmt::format("cannot pause region '{}' keeping its contents: this device cannot map host "
                            "pages (no host virtual memory management), so its pages cannot move to the "
                            "host. Pause it with keep=False to release its memory instead.",
                            name));
  }
  a.spill_all();
  const std::size_t moved = apply_or_move_back(a, /*back_to_host=*/false);  // a driver error: active, on the device
  if (a.has_pending_migrations()) {
    // The host ran out of pages: the region stays where it can run.
    a.restore_all();
    a.apply_pending_migrations();
    throw OutOfMemoryError(fmt::format(
        "cannot pause region '{}' keeping its contents: host memory ran out after moving {} of it, so it "
        "stays on the device. Free host memory, or pause it with keep=False to release its memory.",
        name, format_size(moved)));
  }
  region.state = RegionState::kPausedKept;
  return moved;
}

std::size_t RegionTable::resume(const std::string& name) {
  std::lock_guard lock(mutex_);
  Region& region = find_locked(name, "resume");
  if (region.state == RegionState::kActive) {
    throw Error(fmt::format("cannot resume region '{}': it is not paused.", name));
  }
  refuse_during_capture(name, "resume");
  CachingAllocator& a = *region.allocator;
  if (region.state == RegionState::kPausedDiscarded) {
    const std::size_t mapped = a.back_discarded_pages();  // throws, still paused, when the device is full
    region.state = RegionState::kActive;
    return mapped;
  }
  a.restore_all();
  const std::size_t moved = apply_or_move_back(a, /*back_to_host=*/true);  // a driver error: paused, on the host
  if (a.has_pending_migrations()) {
    const std::size_t left = static_cast<std::size_t>(a.stats().host_resident_bytes.current);
    a.spill_all();  // still paused: what came back goes out again, so the region is whole on the host
    a.apply_pending_migrations();
    throw OutOfMemoryError(fmt::format(
        "cannot resume region '{}': the device has no room for {} of it (the device reports {} free). "
        "Free device memory (tensors, torch.cuda.empty_cache()) and resume again; the region stays "
        "paused, its contents on the host.",
        name, format_size(left), format_size(backend_.device_free_bytes())));
  }
  region.state = RegionState::kActive;
  return moved;
}

std::vector<std::string> RegionTable::spill_active() {
  std::lock_guard lock(mutex_);
  std::vector<std::string> spilled;
  for (auto& [name, region] : regions_) {
    if (region.state != RegionState::kActive || region.allocator->mode() != SpillMode::kRemap) continue;
    region.allocator->spill_all();
    spilled.push_back(name);
  }
  return spilled;
}

void RegionTable::restore_spilled(const std::vector<std::string>& names) {
  std::lock_guard lock(mutex_);
  for (const std::string& name : names) {
    auto it = regions_.find(name);
    if (it != regions_.end() && it->second.state == RegionState::kActive) it->second.allocator->restore_all();
  }
}

bool RegionTable::has_pending_migrations() const {
  std::lock_guard lock(mutex_);
  for (const auto& [name, region] : regions_) {
    if (region.allocator->has_pending_migrations()) return true;
  }
  return false;
}

std::size_t RegionTable::apply_pending_migrations() {
  std::lock_guard lock(mutex_);
  std::size_t moved = 0;
  for (auto& [name, region] : regions_) {
    if (region.allocator->has_pending_migrations()) moved += region.allocator->apply_pending_migrations();
  }
  return moved;
}

bool RegionTable::contains(const std::string& name) const {
  std::lock_guard lock(mutex_);
  return regions_.count(name) != 0;
}

RegionState RegionTable::state(const std::string& name) const {
  std::lock_guard lock(mutex_);
  return find_locked(name, "query").state;
}

std::vector<RegionInfo> RegionTable::regions() const {
  std::lock_guard lock(mutex_);
  std::vector<RegionInfo> out;
  for (const auto& [name, region] : regions_) {
    const AllocatorStats s = region.allocator->stats();
    out.push_back({name, region.state, static_cast<std::size_t>(s.allocated_bytes.all.current),
                   static_cast<std::size_t>(s.device_resident_bytes.current),
                   static_cast<std::size_t>(s.host_resident_bytes.current)});
  }
  return out;
}

std::vector<std::pair<std::string, CachingAllocator*>> RegionTable::allocators() const {
  std::lock_guard lock(mutex_);
  std::vector<std::pair<std::string, CachingAllocator*>> out;
  for (const auto& [name, region] : regions_) out.emplace_back(name, region.allocator.get());
  return out;
}

}  // namespace cotenant
