// The allocator's fast path asks the heap for nothing once a loop is warm:
// the blocks a split needs and the live map's entries come from those the
// loop's earlier frees gave up. Counted with a replaced global operator new,
// so this is a program of its own (and not built under the sanitizers, which
// replace operator new themselves).
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

#include <atomic>
#include <cstdlib>
#include <new>
#include <vector>

#include "cotenant/caching_allocator.h"
#include "cotenant/simulated_backend.h"

namespace {

std::atomic<bool> counting{false};
std::atomic<long> heap_calls{0};

}  // namespace

void* operator new(std::size_t bytes) {
  if (counting.load(std::memory_order_relaxed)) heap_calls.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept {
  if (p != nullptr && counting.load(std::memory_order_relaxed)) heap_calls.fetch_add(1, std::memory_order_relaxed);
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept { operator delete(p); }

namespace {

using namespace cotenant;

constexpr std::size_t kMiB = std::size_t{1} << 20;

// Heap calls made by `call` alone.
template <class Call>
long heap_calls_of(Call call) {
  const long before = heap_calls.load();
  counting.store(true);
  call();
  counting.store(false);
  return heap_calls.load() - before;
}

// One step of a training-like loop: activations that live through the step
// (freed last in, first out), temporaries freed at once, a few large
// blocks, and a gradient that outlives the step (freed in the next one).
// Returns the heap calls made inside allocate() and free().
// `side_stream` nonzero: every fourth activation is used on that stream too
// (record_stream), so its free waits for an event.
long step(CachingAllocator& allocator, DevicePtr* gradient, StreamId side_stream = 0) {
  long calls = 0;
  std::vector<DevicePtr> activations;
  activations.reserve(64);
  const std::size_t sizes[] = {4096, 300 * 1024, 3 * kMiB, 512, 12 * kMiB, 70000};
  for (int layer = 0; layer < 32; ++layer) {
    DevicePtr kept = 0, temporary = 0;
    calls += heap_calls_of([&] { kept = allocator.allocate(sizes[layer % 6], 0); });
    calls += heap_calls_of([&] { temporary = allocator.allocate(sizes[(layer + 3) % 6] / 2 + 512, 0); });
    calls += heap_calls_of([&] { allocator.free(temporary); });
    if (side_stream != 0 && layer % 4 == 0) calls += heap_calls_of([&] { allocator.record_stream(kept, side_stream); });
    activations.push_back(kept);
  }
  DevicePtr next_gradient = 0;
  calls += heap_calls_of([&] { next_gradient = allocator.allocate(5 * kMiB, 0); });
  if (*gradient != 0) calls += heap_calls_of([&] { allocator.free(*gradient); });
  *gradient = next_gradient;
  for (auto it = activations.rbegin(); it != activations.rend(); ++it) {
    calls += heap_calls_of([&] { allocator.free(*it); });
  }
  allocator.mark_iteration();
  return calls;
}

TEST_CASE("a_warm_loop_allocates_and_frees_without_asking_the_heap", "[allocator]") {
  SimulatedDeviceConfig config;
  config.device_capacity = std::size_t{1} << 30;
  SimulatedBackend device(config);
  CachingAllocator allocator(device);
  DevicePtr gradient = 0;
  // The first steps build the layout (blocks, map entries, the plan's
  // records; the plan settles in the fifth step here).
  const long cold = step(allocator, &gradient);
  CHECK(cold > 0);  // the counter sees the allocator's own heap calls
  for (int warm_up = 0; warm_up < 5; ++warm_up) step(allocator, &gradient);
  for (int warm = 0; warm < 3; ++warm) CHECK(step(allocator, &gradient) == 0);
  allocator.free(gradient);
  allocator.check_invariants();
  CHECK(allocator.stats().allocated_bytes.all.current == 0);
}

// A free that waits on record_stream's events records them into the block's
// own list, and the allocations that retire it do so in place: no heap call
// of their own. What is left: a block object handed out without room in its
// stream or event list (block objects move between holes as blocks split
// and merge) grows it once.
TEST_CASE("a_warm_loop_with_record_stream_asks_the_heap_less_than_once_per_waiting_free", "[allocator]") {
  SimulatedDeviceConfig config;
  config.device_capacity = std::size_t{1} << 30;
  SimulatedBackend device(config);  // events complete at once: the next allocation retires a waiting block
  CachingAllocator allocator(device);
  DevicePtr gradient = 0;
  for (int warm_up = 0; warm_up < 6; ++warm_up) step(allocator, &gradient, /*side_stream=*/7);
  const std::uint64_t events_before = device.calls().record_event;
  long warm_calls = 0;
  for (int warm = 0; warm < 3; ++warm) warm_calls += step(allocator, &gradient, /*side_stream=*/7);
  const auto waiting_frees = static_cast<long>(device.calls().record_event - events_before);
  CHECK(waiting_frees == 3 * 8);  // every fourth of 32 activations, three steps
  CHECK(warm_calls < waiting_frees);
  allocator.free(gradient);
  allocator.check_invariants();
  CHECK(allocator.stats().allocated_bytes.all.current == 0);
}

}  // namespace
