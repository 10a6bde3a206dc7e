// Regions paused and resumed (region_table.h) on the real CudaBackend over
// the fake CUDA runtime: a discarded region's addresses stay reserved and
// fault until resume maps zeroed pages there (the fake's new pages hold
// garbage, as a driver's may); a kept region's bytes survive the host round
// trip. Every test ends with no driver rule broken and nothing leaked.
#include <catch2/catch.hpp>

#include <algorithm>
#include <memory>
#include <vector>

#include "cotenant/errors.h"
#include "cotenant/region_table.h"
#include "devices.h"

using namespace cotenant;
using namespace cotenant::testing;

namespace {

struct InRegion {
  explicit InRegion(std::string name) : name(std::move(name)) { RegionScope::enter(this->name); }
  ~InRegion() { RegionScope::exit(name); }
  std::string name;
};

// A device whose new pages hold 0xA5 bytes.
std::unique_ptr<cuda::CudaBackend> garbage_device() {
  fake_cuda::Config config;
  config.garbage_in_new_pages = true;
  fake_cuda::reset(config);
  return std::make_unique<cuda::CudaBackend>(0);
}

// pause/resume as the torch adapter runs them: at a safe point.
template <typename Fn>
void at_safe_point(cuda::CudaBackend& backend, Fn&& fn) {
  backend.synchronize_device();
  backend.set_quiescent(true);
  try {
    fn();
    backend.finish_copies();
  } catch (...) {
    try {
      backend.finish_copies();  // as the adapter does: a second wait before launches resume
    } catch (...) {
    }
    backend.set_quiescent(false);
    throw;
  }
  backend.set_quiescent(false);
}

bool all_zero(DevicePtr address, std::size_t bytes) {
  const auto* p = reinterpret_cast<const unsigned char*>(address);
  return std::all_of(p, p + bytes, [](unsigned char b) { return b == 0; });
}

void fill_bytes(DevicePtr address, std::uint64_t seed, std::size_t bytes) {
  const auto data = pattern(seed, bytes);
  std::memcpy(reinterpret_cast<void*>(address), data.data(), bytes);
}

bool holds_bytes(DevicePtr address, std::uint64_t seed, std::size_t bytes) {
  return std::memcmp(reinterpret_cast<const void*>(address), pattern(seed, bytes).data(), bytes) == 0;
}

// A block of `bytes` allocated in region `name` and filled from `seed`;
// `allocator` receives the region's allocator.
DevicePtr filled_region_block(RegionTable& table, const std::string& name, std::size_t bytes, std::uint64_t seed,
                              CachingAllocator** allocator) {
  DevicePtr block = 0;
  {
    InRegion in(name);
    block = table.allocate(bytes, 0, allocator);
  }
  fill_bytes(block, seed, bytes);
  return block;
}

// Runs `action` at a safe point until region `name` is `wanted` (4 tries at
// most), calling `after_failure` on each Error (an injected failure).
template <typename Action, typename AfterFailure>
void retry_until(cuda::CudaBackend& backend, RegionTable& table, const std::string& name, RegionState wanted,
                 Action&& action, AfterFailure&& after_failure) {
  for (int attempt = 0; attempt < 4 && table.state(name) != wanted; ++attempt) {
    try {
      at_safe_point(backend, action);
    } catch (const Error&) {
      after_failure();
    }
  }
  CHECK(table.state(name) == wanted);
}

}  // namespace

TEST_CASE("discarded_region_keeps_its_addresses_reserved_and_resumes_with_zeroed_pages_over_fake",
          "[fake_cuda][regions]") {
  auto backend = garbage_device();
  {
    CachingAllocator main(*backend);
    RegionTable table(*backend);
    const DevicePtr other = main.allocate(3 * kMiB, 0);
    fill_bytes(other, 1, 3 * kMiB);
    DevicePtr a = 0, b = 0;
    {
      InRegion in("kv_cache");
      CachingAllocator* kv = nullptr;
      a = table.allocate(5 * kMiB, 0, &kv);
      b = table.allocate(2 * kMiB, 0, &kv);
    }
    fill_bytes(a, 2, 5 * kMiB);
    fill_bytes(b, 3, 2 * kMiB);
    const std::size_t device_before = fake_cuda::device_bytes_in_use();
    const auto reserves = fake_cuda::calls("cuMemAddressReserve");

    at_safe_point(*backend, [&] { table.pause("kv_cache", /*keep=*/false); });
    CHECK(fake_cuda::device_bytes_in_use() == device_before - 8 * kMiB);
    CHECK_FALSE(fake_cuda::accessible(reinterpret_cast<void*>(a), 1));  // reserved, unmapped: faults
    CHECK(fake_cuda::calls("cuMemAddressFree") == 0);

    at_safe_point(*backend, [&] { table.resume("kv_cache"); });
    CHECK(fake_cuda::calls("cuMemAddressReserve") == reserves);  // the same range, backed again
    CHECK(fake_cuda::device_can_access(0, reinterpret_cast<void*>(a), 5 * kMiB));
    CHECK(all_zero(a, 5 * kMiB));  // garbage in the new pages was zeroed
    CHECK(all_zero(b, 2 * kMiB));
    CHECK(holds_bytes(other, 1, 3 * kMiB));
    for (auto& [name, allocator] : table.allocators()) allocator->check_invariants();
  }
  backend.reset();
  check_fake_cuda_clean();
}

