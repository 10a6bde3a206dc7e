#include <catch2/catch.hpp>

#include <random>
#include <tuple>
#include <utility>
#include <vector>

#include "cotenant/errors.h"
#include "test_helpers.h"

using namespace cotenant;
using namespace cotenant::testing;

TEST_CASE("zero_byte_allocation_returns_null_and_counts_nothing", "[allocator]") {
  SimulatedBackend device(device_config(64 * kMiB));
  CachingAllocator allocator(device);
  CHECK(allocator.allocate(0, 0) == 0);
  CHECK(allocator.stats().allocation.all.current == 0);
}

TEST_CASE("sizes_round_to_512_bytes_and_the_statistics_split_by_size_class", "[allocator]") {
  SimulatedBackend device(device_config(256 * kMiB));
  CachingAllocator allocator(device);
  const DevicePtr small = allocator.allocate(1000, 0);
  const DevicePtr large = allocator.allocate(3 * kMiB, 0);
  CHECK(allocator.allocation_size(small) == 1024);
  CHECK(allocator.allocation_size(large) == 3 * kMiB);
  CHECK(large == small + 1024);  // one arena per stream, address-ordered
  const AllocatorStats stats = allocator.stats();
  CHECK(stats.allocated_bytes.small_pool.current == 1024);
  CHECK(stats.allocated_bytes.large_pool.current == 3 * kMiB);
  CHECK(stats.allocation.small_pool.current == 1);
  CHECK(stats.requested_bytes.all.current == 1000 + 3 * kMiB);
  // The arena is one segment as large as the device; only the pages the
  // two blocks touch are mapped: [0, 3 MiB + 1 KiB) spans two 2 MiB pages.
  CHECK(stats.segment.all.current == 1);
  CHECK(stats.segment.large_pool.current == 1);
  CHECK(allocator.snapshot().front().size == 256 * kMiB);
  CHECK(stats.reserved_bytes.all.current == 4 * kMiB);
  CHECK(stats.reserved_bytes.large_pool.current == 4 * kMiB);
}

TEST_CASE("a_rounding_that_does_not_divide_the_page_is_refused", "[allocator]") {
  SimulatedBackend device(device_config(64 * kMiB));
  AllocatorOptions options;
  options.round_bytes = 3000;
  CHECK_THROWS_WITH(CachingAllocator(device, options),
                    Catch::Contains("rounding (3000 bytes) must divide the page granularity (2097152 bytes)"));
  options.round_bytes = 4096;
  CachingAllocator allocator(device, options);
  const DevicePtr block = allocator.allocate(5000, 0);
  CHECK(allocator.allocation_size(block) == 8192);
}

TEST_CASE("freed_block_is_reused_at_once_by_its_stream", "[allocator]") {
  SimulatedBackend device(device_config(64 * kMiB));
  CachingAllocator allocator(device);
  const DevicePtr first = allocator.allocate(4096, 1);
  allocator.free(first);
  CHECK(allocator.allocate(4096, 1) == first);
  CHECK(device.calls().create_page == 1);  // no new page for the reuse
}

TEST_CASE("blocks_are_not_shared_between_streams_pools", "[allocator]") {
  SimulatedBackend device(device_config(64 * kMiB));
  CachingAllocator allocator(device);
  const DevicePtr on_one = allocator.allocate(4096, 1);
  allocator.free(on_one);
  const DevicePtr on_two = allocator.allocate(4096, 2);
  CHECK(on_two != on_one);
  CHECK(allocator.stats().segment.all.current == 2);
}

TEST_CASE("best_fit_over_holes_of_every_size_takes_the_smallest_then_the_lowest", "[allocator]") {
  // Holes from 512 bytes to 24 MiB (every range of sizes the free blocks are
  // kept in, several of a size at different addresses), separated by live
  // blocks, on two streams: each request gets the smallest hole of its
  // stream that fits, the lowest-addressed among equal ones, as a search
  // over every hole finds it.
  SimulatedBackend device(device_config(2048 * kMiB));
  CachingAllocator allocator(device);
  std::mt19937_64 random(7);
  auto any_size = [&random] {
    const unsigned octave = 9 + static_cast<unsigned>(random() % 16);  // 512 B .. 16 MiB
    return ((std::size_t{1} << octave) + random() % (std::size_t{1} << octave)) / 512 * 512;
  };
  std::vector<DevicePtr> live;
  std::vector<std::pair<DevicePtr, std::size_t>> holes[2];
  for (int i = 0; i < 200; ++i) {
    const StreamId stream = static_cast<StreamId>(i % 2);
    const std::size_t size = i % 5 == 4 ? holes[stream].back().second : any_size();  // some sizes twice
    holes[stream].emplace_back(allocator.allocate(size, stream), size);
    live.push_back(allocator.allocate(512, stream));
  }
  for (const auto& of_stream : holes) {
    for (const auto& [address, size] : of_stream) allocator.free(address);
  }
  for (int request = 0; request < 400; ++request) {
    const StreamId stream = static_cast<StreamId>(request % 2);
    const std::size_t size = request % 3 == 0 ? holes[stream][random() % holes[stream].size()].second : any_size();
    DevicePtr expected = 0;
    std::size_t expected_size = SIZE_MAX;
    for (const auto& [address, hole] : holes[stream]) {
      if (hole >= size && (hole < expected_size || (hole == expected_size && address < expected))) {
        expected = address;
        expected_size = hole;
      }
    }
    if (expected == 0) continue;  // only the arena's free end fits
    const DevicePtr got = allocator.allocate(size, stream);
    CHECK(got == expected);
    allocator.free(got);  // merges back into its hole
  }
  allocator.check_invariants();
}

TEST_CASE("best_fit_picks_the_smallest_free_block_that_fits", "[allocator]") {
  SimulatedBackend device(device_config(64 * kMiB));
  CachingAllocator allocator(device);
  // Carve one small segment into pieces, keep separators live so frees do not merge.
  const DevicePtr big = allocator.allocate(64 * 1024, 0);
  const DevicePtr sep1 = allocator.allocate(512, 0);
  const DevicePtr mid = allocator.allocate(16 * 1024, 0);
  const DevicePtr sep2 = allocator.allocate(512, 0);
  allocator.free(big);
  allocator.free(mid);
  CHECK(allocator.allocate(10 * 1024, 0) == mid);  // 16 KiB hole beats 64 KiB hole
  CHECK(allocator.allocate(40 * 1024, 0) == big);
  (void)sep1;
  (void)sep2;
}

