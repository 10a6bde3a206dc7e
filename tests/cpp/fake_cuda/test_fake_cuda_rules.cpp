// The fake CUDA driver's own rules, tested directly through the driver table
// that csrc/cuda resolves: each misuse the real driver refuses is refused
// with its error code and counted, so that "zero violations" in the backend
// tests means something.
#include <catch2/catch.hpp>
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <vector>

#include "cuda_driver.h"
#include "fake_cuda.h"

namespace {

constexpr std::size_t kGran = std::size_t{2} << 20;

const cotenant::cuda::DriverApi& api() { return cotenant::cuda::driver(); }

CUmemAllocationProp props(CUmemLocationType type, int id = 0) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = type;
  prop.location.id = id;
  return prop;
}

CUmemGenericAllocationHandle create_device_page() {
  CUmemGenericAllocationHandle h = 0;
  const CUmemAllocationProp prop = props(CU_MEM_LOCATION_TYPE_DEVICE);
  REQUIRE(api().cuMemCreate(&h, kGran, &prop, 0) == CUDA_SUCCESS);
  return h;
}

CUdeviceptr reserve(std::size_t bytes) {
  CUdeviceptr base = 0;
  REQUIRE(api().cuMemAddressReserve(&base, bytes, kGran, 0, 0) == CUDA_SUCCESS);
  REQUIRE(base % kGran == 0);
  return base;
}

void allow_access(CUdeviceptr at, std::size_t bytes) {
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = 0;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  REQUIRE(api().cuMemSetAccess(at, bytes, &access, 1) == CUDA_SUCCESS);
}

std::size_t violation_count() { return fake_cuda::violations().count; }

}  // namespace

TEST_CASE("fake_cuda_correct_map_access_unmap_sequence_keeps_every_rule", "[fake_cuda]") {
  fake_cuda::reset();
  const CUdeviceptr base = reserve(2 * kGran);
  const CUmemGenericAllocationHandle page = create_device_page();
  REQUIRE(api().cuMemMap(base, kGran, 0, page, 0) == CUDA_SUCCESS);
  allow_access(base, kGran);
  std::memset(reinterpret_cast<void*>(base), 0x5a, kGran);  // real memory now
  CHECK(reinterpret_cast<unsigned char*>(base)[kGran - 1] == 0x5a);
  CHECK(fake_cuda::device_bytes_in_use() == kGran);
  REQUIRE(api().cuMemUnmap(base, kGran) == CUDA_SUCCESS);
  REQUIRE(api().cuMemRelease(page) == CUDA_SUCCESS);
  REQUIRE(api().cuMemAddressFree(base, 2 * kGran) == CUDA_SUCCESS);
  CHECK(violation_count() == 0);
  CHECK_FALSE(fake_cuda::leaks().any());
  CHECK(fake_cuda::device_bytes_in_use() == 0);
}

TEST_CASE("fake_cuda_page_mapped_twice_shares_its_bytes", "[fake_cuda]") {
  fake_cuda::reset();
  const CUdeviceptr base = reserve(2 * kGran);
  const CUmemGenericAllocationHandle page = create_device_page();
  REQUIRE(api().cuMemMap(base, kGran, 0, page, 0) == CUDA_SUCCESS);
  REQUIRE(api().cuMemMap(base + kGran, kGran, 0, page, 0) == CUDA_SUCCESS);
  allow_access(base, 2 * kGran);
  reinterpret_cast<unsigned char*>(base)[123] = 77;
  CHECK(reinterpret_cast<unsigned char*>(base + kGran)[123] == 77);
  REQUIRE(api().cuMemUnmap(base, 2 * kGran) == CUDA_SUCCESS);  // both mappings at once
  REQUIRE(api().cuMemRelease(page) == CUDA_SUCCESS);
  REQUIRE(api().cuMemAddressFree(base, 2 * kGran) == CUDA_SUCCESS);
  CHECK(violation_count() == 0);
  CHECK_FALSE(fake_cuda::leaks().any());
}