TEST_CASE("kept_region_moves_to_host_pages_and_back_with_its_bytes_over_fake", "[fake_cuda][regions]") {
  auto backend = garbage_device();
  {
    RegionTable table(*backend);
    CachingAllocator* kv = nullptr;
    const DevicePtr cache = filled_region_block(table, "weights", 9 * kMiB, 4, &kv);
    at_safe_point(*backend, [&] { table.pause("weights", /*keep=*/true); });
    CHECK(fake_cuda::device_bytes_in_use() == 0);
    CHECK(fake_cuda::host_bytes_in_use() == 10 * kMiB);
    CHECK(holds_bytes(cache, 4, 9 * kMiB));  // the same address, now on host pages
    at_safe_point(*backend, [&] { table.resume("weights"); });
    CHECK(fake_cuda::device_bytes_in_use() == 10 * kMiB);
    CHECK(fake_cuda::host_bytes_in_use() == 0);
    CHECK(holds_bytes(cache, 4, 9 * kMiB));
    kv->check_invariants();
  }
  backend.reset();
  check_fake_cuda_clean();
}

// With the device's host pool shared and a host reserve the region's size,
// a kept pause pins nothing (no cuMemCreate of a host page) and a resume
// hands the pages back to the pool for the next pause.
TEST_CASE("a_kept_region_pauses_into_the_host_reserve_without_pinning_over_fake", "[fake_cuda][regions]") {
  auto backend = garbage_device();
  {
    auto host_pages = std::make_shared<HostPagePool>(*backend);
    CachingAllocator main(*backend, {}, host_pages);
    RegionTable table(*backend, host_pages);
    CHECK(main.reserve_host_memory(10 * kMiB) == 10 * kMiB);
    CHECK(fake_cuda::host_bytes_in_use() == 10 * kMiB);
    CachingAllocator* kv = nullptr;
    const DevicePtr cache = filled_region_block(table, "weights", 9 * kMiB, 4, &kv);
    for (int round = 0; round < 2; ++round) {
      CAPTURE(round);
      const auto created = fake_cuda::calls("cuMemCreate");
      at_safe_point(*backend, [&] { table.pause("weights", /*keep=*/true); });
      CHECK(fake_cuda::calls("cuMemCreate") == created);  // every host page came from the reserve
      CHECK(fake_cuda::device_bytes_in_use() == 0);
      CHECK(holds_bytes(cache, 4, 9 * kMiB));
      at_safe_point(*backend, [&] { table.resume("weights"); });
      CHECK(fake_cuda::host_bytes_in_use() == 10 * kMiB);  // back in the pool, not released
      CHECK(holds_bytes(cache, 4, 9 * kMiB));
      kv->check_invariants();
    }
  }
  backend.reset();
  check_fake_cuda_clean();
}

TEST_CASE("a_region_freed_while_discarded_leaves_nothing_behind_over_fake", "[fake_cuda][regions]") {
  auto backend = garbage_device();
  {
    RegionTable table(*backend);
    CachingAllocator* kv = nullptr;
    DevicePtr cache = 0;
    {
      InRegion in("kv_cache");
      cache = table.allocate(4 * kMiB, 0, &kv);
    }
    at_safe_point(*backend, [&] { table.pause("kv_cache", false); });
    kv->free(cache);
    kv->empty_cache();  // the free segment gives its range back
    CHECK(fake_cuda::calls("cuMemAddressFree") == 1);
    kv->check_invariants();
  }
  backend.reset();
  check_fake_cuda_clean();
}

// Every driver or runtime call of a kept pause and its resume failing once,
// at its 1st to 8th call, with copies 1 ms in flight: a pause or resume the
// failure hits throws and leaves the region as it was (active, or paused),
// the next try succeeds, the bytes survive, no rule is broken, and nothing
// leaks but a page whose release the driver refused.
// A driver or runtime entry a sweep fails once, and how many times its run
// calls it at least (so that the failure always fires).
struct FailingEntry {
  const char* name;
  int calls;
};

