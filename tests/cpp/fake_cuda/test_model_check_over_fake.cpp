// A seeded random check of CachingAllocator on the real CudaBackend over the
// fake CUDA runtime, after tests/cpp/test_model_check.cpp: allocations, frees,
// record_stream, cap changes, spill_all/restore_all and empty_cache, with
// migrations at safe points (pipelined, as the torch adapter runs them, or
// not). Checked throughout: every live block reads back what was last
// written at its address (the bytes are real memory that faults if a page
// is not mapped), live blocks never overlap, and device-resident bytes stay
// under the cap after each safe point; at the end, nothing leaked and no
// driver rule was broken. A training loop's steps (step_script.h), with
// iteration marks, run the step plan, cold cache release and spilling ahead
// through the same checks.
//
// Pages are 64 KiB and the size classes scaled down with them (as in the
// simulated model check), so a few thousand operations reach page edges.
#include <catch2/catch.hpp>

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "cotenant/errors.h"
#include "devices.h"
#include "step_script.h"

using namespace cotenant;
using namespace cotenant::testing;

namespace {

constexpr std::size_t kKiB = 1024;
constexpr std::size_t kPage = 64 * kKiB;

AllocatorOptions scaled_options() {
  AllocatorOptions options;
  options.small_request_max = 32 * kKiB;
  // Arenas of 20 pages, so that a stream fills one and opens more, and a
  // large request gets an arena of its own size.
  options.arena_bytes = 20 * kPage;
  return options;
}

void write_words(DevicePtr address, std::size_t bytes, std::uint64_t seed) {
  auto* out = reinterpret_cast<unsigned char*>(address);
  for (std::size_t i = 0; i < bytes; i += 8) {
    const std::uint64_t word = (seed * 0x9E3779B97F4A7C15ull) ^ (i * 0xD1B54A32D192ED03ull);
    std::memcpy(out + i, &word, std::min<std::size_t>(8, bytes - i));
  }
}

bool words_hold(DevicePtr address, std::size_t bytes, std::uint64_t seed) {
  const auto* in = reinterpret_cast<const unsigned char*>(address);
  for (std::size_t i = 0; i < bytes; i += 8) {
    const std::uint64_t word = (seed * 0x9E3779B97F4A7C15ull) ^ (i * 0xD1B54A32D192ED03ull);
    if (std::memcmp(in + i, &word, std::min<std::size_t>(8, bytes - i)) != 0) return false;
  }
  return true;
}

struct Block {
  std::size_t bytes;
  std::uint64_t seed;
};

struct Harness {
  explicit Harness(std::uint64_t seed) : rng(seed) {
    fake_cuda::Config config;
    config.granularity = kPage;
    // 16 MiB: room for every live block when restore_all() lifts the cap
    // (no spilling without a cap), while caps of 1-64 pages force moves.
    config.device_capacity = 256 * kPage;
    fake_cuda::reset(config);
    backend = std::make_unique<cuda::CudaBackend>(0);
    allocator = std::make_unique<CachingAllocator>(*backend, scaled_options());
    for (auto& stream : streams) REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  }

  StreamId stream(std::size_t i) { return i == 0 ? 0 : reinterpret_cast<StreamId>(streams[i - 1]); }

  std::size_t random_size() {
    switch (rng() % 4) {
      case 0: return 1 + rng() % (4 * kKiB);
      case 1: return 1 + rng() % (32 * kKiB);
      case 2: return 1 + rng() % (300 * kKiB);
      default: return 300 * kKiB + rng() % (700 * kKiB);
    }
  }

  // One random operation (single-thread check); `live` holds the blocks.
  void step(std::map<DevicePtr, Block>& live, std::uint64_t& next_seed) {
    const auto choice = rng() % 10;
    if (choice < 5 || live.empty()) {
      const std::size_t bytes = random_size();
      const DevicePtr p = allocator->allocate(bytes, stream(rng() % 3));
      check_no_overlap(p, bytes);
      write_words(p, bytes, next_seed);
      live.emplace(p, Block{bytes, next_seed++});
      return;
    }
    auto it = live.begin();
    std::advance(it, static_cast<long>(rng() % live.size()));
    if (!words_hold(it->first, it->second.bytes, it->second.seed)) {
      FAIL_CHECK("block at " << it->first << " lost its bytes");
    }
    if (choice < 6) allocator->record_stream(it->first, stream(rng() % 3));
    if (choice < 9) {
      erase_live(it->first);
      allocator->free(it->first);
      live.erase(it);
    } else {
      write_words(it->first, it->second.bytes, next_seed);
      it->second.seed = next_seed++;
    }
  }

