// The two devices the allocator's contract suites run on: the simulated
// device, and the real CudaBackend over the fake CUDA runtime
// (tests/fake_cuda). A suite written against these runs unchanged on both
// (TEMPLATE_TEST_CASE over SimulatedDevice and FakeCudaDevice), like rmm's
// one suite for every memory resource.
//
// Usage: construct the device, then the allocator in an inner scope, and
// call check_clean() after the allocator is gone: on the fake it destroys
// the backend and checks that the driver's rules were kept and nothing leaked.
#pragma once

#include <catch2/catch.hpp>
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <map>
#include <memory>
#include <string>

#include "cuda_backend.h"
#include "fake_cuda.h"
#include "test_helpers.h"

namespace cotenant::testing {

struct DeviceSpec {
  std::size_t capacity = 1 * kGiB;
  bool events_immediate = true;  // simulated only: the fake's events complete when their stream is idle
  bool host_mappable = true;
  std::size_t host_capacity = 0;  // 0: the device's default (unbounded on the fake)
};

// Zero violations and zero leaks, with the violations' messages on failure.
inline void check_fake_cuda_clean() {
  const fake_cuda::Violations v = fake_cuda::violations();
  for (const std::string& message : v.messages) FAIL_CHECK("fake CUDA rule violated: " << message);
  CHECK(v.count == 0);
  const fake_cuda::Leaks leaks = fake_cuda::leaks();
  INFO("leaked: " << leaks.describe());
  CHECK_FALSE(leaks.any());
}

// The `nth` call of `entry` from now fails with its API's invalid-value
// error (a runtime entry's cudaError_t, a driver entry's CUresult).
inline void fail_once(const char* entry, int nth) {
  const bool runtime = std::string(entry).rfind("cuda", 0) == 0;
  fake_cuda::fail_nth(entry, nth, runtime ? static_cast<int>(cudaErrorInvalidValue) : CUDA_ERROR_INVALID_VALUE);
}

// check_fake_cuda_clean() after a test that failed `entry` once, except that
// what the driver refused to free (a page, entry cuMemRelease; a pinned
// allocation, entry cuMemFreeHost) stays with the process, as it would with
// a real driver: that one thing and nothing else.
inline void check_fake_cuda_clean_after_failing(const char* entry) {
  const std::string refused = entry;
  if (refused != "cuMemRelease" && refused != "cuMemFreeHost") {
    check_fake_cuda_clean();
    return;
  }
  const fake_cuda::Violations v = fake_cuda::violations();
  for (const std::string& message : v.messages) FAIL_CHECK("fake CUDA rule violated: " << message);
  const fake_cuda::Leaks leaks = fake_cuda::leaks();
  INFO("leaked: " << leaks.describe());
  CHECK(leaks.handles <= (refused == "cuMemRelease" ? 1u : 0u));
  CHECK(leaks.pinned_host <= (refused == "cuMemFreeHost" ? 1u : 0u));
  CHECK(leaks.mappings == 0);
  CHECK(leaks.reservations == 0);
}

class SimulatedDevice {
 public:
  static constexpr const char* kName = "simulated";
  explicit SimulatedDevice(const DeviceSpec& spec = {}) : device_(config_for(spec)) {}

  Backend& backend() { return device_; }
  StreamId stream(int index) { return static_cast<StreamId>(index); }
  // Work pending on `stream` holds its events back until complete_stream().
  void keep_busy(StreamId /*stream*/) {}
  void complete_stream(StreamId stream) { device_.complete_stream(stream); }
  void fill(DevicePtr address, std::uint64_t seed, std::size_t bytes) { testing::fill(device_, address, seed, bytes); }
  bool holds(DevicePtr address, std::uint64_t seed, std::size_t bytes) {
    return testing::holds(device_, address, seed, bytes);
  }
  std::size_t device_bytes_in_use() const { return device_.device_bytes_in_use(); }
  std::size_t host_bytes_in_use() const { return device_.host_bytes_in_use(); }
  std::uint64_t pages_created() const { return device_.calls().create_page; }
  std::uint64_t maps() const { return device_.calls().map; }
  std::uint64_t unmaps() const { return device_.calls().unmap; }
  std::uint64_t pins() const { return device_.calls().allocate_pinned_host; }
  std::uint64_t unpins() const { return device_.calls().free_pinned_host; }
  void fail_next_device_page() { device_.fail_next_device_pages(1); }
  void check_clean() { CHECK(device_.device_bytes_in_use() == 0); }