// cuMemMap's offset "currently must be zero" (cuda.h), and a GPU's driver
// refuses one with CUDA_ERROR_NOT_SUPPORTED: a page cannot be mapped from
// the middle of a larger allocation. Not counted: the driver probe asks.
TEST_CASE("fake_cuda_maps_an_allocation_from_its_start_only", "[fake_cuda]") {
  fake_cuda::reset();
  const CUdeviceptr base = reserve(2 * kGran);
  CUmemGenericAllocationHandle two_pages = 0;
  const CUmemAllocationProp device = props(CU_MEM_LOCATION_TYPE_DEVICE);
  REQUIRE(api().cuMemCreate(&two_pages, 2 * kGran, &device, 0) == CUDA_SUCCESS);
  CHECK(api().cuMemMap(base + kGran, kGran, kGran, two_pages, 0) == CUDA_ERROR_NOT_SUPPORTED);
  CHECK(api().cuMemUnmap(base + kGran, kGran) == CUDA_ERROR_INVALID_VALUE);  // nothing was mapped
  REQUIRE(api().cuMemMap(base, 2 * kGran, 0, two_pages, 0) == CUDA_SUCCESS);
  REQUIRE(api().cuMemUnmap(base, 2 * kGran) == CUDA_SUCCESS);
  REQUIRE(api().cuMemRelease(two_pages) == CUDA_SUCCESS);
  REQUIRE(api().cuMemAddressFree(base, 2 * kGran) == CUDA_SUCCESS);
  CHECK(violation_count() == 1);  // the unmap of nothing
  CHECK_FALSE(fake_cuda::leaks().any());
}

TEST_CASE("fake_cuda_released_handle_lives_until_unmapped", "[fake_cuda]") {
  fake_cuda::reset();
  const CUdeviceptr base = reserve(kGran);
  const CUmemGenericAllocationHandle page = create_device_page();
  REQUIRE(api().cuMemMap(base, kGran, 0, page, 0) == CUDA_SUCCESS);
  allow_access(base, kGran);
  reinterpret_cast<unsigned char*>(base)[0] = 9;
  REQUIRE(api().cuMemRelease(page) == CUDA_SUCCESS);  // legal while mapped
  CHECK(reinterpret_cast<unsigned char*>(base)[0] == 9);
  CHECK(fake_cuda::device_bytes_in_use() == kGran);
  CHECK(fake_cuda::leaks().handles == 0);  // released: not a leak, just still mapped
  REQUIRE(api().cuMemUnmap(base, kGran) == CUDA_SUCCESS);
  CHECK(fake_cuda::device_bytes_in_use() == 0);
  CHECK(api().cuMemMap(base, kGran, 0, page, 0) == CUDA_ERROR_INVALID_HANDLE);  // gone now
  CHECK(violation_count() == 1);
  REQUIRE(api().cuMemAddressFree(base, kGran) == CUDA_SUCCESS);
}

