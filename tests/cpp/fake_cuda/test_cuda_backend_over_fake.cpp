// The real CudaBackend (csrc/cuda) with the CachingAllocator, on the fake
// CUDA runtime: addresses are real memory whose pages fault unless mapped
// and accessible, copies run on stream threads, and every driver rule is
// counted. Each test ends with zero violations and nothing leaked.
#include <catch2/catch.hpp>

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "cotenant/allocator_events.h"
#include "cotenant/errors.h"
#include "devices.h"

using namespace cotenant;
using namespace cotenant::testing;

namespace {

// A safe point as the torch adapter runs one: device synchronized, page
// copies pipelined while quiescent, finished before launches resume.
std::size_t migrate_at_safe_point(CachingAllocator& allocator, cuda::CudaBackend& backend) {
  backend.synchronize_device();
  backend.set_quiescent(true);
  std::size_t moved = 0;
  try {
    moved = allocator.apply_pending_migrations();
    backend.finish_copies();
  } catch (...) {
    try {
      backend.finish_copies();  // as the adapter does: a second wait before launches resume
    } catch (...) {
    }
    backend.set_quiescent(false);
    throw;
  }
  backend.set_quiescent(false);
  return moved;
}

struct Live {
  DevicePtr address;
  std::size_t bytes;
  std::uint64_t seed;
};

// A driver or runtime entry a failure sweep fails once, and how many times
// the sweep's run calls it at least (so that the failure always fires).
struct FailingEntry {
  const char* name;
  int calls;
};

// Runs `action`; an Error (the injected failure) is the job's to survive.
template <typename Action>
void despite_failure(Action&& action) {
  try {
    action();
  } catch (const Error&) {
  }
}

// A job's calls while something fails: `count` blocks of `bytes` on two
// streams, each filled from its seed, the oldest freed after every other
// allocation, a safe point whenever moves are pending; then empty_cache()
// and, with `lift_cap`, no cap and the moves that follows. What a failure
// hits is skipped. Returns the blocks still live, with their seeds.
std::vector<std::pair<DevicePtr, std::uint64_t>> job_despite_failures(FakeCudaDevice& device,
                                                                      CachingAllocator& allocator,
                                                                      std::size_t bytes, int count, bool lift_cap) {
  std::vector<std::pair<DevicePtr, std::uint64_t>> live;
  for (std::uint64_t seed = 1; seed <= static_cast<std::uint64_t>(count); ++seed) {
    despite_failure([&] {
      const DevicePtr block = allocator.allocate(bytes, seed % 2 == 0 ? 0 : device.stream(1));
      device.fill(block, seed, bytes);
      live.push_back({block, seed});
    });
    if (allocator.has_pending_migrations()) {
      despite_failure([&] { migrate_at_safe_point(allocator, device.cuda_backend()); });
    }
    if (seed % 2 == 0 && !live.empty()) {
      despite_failure([&] {
        allocator.free(live.front().first);
        live.erase(live.begin());
      });
    }
  }
  despite_failure([&] { allocator.empty_cache(); });
  if (lift_cap) {
    despite_failure([&] { allocator.set_memory_cap(kNoCap); });
    for (int attempt = 0; attempt < 4 && allocator.has_pending_migrations(); ++attempt) {
      despite_failure([&] { migrate_at_safe_point(allocator, device.cuda_backend()); });
    }
  }
  return live;
}

// What every failure sweep checks at the end of its job: each live block
// mapped with its bytes, the allocator's books whole; then everything freed.
void check_and_free(FakeCudaDevice& device, CachingAllocator& allocator,
                    const std::vector<std::pair<DevicePtr, std::uint64_t>>& live, std::size_t bytes) {
  for (const auto& [address, seed] : live) {
    CHECK(fake_cuda::accessible(reinterpret_cast<void*>(address), bytes));
    CHECK(device.holds(address, seed, bytes));
  }
  allocator.check_invariants();
  for (const auto& block : live) despite_failure([&] { allocator.free(block.first); });
  despite_failure([&] { allocator.empty_cache(); });
}

}  // namespace

TEST_CASE("cuda_backend_over_fake_reports_the_fake_device", "[fake_cuda][backend]") {
  FakeCudaDevice device;
  cuda::CudaBackend& backend = device.cuda_backend();
  CHECK(backend.granularity() == 2 * kMiB);
  CHECK(backend.device_total_bytes() == 1 * kGiB);
  CHECK(backend.device_free_bytes() == 1 * kGiB);
  CHECK(backend.host_pages_mappable());
  CHECK(std::string(backend.host_page_kind()) == "host");
  device.check_clean();
}

// A host page is reachable for copies from its creation to its release at
// an address of its own (mapped there, the device allowed): a page move
// copies to or from it without mapping it. A copy to or from a device page
// is no page move and is refused, naming why.
TEST_CASE("cuda_backend_over_fake_copies_reach_host_pages_at_their_own_addresses", "[fake_cuda][backend]") {
  FakeCudaDevice device;
  cuda::CudaBackend& backend = device.cuda_backend();
  {
    const DevicePtr range = backend.reserve(2 * kMiB);
    const PageHandle device_page = backend.create_page(Residency::kDevice);
    backend.map(range, device_page);
    device.fill(range, 11, 2 * kMiB);
    const PageHandle host_page = backend.create_page(Residency::kHost);
    const auto maps = fake_cuda::calls("cuMemMap");
    backend.copy_out(range, host_page);
    CHECK(fake_cuda::calls("cuMemMap") == maps);  // nothing mapped for the copy
    device.fill(range, 12, 2 * kMiB);
    backend.copy_into(range, host_page);  // the bytes come back from the host page
    CHECK(device.holds(range, 11, 2 * kMiB));
    CHECK_THROWS_WITH(backend.copy_into(range, device_page), Catch::Contains("got a device page"));
    CHECK_THROWS_WITH(backend.copy_out(range, device_page), Catch::Contains("page moves go between device and host"));
    backend.unmap(range);
    backend.release_page(device_page);
    const auto unmaps = fake_cuda::calls("cuMemUnmap");
    backend.release_page(host_page);
    CHECK(fake_cuda::calls("cuMemUnmap") == unmaps + 1);  // its own mapping goes with it
    backend.release(range, 2 * kMiB);
  }
  device.check_clean();
}