 private:
  static SimulatedDeviceConfig config_for(const DeviceSpec& spec) {
    SimulatedDeviceConfig config = device_config(spec.capacity, spec.events_immediate, spec.host_mappable);
    if (spec.host_capacity != 0) config.host_capacity = spec.host_capacity;
    return config;
  }

  SimulatedBackend device_;
};

class FakeCudaDevice {
 public:
  static constexpr const char* kName = "fake-cuda";
  explicit FakeCudaDevice(const DeviceSpec& spec = {}) {
    fake_cuda::Config config;
    config.device_capacity = spec.capacity;
    config.host_vmm = spec.host_mappable;
    if (spec.host_capacity != 0) config.host_capacity = spec.host_capacity;
    fake_cuda::reset(config);
    backend_ = std::make_unique<cuda::CudaBackend>(0);
  }
  ~FakeCudaDevice() {
    for (auto& [index, stream] : streams_) cudaStreamDestroy(stream);
  }

  Backend& backend() { return *backend_; }
  cuda::CudaBackend& cuda_backend() { return *backend_; }
  // A real stream per index (0 is the default stream), created on first use.
  StreamId stream(int index) {
    if (index == 0) return 0;
    auto it = streams_.find(index);
    if (it == streams_.end()) {
      cudaStream_t created = nullptr;
      REQUIRE(cudaStreamCreate(&created) == cudaSuccess);
      it = streams_.emplace(index, created).first;
    }
    return reinterpret_cast<StreamId>(it->second);
  }
  // Queues a copy (host to host) on `stream` and holds it, so that events
  // recorded on it now stay incomplete until complete_stream().
  void keep_busy(StreamId stream) {
    fake_cuda::hold_streams();
    REQUIRE(cudaMemcpyAsync(busy_dst_, busy_src_, sizeof busy_src_, cudaMemcpyDefault,
                            reinterpret_cast<cudaStream_t>(stream)) == cudaSuccess);
  }
  void complete_stream(StreamId stream) {
    REQUIRE(cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream)) == cudaSuccess);
  }
  // The fake's device memory is host memory: tests write it directly.
  void fill(DevicePtr address, std::uint64_t seed, std::size_t bytes) {
    const auto data = pattern(seed, bytes);
    std::memcpy(reinterpret_cast<void*>(address), data.data(), bytes);
  }
  bool holds(DevicePtr address, std::uint64_t seed, std::size_t bytes) {
    return std::memcmp(reinterpret_cast<const void*>(address), pattern(seed, bytes).data(), bytes) == 0;
  }
  std::size_t device_bytes_in_use() const { return fake_cuda::device_bytes_in_use(); }
  std::size_t host_bytes_in_use() const { return fake_cuda::host_bytes_in_use(); }
  std::uint64_t pages_created() const { return fake_cuda::calls("cuMemCreate"); }
  std::uint64_t maps() const { return fake_cuda::calls("cuMemMap"); }
  std::uint64_t unmaps() const { return fake_cuda::calls("cuMemUnmap"); }
  std::uint64_t pins() const { return fake_cuda::calls("cuMemHostAlloc"); }
  std::uint64_t unpins() const { return fake_cuda::calls("cuMemFreeHost"); }
  void fail_next_device_page() { fake_cuda::fail_nth("cuMemCreate", 1, CUDA_ERROR_OUT_OF_MEMORY); }
  // Destroys the backend and its streams, then checks the driver's books.
  void check_clean() {
    shut_down();
    CHECK(fake_cuda::device_bytes_in_use() == 0);
    check_fake_cuda_clean();
  }
  // check_clean() after a test that failed `entry` once (see check_fake_cuda_clean_after_failing).
  void check_clean_after_failing(const char* entry) {
    shut_down();
    check_fake_cuda_clean_after_failing(entry);
  }
  // For a test that broke a rule on purpose: only that nothing leaked.
  void check_leaks_only() {
    shut_down();
    const fake_cuda::Leaks leaks = fake_cuda::leaks();
    INFO("leaked: " << leaks.describe());
    CHECK_FALSE(leaks.any());
  }

 private:
  void shut_down() {
    for (auto& [index, stream] : streams_) cudaStreamDestroy(stream);
    streams_.clear();
    backend_.reset();
  }

  std::unique_ptr<cuda::CudaBackend> backend_;
  std::map<int, cudaStream_t> streams_;
  char busy_src_[64] = {};
  char busy_dst_[64] = {};
};

}  // namespace cotenant::testing
