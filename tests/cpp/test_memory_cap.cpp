#include <catch2/catch.hpp>

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <thread>

#include "cotenant/errors.h"
#include "cotenant/host_memory.h"
#include "test_helpers.h"

using namespace cotenant;
using namespace cotenant::testing;

TEST_CASE("an_allocation_with_no_colder_page_to_displace_spills_to_host_instead_of_failing", "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB));
  CachingAllocator allocator(device);
  allocator.set_memory_cap(8 * kMiB);
  const DevicePtr only = allocator.allocate(12 * kMiB, 0);  // no other live page is colder
  const AllocatorStats stats = allocator.stats();
  CHECK(stats.device_resident_bytes.current == 8 * kMiB);
  CHECK(stats.host_resident_bytes.current == 4 * kMiB);
  CHECK(stats.num_spilled_allocations == 1);
  CHECK_FALSE(allocator.has_pending_migrations());
  CHECK(device.device_bytes_in_use() == 8 * kMiB);
  fill(device, only, 5, 12 * kMiB);  // host-backed memory is addressable like device memory
  CHECK(holds(device, only, 5, 12 * kMiB));
  CHECK(allocator.is_device_resident(only));
  CHECK_FALSE(allocator.is_device_resident(only + 8 * kMiB));
}

TEST_CASE("largest_free_block_counts_only_device_pages_of_a_hole_partly_on_the_host", "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB));
  CachingAllocator allocator(device);
  allocator.set_memory_cap(8 * kMiB);
  allocator.free(allocator.allocate(12 * kMiB, 0));  // 8 MiB of device pages, 4 of host pages
  const AllocatorStats stats = allocator.stats();
  REQUIRE(stats.host_resident_bytes.current == 4 * kMiB);  // kept, mapped, as cache
  // A request of 12 MiB would find the hole but land a third of it on the
  // host: what the device can serve is its 8 MiB of device pages, and the
  // room for new device pages (none under the cap here) beyond them.
  CHECK(allocator.largest_free_block(0, 0) == 8 * kMiB);
  CHECK(allocator.largest_free_block(0, 2 * kMiB) == 10 * kMiB);
}

TEST_CASE("an_allocation_over_the_cap_takes_device_pages_and_a_colder_page_moves_out_at_the_safe_point",
          "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB));
  CachingAllocator allocator(device);
  allocator.set_memory_cap(8 * kMiB);
  const DevicePtr cold = allocator.allocate(6 * kMiB, 0);
  fill(device, cold, 1, 6 * kMiB);
  const DevicePtr hot = allocator.allocate(4 * kMiB, 0);  // one page fits, one goes over
  AllocatorStats stats = allocator.stats();
  CHECK(stats.num_spilled_allocations == 0);
  CHECK(stats.device_resident_bytes.current == 10 * kMiB);
  // The host page the spill needs is taken now, so the safe point cannot fail.
  CHECK(stats.host_resident_bytes.current == 2 * kMiB);
  CHECK(device.host_bytes_in_use() == 2 * kMiB);
  CHECK(stats.pending_spill_bytes == 2 * kMiB);
  CHECK(allocator.has_pending_migrations());
  fill(device, hot, 2, 4 * kMiB);

  CHECK(allocator.apply_pending_migrations() == 2 * kMiB);
  stats = allocator.stats();
  CHECK(stats.device_resident_bytes.current == 8 * kMiB);
  CHECK(stats.host_resident_bytes.current == 2 * kMiB);
  CHECK(device.device_bytes_in_use() == 8 * kMiB);
  CHECK(device.host_bytes_in_use() == 2 * kMiB);
  CHECK_FALSE(allocator.is_device_resident(cold));        // its first page was the coldest
  CHECK(allocator.is_device_resident(cold + 2 * kMiB));
  CHECK(allocator.host_bytes_of(cold) == 2 * kMiB);
  CHECK(allocator.host_bytes_of(hot) == 0);
  CHECK(holds(device, cold, 1, 6 * kMiB));
  CHECK(holds(device, hot, 2, 4 * kMiB));
}

// A step that repeats under a cap below its peak (32 MiB of activations
// under a 24 MiB cap) moves its oldest pages out once, in the first step, a
// safe point (the next op's entry) per page over the cap; the later steps
// reuse those host pages where they lie and move nothing. The cap holds
// after every safe point, and the bytes stay intact.
TEST_CASE("a_repeated_step_under_a_cap_moves_pages_in_its_first_step_only", "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB));
  CachingAllocator allocator(device);
  allocator.set_memory_cap(24 * kMiB);
  std::vector<int> safe_points;     // per step: the safe points that moved pages
  std::vector<std::int64_t> moved;  // per step: bytes moved either way
  for (int step = 0; step < 4; ++step) {
    int moving = 0;
    const std::int64_t moved_before = allocator.stats().spilled_bytes + allocator.stats().restored_bytes;
    auto safe_point = [&] {
      if (allocator.has_pending_migrations() && allocator.apply_pending_migrations() > 0) ++moving;
      CHECK(allocator.stats().device_resident_bytes.current <= 24 * static_cast<std::int64_t>(kMiB));
    };
    std::vector<DevicePtr> activations;
    for (int i = 0; i < 16; ++i) {
      safe_point();
      activations.push_back(allocator.allocate(2 * kMiB, 0));
      fill(device, activations.back(), static_cast<std::uint8_t>(i), 2 * kMiB);
    }
    for (int i = 15; i >= 0; --i) {  // a backward pass: the newest die first
      safe_point();
      CHECK(holds(device, activations[i], static_cast<std::uint8_t>(i), 2 * kMiB));
      allocator.free(activations[i]);
    }
    safe_point();
    allocator.mark_iteration();
    safe_points.push_back(moving);
    moved.push_back(allocator.stats().spilled_bytes + allocator.stats().restored_bytes - moved_before);
  }
  CHECK(safe_points == std::vector<int>{4, 0, 0, 0});
  CHECK(moved == std::vector<std::int64_t>{8 * static_cast<std::int64_t>(kMiB), 0, 0, 0});
}

// A step whose layout holds more pages than its peak of live bytes (a 6 MiB
// block that fits in no hole the step left), warm and uncapped, then capped
// at two thirds of its peak, as bench_allocator's spilled steps do. Under the
// cap the device's free pages are the step's own layout: releasing them to
// map the next block's pages released, in every step, the pages the next
// block of another phase maps again (6 pages created and released a step,
// each release behind a device synchronize, no page moved). A colder live
// page (the weights) moves out instead, so the layout fills with host pages
// once and a warm step asks the driver for no page and releases none. The
// cap holds after every safe point, and the bytes stay intact. Lifted, the
// cap leaves no page of the loop's on the host.
TEST_CASE("a_warm_loop_under_a_cap_keeps_its_layout_instead_of_releasing_and_creating_pages_each_step", "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB));
  CachingAllocator allocator(device);
  const std::int64_t cap = 12 * kMiB;
  bool capped = false;
  auto safe_point = [&] {
    if (allocator.has_pending_migrations()) allocator.apply_pending_migrations();
    if (capped) CHECK(allocator.stats().device_resident_bytes.current <= cap);
  };
  const DevicePtr weights = allocator.allocate(8 * kMiB, 0);
  fill(device, weights, 1, 8 * kMiB);
  struct Counts { std::uint64_t create, release, synchronize; };
  std::vector<Counts> steps;
  for (int step = 0; step < 14; ++step) {
    if (step == 3) {
      allocator.set_memory_cap(cap);
      capped = true;
      safe_point();
    }
    if (step == 12) {
      allocator.set_memory_cap(kNoCap);
      capped = false;
    }
    const SimulatedCallCounts before = device.calls();
    safe_point();
    const DevicePtr first = allocator.allocate(4 * kMiB, 0);
    safe_point();
    const DevicePtr second = allocator.allocate(4 * kMiB, 0);
    fill(device, second, 2, 4 * kMiB);
    safe_point();
    allocator.free(first);
    safe_point();
    const DevicePtr wide = allocator.allocate(6 * kMiB, 0);  // fits in no hole: pages of its own
    safe_point();
    allocator.free(wide);
    safe_point();
    CHECK(holds(device, second, 2, 4 * kMiB));
    allocator.free(second);
    safe_point();
    allocator.mark_iteration();
    const SimulatedCallCounts after = device.calls();
    steps.push_back({after.create_page - before.create_page, after.release_page - before.release_page,
                     after.synchronize_device - before.synchronize_device});
  }
  CHECK(steps[0].create > 0);
  for (std::size_t step = 6; step < 12; ++step) {  // three capped steps to settle
    INFO("step " << step);
    CHECK(steps[step].create == 0);
    CHECK(steps[step].release == 0);
    CHECK(steps[step].synchronize == 0);
  }
  CHECK(allocator.stats().num_ooms == 0);
  CHECK(allocator.stats().host_resident_bytes.current == 0);
  CHECK(holds(device, weights, 1, 8 * kMiB));
  allocator.check_invariants();
}

