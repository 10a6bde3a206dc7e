#include <catch2/catch.hpp>

#include <algorithm>
#include <random>

#include "cotenant/spill_policy.h"

using namespace cotenant;

namespace {
constexpr std::size_t kPage = 2u << 20;
constexpr std::uint64_t kNone = ~std::uint64_t{0};
PageCandidate on_device(std::size_t id, std::uint64_t last_use) { return {id, Residency::kDevice, last_use}; }
PageCandidate on_host(std::size_t id, std::uint64_t last_use) { return {id, Residency::kHost, last_use}; }
PageCandidate free_on_device(std::size_t id, std::uint64_t last_use) {
  return {id, Residency::kDevice, last_use, /*holds_data=*/false};
}
}  // namespace

TEST_CASE("spill_policy_table", "[policy]") {
  struct Case {
    const char* name;
    std::vector<PageCandidate> pages;
    std::uint64_t device_bytes;
    std::uint64_t cap;
    std::vector<std::size_t> to_host, to_device;
    std::uint64_t ahead = 0;
    std::vector<PageSwap> into_free = {};
  };
  const std::vector<Case> cases = {
      {"under the cap with nothing on the host: no moves",
       {on_device(0, 5), on_device(1, 9)}, 2 * kPage, 4 * kPage, {}, {}},
      {"no cap: no moves", {on_device(0, 5)}, kPage, kNone, {}, {}},
      {"over by one page: the coldest page spills",
       {on_device(0, 5), on_device(1, 2), on_device(2, 9)}, 3 * kPage, 2 * kPage, {1}, {}},
      {"over by two pages: the two coldest spill, coldest first",
       {on_device(0, 5), on_device(1, 2), on_device(2, 9)}, 3 * kPage, kPage, {1, 0}, {}},
      {"a cap below one page spills everything",
       {on_device(0, 5), on_device(1, 2)}, 2 * kPage, 1, {1, 0}, {}},
      {"equal heat: the lower id goes first", {on_device(3, 4), on_device(1, 4)}, 2 * kPage, kPage, {1}, {}},
      {"room for one page: the hottest host page returns, the next swaps with a colder device page",
       {on_device(0, 1), on_host(1, 3), on_host(2, 8)}, kPage, 2 * kPage, {0}, {2, 1}},
      {"at the cap: a host page hotter than a device page swaps with it, one pair",
       {on_device(0, 2), on_device(1, 7), on_host(2, 5), on_host(3, 1)}, 2 * kPage, 2 * kPage, {0}, {2}},
      {"at the cap, equal heat: no swap", {on_device(0, 4), on_host(1, 4)}, kPage, kPage, {}, {}},
      {"over the cap: the coldest spill, then a hotter host page swaps with the next coldest",
       {on_device(0, 1), on_device(1, 3), on_device(2, 9), on_host(3, 6)}, 3 * kPage, 2 * kPage, {0, 1}, {3}},
      {"room for all: every host page returns, hottest first",
       {on_host(1, 3), on_host(2, 8)}, 0, 10 * kPage, {}, {2, 1}},
      {"room for less than a page: nothing returns", {on_host(1, 3)}, kPage, kPage + kPage / 2, {}, {}},
      {"over the cap with host pages and no device page left to swap: spill only",
       {on_device(0, 1), on_host(1, 9)}, 2 * kPage, kPage, {0}, {}},
      {"over the cap with a page's allocations ahead: one page more spills",
       {on_device(0, 5), on_device(1, 2), on_device(2, 9)}, 3 * kPage, 2 * kPage, {1, 0}, {}, kPage},
      {"over the cap, less than a page ahead: a page more spills (pages move whole)",
       {on_device(0, 5), on_device(1, 2), on_device(2, 9)}, 3 * kPage, 2 * kPage, {1, 0}, {}, kPage / 4},
      {"ahead more than the cap: everything spills, nothing more",
       {on_device(0, 5), on_device(1, 2)}, 2 * kPage, kPage, {1, 0}, {}, 4 * kPage},
      {"under the cap, bytes ahead: nothing spills before it is needed",
       {on_device(0, 5), on_device(1, 2)}, 2 * kPage, 3 * kPage, {}, {}, 2 * kPage},
      {"room for two pages, one page ahead: one host page returns, the room ahead stays",
       {on_host(1, 3), on_host(2, 8)}, 0, 2 * kPage, {}, {2}, kPage},
      {"at the cap with bytes ahead: a hotter host page still swaps with a colder device page",
       {on_device(0, 2), on_host(1, 5)}, kPage, kPage, {0}, {1}, kPage / 2},
      // Free device pages (mapped, no live block) are colder than any live
      // page: a live host page takes one's place (into_free) at the cap too,
      // hottest host page first, coldest free page first; over the cap they
      // go first, without a copy.
      {"at the cap: the hottest host page takes the coldest free device page",
       {on_device(0, 9), free_on_device(1, 6), free_on_device(2, 3), on_host(3, 4), on_host(4, 8)},
       3 * kPage, 3 * kPage, {}, {}, 0, {{4, 2}, {3, 1}}},
      {"more free pages than host pages: the coldest free pages are taken",
       {free_on_device(0, 6), free_on_device(1, 3), free_on_device(2, 1), on_host(3, 4)},
       3 * kPage, 3 * kPage, {}, {}, 0, {{3, 2}}},
      {"room under the cap first, then free pages, then a swap with a colder live page",
       {on_device(0, 1), free_on_device(1, 2), on_host(2, 9), on_host(3, 7), on_host(4, 5)},
       2 * kPage, 3 * kPage, {0}, {2, 4}, 0, {{3, 1}}},
      {"free pages without live host pages: nothing", {on_device(0, 1), free_on_device(1, 2)},
       2 * kPage, 2 * kPage, {}, {}},
      {"over the cap: a free device page goes first (no copy), then a hotter host page swaps with a live one",
       {on_device(0, 1), on_device(1, 5), free_on_device(2, 2), on_host(3, 9)}, 3 * kPage, 2 * kPage, {2, 0}, {3}},
      {"over the cap by more than the free pages: they go, then the coldest live pages",
       {on_device(0, 4), on_device(1, 5), free_on_device(2, 9), on_host(3, 1)}, 3 * kPage, kPage, {2, 0}, {}},
      {"spill_all's cap of 0: every device page goes, the free ones first", {free_on_device(0, 2), on_host(1, 9)},
       kPage, 0, {0}, {}},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    const MigrationPlan plan = plan_migrations(c.pages, c.device_bytes, c.cap, kPage, c.ahead);
    CHECK(plan.to_host == c.to_host);
    CHECK(plan.to_device == c.to_device);
    CHECK(plan.into_free == c.into_free);
  }
}