  void check_no_overlap(DevicePtr p, std::size_t bytes) {
    std::lock_guard<std::mutex> lock(ranges_mutex);
    auto next = ranges.lower_bound(p);
    if (next != ranges.end() && next->first < p + bytes) problems.push_back("new block overlaps a live block");
    if (next != ranges.begin() && std::prev(next)->first + std::prev(next)->second > p) {
      problems.push_back("new block overlaps a live block");
    }
    ranges.emplace(p, bytes);
  }
  // Catch2's assertions are not thread-safe: worker threads note problems
  // here and the test thread reports them.
  void note(const char* problem) {
    std::lock_guard<std::mutex> lock(ranges_mutex);
    problems.push_back(problem);
  }
  void report_problems() {
    for (const std::string& problem : problems) FAIL_CHECK(problem);
    CHECK(problems.empty());
  }
  void erase_live(DevicePtr p) {
    std::lock_guard<std::mutex> lock(ranges_mutex);
    ranges.erase(p);
  }

  // A safe point: random cap (or spill_all/restore_all), migrations, checks.
  void safe_point(bool pipelined) {
    const auto what = rng() % 8;
    if (what == 0) allocator->spill_all();
    else if (what == 1) allocator->restore_all();
    else if (what == 2) allocator->empty_cache();
    else allocator->set_memory_cap((1 + rng() % 64) * kPage);
    migrate(pipelined);
  }

  // The safe point's moves, then device-resident bytes are at most the cap.
  void migrate(bool pipelined) {
    backend->synchronize_device();
    if (pipelined) {
      backend->set_quiescent(true);
      allocator->apply_pending_migrations();
      backend->finish_copies();
      backend->set_quiescent(false);
    } else {
      allocator->apply_pending_migrations();
    }
    const AllocatorStats stats = allocator->stats();
    if (allocator->mode() == SpillMode::kRemap && stats.memory_cap != kNoCap) {
      CHECK(static_cast<std::uint64_t>(stats.device_resident_bytes.current) <= stats.memory_cap);
    }
    CHECK(static_cast<std::size_t>(stats.device_resident_bytes.current) == fake_cuda::device_bytes_in_use());
  }

  void finish() {
    allocator.reset();
    for (auto& stream : streams) cudaStreamDestroy(stream);
    backend.reset();
    check_fake_cuda_clean();
  }

  std::mt19937_64 rng;
  std::unique_ptr<cuda::CudaBackend> backend;
  std::unique_ptr<CachingAllocator> allocator;
  cudaStream_t streams[2] = {};
  std::mutex ranges_mutex;
  std::map<DevicePtr, std::size_t> ranges;
  std::vector<std::string> problems;  // guarded by ranges_mutex
};

}  // namespace

TEST_CASE("model_check_over_fake_cuda_single_thread", "[fake_cuda][model]") {
  const std::uint64_t seed = GENERATE(1, 2, 3);
  INFO("seed " << seed << " (rerun with this seed to reproduce)");
  Harness harness(seed);
  std::map<DevicePtr, Block> live;
  std::uint64_t next_seed = 1;
  for (int op = 0; op < 1500; ++op) {
    harness.step(live, next_seed);
    if (op % 40 == 39) harness.safe_point(op % 80 == 79);
    CHECK_NOTHROW(harness.allocator->check_invariants());
    if (live.size() > 40) {
      harness.erase_live(live.begin()->first);
      harness.allocator->free(live.begin()->first);
      live.erase(live.begin());
    }
  }
  for (const auto& [address, block] : live) CHECK(words_hold(address, block.bytes, block.seed));
  harness.report_problems();
  const AllocatorStats stats = harness.allocator->stats();
  CHECK(stats.num_migrations > 0);
  CHECK(stats.spilled_bytes > 0);
  CHECK(stats.restored_bytes > 0);
  for (const auto& [address, block] : live) harness.allocator->free(address);
  CHECK(harness.allocator->stats().allocated_bytes.all.current == 0);
  harness.finish();
}