TEST_CASE("cuda_backend_over_fake_spills_and_restores_many_sizes_at_the_same_addresses", "[fake_cuda][backend]") {
  FakeCudaDevice device;
  {
    CachingAllocator allocator(device.backend());
    std::vector<Live> live;
    std::uint64_t seed = 1;
    for (std::size_t bytes : {512ul, 1000ul, 4096ul, 100000ul, 1ul << 20, 3 * kMiB, 5 * kMiB + 7, 12 * kMiB,
                              25 * kMiB, 700 * 1024ul, 64ul, 2 * kMiB}) {
      const DevicePtr p = allocator.allocate(bytes, 0);
      device.fill(p, seed, bytes);
      live.push_back({p, bytes, seed++});
    }
    // Free every other one, so the cache holds holes between live blocks.
    for (std::size_t i = 1; i < live.size(); i += 2) allocator.free(live[i].address);
    std::vector<Live> kept;
    for (std::size_t i = 0; i < live.size(); i += 2) kept.push_back(live[i]);

    const auto resident = static_cast<std::uint64_t>(allocator.stats().device_resident_bytes.current);
    allocator.set_memory_cap(resident / 3);
    // Copies are delayed on the copy stream: the backend must wait for them
    // before the device pages they read are unmapped.
    fake_cuda::set_delay(std::chrono::microseconds(500));
    CHECK(migrate_at_safe_point(allocator, device.cuda_backend()) > 0);
    CHECK(static_cast<std::uint64_t>(allocator.stats().device_resident_bytes.current) <= resident / 3);
    CHECK(allocator.stats().host_resident_bytes.current > 0);
    for (const Live& l : kept) {
      INFO("block of " << l.bytes << " bytes");
      CHECK(device.holds(l.address, l.seed, l.bytes));
    }

    allocator.set_memory_cap(kNoCap);
    CHECK(allocator.apply_pending_migrations() > 0);  // not quiescent: copy_into waits for each copy
    fake_cuda::set_delay(std::chrono::microseconds(0));
    CHECK(allocator.stats().host_resident_bytes.current == 0);
    for (const Live& l : kept) CHECK(device.holds(l.address, l.seed, l.bytes));

    for (const Live& l : kept) allocator.free(l.address);
    allocator.empty_cache();
    CHECK(allocator.stats().reserved_bytes.all.current == 0);
    CHECK(device.device_bytes_in_use() == 0);
  }
  device.check_clean();
}

TEST_CASE("cuda_backend_over_fake_host_numa_pages_spill_like_host_pages", "[fake_cuda][backend]") {
  fake_cuda::Config config;
  config.host_numa_vmm = true;
  config.host_numa_id = 1;
  fake_cuda::reset(config);
  {
    cuda::CudaBackend backend(0);
    CHECK(std::string(backend.host_page_kind()) == "host-numa");
    CachingAllocator allocator(backend);
    const DevicePtr p = allocator.allocate(8 * kMiB, 0);
    const auto data = pattern(3, 8 * kMiB);
    std::memcpy(reinterpret_cast<void*>(p), data.data(), data.size());
    allocator.spill_all();
    CHECK(migrate_at_safe_point(allocator, backend) == 8 * kMiB);
    CHECK(fake_cuda::device_bytes_in_use() == 0);
    CHECK(std::memcmp(reinterpret_cast<void*>(p), data.data(), data.size()) == 0);
  }
  check_fake_cuda_clean();
}

TEST_CASE("cuda_backend_over_fake_pinned_fallback_allocates_and_frees_pinned_host_memory", "[fake_cuda][backend]") {
  DeviceSpec spec;
  spec.host_mappable = false;
  FakeCudaDevice device(spec);
  CHECK(std::string(device.cuda_backend().host_page_kind()) == "pinned-fallback");
  {
    CachingAllocator allocator(device.backend());
    allocator.set_memory_cap(4 * kMiB);
    const DevicePtr on_device = allocator.allocate(4 * kMiB, 0);
    std::vector<DevicePtr> pinned;
    for (int i = 0; i < 4; ++i) {
      pinned.push_back(allocator.allocate(3 * kMiB, 0));
      device.fill(pinned.back(), 10 + i, 3 * kMiB);
    }
    CHECK(fake_cuda::calls("cuMemHostAlloc") >= 1);
    CHECK(fake_cuda::leaks().pinned_host >= 1);
    for (int i = 0; i < 4; ++i) CHECK(device.holds(pinned[i], 10 + i, 3 * kMiB));
    for (DevicePtr p : pinned) allocator.free(p);
    allocator.empty_cache();
    CHECK(fake_cuda::leaks().pinned_host == 0);
    CHECK(fake_cuda::calls("cuMemFreeHost") == fake_cuda::calls("cuMemHostAlloc"));
    allocator.free(on_device);
  }
  device.check_clean();
}

TEST_CASE("cuda_backend_over_fake_grant_access_reaches_pages_mapped_before_and_after", "[fake_cuda][backend]") {
  fake_cuda::Config config;
  config.device_count = 2;
  fake_cuda::reset(config);
  {
    cuda::CudaBackend backend(0);
    CachingAllocator allocator(backend);
    const DevicePtr before = allocator.allocate(4 * kMiB, 0);
    const auto* p = reinterpret_cast<const void*>(before);
    CHECK(fake_cuda::device_can_access(0, p, 4 * kMiB));
    CHECK_FALSE(fake_cuda::device_can_access(1, p, 4 * kMiB));
    backend.grant_access(1);
    CHECK(fake_cuda::device_can_access(1, p, 4 * kMiB));
    const DevicePtr after = allocator.allocate(6 * kMiB, 0);
    CHECK(fake_cuda::device_can_access(1, reinterpret_cast<const void*>(after), 6 * kMiB));
    // A page that moves to the host and back keeps the peer's access.
    allocator.spill_all();
    allocator.apply_pending_migrations();
    CHECK(fake_cuda::device_can_access(1, p, 4 * kMiB));
    allocator.restore_all();
    allocator.apply_pending_migrations();
    CHECK(fake_cuda::device_can_access(1, p, 4 * kMiB));
    CHECK(fake_cuda::device_can_access(0, p, 4 * kMiB));
  }
  check_fake_cuda_clean();
}

// A page whose unmap the driver refused stays mapped, and the allocator keeps
// it: a peer granted access later must reach it like every other mapped page.
TEST_CASE("cuda_backend_over_fake_a_page_whose_unmap_was_refused_still_gets_a_peers_access", "[fake_cuda][backend]") {
  fake_cuda::Config config;
  config.device_count = 2;
  fake_cuda::reset(config);
  {
    cuda::CudaBackend backend(0);
    CachingAllocator allocator(backend);
    allocator.free(allocator.allocate(4 * kMiB, 0));
    fail_once("cuMemUnmap", 1);
    CHECK_THROWS_AS(allocator.empty_cache(), Error);
    const DevicePtr again = allocator.allocate(4 * kMiB, 0);
    backend.grant_access(1);
    CHECK(fake_cuda::device_can_access(1, reinterpret_cast<const void*>(again), 4 * kMiB));
    allocator.free(again);
  }
  check_fake_cuda_clean();
}

