#include <catch2/catch.hpp>

#include <vector>

#include "cotenant/caching_allocator.h"
#include "cotenant/replay.h"
#include "cotenant/simulated_backend.h"

using cotenant::CachingAllocator;
using cotenant::ReplayConfig;
using cotenant::ReplayError;
using cotenant::ReplayOp;
using cotenant::SimulatedBackend;
using cotenant::SimulatedDeviceConfig;

namespace {
constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;

ReplayConfig small_device(std::uint64_t capacity = 64 * kMiB) {
  ReplayConfig config;
  config.device.device_capacity = capacity;
  config.device.granularity = 2 * kMiB;
  return config;
}
}  // namespace

TEST_CASE("replay_reports_peaks_and_counts_of_a_simple_trace", "[replay]") {
  const std::vector<ReplayOp> ops = {
      ReplayOp::alloc(1, 4 * kMiB), ReplayOp::alloc(2, 4 * kMiB), ReplayOp::free(1),
      ReplayOp::alloc(3, 2 * kMiB), ReplayOp::free(2),            ReplayOp::free(3),
  };
  const auto result = cotenant::replay(ops, small_device());
  CHECK(result.num_ops == 6);
  CHECK(result.num_allocs == 3);
  CHECK(result.num_frees == 3);
  CHECK(result.num_ooms == 0);
  CHECK(result.peak_allocated_bytes == static_cast<std::int64_t>(8 * kMiB));
  CHECK(result.peak_reserved_bytes >= result.peak_allocated_bytes);
  CHECK(result.fragmentation == Approx(static_cast<double>(result.peak_reserved_bytes) /
                                       static_cast<double>(result.peak_allocated_bytes)));
  CHECK(result.final_stats.allocated_bytes.all.current == 0);
  CHECK(result.ns_per_alloc > 0.0);
  CHECK(result.ns_per_free > 0.0);
}

TEST_CASE("replay_splits_peak_reserved_into_live_bytes_slack_and_free_pages", "[replay]") {
  // 3 MiB + 1 MiB fill pages 0-1; the 3 MiB block goes, and 3.5 MiB fits no
  // hole: pages 2-3 are mapped while page 0 stays mapped and free.
  const std::vector<ReplayOp> ops = {
      ReplayOp::alloc(1, 3 * kMiB), ReplayOp::alloc(2, kMiB), ReplayOp::free(1),
      ReplayOp::alloc(3, 7 * kMiB / 2), ReplayOp::free(2), ReplayOp::free(3),
  };
  const auto result = cotenant::replay(ops, small_device());
  CHECK(result.peak_reserved_bytes == std::int64_t(8 * kMiB));
  CHECK(result.at_peak_live_bytes == std::int64_t(9 * kMiB / 2));
  CHECK(result.at_peak_partial_page_free_bytes == std::int64_t(3 * kMiB / 2));
  CHECK(result.at_peak_free_page_bytes == std::int64_t(2 * kMiB));
  CHECK(result.at_peak_request_bytes == std::int64_t(7 * kMiB / 2));
  CHECK(result.at_peak_largest_hole_bytes == std::int64_t(3 * kMiB));
  CHECK(result.fragmentation_floor == Approx(6.0 / 4.5));
}

TEST_CASE("replay_of_an_empty_trace_reports_zero_fragmentation", "[replay]") {
  const auto result = cotenant::replay({}, small_device());
  CHECK(result.num_ops == 0);
  CHECK(result.fragmentation == 0.0);
  CHECK(result.ns_per_alloc == 0.0);
}

TEST_CASE("replay_free_of_unknown_id_names_the_op_and_keeps_live_allocations", "[replay]") {
  SimulatedBackend backend(small_device().device);
  CachingAllocator allocator(backend);
  const std::vector<ReplayOp> ops = {ReplayOp::alloc(1, 3 * kMiB), ReplayOp::free(7)};
  try {
    cotenant::replay(ops, allocator);
    FAIL("a free of an id that was never allocated must be refused");
  } catch (const ReplayError& error) {
    CHECK(error.op_index() == 1);
    CHECK_THAT(error.what(), Catch::Contains("trace op 1") && Catch::Contains("id 7"));
  }
  // The allocation made before the bad op is still live.
  CHECK(allocator.stats().allocated_bytes.all.current >= static_cast<std::int64_t>(3 * kMiB));
}

