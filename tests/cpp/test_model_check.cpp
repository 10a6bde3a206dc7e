// A randomized, seeded model check of the allocator against a reference
// model, with several threads, several streams, record_stream, cap changes,
// spill_all/restore_all, empty_cache and migrations at safe points; and a
// training loop's steps (step_script.h) with iteration marks, so that the
// step plan places requests, cold cache is released and safe points spill
// ahead, under the same checks.
//
// The model: every live block's address range and the seed of the bytes last
// written into it; ranges held back by record_stream. Checked throughout:
//  - live blocks never overlap one another, nor a range still held back;
//  - every live byte reads back what was last written (through moves);
//  - device-resident bytes are at most the cap after every safe point;
// and at the end of each round, with all threads stopped:
//  - the statistics equal the model's sums and the simulated device's bytes.
//
// A safe point is modelled as a writer lock: data reads and writes (kernels)
// hold it shared, apply_pending_migrations() holds it exclusive.
#include <catch2/catch.hpp>

#include <cstring>
#include <algorithm>
#include <condition_variable>
#include <map>
#include <random>
#include <shared_mutex>
#include <thread>

#include "cotenant/errors.h"
#include "step_script.h"
#include "test_helpers.h"

using namespace cotenant;
using namespace cotenant::testing;

namespace {

constexpr std::size_t kKiB = 1024;
constexpr std::size_t kPage = 64 * kKiB;

// Fast reproducible contents: 8-byte words derived from (seed, offset).
void write_pattern(SimulatedBackend& device, DevicePtr address, std::size_t bytes, std::uint64_t seed) {
  std::vector<std::uint64_t> words((bytes + 7) / 8);
  for (std::size_t i = 0; i < words.size(); ++i) words[i] = (seed * 0x9E3779B97F4A7C15ull) ^ (i * 0xD1B54A32D192ED03ull);
  device.write(address, words.data(), bytes);
}

bool pattern_holds(const SimulatedBackend& device, DevicePtr address, std::size_t bytes, std::uint64_t seed) {
  std::vector<std::uint64_t> words((bytes + 7) / 8), expected((bytes + 7) / 8);
  device.read(address, words.data(), bytes);
  for (std::size_t i = 0; i < expected.size(); ++i) expected[i] = (seed * 0x9E3779B97F4A7C15ull) ^ (i * 0xD1B54A32D192ED03ull);
  return std::memcmp(words.data(), expected.data(), bytes) == 0;
}

struct LiveBlock {
  std::size_t size = 0;       // what allocation_size() reports
  std::size_t requested = 0;
  std::uint64_t seed = 0;
  StreamId stream = 0;
};

// The reference model, shared by all threads.
struct Model {
  std::mutex mutex;
  std::map<DevicePtr, std::size_t> live;                        // address -> size
  // record_stream ranges by stream, each with the device's synchronize count
  // read before its free: any later synchronize finished that stream's work.
  struct Held {
    DevicePtr address;
    std::size_t size;
    std::uint64_t synchronized_before;
  };
  std::multimap<StreamId, Held> held;
  std::vector<std::string> violations;

  static bool overlaps(DevicePtr a, std::size_t a_size, DevicePtr b, std::size_t b_size) {
    return a < b + b_size && b < a + a_size;
  }

  // `synchronized`: the device's synchronize count after the allocation
  // (allocating may release cache, which synchronizes the device).
  void add_live(DevicePtr address, std::size_t size, std::uint64_t synchronized) {
    std::lock_guard lock(mutex);
    for (auto it = held.begin(); it != held.end();) {
      it = it->second.synchronized_before < synchronized ? held.erase(it) : std::next(it);
    }
    auto next = live.lower_bound(address);
    if (next != live.end() && overlaps(address, size, next->first, next->second)) {
      violations.push_back("new block overlaps a live block");
    }
    if (next != live.begin() && overlaps(address, size, std::prev(next)->first, std::prev(next)->second)) {
      violations.push_back("new block overlaps a live block");
    }
    for (const auto& [stream, range] : held) {
      if (overlaps(address, size, range.address, range.size)) {
        violations.push_back("a block held back by record_stream was handed out before its stream finished");
      }
    }
    live.emplace(address, size);
  }
};

struct Config {
  std::uint64_t seed;
  int threads;
  int ops_per_thread;
};

struct Harness {
  explicit Harness(std::uint64_t seed)
      : device(make_config()), allocator(device, make_options()), rng(seed) {}

