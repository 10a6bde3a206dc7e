// The private pools of CUDA graphs and torch.cuda.MemPool, as PyTorch's own
// code drives them (torch.cuda.graph, graph_pool_handle sharing, MemPool and
// use_mem_pool, empty_cache between captures), on the simulated device.

#include <catch2/catch.hpp>

#include <atomic>
#include <memory>
#include <thread>

#include "cotenant/errors.h"
#include "cotenant/pool_table.h"
#include "test_helpers.h"

using namespace cotenant;
using namespace cotenant::testing;

namespace {

constexpr PoolId kGraphA{1, 0};
constexpr PoolId kGraphB{2, 0};
constexpr PoolId kMemPool{0, 1};
constexpr StreamId kCaptureStream = 7;

PoolTable::StreamFilter only(StreamId stream) {
  return [stream](StreamId s) { return s == stream; };
}

// A capture as torch.cuda.graph() makes one: begin, allocate and free a
// temporary (the replay still touches it), keep an output, end.
DevicePtr capture(PoolTable& table, PoolId id, SimulatedBackend& device, std::uint64_t seed,
                  DevicePtr* temporary = nullptr) {
  table.begin_route(id, only(kCaptureStream));
  CachingAllocator* pool = table.route_for(kCaptureStream).get();
  REQUIRE(pool != nullptr);
  const DevicePtr scratch = pool->allocate(3 * kMiB, kCaptureStream);
  const DevicePtr output = pool->allocate(1 * kMiB, kCaptureStream);
  fill(device, output, seed, kMiB);
  pool->free(scratch);
  table.end_route(id);
  if (temporary) *temporary = scratch;
  return output;
}

}  // namespace

TEST_CASE("empty_cache_between_captures_keeps_the_first_graphs_pages", "[pools]") {
  // torch.cuda.graph() calls empty_cache() on entry: capturing graph B must
  // not release what graph A replays, freed temporaries included.
  SimulatedBackend device(device_config(256 * kMiB));
  PoolTable table(device);
  DevicePtr scratch_a = 0;
  const DevicePtr output_a = capture(table, kGraphA, device, 11, &scratch_a);
  const std::size_t reserved = table.find(kGraphA)->stats().reserved_bytes.all.current;

  CHECK(table.empty_freeable() == 0);
  capture(table, kGraphB, device, 12);

  CHECK(table.use_count(kGraphA) == 1);
  CHECK(table.find(kGraphA)->stats().reserved_bytes.all.current == static_cast<std::int64_t>(reserved));
  CHECK(device.residency_at(scratch_a) == Residency::kDevice);  // the replay's temporary is still mapped
  CHECK(holds(device, output_a, 11, kMiB));
}

TEST_CASE("a_released_graph_pool_is_emptied_and_dropped_once_its_blocks_are_free", "[pools]") {
  SimulatedBackend device(device_config(256 * kMiB));
  PoolTable table(device);
  const DevicePtr output = capture(table, kGraphA, device, 3);
  table.release(kGraphA);  // the graph is reset; its output tensor still lives
  REQUIRE(table.find(kGraphA) != nullptr);
  CHECK(table.use_count(kGraphA) == 0);
  CHECK(table.find(kGraphA)->stats().reserved_bytes.all.current == static_cast<std::int64_t>(2 * kMiB));
  table.find(kGraphA)->free(output);
  CHECK(table.empty_freeable() == 1);
  CHECK(table.find(kGraphA) == nullptr);
  CHECK(device.device_bytes_in_use() == 0);
}

TEST_CASE("beginning_allocation_to_an_existing_pool_adds_a_holder", "[pools]") {
  // A MemPool holds its pool; use_mem_pool begins (a holder more) and then
  // ends and releases (a holder fewer): the pool and its tensor stay.
  SimulatedBackend device(device_config(256 * kMiB));
  PoolTable table(device);
  table.create_or_incref(kMemPool);
  CHECK(table.use_count(kMemPool) == 1);
  table.begin_route(kMemPool, only(kCaptureStream));
  CHECK(table.use_count(kMemPool) == 2);
  const DevicePtr x = table.route_for(kCaptureStream)->allocate(4 * kMiB, kCaptureStream);
  fill(device, x, 5, 4 * kMiB);
  table.end_route(kMemPool);
  table.release(kMemPool);
  CHECK(table.use_count(kMemPool) == 1);
  CHECK(table.empty_freeable() == 0);
  CHECK(holds(device, x, 5, 4 * kMiB));

  // Two graphs sharing one pool (graph_pool_handle): resetting one keeps the other's memory.
  capture(table, kGraphA, device, 1);
  const DevicePtr shared = capture(table, kGraphA, device, 2);
  CHECK(table.use_count(kGraphA) == 2);
  table.release(kGraphA);
  CHECK(table.empty_freeable() == 0);
  CHECK(holds(device, shared, 2, kMiB));
}

TEST_CASE("a_pool_already_receiving_allocations_cannot_begin_again", "[pools]") {
  SimulatedBackend device(device_config(64 * kMiB));
  PoolTable table(device);
  table.begin_route(kGraphA, only(kCaptureStream));
  CHECK_THROWS_AS(table.begin_route(kGraphA, only(kCaptureStream)), Error);
  CHECK(table.use_count(kGraphA) == 1);  // the refused call changed nothing
  table.end_route(kGraphA);
  CHECK_FALSE(table.routing());
}