TEST_CASE("fake_cuda_counts_each_misuse_and_returns_the_drivers_error", "[fake_cuda]") {
  fake_cuda::reset();
  const CUdeviceptr base = reserve(2 * kGran);
  const CUmemGenericAllocationHandle page = create_device_page();
  CUmemGenericAllocationHandle unused = 0;
  const CUmemAllocationProp device = props(CU_MEM_LOCATION_TYPE_DEVICE);
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;

  SECTION("unaligned sizes and addresses") {
    CHECK(api().cuMemCreate(&unused, kGran / 2, &device, 0) == CUDA_ERROR_INVALID_VALUE);
    CUdeviceptr other = 0;
    CHECK(api().cuMemAddressReserve(&other, kGran + 4096, 0, 0, 0) == CUDA_ERROR_INVALID_VALUE);
    CHECK(api().cuMemMap(base + 4096, kGran, 0, page, 0) == CUDA_ERROR_INVALID_VALUE);
    CHECK(violation_count() == 3);
  }
  SECTION("double map") {
    REQUIRE(api().cuMemMap(base, kGran, 0, page, 0) == CUDA_SUCCESS);
    CHECK(api().cuMemMap(base, kGran, 0, page, 0) == CUDA_ERROR_INVALID_VALUE);
    CHECK(violation_count() == 1);
    REQUIRE(api().cuMemUnmap(base, kGran) == CUDA_SUCCESS);
  }
  SECTION("map outside a reservation") {
    CHECK(api().cuMemMap(base + 2 * kGran, kGran, 0, page, 0) == CUDA_ERROR_INVALID_VALUE);
    CHECK(violation_count() == 1);
  }
  SECTION("unmap of a range that is not mapped") {
    CHECK(api().cuMemUnmap(base, kGran) == CUDA_ERROR_INVALID_VALUE);
    CHECK(violation_count() == 1);
  }
  SECTION("access on a range that is not mapped") {
    CHECK(api().cuMemSetAccess(base, kGran, &access, 1) == CUDA_ERROR_INVALID_VALUE);
    REQUIRE(api().cuMemMap(base, kGran, 0, page, 0) == CUDA_SUCCESS);
    CHECK(api().cuMemSetAccess(base, 2 * kGran, &access, 1) == CUDA_ERROR_INVALID_VALUE);  // half mapped
    CHECK(violation_count() == 2);
    REQUIRE(api().cuMemUnmap(base, kGran) == CUDA_SUCCESS);
  }
  SECTION("address free while a page is mapped, or of a wrong size") {
    REQUIRE(api().cuMemMap(base + kGran, kGran, 0, page, 0) == CUDA_SUCCESS);
    CHECK(api().cuMemAddressFree(base, 2 * kGran) == CUDA_ERROR_INVALID_VALUE);
    REQUIRE(api().cuMemUnmap(base + kGran, kGran) == CUDA_SUCCESS);
    CHECK(api().cuMemAddressFree(base, kGran) == CUDA_ERROR_INVALID_VALUE);
    CHECK(violation_count() == 2);
  }
  SECTION("release of an unknown or released handle") {
    CHECK(api().cuMemRelease(page + 1000) == CUDA_ERROR_INVALID_VALUE);
    CHECK(violation_count() == 1);
  }
  SECTION("host locations without host VMM support") {
    fake_cuda::Config no_host_vmm;
    no_host_vmm.host_vmm = false;
    no_host_vmm.host_numa_vmm = false;
    fake_cuda::reset(no_host_vmm);  // forgets base and page
    const CUmemAllocationProp host = props(CU_MEM_LOCATION_TYPE_HOST);
    const CUmemAllocationProp numa = props(CU_MEM_LOCATION_TYPE_HOST_NUMA, 0);
    CHECK(api().cuMemCreate(&unused, kGran, &host, 0) == CUDA_ERROR_NOT_SUPPORTED);
    CHECK(api().cuMemCreate(&unused, kGran, &numa, 0) == CUDA_ERROR_NOT_SUPPORTED);
    CHECK(violation_count() == 2);
    return;
  }
  SECTION("unknown pinned host pointers") {
    REQUIRE(cudaSetDevice(0) == cudaSuccess);  // the pinned host calls act in a context
    int not_pinned = 0;
    CUdeviceptr dptr = 0;
    CHECK(api().cuMemHostGetDevicePointer(&dptr, &not_pinned, 0) == CUDA_ERROR_INVALID_VALUE);
    CHECK(api().cuMemFreeHost(&not_pinned) == CUDA_ERROR_INVALID_VALUE);
    CHECK(violation_count() == 2);
  }
  REQUIRE(api().cuMemRelease(page) == CUDA_SUCCESS);
  REQUIRE(api().cuMemAddressFree(base, 2 * kGran) == CUDA_SUCCESS);
  CHECK_FALSE(fake_cuda::leaks().any());
}