TEST_CASE("replay_double_free_is_refused_at_the_second_free", "[replay]") {
  const std::vector<ReplayOp> ops = {ReplayOp::alloc(1, kMiB), ReplayOp::free(1), ReplayOp::free(1)};
  try {
    cotenant::replay(ops, small_device());
    FAIL("a double free must be refused");
  } catch (const ReplayError& error) {
    CHECK(error.op_index() == 2);
    CHECK_THAT(error.reason(), Catch::Contains("double free"));
  }
}

TEST_CASE("replay_alloc_of_a_live_id_is_refused_and_the_first_allocation_survives", "[replay]") {
  SimulatedBackend backend(small_device().device);
  CachingAllocator allocator(backend);
  const std::vector<ReplayOp> ops = {ReplayOp::alloc(5, kMiB), ReplayOp::alloc(5, 2 * kMiB)};
  REQUIRE_THROWS_AS(cotenant::replay(ops, allocator), ReplayError);
  const auto stats = allocator.stats();
  CHECK(stats.allocation.all.current == 1);
  CHECK(stats.allocated_bytes.all.current == static_cast<std::int64_t>(kMiB));
}

TEST_CASE("replay_refuses_a_zero_cap_op", "[replay]") {
  const std::vector<ReplayOp> ops = {ReplayOp::alloc(1, kMiB), ReplayOp::cap(0)};
  REQUIRE_THROWS_AS(cotenant::replay(ops, small_device()), ReplayError);
}

TEST_CASE("replay_cap_below_live_bytes_spills_at_the_cap_op_and_restores_when_raised", "[replay]") {
  std::vector<ReplayOp> ops;
  for (std::uint64_t id = 1; id <= 8; ++id) ops.push_back(ReplayOp::alloc(id, 2 * kMiB));
  ops.push_back(ReplayOp::cap(8 * kMiB));    // 16 MiB live: half of it must leave the device
  ops.push_back(ReplayOp::cap(cotenant::kNoCap));
  const auto result = cotenant::replay(ops, small_device());
  CHECK(result.spilled_bytes >= static_cast<std::int64_t>(8 * kMiB));
  CHECK(result.restored_bytes >= static_cast<std::int64_t>(8 * kMiB));
  CHECK(result.num_migrations >= 8);
  CHECK(result.final_stats.host_resident_bytes.current == 0);
}

TEST_CASE("replay_under_a_cap_keeps_the_newest_allocations_on_the_device", "[replay]") {
  auto config = small_device();
  config.initial_cap = 4 * kMiB;
  std::vector<ReplayOp> ops;
  for (std::uint64_t id = 1; id <= 4; ++id) ops.push_back(ReplayOp::alloc(id, 2 * kMiB));
  ops.push_back(ReplayOp::iteration());
  for (std::uint64_t id = 3; id <= 4; ++id) ops.push_back(ReplayOp::free(id));
  for (std::uint64_t id = 3; id <= 4; ++id) ops.push_back(ReplayOp::alloc(id, 2 * kMiB));
  ops.push_back(ReplayOp::iteration());
  const auto result = cotenant::replay(ops, config);
  CHECK(result.num_ooms == 0);
  CHECK(result.num_spilled_allocations == 0);
  // Over the cap by at most the page placed since the last safe point.
  CHECK(result.peak_device_resident_bytes <= static_cast<std::int64_t>(6 * kMiB));
  CHECK(result.final_stats.device_resident_bytes.current == static_cast<std::int64_t>(4 * kMiB));
  CHECK(result.final_stats.host_resident_bytes.current == static_cast<std::int64_t>(4 * kMiB));
  CHECK(result.spilled_bytes == static_cast<std::int64_t>(4 * kMiB));  // ids 1 and 2, once each
  // Ids 3 and 4 live on the device: frees and allocations touch no host page.
  REQUIRE(result.host_touched_bytes_per_iteration.size() == 2);
  CHECK(result.host_touched_bytes_per_iteration[1] == 0);
}