TEST_CASE("a_kept_pause_and_resume_under_any_failing_call_keep_the_bytes_over_fake", "[fake_cuda][regions][failure]") {
  // (The copy stream is waited for once for the pause and once for the resume.)
  const FailingEntry failing = GENERATE(
      FailingEntry{"cuMemCreate", 8}, FailingEntry{"cuMemMap", 8}, FailingEntry{"cuMemSetAccess", 8},
      FailingEntry{"cuMemUnmap", 8}, FailingEntry{"cuMemRelease", 8}, FailingEntry{"cudaMemcpyAsync", 8},
      FailingEntry{"cudaStreamSynchronize", 2});
  const char* entry = failing.name;
  const int nth = std::min(GENERATE(1, 2, 3, 5, 8), failing.calls);
  CAPTURE(entry, nth);
  auto backend = garbage_device();
  {
    RegionTable table(*backend);
    CachingAllocator* kv = nullptr;
    const DevicePtr cache = filled_region_block(table, "kv_cache", 7 * kMiB, 5, &kv);
    fake_cuda::set_delay(std::chrono::milliseconds(1));
    fail_once(entry, nth);
    // After the injected failure the region is as it was (an active one whole
    // on the device, a paused one whole on the host), and the next try goes on.
    auto as_it_was = [&] {
      const bool active = table.state("kv_cache") == RegionState::kActive;
      const auto stats = kv->stats();
      CHECK((active ? stats.host_resident_bytes.current : stats.device_resident_bytes.current) == 0);
      CHECK_FALSE(kv->has_pending_migrations());
    };
    retry_until(*backend, table, "kv_cache", RegionState::kPausedKept,
                [&] { table.pause("kv_cache", /*keep=*/true); }, as_it_was);
    CHECK(holds_bytes(cache, 5, 7 * kMiB));
    CHECK(kv->stats().device_resident_bytes.current == 0);
    retry_until(*backend, table, "kv_cache", RegionState::kActive, [&] { table.resume("kv_cache"); }, as_it_was);
    CHECK(holds_bytes(cache, 5, 7 * kMiB));
    CHECK(kv->stats().host_resident_bytes.current == 0);
    fake_cuda::set_delay(std::chrono::microseconds(0));
    kv->check_invariants();
    CHECK(fake_cuda::calls(entry) >= static_cast<std::uint64_t>(nth));  // the failure fired
  }
  backend.reset();
  check_fake_cuda_clean_after_failing(entry);
}

// The same for a pause that discards: a failure part way leaves the region
// paused (what is gone is gone) or, before anything went, active; the resume
// backs all of it again with zeros, and the region's neighbour keeps its bytes.
TEST_CASE("a_discarding_pause_and_resume_under_any_failing_call_resume_as_zeros_over_fake",
          "[fake_cuda][regions][failure]") {
  // (calls: of it before the teardown: the failure fires in the pause or the resume)
  const FailingEntry failing = GENERATE(
      FailingEntry{"cuMemCreate", 3}, FailingEntry{"cuMemMap", 3}, FailingEntry{"cuMemSetAccess", 3},
      FailingEntry{"cuMemUnmap", 3}, FailingEntry{"cuMemRelease", 3}, FailingEntry{"cudaMemsetAsync", 1},
      FailingEntry{"cudaDeviceSynchronize", 2});
  const char* entry = failing.name;
  const int nth = std::min(GENERATE(1, 2, 3), failing.calls);
  CAPTURE(entry, nth);
  auto backend = garbage_device();
  {
    CachingAllocator main(*backend);
    const DevicePtr other = main.allocate(3 * kMiB, 0);
    fill_bytes(other, 1, 3 * kMiB);
    RegionTable table(*backend);
    CachingAllocator* kv = nullptr;
    const DevicePtr cache = filled_region_block(table, "kv_cache", 7 * kMiB, 5, &kv);
    fail_once(entry, nth);
    auto go_on = [] {};  // the injected failure; the next try goes on
    retry_until(*backend, table, "kv_cache", RegionState::kPausedDiscarded,
                [&] { table.pause("kv_cache", /*keep=*/false); }, go_on);
    retry_until(*backend, table, "kv_cache", RegionState::kActive, [&] { table.resume("kv_cache"); }, go_on);
    CHECK(fake_cuda::device_can_access(0, reinterpret_cast<void*>(cache), 7 * kMiB));
    CHECK(all_zero(cache, 7 * kMiB));
    CHECK(holds_bytes(other, 1, 3 * kMiB));
    kv->check_invariants();
    main.check_invariants();
    CHECK(fake_cuda::calls(entry) >= static_cast<std::uint64_t>(nth));  // the failure fired
  }
  backend.reset();
  check_fake_cuda_clean_after_failing(entry);
}
