#include <catch2/catch.hpp>

#include "cotenant/errors.h"
#include "test_helpers.h"

using namespace cotenant;
using namespace cotenant::testing;

TEST_CASE("simulated_device_reports_out_of_memory_when_full", "[simulated]") {
  SimulatedBackend device(device_config(4 * kMiB));
  PageHandle a = device.create_page(Residency::kDevice);
  PageHandle b = device.create_page(Residency::kDevice);
  CHECK(a);
  CHECK(b);
  CHECK_FALSE(device.create_page(Residency::kDevice));
  CHECK(device.device_free_bytes() == 0);
  CHECK(device.calls().failed_create_page == 1);
  device.release_page(a);
  CHECK(device.device_free_bytes() == 2 * kMiB);
  CHECK(device.create_page(Residency::kDevice));
  CHECK(device.create_page(Residency::kHost));  // host pages do not count against the device
}

TEST_CASE("simulated_pages_keep_their_bytes_across_remapping", "[simulated]") {
  SimulatedBackend device(device_config(8 * kMiB));
  const DevicePtr base = device.reserve(4 * kMiB);
  PageHandle first = device.create_page(Residency::kDevice);
  device.map(base, first);
  fill(device, base + 100, 7, 5000);
  CHECK(holds(device, base + 100, 7, 5000));

  PageHandle host = device.create_page(Residency::kHost);
  device.unmap(base);
  device.map(base, host);
  device.copy_into(base, first);
  device.release_page(first);
  CHECK(device.residency_at(base) == Residency::kHost);
  CHECK(holds(device, base + 100, 7, 5000));
}

TEST_CASE("simulated_unwritten_pages_read_as_zeros_and_cost_no_memory", "[simulated]") {
  SimulatedBackend device(device_config(8 * kMiB));
  const DevicePtr base = device.reserve(2 * kMiB);
  device.map(base, device.create_page(Residency::kDevice));
  std::vector<std::uint8_t> bytes(64, 0xff);
  device.read(base, bytes.data(), bytes.size());
  CHECK(std::all_of(bytes.begin(), bytes.end(), [](std::uint8_t b) { return b == 0; }));
}

TEST_CASE("simulated_device_refuses_access_to_unmapped_addresses", "[simulated]") {
  SimulatedBackend device(device_config(8 * kMiB));
  const DevicePtr base = device.reserve(2 * kMiB);
  std::uint8_t byte = 1;
  CHECK_THROWS_AS(device.write(base, &byte, 1), Error);
  CHECK_THROWS_AS(device.map(base + 1, device.create_page(Residency::kDevice)), Error);
}

TEST_CASE("simulated_events_complete_only_when_their_stream_does", "[simulated]") {
  SimulatedBackend device(device_config(8 * kMiB, /*events_immediate=*/false));
  EventHandle on_one = device.create_event();
  EventHandle on_two = device.create_event();
  device.record_event(on_one, 1);
  device.record_event(on_two, 2);
  CHECK_FALSE(device.query_event(on_one));
  device.complete_stream(1);
  CHECK(device.query_event(on_one));
  CHECK_FALSE(device.query_event(on_two));
  device.synchronize_device();
  CHECK(device.query_event(on_two));
}

TEST_CASE("simulated_host_pages_need_host_vmm_to_be_mapped", "[simulated]") {
  SimulatedBackend device(device_config(8 * kMiB, true, /*host_mappable=*/false));
  const DevicePtr base = device.reserve(2 * kMiB);
  CHECK_THROWS_AS(device.map(base, device.create_page(Residency::kHost)), Error);
  const DevicePtr pinned = device.allocate_pinned_host(1000);
  REQUIRE(pinned != 0);
  fill(device, pinned, 3, 1000);
  CHECK(holds(device, pinned, 3, 1000));
  CHECK(device.residency_at(pinned) == Residency::kHost);
  device.free_pinned_host(pinned, 1000);
}