// The loop's cached device pages go last, after a colder live page's spill;
// but a spill needs a host page. With the host exhausted no colder page can
// move out, and the loop's cache is what makes room: a block that fits under
// the cap once that cache is released is placed, where taking the colder
// page's way it found no host page and failed.
TEST_CASE("an_allocation_with_the_host_exhausted_releases_the_loops_cache_instead_of_failing", "[cap]") {
  SimulatedDeviceConfig config = device_config(1 * kGiB);
  config.host_capacity = 0;
  SimulatedBackend device(config);
  CachingAllocator allocator(device);
  const DevicePtr weights = allocator.allocate(4 * kMiB, 0);
  fill(device, weights, 1, 4 * kMiB);
  const DevicePtr hole = allocator.allocate(4 * kMiB, 0);
  const DevicePtr pinned = allocator.allocate(2 * kMiB, 0);  // keeps the hole a hole
  allocator.free(hole);
  for (int step = 0; step < 3; ++step) {  // the hole's pages are the loop's layout
    allocator.free(allocator.allocate(4 * kMiB, 0));
    allocator.mark_iteration();
  }
  allocator.free(allocator.allocate(4 * kMiB, 0));
  allocator.set_memory_cap(12 * kMiB);
  REQUIRE(allocator.stats().device_resident_bytes.current == 10 * kMiB);  // 4 MiB of it cached

  const DevicePtr wide = allocator.allocate(5 * kMiB, 0);  // fits in no hole: 3 pages of its own
  const AllocatorStats stats = allocator.stats();
  CHECK(stats.num_ooms == 0);
  CHECK(stats.device_resident_bytes.current == 12 * kMiB);
  CHECK(stats.host_resident_bytes.current == 0);
  CHECK(allocator.is_device_resident(wide));
  CHECK_FALSE(allocator.has_pending_migrations());
  CHECK(holds(device, weights, 1, 4 * kMiB));
  allocator.check_invariants();
  allocator.free(wide);
  allocator.free(pinned);
  allocator.free(weights);
}

// The loop's cached host pages stay mapped under the cap while the device
// has no room for them, but they hold host memory. With the host short, a
// cap lowered mid-step must spill live device pages into what those pages
// hold: a safe point that kept them found no host page for the spill and
// left the device over the cap, although the host could take it.
TEST_CASE("a_safe_point_gives_up_the_loops_host_cache_when_the_spill_needs_its_memory", "[cap]") {
  SimulatedDeviceConfig config = device_config(1 * kGiB);
  config.host_capacity = 4 * kMiB;
  SimulatedBackend device(config);
  CachingAllocator allocator(device);
  allocator.set_memory_cap(8 * kMiB);
  for (int step = 0; step < 3; ++step) {  // 8 MiB on the device, 4 MiB on the host: the loop's layout
    allocator.free(allocator.allocate(12 * kMiB, 0));
    allocator.mark_iteration();
  }
  REQUIRE(allocator.stats().host_resident_bytes.current == 4 * kMiB);
  const DevicePtr live = allocator.allocate(8 * kMiB, 0);
  REQUIRE(allocator.is_device_resident(live));
  fill(device, live, 3, 8 * kMiB);

  allocator.set_memory_cap(4 * kMiB);
  REQUIRE(allocator.has_pending_migrations());
  CHECK(allocator.apply_pending_migrations() >= 4 * kMiB);
  const AllocatorStats stats = allocator.stats();
  CHECK(stats.device_resident_bytes.current <= 4 * kMiB);
  CHECK(stats.host_resident_bytes.current == 4 * kMiB);
  CHECK(device.device_bytes_in_use() == static_cast<std::size_t>(stats.device_resident_bytes.current));
  CHECK(holds(device, live, 3, 8 * kMiB));
  CHECK_FALSE(allocator.has_pending_migrations());
  allocator.check_invariants();
}

// Under the cap the loop's cached host pages stay mapped (safe points keep
// them while the device has no room), and a block of the loop lands on them
// again every step. Lifting the cap makes nothing pending when no live page
// is on the host, so no safe point releases them: the loop went on running
// that block on host pages, step after step, with the device free.
TEST_CASE("lifting_the_cap_brings_the_loops_blocks_on_host_cache_back_to_the_device", "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB));
  CachingAllocator allocator(device);
  allocator.set_memory_cap(8 * kMiB);
  for (int step = 0; step < 3; ++step) {  // 8 MiB on the device, 4 MiB on host pages: the loop's layout
    const DevicePtr block = allocator.allocate(12 * kMiB, 0);
    CHECK(allocator.host_bytes_of(block) == 4 * kMiB);
    allocator.free(block);
    allocator.mark_iteration();
  }
  REQUIRE(allocator.stats().host_resident_bytes.current == 4 * kMiB);

  allocator.set_memory_cap(kNoCap);
  CHECK_FALSE(allocator.has_pending_migrations());
  for (int step = 0; step < 2; ++step) {
    const DevicePtr block = allocator.allocate(12 * kMiB, 0);
    CHECK(allocator.host_bytes_of(block) == 0);
    allocator.free(block);
    allocator.mark_iteration();
  }
  const AllocatorStats stats = allocator.stats();
  CHECK(stats.host_resident_bytes.current == 0);
  CHECK(stats.device_resident_bytes.current == 12 * kMiB);
  allocator.check_invariants();
}

// Once a step has shown its peak (an iteration mark), a safe point that must
// spill also spills a quarter of what the step still allocates, at most an
// eighth of the cap: the next allocations then find room without a safe
// point (a device synchronize) each. Before any mark it spills what the cap
// needs and no more.
TEST_CASE("a_safe_point_spills_ahead_for_what_the_step_still_allocates_once_a_step_showed_its_peak", "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB));
  auto squeeze_mid_step = [&device](bool step_seen) {
    CachingAllocator allocator(device);
    std::vector<DevicePtr> blocks;
    if (step_seen) {  // a step that peaks at 32 MiB
      for (int i = 0; i < 16; ++i) blocks.push_back(allocator.allocate(2 * kMiB, 0));
      for (DevicePtr block : blocks) allocator.free(block);
      blocks.clear();
      allocator.mark_iteration();
    }
    for (int i = 0; i < 8; ++i) blocks.push_back(allocator.allocate(2 * kMiB, 0));  // 16 MiB into the next
    allocator.set_memory_cap(12 * kMiB);
    allocator.apply_pending_migrations();
    const std::int64_t device_after_squeeze = allocator.stats().device_resident_bytes.current;
    blocks.push_back(allocator.allocate(2 * kMiB, 0));
    const bool next_needs_a_safe_point = allocator.has_pending_migrations();
    allocator.apply_pending_migrations();
    for (DevicePtr block : blocks) allocator.free(block);
    return std::make_pair(device_after_squeeze, next_needs_a_safe_point);
  };
  // 16 MiB still to come: a quarter is 4 MiB, an eighth of the cap 1.5 MiB,
  // so the squeeze goes 1.5 MiB further: a page more than the cap needs.
  CHECK(squeeze_mid_step(true) == std::make_pair(static_cast<std::int64_t>(10 * kMiB), false));
  CHECK(squeeze_mid_step(false) == std::make_pair(static_cast<std::int64_t>(12 * kMiB), true));
}