// A thread has a context current only once it set a device, made a runtime
// call that needs one, or set one with cuCtxSetCurrent; the pinned host
// calls refuse to run without one, the virtual memory calls need none.
TEST_CASE("fake_cuda_pinned_host_calls_need_a_current_context_and_cuda_get_device_binds_none", "[fake_cuda]") {
  fake_cuda::Config two;
  two.device_count = 2;
  fake_cuda::reset(two);
  CUcontext current = nullptr;
  REQUIRE(api().cuCtxGetCurrent(&current) == CUDA_SUCCESS);
  CHECK(current == nullptr);
  int device = -1;
  REQUIRE(cudaGetDevice(&device) == cudaSuccess);
  CHECK(device == 0);
  CHECK_FALSE(fake_cuda::primary_context_initialized(0));
  void* host = nullptr;
  CHECK(api().cuMemHostAlloc(&host, kGran, CU_MEMHOSTALLOC_DEVICEMAP) == CUDA_ERROR_INVALID_CONTEXT);
  CHECK(violation_count() == 1);
  const CUdeviceptr base = reserve(kGran);  // the virtual memory calls need no context
  REQUIRE(api().cuMemAddressFree(base, kGran) == CUDA_SUCCESS);

  SECTION("a runtime call binds the thread's device's primary context") {
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    CHECK(fake_cuda::primary_context_initialized(0));
    CHECK_FALSE(fake_cuda::primary_context_initialized(1));
  }
  SECTION("cudaSetDevice binds and initializes the context of the device it names") {
    REQUIRE(cudaSetDevice(1) == cudaSuccess);
    CHECK(fake_cuda::primary_context_initialized(1));
    CHECK_FALSE(fake_cuda::primary_context_initialized(0));
  }
  SECTION("cuCtxSetCurrent binds a retained context and unbinds with null") {
    CUcontext one = nullptr;
    REQUIRE(api().cuDevicePrimaryCtxRetain(&one, 1) == CUDA_SUCCESS);
    REQUIRE(api().cuCtxSetCurrent(one) == CUDA_SUCCESS);
    REQUIRE(cudaGetDevice(&device) == cudaSuccess);
    CHECK(device == 1);
    REQUIRE(api().cuMemHostAlloc(&host, kGran, CU_MEMHOSTALLOC_DEVICEMAP) == CUDA_SUCCESS);
    REQUIRE(api().cuMemFreeHost(host) == CUDA_SUCCESS);
    REQUIRE(api().cuCtxSetCurrent(nullptr) == CUDA_SUCCESS);
    REQUIRE(api().cuCtxGetCurrent(&current) == CUDA_SUCCESS);
    CHECK(current == nullptr);
    REQUIRE(api().cuDevicePrimaryCtxRelease(1) == CUDA_SUCCESS);
    CHECK(api().cuDevicePrimaryCtxRelease(1) == CUDA_ERROR_INVALID_CONTEXT);  // one release per retain
    CHECK(violation_count() == 2);
    CHECK_FALSE(fake_cuda::primary_context_initialized(0));
    return;
  }
  REQUIRE(api().cuMemHostAlloc(&host, kGran, CU_MEMHOSTALLOC_DEVICEMAP) == CUDA_SUCCESS);
  REQUIRE(api().cuMemFreeHost(host) == CUDA_SUCCESS);
  CHECK(violation_count() == 1);
}