TEST_CASE("freeing_neighbours_coalesces_them_into_one_block", "[allocator]") {
  SimulatedBackend device(device_config(64 * kMiB));
  CachingAllocator allocator(device);
  const DevicePtr a = allocator.allocate(4096, 0);
  const DevicePtr b = allocator.allocate(4096, 0);
  const DevicePtr c = allocator.allocate(4096, 0);
  CHECK(b == a + 4096);
  CHECK(c == b + 4096);
  allocator.free(a);
  allocator.free(c);
  CHECK(allocator.stats().inactive_split.all.current == 2);
  allocator.free(b);
  const auto segments = allocator.snapshot();
  REQUIRE(segments.size() == 1);
  REQUIRE(segments[0].blocks.size() == 1);  // one free block covers the segment
  CHECK_FALSE(segments[0].blocks[0].allocated);
  CHECK(allocator.stats().inactive_split.all.current == 0);
  CHECK(allocator.allocate(3 * 4096, 0) == a);  // the merged block serves a larger request
}

TEST_CASE("record_stream_holds_a_freed_block_until_the_other_stream_finishes", "[allocator]") {
  SimulatedBackend device(device_config(64 * kMiB, /*events_immediate=*/false));
  CachingAllocator allocator(device);
  const DevicePtr block = allocator.allocate(4096, 1);
  allocator.record_stream(block, 2);
  allocator.free(block);
  AllocatorStats stats = allocator.stats();
  CHECK(stats.allocated_bytes.all.current == 0);
  CHECK(stats.active_bytes.all.current == 4096);  // still active: stream 2 may use it
  CHECK(allocator.allocate(4096, 1) != block);
  device.complete_stream(2);
  const DevicePtr again = allocator.allocate(4096, 1);
  CHECK(again == block);
  CHECK(allocator.stats().active.all.current == 2);
}

TEST_CASE("record_stream_on_the_owning_stream_needs_no_event", "[allocator]") {
  SimulatedBackend device(device_config(64 * kMiB, /*events_immediate=*/false));
  CachingAllocator allocator(device);
  const DevicePtr block = allocator.allocate(4096, 1);
  allocator.record_stream(block, 1);
  allocator.free(block);
  CHECK(device.calls().record_event == 0);
  CHECK(allocator.allocate(4096, 1) == block);
}

TEST_CASE("largest_free_block_counts_mapped_bytes_and_new_pages_only_up_to_the_room", "[allocator]") {
  SimulatedBackend device(device_config(256 * kMiB, /*events_immediate=*/false));
  CachingAllocator allocator(device);
  const DevicePtr hole = allocator.allocate(10 * kMiB, 1);  // pages 0-4
  const DevicePtr after = allocator.allocate(1 * kMiB, 1);  // [10, 11) MiB: page 5, half used
  allocator.free(hole);
  // The hole is 10 MiB, all mapped. The arena's tail runs to 256 MiB but
  // only its first MiB is mapped: without room for new pages it serves 1 MiB.
  CHECK(allocator.largest_free_block(1, 0) == 10 * kMiB);
  CHECK(allocator.largest_free_block(1, 4 * kMiB) == 10 * kMiB);     // tail: 1 + 4 MiB
  CHECK(allocator.largest_free_block(1, 64 * kMiB) == 65 * kMiB);    // tail: 1 + 64 MiB
  CHECK(allocator.largest_free_block(2, 4 * kMiB) == 4 * kMiB);      // no arena on stream 2: new pages only
  // What it promises is served without a new page.
  const std::size_t pages = device.calls().create_page;
  const DevicePtr again = allocator.allocate(allocator.largest_free_block(1, 0), 1);
  CHECK(again == hole);
  CHECK(device.calls().create_page == pages);
  CHECK(allocator.largest_free_block(1, 0) == 1 * kMiB);
  // A block freed while another stream may still use it serves nothing yet.
  allocator.record_stream(again, 2);
  allocator.free(again);
  CHECK(allocator.largest_free_block(1, 0) == 1 * kMiB);
  device.complete_stream(2);
  allocator.free(allocator.allocate(512, 1));  // the allocator collects completed events on its next call
  CHECK(allocator.largest_free_block(1, 0) == 10 * kMiB);
  allocator.free(after);
  CHECK(allocator.largest_free_block(1, 0) == 12 * kMiB);  // one free block over pages 0-5
}

TEST_CASE("a_request_best_fit_would_place_over_an_unmapped_page_takes_a_mapped_hole", "[allocator]") {
  // [0, 4 MiB) live | [4, 6) a hole whose page was released | [6, 7) live |
  // [7, 10) a hole on mapped pages | [10, 10.5) live. Best fit's hole for
  // 2 MiB is the first (an exact fit) and needs a page mapped again; the
  // second holds it on pages the allocator already has.
  SimulatedBackend device(device_config(64 * kMiB));
  CachingAllocator allocator(device);
  const DevicePtr x = allocator.allocate(4 * kMiB, 0);
  const DevicePtr y = allocator.allocate(2 * kMiB, 0);
  const DevicePtr z = allocator.allocate(1 * kMiB, 0);
  const DevicePtr w = allocator.allocate(3 * kMiB, 0);
  const DevicePtr v = allocator.allocate(512 * 1024, 0);
  REQUIRE(w == x + 7 * kMiB);
  allocator.free(y);
  allocator.empty_cache();  // page 2, [4, 6) MiB, has no live block: released
  allocator.free(w);        // [7, 10) MiB: pages 3 and 4 stay mapped (z and v live on them)
  const std::uint64_t pages_before = device.calls().create_page;
  const auto reserved_before = allocator.stats().reserved_bytes.all.current;

  SECTION("without_a_cap_it_takes_the_mapped_hole") {
    const DevicePtr got = allocator.allocate(2 * kMiB, 0);
    CHECK(got == w);
    CHECK(device.calls().create_page == pages_before);
    CHECK(allocator.stats().reserved_bytes.all.current == reserved_before);
    // With no mapped hole that holds it, best fit's hole is mapped again.
    const DevicePtr next = allocator.allocate(2 * kMiB, 0);
    CHECK(next == y);
    CHECK(device.calls().create_page == pages_before + 1);
    allocator.check_invariants();
    for (DevicePtr live : {x, z, v, got, next}) allocator.free(live);
  }
  SECTION("under_a_cap_best_fit_places_it_and_temperature_decides_its_pages") {
    allocator.set_memory_cap(32 * kMiB);
    const DevicePtr got = allocator.allocate(2 * kMiB, 0);
    CHECK(got == y);
    CHECK(device.calls().create_page == pages_before + 1);
    allocator.check_invariants();
    for (DevicePtr live : {x, z, v, got}) allocator.free(live);
  }
}

