// The launch gate's logic under a fake clock, fake completion markers and a
// fake guaranteed peer: nothing here depends on real time except the gate's
// short re-check interval while a thread waits.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "cotenant/launch_gate.h"

using namespace cotenant;
using namespace std::chrono_literals;

namespace {

constexpr Nanoseconds kMs = 1'000'000;

class FakeClock final : public Clock {
 public:
  Nanoseconds now_ns() const override { return now_.load(); }
  void advance(Nanoseconds by) { now_ += by; }
  void set(Nanoseconds at) { now_ = at; }

 private:
  std::atomic<Nanoseconds> now_{1'000 * kMs};
};

// Markers complete only when the test says so.
class FakeWork final : public InFlightWork {
 public:
  void record_marker() override {
    std::lock_guard<std::mutex> lock(mutex_);
    ++pending_;
    ++recorded_;
  }
  std::size_t poll_in_flight() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return pending_;
  }
  void complete(std::size_t n) {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_ -= std::min(n, pending_);
  }
  void complete_all() { complete(SIZE_MAX); }
  std::size_t pending() {
    std::lock_guard<std::mutex> lock(mutex_);
    return pending_;
  }
  std::size_t recorded() {
    std::lock_guard<std::mutex> lock(mutex_);
    return recorded_;
  }

 private:
  std::mutex mutex_;
  std::size_t pending_ = 0;
  std::size_t recorded_ = 0;
};

class FakePeer final : public PeerState {
 public:
  bool guaranteed_busy() const override { return busy.load(); }
  std::atomic<bool> busy{false};
};

struct FakeSink final : GuaranteedStateSink {
  void publish_activity(bool b, std::uint32_t n, Nanoseconds at) override {
    busy = b;
    ops_in_flight = n;
    last_activity_ns = at;
    ++activity_publications;
  }
  bool busy = false;
  std::uint32_t ops_in_flight = 0;
  Nanoseconds last_activity_ns = 0;
  int activity_publications = 0;
};

// Waits (real time, bounded) until `condition` holds.
bool eventually(const std::function<bool()>& condition, std::chrono::milliseconds limit = 2000ms) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (condition()) return true;
    std::this_thread::sleep_for(200us);
  }
  return condition();
}

struct Rig {
  FakeClock clock;
  FakeWork work;
  FakePeer peer;
  LaunchGate gate;
  explicit Rig(LaunchGateOptions options = {}) : gate(clock, work, peer, options) {}
};

LaunchGateOptions with_k(std::size_t k) {
  LaunchGateOptions options;
  options.max_in_flight = k;
  return options;
}

}  // namespace

TEST_CASE("duty_cycle_window_counts_only_busy_time_inside_the_window", "[gate]") {
  DutyCycleWindow window(100 * kMs);
  window.begin_busy(0);
  window.end_busy(30 * kMs);
  window.begin_busy(50 * kMs);
  CHECK(window.busy_ns(60 * kMs) == 40 * kMs);
  window.end_busy(70 * kMs);
  CHECK(window.busy_ns(100 * kMs) == 50 * kMs);
  // At 120 ms the window starts at 20 ms: 10 ms of the first interval remain.
  CHECK(window.busy_ns(120 * kMs) == 30 * kMs);
  CHECK(window.busy_ns(500 * kMs) == 0);
}

TEST_CASE("admits_at_once_when_guaranteed_job_is_idle", "[gate]") {
  Rig rig;
  rig.gate.admit();
  rig.gate.launched();
  auto stats = rig.gate.stats();
  CHECK(stats.admitted_ops == 1);
  CHECK(stats.waited_ns == 0);
  CHECK(rig.work.recorded() == 1);
  CHECK(stats.in_flight == 1);
}

TEST_CASE("ops_wait_while_guaranteed_job_is_busy_and_enter_once_it_is_idle", "[gate]") {
  Rig rig;
  rig.peer.busy = true;
  CHECK_FALSE(rig.gate.try_admit());

  std::atomic<bool> entered{false};
  std::thread op([&] {
    rig.gate.admit();
    entered = true;
    rig.gate.launched();
  });
  REQUIRE(eventually([&] { return rig.gate.stats().waiting == 1; }));
  std::this_thread::sleep_for(5ms);
  CHECK_FALSE(entered.load());
  rig.clock.advance(3 * kMs);
  rig.peer.busy = false;
  op.join();
  CHECK(entered.load());
  auto stats = rig.gate.stats();
  CHECK(stats.waits_guaranteed_busy == 1);
  CHECK(stats.waited_ns == 3 * kMs);
}