// The backend makes its device's context current for a call and gives the
// caller's back after; when it is current already, it sets none. It never
// sets the runtime's device (which would initialize that device's context).
TEST_CASE("cuda_backend_over_fake_leaves_the_callers_current_device_as_it_found_it", "[fake_cuda][backend]") {
  fake_cuda::Config config;
  config.device_count = 2;
  fake_cuda::reset(config);
  {
    cuda::CudaBackend backend(0);
    CachingAllocator allocator(backend);
    allocator.set_memory_cap(2 * kMiB);
    const int caller = GENERATE(0, 1);
    CAPTURE(caller);
    REQUIRE(cudaSetDevice(caller) == cudaSuccess);
    const auto device_sets = fake_cuda::calls("cudaSetDevice");
    const auto sets = fake_cuda::calls("cuCtxSetCurrent");
    const DevicePtr block = allocator.allocate(6 * kMiB, 0);
    allocator.apply_pending_migrations();  // over the cap: pages move to the host
    allocator.set_memory_cap(kNoCap);
    allocator.apply_pending_migrations();  // and back
    allocator.free(block);
    allocator.empty_cache();
    int now = -1;
    REQUIRE(cudaGetDevice(&now) == cudaSuccess);
    CHECK(now == caller);
    CHECK(fake_cuda::calls("cudaSetDevice") == device_sets);
    if (caller == 0) CHECK(fake_cuda::calls("cuCtxSetCurrent") == sets);  // already current: none set
    if (caller == 1) CHECK(fake_cuda::calls("cuCtxSetCurrent") > sets);
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
  }
  check_fake_cuda_clean();
}

// cuMemHostAlloc, cuMemHostGetDevicePointer and cuMemFreeHost need a
// context current to the calling thread. A thread whose runtime device is
// already the backend's but that never made a runtime call (a coordinator's
// thread, a user's new thread on cuda:0) has none.
TEST_CASE("cuda_backend_over_fake_pinned_host_memory_comes_and_goes_on_a_thread_with_no_context",
          "[fake_cuda][backend]") {
  fake_cuda::reset();
  {
    cuda::CudaBackend backend(0);
    std::string error;
    std::thread fresh([&] {
      try {
        const DevicePtr pinned = backend.allocate_pinned_host(4 * kMiB);
        if (pinned == 0) throw Error("no pinned host memory");
        backend.free_pinned_host_synchronized(pinned, 4 * kMiB);
      } catch (const Error& e) {
        error = e.what();
      }
    });
    fresh.join();
    CHECK(error.empty());
    INFO(error);
  }
  check_fake_cuda_clean();
}

// cudaSetDevice initializes the primary context of the device it names: a
// backend on cuda:1 that gave a thread back "device 0" that way would put a
// context, and its device memory, on a GPU the job does not use.
TEST_CASE("cuda_backend_over_fake_a_backend_on_device_1_creates_no_context_on_device_0",
          "[fake_cuda][backend]") {
  fake_cuda::Config config;
  config.device_count = 2;
  fake_cuda::reset(config);
  std::thread job([] {
    cuda::CudaBackend backend(1);
    {
      CachingAllocator allocator(backend);
      allocator.set_memory_cap(2 * kMiB);
      const DevicePtr block = allocator.allocate(6 * kMiB, 0);
      migrate_at_safe_point(allocator, backend);  // over the cap: pages move to the host
      allocator.set_memory_cap(kNoCap);
      migrate_at_safe_point(allocator, backend);  // and back
      allocator.free(block);
      allocator.empty_cache();
    }
    int device = -1;
    CHECK(cudaGetDevice(&device) == cudaSuccess);
    CHECK(device == 0);  // the thread's device is as it was
  });
  job.join();
  CHECK(fake_cuda::primary_context_initialized(1));
  CHECK_FALSE(fake_cuda::primary_context_initialized(0));
  check_fake_cuda_clean();
}

TEST_CASE("cuda_backend_over_fake_refuses_a_device_without_vmm_and_leaks_nothing", "[fake_cuda][backend]") {
  fake_cuda::Config config;
  config.vmm = false;
  fake_cuda::reset(config);
  try {
    cuda::CudaBackend backend(0);
    FAIL("a device without VMM was accepted");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("virtual memory management") != std::string::npos);
  }
  CHECK_THROWS_AS(cuda::CudaBackend(1), Error);  // out of range
  check_fake_cuda_clean();
}

TEST_CASE("cuda_backend_over_fake_unmap_waits_for_work_still_touching_a_freed_block", "[fake_cuda][backend]") {
  FakeCudaDevice device;
  {
    CachingAllocator allocator(device.backend());
    const DevicePtr block = allocator.allocate(4 * kMiB, 0);
    std::vector<char> host(4 * kMiB, 7);
    // A "kernel" still writing the block when it is freed and its pages go.
    fake_cuda::hold_streams();
    REQUIRE(cudaMemcpyAsync(reinterpret_cast<void*>(block), host.data(), host.size(), cudaMemcpyDefault, 0) ==
            cudaSuccess);
    allocator.free(block);

    SECTION("unmap synchronizes the device first") {
      allocator.empty_cache();
      CHECK(allocator.stats().reserved_bytes.all.current == 0);
    }
    SECTION("during graph capture the device cannot synchronize: cached pages stay until after it") {
      device.cuda_backend().set_graph_capture(true);
      allocator.empty_cache();
      CHECK(allocator.stats().reserved_bytes.all.current == 4 * kMiB);
      device.cuda_backend().set_graph_capture(false);
      allocator.empty_cache();
      CHECK(allocator.stats().reserved_bytes.all.current == 0);
    }
  }
  device.check_clean();  // no unmap raced the copy
}

TEST_CASE("cuda_backend_over_fake_pinned_memory_is_freed_only_after_work_on_it_is_done", "[fake_cuda][backend]") {
  DeviceSpec spec;
  spec.host_mappable = false;
  FakeCudaDevice device(spec);
  {
    CachingAllocator allocator(device.backend());
    allocator.set_memory_cap(2 * kMiB);
    const DevicePtr on_device = allocator.allocate(2 * kMiB, 0);
    const DevicePtr pinned = allocator.allocate(2 * kMiB, 0);  // over the cap: pinned host memory
    REQUIRE(allocator.stats().pinned_fallback_bytes.current == static_cast<std::int64_t>(2 * kMiB));
    std::vector<char> host(2 * kMiB, 3);
    // A "kernel" still writing the pinned block when it is freed.
    fake_cuda::hold_streams();
    REQUIRE(cudaMemcpyAsync(reinterpret_cast<void*>(pinned), host.data(), host.size(), cudaMemcpyDefault, 0) ==
            cudaSuccess);
    allocator.free(pinned);
    allocator.empty_cache();  // gives the cached pinned block back
    CHECK(allocator.stats().pinned_fallback_bytes.current == 0);
    allocator.free(on_device);
  }
  device.check_clean();  // no cuMemFreeHost raced the copy
}

