// Regions paused and resumed by name (region_table.h), on the simulated
// device: what a paused region gives back, what it keeps, and that nothing
// of another block moves.

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <thread>

#include "cotenant/all_or_none.h"
#include "cotenant/errors.h"
#include "cotenant/region_table.h"
#include "test_helpers.h"

using namespace cotenant;
using namespace cotenant::testing;

namespace {

constexpr StreamId kStream = 0;

// Opens a region for the calling thread for the scope's lifetime.
struct InRegion {
  explicit InRegion(std::string name) : name(std::move(name)) { RegionScope::enter(this->name); }
  ~InRegion() { RegionScope::exit(name); }
  std::string name;
};

SimulatedDeviceConfig garbage_device() {
  SimulatedDeviceConfig config = device_config(1 * kGiB);
  config.fresh_pages_hold_garbage = true;  // a resumed page must be zeroed on purpose
  return config;
}

bool all_zero(SimulatedBackend& device, DevicePtr address, std::size_t bytes) {
  std::vector<std::uint8_t> got(bytes);
  device.read(address, got.data(), bytes);
  return std::all_of(got.begin(), got.end(), [](std::uint8_t b) { return b == 0; });
}

DevicePtr allocate_in(RegionTable& table, const std::string& name, std::size_t bytes,
                      CachingAllocator** allocator = nullptr) {
  InRegion in(name);
  CachingAllocator* owner = nullptr;
  const DevicePtr address = table.allocate(bytes, kStream, &owner);
  if (allocator) *allocator = owner;
  return address;
}

// A kept pause of "kv_cache" (8 MiB holding 6s at `cache`) that the host cannot
// take: it raises OutOfMemoryError and the region stays on the device, its
// bytes as they were.
void check_kept_pause_refused_leaves_it_on_the_device(RegionTable& table, SimulatedBackend& device,
                                                      CachingAllocator& region, DevicePtr cache) {
  CHECK_THROWS_AS(table.pause("kv_cache", true), OutOfMemoryError);
  CHECK(table.state("kv_cache") == RegionState::kActive);
  CHECK(region.stats().host_resident_bytes.current == 0);
  CHECK(holds(device, cache, 6, 8 * kMiB));
}

}  // namespace

TEST_CASE("pausing_a_region_with_keep_moves_its_pages_to_the_host_and_resume_brings_its_bytes_back") {
  SimulatedBackend device(device_config(1 * kGiB));
  CachingAllocator main(device);
  RegionTable table(device);
  const DevicePtr other = main.allocate(3 * kMiB, kStream);
  fill(device, other, 1, 3 * kMiB);
  CachingAllocator* kv = nullptr;
  const DevicePtr cache = allocate_in(table, "kv_cache", 9 * kMiB, &kv);
  fill(device, cache, 2, 9 * kMiB);
  const std::size_t device_before = device.device_bytes_in_use();

  CHECK(table.pause("kv_cache", /*keep=*/true) == 10 * kMiB);  // 5 pages of 2 MiB
  CHECK(table.state("kv_cache") == RegionState::kPausedKept);
  CHECK(device.device_bytes_in_use() == device_before - 10 * kMiB);
  CHECK_FALSE(kv->is_device_resident(cache));
  CHECK(holds(device, cache, 2, 9 * kMiB));  // same address, read over the host mapping
  CHECK(main.is_device_resident(other));
  CHECK(holds(device, other, 1, 3 * kMiB));

  CHECK(table.resume("kv_cache") == 10 * kMiB);
  CHECK(table.state("kv_cache") == RegionState::kActive);
  CHECK(kv->is_device_resident(cache));
  CHECK(device.device_bytes_in_use() == device_before);
  CHECK(holds(device, cache, 2, 9 * kMiB));
  kv->check_invariants();
  main.check_invariants();
}