TEST_CASE("at_most_k_admitted_ops_are_in_flight", "[gate]") {
  Rig rig(with_k(2));
  REQUIRE(rig.gate.try_admit());
  rig.gate.launched();
  REQUIRE(rig.gate.try_admit());  // second: launching, not yet launched
  CHECK_FALSE(rig.gate.try_admit());
  rig.gate.launched();
  CHECK_FALSE(rig.gate.try_admit());  // two markers pending
  rig.work.complete(1);
  CHECK(rig.gate.try_admit());
  rig.gate.launched();
  CHECK_FALSE(rig.gate.try_admit());

  rig.gate.set_max_in_flight(3);
  CHECK(rig.gate.try_admit());
  rig.gate.abandoned();  // launched nothing: no marker
  CHECK(rig.work.recorded() == 3);
  CHECK(rig.gate.stats().in_flight == 2);
}

TEST_CASE("share_limits_busy_time_within_the_sliding_window", "[gate]") {
  LaunchGateOptions options;
  options.share_window_ns = 100 * kMs;
  options.initial_share = 0.25;
  Rig rig(options);
  const Nanoseconds t0 = rig.clock.now_ns();

  // One op keeps the GPU busy for 25 ms: the whole budget of a 0.25 share.
  REQUIRE(rig.gate.try_admit());
  rig.gate.launched();
  rig.clock.advance(25 * kMs);
  rig.work.complete_all();
  rig.gate.refresh();
  CHECK(rig.gate.stats().busy_ns_in_window == 25 * kMs);
  CHECK_FALSE(rig.gate.try_admit());

  // Still spent while the busy interval is inside the window...
  rig.clock.set(t0 + 100 * kMs);
  CHECK_FALSE(rig.gate.try_admit());
  // ...and allowed again once part of it has slid out.
  rig.clock.set(t0 + 101 * kMs);
  CHECK(rig.gate.try_admit());
  rig.gate.launched();
  CHECK(rig.gate.stats().waits_share_spent == 0);  // try_admit does not count waits
}

TEST_CASE("over_a_long_run_the_busy_fraction_follows_the_share", "[gate]") {
  for (double share : {0.25, 0.5, 0.75}) {
    LaunchGateOptions options;
    options.share_window_ns = 20 * kMs;
    options.initial_share = share;
    options.max_in_flight = 1;
    Rig rig(options);
    // Each op keeps the GPU busy for 1 ms; the job offers one every 1 ms.
    std::size_t admitted = 0;
    const int steps = 2000;
    for (int step = 0; step < steps; ++step) {
      if (rig.gate.try_admit()) {
        rig.gate.launched();
        ++admitted;
      }
      rig.clock.advance(kMs);
      rig.work.complete_all();
      rig.gate.refresh();
    }
    const double busy_fraction = static_cast<double>(admitted) / steps;
    INFO("share " << share << " busy fraction " << busy_fraction);
    CHECK(busy_fraction == Approx(share).margin(0.06));
  }
}

TEST_CASE("share_zero_pauses_at_the_next_op_and_raising_it_resumes", "[gate]") {
  Rig rig;
  rig.gate.set_share(0.0);
  CHECK_FALSE(rig.gate.try_admit());

  std::atomic<int> entered{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back([&] {
      rig.gate.admit();
      ++entered;
      rig.gate.abandoned();
    });
  }
  REQUIRE(eventually([&] { return rig.gate.stats().waiting == 3; }));
  std::this_thread::sleep_for(5ms);
  CHECK(entered.load() == 0);
  CHECK(rig.gate.stats().waits_paused == 3);

  rig.gate.set_share(0.5);
  for (auto& t : threads) t.join();
  CHECK(entered.load() == 3);
}