  static SimulatedDeviceConfig make_config() {
    SimulatedDeviceConfig config;
    config.device_capacity = 6 * 1024 * kKiB;
    config.granularity = kPage;
    config.events_complete_immediately = false;
    return config;
  }
  // The production size classes scaled down 32x with the page, so that a
  // few thousand operations exercise segments, splits and page boundaries.
  static AllocatorOptions make_options() {
    AllocatorOptions options;
    options.small_request_max = 32 * kKiB;
    // Arenas of 20 pages, so that a stream fills one and opens more, and a
    // large request gets an arena of its own size.
    options.arena_bytes = 20 * kPage;
    // The uncapped phases fill the small device: spill then too, so that
    // "out of memory although host memory is plentiful" stays checkable.
    options.spill_without_cap = true;
    return options;
  }

  SimulatedBackend device;
  CachingAllocator allocator;
  Model model;
  std::shared_mutex safe_point;  // shared: kernels touching memory; exclusive: migrations
  std::mt19937_64 rng;
  std::atomic<std::uint64_t> cap{kNoCap};
  // Lock-step, both ways: a worker waits for controller round k before its
  // operation k * kOpsPerRound, and the controller starts round k only when
  // every worker has reached k * kOpsPerRound operations (it stops when all
  // have finished). So cap changes land among the workers' operations however
  // the threads are scheduled, and the controller (which takes the locks the
  // workers need) can neither fall behind nor starve them. Waits block on a
  // condition variable: spinning is slow under the sanitizers.
  static constexpr int kOpsPerRound = 20;
  static constexpr int kFinished = 1 << 30;
  struct LockStep {
    std::mutex mutex;
    std::condition_variable changed;
    int rounds = 0;
    std::vector<int> progress;  // operations reached, per worker; kFinished when done
    bool active = false;        // false: workers never wait (single-thread test)

    void start(int workers) {
      std::lock_guard lock(mutex);
      progress.assign(static_cast<std::size_t>(workers), 0);
      active = true;
    }
    // A worker about to run operation `op`.
    void worker_reaches(int index, int op) {
      if (op % kOpsPerRound != 0) return;
      std::unique_lock lock(mutex);
      if (!active) return;
      progress[static_cast<std::size_t>(index)] = op;
      changed.notify_all();
      changed.wait(lock, [&] { return rounds >= op / kOpsPerRound; });
    }
    void worker_finished(int index) {
      std::lock_guard lock(mutex);
      if (!active) return;
      progress[static_cast<std::size_t>(index)] = kFinished;
      changed.notify_all();
    }
    // Waits until the next round may run; false once every worker finished.
    bool controller_may_run() {
      std::unique_lock lock(mutex);
      changed.wait(lock, [&] {
        return *std::min_element(progress.begin(), progress.end()) >= rounds * kOpsPerRound;
      });
      return *std::min_element(progress.begin(), progress.end()) != kFinished;
    }
    void controller_done_round() {
      std::lock_guard lock(mutex);
      ++rounds;
      changed.notify_all();
    }
  } lock_step;

  std::size_t random_size(std::mt19937_64& r) {
    const int kind = static_cast<int>(r() % 10);
    if (kind < 5) return 1 + r() % (32 * kKiB);
    if (kind < 9) return 32 * kKiB + r() % (300 * kKiB);
    return 300 * kKiB + r() % (1200 * kKiB);
  }