TEST_CASE("pausing_a_region_without_keep_releases_its_pages_and_resume_backs_the_same_addresses_with_zeros") {
  SimulatedBackend device(garbage_device());
  CachingAllocator main(device);
  RegionTable table(device);
  const DevicePtr other = main.allocate(1 * kMiB, kStream);
  fill(device, other, 3, kMiB);
  CachingAllocator* kv = nullptr;
  const DevicePtr a = allocate_in(table, "kv_cache", 5 * kMiB, &kv);
  const DevicePtr b = allocate_in(table, "kv_cache", 2 * kMiB);
  fill(device, a, 4, 5 * kMiB);
  fill(device, b, 5, 2 * kMiB);
  const std::size_t device_before = device.device_bytes_in_use();
  const auto reserves_before = device.calls().reserve;

  CHECK(table.pause("kv_cache", /*keep=*/false) > 0);
  CHECK(table.state("kv_cache") == RegionState::kPausedDiscarded);
  CHECK(device.device_bytes_in_use() == device_before - 8 * kMiB);
  CHECK(device.host_bytes_in_use() == 0);  // discarded, not moved
  CHECK_THROWS_AS(device.residency_at(a), Error);  // unmapped: a kernel touching it would fault
  CHECK(kv->allocation_size(a) == 5 * kMiB);  // the blocks and their addresses stay
  kv->check_invariants();

  table.resume("kv_cache");
  CHECK(device.calls().reserve == reserves_before);  // backed again, not reserved anew
  CHECK(all_zero(device, a, 5 * kMiB));
  CHECK(all_zero(device, b, 2 * kMiB));
  CHECK(holds(device, other, 3, kMiB));
  kv->check_invariants();
  kv->free(a);
  kv->free(b);
}

TEST_CASE("a_region_never_shares_a_page_with_other_blocks") {
  SimulatedBackend device(device_config(1 * kGiB));
  CachingAllocator main(device);
  RegionTable table(device);
  const DevicePtr small_main = main.allocate(4096, kStream);
  const DevicePtr small_region = allocate_in(table, "weights", 4096);
  const std::size_t page = device.granularity();
  CHECK(small_main / page != small_region / page);
  const DevicePtr in_a = allocate_in(table, "a", 4096);
  CHECK(in_a / page != small_region / page);  // two regions: two allocators, two segments
}

TEST_CASE("allocating_in_a_paused_region_is_an_error_that_names_the_fix_and_freeing_works") {
  SimulatedBackend device(device_config(1 * kGiB));
  RegionTable table(device);
  CachingAllocator* kv = nullptr;
  const DevicePtr live = allocate_in(table, "kv_cache", 4 * kMiB, &kv);
  table.pause("kv_cache", /*keep=*/false);
  CHECK_THROWS_WITH(allocate_in(table, "kv_cache", kMiB),
                    Catch::Contains("region 'kv_cache'") && Catch::Contains("paused (discarded)") &&
                        Catch::Contains("cotenant.resume_region(\"kv_cache\")"));
  kv->free(live);  // a tensor dropped while paused: its block goes, its bytes were gone already
  CHECK(kv->stats().allocated_bytes.all.current == 0);
  kv->check_invariants();
  table.resume("kv_cache");
  CHECK(device.device_bytes_in_use() == 0);  // nothing live: nothing to back again
  const DevicePtr again = allocate_in(table, "kv_cache", kMiB);
  CHECK(again != 0);
}

TEST_CASE("region_misuse_gets_errors_that_say_what_to_do") {
  SimulatedBackend device(device_config(1 * kGiB));
  RegionTable table(device);
  allocate_in(table, "kv_cache", kMiB);

  CHECK_THROWS_WITH(table.pause("kv", true),
                    Catch::Contains("region 'kv'") && Catch::Contains("'kv_cache'") &&
                        Catch::Contains("with cotenant.region(\"kv\")"));
  CHECK_THROWS_WITH(table.resume("kv_cache"), Catch::Contains("not paused"));
  table.pause("kv_cache", true);
  CHECK_THROWS_WITH(table.pause("kv_cache", false),
                    Catch::Contains("paused (kept) already") && Catch::Contains("resume_region"));
  table.resume("kv_cache");

  table.set_graph_capture(true);
  CHECK_THROWS_WITH(table.pause("kv_cache", true),
                    Catch::Contains("CUDA graph is being captured") && Catch::Contains("after the capture"));
  CHECK(table.state("kv_cache") == RegionState::kActive);
  table.set_graph_capture(false);
}

