// The allocator's data: segments of reserved address space, the pages that
// back them, and the blocks that tile them. Internal to csrc/core.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <tuple>
#include <vector>

#include "cotenant/backend.h"
#include "cotenant/stats.h"

namespace cotenant::detail {

struct Segment;
struct Block;

// A free block's key in the best-fit order (BlockPool): by stream, then
// size, then address. The entry holds the key itself, so a search compares
// the tree's own nodes and reads no block (a block's size changes only while
// it is out of the pool).
struct FreeEntry {
  StreamId stream;
  std::size_t size;
  DevicePtr address;
  Block* block;
  bool operator<(const FreeEntry& other) const {
    return std::tie(stream, size, address) < std::tie(other.stream, other.size, other.address);
  }
};
using FreeTree = std::set<FreeEntry>;

// A contiguous piece of a segment.
// Invariants:
//  - the blocks of a segment tile it in address order through prev/next;
//  - a block is in exactly one state: allocated, waiting on record_stream
//    events (freed, not yet reusable), or free and in exactly one pool;
//  - two free blocks are never neighbours (freeing merges them);
//  - every page overlapping an allocated or waiting block is mapped.
struct Block {
  Segment* segment = nullptr;
  DevicePtr address = 0;
  std::size_t size = 0;          // bytes, a multiple of the rounding
  std::size_t requested = 0;     // bytes the caller asked for; 0 unless allocated
  PoolKind size_class = PoolKind::kLarge;  // of the request, for the statistics; set when allocated
  bool allocated = false;
  bool in_pool = false;
  Block* prev = nullptr;
  Block* next = nullptr;
  std::vector<StreamId> used_on;     // streams other than the segment's (record_stream)
  std::vector<EventHandle> events;   // recorded on used_on at free time
  FreeTree::const_iterator pool_entry;  // its entry in the BlockPool while in one (leaving it is then no search)

  bool is_split() const { return prev != nullptr || next != nullptr; }
};

// One page of a segment.
// Invariant: live_blocks counts the allocated or waiting blocks overlapping
// the page; a mapped page with live_blocks == 0 is cache and may be released.
struct Page {
  PageHandle handle;             // empty when unmapped
  std::uint32_t live_blocks = 0;
  std::uint64_t last_use = 0;    // allocator tick of the last allocation or free on its blocks: its heat
  // The mark (cold_before) at which the cold-cache rule released this page,
  // while it stays released by that rule (0 otherwise; empty_cache() clears
  // it, starting the footprint over).
  std::uint64_t released_cold = 0;
};

// A reserved address range owned by one stream: an arena, or a pinned
// fallback segment (a single pinned-host allocation with one block and no
// pages). Arenas count as PoolKind::kLarge in the statistics.
struct Segment {
  DevicePtr base = 0;
  std::size_t size = 0;
  StreamId stream = 0;
  PoolKind pool = PoolKind::kLarge;
  bool pinned_fallback = false;
  std::vector<Page> pages;
  Block* first = nullptr;
};

// The nodes of values erased from sets of one type, kept for the next
// insert into any of them, so that the allocator's fast path allocates no
// memory of its own (BlockSet keeps one set's, BlockPool its bins').
template <class Set>
class SpareNodes {
 public:
  typename Set::const_iterator insert(Set& set, const typename Set::value_type& value) {
    if (spare_.empty()) return set.insert(value).first;
    typename Set::node_type node = std::move(spare_.back());
    spare_.pop_back();
    node.value() = value;
    return set.insert(std::move(node)).position;
  }
  void erase(Set& set, typename Set::const_iterator position) { spare_.push_back(set.extract(position)); }

 private:
  std::vector<typename Set::node_type> spare_;
};

// A set whose erased values' nodes serve its later inserts.
template <class Order, class Value = Block*>
class BlockSet {
 public:
  using Set = std::set<Value, Order>;
  typename Set::const_iterator insert(const Value& value) { return spare_.insert(set_, value); }
  void erase(const Value& value) {
    const auto position = set_.find(value);
    if (position != set_.end()) spare_.erase(set_, position);
  }
  void erase(typename Set::const_iterator position) { spare_.erase(set_, position); }
  void clear() {
    while (!set_.empty()) spare_.erase(set_, set_.begin());
  }
  const Set& set() const { return set_; }

