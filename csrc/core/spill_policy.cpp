#include "cotenant/spill_policy.h"

#include <algorithm>
#include <tuple>

namespace cotenant {

MigrationPlan plan_migrations(const std::vector<PageCandidate>& pages, std::uint64_t device_bytes,
                              std::uint64_t cap, std::size_t page_bytes, std::uint64_t ahead) {
  MigrationPlan plan;
  // Device pages coldest first: free ones (nothing to copy, nothing a kernel
  // reads) before any live one, then by heat.
  std::vector<const PageCandidate*> device, host;
  for (const PageCandidate& page : pages) {
    if (!page.holds_data && page.where != Residency::kDevice) continue;  // a free host page: no candidate
    (page.where == Residency::kDevice ? device : host).push_back(&page);
  }
  std::sort(device.begin(), device.end(), [](const PageCandidate* a, const PageCandidate* b) {
    return std::make_tuple(a->holds_data, a->last_use, a->id) < std::make_tuple(b->holds_data, b->last_use, b->id);
  });
  std::sort(host.begin(), host.end(), [](const PageCandidate* a, const PageCandidate* b) {
    return std::make_tuple(b->last_use, a->id) < std::make_tuple(a->last_use, b->id);
  });
  std::size_t coldest = 0, hottest = 0;  // next device page to spill, next host page to restore
  const std::uint64_t spill_to = device_bytes > cap ? cap - std::min(cap, ahead) : cap;
  while (device_bytes > spill_to && coldest < device.size()) {
    plan.to_host.push_back(device[coldest++]->id);
    device_bytes -= std::min<std::uint64_t>(device_bytes, page_bytes);
  }
  while (device_bytes <= cap && cap - device_bytes >= page_bytes + ahead && hottest < host.size()) {
    plan.to_device.push_back(host[hottest++]->id);
    device_bytes += page_bytes;
  }
  while (coldest < device.size() && hottest < host.size() &&
         (!device[coldest]->holds_data || host[hottest]->last_use > device[coldest]->last_use)) {
    if (!device[coldest]->holds_data) {
      plan.into_free.push_back({host[hottest++]->id, device[coldest++]->id});
      continue;
    }
    plan.to_host.push_back(device[coldest++]->id);
    plan.to_device.push_back(host[hottest++]->id);
  }
  return plan;
}

}  // namespace cotenant