TEST_CASE("the_coordinator_share_caps_the_job_share_and_neither_replaces_the_other", "[gate]") {
  Rig rig;
  rig.gate.set_share(0.8);
  rig.gate.set_coordinator_share(0.0);
  CHECK_FALSE(rig.gate.try_admit());
  CHECK(rig.gate.stats().share == 0.0);
  rig.gate.set_coordinator_share(0.3);
  const LaunchGateStats stats = rig.gate.stats();
  CHECK(stats.share == Approx(0.3));
  CHECK(stats.user_share == Approx(0.8));
  CHECK(stats.coordinator_share == Approx(0.3));
  CHECK(rig.gate.try_admit());
  rig.gate.launched();
  CHECK(rig.gate.share() == Approx(0.8));
  // The job lowering its own share below the coordinator's wins, and raising
  // it again does not lift the coordinator's.
  rig.gate.set_share(0.1);
  CHECK(rig.gate.effective_share() == Approx(0.1));
  rig.gate.set_share(1.0);
  CHECK(rig.gate.effective_share() == Approx(0.3));
  rig.gate.set_coordinator_share(2.0);
  CHECK(rig.gate.coordinator_share() == 1.0);
}

TEST_CASE("shares_outside_zero_to_one_are_clamped", "[gate]") {
  Rig rig;
  rig.gate.set_share(7.0);
  CHECK(rig.gate.share() == 1.0);
  rig.gate.set_share(-1.0);
  CHECK(rig.gate.share() == 0.0);
}

TEST_CASE("many_threads_at_once_never_exceed_the_in_flight_bound", "[gate]") {
  constexpr std::size_t k = 3;
  Rig rig(with_k(k));
  std::atomic<int> launching{0};
  std::atomic<int> max_seen{0};
  std::atomic<bool> stop{false};

  // Completes markers in the background, like a GPU draining its queue.
  std::thread gpu([&] {
    while (!stop) {
      rig.work.complete(1);
      std::this_thread::sleep_for(50us);
    }
  });
  constexpr int kThreads = 8, kOpsEach = 150;
  // The count an op adds is read and handed over (launching -> pending
  // work) under one lock, so that no snapshot counts an op twice: once as
  // launching and once as its recorded marker. The gate's admit() stays
  // outside it, free to race.
  std::mutex books;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kOpsEach; ++i) {
        rig.gate.admit();
        int now = 0;
        {
          std::lock_guard<std::mutex> lock(books);
          now = ++launching + static_cast<int>(rig.work.pending());
        }
        int seen = max_seen.load();
        while (now > seen && !max_seen.compare_exchange_weak(seen, now)) {
        }
        std::lock_guard<std::mutex> lock(books);
        --launching;
        rig.gate.launched();
      }
    });
  }
  for (auto& t : threads) t.join();
  stop = true;
  gpu.join();
  CHECK(rig.gate.stats().admitted_ops == kThreads * kOpsEach);
  CHECK(rig.work.recorded() == kThreads * kOpsEach);
  CHECK(max_seen.load() <= static_cast<int>(k));
}

TEST_CASE("close_waits_for_launching_ops_and_in_flight_work_then_blocks_until_reopen", "[gate]") {
  Rig rig(with_k(4));
  REQUIRE(rig.gate.try_admit());  // an op is between admit and launched
  std::atomic<bool> closed{false};
  std::thread closer([&] {
    rig.gate.close();
    closed = true;
  });
  REQUIRE(eventually([&] { return rig.gate.is_closed(); }));
  std::this_thread::sleep_for(5ms);
  CHECK_FALSE(closed.load());
  rig.gate.launched();  // launched, but its marker is pending
  std::this_thread::sleep_for(5ms);
  CHECK_FALSE(closed.load());
  rig.work.complete_all();
  closer.join();
  CHECK(closed.load());

  CHECK_FALSE(rig.gate.try_admit());
  std::atomic<bool> entered{false};
  std::thread op([&] {
    rig.gate.admit();
    entered = true;
    rig.gate.launched();
  });
  REQUIRE(eventually([&] { return rig.gate.stats().waiting == 1; }));
  CHECK(rig.gate.stats().waits_closed == 1);
  CHECK_FALSE(entered.load());
  rig.gate.reopen();
  op.join();
  CHECK(entered.load());
}

TEST_CASE("closes_nest_and_the_last_reopen_lets_ops_through", "[gate]") {
  Rig rig;
  rig.gate.close();
  rig.gate.close();
  rig.gate.reopen();
  CHECK(rig.gate.is_closed());
  CHECK_FALSE(rig.gate.try_admit());
  rig.gate.reopen();
  CHECK(rig.gate.try_admit());
  rig.gate.launched();
}

