// Driver failures in the middle of an allocation or a page move, injected
// into the fake CUDA runtime: the allocator must stay usable, keep the bytes
// of live blocks where it says they are, and leak no mapping or handle.
//
// The tests marked "Regression" each caught an exception-safety bug in the
// tree before commit 89e62bf (they fail against 0f6611f).
#include <catch2/catch.hpp>
#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <vector>

#include "cotenant/errors.h"
#include "cuda_driver.h"
#include "devices.h"

using namespace cotenant;
using namespace cotenant::testing;

namespace {

// Every live block's bytes, checked only where the driver says they can be
// touched. Returns false (having reported it) when a block lost its mapping.
bool live_blocks_hold(FakeCudaDevice& device, const std::vector<std::pair<DevicePtr, std::uint64_t>>& blocks,
                      std::size_t bytes) {
  bool all_mapped = true;
  for (const auto& [address, seed] : blocks) {
    if (!fake_cuda::accessible(reinterpret_cast<void*>(address), bytes)) {
      FAIL_CHECK("a live block at 0x" << std::hex << address << " is no longer mapped");
      all_mapped = false;
      continue;
    }
    CHECK(device.holds(address, seed, bytes));
  }
  return all_mapped;
}

}  // namespace

TEST_CASE("failure_host_page_exhausted_during_spill_stops_the_spill_and_loses_nothing", "[fake_cuda][failure]") {
  FakeCudaDevice device;
  {
    CachingAllocator allocator(device.backend());
    std::vector<std::pair<DevicePtr, std::uint64_t>> blocks;
    for (std::uint64_t i = 0; i < 4; ++i) {
      blocks.emplace_back(allocator.allocate(4 * kMiB, 0), i + 1);
      device.fill(blocks.back().first, i + 1, 4 * kMiB);
    }
    allocator.spill_all();
    fake_cuda::fail_nth("cuMemCreate", 3, CUDA_ERROR_OUT_OF_MEMORY);  // the third host page
    CHECK(allocator.apply_pending_migrations() == 4 * kMiB);
    CHECK(allocator.stats().host_resident_bytes.current == 4 * kMiB);
    live_blocks_hold(device, blocks, 4 * kMiB);
    allocator.restore_all();
    allocator.apply_pending_migrations();
    CHECK(allocator.stats().host_resident_bytes.current == 0);
    live_blocks_hold(device, blocks, 4 * kMiB);
  }
  device.check_clean();
}

// Regression (csrc/core/caching_allocator.cpp, back_block/map_page): when
// backend.map() threw, the page create_page_for_allocation() had just made
// was neither recorded nor released (a leaked cuMemCreate handle), and the
// live marks back_block had put on the block's pages stayed, so the pages it
// had mapped were never released as cache.
TEST_CASE("failure_map_error_during_allocation_leaks_no_handle", "[fake_cuda][failure]") {
  FakeCudaDevice device;
  {
    CachingAllocator allocator(device.backend());
    fake_cuda::fail_nth("cuMemMap", 2, CUDA_ERROR_INVALID_VALUE);  // the second page of the block
    CHECK_THROWS_AS(allocator.allocate(4 * kMiB, 0), Error);
    CHECK(allocator.stats().allocated_bytes.all.current == 0);
    const DevicePtr block = allocator.allocate(4 * kMiB, 0);  // still usable
    device.fill(block, 7, 4 * kMiB);
    CHECK(device.holds(block, 7, 4 * kMiB));
    allocator.free(block);
    allocator.empty_cache();
    CHECK(allocator.stats().reserved_bytes.all.current == 0);
  }
  device.check_clean();
}

// Regression (same place): a driver error other than out-of-memory from
// cuMemCreate threw out of back_block with the block's pages still marked
// live, so empty_cache() never released the pages it had already mapped.
TEST_CASE("failure_create_error_during_allocation_leaves_no_page_behind", "[fake_cuda][failure]") {
  FakeCudaDevice device;
  {
    CachingAllocator allocator(device.backend());
    fake_cuda::fail_nth("cuMemCreate", 2, CUDA_ERROR_INVALID_VALUE);
    CHECK_THROWS_AS(allocator.allocate(6 * kMiB, 0), Error);
    allocator.empty_cache();
    CHECK(device.device_bytes_in_use() == 0);
    CHECK(allocator.stats().reserved_bytes.all.current == 0);
  }
  device.check_clean();
}

