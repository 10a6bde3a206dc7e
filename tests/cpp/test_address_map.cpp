#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cotenant/address_map.h"

using cotenant::AddressHash;
using cotenant::AddressMap;

namespace {

// The buckets `count` addresses from `base`, `stride` apart, take in a
// power-of-two table of `buckets` (tsl::robin_map masks the hash's low bits):
// how many distinct ones, and the most addresses in one.
struct Spread {
  std::size_t distinct = 0;
  std::size_t most = 0;
};
Spread spread(std::uintptr_t base, std::uintptr_t stride, std::size_t count, std::size_t buckets) {
  std::vector<std::size_t> load(buckets, 0);
  for (std::size_t i = 0; i < count; ++i) ++load[AddressHash{}(base + i * stride) & (buckets - 1)];
  Spread out;
  for (std::size_t n : load) {
    out.distinct += n != 0;
    out.most = std::max(out.most, n);
  }
  return out;
}

}  // namespace

TEST_CASE("address_hash_spreads_aligned_addresses_over_a_power_of_two_table", "[address_map]") {
  // Blocks start on 512-byte boundaries, pages on 2 MiB, arenas on large
  // ones: the mask alone would put every such address in a few buckets.
  // The map keeps at most half its buckets full, so 4,096 live addresses sit
  // in 8,192 buckets; a uniformly random hash would fill about 79% of 4,096,
  // with up to 5-7 in one bucket.
  const std::uintptr_t base = 0x7f3a00000000ull;
  for (std::uintptr_t stride : {std::uintptr_t{512}, std::uintptr_t{4096}, std::uintptr_t{2} << 20,
                                std::uintptr_t{1} << 30, (std::uintptr_t{3} << 20) + 512}) {
    INFO("stride " << stride);
    const Spread s = spread(base, stride, 4096, 8192);
    CHECK(s.distinct >= 4096 * 9 / 10);
    CHECK(s.most <= 2);
  }
}

TEST_CASE("address_map_finds_erases_and_reuses_entries_by_address", "[address_map]") {
  AddressMap<std::uintptr_t, int> map;
  const std::uintptr_t base = 0x7f3a00000000ull;
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 1000; ++i) map.emplace(base + static_cast<std::uintptr_t>(i) * 512, i + round);
    REQUIRE(map.size() == 1000);
    const std::size_t buckets = map.bucket_count();
    for (int i = 0; i < 1000; i += 2) {
      auto it = map.find(base + static_cast<std::uintptr_t>(i) * 512);
      REQUIRE(it != map.end());
      CHECK(it->second == i + round);
      map.erase(it);
    }
    CHECK(map.find(base) == map.end());
    CHECK(map.find(base + 512)->second == 1 + round);
    map.clear();
    // A map whose size repeats keeps its table: no rehash, no allocation.
    CHECK(map.bucket_count() == buckets);
  }
  // A pointer key hashes as its address (the torch allocator's owners).
  int object = 0;
  CHECK(AddressHash{}(static_cast<const void*>(&object)) == AddressHash{}(reinterpret_cast<std::uintptr_t>(&object)));
}