TEST_CASE("spill_targets_not_needed_any_more_are_given_back", "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB));
  CachingAllocator allocator(device);
  allocator.set_memory_cap(8 * kMiB);
  const DevicePtr cold = allocator.allocate(8 * kMiB, 0);
  for (int i = 0; i < 10; ++i) {
    // Goes over the cap, then is freed before any safe point: its spill is
    // no longer owed, and the held host page is reused, not piled up.
    allocator.free(allocator.allocate(2 * kMiB, 0));
    CHECK(device.host_bytes_in_use() <= 2 * kMiB);
  }
  allocator.empty_cache();
  CHECK(device.host_bytes_in_use() == 0);
  CHECK(allocator.stats().host_resident_bytes.current == 0);
  allocator.free(cold);
}

TEST_CASE("allocation_over_the_cap_releases_cache_before_spilling", "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB));
  CachingAllocator allocator(device);
  const DevicePtr cached = allocator.allocate(4 * kMiB, 7);  // another stream's pool
  allocator.free(cached);
  allocator.set_memory_cap(16 * kMiB);
  CHECK(allocator.stats().device_resident_bytes.current == 4 * kMiB);  // cache under the cap stays
  allocator.allocate(14 * kMiB, 0);  // 6 pages fit; the 7th takes one cached page's place
  const AllocatorStats stats = allocator.stats();
  CHECK(stats.host_resident_bytes.current == 0);
  CHECK(stats.device_resident_bytes.current == 16 * kMiB);  // only as much cache as needed went
  CHECK(device.calls().unmap == 1);
  CHECK(stats.num_alloc_retries == 1);
}

TEST_CASE("shrinking_cap_releases_cache_first_without_moving_live_pages", "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB));
  CachingAllocator allocator(device);
  const DevicePtr live = allocator.allocate(12 * kMiB, 0);
  const DevicePtr dead = allocator.allocate(12 * kMiB, 1);
  allocator.free(dead);
  allocator.set_memory_cap(12 * kMiB);
  CHECK_FALSE(allocator.has_pending_migrations());
  CHECK(allocator.stats().device_resident_bytes.current == 12 * kMiB);
  CHECK(allocator.apply_pending_migrations() == 0);
  CHECK(allocator.is_device_resident(live));
}

TEST_CASE("shrinking_cap_below_live_bytes_spills_coldest_pages", "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB));
  CachingAllocator allocator(device);
  // Three 12 MiB blocks, each in its own segment (own stream), allocated in
  // order: the first is the coldest.
  const DevicePtr cold = allocator.allocate(12 * kMiB, 1);
  const DevicePtr warm = allocator.allocate(12 * kMiB, 2);
  const DevicePtr hot = allocator.allocate(12 * kMiB, 3);
  fill(device, cold, 1, 12 * kMiB);
  fill(device, warm, 2, 12 * kMiB);
  fill(device, hot, 3, 12 * kMiB);

  allocator.set_memory_cap(24 * kMiB);
  CHECK(allocator.has_pending_migrations());
  CHECK(allocator.stats().pending_spill_bytes == 12 * kMiB);
  CHECK(allocator.stats().device_resident_bytes.current == 36 * kMiB);  // nothing moves before the safe point

  CHECK(allocator.apply_pending_migrations() == 12 * kMiB);
  CHECK_FALSE(allocator.has_pending_migrations());
  const AllocatorStats stats = allocator.stats();
  CHECK(stats.device_resident_bytes.current == 24 * kMiB);
  CHECK(stats.host_resident_bytes.current == 12 * kMiB);
  CHECK(stats.spilled_bytes == 12 * kMiB);
  CHECK(stats.num_migrations == 6);
  CHECK(device.device_bytes_in_use() == 24 * kMiB);
  CHECK_FALSE(allocator.is_device_resident(cold));
  CHECK(allocator.is_device_resident(warm));
  CHECK(allocator.is_device_resident(hot));
  // Same addresses, same bytes.
  CHECK(holds(device, cold, 1, 12 * kMiB));
  CHECK(holds(device, warm, 2, 12 * kMiB));
  CHECK(holds(device, hot, 3, 12 * kMiB));
}

TEST_CASE("raising_cap_restores_hottest_host_pages_first", "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB));
  CachingAllocator allocator(device);
  allocator.set_memory_cap(4 * kMiB);
  // Each allocation displaces the coldest live page at the next safe point.
  const DevicePtr older = allocator.allocate(4 * kMiB, 1);
  const DevicePtr newer = allocator.allocate(4 * kMiB, 2);
  allocator.apply_pending_migrations();
  const DevicePtr newest = allocator.allocate(4 * kMiB, 3);
  allocator.apply_pending_migrations();
  fill(device, older, 8, 4 * kMiB);
  fill(device, newer, 9, 4 * kMiB);
  CHECK(allocator.stats().host_resident_bytes.current == 8 * kMiB);
  CHECK(allocator.is_device_resident(newest));

  allocator.set_memory_cap(8 * kMiB);
  CHECK(allocator.stats().pending_restore_bytes == 4 * kMiB);
  CHECK(allocator.apply_pending_migrations() == 4 * kMiB);
  CHECK(allocator.is_device_resident(newer));
  CHECK_FALSE(allocator.is_device_resident(older));
  CHECK(allocator.stats().restored_bytes == 4 * kMiB);
  CHECK(holds(device, newer, 9, 4 * kMiB));
  CHECK(holds(device, older, 8, 4 * kMiB));
  CHECK(allocator.is_device_resident(newest));
}

TEST_CASE("a_host_page_hotter_than_a_device_page_swaps_with_it_at_the_safe_point", "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB));
  CachingAllocator allocator(device);
  allocator.set_memory_cap(4 * kMiB);
  const DevicePtr cold = allocator.allocate(4 * kMiB, 0);
  allocator.spill_all();
  allocator.apply_pending_migrations();
  allocator.restore_all();                 // nothing comes back yet: no safe point
  const DevicePtr other = allocator.allocate(4 * kMiB, 1);  // fills the cap on the device
  allocator.apply_pending_migrations();    // restores nothing: the cap is full
  CHECK_FALSE(allocator.is_device_resident(cold));
  // A free and allocation on the host block's page make it the hottest.
  allocator.free(cold);
  const DevicePtr hot = allocator.allocate(4 * kMiB, 0);
  CHECK(hot == cold);
  CHECK_FALSE(allocator.is_device_resident(hot));
  fill(device, hot, 6, 4 * kMiB);
  fill(device, other, 7, 4 * kMiB);
  allocator.set_memory_cap(4 * kMiB);      // re-plans: the hot host page swaps with the colder device page
  const auto created_before = device.calls().create_page, released_before = device.calls().release_page;
  CHECK(allocator.apply_pending_migrations() == 8 * kMiB);
  CHECK(allocator.is_device_resident(hot));
  CHECK_FALSE(allocator.is_device_resident(other));
  CHECK(holds(device, hot, 6, 4 * kMiB));
  CHECK(holds(device, other, 7, 4 * kMiB));
  CHECK(allocator.stats().device_resident_bytes.current == 4 * kMiB);
  // The two device pages `other` gave up back `hot` on the device: only its
  // two host pages are created, and `hot`'s two old host pages are kept for
  // the next spill, not released.
  CHECK(device.calls().create_page - created_before == 2);
  CHECK(device.calls().release_page - released_before == 0);
  CHECK(allocator.stats().host_pool_bytes.current == 4 * kMiB);
  allocator.check_invariants();
}