TEST_CASE("empty_cache_releases_free_pages_and_whole_free_segments", "[allocator]") {
  SimulatedBackend device(device_config(256 * kMiB));
  CachingAllocator allocator(device);
  const DevicePtr keep = allocator.allocate(3 * kMiB, 0);   // pages 0-1 of a 20 MiB segment
  const DevicePtr drop = allocator.allocate(8 * kMiB, 0);   // same segment, next pages
  const DevicePtr small = allocator.allocate(4096, 0);
  allocator.free(drop);
  allocator.free(small);
  const auto before = allocator.stats().reserved_bytes.all.current;
  allocator.empty_cache();
  const AllocatorStats after = allocator.stats();
  CHECK(after.reserved_bytes.all.current < before);
  CHECK(after.reserved_bytes.all.current == 4 * kMiB);  // only the live block's pages remain
  CHECK(after.segment.small_pool.current == 0);         // the free small segment is gone
  CHECK(after.segment.large_pool.current == 1);
  CHECK(device.device_bytes_in_use() == 4 * kMiB);
  // The released range is mapped again on demand.
  const DevicePtr again = allocator.allocate(8 * kMiB, 0);
  fill(device, again, 1, 8 * kMiB);
  CHECK(holds(device, again, 1, 8 * kMiB));
  allocator.free(keep);
}

TEST_CASE("double_free_is_refused_and_loses_nothing", "[allocator]") {
  SimulatedBackend device(device_config(64 * kMiB));
  CachingAllocator allocator(device);
  const DevicePtr live = allocator.allocate(4096, 0);
  fill(device, live, 11, 4096);
  const DevicePtr gone = allocator.allocate(4096, 0);
  allocator.free(gone);
  try {
    allocator.free(gone);
    FAIL("double free accepted");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("freed already") != std::string::npos);
  }
  CHECK_THROWS_AS(allocator.free(live + 8), Error);  // not the start of a block
  CHECK(allocator.allocation_size(live) == 4096);
  CHECK(holds(device, live, 11, 4096));
  CHECK(allocator.stats().allocation.all.current == 1);
}

TEST_CASE("out_of_memory_names_the_numbers_when_device_and_host_are_full", "[allocator]") {
  SimulatedDeviceConfig config = device_config(4 * kMiB);
  config.host_capacity = 4 * kMiB;
  SimulatedBackend device(config);
  CachingAllocator allocator(device);
  allocator.set_memory_cap(4 * kMiB);
  const DevicePtr live = allocator.allocate(6 * kMiB, 0);  // 2 pages device, 1 page host
  CHECK(allocator.stats().host_resident_bytes.current == 2 * kMiB);
  try {
    allocator.allocate(6 * kMiB, 0);
    FAIL("allocation beyond device and host succeeded");
  } catch (const OutOfMemoryError& e) {
    const std::string message = e.what();
    CHECK(message.find("6.00 MiB") != std::string::npos);
    CHECK(message.find("set_memory_cap") != std::string::npos);
  }
  CHECK(allocator.stats().num_ooms == 1);
  CHECK(allocator.allocation_size(live) == 6 * kMiB);
  allocator.free(live);
}

TEST_CASE("a_request_the_device_has_no_room_for_leaves_nothing_mapped_for_itself", "[allocator]") {
  SimulatedBackend device(device_config(16 * kMiB));
  CachingAllocator other(device), allocator(device);
  const DevicePtr others = other.allocate(8 * kMiB, 0);  // another process's memory
  const DevicePtr live = allocator.allocate(3 * kMiB, 0);
  fill(device, live, 5, 3 * kMiB);
  const std::int64_t reserved = allocator.stats().reserved_bytes.all.current;
  const auto maps = device.calls().map;
  CHECK_THROWS_AS(allocator.allocate(12 * kMiB, 0), OutOfMemoryError);
  CHECK(device.calls().map > maps);  // it tried: 4 MiB were free
  // The pages mapped while trying went back: the device is as free as before,
  // for another process or a request that fits.
  CHECK(allocator.stats().reserved_bytes.all.current == reserved);
  CHECK(device.device_free_bytes() == 8 * kMiB - static_cast<std::size_t>(reserved));
  CHECK(allocator.stats().num_ooms == 1);
  other.free(others);
  other.empty_cache();
  const DevicePtr fits = allocator.allocate(12 * kMiB, 0);
  CHECK(holds(device, live, 5, 3 * kMiB));
  allocator.free(fits);
  allocator.free(live);
  allocator.check_invariants();
}

TEST_CASE("a_request_larger_than_any_residency_could_hold_fails_before_mapping_a_page", "[allocator]") {
  // No cap: the device alone could hold the block. It used to map the whole
  // free device (taking it from other processes meanwhile) and give it back.
  SimulatedDeviceConfig config = device_config(16 * kMiB);
  config.host_capacity = 64 * kMiB;
  SimulatedBackend device(config);
  CachingAllocator allocator(device);
  const DevicePtr live = allocator.allocate(3 * kMiB, 0);
  const auto maps = device.calls().map;
  const auto reserves = device.calls().reserve;
  try {
    allocator.allocate(24 * kMiB, 0);
    FAIL("a block larger than the device was allocated without a cap");
  } catch (const OutOfMemoryError& e) {
    CHECK(std::string(e.what()).rfind("CUDA out of memory. Tried to allocate 24.00 MiB.", 0) == 0);
  }
  CHECK(device.calls().map == maps);
  CHECK(device.calls().reserve == reserves);
  CHECK(allocator.stats().num_ooms == 1);
  // A size no machine has (a typo) fails the same way, at once: its page
  // table is never built.
  CHECK_THROWS_AS(allocator.allocate(std::size_t{1} << 60, 0), OutOfMemoryError);
  CHECK(device.calls().reserve == reserves);
  // Under a cap the block may spill, so the host's room counts too: 24 MiB
  // fits 16 + 64, and 96 MiB does not.
  allocator.set_memory_cap(8 * kMiB);
  const DevicePtr spilled = allocator.allocate(24 * kMiB, 0);
  CHECK(allocator.stats().host_resident_bytes.current > 0);
  const auto maps_under_cap = device.calls().map;
  CHECK_THROWS_AS(allocator.allocate(96 * kMiB, 0), OutOfMemoryError);
  CHECK(device.calls().map == maps_under_cap);
  allocator.free(spilled);
  allocator.free(live);
  allocator.check_invariants();
}