// Regression (csrc/core/caching_allocator.cpp, then move_page): when a move
// threw part way, the target page it had created was never released. Now
// every page stays or goes back in its place, bytes unchanged, and no page
// is left behind (here: the second cuMemMap fails, mapping the second host
// page at its copy address after the first page's copy was issued).
TEST_CASE("failure_map_error_during_a_page_move_leaks_no_handle", "[fake_cuda][failure]") {
  FakeCudaDevice device;
  {
    CachingAllocator allocator(device.backend());
    std::vector<std::pair<DevicePtr, std::uint64_t>> blocks{{allocator.allocate(4 * kMiB, 0), 3}};
    device.fill(blocks[0].first, 3, 4 * kMiB);
    allocator.spill_all();
    fake_cuda::fail_nth("cuMemMap", 2, CUDA_ERROR_OUT_OF_MEMORY);
    CHECK_THROWS_AS(allocator.apply_pending_migrations(), Error);
    live_blocks_hold(device, blocks, 4 * kMiB);
    allocator.restore_all();
    allocator.apply_pending_migrations();
    live_blocks_hold(device, blocks, 4 * kMiB);
  }
  device.check_clean();
}

// Regression (csrc/core/caching_allocator.cpp, then move_page): a move unmaps
// the old page before mapping the new one at the same address; when that map
// threw, the address was left unmapped while the page table still recorded
// the old page there: the live block's bytes were unreachable (a kernel
// would fault), the new page leaked, and ~CachingAllocator threw from
// cuMemUnmap of the unmapped address (std::terminate). A copy the driver
// refuses must leave the old page in its place too. The check reads the
// block only where the fake says it is mapped, so a regression fails here
// instead of faulting.
TEST_CASE("failure_remap_or_copy_error_during_a_page_move_keeps_the_block_mapped", "[fake_cuda][failure]") {
  struct Failure {
    const char* entry;
    int nth;  // this call of it fails
    int code;
  };
  // A spill of two pages maps each new host page at its copy address and
  // copies into it (maps 1 and 2), then maps the first host page in the
  // device page's place (map 3).
  const Failure failure = GENERATE(Failure{"cuMemMap", 3, CUDA_ERROR_OUT_OF_MEMORY},
                                   Failure{"cudaMemcpyAsync", 1, cudaErrorInvalidValue});
  CAPTURE(failure.entry);
  FakeCudaDevice device;
  {
    CachingAllocator allocator(device.backend());
    std::vector<std::pair<DevicePtr, std::uint64_t>> blocks{{allocator.allocate(4 * kMiB, 0), 4}};
    device.fill(blocks[0].first, 4, 4 * kMiB);
    allocator.spill_all();
    fake_cuda::fail_nth(failure.entry, failure.nth, failure.code);
    CHECK_THROWS_AS(allocator.apply_pending_migrations(), Error);
    REQUIRE(live_blocks_hold(device, blocks, 4 * kMiB));
    CHECK(allocator.is_device_resident(blocks[0].first));
    CHECK(allocator.apply_pending_migrations() == 4 * kMiB);  // the retry moves it
    CHECK_FALSE(allocator.is_device_resident(blocks[0].first));
    CHECK(live_blocks_hold(device, blocks, 4 * kMiB));
    allocator.check_invariants();
  }
  device.check_clean();
}

