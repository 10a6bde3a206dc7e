// Which pages move at a safe point: a pure function of the pages' residency
// and heat, the device-resident bytes and the cap. No I/O, no locks, so a
// test can drive it with a table of cases.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cotenant/backend.h"

namespace cotenant {

// A live page (touched by at least one live block) as the policy sees it.
struct PageCandidate {
  std::size_t id = 0;          // caller's handle for the page, returned in the plan
  Residency where = Residency::kDevice;
  std::uint64_t last_use = 0;  // larger = used more recently ("hotter")
};

struct MigrationPlan {
  std::vector<std::size_t> to_host;    // coldest first
  std::vector<std::size_t> to_device;  // hottest first
  bool empty() const { return to_host.empty() && to_device.empty(); }
};

// Over the cap: spill device pages, coldest first, until device_bytes is at
// most the cap less `ahead` (the bytes the job is expected to allocate soon:
// spilling for them in the same batch spares them a safe point each). Under
// it: restore host pages, hottest first, while each one still fits under the
// cap with `ahead` to spare. Then, while the hottest host page left is hotter
// than the coldest device page left, the two swap places (one page each
// way), so that the cap holds the hottest pages. Apply to_host before
// to_device. Ties go to the lower id, so plans are reproducible. `cap` ==
// UINT64_MAX means no cap.
MigrationPlan plan_migrations(const std::vector<PageCandidate>& live_pages, std::uint64_t device_bytes,
                              std::uint64_t cap, std::size_t page_bytes, std::uint64_t ahead = 0);

}  // namespace cotenant
