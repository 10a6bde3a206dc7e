// A training loop's requests as a script, for the randomized checks
// (test_model_check.cpp, fake_cuda/test_model_check_over_fake.cpp).
//
// Steps repeat, so the allocator's step plan forms and places requests at
// the addresses the step before gave them. Some blocks outlive their step
// (gradients) and are freed in the next one, before their own request comes
// again. Now and then one request's size changes, for one step or from then
// on (a longer sequence), so the plan breaks and forms again.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <random>
#include <utility>
#include <vector>

namespace cotenant::testing {

struct ScriptOp {
  bool allocate = false;  // else free
  std::size_t slot = 0;   // the block's name within the step
  std::size_t bytes = 0;  // allocations only
  std::size_t stream = 0; // allocations only: an index the caller maps to a stream
};

class StepScript {
 public:
  using DrawSize = std::function<std::size_t(std::mt19937_64&)>;

  // `requests` allocations a step, each of `draw_size(rng)` bytes on one of
  // `streams` streams.
  StepScript(std::mt19937_64& rng, std::size_t requests, std::size_t streams, DrawSize draw_size)
      : slots_(requests), draw_(std::move(draw_size)) {
    for (std::size_t i = 0; i < requests; ++i) {
      Slot& slot = slots_[i];
      slot.bytes = draw_(rng);
      slot.stream = rng() % streams;
      slot.carried = rng() % 6 == 0;
      // In-step blocks die after their request, by the step's end at the
      // latest; carried ones in the next step, before their request.
      slot.dies_at = slot.carried ? rng() % (i + 1) : i + 1 + rng() % (requests - i);
    }
  }

  // The next step's operations. A step whose sizes differ from the step
  // before's (one in four) is off the plan; half of those changes stay.
  std::vector<ScriptOp> next_step(std::mt19937_64& rng) {
    std::vector<std::size_t> bytes(slots_.size());
    for (std::size_t i = 0; i < slots_.size(); ++i) bytes[i] = slots_[i].bytes;
    if (rng() % 4 == 0) {
      const std::size_t changed = rng() % slots_.size();
      bytes[changed] = draw_(rng);
      if (rng() % 2 == 0) slots_[changed].bytes = bytes[changed];
    }
    std::vector<ScriptOp> ops;
    auto free_at = [&](std::size_t position, bool carried) {
      for (std::size_t i = 0; i < slots_.size(); ++i) {
        Slot& slot = slots_[i];
        if (slot.live && slot.carried == carried && slot.dies_at == position) {
          ops.push_back({false, i, 0, 0});
          slot.live = false;
        }
      }
    };
    for (std::size_t k = 0; k <= slots_.size(); ++k) {
      free_at(k, /*carried=*/true);
      free_at(k, /*carried=*/false);
      if (k == slots_.size()) break;
      ops.push_back({true, k, bytes[k], slots_[k].stream});
      slots_[k].live = true;
    }
    return ops;
  }

  std::size_t slots() const { return slots_.size(); }

 private:
  struct Slot {
    std::size_t bytes = 0;
    std::size_t stream = 0;
    bool carried = false;     // outlives its step
    std::size_t dies_at = 0;  // the request (of this step or, carried, the next) before which it is freed
    bool live = false;        // allocated and not yet freed
  };
  std::vector<Slot> slots_;
  DrawSize draw_;
};

}  // namespace cotenant::testing
