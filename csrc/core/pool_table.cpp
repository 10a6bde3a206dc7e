#include "cotenant/pool_table.h"

#include <algorithm>

#include <fmt/format.h>

#include "cotenant/errors.h"

namespace cotenant {

PoolTable::PoolTable(Backend& backend, std::shared_ptr<HostPagePool> host_pages)
    : backend_(backend), host_pages_(std::move(host_pages)) {}

PoolTable::~PoolTable() = default;

AllocatorOptions PoolTable::pool_options() {
  // The defaults: pages are unmapped only under pressure, never to grow, so
  // a graph's freed blocks keep the pages it replays.
  return AllocatorOptions{};
}

PoolTable::Pool& PoolTable::create_or_incref_locked(PoolId id) {
  Pool& pool = pools_[id];
  if (!pool.allocator) pool.allocator = std::make_shared<CachingAllocator>(backend_, pool_options(), host_pages_);
  ++pool.use_count;
  return pool;
}

bool PoolTable::routed_locked(PoolId id) const {
  return std::any_of(routes_.begin(), routes_.end(), [&](const auto& route) { return route.first == id; });
}

void PoolTable::drop_if_done_locked(std::map<PoolId, Pool>::iterator it) {
  // Only a pool its empty_cache() left holding nothing: its allocator's
  // destructor then releases nothing, so a reader elsewhere that holds the
  // last reference (pools(), find()) can let it go on any thread at any
  // time. What a capture kept from being unmapped (it forbids the device
  // synchronize; the capture need not be this table's) stays in the table
  // for a later empty_freeable().
  const AllocatorStats stats = it->second.allocator->stats();
  if (it->second.use_count <= 0 && routes_.empty() && stats.allocated_bytes.all.current == 0 &&
      stats.reserved_bytes.all.current == 0) {
    pools_.erase(it);
  }
}

void PoolTable::create_or_incref(PoolId id) {
  std::lock_guard lock(mutex_);
  create_or_incref_locked(id);
}

void PoolTable::begin_route(PoolId id, StreamFilter filter) {
  std::lock_guard lock(mutex_);
  if (routed_locked(id)) {
    throw Error(fmt::format("pool ({}, {}) already receives allocations; end its allocation to the pool "
                            "(endAllocateToPool) before beginning another",
                            id.first, id.second));
  }
  create_or_incref_locked(id);
  routes_.emplace_back(id, std::move(filter));
  routing_.store(true, std::memory_order_release);
}

void PoolTable::end_route(PoolId id) {
  std::lock_guard lock(mutex_);
  routes_.erase(std::remove_if(routes_.begin(), routes_.end(), [&](const auto& route) { return route.first == id; }),
                routes_.end());
  routing_.store(!routes_.empty(), std::memory_order_release);
}

void PoolTable::release(PoolId id) {
  std::lock_guard lock(mutex_);
  auto it = pools_.find(id);
  if (it == pools_.end()) return;
  if (--it->second.use_count > 0) return;
  it->second.use_count = 0;
  it->second.allocator->empty_cache();
  drop_if_done_locked(it);
}

std::shared_ptr<CachingAllocator> PoolTable::route_for(StreamId stream, PoolId* id) {
  std::lock_guard lock(mutex_);
  for (auto& [routed, filter] : routes_) {
    if (!filter(stream)) continue;
    if (id != nullptr) *id = routed;
    return pools_.at(routed).allocator;
  }
  return nullptr;
}

int PoolTable::use_count(PoolId id) const {
  std::lock_guard lock(mutex_);
  auto it = pools_.find(id);
  return it == pools_.end() ? 0 : it->second.use_count;
}

std::shared_ptr<CachingAllocator> PoolTable::find(PoolId id) {
  std::lock_guard lock(mutex_);
  auto it = pools_.find(id);
  return it == pools_.end() ? nullptr : it->second.allocator;
}

std::vector<std::pair<PoolId, std::shared_ptr<CachingAllocator>>> PoolTable::pools() const {
  std::lock_guard lock(mutex_);
  std::vector<std::pair<PoolId, std::shared_ptr<CachingAllocator>>> out;
  for (const auto& [id, pool] : pools_) out.emplace_back(id, pool.allocator);
  return out;
}

void PoolTable::for_each_pool(const std::function<void(PoolId, const CachingAllocator&)>& fn) const {
  std::lock_guard lock(mutex_);
  for (const auto& [id, pool] : pools_) fn(id, *pool.allocator);
}

std::size_t PoolTable::empty_freeable(const PoolId* only) {
  std::lock_guard lock(mutex_);
  std::size_t emptied = 0;
  for (auto it = pools_.begin(); it != pools_.end();) {
    auto current = it++;
    if (only != nullptr && current->first != *only) continue;
    if (current->second.use_count > 0 || routed_locked(current->first)) continue;
    current->second.allocator->empty_cache();
    ++emptied;
    drop_if_done_locked(current);
  }
  return emptied;
}

}  // namespace cotenant