TEST_CASE("cuda_backend_over_fake_pinned_cache_goes_back_after_one_synchronize_and_never_during_capture",
          "[fake_cuda][backend]") {
  DeviceSpec spec;
  spec.host_mappable = false;
  FakeCudaDevice device(spec);
  {
    CachingAllocator allocator(device.backend());
    allocator.set_memory_cap(2 * kMiB);
    const DevicePtr on_device = allocator.allocate(2 * kMiB, 0);
    std::vector<DevicePtr> pinned;
    for (int i = 0; i < 5; ++i) pinned.push_back(allocator.allocate((2 + 2 * i) * kMiB, 0));  // five sizes: no reuse
    REQUIRE(fake_cuda::calls("cuMemHostAlloc") == 5);
    for (DevicePtr p : pinned) allocator.free(p);  // kept pinned, as cache

    // During a capture the device cannot synchronize: the cache stays.
    device.cuda_backend().set_graph_capture(true);
    const std::uint64_t before_capture = fake_cuda::calls("cudaDeviceSynchronize");
    allocator.empty_cache();
    CHECK(fake_cuda::calls("cudaDeviceSynchronize") == before_capture);
    CHECK(fake_cuda::calls("cuMemFreeHost") == 0);
    CHECK(allocator.stats().pinned_fallback_bytes.current > 0);
    device.cuda_backend().set_graph_capture(false);

    // After it, one synchronize covers all five.
    const std::uint64_t before = fake_cuda::calls("cudaDeviceSynchronize");
    allocator.empty_cache();
    CHECK(fake_cuda::calls("cudaDeviceSynchronize") - before == 1);
    CHECK(fake_cuda::calls("cuMemFreeHost") == 5);
    CHECK(allocator.stats().pinned_fallback_bytes.current == 0);
    allocator.free(on_device);
  }
  device.check_clean();
}

TEST_CASE("cuda_backend_over_fake_an_allocator_going_away_synchronizes_once", "[fake_cuda][backend]") {
  FakeCudaDevice device;
  {
    CachingAllocator allocator(device.backend());
    for (int i = 0; i < 8; ++i) allocator.allocate(4 * kMiB, 0);  // 16 pages, left live
    const std::uint64_t before = fake_cuda::calls("cudaDeviceSynchronize");
    const std::uint64_t unmaps = fake_cuda::calls("cuMemUnmap");
    {
      CachingAllocator doomed(device.backend());
      for (int i = 0; i < 8; ++i) doomed.allocate(4 * kMiB, 0);
    }
    CHECK(fake_cuda::calls("cudaDeviceSynchronize") - before == 1);
    CHECK(fake_cuda::calls("cuMemUnmap") - unmaps == 16);
  }
  device.check_clean();
}

// A swap at a safe point: the device pages a cold block gives up back a hot
// block coming back, while the copies out of them may still be in flight
// (2 ms each on the copy stream). The stream runs the copy out before the
// copy in, so both blocks keep their bytes, and no device page is created.
TEST_CASE("cuda_backend_over_fake_a_swap_reuses_the_device_pages_given_up_with_copies_in_flight",
          "[fake_cuda][backend]") {
  using Call = cuda::CudaBackend::DriverCall;
  FakeCudaDevice device;
  cuda::CudaBackend& backend = device.cuda_backend();
  {
    CachingAllocator allocator(device.backend());
    allocator.set_memory_cap(4 * kMiB);
    const DevicePtr hot = allocator.allocate(4 * kMiB, 0);
    device.fill(hot, 6, 4 * kMiB);
    allocator.spill_all();
    REQUIRE(migrate_at_safe_point(allocator, backend) == 4 * kMiB);
    allocator.restore_all();
    const DevicePtr cold = allocator.allocate(4 * kMiB, 1);  // fills the cap on the device
    device.fill(cold, 7, 4 * kMiB);
    REQUIRE(migrate_at_safe_point(allocator, backend) == 0);
    allocator.free(hot);  // a free and an allocation on the host pages make them the hottest
    REQUIRE(allocator.allocate(4 * kMiB, 0) == hot);
    device.fill(hot, 8, 4 * kMiB);
    fake_cuda::set_delay(std::chrono::milliseconds(2));
    backend.reset_driver_call_times();
    allocator.set_memory_cap(4 * kMiB);  // re-plans: the swap
    REQUIRE(migrate_at_safe_point(allocator, backend) == 8 * kMiB);
    fake_cuda::set_delay(std::chrono::microseconds(0));
    CHECK(allocator.is_device_resident(hot));
    CHECK_FALSE(allocator.is_device_resident(cold));
    CHECK(device.holds(hot, 8, 4 * kMiB));
    CHECK(device.holds(cold, 7, 4 * kMiB));
    CHECK(backend.driver_call_time(Call::kCreateDevicePage).calls == 0);
    CHECK(backend.driver_call_time(Call::kReleaseDevicePage).calls == 0);
    CHECK(backend.driver_call_time(Call::kCreateHostPage).calls == 2);
    allocator.free(hot);
    allocator.free(cold);
  }
  device.check_clean();
}

// At a safe point the copies of a spill run on while more are issued, and one
// wait covers them before any page is remapped. When that wait fails, the
// copies (2 ms each on their stream) may still run: nothing is remapped, the
// host pages they fill are not released under them, and the next safe point
// moves the pages with their bytes.
TEST_CASE("cuda_backend_over_fake_a_spill_whose_copies_cannot_be_waited_for_moves_nothing_until_the_next_safe_point",
          "[fake_cuda][backend]") {
  const bool keep = GENERATE(true, false);
  CAPTURE(keep);
  FakeCudaDevice device;
  cuda::CudaBackend& backend = device.cuda_backend();
  {
    AllocatorOptions options;
    options.keep_host_pages = keep;
    CachingAllocator allocator(device.backend(), options);
    const DevicePtr block = allocator.allocate(4 * kMiB, 0);
    device.fill(block, 9, 4 * kMiB);
    allocator.spill_all();
    fake_cuda::set_delay(std::chrono::milliseconds(2));
    fake_cuda::fail_nth("cudaStreamSynchronize", 1, cudaErrorInvalidValue);
    CHECK_THROWS_WITH(migrate_at_safe_point(allocator, backend), Catch::Contains("cudaStreamSynchronize") ||
                                                                     Catch::Contains("copying pages"));
    CHECK(allocator.is_device_resident(block));
    CHECK(device.holds(block, 9, 4 * kMiB));
    CHECK(migrate_at_safe_point(allocator, backend) == 4 * kMiB);
    fake_cuda::set_delay(std::chrono::microseconds(0));
    CHECK_FALSE(allocator.is_device_resident(block));
    CHECK(device.holds(block, 9, 4 * kMiB));
    allocator.check_invariants();
    allocator.free(block);
  }
  device.check_clean();
}