  // Allocates `block` (its request, seed and stream set), adds it to the
  // model and writes its bytes; 0 (a violation noted) when it failed.
  DevicePtr allocate_block(LiveBlock& block) {
    DevicePtr address = 0;
    try {
      // An allocation is part of an op: no safe point runs meanwhile (an
      // allocation may go over the cap until the next one).
      std::shared_lock op(safe_point);
      address = allocator.allocate(block.requested, block.stream);
    } catch (const OutOfMemoryError&) {
      std::lock_guard lock(model.mutex);
      model.violations.push_back("out of memory although host memory is plentiful");
      return 0;
    }
    block.size = allocator.allocation_size(address);
    if (block.size < block.requested || block.size % 512 != 0) {
      std::lock_guard lock(model.mutex);
      model.violations.push_back("allocation_size is not the rounded request");
    }
    model.add_live(address, block.size, device.calls().synchronize_device);
    std::shared_lock kernel(safe_point);
    write_pattern(device, address, block.requested, block.seed);
    return address;
  }

  // Frees a live block; with a `side_stream` (not 0), as used on it
  // (record_stream), so its range is held back until that stream's work ends.
  void free_block(DevicePtr address, const LiveBlock& block, StreamId side_stream) {
    if (side_stream != 0) allocator.record_stream(address, side_stream);
    {
      std::lock_guard lock(model.mutex);
      model.live.erase(address);
      if (side_stream != 0) {
        model.held.emplace(side_stream, Model::Held{address, block.size, device.calls().synchronize_device});
      }
    }
    allocator.free(address);
  }

  void check_block(DevicePtr address, const LiveBlock& block) {
    std::shared_lock kernel(safe_point);
    if (!pattern_holds(device, address, block.requested, block.seed)) {
      std::lock_guard lock(model.mutex);
      model.violations.push_back("a live block does not hold the bytes last written into it");
    }
  }

  // The side stream's work finishes: its held-back ranges may be reused.
  void complete_side_stream(StreamId side_stream) {
    std::lock_guard lock(model.mutex);
    device.complete_stream(side_stream);
    model.held.erase(side_stream);
  }

  // One worker: its own streams, its own live blocks.
  void worker(int index, std::uint64_t seed, int ops) {
    std::mt19937_64 r(seed);
    const StreamId streams[2] = {StreamId(10 + 2 * index), StreamId(11 + 2 * index)};
    const StreamId side_stream = 100 + index;  // record_stream target
    std::map<DevicePtr, LiveBlock> mine;
    for (int op = 0; op < ops; ++op) {
      lock_step.worker_reaches(index, op);
      check_invariants();
      const int action = static_cast<int>(r() % 100);
      if (action < 45 || mine.empty()) {
        LiveBlock block;
        block.requested = random_size(r);
        block.seed = r();
        block.stream = streams[r() % 2];
        if (const DevicePtr address = allocate_block(block)) mine.emplace(address, block);
      } else if (action < 80) {
        auto it = std::next(mine.begin(), static_cast<long>(r() % mine.size()));
        free_block(it->first, it->second, r() % 5 == 0 ? side_stream : 0);
        mine.erase(it);
      } else if (action < 95) {
        auto it = std::next(mine.begin(), static_cast<long>(r() % mine.size()));
        check_block(it->first, it->second);
      } else {
        complete_side_stream(side_stream);
      }
    }
    lock_step.worker_finished(index);
    std::lock_guard lock(model.mutex);
    for (auto& [address, block] : mine) {
      model.live.erase(address);
      allocator.free(address);
    }
  }

  // The coordinator's role: move the cap, spill/restore, empty the cache, and
  // run safe points; checks the cap after each.
  void controller(std::uint64_t seed) {
    std::mt19937_64 r(seed);
    for (; lock_step.controller_may_run(); lock_step.controller_done_round()) {
      controller_round(r);
      std::this_thread::yield();
    }
  }

