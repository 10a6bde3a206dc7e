// PyTorch's own CUDA caching allocator replaying an allocation trace on the
// CPU: the allocator is libc10_cuda.so from the torch wheel, unchanged; the
// CUDA runtime it links (libcudart.so.N) is the fake of tests/fake_cuda,
// built as a shared library of that name, so every cudaMalloc, cudaFree and
// (with expandable segments) cuMemMap / cuMemUnmap that PyTorch makes is
// counted, and a call the fake cannot model fails the run.
//
// Input on stdin, one operation per line (benchmarks/bench_beside_pytorch.py
// writes it from any trace cotenant-replay reads):
//   a ID SIZE STREAM   allocate SIZE bytes on stream STREAM (0: the default stream)
//   f ID               free the allocation ID
//   i                  an iteration mark
// Output on stdout: one JSON object of PyTorch's figures. The allocator's
// settings come from PYTORCH_CUDA_ALLOC_CONF, as in any PyTorch process.
//
//   pytorch_replay [--device-capacity BYTES] < ops
#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iostream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "fake_cuda.h"

namespace {

namespace alloc = c10::cuda::CUDACachingAllocator;
constexpr auto kAll = static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE);

// Driver calls that give the device memory (cudaMalloc, cuMemMap) and take
// it back (cudaFree, cuMemUnmap), as the fake counted them.
struct DriverCounts {
  std::uint64_t mallocs = 0;
  std::uint64_t frees = 0;
  std::uint64_t maps = 0;
  std::uint64_t unmaps = 0;
};

DriverCounts driver_counts() {
  return DriverCounts{fake_cuda::calls("cudaMalloc"), fake_cuda::calls("cudaFree"), fake_cuda::calls("cuMemMap"),
                      fake_cuda::calls("cuMemUnmap")};
}

struct Block {
  void* ptr = nullptr;  // null for a request of 0 bytes
  std::int64_t size = 0;
};

struct Run {
  std::unordered_map<std::uint64_t, Block> live;            // trace id -> PyTorch's block
  std::unordered_map<std::uint64_t, cudaStream_t> streams;  // trace stream id -> fake stream
  std::int64_t live_bytes = 0;
  std::int64_t peak_live_bytes = 0;
  // The peak of device bytes the fake held, sampled after each operation: the
  // memory PyTorch reserved, counted by the driver rather than by PyTorch.
  std::size_t peak_device_bytes = 0;
  std::vector<std::uint64_t> maps_per_iteration;  // new device memory calls between marks
  std::uint64_t maps_at_last_mark = 0;
  std::vector<std::uint64_t> bytes_per_iteration;  // device bytes obtained between marks
  std::uint64_t bytes_at_last_mark = 0;
  std::uint64_t operations = 0;
};

cudaStream_t stream_for(Run& run, std::uint64_t id) {
  if (id == 0) return nullptr;
  auto it = run.streams.find(id);
  if (it != run.streams.end()) return it->second;
  cudaStream_t stream = nullptr;
  if (cudaStreamCreate(&stream) != cudaSuccess) throw std::runtime_error("the fake runtime refused a new stream");
  run.streams.emplace(id, stream);
  return stream;
}

std::uint64_t new_memory_calls() {
  const DriverCounts c = driver_counts();
  return c.mallocs + c.maps;
}