// A spill waits for its copies eight pages at a time: the first pages take
// their host pages while the later ones still copy, so the driver calls of
// the remaps overlap the copies instead of following all of them. No page
// is remapped before its own copy is done.
TEST_CASE("cuda_backend_over_fake_a_spill_remaps_its_first_pages_while_the_rest_still_copy",
          "[fake_cuda][backend]") {
  using Call = cuda::CudaBackend::DriverCall;
  struct CopiesDoneAtEachMove : AllocatorEventSink {
    std::vector<std::uint64_t> done;
    void on_event(const AllocatorEvent& event) override {
      if (event.kind == AllocatorEvent::Kind::kPageMoved) done.push_back(fake_cuda::operations_completed());
    }
  } moves;
  FakeCudaDevice device;
  cuda::CudaBackend& backend = device.cuda_backend();
  {
    CachingAllocator allocator(device.backend());
    const DevicePtr block = allocator.allocate(64 * kMiB, 0);  // 32 pages
    device.fill(block, 3, 64 * kMiB);
    allocator.set_event_sink(&moves);
    fake_cuda::set_delay(std::chrono::milliseconds(3));  // each copy: 3 ms on the copy stream
    const std::uint64_t before = fake_cuda::operations_completed();
    backend.reset_driver_call_times();
    allocator.spill_all();
    REQUIRE(migrate_at_safe_point(allocator, backend) == 64 * kMiB);
    fake_cuda::set_delay(std::chrono::microseconds(0));
    allocator.set_event_sink(nullptr);
    REQUIRE(moves.done.size() == 32);
    for (std::size_t i = 0; i < moves.done.size(); ++i) {
      CAPTURE(i);
      CHECK(moves.done[i] - before >= i + 1);  // its own copy is done
    }
    // The first remap follows the first 8 copies, about 70 ms before the last
    // copy is done (a remap here takes microseconds).
    CHECK(moves.done.front() - before >= 8);
    CHECK(moves.done.front() - before < 32);
    // One wait per 8 pages, and the safe point's wait for every copy at its end.
    CHECK(backend.driver_call_time(Call::kCopyWait).calls == 5);
    CHECK(device.holds(block, 3, 64 * kMiB));
    CHECK_FALSE(allocator.is_device_resident(block));
    allocator.free(block);
  }
  device.check_clean();
}

TEST_CASE("cuda_backend_over_fake_counts_the_driver_calls_and_their_time_of_a_spill_and_a_restore",
          "[fake_cuda][backend]") {
  using Call = cuda::CudaBackend::DriverCall;
  FakeCudaDevice device;
  const std::size_t kPageBytes = 2 * kMiB;
  cuda::CudaBackend& backend = device.cuda_backend();
  {
    CachingAllocator allocator(device.backend());
    allocator.set_memory_cap(64 * kMiB);  // under a cap host pages given up are kept
    const DevicePtr block = allocator.allocate(4 * kPageBytes, 0);
    device.fill(block, 5, 4 * kPageBytes);
    fake_cuda::set_delay(std::chrono::milliseconds(2));  // each page copy takes 2 ms on its stream
    auto calls = [&](Call call) { return backend.driver_call_time(call).calls; };
    auto spill_and_count = [&] {
      backend.reset_driver_call_times();
      allocator.spill_all();
      REQUIRE(migrate_at_safe_point(allocator, backend) == 4 * kPageBytes);
      CHECK(calls(Call::kCreateDevicePage) == 0);
      CHECK(calls(Call::kReleaseDevicePage) == 4);
      CHECK(calls(Call::kCopyIssue) == 4);
      CHECK(calls(Call::kReleaseHostPage) == 0);
    };

    // The first spill pins its host pages (and maps each at its copy
    // address); then per page: the copy, and the host page mapped at the
    // block's address in the device page's place, one access call for the
    // block's 4 neighbouring pages. No page is mapped for a copy.
    spill_and_count();
    CHECK(calls(Call::kCreateHostPage) == 4);
    CHECK(calls(Call::kMap) == 8);
    CHECK(calls(Call::kSetAccess) == 4 + 1);
    CHECK(calls(Call::kUnmap) == 4);
    // The copies run one after another on the copy stream (8 ms in all) and
    // are issued in microseconds, so the wait covers much of them; 2 ms
    // leaves room for a loaded machine descheduling the issuing thread.
    CHECK(backend.driver_call_time(Call::kCopyWait).ns >= 2'000'000);

    // Back: per page a device page in the host page's place, the bytes copied
    // from the host page's copy address; the host page is kept.
    backend.reset_driver_call_times();
    CHECK(calls(Call::kCopyWait) == 0);
    allocator.restore_all();
    REQUIRE(migrate_at_safe_point(allocator, backend) == 4 * kPageBytes);
    CHECK(calls(Call::kCreateDevicePage) == 4);
    CHECK(calls(Call::kCreateHostPage) == 0);
    CHECK(calls(Call::kReleaseHostPage) == 0);
    CHECK(calls(Call::kMap) == 4);
    CHECK(calls(Call::kSetAccess) == 1);
    CHECK(calls(Call::kUnmap) == 4);
    CHECK(device.holds(block, 5, 4 * kPageBytes));
    CHECK(allocator.stats().host_pool_bytes.current == 4 * static_cast<std::int64_t>(kPageBytes));

    // Squeezed again: the kept pages take the bytes; nothing is pinned.
    spill_and_count();
    CHECK(calls(Call::kCreateHostPage) == 0);
    CHECK(calls(Call::kMap) == 4);
    CHECK(calls(Call::kSetAccess) == 1);
    CHECK(calls(Call::kUnmap) == 4);
    allocator.restore_all();
    REQUIRE(migrate_at_safe_point(allocator, backend) == 4 * kPageBytes);
    CHECK(device.holds(block, 5, 4 * kPageBytes));

    // Lifting the cap gives the kept pages back: each unmapped from its copy
    // address, then released.
    backend.reset_driver_call_times();
    allocator.set_memory_cap(kNoCap);
    CHECK(calls(Call::kReleaseHostPage) == 4);
    CHECK(calls(Call::kUnmap) == 4);
    CHECK(allocator.stats().host_pool_bytes.current == 0);
    fake_cuda::set_delay(std::chrono::microseconds(0));
    allocator.free(block);
  }
  for (auto call = 0; call < static_cast<int>(Call::kCount); ++call) {
    CHECK(std::string(cuda::CudaBackend::driver_call_name(static_cast<Call>(call))) != "unknown");
  }
  device.check_clean();
}