TEST_CASE("a_warm_allocation_asks_the_backend_for_neither_the_device_size_nor_the_hosts_room", "[allocator]") {
  // The size check of a request runs on every allocation. On the CUDA
  // backend the device's size is a cudaMemGetInfo and the host's room reads
  // /proc/meminfo and the cgroup's files: a block the device could hold
  // needs neither (PyTorch's warm path makes no such call).
  SimulatedDeviceConfig config = device_config(64 * kMiB);
  config.host_capacity = 64 * kMiB;
  SimulatedBackend device(config);
  CachingAllocator allocator(device);
  allocator.free(allocator.allocate(4 * kMiB, 0));  // warm: the cache holds a block of this size
  for (const bool capped : {false, true}) {
    if (capped) allocator.set_memory_cap(32 * kMiB);  // under a cap a block may spill
    const SimulatedCallCounts before = device.calls();
    for (int i = 0; i < 10; ++i) allocator.free(allocator.allocate(4 * kMiB, 0));
    CHECK(device.calls().device_total == before.device_total);
    CHECK(device.calls().host_available == before.host_available);
  }
  allocator.check_invariants();
}

TEST_CASE("statistics_use_torch_key_names", "[allocator]") {
  SimulatedBackend device(device_config(64 * kMiB));
  CachingAllocator allocator(device);
  const DevicePtr block = allocator.allocate(4096, 0);
  allocator.free(block);
  const auto stats = allocator.stats().as_map();
  for (const char* key : {"allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
                          "active_bytes.large_pool.peak", "inactive_split_bytes.all.current",
                          "allocation.all.allocated", "segment.small_pool.current", "num_alloc_retries",
                          "num_ooms", "requested_bytes.all.freed", "device_resident_bytes.current",
                          "host_resident_bytes.current", "spilled_bytes", "restored_bytes", "num_migrations"}) {
    INFO(key);
    CHECK(stats.count(key) == 1);
  }
  CHECK(stats.at("allocated_bytes.all.peak") == 4096);
  CHECK(stats.at("allocated_bytes.all.current") == 0);
  CHECK(stats.at("allocation.all.allocated") == 1);
  CHECK(stats.at("allocation.all.freed") == 1);
}

TEST_CASE("reset_peak_stats_brings_peaks_down_to_current", "[allocator]") {
  SimulatedBackend device(device_config(64 * kMiB));
  CachingAllocator allocator(device);
  const DevicePtr a = allocator.allocate(8192, 0);
  allocator.free(a);
  CHECK(allocator.stats().allocated_bytes.all.peak == 8192);
  allocator.reset_peak_stats();
  CHECK(allocator.stats().allocated_bytes.all.peak == 0);
}

TEST_CASE("destroying_the_allocator_returns_every_page_and_range", "[allocator]") {
  SimulatedBackend device(device_config(64 * kMiB));
  {
    CachingAllocator allocator(device);
    allocator.allocate(4096, 0);
    allocator.allocate(5 * kMiB, 3);
  }
  CHECK(device.device_bytes_in_use() == 0);
  const auto calls = device.calls();
  CHECK(calls.reserve == calls.release);
  CHECK(calls.map == calls.unmap);
}

TEST_CASE("a_larger_request_reuses_the_mapped_pages_of_a_freed_block_below_it", "[allocator]") {
  SimulatedBackend device(device_config(1 * kGiB));
  CachingAllocator allocator(device);
  const DevicePtr a = allocator.allocate(12 * kMiB, 0);
  allocator.free(a);                                       // 6 pages cached
  const auto maps_before = device.calls().map;
  const DevicePtr b = allocator.allocate(14 * kMiB, 0);   // larger: extends the same range
  CHECK(b == a);
  CHECK(device.calls().map - maps_before == 1);           // one new page, six reused
  CHECK(device.calls().unmap == 0);
  const AllocatorStats stats = allocator.stats();
  CHECK(stats.reserved_bytes.all.current == static_cast<std::int64_t>(14 * kMiB));
  fill(device, b, 3, 14 * kMiB);
  CHECK(holds(device, b, 3, 14 * kMiB));
  const DevicePtr c = allocator.allocate(12 * kMiB, 0);   // placed right after b
  CHECK(c == b + 14 * kMiB);
  fill(device, c, 4, 12 * kMiB);
  CHECK(holds(device, c, 4, 12 * kMiB));
  CHECK(holds(device, b, 3, 14 * kMiB));
}

TEST_CASE("a_loop_with_iteration_marks_releases_only_cache_idle_since_the_last_mark_to_grow", "[allocator]") {
  SimulatedBackend device(device_config(1 * kGiB));
  CachingAllocator allocator(device);
  // Iteration 1 leaves 8 MiB cached that the next iteration never touches.
  const DevicePtr keep = allocator.allocate(2 * kMiB, 0);
  const DevicePtr idle = allocator.allocate(8 * kMiB, 0);
  const DevicePtr keep_too = allocator.allocate(2 * kMiB, 0);
  allocator.free(idle);
  allocator.mark_iteration();
  // Iteration 2 needs 16 MiB: the idle cache goes instead of piling up.
  const DevicePtr big = allocator.allocate(16 * kMiB, 0);
  CHECK(device.calls().unmap == 4);
  CHECK(allocator.stats().reserved_bytes.all.current == static_cast<std::int64_t>(20 * kMiB));
  allocator.free(big);
  allocator.mark_iteration();
  // Iteration 3 repeats iteration 2: its cache is warm, nothing maps or unmaps.
  const auto maps = device.calls().map, unmaps = device.calls().unmap;
  CHECK(allocator.allocate(16 * kMiB, 0) == big);
  CHECK(device.calls().map == maps);
  CHECK(device.calls().unmap == unmaps);
  allocator.free(keep);
  allocator.free(keep_too);
}

