// The allocator's data: segments of reserved address space, the pages that
// back them, and the blocks that tile them. Internal to csrc/core.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
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

// A set that keeps the nodes of erased values for later inserts, so that
// the allocator's fast path allocates no memory of its own.
template <class Order, class Value = Block*>
class BlockSet {
 public:
  using Set = std::set<Value, Order>;
  typename Set::const_iterator insert(const Value& value) {
    if (spare_.empty()) return set_.insert(value).first;
    typename Set::node_type node = std::move(spare_.back());
    spare_.pop_back();
    node.value() = value;
    return set_.insert(std::move(node)).position;
  }
  void erase(const Value& value) {
    if (typename Set::node_type node = set_.extract(value)) spare_.push_back(std::move(node));
  }
  void erase(typename Set::const_iterator position) { spare_.push_back(set_.extract(position)); }
  void clear() {
    while (!set_.empty()) spare_.push_back(set_.extract(set_.begin()));
  }
  const Set& set() const { return set_; }

 private:
  Set set_;
  std::vector<typename Set::node_type> spare_;
};

// Free blocks ordered for best fit (FreeEntry). Each block keeps its own
// entry's position while in the pool, so taking it out searches nothing.
class BlockPool {
 public:
  // The smallest free block of `stream` with at least `size` bytes, or null.
  Block* best_fit(StreamId stream, std::size_t size) const {
    auto it = first_fit_in_order(stream, size);
    return it == blocks_.set().end() || it->stream != stream ? nullptr : it->block;
  }
  // The first of the free blocks of `stream` with at least `size` bytes, in
  // best-fit order and at most `limit` of them, that `accept` takes; or null.
  template <class Accept>
  Block* find_fit(StreamId stream, std::size_t size, std::size_t limit, Accept accept) const {
    for (auto it = first_fit_in_order(stream, size);
         it != blocks_.set().end() && it->stream == stream && limit > 0; ++it, --limit) {
      if (accept(it->block)) return it->block;
    }
    return nullptr;
  }
  void insert(Block* block) { block->pool_entry = blocks_.insert(key_of(block)); }
  // `block` must be in this pool (in_pool, and inserted here).
  void erase(Block* block) { blocks_.erase(block->pool_entry); }
  bool empty() const { return blocks_.set().empty(); }
  std::size_t size() const { return blocks_.set().size(); }

 private:
  using Entry = FreeEntry;
  static Entry key_of(Block* block) { return {block->segment->stream, block->size, block->address, block}; }
  using Set = BlockSet<std::less<Entry>, Entry>::Set;
  Set::const_iterator first_fit_in_order(StreamId stream, std::size_t size) const {
    return blocks_.set().lower_bound(Entry{stream, size, 0, nullptr});
  }
  BlockSet<std::less<Entry>, Entry> blocks_;
};

// Free blocks by address, to find the one holding a given address.
struct ByAddress {
  bool operator()(const Block* a, const Block* b) const { return a->address < b->address; }
};

}  // namespace cotenant::detail