// A host reserve pins its pages when it is asked for, each mapped at its copy
// address: the job's first squeeze then makes the calls of one squeezed
// before (no host page created), and the allocator's end releases them.
TEST_CASE("cuda_backend_over_fake_a_host_reserve_pins_ahead_so_the_first_squeeze_pins_nothing",
          "[fake_cuda][backend]") {
  using Call = cuda::CudaBackend::DriverCall;
  FakeCudaDevice device;
  const std::size_t kPageBytes = 2 * kMiB;
  cuda::CudaBackend& backend = device.cuda_backend();
  auto calls = [&](Call call) { return backend.driver_call_time(call).calls; };
  {
    CachingAllocator allocator(device.backend());
    backend.reset_driver_call_times();
    REQUIRE(allocator.reserve_host_memory(4 * kPageBytes) == 4 * kPageBytes);
    CHECK(calls(Call::kCreateHostPage) == 4);
    CHECK(calls(Call::kMap) == 4);  // at their copy addresses
    const DevicePtr block = allocator.allocate(4 * kPageBytes, 0);
    device.fill(block, 6, 4 * kPageBytes);
    backend.reset_driver_call_times();
    allocator.set_memory_cap(2 * kPageBytes);
    REQUIRE(migrate_at_safe_point(allocator, backend) == 2 * kPageBytes);
    CHECK(calls(Call::kCreateHostPage) == 0);
    CHECK(calls(Call::kCopyIssue) == 2);
    CHECK(calls(Call::kMap) == 2);
    CHECK(calls(Call::kUnmap) == 2);
    CHECK(calls(Call::kReleaseDevicePage) == 2);
    CHECK(device.holds(block, 6, 4 * kPageBytes));
    allocator.set_memory_cap(kNoCap);
    REQUIRE(migrate_at_safe_point(allocator, backend) == 2 * kPageBytes);
    CHECK(device.holds(block, 6, 4 * kPageBytes));
    CHECK(allocator.stats().host_pool_bytes.current == 4 * static_cast<std::int64_t>(kPageBytes));
    allocator.free(block);
  }
  device.check_clean();
}

// Every driver and runtime call a page move makes, failing once at each of
// its first calls, at a safe point with copies in flight (1 ms each): the
// failed batch throws or completes, a retry finishes the moves, and then, and
// after the pages come back, every block holds its bytes; no driver rule is
// broken and nothing leaks (but the page whose release the driver refused:
// it stays with the process, as it would with a real driver).
TEST_CASE("cuda_backend_over_fake_any_call_failing_during_page_moves_loses_no_byte_and_breaks_no_rule",
          "[fake_cuda][backend][failure]") {
  // The failure fires in the spill, or in the restore that follows a spill
  // without one; `calls`: of the entry in that phase at least. (12 pages: the
  // spill maps 12 new host pages first; its first 8 copies are waited for
  // through an event; each phase waits for the copy stream once; a restore
  // remaps runs of up to 8 pages, one access call each.)
  struct PhaseEntry {
    const char* name;
    int calls;
    bool in_restore;
  };
  const PhaseEntry failing = GENERATE(
      PhaseEntry{"cuMemCreate", 8, false}, PhaseEntry{"cuMemMap", 8, false}, PhaseEntry{"cuMemSetAccess", 8, false},
      PhaseEntry{"cuMemUnmap", 8, false}, PhaseEntry{"cuMemRelease", 8, false},
      PhaseEntry{"cudaMemcpyAsync", 8, false}, PhaseEntry{"cudaStreamSynchronize", 1, false},
      PhaseEntry{"cudaEventRecord", 1, false}, PhaseEntry{"cudaEventSynchronize", 1, false},
      PhaseEntry{"cuMemCreate", 8, true}, PhaseEntry{"cuMemMap", 8, true}, PhaseEntry{"cuMemSetAccess", 2, true},
      PhaseEntry{"cuMemUnmap", 8, true}, PhaseEntry{"cuMemRelease", 8, true},
      PhaseEntry{"cudaMemcpyAsync", 8, true}, PhaseEntry{"cudaStreamSynchronize", 1, true});
  const char* entry = failing.name;
  const int nth = std::min(GENERATE(1, 2, 3, 5, 8), failing.calls);
  CAPTURE(entry, nth, failing.in_restore);
  FakeCudaDevice device;
  cuda::CudaBackend& backend = device.cuda_backend();
  {
    CachingAllocator allocator(device.backend());
    std::vector<std::pair<DevicePtr, std::uint64_t>> blocks;
    for (std::uint64_t seed = 1; seed <= 3; ++seed) {
      blocks.push_back({allocator.allocate(8 * kMiB, 0), seed});
      device.fill(blocks.back().first, seed, 8 * kMiB);
    }
    auto migrate_until_done = [&] {
      for (int attempt = 0; attempt < 4 && allocator.has_pending_migrations(); ++attempt) {
        try {
          migrate_at_safe_point(allocator, backend);
        } catch (const Error&) {
          // the injected failure: the next attempt goes on
        }
      }
    };
    std::uint64_t calls_before = 0;  // of the entry, when its failure was set
    auto fail_here = [&] {
      calls_before = fake_cuda::calls(entry);
      fail_once(entry, nth);
    };
    fake_cuda::set_delay(std::chrono::milliseconds(1));
    allocator.spill_all();
    if (!failing.in_restore) fail_here();
    migrate_until_done();
    CHECK_FALSE(allocator.has_pending_migrations());
    CHECK(allocator.stats().num_migrations == 12);  // each page moved once: a failed move is undone, not counted
    for (const auto& [address, seed] : blocks) CHECK(device.holds(address, seed, 8 * kMiB));
    allocator.restore_all();
    if (failing.in_restore) fail_here();
    migrate_until_done();
    fake_cuda::set_delay(std::chrono::microseconds(0));
    CHECK_FALSE(allocator.has_pending_migrations());
    CHECK(allocator.stats().num_migrations == 24);
    for (const auto& [address, seed] : blocks) {
      CHECK(allocator.is_device_resident(address));
      CHECK(device.holds(address, seed, 8 * kMiB));
    }
    allocator.check_invariants();
    for (const auto& block : blocks) allocator.free(block.first);
    CHECK(fake_cuda::calls(entry) >= calls_before + static_cast<std::uint64_t>(nth));  // the failure fired
  }
  device.check_clean_after_failing(entry);
}