// A live block on host pages is read across the bus by every kernel that
// uses it; a free device page holds nothing a kernel reads. So when a free
// leaves enough device pages free while live pages sit on the host, the next
// safe point moves the live pages into the free pages' places and maps the
// host pages where the free ones were: one copy per page, no page created
// or released, the device's bytes unchanged (the cap holds), the layout
// still mapped. A free that leaves too few calls for no safe point.
TEST_CASE("live_host_pages_take_free_device_pages_places_at_the_safe_point_a_large_enough_free_calls_for",
          "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB));
  CachingAllocator allocator(device);
  allocator.set_memory_cap(36 * kMiB);
  const DevicePtr weights = allocator.allocate(16 * kMiB, 0);
  fill(device, weights, 1, 16 * kMiB);
  const DevicePtr early = allocator.allocate(16 * kMiB, 0);
  const DevicePtr small = allocator.allocate(4 * kMiB, 0);  // the cap is full
  const DevicePtr late = allocator.allocate(16 * kMiB, 0);  // in the colder weights' stead
  fill(device, late, 2, 16 * kMiB);
  REQUIRE(allocator.has_pending_migrations());
  allocator.apply_pending_migrations();
  CHECK_FALSE(allocator.is_device_resident(weights));
  CHECK(allocator.stats().host_live_bytes == 16 * kMiB);
  CHECK(allocator.stats().device_resident_bytes.current == 36 * kMiB);

  allocator.free(small);  // 4 MiB free on the device: less than 8 pages' worth, no safe point
  CHECK_FALSE(allocator.has_pending_migrations());
  allocator.free(early);  // 20 MiB free: the weights fit
  REQUIRE(allocator.has_pending_migrations());
  const SimulatedCallCounts before = device.calls();
  const AllocatorStats stats_before = allocator.stats();
  CHECK(allocator.apply_pending_migrations() == 16 * kMiB);
  CHECK(allocator.is_device_resident(weights));
  CHECK(holds(device, weights, 1, 16 * kMiB));
  CHECK(holds(device, late, 2, 16 * kMiB));
  CHECK(device.calls().create_page == before.create_page);
  CHECK(device.calls().release_page == before.release_page);
  const AllocatorStats after = allocator.stats();
  CHECK(after.host_live_bytes == 0);
  CHECK(after.device_resident_bytes.current == 36 * kMiB);
  CHECK(after.host_resident_bytes.current == 16 * kMiB);  // the host pages, free, where `early` was
  CHECK(after.reserved_bytes.all.current == stats_before.reserved_bytes.all.current);
  CHECK(after.restored_bytes - stats_before.restored_bytes == 16 * kMiB);
  CHECK(after.spilled_bytes == stats_before.spilled_bytes);  // a free page's place costs no copy out
  CHECK_FALSE(allocator.has_pending_migrations());

  // The step's next block of that size lands where `early` was, on the host
  // pages now there: nothing is mapped for it.
  const auto created = device.calls().create_page;
  const DevicePtr again = allocator.allocate(16 * kMiB, 0);
  CHECK(again == early);
  CHECK(device.calls().create_page == created);
  CHECK(allocator.host_live_bytes() == 16 * kMiB);
  allocator.check_invariants();
  for (DevicePtr block : {weights, late, again}) allocator.free(block);
  allocator.check_invariants();
}

// Pinning host memory costs more than copying it, so host pages a job gives
// up under a cap stay with it: a job squeezed again pins nothing new.
TEST_CASE("host_pages_given_up_under_a_cap_are_kept_and_the_next_spill_creates_none", "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB));
  CachingAllocator allocator(device);
  allocator.set_memory_cap(64 * kMiB);
  const DevicePtr block = allocator.allocate(8 * kMiB, 0);
  fill(device, block, 3, 8 * kMiB);
  for (int round = 0; round < 3; ++round) {
    CAPTURE(round);
    const auto created = device.calls().create_page, released = device.calls().release_page;
    allocator.spill_all();
    CHECK(allocator.apply_pending_migrations() == 8 * kMiB);
    CHECK(allocator.stats().host_pool_bytes.current == 0);
    allocator.restore_all();
    CHECK(allocator.apply_pending_migrations() == 8 * kMiB);
    CHECK(holds(device, block, 3, 8 * kMiB));
    // Each round: 4 host pages, then 4 device pages, the device pages the
    // spill gave up released; from the second round on the host pages are
    // the ones the restore before kept.
    CHECK(device.calls().create_page - created == (round == 0 ? 8u : 4u));
    CHECK(device.calls().release_page - released == 4u);
    CHECK(allocator.stats().host_pool_bytes.current == 8 * kMiB);
    CHECK(device.host_bytes_in_use() == 8 * kMiB);  // held, pinned: what the figure trades
    allocator.check_invariants();
  }
  // Kept pages are neither reserved nor resident: the job's memory is on the device.
  CHECK(allocator.stats().reserved_bytes.all.current == 8 * kMiB);
  CHECK(allocator.stats().host_resident_bytes.current == 0);

  SECTION("empty_cache gives them back") {
    allocator.empty_cache();
  }
  SECTION("lifting the cap gives them back") {
    allocator.set_memory_cap(kNoCap);
  }
  CHECK(allocator.stats().host_pool_bytes.current == 0);
  CHECK(device.host_bytes_in_use() == 0);
  allocator.check_invariants();
  allocator.free(block);
}

TEST_CASE("an_allocation_over_the_cap_takes_a_kept_host_page_and_a_job_can_opt_out_of_keeping", "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB));
  const bool keep = GENERATE(true, false);
  CAPTURE(keep);
  AllocatorOptions options;
  options.keep_host_pages = keep;
  CachingAllocator allocator(device, options);
  allocator.set_memory_cap(4 * kMiB);
  const DevicePtr first = allocator.allocate(8 * kMiB, 0);  // half on the host: nothing colder
  CHECK(allocator.stats().host_resident_bytes.current == 4 * kMiB);
  allocator.free(first);
  allocator.empty_cache();  // releases the cached pages, and with them any kept page
  CHECK(device.host_bytes_in_use() == 0);
  const DevicePtr second = allocator.allocate(8 * kMiB, 0);
  allocator.free(second);
  // Freed host pages stay cached in their arena: kept, they stay mapped
  // there through a safe point (released, they would only go to the host
  // pool, pinned still); not kept, the safe point releases them.
  allocator.apply_pending_migrations();
  CHECK(allocator.stats().host_resident_bytes.current == (keep ? 4 * kMiB : 0));
  CHECK(allocator.stats().host_live_bytes == 0);
  CHECK(allocator.stats().host_pool_bytes.current == 0);
  CHECK(device.host_bytes_in_use() == (keep ? 4 * kMiB : 0));
  const auto created = device.calls().create_page;
  const DevicePtr third = allocator.allocate(8 * kMiB, 0);
  CHECK(allocator.stats().host_resident_bytes.current == 4 * kMiB);
  CHECK(device.calls().create_page - created == (keep ? 0u : 2u));  // the device pages are cached
  CHECK(allocator.stats().host_pool_bytes.current == 0);
  allocator.check_invariants();
  allocator.free(third);
}

