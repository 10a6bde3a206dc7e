#include "cotenant/replay.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <unordered_map>
#include <unordered_set>


namespace cotenant {

ReplayError::ReplayError(std::size_t op_index, const std::string& reason)
    : Error(fmt::format("trace op {}: {}", op_index, reason)), op_index_(op_index), reason_(reason) {}

const char* replay_op_kind_name(ReplayOpKind kind) {
  switch (kind) {
    case ReplayOpKind::kAlloc: return "alloc";
    case ReplayOpKind::kFree: return "free";
    case ReplayOpKind::kRecordStream: return "record_stream";
    case ReplayOpKind::kCap: return "cap";
    case ReplayOpKind::kEmptyCache: return "empty_cache";
    case ReplayOpKind::kIteration: return "iteration";
  }
  return "unknown";
}

namespace {

using Clock = std::chrono::steady_clock;

std::uint64_t elapsed_ns(Clock::time_point start, Clock::time_point end) {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(end - start).count());
}

// This thread's CPU time: unlike the wall clock, it does not count the time
// the thread waits while another process has its core.
std::uint64_t thread_cpu_ns() {
  timespec now{};
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now) != 0) {
    throw Error(fmt::format("clock_gettime(CLOCK_THREAD_CPUTIME_ID) failed: {}", std::strerror(errno)));
  }
  return static_cast<std::uint64_t>(now.tv_sec) * 1'000'000'000u + static_cast<std::uint64_t>(now.tv_nsec);
}

// The refusals replay() and time_ops() share, so that both refuse a trace
// at the same op with the same words.
ReplayError live_id_refused(std::size_t index, std::uint64_t id) {
  return ReplayError(index, fmt::format(
      "alloc of id {} while an allocation with that id is live; the trace must free it first", id));
}
ReplayError zero_cap_refused(std::size_t index) {
  return ReplayError(index, "a cap of 0 bytes; give a positive size, or no cap to remove it");
}
ReplayError unknown_kind_refused(std::size_t index, ReplayOpKind kind) {
  return ReplayError(index, fmt::format("unknown operation kind {}", static_cast<int>(kind)));
}

// A fresh simulated device and an allocator on it, as `config` sets them.
struct SimulatedRun {
  explicit SimulatedRun(const ReplayConfig& config) : backend(config.device), allocator(backend, config.allocator) {
    if (config.initial_cap == 0) throw Error("the initial cap is 0 bytes; give a positive size, or no cap");
    if (config.initial_cap != kNoCap) allocator.set_memory_cap(config.initial_cap);
  }
  SimulatedBackend backend;
  CachingAllocator allocator;
};

// Ids the trace has allocated and not yet freed, and ids whose allocation
// failed (their free is part of the trace and is skipped, not an error).
struct TraceState {
  std::unordered_map<std::uint64_t, DevicePtr> live;  // id -> address
  std::unordered_set<std::uint64_t> failed;
};

// Fills the result's at_peak_* figures from the allocator's blocks now:
// called when an allocation of `request` bytes has just raised reserved
// bytes to `reserved`.
void record_reserved_peak(const CachingAllocator& allocator, std::int64_t reserved, std::uint64_t request,
                          ReplayResult& result) {
  const std::size_t page = allocator.backend().granularity();
  std::int64_t live = 0, live_pages = 0, largest_hole = 0;
  for (const SegmentInfo& segment : allocator.snapshot()) {
    std::size_t counted_up_to = 0;  // pages [0, counted_up_to) of the segment are counted
    std::int64_t hole = 0;          // the free bytes since the last live block
    for (const BlockInfo& block : segment.blocks) {
      const bool is_live = block.allocated || block.waiting_on_events;
      if (!is_live) {
        hole = static_cast<std::int64_t>(block.size);
        continue;
      }
      largest_hole = std::max(largest_hole, hole);
      hole = 0;
      live += static_cast<std::int64_t>(block.size);
      if (segment.pinned_fallback) {
        live_pages += static_cast<std::int64_t>(segment.size);  // one block, whole pages
        continue;
      }
      const std::size_t first = std::max<std::size_t>((block.address - segment.address) / page, counted_up_to);
      const std::size_t end = (block.address + block.size - segment.address + page - 1) / page;
      if (end > first) live_pages += static_cast<std::int64_t>((end - first) * page);
      counted_up_to = std::max(counted_up_to, end);
    }
  }
  result.at_peak_live_bytes = live;
  result.at_peak_partial_page_free_bytes = live_pages - live;
  result.at_peak_free_page_bytes = reserved - live_pages;
  result.at_peak_request_bytes = static_cast<std::int64_t>(request);
  result.at_peak_largest_hole_bytes = largest_hole;
}

}  // namespace