TEST_CASE("regions_nest_only_in_themselves") {
  RegionScope::enter("a");
  RegionScope::enter("a");  // the same region: counted
  CHECK_THROWS_WITH(RegionScope::enter("b"),
                    Catch::Contains("inside region 'a'") && Catch::Contains("Leave 'a' first"));
  CHECK_THROWS_WITH(RegionScope::exit("b"), Catch::Contains("in region 'a'"));
  RegionScope::exit("a");
  CHECK(RegionScope::current() == "a");
  RegionScope::exit("a");
  CHECK_FALSE(RegionScope::inside());
  CHECK_THROWS_WITH(RegionScope::exit("a"), Catch::Contains("in no region"));
  CHECK_THROWS_WITH(RegionScope::enter(""), Catch::Contains("needs a name"));
}

TEST_CASE("a_region_tags_only_the_thread_that_entered_it") {
  InRegion in("kv_cache");
  bool other_thread_inside = true;
  std::thread([&] { other_thread_inside = RegionScope::inside(); }).join();
  CHECK(RegionScope::inside());
  CHECK_FALSE(other_thread_inside);
}

TEST_CASE("pausing_with_keep_when_the_host_runs_out_leaves_the_region_on_the_device") {
  SimulatedDeviceConfig config = device_config(1 * kGiB);
  config.host_capacity = 4 * kMiB;  // two host pages for a region of four
  SimulatedBackend device(config);
  RegionTable table(device);
  CachingAllocator* kv = nullptr;
  const DevicePtr cache = allocate_in(table, "kv_cache", 8 * kMiB, &kv);
  fill(device, cache, 6, 8 * kMiB);
  check_kept_pause_refused_leaves_it_on_the_device(table, device, *kv, cache);
  kv->check_invariants();
}

TEST_CASE("pausing_with_keep_at_the_hosts_headroom_leaves_the_region_on_the_device_and_says_why") {
  SimulatedDeviceConfig config = device_config(1 * kGiB);
  config.host_capacity = 10 * kMiB;
  SimulatedBackend device(config);
  auto host_pages = std::make_shared<HostPagePool>(device);
  host_pages->set_headroom(6 * kMiB);  // two host pages may be pinned, for a region of four
  RegionTable table(device, host_pages);
  CachingAllocator* kv = nullptr;
  const DevicePtr cache = allocate_in(table, "kv_cache", 8 * kMiB, &kv);
  fill(device, cache, 6, 8 * kMiB);
  check_kept_pause_refused_leaves_it_on_the_device(table, device, *kv, cache);
  CHECK(device.host_bytes_in_use() == 0);  // what it pinned before the headroom went back
  CHECK(host_pages->headroom_refusals() >= 1);
  host_pages->set_headroom(0);
  table.pause("kv_cache", true);
  CHECK(table.state("kv_cache") == RegionState::kPausedKept);
  table.resume("kv_cache");
  CHECK(holds(device, cache, 6, 8 * kMiB));
  kv->check_invariants();
}

TEST_CASE("resuming_a_discarded_region_on_a_full_device_stays_paused_and_can_be_retried") {
  SimulatedBackend device(device_config(16 * kMiB));
  CachingAllocator main(device);
  RegionTable table(device);
  allocate_in(table, "kv_cache", 8 * kMiB);
  table.pause("kv_cache", false);
  const DevicePtr filler = main.allocate(12 * kMiB, kStream);  // the device has 4 MiB left
  CHECK_THROWS_WITH(table.resume("kv_cache"), Catch::Contains("no room") && Catch::Contains("resume again"));
  CHECK(table.state("kv_cache") == RegionState::kPausedDiscarded);
  main.free(filler);
  main.empty_cache();
  table.resume("kv_cache");
  CHECK(table.state("kv_cache") == RegionState::kActive);
  for (auto& [name, allocator] : table.allocators()) allocator->check_invariants();
}