TEST_CASE("a_loop_alternating_two_step_shapes_stops_the_cold_cache_rule_once_a_release_comes_back",
          "[allocator]") {
  SimulatedBackend device(device_config(256 * kMiB));
  CachingAllocator allocator(device);
  const DevicePtr weights = allocator.allocate(2 * kMiB, 0);
  // Shape A uses [2, 12) MiB and leaves 2 MiB alive into shape B, whose
  // 10 MiB block fits no hole below it: each shape's pages are cold while
  // the other runs, and each would release the other's to grow.
  DevicePtr carried = 0;
  auto step_a = [&] {
    const DevicePtr x = allocator.allocate(8 * kMiB, 0);
    carried = allocator.allocate(2 * kMiB, 0);
    allocator.free(x);
    allocator.mark_iteration();
  };
  auto step_b = [&] {
    const DevicePtr z = allocator.allocate(10 * kMiB, 0);
    allocator.free(carried);
    allocator.free(z);
    allocator.mark_iteration();
  };
  struct Calls { std::size_t map, unmap; };
  auto run = [&](auto&& step) {
    const auto before = device.calls();
    step();
    return Calls{device.calls().map - before.map, device.calls().unmap - before.unmap};
  };
  run(step_a);
  const Calls first_b = run(step_b);
  CHECK(first_b.unmap == 4);  // the rule releases shape A's cold pages to grow
  // ... which shape A maps again. A released page that comes back stops the
  // rule: this allocation releases nothing (shape B's pages, cold now,
  // stay), the loop needs both layouts, and no later step maps anything.
  const Calls second_a = run(step_a);
  CHECK(second_a.map > 0);
  CHECK(second_a.unmap == 0);
  for (int cycle = 0; cycle < 4; ++cycle) {
    const Calls b = run(step_b);
    const Calls a = run(step_a);
    CHECK(b.map + b.unmap + a.map + a.unmap == 0);
  }
  // The cost: both layouts stay mapped, 22 MiB for a live peak of 14.
  CHECK(allocator.stats().reserved_bytes.all.peak == static_cast<std::int64_t>(22 * kMiB));
  CHECK(allocator.stats().allocated_bytes.all.peak == static_cast<std::int64_t>(14 * kMiB));
  // empty_cache() starts the footprint over: the rule releases again.
  run(step_b);
  allocator.empty_cache();
  run(step_a);
  CHECK(run(step_b).unmap > 0);
  allocator.free(weights);
  allocator.check_invariants();
}

TEST_CASE("after_empty_cache_a_page_the_cold_cache_rule_released_before_does_not_stop_the_rule",
          "[allocator]") {
  SimulatedBackend device(device_config(256 * kMiB));
  CachingAllocator allocator(device);
  const DevicePtr weights = allocator.allocate(2 * kMiB, 0);
  // Step 1 leaves [2, 10) MiB cached and [10, 12) alive; step 2's 10 MiB
  // block fits no hole below 12, and the rule releases [2, 10) to grow.
  const DevicePtr x = allocator.allocate(8 * kMiB, 0);
  const DevicePtr carried = allocator.allocate(2 * kMiB, 0);
  allocator.free(x);
  allocator.mark_iteration();
  const DevicePtr z = allocator.allocate(10 * kMiB, 0);
  CHECK(device.calls().unmap == 4);
  allocator.free(z);
  allocator.mark_iteration();
  allocator.empty_cache();  // the footprint starts over
  // A new phase: 16 MiB above `carried`, freed, then cold at the mark.
  const DevicePtr w = allocator.allocate(16 * kMiB, 0);
  CHECK(w == carried + 2 * kMiB);
  allocator.free(w);
  allocator.mark_iteration();
  // 8 MiB fits best in [2, 10), whose pages the rule released before
  // empty_cache(). That is no release of this footprint coming back: to
  // grow past 1.05x the live peak (20 MiB), the rule releases w's cold pages.
  const auto unmaps = device.calls().unmap;
  const DevicePtr v = allocator.allocate(8 * kMiB, 0);
  CHECK(v == x);
  CHECK(device.calls().unmap - unmaps == 4);
  CHECK(allocator.stats().reserved_bytes.all.current == static_cast<std::int64_t>(20 * kMiB));
  allocator.free(v);
  allocator.free(carried);
  allocator.free(weights);
  allocator.check_invariants();
}

TEST_CASE("a_page_freed_after_an_iteration_mark_is_not_cold_for_the_cold_cache_rule", "[allocator]") {
  // The same program as above, but `x` is freed after the mark, before any
  // allocation: a free is a use, so its pages are not cold in this
  // iteration, and the 10 MiB block that fits no hole grows the arena
  // instead of releasing them. (The free used to be stamped with the
  // iteration before's time, so the rule released x's 4 pages.)
  SimulatedBackend device(device_config(256 * kMiB));
  CachingAllocator allocator(device);
  const DevicePtr weights = allocator.allocate(2 * kMiB, 0);
  const DevicePtr x = allocator.allocate(8 * kMiB, 0);
  const DevicePtr carried = allocator.allocate(2 * kMiB, 0);
  allocator.mark_iteration();
  allocator.free(x);
  const DevicePtr z = allocator.allocate(10 * kMiB, 0);
  CHECK(z == carried + 2 * kMiB);
  CHECK(device.calls().unmap == 0);
  CHECK(allocator.stats().reserved_bytes.all.current == static_cast<std::int64_t>(22 * kMiB));
  // At the next mark nothing has touched x's pages since: cold, and released
  // when an allocation must grow past 1.05x the live peak (22 MiB).
  allocator.free(z);
  allocator.mark_iteration();
  const DevicePtr big = allocator.allocate(18 * kMiB, 0);
  CHECK(big == carried + 2 * kMiB);
  CHECK(device.calls().unmap == 4);
  allocator.free(big);
  allocator.free(carried);
  allocator.free(weights);
  allocator.check_invariants();
}

