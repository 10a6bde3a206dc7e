// The step before as a plan: where a loop that repeats its steps puts each
// request. Internal to csrc/core (docs/allocator.md, "Placement").
//
// Best fit alone never settles on such a loop: the blocks a step leaves
// alive (gradients) sit where the next step's blocks went, so each step
// routes around them somewhere else, and now and then reaches a page that is
// not mapped. Once the last step made the same requests, in the same order,
// as the step before it (the same sizes but for at most 1 in 16: a batch
// padded to another bucket length changes a few small tensors), the plan is
// that last step: each request goes to the address the same request had
// there while that range is free and large enough, and a request whose
// range is taken goes where no later request of the step is planned to go.
// The layout then repeats, and a warm loop maps nothing.
//
// A plan forms only once best fit has drifted: when a step that repeats the
// one before it had to map a page. A loop whose layout best fit already
// repeats maps nothing and needs no plan, and without one its free blocks
// are not also kept in address order (the allocator's cost of a plan).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cotenant/backend.h"

namespace cotenant::detail {

class StepPlan {
 public:
  // Requests a step may record; a longer step (or a program that stops
  // marking its steps) records no more and plans nothing.
  static constexpr std::size_t kMaxRequests = std::size_t{1} << 17;

  // An iteration mark: the step that ends becomes the plan if it made
  // similar requests to the one before it (similar_requests) and either
  // followed a plan or had to map a page (`mapped`). Recording starts at
  // the first mark.
  void mark(bool mapped) {
    // A step longer than kMaxRequests leaves current_ empty: it repeats nothing.
    const bool repeats = recording_ && !current_.empty() && similar_requests(current_, previous_);
    const bool same_layout =
        repeats && repeating_ && same_sizes(current_, previous_) && same_addresses(current_, previous_);
    repeating_ = repeats && (repeating_ || mapped);
    recording_ = true;
    in_step_ = true;
    differed_ = 0;
    previous_.swap(current_);
    current_.clear();
    made_ = 0;
    if (same_layout) return;  // a settled loop: the claims are those of the plan before
    claims_.clear();
    claim_end_max_.clear();
    if (!repeating_) return;
    claims_.reserve(previous_.size());
    for (std::size_t i = 0; i < previous_.size(); ++i) {
      claims_.push_back({previous_[i].address, previous_[i].address + previous_[i].size, i});
    }
    std::sort(claims_.begin(), claims_.end(), [](const Claim& a, const Claim& b) { return a.begin < b.begin; });
    DevicePtr end = 0;
    for (const Claim& claim : claims_) claim_end_max_.push_back(end = std::max(end, claim.end));
  }

  bool active() const { return repeating_; }

  // The address the next request (`size` bytes on `stream`) had in the plan
  // when its planned range holds `size`, while this step has made no more
  // requests than the plan and each on the plan's stream; 0 otherwise.
  DevicePtr hint(std::size_t size, StreamId stream) {
    if (!repeating_ || !in_step_) return 0;
    const std::size_t i = made_;
    if (i >= previous_.size() || previous_[i].stream != stream) {
      in_step_ = false;  // the step left the plan: no more hints until the next mark
      return 0;
    }
    if (size != previous_[i].size && ++differed_ * kDifferShare > i + kDifferShare * kDifferSlack) {
      in_step_ = false;  // more of its requests differ than a plan allows: the step left it
      return 0;
    }
    // A request larger than its planned range would run into the next ones.
    return size <= previous_[i].size ? previous_[i].address : 0;
  }

  // The lowest start of `size` bytes in [begin, end) that no later request
  // of this step is planned to overlap and that `usable(start)` accepts; 0
  // when there is none.
  template <class Usable>
  DevicePtr unclaimed(DevicePtr begin, DevicePtr end, std::size_t size, Usable usable) const {
    const std::size_t next = made_;
    // The first claim that can reach `begin`: claims are by start, and
    // claim_end_max_ is the furthest end of any claim up to each one.
    std::size_t k = static_cast<std::size_t>(
        std::upper_bound(claim_end_max_.begin(), claim_end_max_.end(), begin) - claim_end_max_.begin());
    DevicePtr at = begin;
    for (; k < claims_.size() && claims_[k].begin < end; ++k) {
      const Claim& claim = claims_[k];
      if (claim.end <= at || claim.request <= next) continue;  // behind us, or a request already made
      if (claim.begin >= at + size && usable(at)) return at;
      at = std::max(at, claim.end);
    }
    if (at + size <= end && usable(at)) return at;
    return 0;
  }

  // Each successful allocation, in order, where it went.
  void record(std::size_t size, StreamId stream, DevicePtr address) {
    if (!recording_) return;
    if (++made_ <= kMaxRequests) {
      current_.push_back({size, stream, address});
    } else if (made_ == kMaxRequests + 1) {  // too long a step: it records no more and plans nothing
      current_.clear();
      current_.shrink_to_fit();
    }
  }

 private:
  struct Request {
    std::size_t size;
    StreamId stream;
    DevicePtr address;
  };
  struct Claim {
    DevicePtr begin;
    DevicePtr end;
    std::size_t request;  // its index in the plan
  };

  // The same number of requests on the same streams, and the same sizes
  // but for a few (at most 1 in kDifferShare).
  static constexpr std::size_t kDifferShare = 16;
  // While a step runs, it follows the plan as long as no more than 1 in
  // kDifferShare of its requests so far differed, past the first
  // kDifferSlack (the first requests of a step may all be the few that
  // differ).
  static constexpr std::size_t kDifferSlack = 4;
  static bool similar_requests(const std::vector<Request>& a, const std::vector<Request>& b) {
    if (a.size() != b.size()) return false;
    std::size_t differ = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      if (a[i].stream != b[i].stream) return false;
      differ += a[i].size != b[i].size;
    }
    return differ * kDifferShare <= a.size();
  }
  static bool same_sizes(const std::vector<Request>& a, const std::vector<Request>& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end(),
                      [](const Request& x, const Request& y) { return x.size == y.size; });
  }
  static bool same_addresses(const std::vector<Request>& a, const std::vector<Request>& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end(),
                      [](const Request& x, const Request& y) { return x.address == y.address; });
  }

  bool recording_ = false;   // a mark has been seen
  bool repeating_ = false;   // the plan (previous_) repeated the step before it
  bool in_step_ = false;     // this step's requests have all matched the plan's so far
  std::size_t made_ = 0;     // requests this step has made (past kMaxRequests, no longer recorded)
  std::size_t differed_ = 0; // of them, those whose size was not the plan's
  std::vector<Request> current_;
  std::vector<Request> previous_;
  std::vector<Claim> claims_;              // the plan's ranges, by start
  std::vector<DevicePtr> claim_end_max_;   // running maximum of their ends
};

}  // namespace cotenant::detail
