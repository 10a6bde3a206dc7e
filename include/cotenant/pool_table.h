// The private memory pools of one device (CUDA graph pools and
// torch.cuda.MemPool), with PyTorch's rules for who holds them, without torch.
//
// PyTorch's caching allocator keeps, per pool, a use count: one for each
// graph that replays the pool's memory and each MemPool object that owns it.
// beginAllocateToPool creates the pool or adds a holder and routes the
// allocations of the capturing streams to it; endAllocateToPool stops the
// routing; releasePool drops a holder. A pool whose count reached zero is
// "freeable": empty_cache may release its cached pages, and it disappears
// once no block of it is live. A pool that some graph still holds is never
// released, because its graphs replay kernels on its memory, freed blocks
// included.
//
// The table owns each pool's CachingAllocator. Pool allocators are never
// capped and never release cached pages to grow (a graph replay touches
// blocks freed during its capture), so a graph's memory stays where the
// capture saw it.
//
// Thread-safe: every method takes the table's mutex. The table shares each
// pool's allocator with whoever asked for it (find, pools, route_for): a
// pool dropped meanwhile (a release or empty_freeable on another thread) is
// destroyed once the last of them lets it go, never under a caller's feet.
// A pool is dropped only once it holds no page, so that destruction, on
// whichever thread, releases nothing.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "cotenant/backend.h"
#include "cotenant/caching_allocator.h"

namespace cotenant {

// A pool's id as PyTorch numbers them (c10::MempoolId_t's two halves).
using PoolId = std::pair<std::uint64_t, std::uint64_t>;

class PoolTable {
 public:
  // Which stream's allocations a route takes (PyTorch's capture filter).
  using StreamFilter = std::function<bool(StreamId)>;

  // `host_pages`: the device's host page pool, shared by the allocators
  // made here (null: each gets one of its own).
  explicit PoolTable(Backend& backend, std::shared_ptr<HostPagePool> host_pages = nullptr);
  ~PoolTable();
  PoolTable(const PoolTable&) = delete;
  PoolTable& operator=(const PoolTable&) = delete;

  // createOrIncrefPool: creates the pool with one holder, or adds one.
  void create_or_incref(PoolId id);
  // beginAllocateToPool: create_or_incref, then route the allocations of the
  // streams `filter` accepts to the pool until end_route. Throws Error when
  // the pool already receives allocations.
  void begin_route(PoolId id, StreamFilter filter);
  // endAllocateToPool: stops the routing (the holder stays).
  void end_route(PoolId id);
  // releasePool: one holder fewer. At zero the pool's cached pages are
  // released, and the pool goes once none of its blocks is live.
  void release(PoolId id);

  // The pool an allocation on `stream` goes to while routes are active, or
  // nullptr (then it goes to the device's main allocator). `id`, when given,
  // receives the pool's id.
  std::shared_ptr<CachingAllocator> route_for(StreamId stream, PoolId* id = nullptr);
  // Whether some route is active (lock-free: read on every allocation).
  bool routing() const { return routing_.load(std::memory_order_acquire); }

  int use_count(PoolId id) const;  // 0 for an unknown pool
  std::shared_ptr<CachingAllocator> find(PoolId id);
  // Every pool, in id order (statistics, snapshots).
  std::vector<std::pair<PoolId, std::shared_ptr<CachingAllocator>>> pools() const;
  // Calls fn(id, allocator) for every pool, in id order, under the table's
  // lock, so no pool is dropped meanwhile (a release on another thread may
  // drop one that pools() listed). fn must not call into the table.
  void for_each_pool(const std::function<void(PoolId, const CachingAllocator&)>& fn) const;

  // empty_cache: releases the cached pages of the freeable pools (every one
  // when `only` is null, else that pool if it is freeable) and drops the
  // freeable pools that hold no live block. Pools that a graph or MemPool
  // still holds are left alone. Returns how many pools were emptied.
  std::size_t empty_freeable(const PoolId* only = nullptr);

  // The options every pool allocator is made with.
  static AllocatorOptions pool_options();

 private:
  struct Pool {
    std::shared_ptr<CachingAllocator> allocator;
    int use_count = 0;
  };
  Pool& create_or_incref_locked(PoolId id);
  bool routed_locked(PoolId id) const;
  void drop_if_done_locked(std::map<PoolId, Pool>::iterator it);

  Backend& backend_;
  const std::shared_ptr<HostPagePool> host_pages_;
  mutable std::mutex mutex_;
  std::map<PoolId, Pool> pools_;
  std::vector<std::pair<PoolId, StreamFilter>> routes_;
  std::atomic<bool> routing_{false};
};

}  // namespace cotenant