// A live host page taking a free device page's place (plan_migrations'
// into_free) over the fake: the page's bytes are copied into the free page
// where it is mapped, then the two trade addresses. With any of the safe
// point's driver or runtime calls failing once, the safe point throws, the
// next one finishes the move, the weights keep their bytes and end on the
// device, and nothing leaks.
TEST_CASE("cuda_backend_over_fake_a_live_host_page_takes_a_free_device_pages_place_despite_any_failing_call",
          "[fake_cuda][backend][failure]") {
  const FailingEntry failing =
      GENERATE(FailingEntry{"cuMemUnmap", 4}, FailingEntry{"cuMemMap", 4}, FailingEntry{"cuMemSetAccess", 4},
               FailingEntry{"cudaMemcpyAsync", 4}, FailingEntry{"cudaStreamSynchronize", 1},
               FailingEntry{"cudaDeviceSynchronize", 1});
  const char* entry = failing.name;
  const int nth = std::min(GENERATE(1, 2, 4), failing.calls);
  CAPTURE(entry, nth);
  FakeCudaDevice device;
  {
    CachingAllocator allocator(device.backend());
    allocator.set_memory_cap(36 * kMiB);
    const DevicePtr weights = allocator.allocate(16 * kMiB, 0);
    device.fill(weights, 1, 16 * kMiB);
    const DevicePtr early = allocator.allocate(16 * kMiB, 0);
    const DevicePtr small = allocator.allocate(4 * kMiB, 0);
    const DevicePtr late = allocator.allocate(16 * kMiB, 0);  // the weights move out for it
    device.fill(late, 2, 16 * kMiB);
    migrate_at_safe_point(allocator, device.cuda_backend());
    REQUIRE_FALSE(allocator.is_device_resident(weights));
    allocator.free(small);
    allocator.free(early);
    REQUIRE(allocator.has_pending_migrations());
    const std::uint64_t calls_before = fake_cuda::calls(entry);
    fail_once(entry, nth);
    for (int attempt = 0; attempt < 3 && allocator.has_pending_migrations(); ++attempt) {
      despite_failure([&] { migrate_at_safe_point(allocator, device.cuda_backend()); });
    }
    CHECK(fake_cuda::calls(entry) >= calls_before + static_cast<std::uint64_t>(nth));  // the failure fired
    CHECK_FALSE(allocator.has_pending_migrations());
    CHECK(allocator.is_device_resident(weights));
    CHECK(allocator.host_live_bytes() == 0);
    CHECK(device.holds(weights, 1, 16 * kMiB));
    CHECK(device.holds(late, 2, 16 * kMiB));
    CHECK(fake_cuda::accessible(reinterpret_cast<void*>(early), 16 * kMiB));  // the free range stays mapped
    allocator.check_invariants();
    allocator.free(weights);
    allocator.free(late);
  }
  device.check_clean_after_failing(entry);
}

// The same sweep over a job's own calls under a cap: allocations (over the cap
// too, in colder pages' stead), frees, safe points and empty_cache(), each
// driver or runtime call failing once at one of its first 13 calls. An allocation
// the failure hits throws and leaves nothing behind; every live block keeps
// its bytes; no rule is broken; nothing leaks but a page whose release the
// driver refused.
TEST_CASE("cuda_backend_over_fake_any_call_failing_in_a_capped_job_loses_no_byte_and_breaks_no_rule",
          "[fake_cuda][backend][failure]") {
  const FailingEntry failing = GENERATE(
      FailingEntry{"cuMemCreate", 13}, FailingEntry{"cuMemMap", 13}, FailingEntry{"cuMemSetAccess", 13},
      FailingEntry{"cuMemUnmap", 13}, FailingEntry{"cuMemRelease", 13}, FailingEntry{"cudaMemcpyAsync", 9},
      FailingEntry{"cudaStreamSynchronize", 2},
      FailingEntry{"cudaDeviceSynchronize", 4}, FailingEntry{"cuMemAddressReserve", 3});
  const char* entry = failing.name;
  const int nth = std::min(GENERATE(1, 2, 4, 7, 13), failing.calls);
  CAPTURE(entry, nth);
  FakeCudaDevice device;
  {
    CachingAllocator allocator(device.backend());
    allocator.set_memory_cap(8 * kMiB);
    fake_cuda::set_delay(std::chrono::milliseconds(1));
    fail_once(entry, nth);
    const auto live = job_despite_failures(device, allocator, 3 * kMiB, 8, /*lift_cap=*/true);
    fake_cuda::set_delay(std::chrono::microseconds(0));
    check_and_free(device, allocator, live, 3 * kMiB);
    CHECK(fake_cuda::calls(entry) >= static_cast<std::uint64_t>(nth));  // the failure fired
  }
  device.check_clean_after_failing(entry);
}

// The sweep in pinned fallback mode (no host virtual memory management):
// allocations over the cap come from pinned host memory, are freed, cached
// and given back by empty_cache(), each driver or runtime call failing once.
// What the failure hits throws; every live block keeps its bytes; no rule is
// broken; nothing leaks but what the driver refused to free (and an
// allocator going away gives back everything else).
TEST_CASE("cuda_backend_over_fake_any_call_failing_in_pinned_fallback_mode_loses_no_byte_and_breaks_no_rule",
          "[fake_cuda][backend][failure]") {
  const FailingEntry failing = GENERATE(
      FailingEntry{"cuMemCreate", 3}, FailingEntry{"cuMemMap", 3}, FailingEntry{"cuMemSetAccess", 3},
      FailingEntry{"cuMemHostAlloc", 2}, FailingEntry{"cuMemFreeHost", 2},
      FailingEntry{"cuMemHostGetDevicePointer", 2}, FailingEntry{"cudaDeviceSynchronize", 1});
  const char* entry = failing.name;
  const int nth = std::min(GENERATE(1, 2, 4), failing.calls);
  CAPTURE(entry, nth);
  DeviceSpec spec;
  spec.host_mappable = false;
  FakeCudaDevice device(spec);
  {
    CachingAllocator allocator(device.backend());
    allocator.set_memory_cap(4 * kMiB);
    fail_once(entry, nth);
    const auto live = job_despite_failures(device, allocator, 2 * kMiB, 6, /*lift_cap=*/false);
    check_and_free(device, allocator, live, 2 * kMiB);
    CHECK(fake_cuda::calls(entry) >= static_cast<std::uint64_t>(nth));  // the failure fired
  }
  device.check_clean_after_failing(entry);
}

