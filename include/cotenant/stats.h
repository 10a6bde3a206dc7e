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

struct AllocatorStats {
  // Bytes and counts as torch.cuda.memory_stats() defines them. "allocated"
  // is what callers hold (rounded sizes), "requested" what they asked for,
  // "reserved" all mapped memory (device and host), "active" allocated plus
  // freed blocks still waiting on record_stream events, "inactive_split"
  // free pieces of split blocks.
  PooledStat allocation, segment, active, inactive_split;
  PooledStat allocated_bytes, reserved_bytes, active_bytes, inactive_split_bytes, requested_bytes;
  std::int64_t num_alloc_retries = 0;  // allocations that had to release cache first
  std::int64_t num_ooms = 0;           // allocations that failed on device and host
  std::int64_t num_device_alloc = 0;   // pages created on the backend (device or host)
  std::int64_t num_device_free = 0;    // pages released to the backend

  // Residency: mapped bytes by where they live. device + host == reserved.
  Stat device_resident_bytes, host_resident_bytes;
  // Pinned-fallback allocations (kPinnedFallback mode only), part of host_resident_bytes.
  Stat pinned_fallback_bytes;
  std::int64_t spilled_bytes = 0;     // cumulative bytes moved device -> host
  std::int64_t restored_bytes = 0;    // cumulative bytes moved host -> device
  std::int64_t num_migrations = 0;    // cumulative page moves, both directions
  std::int64_t num_spilled_allocations = 0;  // allocations that got host memory at birth
  std::int64_t pending_spill_bytes = 0;    // marked, not yet moved
  std::int64_t pending_restore_bytes = 0;  // marked, not yet moved
  std::uint64_t memory_cap = 0;       // device-resident bound in bytes; kNoCap when unset
  SpillMode mode = SpillMode::kRemap;

  // torch.cuda.reset_peak_memory_stats() and reset_accumulated_memory_stats():
  // peaks come down to current values; cumulative counts go to zero.
  void reset_peaks();
  void reset_accumulated();

  // Flattens into torch's key names ("allocated_bytes.all.current", ...)
  // plus cotenant's ("device_resident_bytes.current", "memory_cap", ...).
  std::map<std::string, std::int64_t> as_map() const;
};

}  // namespace cotenant
