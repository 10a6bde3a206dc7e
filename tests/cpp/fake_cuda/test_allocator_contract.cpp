// The allocator's behaviour suites (from test_caching_allocator.cpp and
// test_memory_cap.cpp), run on the simulated device and on the real
// CudaBackend over the fake CUDA runtime alike. On the fake, every test ends
// with zero driver-rule violations and nothing leaked.
#include <catch2/catch.hpp>

#include <atomic>
#include <thread>

#include "cotenant/errors.h"
#include "devices.h"

using namespace cotenant;
using namespace cotenant::testing;

#define BOTH_DEVICES SimulatedDevice, FakeCudaDevice

TEMPLATE_TEST_CASE("contract_sizes_round_to_512_bytes_in_one_arena_per_stream", "[contract]", BOTH_DEVICES) {
  TestType device;
  {
    CachingAllocator allocator(device.backend());
    CHECK(allocator.allocate(0, 0) == 0);
    const DevicePtr small = allocator.allocate(1000, 0);
    const DevicePtr large = allocator.allocate(3 * kMiB, 0);
    CHECK(allocator.allocation_size(small) == 1024);
    CHECK(allocator.allocation_size(large) == 3 * kMiB);
    CHECK(large == small + 1024);
    const AllocatorStats stats = allocator.stats();
    CHECK(stats.segment.all.current == 1);
    CHECK(stats.allocated_bytes.small_pool.current == 1024);
    CHECK(stats.reserved_bytes.all.current == 4 * kMiB);  // two pages mapped of the arena
    device.fill(small, 1, 1000);
    device.fill(large, 2, 3 * kMiB);
    CHECK(device.holds(small, 1, 1000));
    CHECK(device.holds(large, 2, 3 * kMiB));
  }
  device.check_clean();
}

TEMPLATE_TEST_CASE("contract_freed_block_is_reused_at_once_by_its_stream_and_not_by_others", "[contract]",
                   BOTH_DEVICES) {
  TestType device;
  {
    CachingAllocator allocator(device.backend());
    const DevicePtr first = allocator.allocate(4096, device.stream(1));
    allocator.free(first);
    CHECK(allocator.allocate(4096, device.stream(1)) == first);
    CHECK(device.pages_created() == 1);
    CHECK(allocator.allocate(4096, device.stream(2)) != first);
    CHECK(allocator.stats().segment.all.current == 2);
  }
  device.check_clean();
}

TEMPLATE_TEST_CASE("contract_freeing_neighbours_coalesces_them_into_one_block", "[contract]", BOTH_DEVICES) {
  TestType device;
  {
    CachingAllocator allocator(device.backend());
    const DevicePtr a = allocator.allocate(4096, 0);
    const DevicePtr b = allocator.allocate(4096, 0);
    const DevicePtr c = allocator.allocate(4096, 0);
    CHECK(b == a + 4096);
    CHECK(c == b + 4096);
    allocator.free(a);
    allocator.free(c);
    allocator.free(b);
    const auto segments = allocator.snapshot();
    REQUIRE(segments.size() == 1);
    CHECK(segments[0].blocks.size() == 1);
    CHECK(allocator.allocate(3 * 4096, 0) == a);
  }
  device.check_clean();
}

TEMPLATE_TEST_CASE("contract_record_stream_holds_a_freed_block_until_the_other_stream_finishes", "[contract]",
                   BOTH_DEVICES) {
  DeviceSpec spec;
  spec.events_immediate = false;
  TestType device(spec);
  {
    CachingAllocator allocator(device.backend());
    const StreamId one = device.stream(1);
    const StreamId two = device.stream(2);
    const DevicePtr block = allocator.allocate(4096, one);
    device.keep_busy(two);
    allocator.record_stream(block, two);
    allocator.free(block);
    CHECK(allocator.stats().active_bytes.all.current == 4096);
    CHECK(allocator.allocate(4096, one) != block);
    device.complete_stream(two);
    CHECK(allocator.allocate(4096, one) == block);
  }
  device.check_clean();
}