// A host reserve: host pages pinned before any squeeze, so the first one
// pins nothing (as a job squeezed before), kept through the cap's removal and
// empty_cache() until the reserve is lowered or the allocator ends.
TEST_CASE("a_host_reserve_is_pinned_at_once_serves_the_first_squeeze_and_stays_till_it_is_lowered", "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB));
  const bool keep = GENERATE(true, false);
  CAPTURE(keep);
  AllocatorOptions options;
  options.keep_host_pages = keep;
  {
    CachingAllocator allocator(device, options);
    CHECK(allocator.reserve_host_memory(5 * kMiB) == 6 * kMiB);  // whole pages
    CHECK(allocator.host_reserve() == 6 * kMiB);
    CHECK(allocator.stats().host_pool_bytes.current == 6 * kMiB);
    CHECK(device.host_bytes_in_use() == 6 * kMiB);
    CHECK(allocator.stats().reserved_bytes.all.current == 0);  // not the job's memory

    const DevicePtr block = allocator.allocate(8 * kMiB, 0);
    fill(device, block, 4, 8 * kMiB);
    const auto created = device.calls().create_page;
    allocator.set_memory_cap(4 * kMiB);
    CHECK(allocator.apply_pending_migrations() == 4 * kMiB);
    CHECK(device.calls().create_page == created);  // the spill pinned nothing
    CHECK(allocator.stats().host_resident_bytes.current == 4 * kMiB);
    CHECK(allocator.stats().host_pool_bytes.current == 2 * kMiB);
    CHECK(holds(device, block, 4, 8 * kMiB));

    allocator.set_memory_cap(kNoCap);  // nothing left to keep but the reserve
    allocator.apply_pending_migrations();
    CHECK(allocator.stats().host_resident_bytes.current == 0);
    CHECK(allocator.stats().host_pool_bytes.current == 6 * kMiB);
    CHECK(holds(device, block, 4, 8 * kMiB));
    SECTION("empty_cache keeps it") {
      allocator.empty_cache();
    }
    SECTION("a discard keeps it") {
      allocator.discard_pages();
      allocator.back_discarded_pages();
    }
    CHECK(allocator.stats().host_pool_bytes.current == 6 * kMiB);
    CHECK(device.host_bytes_in_use() == 6 * kMiB);
    allocator.check_invariants();

    CHECK(allocator.reserve_host_memory(0) == 0);
    CHECK(allocator.stats().host_pool_bytes.current == 0);
    CHECK(device.host_bytes_in_use() == 0);
    CHECK(allocator.reserve_host_memory(2 * kMiB) == 2 * kMiB);
    allocator.free(block);
    allocator.check_invariants();
  }
  CHECK(device.host_bytes_in_use() == 0);  // the allocator's end gives the reserve back
}

TEST_CASE("a_host_reserve_the_host_cannot_pin_is_refused_and_the_reserve_stays_as_it_was", "[cap]") {
  SimulatedDeviceConfig config = device_config(1 * kGiB);
  config.host_capacity = 5 * kMiB;
  SimulatedBackend device(config);
  CachingAllocator allocator(device);
  REQUIRE(allocator.reserve_host_memory(2 * kMiB) == 2 * kMiB);
  CHECK_THROWS_WITH(allocator.reserve_host_memory(8 * kMiB),
                    Catch::Contains("cannot reserve 8") && Catch::Contains("ulimit -l") &&
                        Catch::Contains("Reserve less"));
  CHECK(allocator.host_reserve() == 2 * kMiB);
  CHECK(allocator.stats().host_pool_bytes.current == 2 * kMiB);
  CHECK(device.host_bytes_in_use() == 2 * kMiB);
  allocator.check_invariants();
}

// The host pins a reserve without the allocator's lock: a thread that moves
// the reserve up and down while another allocates, frees and spills under a
// cap leaves the books whole, every byte in place, and nothing pinned once
// the reserve is 0 and the cap gone (the sanitizer builds check the races).
TEST_CASE("a_host_reserve_pinned_while_another_thread_allocates_and_spills_keeps_the_books", "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB));
  CachingAllocator allocator(device);
  allocator.set_memory_cap(8 * kMiB);
  std::atomic<bool> done{false};
  std::thread reserving([&] {
    for (int round = 0; !done.load(); ++round) allocator.reserve_host_memory(round % 2 == 0 ? 16 * kMiB : 0);
  });
  std::vector<DevicePtr> live;
  for (int i = 0; i < 200; ++i) {
    live.push_back(allocator.allocate(static_cast<std::size_t>(1 + i % 3) * kMiB, 0));
    fill(device, live.back(), static_cast<std::uint8_t>(i), kMiB);
    if (live.size() > 6) {
      CHECK(holds(device, live.front(), static_cast<std::uint8_t>(i - 6), kMiB));
      allocator.free(live.front());
      live.erase(live.begin());
    }
    allocator.apply_pending_migrations();
  }
  done = true;
  reserving.join();
  allocator.check_invariants();
  for (DevicePtr address : live) allocator.free(address);
  allocator.reserve_host_memory(0);
  allocator.set_memory_cap(kNoCap);
  allocator.apply_pending_migrations();  // the host cache goes at a safe point
  allocator.check_invariants();
  CHECK(allocator.stats().host_pool_bytes.current == 0);
  CHECK(allocator.stats().host_resident_bytes.current == 0);
}

TEST_CASE("a_host_reserve_in_pinned_fallback_mode_is_refused_with_the_reason", "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB, true, /*host_mappable=*/false));
  CachingAllocator allocator(device);
  CHECK_THROWS_WITH(allocator.reserve_host_memory(2 * kMiB), Catch::Contains("pinned fallback"));
  CHECK(allocator.host_reserve() == 0);
  CHECK(device.host_bytes_in_use() == 0);
}

// Pinned host memory cannot be swapped or reclaimed: with a headroom the
// pool pins nothing that would leave the host less than it. A squeeze then
// stops part way (its pages stay on the device, pending), an allocation over
// the cap fails naming the headroom, and a lower headroom lets the next safe
// point finish.
TEST_CASE("a_squeeze_stops_at_the_hosts_headroom_and_an_allocation_past_it_fails_naming_it", "[cap]") {
  SimulatedDeviceConfig config = device_config(1 * kGiB);
  config.host_capacity = 10 * kMiB;
  SimulatedBackend device(config);
  auto host_pages = std::make_shared<HostPagePool>(device);
  host_pages->set_headroom(6 * kMiB);  // room for two pages
  CachingAllocator allocator(device, {}, host_pages);
  const DevicePtr a = allocator.allocate(8 * kMiB, 0);
  fill(device, a, 3, 8 * kMiB);
  allocator.set_memory_cap(2 * kMiB);
  CHECK(allocator.apply_pending_migrations() == 4 * kMiB);  // two pages out, then the headroom
  CHECK(allocator.has_pending_migrations());
  CHECK(device.host_bytes_in_use() == 4 * kMiB);
  CHECK(allocator.stats().num_host_headroom_refusals >= 1);
  CHECK(holds(device, a, 3, 8 * kMiB));
  CHECK_THROWS_WITH(allocator.allocate(2 * kMiB, 0),
                    Catch::Contains("at its headroom (6.00 MiB available, 6.00 MiB kept available") &&
                        Catch::Contains("COTENANT_HOST_HEADROOM"));
  CHECK_THROWS_WITH(allocator.reserve_host_memory(8 * kMiB), Catch::Contains("at its headroom"));
  CHECK(allocator.host_reserve() == 0);
  host_pages->set_headroom(0);
  CHECK(allocator.apply_pending_migrations() == 2 * kMiB);
  CHECK_FALSE(allocator.has_pending_migrations());
  CHECK(holds(device, a, 3, 8 * kMiB));
  allocator.reset_accumulated_stats();
  CHECK(allocator.stats().num_host_headroom_refusals == 0);
  allocator.free(a);
  allocator.check_invariants();
}

TEST_CASE("pinned_fallback_memory_stops_at_the_hosts_headroom_too", "[cap]") {
  SimulatedDeviceConfig config = device_config(1 * kGiB, true, /*host_mappable=*/false);
  config.host_capacity = 10 * kMiB;
  SimulatedBackend device(config);
  auto host_pages = std::make_shared<HostPagePool>(device);
  host_pages->set_headroom(6 * kMiB);
  CachingAllocator allocator(device, {}, host_pages);
  allocator.set_memory_cap(2 * kMiB);
  const DevicePtr on_device = allocator.allocate(2 * kMiB, 0);
  const DevicePtr pinned = allocator.allocate(4 * kMiB, 0);  // leaves exactly the headroom
  CHECK(allocator.stats().pinned_fallback_bytes.current == 4 * kMiB);
  CHECK_THROWS_WITH(allocator.allocate(kMiB, 0), Catch::Contains("at its headroom"));
  CHECK(allocator.stats().pinned_fallback_bytes.current == 4 * kMiB);
  allocator.free(pinned);
  allocator.free(on_device);
  allocator.check_invariants();
}