void replay(Run& run, std::istream& in) {
  std::string op;
  while (in >> op) {
    if (op == "a") {
      std::uint64_t id = 0, size = 0, stream = 0;
      if (!(in >> id >> size >> stream)) throw std::runtime_error("an 'a' line needs ID SIZE STREAM");
      void* p = size == 0 ? nullptr : alloc::raw_alloc_with_stream(size, stream_for(run, stream));
      run.live[id] = Block{p, static_cast<std::int64_t>(size)};
      run.live_bytes += static_cast<std::int64_t>(size);
      if (run.live_bytes > run.peak_live_bytes) run.peak_live_bytes = run.live_bytes;
    } else if (op == "f") {
      std::uint64_t id = 0;
      if (!(in >> id)) throw std::runtime_error("an 'f' line needs ID");
      auto it = run.live.find(id);
      if (it == run.live.end()) throw std::runtime_error("free of id " + std::to_string(id) + ", which is not live");
      if (it->second.ptr != nullptr) alloc::raw_delete(it->second.ptr);
      run.live_bytes -= it->second.size;
      run.live.erase(it);
    } else if (op == "i") {
      const std::uint64_t now = new_memory_calls();
      run.maps_per_iteration.push_back(now - run.maps_at_last_mark);
      run.maps_at_last_mark = now;
      const std::uint64_t bytes = fake_cuda::device_bytes_created();
      run.bytes_per_iteration.push_back(bytes - run.bytes_at_last_mark);
      run.bytes_at_last_mark = bytes;
    } else {
      throw std::runtime_error("unknown operation '" + op + "' (expected a, f or i)");
    }
    ++run.operations;
    const std::size_t device = fake_cuda::device_bytes_in_use();
    if (device > run.peak_device_bytes) run.peak_device_bytes = device;
  }
}

void print_list(const std::vector<std::uint64_t>& values) {
  for (std::size_t i = 0; i < values.size(); ++i) {
    std::printf("%s%llu", i ? ", " : "", static_cast<unsigned long long>(values[i]));
  }
}

void print_json(const Run& run, const c10::CachingDeviceAllocator::DeviceStats& stats, const DriverCounts& c,
                const fake_cuda::Violations& v) {
  std::printf("{\"operations\": %llu, \"peak_requested_bytes\": %lld, \"peak_allocated_bytes\": %lld, "
              "\"peak_reserved_bytes\": %lld, \"peak_device_bytes\": %zu, \"cuda_malloc_calls\": %llu, "
              "\"cuda_free_calls\": %llu, \"cu_mem_map_calls\": %llu, \"cu_mem_unmap_calls\": %llu, "
              "\"device_bytes_obtained\": %llu, "
              "\"num_alloc_retries\": %lld, \"num_ooms\": %lld, \"new_memory_calls_per_iteration\": [",
              static_cast<unsigned long long>(run.operations), static_cast<long long>(run.peak_live_bytes),
              static_cast<long long>(stats.allocated_bytes[kAll].peak),
              static_cast<long long>(stats.reserved_bytes[kAll].peak), run.peak_device_bytes,
              static_cast<unsigned long long>(c.mallocs), static_cast<unsigned long long>(c.frees),
              static_cast<unsigned long long>(c.maps), static_cast<unsigned long long>(c.unmaps),
              static_cast<unsigned long long>(fake_cuda::device_bytes_created()),
              static_cast<long long>(stats.num_alloc_retries), static_cast<long long>(stats.num_ooms));
  print_list(run.maps_per_iteration);
  std::printf("], \"new_device_bytes_per_iteration\": [");
  print_list(run.bytes_per_iteration);
  std::printf("], \"fake_cuda_violations\": [");
  for (std::size_t i = 0; i < v.messages.size(); ++i) {
    std::string m;
    for (char ch : v.messages[i]) m += (ch == '"' || ch == '\\') ? std::string("\\") + ch : std::string(1, ch);
    std::printf("%s\"%s\"", i ? ", " : "", m.c_str());
  }
  std::printf("]}\n");
}

}  // namespace

int main(int argc, char** argv) {
  fake_cuda::Config config;
  config.device_capacity = std::size_t{16} << 30;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--device-capacity") == 0 && i + 1 < argc) {
      config.device_capacity = std::strtoull(argv[++i], nullptr, 10);
    } else {
      std::fprintf(stderr, "usage: %s [--device-capacity BYTES] < operations\n", argv[0]);
      return 2;
    }
  }
  try {
    fake_cuda::reset(config);
    alloc::init(1);
    Run run;
    replay(run, std::cin);
    const auto stats = alloc::getDeviceStats(0);
    const DriverCounts counts = driver_counts();
    print_json(run, stats, counts, fake_cuda::violations());
    return fake_cuda::violations().count == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pytorch_replay: %s\n", e.what());
    return 1;
  }
}