TEMPLATE_TEST_CASE("contract_empty_cache_releases_free_pages_and_whole_free_segments", "[contract]", BOTH_DEVICES) {
  TestType device;
  {
    CachingAllocator allocator(device.backend());
    const DevicePtr keep = allocator.allocate(3 * kMiB, 0);
    const DevicePtr drop = allocator.allocate(8 * kMiB, 0);
    const DevicePtr small = allocator.allocate(4096, 0);
    device.fill(keep, 5, 3 * kMiB);
    allocator.free(drop);
    allocator.free(small);
    allocator.empty_cache();
    const AllocatorStats after = allocator.stats();
    CHECK(after.reserved_bytes.all.current == 4 * kMiB);
    CHECK(after.segment.small_pool.current == 0);
    CHECK(device.device_bytes_in_use() == 4 * kMiB);
    const DevicePtr again = allocator.allocate(8 * kMiB, 0);
    device.fill(again, 1, 8 * kMiB);
    CHECK(device.holds(again, 1, 8 * kMiB));
    CHECK(device.holds(keep, 5, 3 * kMiB));
    allocator.free(keep);
  }
  device.check_clean();
}

TEMPLATE_TEST_CASE("contract_double_free_is_refused_and_loses_nothing", "[contract]", BOTH_DEVICES) {
  TestType device;
  {
    CachingAllocator allocator(device.backend());
    const DevicePtr live = allocator.allocate(4096, 0);
    device.fill(live, 11, 4096);
    const DevicePtr gone = allocator.allocate(4096, 0);
    allocator.free(gone);
    CHECK_THROWS_AS(allocator.free(gone), Error);
    CHECK_THROWS_AS(allocator.free(live + 8), Error);
    CHECK(device.holds(live, 11, 4096));
  }
  device.check_clean();
}

TEMPLATE_TEST_CASE("contract_out_of_memory_names_the_numbers_when_device_and_host_are_full", "[contract]",
                   BOTH_DEVICES) {
  DeviceSpec spec;
  spec.capacity = 4 * kMiB;
  spec.host_capacity = 4 * kMiB;
  TestType device(spec);
  {
    CachingAllocator allocator(device.backend());
    allocator.set_memory_cap(4 * kMiB);
    const DevicePtr live = allocator.allocate(6 * kMiB, 0);  // 2 pages device, 1 page host
    CHECK(allocator.stats().host_resident_bytes.current == 2 * kMiB);
    device.fill(live, 8, 6 * kMiB);
    try {
      allocator.allocate(6 * kMiB, 0);
      FAIL("allocation beyond device and host succeeded");
    } catch (const OutOfMemoryError& e) {
      CHECK(std::string(e.what()).find("6.00 MiB") != std::string::npos);
    }
    CHECK(allocator.stats().num_ooms == 1);
    CHECK(device.holds(live, 8, 6 * kMiB));
    allocator.free(live);
  }
  device.check_clean();
}

TEMPLATE_TEST_CASE("contract_steady_state_reuse_maps_no_new_pages", "[contract]", BOTH_DEVICES) {
  TestType device;
  {
    CachingAllocator allocator(device.backend());
    auto iteration = [&] {
      std::vector<DevicePtr> live;
      for (std::size_t size : {3 * kMiB, 700 * 1024ul, 12 * kMiB, 4096ul, 25 * kMiB, 9 * kMiB}) {
        live.push_back(allocator.allocate(size, 0));
      }
      for (DevicePtr p : live) allocator.free(p);
    };
    iteration();
    const auto maps_after_first = device.maps();
    for (int i = 0; i < 5; ++i) {
      iteration();
      UNSCOPED_INFO("iteration " << i << " maps " << device.maps() << " unmaps " << device.unmaps() << " reserved "
                    << allocator.stats().reserved_bytes.all.current);
    }
    CHECK(device.maps() == maps_after_first);
    CHECK(device.unmaps() == 0);
  }
  device.check_clean();
}

TEMPLATE_TEST_CASE("contract_a_larger_request_reuses_the_mapped_pages_of_a_freed_block_below_it", "[contract]",
                   BOTH_DEVICES) {
  TestType device;
  {
    CachingAllocator allocator(device.backend());
    const DevicePtr a = allocator.allocate(12 * kMiB, 0);
    allocator.free(a);
    const std::size_t pages_before = device.pages_created();
    const DevicePtr b = allocator.allocate(14 * kMiB, 0);
    CHECK(b == a);
    CHECK(device.pages_created() - pages_before == 1);
    const AllocatorStats stats = allocator.stats();
    CHECK(stats.reserved_bytes.all.current == static_cast<std::int64_t>(14 * kMiB));
    CHECK(device.device_bytes_in_use() == static_cast<std::size_t>(stats.reserved_bytes.all.current));
    device.fill(b, 3, 14 * kMiB);
    const DevicePtr c = allocator.allocate(12 * kMiB, 0);
    CHECK(c == b + 14 * kMiB);
    device.fill(c, 4, 12 * kMiB);
    CHECK(device.holds(c, 4, 12 * kMiB));
    CHECK(device.holds(b, 3, 14 * kMiB));
  }
  device.check_clean();
}