// The mean of the last half of `values` (at least one), or -1 for fewer than 2.
double warm_mean(const std::vector<std::int64_t>& values) {
  if (values.size() < 2) return -1.0;
  const std::size_t warm = std::max<std::size_t>(1, values.size() / 2);
  double sum = 0;
  for (std::size_t i = values.size() - warm; i < values.size(); ++i) sum += static_cast<double>(values[i]);
  return sum / static_cast<double>(warm);
}

ReplayResult replay(const std::vector<ReplayOp>& ops, CachingAllocator& allocator) {
  ReplayResult result;
  TraceState trace;
  trace.live.reserve(1024);
  // Per-iteration counters: maps at the last mark, host bytes touched since it.
  std::int64_t maps_at_mark = allocator.stats().num_device_alloc;
  std::int64_t host_touched = 0;
  // Live host bytes, and live bytes over the cap, summed after each op
  // since the mark, and the ops; the live bytes (rounded sizes).
  double host_live_sum = 0, host_live_floor_sum = 0;
  std::int64_t ops_since_mark = 0;
  std::uint64_t live_bytes = 0;
  auto moved = [](const AllocatorStats& stats) { return stats.spilled_bytes + stats.restored_bytes; };
  std::int64_t moved_at_mark = moved(allocator.stats());
  std::int64_t safe_points_at_mark = 0;
  auto safe_point = [&allocator, &result] {
    if (allocator.apply_pending_migrations() > 0) ++result.num_safe_points;
  };
  std::int64_t reserved_peak = allocator.stats().reserved_bytes.all.current;

  for (std::size_t index = 0; index < ops.size(); ++index) {
    const ReplayOp& op = ops[index];
    // An allocation over the cap (in a colder page's stead) flags pages to
    // move; a job moves them at its next safe point, the next op's entry.
    // The trace's next op stands for that.
    if (allocator.has_pending_migrations()) safe_point();
    switch (op.kind) {
      case ReplayOpKind::kAlloc: {
        if (trace.live.count(op.id) != 0) {
          throw live_id_refused(index, op.id);
        }
        trace.failed.erase(op.id);
        const auto start = Clock::now();
        try {
          const DevicePtr address = allocator.allocate(op.bytes, op.stream);
          const auto end = Clock::now();
          result.alloc_ns_total += elapsed_ns(start, end);
          ++result.num_allocs;
          trace.live.emplace(op.id, address);
          if (address != 0) live_bytes += allocator.allocation_size(address);
          const std::int64_t reserved = allocator.stats().reserved_bytes.all.current;
          if (reserved > reserved_peak) {
            reserved_peak = reserved;
            record_reserved_peak(allocator, reserved, op.bytes, result);
          }
          if (address != 0) host_touched += static_cast<std::int64_t>(allocator.host_bytes_of(address));
        } catch (const OutOfMemoryError&) {
          ++result.num_ooms;
          trace.failed.insert(op.id);
        }
        break;
      }
      case ReplayOpKind::kFree: {
        auto it = trace.live.find(op.id);
        if (it == trace.live.end()) {
          if (trace.failed.erase(op.id) != 0) break;  // its allocation ran out of memory
          throw ReplayError(index, fmt::format(
              "free of id {}, which is not live (never allocated, or freed already: a double free)", op.id));
        }
        const DevicePtr address = it->second;
        trace.live.erase(it);
        // A 0-byte allocation has address 0 and nothing to give back.
        if (address != 0) {
          host_touched += static_cast<std::int64_t>(allocator.host_bytes_of(address));
          live_bytes -= allocator.allocation_size(address);
          const auto start = Clock::now();
          allocator.free(address);
          const auto end = Clock::now();
          result.free_ns_total += elapsed_ns(start, end);
        }
        ++result.num_frees;
        break;
      }
      case ReplayOpKind::kRecordStream: {
        auto it = trace.live.find(op.id);
        if (it == trace.live.end()) {
          if (trace.failed.count(op.id) != 0) break;
          throw ReplayError(index, fmt::format("record_stream on id {}, which is not live", op.id));
        }
        if (it->second != 0) allocator.record_stream(it->second, op.stream);
        break;
      }
      case ReplayOpKind::kCap: {
        if (op.bytes == 0) {
          throw zero_cap_refused(index);
        }
        allocator.set_memory_cap(op.bytes);
        // The cap op is the trace's safe point: pages move here.
        safe_point();
        break;
      }
      case ReplayOpKind::kEmptyCache:
        allocator.empty_cache();
        break;
      case ReplayOpKind::kIteration: {
        // The end of a step is a safe point: marked pages move here.
        safe_point();
        allocator.mark_iteration();
        const AllocatorStats at_mark = allocator.stats();
        result.maps_per_iteration.push_back(at_mark.num_device_alloc - maps_at_mark);
        result.host_touched_bytes_per_iteration.push_back(host_touched);
        const auto ops = static_cast<double>(std::max<std::int64_t>(1, ops_since_mark));
        result.host_live_bytes_per_iteration.push_back(static_cast<std::int64_t>(host_live_sum / ops));
        result.host_live_floor_bytes_per_iteration.push_back(static_cast<std::int64_t>(host_live_floor_sum / ops));
        host_live_sum = host_live_floor_sum = 0;
        ops_since_mark = 0;
        result.moved_bytes_per_iteration.push_back(moved(at_mark) - moved_at_mark);
        result.safe_points_per_iteration.push_back(result.num_safe_points - safe_points_at_mark);
        safe_points_at_mark = result.num_safe_points;
        maps_at_mark = at_mark.num_device_alloc;
        moved_at_mark = moved(at_mark);
        host_touched = 0;
        break;
      }
      default:
        throw unknown_kind_refused(index, op.kind);
    }
    ++result.num_ops;
    if (op.kind != ReplayOpKind::kIteration) {
      host_live_sum += static_cast<double>(allocator.host_live_bytes());
      const std::uint64_t cap = allocator.memory_cap();
      if (cap != kNoCap && live_bytes > cap) host_live_floor_sum += static_cast<double>(live_bytes - cap);
      ++ops_since_mark;
    }
  }

  const AllocatorStats stats = allocator.stats();
  result.peak_allocated_bytes = stats.allocated_bytes.all.peak;
  result.peak_requested_bytes = stats.requested_bytes.all.peak;
  result.peak_reserved_bytes = stats.reserved_bytes.all.peak;
  result.peak_device_resident_bytes = stats.device_resident_bytes.peak;
  result.fragmentation = result.peak_allocated_bytes > 0
      ? static_cast<double>(result.peak_reserved_bytes) / static_cast<double>(result.peak_allocated_bytes)
      : 0.0;
  result.spilled_bytes = stats.spilled_bytes;
  result.restored_bytes = stats.restored_bytes;
  result.num_migrations = stats.num_migrations;
  result.num_spilled_allocations = stats.num_spilled_allocations;
  result.ns_per_alloc = result.num_allocs > 0
      ? static_cast<double>(result.alloc_ns_total) / static_cast<double>(result.num_allocs) : 0.0;
  result.ns_per_free = result.num_frees > 0
      ? static_cast<double>(result.free_ns_total) / static_cast<double>(result.num_frees) : 0.0;
  result.num_page_maps = stats.num_device_alloc;
  result.num_page_unmaps = stats.num_device_free;
  const auto page_bytes = static_cast<double>(allocator.backend().granularity());
  result.maps_per_peak_page = result.peak_reserved_bytes > 0
      ? static_cast<double>(result.num_page_maps) / (static_cast<double>(result.peak_reserved_bytes) / page_bytes)
      : 0.0;
  if (result.peak_allocated_bytes > 0) {
    const auto page = static_cast<std::int64_t>(allocator.backend().granularity());
    const std::int64_t floor_bytes = (result.peak_allocated_bytes + page - 1) / page * page;
    result.fragmentation_floor =
        static_cast<double>(floor_bytes) / static_cast<double>(result.peak_allocated_bytes);
  }
  result.steady_maps_per_iteration = warm_mean(result.maps_per_iteration);
  result.steady_host_touched_bytes_per_iteration = warm_mean(result.host_touched_bytes_per_iteration);
  result.steady_host_live_bytes = warm_mean(result.host_live_bytes_per_iteration);
  result.steady_host_live_floor_bytes = warm_mean(result.host_live_floor_bytes_per_iteration);
  result.steady_moved_bytes_per_iteration = warm_mean(result.moved_bytes_per_iteration);
  result.steady_safe_points_per_iteration = warm_mean(result.safe_points_per_iteration);
  result.final_stats = stats;
  return result;
}