namespace {
// Ten training steps: weights live throughout; activations grow through
// the forward pass, shrink through the backward pass.
std::vector<ReplayOp> repeated_training_loop() {
  std::vector<ReplayOp> ops;
  std::uint64_t next = 1000;
  const std::uint64_t sizes[] = {3 * kMiB, 700 * 1024, 12 * kMiB, 4096, 25 * kMiB, 9 * kMiB, 1536};
  for (std::uint64_t id = 1; id <= 8; ++id) ops.push_back(ReplayOp::alloc(id, id * 1'000'000));
  for (int step = 0; step < 10; ++step) {
    std::vector<std::uint64_t> live;
    for (std::uint64_t size : sizes) {
      ops.push_back(ReplayOp::alloc(next, size + static_cast<std::uint64_t>(step % 2) * 512));
      live.push_back(next++);
    }
    for (auto it = live.rbegin(); it != live.rend(); ++it) {
      ops.push_back(ReplayOp::free(*it));
      ops.push_back(ReplayOp::alloc(next, 64 * 1024));  // a gradient
      ops.push_back(ReplayOp::free(next++));
    }
    ops.push_back(ReplayOp::iteration());
  }
  return ops;
}
}  // namespace

TEST_CASE("replay_pins_zero_page_maps_per_iteration_once_a_repeated_loop_is_warm", "[replay]") {
  const auto result = cotenant::replay(repeated_training_loop(), small_device(1024 * kMiB));
  REQUIRE(result.maps_per_iteration.size() == 10);
  CHECK(result.maps_per_iteration.front() > 0);
  for (std::size_t i = 1; i < result.maps_per_iteration.size(); ++i) CHECK(result.maps_per_iteration[i] == 0);
  CHECK(result.steady_maps_per_iteration == 0.0);
  CHECK(result.num_page_unmaps == 0);
  CHECK(result.maps_per_peak_page == Approx(1.0));
  CHECK(result.fragmentation <= 1.05);
}

TEST_CASE("replay_counts_an_oom_and_skips_the_free_of_the_failed_allocation", "[replay]") {
  auto config = small_device(8 * kMiB);
  config.device.host_capacity = 0;           // nowhere to spill
  const std::vector<ReplayOp> ops = {ReplayOp::alloc(1, 64 * kMiB), ReplayOp::free(1),
                                     ReplayOp::alloc(2, kMiB), ReplayOp::free(2)};
  const auto result = cotenant::replay(ops, config);
  CHECK(result.num_ooms == 1);
  CHECK(result.num_allocs == 1);
  CHECK(result.num_frees == 1);
}

TEST_CASE("replay_record_stream_and_empty_cache_ops_run_through_the_allocator", "[replay]") {
  const std::vector<ReplayOp> ops = {ReplayOp::alloc(1, 4 * kMiB, 0), ReplayOp::record_stream(1, 9),
                                     ReplayOp::free(1), ReplayOp::empty_cache()};
  const auto result = cotenant::replay(ops, small_device());
  CHECK(result.final_stats.reserved_bytes.all.current == 0);
  CHECK(result.num_frees == 1);
}

TEST_CASE("replay_zero_byte_allocations_are_counted_and_freed", "[replay]") {
  const std::vector<ReplayOp> ops = {ReplayOp::alloc(1, 0), ReplayOp::free(1)};
  const auto result = cotenant::replay(ops, small_device());
  CHECK(result.num_allocs == 1);
  CHECK(result.num_frees == 1);
  CHECK(result.peak_allocated_bytes == 0);
}