TEST_CASE("a_loop_that_repeats_its_steps_places_each_request_where_it_went_in_the_step_before", "[allocator]") {
  // Two allocators run the same program; in `other` the steps differ, so it
  // has no plan and best fit decides.
  SimulatedBackend device(device_config(256 * kMiB)), other_device(device_config(256 * kMiB));
  CachingAllocator allocator(device), other(other_device);
  auto run = [](CachingAllocator& a, std::size_t second_step_bytes) {
    const DevicePtr first = a.allocate(kMiB, 0);  // lives across the steps
    a.allocate(kMiB, 0);
    a.mark_iteration();
    auto step = [&](std::size_t bytes) {
      const DevicePtr x = a.allocate(bytes, 0);
      a.free(x);
      a.mark_iteration();
      return x;
    };
    const DevicePtr one = step(kMiB);
    // A plan forms once a step that repeats the one before has to map a
    // page (best fit drifting): emptying the cache makes the next step map
    // its page again.
    a.empty_cache();
    step(second_step_bytes);
    // A free is no request: the step still follows the plan, though best
    // fit would now take the 1 MiB hole `first` leaves.
    a.free(first);
    const DevicePtr three = a.allocate(kMiB, 0);
    return std::make_tuple(first, one, three);
  };
  const auto [first, one, three] = run(allocator, kMiB);
  CHECK(one == first + 2 * kMiB);
  CHECK(three == one);
  const auto [other_first, other_one, other_three] = run(other, 2 * kMiB);
  CHECK(other_three == other_first);
  (void)other_one;
  allocator.check_invariants();
  other.check_invariants();
}

TEST_CASE("a_repeated_step_that_maps_no_page_forms_no_plan", "[allocator]") {
  // Best fit already repeats this loop's layout: its repeated steps map
  // nothing, no plan forms (none of a plan's cost), and a request goes
  // where best fit puts it. Once a repeated step has to map a page, the
  // step is the plan.
  SimulatedBackend device(device_config(256 * kMiB));
  CachingAllocator a(device);
  const DevicePtr first = a.allocate(kMiB, 0);  // lives across the steps
  a.allocate(kMiB, 0);
  a.mark_iteration();
  DevicePtr planned = 0;
  for (int i = 0; i < 4; ++i) {
    planned = a.allocate(kMiB, 0);
    a.free(planned);
    a.mark_iteration();
  }
  CHECK(device.calls().map == 2);  // the first step's page, and none since
  a.free(first);
  const DevicePtr best = a.allocate(kMiB, 0);
  CHECK(best == first);  // best fit: the lower hole

  // The same loop, each step mapping its page again.
  SimulatedBackend other_device(device_config(256 * kMiB));
  CachingAllocator b(other_device);
  const DevicePtr other_first = b.allocate(kMiB, 0);
  b.allocate(kMiB, 0);
  b.mark_iteration();
  DevicePtr other_planned = 0;
  for (int i = 0; i < 2; ++i) {
    b.empty_cache();
    other_planned = b.allocate(kMiB, 0);
    b.free(other_planned);
    b.mark_iteration();
  }
  b.free(other_first);
  CHECK(b.allocate(kMiB, 0) == other_planned);  // the plan: where the step before put it
  CHECK(other_planned != other_first);
  a.check_invariants();
  b.check_invariants();
}

TEST_CASE("a_loop_whose_steps_differ_in_a_few_requests_still_follows_the_step_before", "[allocator]") {
  // Batches padded to another bucket length change a few small tensors
  // (positions, masks) and nothing else: the steps still make a plan. Each
  // step: a small request whose size alternates, then 16 blocks of 1 MiB.
  // In `other`, two requests of the 17 change (more than 1 in 16): no plan,
  // best fit decides.
  SimulatedBackend device(device_config(256 * kMiB)), other_device(device_config(256 * kMiB));
  CachingAllocator allocator(device), other(other_device);
  auto run = [](CachingAllocator& a, bool two_differ) {
    const DevicePtr first = a.allocate(kMiB, 0);  // lives across the steps
    a.allocate(kMiB, 0);
    a.mark_iteration();
    std::vector<DevicePtr> blocks;
    auto step = [&](int i) {
      const DevicePtr small = a.allocate(i % 2 ? 8192 : 4096, 0);
      blocks.clear();
      for (int b = 0; b < 16; ++b) blocks.push_back(a.allocate(two_differ && b == 15 && i % 2 ? 2 * kMiB : kMiB, 0));
      for (DevicePtr block : blocks) a.free(block);
      a.free(small);
      a.mark_iteration();
    };
    for (int i = 0; i < 4; ++i) {
      a.empty_cache();  // each step maps its pages again: a repeated step that maps forms a plan
      step(i);
    }
    const DevicePtr planned = blocks[0];
    // Best fit would now put the step's small request in the hole `first`
    // leaves, and its first block elsewhere; the plan keeps the step's layout.
    a.free(first);
    a.allocate(4096, 0);
    return std::make_tuple(first, planned, a.allocate(kMiB, 0));
  };
  const auto [first, planned, placed] = run(allocator, false);
  CHECK(placed == planned);
  CHECK(placed != first);
  const auto [other_first, other_planned, other_placed] = run(other, true);
  CHECK(other_placed != other_planned);  // best fit: the small request took `first`'s hole, the block the lowest after
  (void)other_first;
  allocator.check_invariants();
  other.check_invariants();
}

TEST_CASE("a_step_whose_requests_keep_differing_from_the_plan_leaves_it", "[allocator]") {
  // A plan of 20 blocks of 1 MiB. A step that asks 512 KiB for its first k
  // requests, then 1 MiB: after a few such requests it may still be the
  // plan's step (its 1 MiB block goes where the plan had it); once more of
  // them differ than a plan allows (1 in 16, past the first 4) it has left
  // the plan, and the block goes to the best hole: the one `first` left.
  auto run = [](int differing) {
    SimulatedBackend device(device_config(256 * kMiB));
    CachingAllocator a(device);
    const DevicePtr first = a.allocate(kMiB, 0);
    a.allocate(kMiB, 0);
    a.mark_iteration();
    std::vector<DevicePtr> plan;
    for (int step = 0; step < 2; ++step) {
      a.empty_cache();  // each step maps its pages again: a repeated step that maps forms a plan
      plan.clear();
      for (int i = 0; i < 20; ++i) plan.push_back(a.allocate(kMiB, 0));
      for (DevicePtr block : plan) a.free(block);
      a.mark_iteration();
    }
    a.free(first);
    for (int i = 0; i < differing; ++i) a.allocate(kMiB / 2, 0);
    const DevicePtr block = a.allocate(kMiB, 0);
    a.check_invariants();
    return std::make_tuple(block, plan[static_cast<std::size_t>(differing)], first);
  };
  const auto [kept, planned, first] = run(3);
  CHECK(kept == planned);
  const auto [left, planned_too, first_too] = run(6);
  CHECK(left == first_too);
  CHECK(left != planned_too);
  (void)first;
}