  // One round of the controller: an action, then a safe point. `marks`:
  // iteration marks are among the actions (not where the loop marks its own).
  void controller_round(std::mt19937_64& r, bool marks = true) {
    const std::uint64_t caps[] = {2 * 1024 * kKiB, 3 * 1024 * kKiB, 5 * 1024 * kKiB, kNoCap};
    const int action = static_cast<int>(r() % 10);
    if (action < 5) {
      const std::uint64_t next = caps[r() % 4];
      if (next == kNoCap) allocator.set_memory_cap(~std::uint64_t{0});
      else allocator.set_memory_cap(next);
      cap = next;
    } else if (action == 5) {
      allocator.spill_all();
      cap = 0;
    } else if (action == 6) {
      allocator.restore_all();
      cap = allocator.memory_cap();
    } else if (action == 7) {
      std::lock_guard lock(model.mutex);
      allocator.empty_cache();  // waits for held-back blocks: their streams are done
      model.held.clear();
    } else if (action == 8 && marks) {
      allocator.mark_iteration();  // cache idle since the last mark turns cold; safe points spill ahead
    }
    safe_point_now();
  }

  // A safe point: pages move, then device-resident bytes are at most the cap.
  void safe_point_now() {
    std::unique_lock quiet(safe_point);
    std::lock_guard lock(model.mutex);
    const auto synchronized_before = device.calls().synchronize_device;
    allocator.apply_pending_migrations();
    check_invariants();
    // A safe point that moved pages synchronized the device: every
    // stream's work is done, so held-back ranges may be reused.
    if (device.calls().synchronize_device != synchronized_before) model.held.clear();
    const AllocatorStats stats = allocator.stats();
    const std::uint64_t limit = cap.load();
    if (static_cast<std::uint64_t>(stats.device_resident_bytes.current) > limit ||
        device.device_bytes_in_use() > limit) {
      model.violations.push_back("device-resident bytes above the cap after a safe point");
    }
  }

  // The allocator's own books, after every step of every thread.
  void check_invariants() {
    try {
      allocator.check_invariants();
    } catch (const std::exception& e) {
      std::lock_guard lock(model.mutex);
      model.violations.push_back(e.what());
    }
  }

  // With every thread stopped: the statistics against the model and the device.
  void check_quiescent_stats() {
    device.synchronize_device();
    allocator.empty_cache();
    model.held.clear();
    const AllocatorStats stats = allocator.stats();
    std::int64_t live_bytes = 0;
    for (const auto& [address, size] : model.live) live_bytes += static_cast<std::int64_t>(size);
    CHECK(stats.allocated_bytes.all.current == live_bytes);
    CHECK(stats.allocation.all.current == static_cast<std::int64_t>(model.live.size()));
    CHECK(stats.active_bytes.all.current == live_bytes);
    CHECK(stats.reserved_bytes.all.current ==
          static_cast<std::int64_t>(device.device_bytes_in_use() + device.host_bytes_in_use()));
    CHECK(stats.device_resident_bytes.current == static_cast<std::int64_t>(device.device_bytes_in_use()));
    CHECK(stats.host_resident_bytes.current == static_cast<std::int64_t>(device.host_bytes_in_use()));
    CHECK(stats.allocated_bytes.all.current ==
          stats.allocated_bytes.small_pool.current + stats.allocated_bytes.large_pool.current);
    CHECK(stats.allocated_bytes.all.allocated - stats.allocated_bytes.all.freed == live_bytes);
    CHECK(stats.num_ooms == 0);
  }
};

}  // namespace