TEST_CASE("without_admission_control_only_close_stops_ops", "[gate]") {
  LaunchGateOptions options;
  options.admission_control = false;
  options.max_in_flight = 1;
  Rig rig(options);
  rig.peer.busy = true;
  rig.gate.set_share(0.0);
  for (int i = 0; i < 5; ++i) {
    REQUIRE(rig.gate.try_admit());
    rig.gate.launched();
  }
  CHECK(rig.work.recorded() == 0);  // no markers: no per-op cost
  rig.gate.close();  // returns at once: nothing launching
  CHECK_FALSE(rig.gate.try_admit());
  rig.gate.reopen();
  CHECK(rig.gate.try_admit());
  rig.gate.launched();
}

TEST_CASE("busy_tracker_records_at_most_one_marker_per_interval", "[gate][guaranteed]") {
  FakeClock clock;
  FakeWork work;
  FakeSink sink;
  BusyTrackerOptions options;
  options.min_marker_interval_ns = 100'000;  // 100 us
  options.unmarked_grace_ns = 2 * kMs;
  BusyTracker tracker(clock, work, sink, options);

  for (int i = 0; i < 100; ++i) {  // 100 launches 10 us apart: 1 ms
    tracker.on_op_launched();
    clock.advance(10'000);
  }
  CHECK(tracker.markers_recorded() == 10);
  CHECK(tracker.refresh());
  CHECK(sink.busy);
  CHECK(sink.ops_in_flight == 10);

  work.complete_all();
  // The last launches have no marker of their own: busy during the grace.
  CHECK(tracker.refresh());
  CHECK(sink.ops_in_flight == 0);
  clock.advance(3 * kMs);
  CHECK_FALSE(tracker.refresh());
  CHECK_FALSE(sink.busy);

  tracker.mark();  // an iteration boundary covers the tail at once
  CHECK(tracker.refresh());
  work.complete_all();
  CHECK_FALSE(tracker.refresh());
}

TEST_CASE("iteration_tracker_measures_last_ewma_and_p99", "[gate][guaranteed]") {
  FakeClock clock;
  IterationTracker tracker(clock);
  tracker.boundary();  // starts timing only
  CHECK(tracker.stats().iterations == 0);
  for (int i = 0; i < 99; ++i) {
    clock.advance(10 * kMs);
    tracker.boundary();
  }
  clock.advance(50 * kMs);  // one slow iteration in 100
  tracker.boundary();
  auto stats = tracker.stats();
  CHECK(stats.iterations == 100);
  CHECK(stats.last_ns == 50 * kMs);
  CHECK(stats.p99_ns == 10 * kMs);  // nearest rank: the 99th of 100 is 10 ms
  CHECK(stats.ewma_ns == 10 * kMs + 40 * kMs / 8);
  CHECK(stats.total_ns == 99 * 10 * kMs + 50 * kMs);
  clock.advance(50 * kMs);  // a second slow one: 2 in 101
  tracker.boundary();
  CHECK(tracker.stats().p99_ns == 50 * kMs);  // nearest rank 100 of 101 is slow
  CHECK(tracker.stats().iterations == 101);
  tracker.record(-5);  // a clock glitch is not an iteration
  CHECK(tracker.stats().iterations == 101);
  tracker.record(20 * kMs);  // a known duration counts like a measured one
  CHECK(tracker.stats().iterations == 102);
  CHECK(tracker.stats().last_ns == 20 * kMs);
}

TEST_CASE("iteration_begin_excludes_the_gap_before_an_iteration", "[gate][guaranteed]") {
  FakeClock clock;
  IterationTracker tracker(clock);
  tracker.begin();
  clock.advance(4 * kMs);
  tracker.boundary();
  clock.advance(100 * kMs);  // idle between requests
  tracker.begin();
  clock.advance(6 * kMs);
  tracker.boundary();
  CHECK(tracker.stats().iterations == 2);
  CHECK(tracker.stats().last_ns == 6 * kMs);
  CHECK(tracker.stats().p99_ns == 6 * kMs);
}

TEST_CASE("duty_cycle_window_counts_only_the_last_window_after_many_intervals", "[gate]") {
  DutyCycleWindow window(10 * kMs);
  for (int i = 0; i < 10'000; ++i) {
    window.begin_busy(i * kMs);
    window.end_busy(i * kMs + kMs / 2);
  }
  // Only the last ten intervals (half busy each) are inside the window.
  CHECK(window.busy_ns(10'000 * kMs) == 5 * kMs);
}
