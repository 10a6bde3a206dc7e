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
#define COTENANT_RESET_PEAK(name) name.reset_peak();
  COTENANT_POOLED_STATS(COTENANT_RESET_PEAK)
  COTENANT_PLAIN_STATS(COTENANT_RESET_PEAK)
#undef COTENANT_RESET_PEAK
}

void AllocatorStats::reset_accumulated() {
#define COTENANT_RESET_ACCUMULATED(name) name.reset_accumulated();
#define COTENANT_RESET_COUNT(name) name = 0;
  COTENANT_POOLED_STATS(COTENANT_RESET_ACCUMULATED)
  COTENANT_PLAIN_STATS(COTENANT_RESET_ACCUMULATED)
  COTENANT_COUNT_STATS(COTENANT_RESET_COUNT)
#undef COTENANT_RESET_ACCUMULATED
#undef COTENANT_RESET_COUNT
}

namespace {

void add_to(Stat& to, const Stat& from) {
  to.current += from.current;
  to.peak += from.peak;
  to.allocated += from.allocated;
  to.freed += from.freed;
}

void add_to(PooledStat& to, const PooledStat& from) {
  add_to(to.all, from.all);
  add_to(to.small_pool, from.small_pool);
  add_to(to.large_pool, from.large_pool);
}

}  // namespace

void AllocatorStats::add(const AllocatorStats& other) {
  const Stat host_pool = host_pool_bytes;
  const std::int64_t refusals = num_host_headroom_refusals;
#define COTENANT_ADD(name) add_to(name, other.name);
#define COTENANT_ADD_INT(name) name += other.name;
  COTENANT_POOLED_STATS(COTENANT_ADD)
  COTENANT_PLAIN_STATS(COTENANT_ADD)
  COTENANT_COUNT_STATS(COTENANT_ADD_INT)
  COTENANT_GAUGE_STATS(COTENANT_ADD_INT)
#undef COTENANT_ADD
#undef COTENANT_ADD_INT
  host_pool_bytes = host_pool;  // the device's one pool, not a sum of its views
  num_host_headroom_refusals = refusals;
}

std::map<std::string, std::int64_t> AllocatorStats::as_map() const {
  std::map<std::string, std::int64_t> out;
#define COTENANT_PUT(name) put(out, #name, name);
#define COTENANT_PUT_INT(name) out[#name] = name;
  COTENANT_POOLED_STATS(COTENANT_PUT)
  COTENANT_PLAIN_STATS(COTENANT_PUT)
  COTENANT_COUNT_STATS(COTENANT_PUT_INT)
  COTENANT_GAUGE_STATS(COTENANT_PUT_INT)
#undef COTENANT_PUT
#undef COTENANT_PUT_INT
  out["memory_cap"] = memory_cap == ~std::uint64_t{0} ? -1 : static_cast<std::int64_t>(memory_cap);
  out["spilled_all"] = spilled_all ? 1 : 0;
  out["spill_mode_remap"] = mode == SpillMode::kRemap ? 1 : 0;
  return out;
}

}  // namespace cotenant
