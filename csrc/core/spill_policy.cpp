#include "cotenant/spill_policy.h"

#include <algorithm>
#include <tuple>

namespace cotenant {

MigrationPlan plan_migrations(const std::vector<PageCandidate>& live_pages, std::uint64_t device_bytes,
                              std::uint64_t cap, std::size_t page_bytes) {
  MigrationPlan plan;
  std::vector<const PageCandidate*> device, host;
  for (const PageCandidate& page : live_pages) {
    (page.where == Residency::kDevice ? device : host).push_back(&page);
  }
  if (device_bytes > cap) {
    std::sort(device.begin(), device.end(), [](const PageCandidate* a, const PageCandidate* b) {
      return std::tie(a->last_use, a->id) < std::tie(b->last_use, b->id);
    });
    for (const PageCandidate* page : device) {
      if (device_bytes <= cap) break;
      plan.to_host.push_back(page->id);
      device_bytes -= std::min<std::uint64_t>(device_bytes, page_bytes);
    }
    return plan;
  }
  std::sort(host.begin(), host.end(), [](const PageCandidate* a, const PageCandidate* b) {
    return std::make_tuple(b->last_use, a->id) < std::make_tuple(a->last_use, b->id);
  });
  for (const PageCandidate* page : host) {
    if (cap - device_bytes < page_bytes) break;
    plan.to_device.push_back(page->id);
    device_bytes += page_bytes;
  }
  return plan;
}

}  // namespace cotenant
