// Which pages move at a safe point: a pure function of the pages' residency
// and heat, the device-resident bytes and the cap. No I/O, no locks, so a
// test can drive it with a table of cases.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cotenant/backend.h"

namespace cotenant {

// A mapped page as the policy sees it: a live page (touched by at least one
// live block), or a free device page (`holds_data` false: mapped, no live
// block), which a live host page can take in its place.
struct PageCandidate {
  std::size_t id = 0;          // caller's handle for the page, returned in the plan
  Residency where = Residency::kDevice;
  std::uint64_t last_use = 0;  // larger = used more recently ("hotter")
  bool holds_data = true;      // false: a free device page (free host pages are no candidates)
};

// A live host page and a free device page that trade backings: the host
// page's bytes go to the device page, which then backs the live address,
// and the host page backs the free one's. The device's bytes stay as they
// are, so no cap stands in the way.
struct PageSwap {
  std::size_t host_page;
  std::size_t free_device_page;
  bool operator==(const PageSwap& other) const {
    return host_page == other.host_page && free_device_page == other.free_device_page;
  }
};

struct MigrationPlan {
  std::vector<std::size_t> to_host;    // coldest first (free device pages first)
  std::vector<std::size_t> to_device;  // hottest first
  std::vector<PageSwap> into_free;     // hottest host page first, each with the coldest free device page left
  bool empty() const { return to_host.empty() && to_device.empty() && into_free.empty(); }
};

// Over the cap: spill device pages, coldest first (free device pages before
// any live one: nothing to copy), until device_bytes is at most the cap less
// `ahead` (the bytes the job is expected to allocate soon: spilling for them
// in the same batch spares them a safe point each). Under it: restore host
// pages, hottest first, while each one still fits under the cap with `ahead`
// to spare. Then, while the hottest host page left is hotter than the
// coldest device page left, the two swap places (one page each way), so that
// the cap holds the hottest pages; a free device page is colder than any
// live page, and its swap is into_free: a live page on the host is read
// across the bus by the kernels that use it, a free device page by none
// (docs/allocator.md, "Live pages into free device pages"). Apply to_host
// before to_device; into_free moves no page the other two move. A free
// device page in to_host moves without a copy. Ties go to the lower id, so
// plans are reproducible. `cap` == UINT64_MAX means no cap.
MigrationPlan plan_migrations(const std::vector<PageCandidate>& pages, std::uint64_t device_bytes,
                              std::uint64_t cap, std::size_t page_bytes, std::uint64_t ahead = 0);

}  // namespace cotenant