TEST_CASE("a_request_off_the_plan_goes_where_no_later_request_of_the_step_is_planned", "[allocator]") {
  SimulatedBackend device(device_config(256 * kMiB)), other_device(device_config(256 * kMiB));
  CachingAllocator allocator(device), other(other_device);
  auto run = [](CachingAllocator& a, bool repeat) {
    // Weights, then a mapped 6 MiB hole below a live block.
    a.allocate(128 * kMiB, 0);
    const DevicePtr hole = a.allocate(6 * kMiB, 0);
    a.allocate(512 * 1024, 0);
    a.free(hole);
    a.mark_iteration();
    for (int i = 0; i < 2; ++i) {  // two steps alike (or not): the plan is two 1 MiB blocks at the hole's start
      const DevicePtr r0 = a.allocate(repeat || i == 0 ? kMiB : 2 * kMiB, 0);
      const DevicePtr r1 = a.allocate(kMiB, 0);
      // And a block each step leaves alive, larger than the hole: it maps
      // fresh pages (within 1.05x the live peak: no cached page is
      // released), so a repeated step forms a plan.
      a.allocate(8 * kMiB, 0);
      a.free(r0);
      a.free(r1);
      a.mark_iteration();
    }
    // 1.5 MiB is not the plan's first request. Best fit would put it at the
    // hole's start, over the range the plan gives the step's second request.
    return std::make_pair(hole, a.allocate(3 * kMiB / 2, 0));
  };
  const auto [hole, off_plan] = run(allocator, true);
  CHECK(off_plan == hole + 2 * kMiB);
  const auto [other_hole, best_fit] = run(other, false);
  CHECK(best_fit == other_hole);
  CHECK(device.calls().map == other_device.calls().map);  // the range was mapped: nothing new for it
  allocator.check_invariants();
}

TEST_CASE("a_step_longer_than_the_plan_can_record_places_by_best_fit_once_past_the_plan", "[allocator]") {
  SimulatedBackend device(device_config(256 * kMiB));
  CachingAllocator allocator(device);
  // As above: a mapped 6 MiB hole, and a plan of two 1 MiB blocks at its start.
  const DevicePtr hole = allocator.allocate(6 * kMiB, 0);
  allocator.allocate(512 * 1024, 0);
  allocator.free(hole);
  allocator.mark_iteration();
  for (int i = 0; i < 2; ++i) {
    const DevicePtr r0 = allocator.allocate(kMiB, 0);
    const DevicePtr r1 = allocator.allocate(kMiB, 0);
    allocator.free(r0);
    allocator.free(r1);
    allocator.mark_iteration();
  }
  // This step makes more requests than a step records (2^17): every request
  // of the plan lies behind it, so nothing is left to keep off, and 1.5 MiB
  // goes where best fit puts it, at the hole's start.
  for (std::size_t i = 0; i <= (std::size_t{1} << 17); ++i) allocator.free(allocator.allocate(512, 0));
  CHECK(allocator.allocate(3 * kMiB / 2, 0) == hole);
  allocator.check_invariants();
}

TEST_CASE("steady_state_reuse_maps_no_new_pages", "[allocator]") {
  SimulatedBackend device(device_config(1 * kGiB));
  CachingAllocator allocator(device);
  auto iteration = [&] {
    std::vector<DevicePtr> live;
    for (std::size_t size : {3 * kMiB, 700 * 1024ul, 12 * kMiB, 4096ul, 25 * kMiB, 9 * kMiB}) {
      live.push_back(allocator.allocate(size, 0));
    }
    for (DevicePtr p : live) allocator.free(p);
  };
  iteration();
  const auto maps_after_first = device.calls().map;
  for (int i = 0; i < 5; ++i) iteration();
  CHECK(device.calls().map == maps_after_first);
  CHECK(device.calls().unmap == 0);
}

TEST_CASE("releasing_many_cached_pages_synchronizes_the_device_once", "[allocator]") {
  // A device synchronize per page made empty_cache() and cap changes on a
  // busy GPU cost one synchronize per 2 MiB.
  SimulatedBackend device(device_config(256 * kMiB));
  CachingAllocator allocator(device);
  const DevicePtr big = allocator.allocate(32 * kMiB, 0);
  allocator.free(big);
  const auto before = device.calls();
  allocator.empty_cache();
  const auto after = device.calls();
  CHECK(after.unmap - before.unmap == 16);
  CHECK(after.synchronize_device - before.synchronize_device == 1);
  CHECK(allocator.stats().reserved_bytes.all.current == 0);
}

TEST_CASE("cached_pages_stay_while_the_device_cannot_synchronize", "[allocator]") {
  // During a CUDA graph capture nothing may synchronize the device: cache
  // that empty_cache would release stays mapped.
  SimulatedBackend device(device_config(256 * kMiB));
  CachingAllocator allocator(device);
  const DevicePtr first = allocator.allocate(12 * kMiB, 0);
  const DevicePtr second = allocator.allocate(2 * kMiB, 0);
  allocator.free(first);
  device.refuse_synchronization(true);
  const auto unmaps_before = device.calls().unmap;
  allocator.empty_cache();
  CHECK(device.calls().unmap == unmaps_before);
  CHECK(device.calls().refused_synchronization >= 1);
  CHECK(allocator.is_device_resident(first));
  device.refuse_synchronization(false);
  allocator.empty_cache();
  CHECK(allocator.stats().reserved_bytes.all.current == static_cast<std::int64_t>(2 * kMiB));
  CHECK_FALSE(allocator.is_device_resident(first));
  allocator.free(second);
}

// ---- checkpoints (CUDA graph trees restore a graph pool's allocations) --------

namespace {
std::vector<std::tuple<DevicePtr, std::size_t, std::size_t>> live_blocks(const CachingAllocator& allocator) {
  std::vector<std::tuple<DevicePtr, std::size_t, std::size_t>> out;
  for (const SegmentInfo& segment : allocator.snapshot()) {
    for (const BlockInfo& block : segment.blocks) {
      if (block.allocated) out.emplace_back(block.address, block.size, block.requested_size);
    }
  }
  return out;
}
}  // namespace

