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

TEST_CASE("replay_initial_cap_places_over_cap_allocations_on_the_host", "[replay]") {
  auto config = small_device();
  config.initial_cap = 4 * kMiB;
  std::vector<ReplayOp> ops;
  for (std::uint64_t id = 1; id <= 4; ++id) ops.push_back(ReplayOp::alloc(id, 2 * kMiB));
  const auto result = cotenant::replay(ops, config);
  CHECK(result.num_ooms == 0);
  CHECK(result.peak_device_resident_bytes <= static_cast<std::int64_t>(4 * kMiB));
  CHECK(result.final_stats.host_resident_bytes.current >= static_cast<std::int64_t>(4 * kMiB));
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