namespace {

using ProbeRows = std::vector<cuda::CudaBackend::VmmProbeRow>;

const cuda::CudaBackend::VmmProbeRow* probe_row(const ProbeRows& rows, const std::string& side, std::size_t extent,
                                                const std::string& step) {
  for (const auto& row : rows) {
    if (row.side == side && row.extent_bytes == extent && row.step == step) return &row;
  }
  return nullptr;
}

}  // namespace

// The driver probe (bench_allocator.py's measured.vmm_probe) makes each
// step's calls on both sides, a pass per extent, and gives back everything
// it made: allocations, mappings and address ranges. Mapping a page from
// part of a larger allocation is refused, as on a GPU, and ends the pieces.
TEST_CASE("cuda_backend_over_fake_the_vmm_probe_times_every_step_and_gives_everything_back",
          "[fake_cuda][backend]") {
  FakeCudaDevice device;
  cuda::CudaBackend& backend = device.cuda_backend();
  const std::uint64_t creates_before = fake_cuda::calls("cuMemCreate");
  const ProbeRows rows = backend.probe_vmm_costs(16 * kMiB, {2 * kMiB, 8 * kMiB});
  for (const char* side : {"device", "host"}) {
    for (std::size_t extent : {2 * kMiB, 8 * kMiB}) {
      const std::uint64_t count = 16 * kMiB / extent;
      INFO(side << " extent " << extent);
      for (const char* step : {"create", "map", "set_access", "unmap", "map_again", "set_access_again", "release"}) {
        const auto* row = probe_row(rows, side, extent, step);
        REQUIRE(row != nullptr);
        CHECK(row->calls == count);
        CHECK(row->error.empty());
      }
      const auto* whole = probe_row(rows, side, extent, "set_access_whole");
      REQUIRE(whole != nullptr);
      CHECK(whole->calls == 1);
      const auto* piece = probe_row(rows, side, extent, "map_piece");
      const auto* piece_access = probe_row(rows, side, extent, "set_access_piece");
      if (extent == 2 * kMiB) {
        CHECK(piece == nullptr);  // a page is its own allocation: no pieces
      } else {
        REQUIRE(piece != nullptr);
        CHECK(piece->calls == 1);  // the first piece, at offset 0, maps; the second does not
        CHECK(piece->error == "CUDA_ERROR_NOT_SUPPORTED");
        CHECK(piece_access == nullptr);
      }
    }
  }
  CHECK(rows.size() == 2 * (8 + 8 + 1));
  // 8 + 2 allocations per side, and one more for the pieces of 8 MiB.
  CHECK(fake_cuda::calls("cuMemCreate") - creates_before == 2 * (8 + 2 + 1));
  CHECK_THROWS_WITH(backend.probe_vmm_costs(16 * kMiB, {3 * kMiB}),
                    Catch::Contains("multiple of the page") && Catch::Contains("3145728"));
  CHECK_THROWS_WITH(backend.probe_vmm_costs(16 * kMiB, {6 * kMiB}), Catch::Contains("divide total_bytes"));
  device.check_clean();
}

// A driver call the probe makes failing ends that pass with the refusal in
// its row; the passes after it run, and nothing the failed pass made stays.
TEST_CASE("cuda_backend_over_fake_a_refusal_during_the_vmm_probe_ends_its_pass_and_leaks_nothing",
          "[fake_cuda][backend]") {
  const std::pair<const char*, const char*> entries[] = {
      {"cuMemCreate", "create"}, {"cuMemMap", "map"}, {"cuMemSetAccess", "set_access"},
      {"cuMemUnmap", "unmap"}, {"cuMemRelease", "release"}};
  for (const auto& [entry, step] : entries) {
    INFO("failing the second " << entry);
    {
      FakeCudaDevice device;
      fail_once(entry, 2);
      const ProbeRows rows = device.cuda_backend().probe_vmm_costs(8 * kMiB, {2 * kMiB, 4 * kMiB});
      std::vector<std::string> errors;
      for (const auto& row : rows) {
        if (!row.error.empty() && row.step != "map_piece") {  // the driver refuses pieces (see above)
          errors.push_back(row.side + " " + std::to_string(row.extent_bytes) + " " + row.step);
        }
      }
      REQUIRE(errors.size() == 1);
      CHECK(errors[0] == std::string("device 2097152 ") + step);
      const auto* failed = probe_row(rows, "device", 2 * kMiB, step);
      CHECK(failed->calls == 1);
      CHECK(failed->error == "CUDA_ERROR_INVALID_VALUE");
      if (std::string(step) != "release") {  // the pass ended there (release is its last step)
        CHECK(probe_row(rows, "device", 2 * kMiB, "set_access_whole") == nullptr);
      }
      for (const char* side : {"device", "host"}) {
        const auto* release = probe_row(rows, side, 4 * kMiB, "release");
        REQUIRE(release != nullptr);  // later passes ran whole
        CHECK(release->error.empty());
      }
      device.check_clean();
    }
  }
  // The pieces' own allocation and address range (set-up, untimed): a
  // refusal there is reported under its own name, and the pieces are left
  // out of that pass only.
  const std::pair<const char*, int> setups[] = {{"cuMemAddressReserve", 3}, {"cuMemCreate", 7}};
  for (const auto& [entry, nth] : setups) {
    INFO("failing call " << nth << " of " << entry);
    FakeCudaDevice device;
    fail_once(entry, nth);
    const ProbeRows rows = device.cuda_backend().probe_vmm_costs(8 * kMiB, {2 * kMiB, 4 * kMiB});
    const std::string step = std::string(entry) == "cuMemCreate" ? "piece_create" : "piece_reserve";
    const auto* failed = probe_row(rows, "device", 4 * kMiB, step);
    REQUIRE(failed != nullptr);
    CHECK(failed->error == "CUDA_ERROR_INVALID_VALUE");
    CHECK(probe_row(rows, "device", 4 * kMiB, "map_piece") == nullptr);
    CHECK(probe_row(rows, "device", 4 * kMiB, "release") != nullptr);  // the pass itself ran whole
    REQUIRE(probe_row(rows, "host", 4 * kMiB, "map_piece") != nullptr);  // later passes did too
    CHECK(probe_row(rows, "host", 4 * kMiB, "map_piece")->error == "CUDA_ERROR_NOT_SUPPORTED");
    device.check_clean();
  }
}
