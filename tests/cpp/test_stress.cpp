// Many threads on one allocator at once: allocation, free, record_stream,
// statistics, cap changes, cache release and safe points. Run under
// ThreadSanitizer in CI; here it also checks the books balance afterwards.
#include <catch2/catch.hpp>

#include <random>
#include <mutex>
#include <string>
#include <thread>

#include "test_helpers.h"

using namespace cotenant;
using namespace cotenant::testing;

TEST_CASE("concurrent_allocation_free_and_cap_changes_leave_consistent_books", "[stress][threads]") {
  SimulatedBackend device(device_config(256 * kMiB, /*events_immediate=*/false));
  CachingAllocator allocator(device);
  // Under a cap from the start: without one a full device is out of memory
  // (as with PyTorch), and six threads' live sets can fill 256 MiB before
  // thread 0 first moves the cap.
  allocator.set_memory_cap(128 * kMiB);
  constexpr int kThreads = 6;
  std::atomic<int> running{kThreads};
  std::mutex broken_mutex;
  std::string broken;  // the first invariant a thread saw broken
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 r(static_cast<std::uint64_t>(t) + 1);
      std::vector<DevicePtr> live;
      for (int i = 0; i < 3000; ++i) {
        const int action = static_cast<int>(r() % 20);
        if (action < 9 || live.empty()) {
          const std::size_t size = r() % 4 == 0 ? 1 + r() % (24 * kMiB) : 1 + r() % (256 * 1024);
          live.push_back(allocator.allocate(size, static_cast<StreamId>(t % 3)));
        } else if (action < 17) {
          const std::size_t index = r() % live.size();
          if (r() % 4 == 0) allocator.record_stream(live[index], 50 + static_cast<StreamId>(t));
          allocator.free(live[index]);
          live[index] = live.back();
          live.pop_back();
        } else if (action == 17) {
          (void)allocator.stats();
          (void)allocator.snapshot();
          try {
            allocator.check_invariants();
          } catch (const std::exception& e) {
            std::lock_guard lock(broken_mutex);
            if (broken.empty()) broken = e.what();
          }
        } else if (action == 18) {
          device.complete_stream(50 + static_cast<StreamId>(t));
        } else if (t == 0) {
          allocator.set_memory_cap((16 + r() % 128) * kMiB);
          allocator.apply_pending_migrations();
        } else if (t == 1) {
          allocator.empty_cache();
        }
      }
      for (DevicePtr p : live) allocator.free(p);
      --running;
    });
  }
  for (auto& thread : threads) thread.join();
  INFO(broken);
  CHECK(broken.empty());
  device.synchronize_device();
  allocator.empty_cache();
  const AllocatorStats stats = allocator.stats();
  CHECK(stats.allocated_bytes.all.current == 0);
  CHECK(stats.active_bytes.all.current == 0);
  CHECK(stats.reserved_bytes.all.current == 0);
  CHECK(stats.segment.all.current == 0);
  CHECK(device.device_bytes_in_use() == 0);
  CHECK(device.host_bytes_in_use() == 0);
  CHECK(stats.allocation.all.allocated == stats.allocation.all.freed);
}