ReplayResult replay(const std::vector<ReplayOp>& ops, const ReplayConfig& config) {
  SimulatedRun run(config);
  return replay(ops, run.allocator);
}

OpTiming time_ops(const std::vector<ReplayOp>& ops, std::size_t first_timed, const ReplayConfig& config) {
  if (first_timed > ops.size()) {
    throw Error(fmt::format("time_ops: the warm-up of {} ops is longer than the {} ops given", first_timed,
                            ops.size()));
  }
  SimulatedRun simulated(config);
  CachingAllocator& allocator = simulated.allocator;
  // Each op as the timed loop runs it: an allocation's id resolved to a
  // slot of `addresses`, a slot freed for the next allocation to reuse.
  struct Step {
    ReplayOpKind kind;
    std::size_t slot;
    std::uint64_t bytes;
    StreamId stream;
  };
  std::vector<Step> steps;
  steps.reserve(ops.size());
  std::unordered_map<std::uint64_t, std::size_t> live;  // id -> slot
  std::vector<std::size_t> spare_slots;
  std::size_t slots = 0;
  OpTiming timing;
  for (std::size_t index = 0; index < ops.size(); ++index) {
    const ReplayOp& op = ops[index];
    const bool timed = index >= first_timed;
    switch (op.kind) {
      case ReplayOpKind::kAlloc: {
        if (live.count(op.id) != 0) {
          throw live_id_refused(index, op.id);
        }
        std::size_t slot = slots;
        if (spare_slots.empty()) {
          ++slots;
        } else {
          slot = spare_slots.back();
          spare_slots.pop_back();
        }
        live.emplace(op.id, slot);
        steps.push_back({op.kind, slot, op.bytes, op.stream});
        if (timed) ++timing.allocs;
        break;
      }
      case ReplayOpKind::kFree:
      case ReplayOpKind::kRecordStream: {
        auto it = live.find(op.id);
        if (it == live.end()) {
          throw ReplayError(index, fmt::format("{} of id {}, which is not live (never allocated, or freed already)",
                                               replay_op_kind_name(op.kind), op.id));
        }
        steps.push_back({op.kind, it->second, 0, op.stream});
        if (op.kind == ReplayOpKind::kFree) {
          spare_slots.push_back(it->second);
          live.erase(it);
          if (timed) ++timing.frees;
        }
        break;
      }
      case ReplayOpKind::kEmptyCache:
        steps.push_back({op.kind, 0, 0, 0});
        break;
      case ReplayOpKind::kIteration:
        steps.push_back({op.kind, 0, 0, 0});
        if (timed) ++timing.marks;
        break;
      case ReplayOpKind::kCap:
        if (op.bytes == 0) {
          throw zero_cap_refused(index);
        }
        steps.push_back({op.kind, 0, op.bytes, 0});
        break;
      default:
        throw unknown_kind_refused(index, op.kind);
    }
  }

  std::vector<DevicePtr> addresses(slots, 0);
  auto run = [&](std::size_t begin, std::size_t end) {
    for (std::size_t index = begin; index < end; ++index) {
      const Step& step = steps[index];
      // As replay() and a job's next op entry do: pages left waiting to
      // move move here (one atomic load when none wait).
      if (allocator.has_pending_migrations()) allocator.apply_pending_migrations();
      switch (step.kind) {
        case ReplayOpKind::kAlloc:
          addresses[step.slot] = allocator.allocate(step.bytes, step.stream);
          break;
        case ReplayOpKind::kFree:
          if (addresses[step.slot] != 0) allocator.free(addresses[step.slot]);  // a 0-byte allocation is 0
          break;
        case ReplayOpKind::kRecordStream:
          if (addresses[step.slot] != 0) allocator.record_stream(addresses[step.slot], step.stream);
          break;
        case ReplayOpKind::kEmptyCache:
          allocator.empty_cache();
          break;
        case ReplayOpKind::kCap:
          allocator.set_memory_cap(step.bytes);
          if (allocator.has_pending_migrations()) allocator.apply_pending_migrations();  // a safe point
          break;
        default:
          allocator.mark_iteration();
          break;
      }
    }
  };
  run(0, first_timed);
  const std::uint64_t cpu_start = thread_cpu_ns();
  const auto start = Clock::now();
  run(first_timed, steps.size());
  const auto end = Clock::now();
  timing.cpu_ns = thread_cpu_ns() - cpu_start;
  timing.ns = elapsed_ns(start, end);
  const AllocatorStats stats = allocator.stats();
  timing.num_page_maps = stats.num_device_alloc;
  timing.peak_reserved_bytes = stats.reserved_bytes.all.peak;
  return timing;
}

}  // namespace cotenant
