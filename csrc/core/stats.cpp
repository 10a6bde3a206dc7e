#include "cotenant/stats.h"

#include "cotenant/backend.h"

namespace cotenant {

const char* residency_name(Residency where) {
  return where == Residency::kDevice ? "device" : "host";
}

const char* spill_mode_name(SpillMode mode) {
  return mode == SpillMode::kRemap ? "remap" : "pinned_fallback";
}

namespace {

void put(std::map<std::string, std::int64_t>& out, const std::string& name, const Stat& stat) {
  out[name + ".current"] = stat.current;
  out[name + ".peak"] = stat.peak;
  out[name + ".allocated"] = stat.allocated;
  out[name + ".freed"] = stat.freed;
}

void put(std::map<std::string, std::int64_t>& out, const std::string& name, const PooledStat& stat) {
  put(out, name + ".all", stat.all);
  put(out, name + ".small_pool", stat.small_pool);
  put(out, name + ".large_pool", stat.large_pool);
}

}  // namespace

void AllocatorStats::reset_peaks() {
  for (PooledStat* stat : {&allocation, &segment, &active, &inactive_split, &allocated_bytes, &reserved_bytes,
                           &active_bytes, &inactive_split_bytes, &requested_bytes}) {
    stat->reset_peak();
  }
  for (Stat* stat : {&device_resident_bytes, &host_resident_bytes, &pinned_fallback_bytes}) stat->reset_peak();
}

void AllocatorStats::reset_accumulated() {
  for (PooledStat* stat : {&allocation, &segment, &active, &inactive_split, &allocated_bytes, &reserved_bytes,
                           &active_bytes, &inactive_split_bytes, &requested_bytes}) {
    stat->reset_accumulated();
  }
  for (Stat* stat : {&device_resident_bytes, &host_resident_bytes, &pinned_fallback_bytes}) stat->reset_accumulated();
  num_alloc_retries = num_ooms = num_device_alloc = num_device_free = 0;
  spilled_bytes = restored_bytes = num_migrations = num_spilled_allocations = 0;
}

std::map<std::string, std::int64_t> AllocatorStats::as_map() const {
  std::map<std::string, std::int64_t> out;
  put(out, "allocation", allocation);
  put(out, "segment", segment);
  put(out, "active", active);
  put(out, "inactive_split", inactive_split);
  put(out, "allocated_bytes", allocated_bytes);
  put(out, "reserved_bytes", reserved_bytes);
  put(out, "active_bytes", active_bytes);
  put(out, "inactive_split_bytes", inactive_split_bytes);
  put(out, "requested_bytes", requested_bytes);
  out["num_alloc_retries"] = num_alloc_retries;
  out["num_ooms"] = num_ooms;
  out["num_device_alloc"] = num_device_alloc;
  out["num_device_free"] = num_device_free;
  put(out, "device_resident_bytes", device_resident_bytes);
  put(out, "host_resident_bytes", host_resident_bytes);
  put(out, "pinned_fallback_bytes", pinned_fallback_bytes);
  out["spilled_bytes"] = spilled_bytes;
  out["restored_bytes"] = restored_bytes;
  out["num_migrations"] = num_migrations;
  out["num_spilled_allocations"] = num_spilled_allocations;
  out["pending_spill_bytes"] = pending_spill_bytes;
  out["pending_restore_bytes"] = pending_restore_bytes;
  out["memory_cap"] = memory_cap == ~std::uint64_t{0} ? -1 : static_cast<std::int64_t>(memory_cap);
  out["spill_mode_remap"] = mode == SpillMode::kRemap ? 1 : 0;
  return out;
}

}  // namespace cotenant