TEST_CASE("mem_available_is_read_from_meminfo_in_bytes_and_is_unknown_where_it_cannot_be", "[cap]") {
  const std::string path = "/tmp/cotenant_meminfo_test_" + std::to_string(::getpid());
  {
    std::ofstream out(path);
    out << "MemTotal:       16384 kB\nMemFree:         1024 kB\nMemAvailable:    8192 kB\n";
  }
  CHECK(read_mem_available(path.c_str()) == std::optional<std::size_t>(8 * kMiB));
  {
    std::ofstream out(path);
    out << "MemTotal:       16384 kB\n";  // a kernel without MemAvailable
  }
  CHECK_FALSE(read_mem_available(path.c_str()).has_value());
  std::remove(path.c_str());
  CHECK_FALSE(read_mem_available(path.c_str()).has_value());
  const std::optional<std::size_t> real = read_mem_available();
  CHECK((!real || *real > 0));
}

TEST_CASE("spill_all_moves_every_live_page_to_host_and_restore_all_brings_them_back", "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB));
  CachingAllocator allocator(device);
  const DevicePtr a = allocator.allocate(6 * kMiB, 0);
  const DevicePtr b = allocator.allocate(100, 0);
  fill(device, a, 1, 6 * kMiB);
  fill(device, b, 2, 100);
  allocator.spill_all();
  allocator.apply_pending_migrations();
  CHECK(allocator.stats().device_resident_bytes.current == 0);
  CHECK(device.device_bytes_in_use() == 0);
  // The cap is one value: spill_all() is a state beside it, not a cap of 0.
  CHECK(allocator.stats().memory_cap == kNoCap);
  CHECK(allocator.memory_cap() == kNoCap);
  CHECK(allocator.stats().spilled_all);
  CHECK(allocator.stats().as_map().at("spilled_all") == 1);
  // New memory while spilled goes to the host too.
  const DevicePtr c = allocator.allocate(4096, 0);
  CHECK_FALSE(allocator.is_device_resident(c));
  allocator.restore_all();
  allocator.apply_pending_migrations();
  CHECK(allocator.stats().host_resident_bytes.current == 0);
  CHECK(holds(device, a, 1, 6 * kMiB));
  CHECK(holds(device, b, 2, 100));
  CHECK(allocator.is_device_resident(c));
}

TEST_CASE("zero_cap_is_refused_and_changes_nothing", "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB));
  CachingAllocator allocator(device);
  allocator.set_memory_cap(64 * kMiB);
  try {
    allocator.set_memory_cap(0);
    FAIL("cap 0 accepted");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("spill_all") != std::string::npos);
  }
  CHECK(allocator.memory_cap() == 64 * kMiB);
}

TEST_CASE("hard_cap_without_spilling_raises_out_of_memory", "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB));
  AllocatorOptions options;
  options.spill_to_host = false;
  CachingAllocator allocator(device, options);
  allocator.set_memory_cap(4 * kMiB);
  const DevicePtr fits = allocator.allocate(4 * kMiB, 0);
  CHECK_THROWS_AS(allocator.allocate(4 * kMiB, 0), OutOfMemoryError);
  CHECK(allocator.allocation_size(fits) == 4 * kMiB);
  CHECK(allocator.stats().host_resident_bytes.current == 0);
}

TEST_CASE("device_full_from_other_processes_spills_under_a_cap", "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB));
  CachingAllocator allocator(device);
  allocator.set_memory_cap(512 * kMiB);
  device.fail_next_device_pages(1);
  const DevicePtr block = allocator.allocate(2 * kMiB, 0);
  CHECK_FALSE(allocator.is_device_resident(block));
  CHECK(allocator.stats().host_resident_bytes.current == 2 * kMiB);
}

TEST_CASE("without_a_cap_a_full_device_raises_out_of_memory_as_pytorch_does", "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB));
  CachingAllocator allocator(device);
  device.fail_next_device_pages(1);
  try {
    allocator.allocate(2 * kMiB, 0);
    FAIL("a full device with no cap spilled to the host");
  } catch (const OutOfMemoryError& e) {
    const std::string message = e.what();
    CHECK(message.rfind("CUDA out of memory. Tried to allocate 2.00 MiB.", 0) == 0);
    CHECK(message.find("set_memory_cap") != std::string::npos);
  }
  CHECK(allocator.stats().host_resident_bytes.current == 0);
  CHECK(allocator.stats().num_ooms == 1);
  CHECK(device.host_bytes_in_use() == 0);
}

TEST_CASE("spill_without_cap_opts_into_spilling_when_the_device_is_full", "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB));
  AllocatorOptions options;
  options.spill_without_cap = true;
  CachingAllocator allocator(device, options);
  device.fail_next_device_pages(1);
  const DevicePtr block = allocator.allocate(2 * kMiB, 0);
  CHECK_FALSE(allocator.is_device_resident(block));
}

TEST_CASE("pinned_fallback_mode_without_a_cap_raises_out_of_memory_instead_of_pinning", "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB, true, /*host_mappable=*/false));
  CachingAllocator allocator(device);
  device.fail_next_device_pages(1);
  CHECK_THROWS_AS(allocator.allocate(2 * kMiB, 0), OutOfMemoryError);
  CHECK(allocator.stats().pinned_fallback_bytes.current == 0);
}

TEST_CASE("pinned_fallback_mode_serves_over_cap_allocations_from_pinned_host_memory", "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB, true, /*host_mappable=*/false));
  CachingAllocator allocator(device);
  CHECK(allocator.mode() == SpillMode::kPinnedFallback);
  allocator.set_memory_cap(4 * kMiB);
  const DevicePtr on_device = allocator.allocate(4 * kMiB, 0);
  const DevicePtr pinned = allocator.allocate(3 * kMiB, 0);
  fill(device, pinned, 4, 3 * kMiB);
  CHECK(holds(device, pinned, 4, 3 * kMiB));
  AllocatorStats stats = allocator.stats();
  CHECK(stats.mode == SpillMode::kPinnedFallback);
  CHECK(stats.pinned_fallback_bytes.current == 4 * kMiB);  // rounded up to a page
  CHECK(stats.device_resident_bytes.current == 4 * kMiB);
  // Live pages cannot move in this mode: lowering the cap marks nothing.
  allocator.set_memory_cap(2 * kMiB);
  CHECK_FALSE(allocator.has_pending_migrations());
  CHECK(allocator.apply_pending_migrations() == 0);
  // Freed pinned memory is kept for the next over-cap allocation, and goes
  // back at empty_cache().
  allocator.free(pinned);
  CHECK(allocator.stats().pinned_fallback_bytes.current == 4 * kMiB);
  CHECK(allocator.stats().allocated_bytes.all.current == 4 * kMiB);
  allocator.empty_cache();
  CHECK(allocator.stats().pinned_fallback_bytes.current == 0);
  CHECK(allocator.stats().reserved_bytes.all.current == 4 * kMiB);
  CHECK(device.host_bytes_in_use() == 0);
  CHECK(device.calls().free_pinned_host == 1);
  allocator.free(on_device);
}

TEST_CASE("empty_cache_waits_for_the_device_once_for_cached_pages_and_pinned_blocks", "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB, true, /*host_mappable=*/false));
  CachingAllocator allocator(device);
  allocator.set_memory_cap(4 * kMiB);
  const DevicePtr on_device = allocator.allocate(4 * kMiB, 0);
  const DevicePtr pinned = allocator.allocate(3 * kMiB, 0);
  CHECK_FALSE(allocator.is_device_resident(pinned));
  allocator.free(pinned);
  allocator.free(on_device);
  REQUIRE(allocator.stats().pinned_fallback_bytes.current == 4 * kMiB);
  REQUIRE(allocator.stats().device_resident_bytes.current == 4 * kMiB);  // cached pages
  const auto waits_before = device.calls().synchronize_device;
  allocator.empty_cache();
  CHECK(device.calls().synchronize_device == waits_before + 1);
  CHECK(allocator.stats().reserved_bytes.all.current == 0);
  CHECK(device.calls().free_pinned_host == 1);
  CHECK(device.device_bytes_in_use() == 0);
  CHECK(device.host_bytes_in_use() == 0);
  // Nothing cached: no wait at all.
  allocator.empty_cache();
  CHECK(device.calls().synchronize_device == waits_before + 1);
}