TEMPLATE_TEST_CASE("contract_an_allocation_with_no_colder_page_to_displace_spills_to_host", "[contract][cap]",
                   BOTH_DEVICES) {
  TestType device;
  {
    CachingAllocator allocator(device.backend());
    allocator.set_memory_cap(8 * kMiB);
    const DevicePtr only = allocator.allocate(12 * kMiB, 0);
    const AllocatorStats stats = allocator.stats();
    CHECK(stats.device_resident_bytes.current == 8 * kMiB);
    CHECK(stats.host_resident_bytes.current == 4 * kMiB);
    CHECK(device.device_bytes_in_use() == 8 * kMiB);
    device.fill(only, 5, 12 * kMiB);  // host-backed memory is addressable like device memory
    CHECK(device.holds(only, 5, 12 * kMiB));
    CHECK(allocator.is_device_resident(only));
    CHECK_FALSE(allocator.is_device_resident(only + 8 * kMiB));
  }
  device.check_clean();
}

TEMPLATE_TEST_CASE("contract_an_allocation_over_the_cap_displaces_a_colder_page_at_the_safe_point",
                   "[contract][cap]", BOTH_DEVICES) {
  TestType device;
  {
    CachingAllocator allocator(device.backend());
    allocator.set_memory_cap(8 * kMiB);
    const DevicePtr cold = allocator.allocate(6 * kMiB, 0);
    device.fill(cold, 1, 6 * kMiB);
    const DevicePtr hot = allocator.allocate(4 * kMiB, 0);
    CHECK(allocator.stats().device_resident_bytes.current == 10 * kMiB);
    CHECK(allocator.has_pending_migrations());
    device.fill(hot, 2, 4 * kMiB);
    CHECK(allocator.apply_pending_migrations() == 2 * kMiB);
    CHECK(allocator.stats().device_resident_bytes.current == 8 * kMiB);
    CHECK(device.device_bytes_in_use() == 8 * kMiB);
    CHECK_FALSE(allocator.is_device_resident(cold));
    CHECK(allocator.is_device_resident(hot + 2 * kMiB));
    CHECK(device.holds(cold, 1, 6 * kMiB));
    CHECK(device.holds(hot, 2, 4 * kMiB));
    // A spill owed and then not needed gives its held host page back.
    allocator.free(allocator.allocate(2 * kMiB, 0));
    allocator.empty_cache();
    CHECK(allocator.stats().host_resident_bytes.current == 2 * kMiB);
  }
  device.check_clean();
}

TEMPLATE_TEST_CASE("contract_shrinking_cap_below_live_bytes_spills_coldest_pages_and_raising_restores",
                   "[contract][cap]", BOTH_DEVICES) {
  TestType device;
  {
    CachingAllocator allocator(device.backend());
    const DevicePtr cold = allocator.allocate(12 * kMiB, device.stream(1));
    const DevicePtr warm = allocator.allocate(12 * kMiB, device.stream(2));
    const DevicePtr hot = allocator.allocate(12 * kMiB, 0);
    device.fill(cold, 1, 12 * kMiB);
    device.fill(warm, 2, 12 * kMiB);
    device.fill(hot, 3, 12 * kMiB);

    allocator.set_memory_cap(24 * kMiB);
    CHECK(allocator.apply_pending_migrations() == 12 * kMiB);
    CHECK(allocator.stats().device_resident_bytes.current == 24 * kMiB);
    CHECK(device.device_bytes_in_use() == 24 * kMiB);
    CHECK_FALSE(allocator.is_device_resident(cold));
    CHECK(allocator.is_device_resident(hot));
    CHECK(device.holds(cold, 1, 12 * kMiB));  // same address, bytes now on the host
    CHECK(device.holds(warm, 2, 12 * kMiB));
    CHECK(device.holds(hot, 3, 12 * kMiB));

    allocator.set_memory_cap(kNoCap);
    CHECK(allocator.apply_pending_migrations() == 12 * kMiB);
    CHECK(allocator.is_device_resident(cold));
    CHECK(device.holds(cold, 1, 12 * kMiB));
  }
  device.check_clean();
}