TEST_CASE("time_ops_places_as_replay_does_and_counts_only_the_timed_ops", "[replay]") {
  const auto ops = repeated_training_loop();
  const auto replayed = cotenant::replay(ops, small_device(1024 * kMiB));
  std::size_t first_step_end = 0;  // the ops up to the first mark are the warm-up
  while (ops[first_step_end].kind != cotenant::ReplayOpKind::kIteration) ++first_step_end;
  ++first_step_end;
  const auto timed = cotenant::time_ops(ops, first_step_end, small_device(1024 * kMiB));
  CHECK(timed.num_page_maps == replayed.num_page_maps);
  CHECK(timed.peak_reserved_bytes == replayed.peak_reserved_bytes);
  std::uint64_t allocs = 0, frees = 0;
  for (std::size_t i = first_step_end; i < ops.size(); ++i) {
    allocs += ops[i].kind == cotenant::ReplayOpKind::kAlloc;
    frees += ops[i].kind == cotenant::ReplayOpKind::kFree;
  }
  CHECK(timed.allocs == allocs);
  CHECK(timed.frees == frees);
  CHECK(timed.marks == 9);
  CHECK(timed.ns > 0);
  const auto whole = cotenant::time_ops(ops, 0, small_device(1024 * kMiB));
  CHECK(whole.allocs == replayed.num_allocs);
  CHECK(whole.marks == 10);
}

TEST_CASE("time_ops_runs_record_stream_empty_cache_and_zero_byte_allocations", "[replay]") {
  const std::vector<ReplayOp> ops = {ReplayOp::alloc(1, 4 * kMiB, 0), ReplayOp::record_stream(1, 9),
                                     ReplayOp::alloc(2, 0),          ReplayOp::free(1),
                                     ReplayOp::free(2),              ReplayOp::empty_cache(),
                                     ReplayOp::alloc(3, kMiB),       ReplayOp::free(3)};
  const auto timed = cotenant::time_ops(ops, 0, small_device());
  CHECK(timed.allocs == 3);
  CHECK(timed.frees == 3);
  CHECK(timed.num_page_maps == 3);  // two pages, released by empty_cache, then one again
}

TEST_CASE("time_ops_refuses_a_trace_it_cannot_time_before_running_any_op", "[replay]") {
  using Ops = std::vector<ReplayOp>;
  auto refused_at = [](const Ops& ops) -> std::size_t {
    try {
      cotenant::time_ops(ops, 0, small_device());
    } catch (const ReplayError& error) {
      return error.op_index();
    }
    FAIL("time_ops accepted a trace it cannot time");
    return 0;
  };
  CHECK(refused_at(Ops{ReplayOp::alloc(1, kMiB), ReplayOp::cap(0), ReplayOp::free(1)}) == 1);
  CHECK(refused_at(Ops{ReplayOp::alloc(1, kMiB), ReplayOp::free(1), ReplayOp::free(1)}) == 2);
  CHECK(refused_at(Ops{ReplayOp::alloc(1, kMiB), ReplayOp::alloc(1, kMiB)}) == 1);
  CHECK(refused_at(Ops{ReplayOp::record_stream(4, 1)}) == 0);
  CHECK_THROWS_WITH(cotenant::time_ops(Ops{ReplayOp::alloc(1, kMiB)}, 2, small_device()),
                    Catch::Contains("warm-up of 2 ops is longer than the 1 ops given"));
}

TEST_CASE("time_ops_moves_pages_under_a_cap_as_replay_does", "[replay]") {
  const std::vector<ReplayOp> ops = {ReplayOp::alloc(1, 8 * kMiB), ReplayOp::alloc(2, 8 * kMiB),
                                     ReplayOp::cap(4 * kMiB),      ReplayOp::free(1),
                                     ReplayOp::cap(cotenant::kNoCap), ReplayOp::alloc(3, 2 * kMiB),
                                     ReplayOp::free(2),            ReplayOp::free(3)};
  const auto replayed = cotenant::replay(ops, small_device());
  REQUIRE(replayed.spilled_bytes > 0);
  const auto timed = cotenant::time_ops(ops, 0, small_device());
  CHECK(timed.num_page_maps == replayed.num_page_maps);
  CHECK(timed.peak_reserved_bytes == replayed.peak_reserved_bytes);
  CHECK(timed.allocs == 3);
}

TEST_CASE("time_ops_raises_when_an_allocation_does_not_fit", "[replay]") {
  auto config = small_device(8 * kMiB);
  config.device.host_capacity = 0;
  CHECK_THROWS_AS(cotenant::time_ops({ReplayOp::alloc(1, 64 * kMiB)}, 0, config), cotenant::OutOfMemoryError);
}