TEST_CASE("pinned_fallback_mode_pins_once_for_a_loop_of_over_cap_allocations", "[cap]") {
  // Pinning and unpinning host memory costs milliseconds: a training loop
  // whose activations go over the cap every step must not pay it every step.
  SimulatedBackend device(device_config(1 * kGiB, true, /*host_mappable=*/false));
  CachingAllocator allocator(device);
  allocator.set_memory_cap(4 * kMiB);
  const DevicePtr on_device = allocator.allocate(4 * kMiB, 0);
  for (int step = 0; step < 20; ++step) {
    const DevicePtr a = allocator.allocate(3 * kMiB, 0);
    const DevicePtr b = allocator.allocate(5 * kMiB + step * 4096, 0);
    CHECK_FALSE(allocator.is_device_resident(a));
    fill(device, b, 7, 5 * kMiB);
    CHECK(holds(device, b, 7, 5 * kMiB));
    allocator.free(b);
    allocator.free(a);
  }
  CHECK(device.calls().allocate_pinned_host == 2);
  CHECK(device.calls().free_pinned_host == 0);
  CHECK(allocator.stats().num_spilled_allocations == 40);
  // Another stream does not take this stream's pinned blocks (no events
  // order their work); a block more than twice the request is not reused.
  allocator.free(allocator.allocate(1 * kMiB, 3));
  allocator.free(allocator.allocate(1 * kMiB, 0));
  CHECK(device.calls().allocate_pinned_host == 4);
  allocator.free(on_device);
}

TEST_CASE("a_partial_move_stays_pending_and_the_next_safe_point_finishes_it", "[cap]") {
  SimulatedDeviceConfig config = device_config(1 * kGiB);
  config.host_capacity = 2 * kMiB;  // room for one page on the host
  SimulatedBackend device(config);
  CachingAllocator allocator(device);
  const DevicePtr a = allocator.allocate(4 * kMiB, 0);
  const DevicePtr b = allocator.allocate(4 * kMiB, 0);
  fill(device, a, 1, 4 * kMiB);
  fill(device, b, 2, 4 * kMiB);
  allocator.set_memory_cap(2 * kMiB);
  CHECK(allocator.apply_pending_migrations() == 2 * kMiB);  // one page out, then the host is full
  CHECK(allocator.has_pending_migrations());
  CHECK(allocator.stats().pending_spill_bytes == 4 * kMiB);
  CHECK(allocator.apply_pending_migrations() == 0);  // still no host page: still pending
  CHECK(allocator.has_pending_migrations());
  allocator.free(a);  // its host page becomes cache, released at the next safe point
  CHECK(allocator.apply_pending_migrations() == 2 * kMiB);
  CHECK_FALSE(allocator.has_pending_migrations());
  CHECK(allocator.stats().device_resident_bytes.current == 2 * kMiB);
  CHECK(holds(device, b, 2, 4 * kMiB));
  allocator.check_invariants();
}

// One host pool shared by a device's allocators: pages one gives up serve
// another, an allocator that keeps host pages (under a cap) keeps them
// whatever the others do, the pages beyond the reserve go back only when the
// last keeper stops, and an allocator's end leaves the shared pool as it is.
TEST_CASE("allocators_sharing_a_host_pool_reuse_each_others_pages_and_keep_them_while_one_keeps", "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB));
  auto host_pages = std::make_shared<HostPagePool>(device);
  CachingAllocator capped(device, {}, host_pages);
  auto other = std::make_unique<CachingAllocator>(device, AllocatorOptions{}, host_pages);
  CHECK(capped.reserve_host_memory(2 * kMiB) == 2 * kMiB);
  CHECK(other->host_reserve() == 2 * kMiB);  // one reserve per pool

  // `capped` spills 3 pages under its cap: 1 from the reserve, 2 pinned.
  const DevicePtr a = capped.allocate(6 * kMiB, 0);
  fill(device, a, 7, 6 * kMiB);
  capped.set_memory_cap(2 * kMiB);
  CHECK(capped.apply_pending_migrations() == 4 * kMiB);
  CHECK(host_pages->kept().current == 0);

  // `other` (no cap: keeps nothing itself) pauses everything: 2 host pages pinned.
  const DevicePtr b = other->allocate(4 * kMiB, 0);
  fill(device, b, 9, 4 * kMiB);
  const auto pinned = device.calls().create_page;
  other->spill_all();
  CHECK(other->apply_pending_migrations() == 4 * kMiB);
  CHECK(device.calls().create_page - pinned == 2u);
  other->restore_all();
  CHECK(other->apply_pending_migrations() == 4 * kMiB);
  CHECK(holds(device, b, 9, 4 * kMiB));
  // Its restore gave 2 pages to the pool, which keeps them: `capped` keeps.
  CHECK(host_pages->kept().current == 4 * kMiB);

  // They serve `capped`'s next squeeze without pinning.
  const auto before = device.calls().create_page;
  capped.set_memory_cap(kMiB * 1);  // under a page: the last device page goes too
  CHECK(capped.apply_pending_migrations() == 2 * kMiB);
  CHECK(device.calls().create_page == before);
  CHECK(holds(device, a, 7, 6 * kMiB));
  CHECK(host_pages->kept().current == 2 * kMiB);

  // The cap lifted: the pages come back and the pool keeps only the reserve.
  capped.set_memory_cap(kNoCap);
  CHECK(capped.apply_pending_migrations() == 6 * kMiB);
  CHECK(host_pages->kept().current == 2 * kMiB);
  CHECK(device.host_bytes_in_use() == 2 * kMiB);

  other->free(b);
  other.reset();  // the shared pool stays
  CHECK(host_pages->kept().current == 2 * kMiB);
  CHECK(capped.host_reserve() == 2 * kMiB);
  CHECK(holds(device, a, 7, 6 * kMiB));
  capped.check_invariants();
  capped.free(a);
}

TEST_CASE("an_allocator_refuses_a_host_pool_of_another_device", "[cap]") {
  SimulatedBackend device(device_config(1 * kGiB));
  SimulatedBackend elsewhere(device_config(1 * kGiB));
  auto host_pages = std::make_shared<HostPagePool>(elsewhere);
  CHECK_THROWS_WITH(CachingAllocator(device, {}, host_pages), Catch::Contains("one pool per device"));
}

namespace {

// A cgroup filesystem in a temporary directory: write(path, text) makes the
// file and its directories.
struct FakeCgroupFs {
  std::filesystem::path root =
      std::filesystem::temp_directory_path() / ("cotenant_cgroup_test_" + std::to_string(::getpid()));
  FakeCgroupFs() { std::filesystem::remove_all(root); }
  ~FakeCgroupFs() { std::filesystem::remove_all(root); }
  void write(const std::string& relative, const std::string& text) const {
    const std::filesystem::path file = root / relative;
    std::filesystem::create_directories(file.parent_path());
    std::ofstream(file) << text;
  }
  std::optional<std::size_t> room() const {
    return read_cgroup_memory_room((root / "self_cgroup").string(), (root / "fs").string());
  }
};

}  // namespace

TEST_CASE("cgroup_v2_room_is_the_least_over_the_cgroup_and_its_ancestors_of_limit_less_working_set", "[cap]") {
  FakeCgroupFs fs;
  fs.write("self_cgroup", "0::/kubepods/pod1/job\n");
  // The job's cgroup: no limit of its own ("max"); its pod: 1 GiB, 724 MiB used of which 100 MiB is
  // inactive page cache (the kernel drops it before it kills): 400 MiB of room.
  fs.write("fs/kubepods/pod1/job/memory.max", "max\n");
  fs.write("fs/kubepods/pod1/job/memory.current", "629145600\n");
  fs.write("fs/kubepods/pod1/memory.max", "1073741824\n");
  fs.write("fs/kubepods/pod1/memory.current", std::to_string(724 * kMiB) + "\n");
  fs.write("fs/kubepods/pod1/memory.stat", "anon 629145600\nactive_file 0\ninactive_file 104857600\n");
  fs.write("fs/kubepods/memory.max", "8589934592\n");
  fs.write("fs/kubepods/memory.current", "1073741824\n");
  CHECK(fs.room() == std::optional<std::size_t>(400 * kMiB));

  // An ancestor nearer its own limit binds instead: 8 GiB with 7.9 GiB used.
  fs.write("fs/kubepods/memory.current", std::to_string(8 * kGiB - 100 * kMiB) + "\n");
  CHECK(fs.room() == std::optional<std::size_t>(100 * kMiB));

  // Past the limit (usage above it while the kernel reclaims): no room, not a wrapped-around number.
  fs.write("fs/kubepods/pod1/memory.current", std::to_string(2 * kGiB) + "\n");
  CHECK(fs.room() == std::optional<std::size_t>(0));
}