TEST_CASE("restoring_a_checkpoint_frees_what_is_live_and_allocates_what_was_at_the_same_addresses",
          "[allocator][checkpoint]") {
  SimulatedBackend device(device_config(256 * kMiB));
  CachingAllocator allocator(device);
  const DevicePtr a = allocator.allocate(1000, 0);
  const DevicePtr b = allocator.allocate(3 * kMiB, 0);
  const DevicePtr c = allocator.allocate(5000, 0);
  const DevicePtr other_stream = allocator.allocate(2 * kMiB, 7);
  allocator.free(other_stream);
  const auto checkpoint = allocator.snapshot();
  const auto live_then = live_blocks(allocator);
  const AllocatorStats stats_then = allocator.stats();

  allocator.free(b);
  const DevicePtr d = allocator.allocate(1 * kMiB, 0);  // in b's place
  const DevicePtr e = allocator.allocate(8 * kMiB, 0);
  const DevicePtr f = allocator.allocate(4096, 7);
  const std::int64_t maps_before = allocator.stats().num_device_alloc;

  const CachingAllocator::Restored restored = allocator.restore_allocations(checkpoint);
  std::vector<DevicePtr> was_live{a, c, d, e, f};
  std::sort(was_live.begin(), was_live.end());
  CHECK(restored.freed == was_live);
  CHECK(restored.allocated == std::vector<DevicePtr>{a, b, c});
  CHECK(live_blocks(allocator) == live_then);  // addresses, sizes and requested bytes
  const AllocatorStats stats = allocator.stats();
  CHECK(stats.allocated_bytes.small_pool.current == stats_then.allocated_bytes.small_pool.current);
  CHECK(stats.allocated_bytes.large_pool.current == stats_then.allocated_bytes.large_pool.current);
  CHECK(stats.requested_bytes.all.current == stats_then.requested_bytes.all.current);
  CHECK(stats.allocation.all.current == 3);
  CHECK(stats.num_device_alloc == maps_before);  // no page mapped: the pages were kept
  allocator.check_invariants();

  // The restored blocks are allocations like any other.
  allocator.free(b);
  CHECK(allocator.allocate(3 * kMiB, 0) == b);
  allocator.free(a);
  allocator.free(b);
  allocator.free(c);
  allocator.check_invariants();
  CHECK(allocator.stats().allocation.all.current == 0);
}

TEST_CASE("restoring_waits_for_the_streams_that_used_a_live_block", "[allocator][checkpoint]") {
  SimulatedBackend device(device_config(64 * kMiB));
  CachingAllocator allocator(device);
  const auto empty = allocator.snapshot();  // no segment yet: nothing to restore
  const DevicePtr a = allocator.allocate(1 * kMiB, 0);
  allocator.record_stream(a, 3);
  const auto checkpoint = allocator.snapshot();
  const CachingAllocator::Restored restored = allocator.restore_allocations(checkpoint);
  CHECK(restored.freed == std::vector<DevicePtr>{a});
  CHECK(restored.allocated == std::vector<DevicePtr>{a});
  CHECK(allocator.allocation_size(a) == 1 * kMiB);
  allocator.check_invariants();
  CHECK(allocator.restore_allocations(empty).allocated.empty());
  CHECK(allocator.stats().allocation.all.current == 0);
  allocator.check_invariants();
}

TEST_CASE("a_checkpoint_that_no_longer_fits_is_refused_and_nothing_changes", "[allocator][checkpoint]") {
  SimulatedBackend device(device_config(64 * kMiB));
  CachingAllocator allocator(device);
  const DevicePtr a = allocator.allocate(3 * kMiB, 0);
  const auto checkpoint = allocator.snapshot();
  allocator.free(a);
  allocator.empty_cache();  // the pages under a go back to the driver
  const DevicePtr small = allocator.allocate(1024, 0);
  CHECK_THROWS_WITH(allocator.restore_allocations(checkpoint), Catch::Contains("released since"));
  CHECK(allocator.allocation_size(small) == 1024);  // still live
  CHECK(allocator.stats().allocation.all.current == 1);

  auto moved = checkpoint;
  moved.front().address += 64 * kMiB;
  CHECK_THROWS_WITH(allocator.restore_allocations(moved), Catch::Contains("no longer this allocator's"));
  auto off_rounding = allocator.snapshot();
  off_rounding.front().blocks.front().address += 1;
  CHECK_THROWS_WITH(allocator.restore_allocations(off_rounding), Catch::Contains("rounding"));
  CHECK(allocator.stats().allocation.all.current == 1);
  allocator.check_invariants();
}

TEST_CASE("adding_an_allocators_statistics_sums_its_memory_but_not_the_devices_shared_host_pool", "[allocator]") {
  // A job's footprint: its main allocator plus a graph pool or region of the same device.
  AllocatorStats main, pool;
  main.device_resident_bytes.increase(4 * kMiB);
  main.allocated_bytes.increase(PoolKind::kLarge, 3 * kMiB);
  main.host_pool_bytes.increase(8 * kMiB);
  main.num_host_headroom_refusals = 2;
  main.spilled_bytes = 10;
  main.memory_cap = 6 * kMiB;
  pool.device_resident_bytes.increase(2 * kMiB);
  pool.allocated_bytes.increase(PoolKind::kSmall, kMiB);
  pool.host_pool_bytes.increase(8 * kMiB);  // the same pool, seen from the other allocator
  pool.num_host_headroom_refusals = 2;
  pool.spilled_bytes = 5;
  pool.pending_spill_bytes = 7;
  main.add(pool);
  CHECK(main.device_resident_bytes.current == 6 * kMiB);
  CHECK(main.device_resident_bytes.peak == 6 * kMiB);
  CHECK(main.allocated_bytes.all.current == 4 * kMiB);
  CHECK(main.allocated_bytes.small_pool.current == kMiB);
  CHECK(main.allocated_bytes.large_pool.current == 3 * kMiB);
  CHECK(main.spilled_bytes == 15);
  CHECK(main.pending_spill_bytes == 7);
  CHECK(main.host_pool_bytes.current == 8 * kMiB);  // one pool, not two
  CHECK(main.num_host_headroom_refusals == 2);
  CHECK(main.memory_cap == 6 * kMiB);
}
