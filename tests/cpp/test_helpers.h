// Shared fixtures for the core tests: a simulated device and byte patterns.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "cotenant/caching_allocator.h"
#include "cotenant/simulated_backend.h"

namespace cotenant::testing {

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kGiB = std::size_t{1} << 30;

inline SimulatedDeviceConfig device_config(std::size_t capacity, bool events_immediate = true,
                                           bool host_mappable = true) {
  SimulatedDeviceConfig config;
  config.device_capacity = capacity;
  config.granularity = 2 * kMiB;
  config.events_complete_immediately = events_immediate;
  config.host_pages_mappable = host_mappable;
  return config;
}

// A byte pattern unique to (seed, offset), to prove data survives moves:
// xorshift, one 8-byte word a step (a step a byte made the sanitizer runs
// spend minutes making patterns).
inline std::vector<std::uint8_t> pattern(std::uint64_t seed, std::size_t bytes) {
  std::vector<std::uint8_t> out(bytes);
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  std::size_t at = 0;
  for (; at + sizeof x <= bytes; at += sizeof x) {
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    std::memcpy(out.data() + at, &x, sizeof x);
  }
  if (at < bytes) {
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    std::memcpy(out.data() + at, &x, bytes - at);
  }
  return out;
}

inline void fill(SimulatedBackend& device, DevicePtr address, std::uint64_t seed, std::size_t bytes) {
  const auto data = pattern(seed, bytes);
  device.write(address, data.data(), bytes);
}

inline bool holds(const SimulatedBackend& device, DevicePtr address, std::uint64_t seed, std::size_t bytes) {
  std::vector<std::uint8_t> got(bytes);
  device.read(address, got.data(), bytes);
  return got == pattern(seed, bytes);
}

}  // namespace cotenant::testing