TEST_CASE("cgroup_room_is_unknown_without_a_limit_and_reads_the_mount_root_in_a_cgroup_namespace", "[cap]") {
  FakeCgroupFs fs;
  CHECK_FALSE(fs.room().has_value());  // no /proc/self/cgroup at all
  fs.write("self_cgroup", "0::/user.slice/session.scope\n");
  fs.write("fs/user.slice/session.scope/memory.max", "max\n");
  fs.write("fs/user.slice/session.scope/memory.current", "4096\n");
  CHECK_FALSE(fs.room().has_value());  // nothing on the way has a limit

  // In a container's cgroup namespace /proc/self/cgroup says "0::/" (or a path the mount does not show):
  // the mount's root is the container's cgroup, and its limit holds.
  fs.write("self_cgroup", "0::/\n");
  fs.write("fs/memory.max", std::to_string(2 * kGiB) + "\n");
  fs.write("fs/memory.current", std::to_string(kGiB) + "\n");
  CHECK(fs.room() == std::optional<std::size_t>(kGiB));
  fs.write("self_cgroup", "0::/../../elsewhere\n");
  CHECK(fs.room() == std::optional<std::size_t>(kGiB));
  fs.write("self_cgroup", "0::/not/mounted/here\n");
  CHECK(fs.room() == std::optional<std::size_t>(kGiB));
}

TEST_CASE("cgroup_v1_room_reads_the_memory_controller_and_wins_on_a_hybrid_system", "[cap]") {
  FakeCgroupFs fs;
  fs.write("self_cgroup", "12:cpu,cpuacct:/docker/abc\n5:memory:/docker/abc\n0::/docker/abc\n");
  fs.write("fs/memory/docker/abc/memory.limit_in_bytes", std::to_string(512 * kMiB) + "\n");
  fs.write("fs/memory/docker/abc/memory.usage_in_bytes", std::to_string(300 * kMiB) + "\n");
  fs.write("fs/memory/docker/abc/memory.stat",
           "inactive_file 1048576\ntotal_inactive_file " + std::to_string(88 * kMiB) + "\n");
  fs.write("fs/memory/memory.limit_in_bytes", "9223372036854771712\n");  // v1's "no limit"
  fs.write("fs/memory/memory.usage_in_bytes", std::to_string(kGiB) + "\n");
  fs.write("fs/docker/abc/memory.max", "1\n");  // the v2 tree of a hybrid system has no memory controller
  CHECK(fs.room() == std::optional<std::size_t>(300 * kMiB));
}

TEST_CASE("cgroup_rooms_name_every_limited_cgroup_on_the_way_up_so_sibling_processes_can_share_one", "[cap]") {
  // A Slurm job step: each rank in a task cgroup of its own, no limit there; the step and the job have one.
  FakeCgroupFs fs;
  fs.write("task0_cgroup", "0::/slurm/uid_1000/job_7/step_0/task_0\n");
  fs.write("task1_cgroup", "0::/slurm/uid_1000/job_7/step_0/task_1\n");
  for (const char* task : {"task_0", "task_1"}) {
    fs.write(std::string("fs/slurm/uid_1000/job_7/step_0/") + task + "/memory.max", "max\n");
    fs.write(std::string("fs/slurm/uid_1000/job_7/step_0/") + task + "/memory.current", "4096\n");
  }
  fs.write("fs/slurm/uid_1000/job_7/step_0/memory.max", std::to_string(4 * kGiB) + "\n");
  fs.write("fs/slurm/uid_1000/job_7/step_0/memory.current", std::to_string(kGiB) + "\n");
  fs.write("fs/slurm/uid_1000/job_7/memory.max", std::to_string(6 * kGiB) + "\n");
  fs.write("fs/slurm/uid_1000/job_7/memory.current", std::to_string(kGiB) + "\n");
  fs.write("fs/memory.max", "max\n");
  const std::string top = (fs.root / "fs").string();
  const std::vector<CgroupRoom> task0 =
      read_cgroup_memory_rooms((fs.root / "task0_cgroup").string(), top, CgroupOf::another_process);
  REQUIRE(task0.size() == 2);  // own first; the task's and the root's "max" are no limit
  CHECK(task0[0].path == "/slurm/uid_1000/job_7/step_0");
  CHECK(task0[0].room_bytes == 3 * kGiB);
  CHECK(task0[1].path == "/slurm/uid_1000/job_7");
  CHECK(task0[1].room_bytes == 5 * kGiB);
  const std::vector<CgroupRoom> task1 =
      read_cgroup_memory_rooms((fs.root / "task1_cgroup").string(), top, CgroupOf::another_process);
  REQUIRE(task1.size() == 2);
  CHECK(task1[0].path == task0[0].path);  // the two ranks name one step cgroup: one room between them
  CHECK(task1[1].path == task0[1].path);

  // A limit at the mount's root is named "/".
  fs.write("fs/memory.max", std::to_string(64 * kGiB) + "\n");
  fs.write("fs/memory.current", std::to_string(8 * kGiB) + "\n");
  const std::vector<CgroupRoom> with_root =
      read_cgroup_memory_rooms((fs.root / "task0_cgroup").string(), top, CgroupOf::another_process);
  REQUIRE(with_root.size() == 3);
  CHECK(with_root[2].path == "/");
  CHECK(with_root[2].room_bytes == 56 * kGiB);

  // Another process's cgroup the mount does not show (another cgroup namespace) is unknown, not the root's:
  // only this process's own is read as the mount's root.
  fs.write("other_cgroup", "0::/../../kubepods/pod9/ctr\n");
  CHECK(read_cgroup_memory_rooms((fs.root / "other_cgroup").string(), top, CgroupOf::another_process).empty());
  const std::vector<CgroupRoom> own =
      read_cgroup_memory_rooms((fs.root / "other_cgroup").string(), top, CgroupOf::this_process);
  REQUIRE(own.size() == 1);
  CHECK(own[0].path == "/");
  CHECK(read_cgroup_memory_rooms((fs.root / "missing").string(), top, CgroupOf::another_process).empty());
}

TEST_CASE("host_available_is_the_least_of_mem_available_and_the_cgroup_room", "[cap]") {
  const std::optional<std::size_t> available = read_host_available();
  const std::optional<std::size_t> node = read_mem_available();
  const std::optional<std::size_t> cgroup = read_cgroup_memory_room();
  REQUIRE((node || cgroup));  // Linux: at least MemAvailable
  // The figures move between the reads, so compare within what a test's neighbours could take meanwhile.
  const std::size_t expected = node && cgroup ? std::min(*node, *cgroup) : node ? *node : *cgroup;
  REQUIRE(available.has_value());
  const std::size_t drift = 256 * kMiB;
  CHECK(*available + drift >= expected);
  CHECK(*available <= expected + drift);

  SimulatedDeviceConfig config = device_config(1 * kGiB);
  config.host_capacity = 10 * kMiB;
  SimulatedBackend device(config);
  HostPagePool pool(device);
  CHECK(pool.room() == std::optional<std::size_t>(10 * kMiB));
  pool.set_headroom(6 * kMiB);
  CHECK(pool.room() == std::optional<std::size_t>(4 * kMiB));
  pool.set_headroom(12 * kMiB);
  CHECK(pool.room() == std::optional<std::size_t>(0));
}
