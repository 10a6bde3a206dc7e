// Maps keyed by an address (a device pointer), on the paths every allocation
// and free takes: the core's live blocks, the torch allocator's owner of
// each pointer, and, while memory history is recorded, each live block's
// context.
#pragma once

#include <cstddef>
#include <cstdint>

#include <tsl/robin_map.h>

namespace cotenant {

// tsl::robin_map takes a bucket from the hash's low bits (a power-of-two
// table: a mask, not a division by a prime as std::unordered_map's), and
// addresses are multiples of 512 bytes or more, so the address is mixed
// first: Fibonacci hashing of the address in 512-byte units, the product's
// bits from 32 up (each depends on every bit of the address below it).
// Addresses a fixed stride apart (blocks, pages, arenas) then fall in
// distinct buckets; MurmurHash3's finalizer spreads them like random ones,
// with more collisions (and more mispredicted branches on the allocator's
// alloc+free pairs).
struct AddressHash {
  std::size_t operator()(std::uintptr_t address) const noexcept {
    return static_cast<std::size_t>(((static_cast<std::uint64_t>(address) >> 9) * 0x9E3779B97F4A7C15ull) >> 32);
  }
  std::size_t operator()(const void* address) const noexcept {
    return (*this)(reinterpret_cast<std::uintptr_t>(address));
  }
};

// Open addressing: a lookup is a multiply, a mask and a short probe, and a
// map whose size repeats (a warm loop) asks the heap for nothing, where a
// node-based map allocated an entry for each insert. Inserts may move
// entries: hold no iterator or reference across one.
template <class Key, class Value>
using AddressMap = tsl::robin_map<Key, Value, AddressHash>;

}  // namespace cotenant