TEMPLATE_TEST_CASE("contract_spill_all_and_restore_all_keep_addresses_and_bytes", "[contract][cap]", BOTH_DEVICES) {
  TestType device;
  {
    CachingAllocator allocator(device.backend());
    const DevicePtr a = allocator.allocate(6 * kMiB, 0);
    const DevicePtr b = allocator.allocate(100, 0);
    device.fill(a, 1, 6 * kMiB);
    device.fill(b, 2, 100);
    allocator.spill_all();
    allocator.apply_pending_migrations();
    CHECK(allocator.stats().device_resident_bytes.current == 0);
    CHECK(device.device_bytes_in_use() == 0);
    const DevicePtr c = allocator.allocate(4096, 0);
    CHECK_FALSE(allocator.is_device_resident(c));
    device.fill(c, 3, 4096);
    allocator.restore_all();
    allocator.apply_pending_migrations();
    CHECK(allocator.stats().host_resident_bytes.current == 0);
    CHECK(device.holds(a, 1, 6 * kMiB));
    CHECK(device.holds(b, 2, 100));
    CHECK(device.holds(c, 3, 4096));
    CHECK(allocator.is_device_resident(c));
  }
  device.check_clean();
}

TEMPLATE_TEST_CASE("contract_hard_cap_without_spilling_raises_out_of_memory", "[contract][cap]", BOTH_DEVICES) {
  TestType device;
  {
    AllocatorOptions options;
    options.spill_to_host = false;
    CachingAllocator allocator(device.backend(), options);
    allocator.set_memory_cap(4 * kMiB);
    const DevicePtr fits = allocator.allocate(4 * kMiB, 0);
    CHECK_THROWS_AS(allocator.allocate(4 * kMiB, 0), OutOfMemoryError);
    CHECK(allocator.allocation_size(fits) == 4 * kMiB);
  }
  device.check_clean();
}

TEMPLATE_TEST_CASE("contract_device_full_from_other_processes_spills_under_a_cap", "[contract][cap]", BOTH_DEVICES) {
  TestType device;
  {
    CachingAllocator allocator(device.backend());
    allocator.set_memory_cap(512 * kMiB);
    device.fail_next_device_page();
    const DevicePtr block = allocator.allocate(2 * kMiB, 0);
    CHECK_FALSE(allocator.is_device_resident(block));
    CHECK(allocator.stats().host_resident_bytes.current == 2 * kMiB);
    device.fill(block, 6, 2 * kMiB);
    CHECK(device.holds(block, 6, 2 * kMiB));
  }
  device.check_clean();
}

TEMPLATE_TEST_CASE("contract_pinned_fallback_serves_over_cap_allocations_from_pinned_host_memory",
                   "[contract][cap]", BOTH_DEVICES) {
  DeviceSpec spec;
  spec.host_mappable = false;
  TestType device(spec);
  {
    CachingAllocator allocator(device.backend());
    CHECK(allocator.mode() == SpillMode::kPinnedFallback);
    allocator.set_memory_cap(4 * kMiB);
    const DevicePtr on_device = allocator.allocate(4 * kMiB, 0);
    const DevicePtr pinned = allocator.allocate(3 * kMiB, 0);
    device.fill(pinned, 4, 3 * kMiB);
    CHECK(device.holds(pinned, 4, 3 * kMiB));
    CHECK(allocator.stats().pinned_fallback_bytes.current == 4 * kMiB);  // a page-rounded size
    allocator.set_memory_cap(2 * kMiB);
    CHECK_FALSE(allocator.has_pending_migrations());
    allocator.free(pinned);
    CHECK(allocator.stats().pinned_fallback_bytes.current == 4 * kMiB);  // kept for the next one
    CHECK(allocator.allocate(2 * kMiB + 4096, 0) == pinned);
    allocator.free(pinned);
    allocator.empty_cache();
    CHECK(allocator.stats().pinned_fallback_bytes.current == 0);
    CHECK(device.host_bytes_in_use() == 0);  // empty_cache gives pinned memory back
    allocator.allocate(5 * kMiB, 0);  // stays allocated: the allocator's destructor returns it
    allocator.free(on_device);
  }
  device.check_clean();
}