TEST_CASE("model_check_random_operations_from_many_threads_and_streams", "[model]") {
  const std::uint64_t seed = GENERATE(1, 2, 3);
  INFO("seed " << seed << " (rerun with this seed to reproduce)");
  Harness harness(seed);
  constexpr int kThreads = 4;
  constexpr int kOps = 1500;
  harness.lock_step.start(kThreads);
  std::thread controller([&] { harness.controller(seed * 7919); });
  std::vector<std::thread> workers;
  for (int t = 0; t < kThreads; ++t) {
    workers.emplace_back([&, t] { harness.worker(t, seed * 1000 + static_cast<std::uint64_t>(t), kOps); });
  }
  for (auto& w : workers) w.join();
  controller.join();  // returns once every worker has finished

  for (const std::string& violation : harness.model.violations) FAIL_CHECK(violation);
  CHECK(harness.model.violations.empty());
  harness.check_quiescent_stats();
  const AllocatorStats stats = harness.allocator.stats();
  // The run really exercised what it claims to.
  CHECK(stats.allocation.all.allocated >= kThreads * kOps / 3);
  CHECK(stats.num_migrations > 0);
  CHECK(stats.spilled_bytes > 0);
  CHECK(stats.restored_bytes > 0);
}

TEST_CASE("model_check_single_thread_interleaves_with_exact_statistics_midway", "[model]") {
  const std::uint64_t seed = GENERATE(11, 12);
  INFO("seed " << seed);
  Harness harness(seed);
  std::mt19937_64 r(seed);
  for (int round = 0; round < 6; ++round) {
    harness.worker(0, r(), 400);  // frees everything it allocated at the end
    harness.allocator.set_memory_cap((1 + r() % 4) * 1024 * kKiB);
    harness.allocator.apply_pending_migrations();
    harness.model.held.clear();  // the safe point synchronized every stream
    harness.check_quiescent_stats();
    CHECK(harness.allocator.stats().allocated_bytes.all.current == 0);
  }
  CHECK(harness.model.violations.empty());
}

TEST_CASE("model_check_repeated_steps_with_plans_marks_and_a_moving_cap", "[model]") {
  const std::uint64_t seed = GENERATE(21, 22, 23);
  INFO("seed " << seed);
  Harness harness(seed);
  std::mt19937_64 r(seed);
  StepScript script(r, 40, 2, [&](std::mt19937_64& g) { return harness.random_size(g); });
  const StreamId streams[2] = {10, 11};
  const StreamId side_stream = 100;
  std::vector<DevicePtr> address(script.slots(), 0);
  std::vector<LiveBlock> blocks(script.slots());
  std::vector<DevicePtr> layout, layout_before;  // each step's addresses, in request order
  int same_layout = 0;
  for (int step = 0; step < 60; ++step) {
    layout.clear();
    for (const ScriptOp& op : script.next_step(r)) {
      LiveBlock& block = blocks[op.slot];
      if (op.allocate) {
        block.requested = op.bytes;
        block.seed = r();
        block.stream = streams[op.stream];
        address[op.slot] = harness.allocate_block(block);
        layout.push_back(address[op.slot]);
      } else if (address[op.slot] != 0) {
        harness.check_block(address[op.slot], block);
        harness.free_block(address[op.slot], block, r() % 8 == 0 ? side_stream : 0);
        address[op.slot] = 0;
      }
      harness.check_invariants();
      // The coordinator's moves and the next op's safe point, now and then.
      if (r() % 30 == 0) harness.controller_round(r, /*marks=*/false);
      if (r() % 10 == 0) harness.complete_side_stream(side_stream);
    }
    harness.allocator.mark_iteration();
    harness.safe_point_now();  // the optimizer step's
    if (layout == layout_before) ++same_layout;
    layout.swap(layout_before);
  }
  for (std::size_t i = 0; i < script.slots(); ++i) {
    if (address[i] == 0) continue;
    harness.check_block(address[i], blocks[i]);
    harness.free_block(address[i], blocks[i], 0);
  }
  for (const std::string& violation : harness.model.violations) FAIL_CHECK(violation);
  CHECK(harness.model.violations.empty());
  harness.check_quiescent_stats();
  const AllocatorStats stats = harness.allocator.stats();
  // The run really exercised what it claims to: steps that repeated their
  // layout (5-12 of 60 with these seeds; none when the plan places nothing),
  // page moves both ways, and pages released.
  CHECK(same_layout >= 3);
  CHECK(stats.spilled_bytes > 0);
  CHECK(stats.restored_bytes > 0);
  CHECK(stats.num_device_free > 0);
}