TEST_CASE("routes_take_only_the_streams_their_filter_accepts", "[pools]") {
  SimulatedBackend device(device_config(64 * kMiB));
  PoolTable table(device);
  CHECK(table.route_for(kCaptureStream) == nullptr);
  table.begin_route(kGraphA, only(kCaptureStream));
  CHECK(table.routing());
  PoolId routed{};
  CHECK(table.route_for(kCaptureStream, &routed) == table.find(kGraphA));
  CHECK(routed == kGraphA);
  CHECK(table.route_for(kCaptureStream + 1) == nullptr);
  table.end_route(kGraphA);
  CHECK(table.route_for(kCaptureStream) == nullptr);
}

TEST_CASE("a_pool_never_unmaps_cached_pages_to_grow", "[pools]") {
  // A graph pool must not release cache to grow, since a replay writes to
  // blocks its capture freed; iteration marks never reach a pool.
  SimulatedBackend device(device_config(256 * kMiB));
  PoolTable table(device);
  table.begin_route(kGraphA, only(kCaptureStream));
  CachingAllocator* pool = table.route_for(kCaptureStream).get();
  const DevicePtr first = pool->allocate(12 * kMiB, kCaptureStream);
  const DevicePtr between = pool->allocate(2 * kMiB, kCaptureStream);
  pool->free(first);
  const DevicePtr second = pool->allocate(16 * kMiB, kCaptureStream);  // does not fit the freed range
  CHECK(second != first);
  CHECK(device.residency_at(first) == Residency::kDevice);
  CHECK(device.calls().unmap == 0);
  CHECK(pool->stats().reserved_bytes.all.current == static_cast<std::int64_t>(30 * kMiB));
  pool->free(between);
  table.end_route(kGraphA);
}

TEST_CASE("a_released_pool_is_not_dropped_while_a_capture_runs", "[pools]") {
  // Dropping a pool unmaps its pages, which needs a device synchronize that a
  // capture in progress forbids: the pool goes at a later empty_cache.
  SimulatedBackend device(device_config(256 * kMiB));
  PoolTable table(device);
  const DevicePtr output = capture(table, kGraphA, device, 9);
  table.find(kGraphA)->free(output);
  table.begin_route(kGraphB, only(kCaptureStream));
  table.release(kGraphA);
  CHECK(table.find(kGraphA) != nullptr);
  table.end_route(kGraphB);
  CHECK(table.empty_freeable() == 1);
  CHECK(table.find(kGraphA) == nullptr);
}

TEST_CASE("a_released_pool_whose_pages_a_capture_keeps_stays_until_they_go", "[pools]") {
  // A capture the table does not route (another library's, or another
  // device's stream) still forbids the synchronize an unmap needs. The
  // pool's empty_cache then keeps its pages; dropped, the pool would release
  // them in its destructor, on whichever thread let it go last (a reader of
  // pools() or find()), perhaps during that capture. It stays instead, and
  // goes at the next empty_freeable that can release its pages.
  SimulatedBackend device(device_config(256 * kMiB));
  PoolTable table(device);
  table.create_or_incref(kMemPool);
  std::shared_ptr<CachingAllocator> pool = table.find(kMemPool);
  pool->free(pool->allocate(3 * kMiB, 0));
  REQUIRE(pool->stats().reserved_bytes.all.current == static_cast<std::int64_t>(4 * kMiB));
  pool.reset();
  device.refuse_synchronization(true);
  table.release(kMemPool);
  auto kept = table.find(kMemPool);
  REQUIRE(kept != nullptr);
  CHECK(kept->stats().reserved_bytes.all.current == static_cast<std::int64_t>(4 * kMiB));
  CHECK(device.calls().unmap == 0);
  CHECK(table.empty_freeable() == 1);  // still refused: kept
  CHECK(table.find(kMemPool) != nullptr);
  device.refuse_synchronization(false);
  std::weak_ptr<CachingAllocator> watch = kept;
  kept.reset();
  CHECK(table.empty_freeable() == 1);
  CHECK(table.find(kMemPool) == nullptr);
  CHECK(watch.expired());
  CHECK(device.calls().unmap == 2);
}

TEST_CASE("a_pool_released_on_one_thread_outlives_a_reader_that_holds_it_on_another", "[pools]") {
  // Statistics and snapshots walk every pool while another thread may
  // release one (a graph freed, a MemPool collected): what the table handed
  // out stays valid until the reader lets it go, and the pool is gone after.
  SimulatedBackend device(device_config(256 * kMiB));
  PoolTable table(device);
  table.create_or_incref(kMemPool);
  std::shared_ptr<CachingAllocator> held = table.find(kMemPool);
  auto listed = table.pools();
  REQUIRE(listed.size() == 1);
  table.release(kMemPool);  // the last holder: dropped from the table at once (no live block)
  CHECK(table.find(kMemPool) == nullptr);
  CHECK(table.pools().empty());
  CHECK(held->stats().allocated_bytes.all.current == 0);  // still an allocator, not freed memory
  CHECK(listed[0].second->stats().reserved_bytes.all.current == 0);
  std::weak_ptr<CachingAllocator> watch = held;
  held.reset();
  listed.clear();
  CHECK(watch.expired());

  // The same race on two threads, many times over (the sanitizer builds catch a use after free).
  std::atomic<bool> done{false};
  std::thread reader([&] {
    while (!done.load()) {
      for (const auto& [id, pool] : table.pools()) (void)pool->stats();
      if (auto pool = table.find(kGraphA)) pool->reset_peak_stats();
    }
  });
  for (int round = 0; round < 300; ++round) {
    table.begin_route(kGraphA, only(kCaptureStream));
    std::shared_ptr<CachingAllocator> pool = table.route_for(kCaptureStream);
    const DevicePtr block = pool->allocate(1 * kMiB, kCaptureStream);
    table.end_route(kGraphA);
    pool->free(block);
    pool.reset();
    table.release(kGraphA);
    table.empty_freeable();
  }
  done.store(true);
  reader.join();
  CHECK(table.pools().empty());
}
