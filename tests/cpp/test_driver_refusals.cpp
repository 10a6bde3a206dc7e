// The allocator's books when the driver refuses a call: the books keep
// saying what is mapped and reserved, and nothing is stranded. The simulated
// device cannot refuse these calls itself, so a thin backend over it does,
// once, on the call a test names.
#include <catch2/catch.hpp>

#include "cotenant/errors.h"
#include "test_helpers.h"

using namespace cotenant;
using namespace cotenant::testing;

namespace {

// The simulated device, but the nth unmap or the nth release of an address
// range from the moment a test arms it throws, as a driver error would.
class RefusingBackend final : public Backend {
 public:
  explicit RefusingBackend(SimulatedDeviceConfig config) : device(config) {}

  SimulatedBackend device;
  int unmaps_until_refusal = 0;    // 0: none refused
  int releases_until_refusal = 0;  // 0: none refused
  std::size_t granularity_bytes = 0;  // 0: the device's

  std::size_t granularity() const override { return granularity_bytes != 0 ? granularity_bytes : device.granularity(); }
  std::size_t device_total_bytes() const override { return device.device_total_bytes(); }
  std::size_t device_free_bytes() const override { return device.device_free_bytes(); }
  bool host_pages_mappable() const override { return device.host_pages_mappable(); }
  std::optional<std::size_t> host_available_bytes() const override { return device.host_available_bytes(); }
  DevicePtr reserve(std::size_t bytes) override { return device.reserve(bytes); }
  void release(DevicePtr base, std::size_t bytes) override {
    if (releases_until_refusal > 0 && --releases_until_refusal == 0) throw Error("injected: the driver refused to free an address range");
    device.release(base, bytes);
  }
  PageHandle create_page(Residency where) override { return device.create_page(where); }
  void release_page(PageHandle page) override { device.release_page(page); }
  void map(DevicePtr address, PageHandle page) override { device.map(address, page); }
  void unmap(DevicePtr address) override {
    if (unmaps_until_refusal > 0 && --unmaps_until_refusal == 0) throw Error("injected: the driver refused an unmap");
    device.unmap(address);
  }
  bool synchronize_for_unmap() override { return device.synchronize_for_unmap(); }
  void copy_into(DevicePtr address, PageHandle src) override { device.copy_into(address, src); }
  void copy_out(DevicePtr address, PageHandle dst) override { device.copy_out(address, dst); }
  void zero(DevicePtr address, std::size_t bytes) override { device.zero(address, bytes); }
  DevicePtr allocate_pinned_host(std::size_t bytes) override { return device.allocate_pinned_host(bytes); }
  void free_pinned_host(DevicePtr address, std::size_t bytes) override { device.free_pinned_host(address, bytes); }
  EventHandle create_event() override { return device.create_event(); }
  void destroy_event(EventHandle event) override { device.destroy_event(event); }
  void record_event(EventHandle event, StreamId stream) override { device.record_event(event, stream); }
  bool query_event(EventHandle event) override { return device.query_event(event); }
  void synchronize_event(EventHandle event) override { device.synchronize_event(event); }
  void synchronize_device() override { device.synchronize_device(); }
};

}  // namespace

// Regression (csrc/core/caching_allocator.cpp, back_block): an allocation
// that found no page undid its live marks on the block's pages, then gave
// back the pages it had mapped; when the driver refused one of those unmaps,
// the error path undid the live marks a second time, so each page counted
// 2^32 - 1 live blocks: never released as cache again, not even by
// empty_cache(), and moved at every safe point as if it held data.
TEST_CASE("an_unmap_refused_while_a_failed_allocation_gives_back_its_pages_leaves_them_as_cache",
          "[allocator][driver]") {
  RefusingBackend backend(device_config(8 * kMiB));  // four pages
  CachingAllocator other(backend.device);             // another process, on two of them
  const DevicePtr others = other.allocate(4 * kMiB, 0);
  CachingAllocator allocator(backend);
  backend.unmaps_until_refusal = 1;
  // Three pages where two are free, no cap: two are mapped, the third
  // cannot be had, and giving back the first of the two is refused.
  CHECK_THROWS_AS(allocator.allocate(6 * kMiB, 0), Error);
  CHECK(backend.unmaps_until_refusal == 0);  // the refusal happened
  CHECK_NOTHROW(allocator.check_invariants());
  CHECK(allocator.stats().allocated_bytes.all.current == 0);
  // The pages mapped so far stay, as cache: empty_cache() gives them back.
  allocator.empty_cache();
  CHECK_NOTHROW(allocator.check_invariants());
  CHECK(allocator.stats().reserved_bytes.all.current == 0);
  CHECK(backend.device.device_bytes_in_use() == 4 * kMiB);  // the other process's
  other.free(others);
  other.empty_cache();
  const DevicePtr fits = allocator.allocate(8 * kMiB, 0);  // the whole device is usable again
  allocator.free(fits);
  allocator.empty_cache();
  CHECK(allocator.stats().segment.all.current == 0);
}

// Regression (csrc/core/caching_allocator.cpp, empty_cache): a whole free
// arena left its pool before its address range was given back; when the
// driver refused that, the arena's one block was in no state at all (not
// free, not allocated, not waiting): never reused, and never given back by
// a later empty_cache().
TEST_CASE("an_address_range_the_driver_refuses_to_free_stays_a_free_arena_for_the_next_empty_cache",
          "[allocator][driver]") {
  RefusingBackend backend(device_config(64 * kMiB));
  CachingAllocator allocator(backend);
  allocator.free(allocator.allocate(4096, 0));
  backend.releases_until_refusal = 1;
  CHECK_THROWS_AS(allocator.empty_cache(), Error);
  CHECK_NOTHROW(allocator.check_invariants());
  CHECK(allocator.stats().segment.all.current == 1);
  allocator.empty_cache();  // the driver frees it this time
  CHECK_NOTHROW(allocator.check_invariants());
  CHECK(allocator.stats().segment.all.current == 0);
  CHECK(allocator.stats().reserved_bytes.all.current == 0);
}

// A page's index is a shift and a size rounds by a mask, so the allocator
// takes only a power-of-two page granularity (every driver's is) and says
// so at construction, before any allocation could compute a wrong page.
TEST_CASE("an_allocator_refuses_a_granularity_that_is_not_a_power_of_two", "[allocator][driver]") {
  RefusingBackend backend(device_config(64 * kMiB));
  backend.granularity_bytes = 3 * kMiB;
  CHECK_THROWS_WITH(CachingAllocator(backend),
                    Catch::Contains("page granularity (3145728 bytes) is not a power of two"));
  backend.granularity_bytes = 0;
  CachingAllocator allocator(backend);
  CHECK(allocator.allocate(kMiB, 0) != 0);
}