TEST_CASE("model_check_over_fake_cuda_repeated_steps_with_marks", "[fake_cuda][model]") {
  const std::uint64_t seed = GENERATE(4, 5);
  INFO("seed " << seed);
  Harness harness(seed);
  StepScript script(harness.rng, 40, 3, [&](std::mt19937_64&) { return harness.random_size(); });
  std::vector<DevicePtr> address(script.slots(), 0);
  std::vector<Block> blocks(script.slots());
  std::uint64_t next_seed = 1;
  for (int step = 0; step < 40; ++step) {
    for (const ScriptOp& op : script.next_step(harness.rng)) {
      if (op.allocate) {
        const DevicePtr p = harness.allocator->allocate(op.bytes, harness.stream(op.stream));
        harness.check_no_overlap(p, op.bytes);
        write_words(p, op.bytes, next_seed);
        blocks[op.slot] = Block{op.bytes, next_seed++};
        address[op.slot] = p;
      } else {
        const DevicePtr p = address[op.slot];
        const Block& block = blocks[op.slot];
        if (!words_hold(p, block.bytes, block.seed)) FAIL_CHECK("block at " << p << " lost its bytes");
        if (harness.rng() % 8 == 0) harness.allocator->record_stream(p, harness.stream(harness.rng() % 3));
        harness.erase_live(p);
        harness.allocator->free(p);
        address[op.slot] = 0;
      }
      if (harness.rng() % 30 == 0) harness.safe_point(harness.rng() % 2 == 0);
      CHECK_NOTHROW(harness.allocator->check_invariants());
    }
    harness.allocator->mark_iteration();
    harness.migrate(step % 2 == 0);  // the optimizer step's safe point
  }
  for (std::size_t i = 0; i < script.slots(); ++i) {
    if (address[i] == 0) continue;
    CHECK(words_hold(address[i], blocks[i].bytes, blocks[i].seed));
    harness.erase_live(address[i]);
    harness.allocator->free(address[i]);
  }
  harness.report_problems();
  const AllocatorStats stats = harness.allocator->stats();
  // Moves both ways and pages released. (That the plan places requests is
  // pinned by the simulated model check on the same kind of script, where
  // steps repeat their layout only through it; here best fit often repeats
  // it too, so the count would not tell.)
  CHECK(stats.num_device_free > 0);
  CHECK(stats.spilled_bytes > 0);
  CHECK(stats.restored_bytes > 0);
  CHECK(harness.allocator->stats().allocated_bytes.all.current == 0);
  harness.finish();
}

TEST_CASE("model_check_over_fake_cuda_threads_with_safe_points", "[fake_cuda][model][threads]") {
  const std::uint64_t seed = GENERATE(7, 8);
  INFO("seed " << seed);
  Harness harness(seed);
  // Shared: a thread touching memory (a kernel); exclusive: a safe point.
  std::shared_mutex safe_point;
  std::atomic<int> running{3};
  std::vector<std::thread> workers;
  for (int t = 0; t < 3; ++t) {
    workers.emplace_back([&, t] {
      std::mt19937_64 local(seed * 100 + static_cast<std::uint64_t>(t));
      std::map<DevicePtr, Block> live;
      std::uint64_t next_seed = static_cast<std::uint64_t>(t) << 40;
      Harness& h = harness;
      for (int op = 0; op < 300; ++op) {
        std::shared_lock<std::shared_mutex> kernel(safe_point);
        // Each thread draws from its own generator: step() uses harness.rng.
        std::uint64_t value = local();
        const std::size_t bytes = 1 + value % (200 * kKiB);
        if ((value % 3 != 0 && live.size() < 16) || live.empty()) {
          const DevicePtr p = h.allocator->allocate(bytes, 0);
          h.check_no_overlap(p, bytes);
          write_words(p, bytes, next_seed);
          live.emplace(p, Block{bytes, next_seed++});
        } else {
          auto it = live.begin();
          std::advance(it, static_cast<long>(value % live.size()));
          if (!words_hold(it->first, it->second.bytes, it->second.seed)) h.note("a block lost its bytes");
          h.erase_live(it->first);
          h.allocator->free(it->first);
          live.erase(it);
        }
        try {
          h.allocator->check_invariants();
        } catch (const std::exception& e) {
          h.note(e.what());
        }
      }
      std::shared_lock<std::shared_mutex> kernel(safe_point);
      for (const auto& [address, block] : live) {
        if (!words_hold(address, block.bytes, block.seed)) h.note("a block lost its bytes");
        h.erase_live(address);
        h.allocator->free(address);
      }
      --running;
    });
  }
  std::thread controller([&] {
    while (running.load() > 0) {
      {
        std::unique_lock<std::shared_mutex> exclusive(safe_point);
        harness.safe_point(harness.rng() % 2 == 0);
        try {
          harness.allocator->check_invariants();
        } catch (const std::exception& e) {
          harness.note(e.what());
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  for (auto& w : workers) w.join();
  controller.join();
  harness.report_problems();
  CHECK(harness.allocator->stats().allocated_bytes.all.current == 0);
  harness.finish();
}