TEST_CASE("fake_cuda_device_capacity_bounds_device_pages_only", "[fake_cuda]") {
  fake_cuda::Config config;
  config.device_capacity = 2 * kGran;
  fake_cuda::reset(config);
  const CUmemAllocationProp device = props(CU_MEM_LOCATION_TYPE_DEVICE);
  const CUmemAllocationProp host = props(CU_MEM_LOCATION_TYPE_HOST);
  CUmemGenericAllocationHandle h[4] = {};
  REQUIRE(api().cuMemCreate(&h[0], kGran, &device, 0) == CUDA_SUCCESS);
  REQUIRE(api().cuMemCreate(&h[1], kGran, &device, 0) == CUDA_SUCCESS);
  CHECK(api().cuMemCreate(&h[2], kGran, &device, 0) == CUDA_ERROR_OUT_OF_MEMORY);
  REQUIRE(api().cuMemCreate(&h[3], kGran, &host, 0) == CUDA_SUCCESS);
  std::size_t free = 0, total = 0;
  REQUIRE(cudaMemGetInfo(&free, &total) == cudaSuccess);
  CHECK(total == 2 * kGran);
  CHECK(free == 0);
  CHECK(fake_cuda::leaks().handles == 3);
  for (int i : {0, 1, 3}) REQUIRE(api().cuMemRelease(h[i]) == CUDA_SUCCESS);
  CHECK(violation_count() == 0);  // out of memory is not a misuse
  CHECK_FALSE(fake_cuda::leaks().any());
}