// Regression (csrc/cuda/cuda_backend.cpp, CudaBackend::map): when
// cuMemSetAccess failed after cuMemMap succeeded, map() threw with the page
// still mapped, so the caller (which sees the map as failed) could neither
// reuse the address (double map) nor free its range (pages mapped in it).
TEST_CASE("failure_access_error_in_backend_map_leaves_nothing_mapped", "[fake_cuda][failure]") {
  FakeCudaDevice device;
  cuda::CudaBackend& backend = device.cuda_backend();
  const DevicePtr range = backend.reserve(backend.granularity());
  const PageHandle page = backend.create_page(Residency::kDevice);
  fake_cuda::fail_nth("cuMemSetAccess", 1, CUDA_ERROR_INVALID_VALUE);
  CHECK_THROWS_AS(backend.map(range, page), Error);
  const std::size_t left_mapped = fake_cuda::leaks().mappings;
  CHECK(left_mapped == 0);
  if (left_mapped != 0) cuda::driver().cuMemUnmap(range, backend.granularity());  // clean up for the checks below
  backend.release_page(page);
  backend.release(range, backend.granularity());
  device.check_clean();
}

TEST_CASE("failure_errors_name_the_call_the_error_and_its_number_and_clear_the_runtime_error", "[fake_cuda][failure]") {
  FakeCudaDevice device;
  {
    CachingAllocator allocator(device.backend());
    fake_cuda::fail_nth("cuMemMap", 1, CUDA_ERROR_INVALID_VALUE);
    try {
      allocator.allocate(4 * kMiB, 0);
      FAIL("an allocation whose cuMemMap failed succeeded");
    } catch (const Error& e) {
      const std::string message = e.what();
      CHECK(message.find("cuMemMap failed") != std::string::npos);
      CHECK(message.find("(CUDA_ERROR_INVALID_VALUE, error 1)") != std::string::npos);
    }
    allocator.free(allocator.allocate(4 * kMiB, 0));  // still usable; the block is cached now
    fake_cuda::fail_nth("cudaDeviceSynchronize", 1, cudaErrorIllegalAddress);
    try {
      allocator.empty_cache();
      FAIL("empty_cache went on after its device synchronize failed");
    } catch (const Error& e) {
      CHECK(std::string(e.what()).find("(cudaErrorIllegalAddress, error 700)") != std::string::npos);
    }
    // torch's next check must not see this error again against another call.
    CHECK(cudaGetLastError() == cudaSuccess);
  }
  device.check_clean();
}

// A tensor's deleter must not throw (it runs in destructors, at interpreter
// exit too), so a free that fails is reported and the memory stays
// allocated. That report is true only if free() changes nothing when the
// driver refuses: recording the event of a record_stream use fails when the
// runtime is shutting down, or for a stream of another device. Regression:
// free() took the block out of the live set first, so it was lost (neither
// allocated nor free, its event leaked) and a second free was refused.
TEST_CASE("failure_event_record_error_during_free_keeps_the_block_allocated", "[fake_cuda][failure]") {
  FakeCudaDevice device;
  {
    CachingAllocator allocator(device.backend());
    const DevicePtr block = allocator.allocate(3 * kMiB, device.stream(1));
    device.fill(block, 5, 3 * kMiB);
    allocator.record_stream(block, device.stream(2));
    const AllocatorStats before = allocator.stats();
    fake_cuda::fail_nth("cudaEventRecord", 1, cudaErrorCudartUnloading);
    try {
      allocator.free(block);
      FAIL("free() succeeded although the runtime refused to record its event");
    } catch (const Error& e) {
      CHECK_THAT(e.what(), Catch::Contains("cudaEventRecord") && Catch::Contains("cudaErrorCudartUnloading"));
    }
    CHECK(cudaGetLastError() == cudaSuccess);  // torch's next check does not see it
    const AllocatorStats after = allocator.stats();
    CHECK(after.allocated_bytes.all.current == before.allocated_bytes.all.current);
    CHECK(after.active_bytes.all.current == before.active_bytes.all.current);
    CHECK(allocator.allocation_size(block) == 3 * kMiB);
    CHECK(device.holds(block, 5, 3 * kMiB));
    allocator.check_invariants();
    // The driver works again: the same free goes through, once.
    allocator.free(block);
    CHECK(allocator.stats().allocated_bytes.all.current == 0);
    CHECK_THROWS_AS(allocator.free(block), Error);
    allocator.check_invariants();
  }
  device.check_clean();  // the event made for the failed free was not lost
}