TEST_CASE("pausing_with_keep_needs_host_pages") {
  SimulatedBackend device(device_config(1 * kGiB, true, /*host_mappable=*/false));
  RegionTable table(device);
  allocate_in(table, "kv_cache", kMiB);
  CHECK_THROWS_WITH(table.pause("kv_cache", true), Catch::Contains("keep=False"));
  CHECK(table.pause("kv_cache", false) == 2 * kMiB);
}

TEST_CASE("discarding_refuses_while_the_device_cannot_synchronize") {
  SimulatedBackend device(device_config(1 * kGiB));
  CachingAllocator allocator(device);
  const DevicePtr a = allocator.allocate(kMiB, kStream);
  device.refuse_synchronization(true);
  CHECK_THROWS_WITH(allocator.discard_pages(), Catch::Contains("CUDA graph"));
  CHECK_FALSE(allocator.discarded());
  CHECK(allocator.is_device_resident(a));
  device.refuse_synchronization(false);
  CHECK(allocator.allocate(1, kStream) != 0);  // nothing was discarded
}

// A region that shares the device's host page pool pauses into the host
// reserve: with a reserve as large as the region, a pause pins nothing, the
// resume gives the pages back to the pool, and the next pause takes them
// again. Without a reserve, a resume gives the host pages back to the driver.
TEST_CASE("a_region_paused_with_keep_takes_its_host_pages_from_the_device_reserve_and_gives_them_back") {
  SimulatedBackend device(device_config(1 * kGiB));
  auto host_pages = std::make_shared<HostPagePool>(device);
  CachingAllocator main(device, {}, host_pages);
  RegionTable table(device, host_pages);
  const bool reserved = GENERATE(true, false);
  CAPTURE(reserved);
  if (reserved) CHECK(main.reserve_host_memory(10 * kMiB) == 10 * kMiB);
  CachingAllocator* kv = nullptr;
  const DevicePtr cache = allocate_in(table, "kv_cache", 9 * kMiB, &kv);

  for (int round = 0; round < 3; ++round) {
    CAPTURE(round);
    fill(device, cache, static_cast<std::uint8_t>(round + 1), 9 * kMiB);
    const auto pinned = device.calls().create_page;
    CHECK(table.pause("kv_cache", /*keep=*/true) == 10 * kMiB);
    // 5 device pages went; with the reserve, no host page was pinned for them.
    CHECK(device.calls().create_page - pinned == (reserved ? 0u : 5u));
    CHECK(host_pages->kept().current == 0);
    CHECK(holds(device, cache, static_cast<std::uint8_t>(round + 1), 9 * kMiB));

    CHECK(table.resume("kv_cache") == 10 * kMiB);
    CHECK(holds(device, cache, static_cast<std::uint8_t>(round + 1), 9 * kMiB));
    CHECK(host_pages->kept().current == (reserved ? 10 * kMiB : 0));
    CHECK(device.host_bytes_in_use() == (reserved ? 10 * kMiB : 0));
    kv->check_invariants();
  }
  CHECK(main.stats().host_pool_bytes.current == (reserved ? 10 * kMiB : 0));  // the device's pool
  CHECK(main.host_reserve() == (reserved ? 10 * kMiB : 0));
}