 private:
  Set set_;
  SpareNodes<Set> spare_;
};

// Free blocks ordered for best fit (FreeEntry): the smallest block of a
// stream with at least the requested size, the lowest address among equal
// sizes. Each block keeps its own entry's position while in the pool, so
// taking it out searches nothing.
//
// The order is split into size bins, each a small tree, with a bitmap of
// the bins that hold a block: a search descends one bin's tree (a few
// levels, not the dozen of one tree over every free block, each level a
// node that may miss the cache) and finds the next bin by the bitmap. The
// bins partition sizes in order, so walking them in order is the one
// best-fit order.
// Invariant: a bin's bit is set exactly while its tree is not empty; an
// entry sits in the bin of its size.
class BlockPool {
 public:
  // The smallest free block of `stream` with at least `size` bytes, or null.
  Block* best_fit(StreamId stream, std::size_t size) const {
    return find_fit(stream, size, 1, [](const Block*) { return true; });
  }
  // The first of the free blocks of `stream` with at least `size` bytes, in
  // best-fit order and at most `limit` of them, that `accept` takes; or null.
  template <class Accept>
  Block* find_fit(StreamId stream, std::size_t size, std::size_t limit, Accept accept) const {
    const Bins* bins = bins_of(stream);
    if (bins == nullptr || limit == 0) return nullptr;
    std::size_t bin = bin_of(size);
    auto it = bins->trees[bin].lower_bound(FreeEntry{stream, size, 0, nullptr});
    while (true) {
      for (; it != bins->trees[bin].end(); ++it) {
        if (accept(it->block)) return it->block;
        if (--limit == 0) return nullptr;
      }
      bin = bins->next_nonempty(bin + 1);
      if (bin == kBins) return nullptr;
      it = bins->trees[bin].begin();
    }
  }
  void insert(Block* block) {
    const FreeEntry entry{block->segment->stream, block->size, block->address, block};
    Bins& bins = bins_for(entry.stream);
    const std::size_t bin = bin_of(entry.size);
    block->pool_entry = spare_.insert(bins.trees[bin], entry);
    bins.nonempty[bin / 64] |= std::uint64_t{1} << (bin % 64);
    ++count_;
  }
  // `block` must be in this pool (in_pool, and inserted here).
  void erase(Block* block) {
    const FreeEntry& entry = *block->pool_entry;
    Bins& bins = *bins_of(entry.stream);
    const std::size_t bin = bin_of(entry.size);
    FreeTree& tree = bins.trees[bin];
    spare_.erase(tree, block->pool_entry);
    if (tree.empty()) bins.nonempty[bin / 64] &= ~(std::uint64_t{1} << (bin % 64));
    --count_;
  }
  bool empty() const { return count_ == 0; }
  std::size_t size() const { return count_; }

 private:
  // Bins: one per 512 bytes below 32 KiB, then eight per doubling of size
  // (each 1/8 of its octave wide), up to 2**64 bytes.
  static constexpr std::size_t kExactBins = 64;          // [0, 32 KiB) in steps of 512 bytes
  static constexpr unsigned kFirstOctave = 15;           // 32 KiB = 2**15
  static constexpr std::size_t kBinsPerOctave = 8;
  static constexpr std::size_t kBins = kExactBins + (64 - kFirstOctave) * kBinsPerOctave;
  static constexpr std::size_t kWords = (kBins + 63) / 64;
  // Non-decreasing in size: a smaller size never lands in a later bin.
  static std::size_t bin_of(std::size_t size) {
    if (size < (std::size_t{1} << kFirstOctave)) return size >> 9;
    const unsigned octave = 63 - static_cast<unsigned>(__builtin_clzll(size));
    const std::size_t eighth = (size >> (octave - 3)) & (kBinsPerOctave - 1);
    return kExactBins + (octave - kFirstOctave) * kBinsPerOctave + eighth;
  }

  struct Bins {
    StreamId stream = 0;
    std::array<FreeTree, kBins> trees;
    std::array<std::uint64_t, kWords> nonempty{};
    // The first bin at or after `bin` that holds a block, or kBins.
    std::size_t next_nonempty(std::size_t bin) const {
      for (std::size_t word = bin / 64; word < kWords; ++word) {
        std::uint64_t bits = nonempty[word];
        if (word == bin / 64) bits &= ~std::uint64_t{0} << (bin % 64);
        if (bits != 0) return word * 64 + static_cast<std::size_t>(__builtin_ctzll(bits));
      }
      return kBins;
    }
  };
  // A job uses a few streams: a list, searched in order.
  Bins* bins_of(StreamId stream) const {
    for (const auto& bins : streams_) {
      if (bins->stream == stream) return bins.get();
    }
    return nullptr;
  }
  Bins& bins_for(StreamId stream) {
    if (Bins* bins = bins_of(stream)) return *bins;
    streams_.push_back(std::make_unique<Bins>());
    streams_.back()->stream = stream;
    return *streams_.back();
  }

  std::vector<std::unique_ptr<Bins>> streams_;
  SpareNodes<FreeTree> spare_;  // shared by every bin: a node freed in one serves an insert in any
  std::size_t count_ = 0;
};

// Free blocks by address, to find the one holding a given address.
struct ByAddress {
  bool operator()(const Block* a, const Block* b) const { return a->address < b->address; }
};

}  // namespace cotenant::detail
