// all_or_none: one change made to several things (a region paused on every
// device that holds it), so that a failure part way leaves none of them
// changed instead of some.
#pragma once

#include <cstddef>
#include <vector>

namespace cotenant {

// Runs apply(item) on each item in order and returns the sum of what they
// return. When one throws, undo(item) runs on those already done, the latest
// first (an undo that throws is skipped: the first error is the one that
// counts), and the error goes on to the caller.
template <typename Item, typename Apply, typename Undo>
std::size_t all_or_none(const std::vector<Item>& items, Apply&& apply, Undo&& undo) {
  std::size_t total = 0;
  std::size_t done = 0;
  try {
    for (const Item& item : items) {
      total += apply(item);
      ++done;
    }
  } catch (...) {
    while (done > 0) {
      try {
        undo(items[--done]);
      } catch (...) {
      }
    }
    throw;
  }
  return total;
}

}  // namespace cotenant