// One host pool, two threads: a region paused and resumed again and again
// while the capped allocator allocates, frees and spills on another thread
// and the reserve moves. Every byte stays, the books hold, and once the
// reserve is 0 and the cap gone nothing is pinned (the sanitizer builds
// check the races).
TEST_CASE("a_region_pausing_while_the_capped_allocator_spills_shares_the_host_pool_safely") {
  SimulatedBackend device(device_config(1 * kGiB));
  auto host_pages = std::make_shared<HostPagePool>(device);
  CachingAllocator main(device, {}, host_pages);
  RegionTable table(device, host_pages);
  main.reserve_host_memory(8 * kMiB);
  main.set_memory_cap(8 * kMiB);
  CachingAllocator* kv = nullptr;
  const DevicePtr cache = allocate_in(table, "kv_cache", 9 * kMiB, &kv);
  fill(device, cache, 3, 9 * kMiB);

  std::atomic<bool> done{false};
  std::atomic<int> pauses{0}, corrupt_pauses{0};
  std::thread pausing([&] {
    for (int round = 0; !done.load(); ++round) {
      table.pause("kv_cache", /*keep=*/true);
      if (!holds(device, cache, 3, 9 * kMiB)) ++corrupt_pauses;
      ++pauses;
      table.resume("kv_cache");
      if (round % 4 == 0) main.reserve_host_memory(round % 8 == 0 ? 16 * kMiB : 4 * kMiB);
    }
  });
  std::vector<DevicePtr> live;
  for (int i = 0; i < 200; ++i) {
    live.push_back(main.allocate(static_cast<std::size_t>(1 + i % 3) * kMiB, 0));
    fill(device, live.back(), static_cast<std::uint8_t>(i), kMiB);
    if (live.size() > 6) {
      CHECK(holds(device, live.front(), static_cast<std::uint8_t>(i - 6), kMiB));
      main.free(live.front());
      live.erase(live.begin());
    }
    main.apply_pending_migrations();
  }
  while (pauses.load() < 3) std::this_thread::yield();
  done = true;
  pausing.join();
  CHECK(corrupt_pauses.load() == 0);
  CHECK(table.state("kv_cache") == RegionState::kActive);
  CHECK(holds(device, cache, 3, 9 * kMiB));
  main.check_invariants();
  kv->check_invariants();
  for (DevicePtr address : live) main.free(address);
  main.reserve_host_memory(0);
  main.set_memory_cap(kNoCap);
  main.apply_pending_migrations();
  CHECK(host_pages->kept().current == 0);
  CHECK(device.host_bytes_in_use() == 0);
}

TEST_CASE("an_allocation_asked_to_return_zero_on_oom_counts_no_oom_and_the_retry_succeeds") {
  // The adapter frees the device's other caches between the two calls.
  SimulatedBackend device(device_config(64 * kMiB));
  CachingAllocator main(device);
  const DevicePtr big = main.allocate(48 * kMiB, kStream);
  main.free(big);  // cached by main: the region finds no room
  RegionTable table(device);
  InRegion in("kv_cache");
  CachingAllocator* region = nullptr;
  CHECK(table.allocate(32 * kMiB, kStream, &region, OnOutOfMemory::kReturnZero) == 0);
  REQUIRE(region != nullptr);
  CHECK(region->stats().num_ooms == 0);
  main.empty_cache();
  CHECK(table.allocate(32 * kMiB, kStream, &region, OnOutOfMemory::kThrow) != 0);
  CHECK(region->stats().num_ooms == 0);
}

