// Allocator statistics, named as torch.cuda.memory_stats() names them where
// the number means the same thing, plus cotenant's residency figures.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>

namespace cotenant {

// One counter the way PyTorch keeps it: the current value, its peak since the
// last reset_peak(), and the cumulative amounts added and removed.
struct Stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;
  std::int64_t freed = 0;

  void increase(std::int64_t amount) {
    current += amount;
    allocated += amount;
    if (current > peak) peak = current;
  }
  void decrease(std::int64_t amount) {
    current -= amount;
    freed += amount;
  }
  void reset_peak() { peak = current; }
  void reset_accumulated() { allocated = freed = 0; }
};

// PyTorch's "all" / "small_pool" / "large_pool" breakdown.
enum class PoolKind : std::uint8_t { kSmall = 0, kLarge = 1 };
struct PooledStat {
  Stat all, small_pool, large_pool;
  Stat& of(PoolKind pool) { return pool == PoolKind::kSmall ? small_pool : large_pool; }
  void increase(PoolKind pool, std::int64_t amount) { all.increase(amount); of(pool).increase(amount); }
  void decrease(PoolKind pool, std::int64_t amount) { all.decrease(amount); of(pool).decrease(amount); }
  void reset_peak() { all.reset_peak(); small_pool.reset_peak(); large_pool.reset_peak(); }
  void reset_accumulated() {
    all.reset_accumulated(); small_pool.reset_accumulated(); large_pool.reset_accumulated();
  }
};

// How over-cap memory is held.
//  kRemap:  host pages are mapped into the same address ranges (host VMM);
//           live pages move both ways and keep their addresses.
//  kPinnedFallback: over-cap allocations come from mapped pinned host memory
//           (AntMan's scheme); they return to the device only when freed and
//           allocated again.
enum class SpillMode : std::uint8_t { kRemap, kPinnedFallback };
const char* spill_mode_name(SpillMode mode);

// The statistics' fields, each listed once. X(name) for every field of a
// kind; the struct, resets and as_map() are generated from these lists.
//   pooled: PooledStat (torch's "<name>.{all,small_pool,large_pool}.{current,peak,allocated,freed}")
//   plain:  Stat ("<name>.{current,peak,allocated,freed}")
//   count:  std::int64_t, cumulative (reset_accumulated() zeroes it)
//   gauge:  std::int64_t, a current value (no reset)
#define COTENANT_POOLED_STATS(X) \
  X(allocation) X(segment) X(active) X(inactive_split) X(allocated_bytes) X(reserved_bytes) X(active_bytes) \
  X(inactive_split_bytes) X(requested_bytes)
#define COTENANT_PLAIN_STATS(X) \
  X(device_resident_bytes) X(host_resident_bytes) X(pinned_fallback_bytes) X(host_pool_bytes)
#define COTENANT_COUNT_STATS(X) \
  X(num_alloc_retries) X(num_ooms) X(num_device_alloc) X(num_device_free) X(spilled_bytes) X(restored_bytes) \
  X(num_migrations) X(num_spilled_allocations) X(num_host_headroom_refusals)
#define COTENANT_GAUGE_STATS(X) X(pending_spill_bytes) X(pending_restore_bytes) X(host_live_bytes)

struct AllocatorStats {
  // Bytes and counts as torch.cuda.memory_stats() defines them. "allocated"
  // is what callers hold (rounded sizes), "requested" what they asked for,
  // "reserved" all mapped memory (device and host), "active" allocated plus
  // freed blocks still waiting on record_stream events, "inactive_split"
  // free pieces of split blocks.
  //   num_alloc_retries        allocations that had to release cache first
  //   num_ooms                 allocations that failed on device and host
  //   num_device_alloc / free  pages created on / released to the backend
  // Residency: mapped bytes by where they live (device + host == reserved);
  // pinned_fallback_bytes: kPinnedFallback allocations, part of host_resident_bytes.
  // host_pool_bytes: host pages kept for reuse after their last use (pinned,
  // mapped nowhere; not part of reserved or host_resident_bytes), in the
  // host pool the allocator draws from (shared by a device's allocators).
  //   spilled_bytes / restored_bytes  cumulative bytes moved device -> host / back
  //   num_migrations                  cumulative page moves, both directions
  //   num_spilled_allocations         allocations that got host memory at birth
  //   num_host_headroom_refusals      host pages not pinned: the host was at its
  //                                   headroom (the device's host pool's count)
  //   pending_spill/restore_bytes     marked, not yet moved
  //   host_live_bytes                 host pages holding a live block and pinned
  //                                   fallback allocations in use (part of
  //                                   host_resident_bytes: what kernels reach
  //                                   across the bus)
#define COTENANT_DECLARE_POOLED(name) PooledStat name;
#define COTENANT_DECLARE_PLAIN(name) Stat name;
#define COTENANT_DECLARE_INT(name) std::int64_t name = 0;
  COTENANT_POOLED_STATS(COTENANT_DECLARE_POOLED)
  COTENANT_PLAIN_STATS(COTENANT_DECLARE_PLAIN)
  COTENANT_COUNT_STATS(COTENANT_DECLARE_INT)
  COTENANT_GAUGE_STATS(COTENANT_DECLARE_INT)
#undef COTENANT_DECLARE_POOLED
#undef COTENANT_DECLARE_PLAIN
#undef COTENANT_DECLARE_INT
  std::uint64_t memory_cap = ~std::uint64_t{0};  // device-resident bound (Cap::to_word(); kNoCap when unset)
  bool spilled_all = false;                      // spill_all() holds until restore_all()
  SpillMode mode = SpillMode::kRemap;

  // torch.cuda.reset_peak_memory_stats() and reset_accumulated_memory_stats():
  // peaks come down to current values; cumulative counts go to zero.
  void reset_peaks();
  void reset_accumulated();
  // Adds another allocator's figures on the same device, for one job's
  // whole footprint (its main allocator, graph pools, regions): counts and
  // current values add up; peaks add up too (an upper bound of the peak of
  // the sum). The device's host pool is one, shared by its allocators:
  // host_pool_bytes and num_host_headroom_refusals stay this one's. The cap
  // and the modes stay this one's.
  void add(const AllocatorStats& other);

  // Flattens into torch's key names ("allocated_bytes.all.current", ...)
  // plus cotenant's ("device_resident_bytes.current", "memory_cap" (-1 for
  // none), "spilled_all", "spill_mode_remap").
  std::map<std::string, std::int64_t> as_map() const;
};

}  // namespace cotenant