// A safe point that moved its whole plan does not plan again
// (CachingAllocator::apply_pending_migrations): planning over the pages as
// the plan left them must find nothing to move. Random pages, heats (ties
// included), caps, bytes expected ahead and free device pages.
TEST_CASE("spill_policy_a_plan_carried_out_leaves_nothing_to_plan", "[policy]") {
  std::mt19937_64 random(20261124);
  for (int round = 0; round < 2000; ++round) {
    std::vector<PageCandidate> pages;
    const std::size_t count = random() % 24;
    std::uint64_t live_device = 0;
    for (std::size_t id = 0; id < count; ++id) {
      const bool device = random() % 2 == 0;
      pages.push_back({id, device ? Residency::kDevice : Residency::kHost, random() % 12});
      live_device += device ? kPage : 0;
    }
    const std::size_t free_pages = random() % 4;
    for (std::size_t i = 0; i < free_pages; ++i) {
      pages.push_back({count + i, Residency::kDevice, random() % 12, /*holds_data=*/false});
    }
    const std::uint64_t cached = free_pages * kPage;
    const std::uint64_t cap = random() % 5 == 0 ? kNone : random() % (28 * kPage);
    const std::uint64_t ahead = random() % 3 == 0 ? 0 : random() % (6 * kPage);
    std::uint64_t device_bytes = live_device + cached;
    CAPTURE(round, count, device_bytes, cap, ahead);
    const MigrationPlan plan = plan_migrations(pages, device_bytes, cap, kPage, ahead);
    for (std::size_t id : plan.to_host) {
      pages[id].where = Residency::kHost;
      device_bytes -= std::min<std::uint64_t>(device_bytes, kPage);
    }
    for (std::size_t id : plan.to_device) {
      pages[id].where = Residency::kDevice;
      device_bytes += kPage;
    }
    for (const PageSwap& swap : plan.into_free) {  // the free page goes to the host: no candidate any more
      pages[swap.host_page].where = Residency::kDevice;
      pages[swap.free_device_page].where = Residency::kHost;
    }
    pages.erase(std::remove_if(pages.begin(), pages.end(),
                               [](const PageCandidate& page) { return !page.holds_data && page.where == Residency::kHost; }),
                pages.end());
    const MigrationPlan again = plan_migrations(pages, device_bytes, cap, kPage, ahead);
    CHECK(again.to_host.empty());
    CHECK(again.to_device.empty());
    CHECK(again.into_free.empty());
  }
}