TEST_CASE("a_jobs_suspend_moves_its_active_regions_to_the_host_and_its_resume_brings_back_those_still_active") {
  SimulatedBackend device(device_config(1 * kGiB));
  RegionTable table(device);
  CachingAllocator* kv = nullptr;
  CachingAllocator* weights = nullptr;
  CachingAllocator* paused = nullptr;
  const DevicePtr cache = allocate_in(table, "kv_cache", 4 * kMiB, &kv);
  const DevicePtr copy = allocate_in(table, "weights", 2 * kMiB, &weights);
  allocate_in(table, "rollout", 2 * kMiB, &paused);
  fill(device, cache, 7, 4 * kMiB);
  fill(device, copy, 8, 2 * kMiB);
  table.pause("rollout", /*keep=*/true);  // the job paused this one itself

  const std::vector<std::string> spilled = table.spill_active();
  CHECK(spilled == std::vector<std::string>{"kv_cache", "weights"});  // not the paused one
  CHECK(table.has_pending_migrations());
  CHECK(table.apply_pending_migrations() == 6 * kMiB);
  CHECK_FALSE(table.has_pending_migrations());
  CHECK(device.device_bytes_in_use() == 0);
  CHECK(table.state("kv_cache") == RegionState::kActive);  // spilled, not paused: it still allocates
  const DevicePtr more = allocate_in(table, "kv_cache", kMiB);
  CHECK_FALSE(kv->is_device_resident(more));  // on the host while the job is suspended
  table.pause("weights", /*keep=*/true);  // paused while suspended: it stays paused after the resume

  table.restore_spilled(spilled);
  CHECK(table.apply_pending_migrations() == 6 * kMiB);  // kv_cache's pages, the new block's too
  CHECK(kv->is_device_resident(cache));
  CHECK(kv->is_device_resident(more));
  CHECK(holds(device, cache, 7, 4 * kMiB));
  CHECK(table.state("weights") == RegionState::kPausedKept);
  CHECK_FALSE(weights->is_device_resident(copy));
  CHECK(holds(device, copy, 8, 2 * kMiB));
  CHECK(table.state("rollout") == RegionState::kPausedKept);
  for (CachingAllocator* a : {kv, weights, paused}) a->check_invariants();
}

TEST_CASE("a_region_paused_on_two_devices_is_paused_on_both_or_on_neither") {
  // A process with the region on two devices: pausing it with keep moves
  // both devices' pages, one after the other. The second device's host
  // cannot take its pages, so the first is brought back: the region is
  // active everywhere, every byte where it was, and a second try can work.
  SimulatedBackend first(device_config(1 * kGiB));
  SimulatedDeviceConfig small_host = device_config(1 * kGiB);
  small_host.host_capacity = 4 * kMiB;  // two host pages for a region of four
  SimulatedBackend second(small_host);
  RegionTable first_table(first), second_table(second);
  const DevicePtr a = allocate_in(first_table, "kv_cache", 8 * kMiB);
  const DevicePtr b = allocate_in(second_table, "kv_cache", 8 * kMiB);
  fill(first, a, 3, 8 * kMiB);
  fill(second, b, 4, 8 * kMiB);
  const std::vector<RegionTable*> tables{&first_table, &second_table};
  int undone = 0;
  auto pause = [](RegionTable* table) { return table->pause("kv_cache", /*keep=*/true); };
  auto resume = [&](RegionTable* table) {
    ++undone;
    table->resume("kv_cache");
  };
  CHECK_THROWS_AS(all_or_none(tables, pause, resume), OutOfMemoryError);
  CHECK(undone == 1);  // the first device, brought back; the second never paused
  CHECK(first_table.state("kv_cache") == RegionState::kActive);
  CHECK(second_table.state("kv_cache") == RegionState::kActive);
  CHECK(first.residency_at(a) == Residency::kDevice);
  CHECK(holds(first, a, 3, 8 * kMiB));
  CHECK(holds(second, b, 4, 8 * kMiB));

  // Where every device can, it is all of them, and the sum of their bytes.
  const std::vector<RegionTable*> one{&first_table};
  CHECK(all_or_none(one, pause, resume) == 8 * kMiB);
  CHECK(first_table.state("kv_cache") == RegionState::kPausedKept);
  // An undo that fails is passed over: the error that stopped the change is the one that comes out.
  auto failing_undo = [](RegionTable*) { throw Error("undo failed"); };
  CHECK_THROWS_WITH(all_or_none(tables, [](RegionTable* table) { return table->resume("kv_cache"); }, failing_undo),
                    Catch::Contains("not paused"));  // the second's refusal, not the first's failed undo
  CHECK(first_table.state("kv_cache") == RegionState::kActive);  // resumed, and its undo failed
  CHECK(holds(first, a, 3, 8 * kMiB));
}