TEMPLATE_TEST_CASE("contract_pinned_fallback_pins_once_for_a_loop_of_over_cap_allocations", "[contract][cap]",
                   BOTH_DEVICES) {
  // Pinning host memory costs milliseconds: a training loop whose
  // activations go over the cap every step pins its memory once.
  DeviceSpec spec;
  spec.host_mappable = false;
  TestType device(spec);
  {
    CachingAllocator allocator(device.backend());
    allocator.set_memory_cap(4 * kMiB);
    const DevicePtr on_device = allocator.allocate(4 * kMiB, 0);
    for (int step = 0; step < 50; ++step) {
      const DevicePtr a = allocator.allocate(3 * kMiB, 0);
      const DevicePtr b = allocator.allocate(5 * kMiB + static_cast<std::size_t>(step) * 4096, 0);
      CHECK_FALSE(allocator.is_device_resident(a));
      device.fill(b, 7 + static_cast<std::uint64_t>(step), 5 * kMiB);
      CHECK(device.holds(b, 7 + static_cast<std::uint64_t>(step), 5 * kMiB));
      allocator.free(b);
      allocator.free(a);
    }
    CHECK(device.pins() == 2);
    CHECK(device.unpins() == 0);
    CHECK(allocator.stats().num_spilled_allocations == 100);
    allocator.empty_cache();
    CHECK(device.unpins() == 2);
    CHECK(allocator.stats().pinned_fallback_bytes.current == 0);
    allocator.free(on_device);
    allocator.check_invariants();
  }
  device.check_clean();
}

TEMPLATE_TEST_CASE("contract_a_cached_pinned_block_is_not_reused_while_another_stream_still_uses_it",
                   "[contract][cap]", BOTH_DEVICES) {
  DeviceSpec spec;
  spec.host_mappable = false;
  spec.events_immediate = false;
  TestType device(spec);
  {
    CachingAllocator allocator(device.backend());
    const StreamId one = device.stream(1);
    const StreamId two = device.stream(2);
    allocator.set_memory_cap(4 * kMiB);
    const DevicePtr on_device = allocator.allocate(4 * kMiB, one);
    const DevicePtr pinned = allocator.allocate(3 * kMiB, one);
    device.keep_busy(two);
    allocator.record_stream(pinned, two);
    allocator.free(pinned);
    const DevicePtr other = allocator.allocate(3 * kMiB, one);
    CHECK(other != pinned);  // stream two's work may still touch it
    device.complete_stream(two);
    CHECK(allocator.allocate(3 * kMiB, one) == pinned);
    CHECK(device.pins() == 2);
    allocator.free(pinned);
    allocator.free(other);
    allocator.free(on_device);
    allocator.check_invariants();
  }
  device.check_clean();
}

TEMPLATE_TEST_CASE("contract_cached_pinned_memory_goes_back_when_host_memory_runs_short", "[contract][cap]",
                   BOTH_DEVICES) {
  DeviceSpec spec;
  spec.host_mappable = false;
  spec.host_capacity = 8 * kMiB;
  TestType device(spec);
  {
    CachingAllocator allocator(device.backend());
    allocator.set_memory_cap(4 * kMiB);
    const DevicePtr on_device = allocator.allocate(4 * kMiB, 0);
    allocator.free(allocator.allocate(6 * kMiB, device.stream(1)));  // cached for stream 1
    // Another stream cannot take it, and the host has room for 2 MiB more
    // only: the cache goes back, then the allocation is pinned.
    const DevicePtr pinned = allocator.allocate(6 * kMiB, device.stream(2));
    CHECK_FALSE(allocator.is_device_resident(pinned));
    device.fill(pinned, 9, 6 * kMiB);
    CHECK(device.holds(pinned, 9, 6 * kMiB));
    CHECK(device.pins() == 3);  // one failed try between the two that succeeded
    CHECK(device.unpins() == 1);
    CHECK(allocator.stats().pinned_fallback_bytes.current == 6 * kMiB);
    allocator.free(pinned);
    allocator.free(on_device);
    allocator.check_invariants();
  }
  device.check_clean();
}

TEMPLATE_TEST_CASE("contract_setting_the_cap_from_another_thread_is_safe_while_allocating", "[contract][threads]",
                   BOTH_DEVICES) {
  TestType device;
  {
    CachingAllocator allocator(device.backend());
    std::atomic<bool> stop{false};
    std::thread capper([&] {
      std::uint64_t cap = 8 * kMiB;
      while (!stop.load()) {
        allocator.set_memory_cap(cap);
        cap = cap == 8 * kMiB ? 64 * kMiB : 8 * kMiB;
        allocator.apply_pending_migrations();
      }
    });
    std::vector<DevicePtr> live;
    for (int i = 0; i < 2000; ++i) {
      live.push_back(allocator.allocate(static_cast<std::size_t>((i % 7) + 1) * 300 * 1024, 0));
      if (live.size() > 20) {
        allocator.free(live.front());
        live.erase(live.begin());
      }
    }
    stop = true;
    capper.join();
    for (DevicePtr p : live) allocator.free(p);
    CHECK(allocator.stats().allocated_bytes.all.current == 0);
  }
  device.check_clean();
}