TEST_CASE("fake_cuda_delayed_copies_run_in_stream_order", "[fake_cuda]") {
  fake_cuda::reset();
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  std::vector<char> a(4096, 1), b(4096, 2), out(4096, 0);
  fake_cuda::set_delay(std::chrono::milliseconds(5));
  REQUIRE(cudaMemcpyAsync(out.data(), a.data(), out.size(), cudaMemcpyDefault, stream) == cudaSuccess);
  REQUIRE(cudaMemcpyAsync(out.data(), b.data(), out.size(), cudaMemcpyDefault, stream) == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  CHECK(out[0] == 2);  // the later copy ran last
  REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
  CHECK(violation_count() == 0);
  CHECK_FALSE(fake_cuda::leaks().any());
}

TEST_CASE("fake_cuda_fail_nth_fails_exactly_that_call", "[fake_cuda]") {
  fake_cuda::reset();
  fake_cuda::fail_nth("cuMemCreate", 2, CUDA_ERROR_OUT_OF_MEMORY);
  const CUmemAllocationProp device = props(CU_MEM_LOCATION_TYPE_DEVICE);
  CUmemGenericAllocationHandle h[3] = {};
  CHECK(api().cuMemCreate(&h[0], kGran, &device, 0) == CUDA_SUCCESS);
  CHECK(api().cuMemCreate(&h[1], kGran, &device, 0) == CUDA_ERROR_OUT_OF_MEMORY);
  CHECK(api().cuMemCreate(&h[2], kGran, &device, 0) == CUDA_SUCCESS);
  CHECK(fake_cuda::calls("cuMemCreate") == 3);
  CHECK(fake_cuda::leaks().handles == 2);
  REQUIRE(api().cuMemRelease(h[0]) == CUDA_SUCCESS);
  REQUIRE(api().cuMemRelease(h[2]) == CUDA_SUCCESS);
  CHECK_FALSE(fake_cuda::leaks().any());
  // The whole table holds what each entry's count says, and nothing uncalled.
  const auto table = fake_cuda::all_calls();
  CHECK(table.at("cuMemCreate") == 3);
  CHECK(table.at("cuMemRelease") == 2);
  CHECK(table.count("cuMemMap") == 0);
}

TEST_CASE("fake_cuda_unmap_while_a_delayed_copy_touches_the_page_is_a_violation", "[fake_cuda]") {
  fake_cuda::reset();
  const CUdeviceptr base = reserve(kGran);
  const CUmemGenericAllocationHandle page = create_device_page();
  REQUIRE(api().cuMemMap(base, kGran, 0, page, 0) == CUDA_SUCCESS);
  allow_access(base, kGran);
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  std::vector<unsigned char> host(kGran, 0xab);
  fake_cuda::hold_streams();  // the copy is still pending at the unmap, however slow this machine is
  REQUIRE(cudaMemcpyAsync(reinterpret_cast<void*>(base), host.data(), kGran, cudaMemcpyDefault, stream) ==
          cudaSuccess);

  SECTION("without synchronizing first") {
    REQUIRE(api().cuMemUnmap(base, kGran) == CUDA_SUCCESS);  // the driver does not wait
    const fake_cuda::Violations v = fake_cuda::violations();
    REQUIRE(v.count == 1);
    CHECK(v.messages[0].find("missing synchronization") != std::string::npos);
  }
  SECTION("after synchronizing the stream") {
    REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
    CHECK(reinterpret_cast<unsigned char*>(base)[kGran - 1] == 0xab);
    REQUIRE(api().cuMemUnmap(base, kGran) == CUDA_SUCCESS);
    CHECK(violation_count() == 0);
  }
  REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
  REQUIRE(api().cuMemRelease(page) == CUDA_SUCCESS);
  REQUIRE(api().cuMemAddressFree(base, kGran) == CUDA_SUCCESS);
  CHECK_FALSE(fake_cuda::leaks().any());
}

TEST_CASE("fake_cuda_events_complete_when_the_stream_reaches_them", "[fake_cuda]") {
  fake_cuda::reset();
  cudaStream_t stream = nullptr;
  cudaEvent_t event = nullptr;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  REQUIRE(cudaEventCreateWithFlags(&event, cudaEventDisableTiming) == cudaSuccess);
  CHECK(cudaEventQuery(event) == cudaSuccess);  // never recorded: complete
  std::vector<char> a(4096, 1), b(4096, 0);
  fake_cuda::hold_streams();
  REQUIRE(cudaMemcpyAsync(b.data(), a.data(), a.size(), cudaMemcpyDefault, stream) == cudaSuccess);
  REQUIRE(cudaEventRecord(event, stream) == cudaSuccess);
  CHECK(cudaEventQuery(event) == cudaErrorNotReady);
  CHECK(cudaGetLastError() == cudaErrorNotReady);
  CHECK(cudaGetLastError() == cudaSuccess);
  REQUIRE(cudaEventSynchronize(event) == cudaSuccess);
  CHECK(cudaEventQuery(event) == cudaSuccess);
  CHECK(b[4095] == 1);
  REQUIRE(cudaEventDestroy(event) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
  CHECK(violation_count() == 0);
  CHECK_FALSE(fake_cuda::leaks().any());
}

TEST_CASE("fake_cuda_copy_into_reserved_but_inaccessible_memory_is_refused", "[fake_cuda]") {
  fake_cuda::reset();
  const CUdeviceptr base = reserve(kGran);
  const CUmemGenericAllocationHandle page = create_device_page();
  REQUIRE(api().cuMemMap(base, kGran, 0, page, 0) == CUDA_SUCCESS);  // mapped, no access yet
  std::vector<char> host(64, 1);
  CHECK(cudaMemcpyAsync(reinterpret_cast<void*>(base), host.data(), host.size(), cudaMemcpyDefault, 0) ==
        cudaErrorIllegalAddress);
  CHECK(violation_count() == 1);
  cudaGetLastError();
  REQUIRE(api().cuMemUnmap(base, kGran) == CUDA_SUCCESS);
  REQUIRE(api().cuMemRelease(page) == CUDA_SUCCESS);
  REQUIRE(api().cuMemAddressFree(base, kGran) == CUDA_SUCCESS);
  CHECK_FALSE(fake_cuda::leaks().any());
}

TEST_CASE("fake_cuda_cuda_malloc_counts_against_the_device_and_cuda_free_gives_it_back", "[fake_cuda]") {
  fake_cuda::Config config;
  config.device_capacity = 8 * kGran;
  fake_cuda::reset(config);
  void* a = nullptr;
  REQUIRE(cudaMalloc(&a, kGran + 1) == cudaSuccess);  // two pages' worth: rounded to the granularity
  REQUIRE(reinterpret_cast<std::uintptr_t>(a) % kGran == 0);
  CHECK(fake_cuda::device_bytes_in_use() == 2 * kGran);
  std::memset(a, 7, kGran + 1);  // readable and writable at once
  CHECK(fake_cuda::accessible(a, kGran + 1));
  void* too_big = nullptr;
  CHECK(cudaMalloc(&too_big, 7 * kGran) == cudaErrorMemoryAllocation);  // 2 + 7 pages > 8
  CHECK(too_big == nullptr);
  CHECK(cudaGetLastError() == cudaErrorMemoryAllocation);
  CHECK(fake_cuda::leaks().device_allocations == 1);
  REQUIRE(cudaFree(a) == cudaSuccess);
  CHECK(fake_cuda::device_bytes_in_use() == 0);
  CHECK(fake_cuda::device_bytes_created() == 2 * kGran);  // freed, still counted as handed out
  CHECK_FALSE(fake_cuda::leaks().any());
  CHECK(violation_count() == 0);
  CHECK(cudaFree(a) == cudaErrorInvalidValue);  // twice: the runtime refuses it
  CHECK(violation_count() == 1);
}

TEST_CASE("fake_cuda_calls_it_does_not_model_fail_and_count_a_violation", "[fake_cuda]") {
  fake_cuda::reset();
  void* p = nullptr;
  CHECK(cudaMallocAsync(&p, 4096, nullptr) == cudaErrorNotSupported);
  CHECK(violation_count() == 1);
  CHECK(fake_cuda::violations().messages.back() == "cudaMallocAsync is not modelled by the fake CUDA runtime");
  void* entry = nullptr;
  cudaDriverEntryPointQueryResult found{};
  REQUIRE(cudaGetDriverEntryPointByVersion("cuMemExportToShareableHandle", &entry, 12000, 0, &found) == cudaSuccess);
  REQUIRE(found == cudaDriverEntryPointSuccess);
  auto export_handle = reinterpret_cast<CUresult (*)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                                                     unsigned long long)>(entry);
  CHECK(export_handle(nullptr, 1, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) == CUDA_ERROR_NOT_SUPPORTED);
  CHECK(violation_count() == 2);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusActive;
  CHECK(cudaStreamIsCapturing(nullptr, &status) == cudaSuccess);  // stream capture: never on
  CHECK(status == cudaStreamCaptureStatusNone);
  CHECK(violation_count() == 2);
}

// What nvcc's host code calls while a library loads (crt/host_runtime.h).
extern "C" void** __cudaRegisterFatBinary(void* fatCubin);
extern "C" void __cudaRegisterFatBinaryEnd(void** handle);

TEST_CASE("fake_cuda_registers_kernels_but_refuses_to_launch_them", "[fake_cuda]") {
  fake_cuda::reset();
  void** handle = __cudaRegisterFatBinary(nullptr);  // a library of kernels loads: nothing to count
  REQUIRE(handle != nullptr);
  __cudaRegisterFatBinaryEnd(handle);
  CHECK(violation_count() == 0);
  CHECK(cudaLaunchKernel(reinterpret_cast<const void*>(&violation_count), dim3(1), dim3(1), nullptr, 0, nullptr) ==
        cudaErrorNotSupported);
  CHECK(violation_count() == 1);
  CHECK(fake_cuda::violations().messages.back() == "cudaLaunchKernel is not modelled by the fake CUDA runtime");
}

TEST_CASE("fake_cuda_event_record_with_the_default_flag_is_an_event_record", "[fake_cuda]") {
  fake_cuda::reset();
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  cudaEvent_t event = nullptr;
  REQUIRE(cudaEventCreateWithFlags(&event, cudaEventDisableTiming) == cudaSuccess);
  CHECK(cudaEventRecordWithFlags(event, stream, cudaEventRecordDefault) == cudaSuccess);
  CHECK(cudaEventSynchronize(event) == cudaSuccess);
  CHECK(cudaEventQuery(event) == cudaSuccess);
  CHECK(violation_count() == 0);
  CHECK(cudaEventRecordWithFlags(event, stream, cudaEventRecordExternal) == cudaErrorNotSupported);  // graphs only
  CHECK(violation_count() == 1);
  CHECK(cudaEventDestroy(event) == cudaSuccess);
  CHECK(cudaStreamDestroy(stream) == cudaSuccess);
}
