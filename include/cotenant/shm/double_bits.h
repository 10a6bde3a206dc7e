// Doubles in shared memory travel as the bits of a 64-bit word, so that they
// can live in std::atomic<std::uint64_t> fields that are lock-free and
// address-free across processes (std::atomic<double> is not guaranteed to be).
#pragma once

#include <cstdint>
#include <cstring>

namespace cotenant::shm {

inline std::uint64_t double_to_bits(double value) {
  std::uint64_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

inline double bits_to_double(std::uint64_t bits) {
  double value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

}  // namespace cotenant::shm
