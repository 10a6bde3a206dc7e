// The launch gate: an opportunistic job computes only in the guaranteed job's
// idle slots, and the trackers through which the guaranteed job says when
// those are.
//
// No CUDA and no torch here. Every source of time and of completion is an
// interface, so the same logic runs under a fake clock in tests and over CUDA
// events in a real job:
//   Clock         now, in nanoseconds of one monotonic clock (CLOCK_MONOTONIC
//                 in real use, so two processes on one host agree);
//   InFlightWork  completion markers recorded after admitted ops (CUDA events
//                 on the current stream), polled for how many are pending;
//   PeerState     whether the guaranteed job on the same GPU is busy (the
//                 per-GPU shared-memory segment, see shm/gpu_block.h).
//
// Opportunistic side (LaunchGate::admit): an op enters only when all hold
//   (a) fewer than k admitted ops are in flight (k = max_in_flight), so a
//       guaranteed kernel never queues behind a long opportunistic backlog;
//   (b) the guaranteed job is idle;
//   (c) the duty-cycle share allows it: the time this process kept the GPU
//       busy within the last share_window_ns is below share * window, where
//       share = min(the job's own share, the coordinator's share). The two
//       have one writer each (set_share: the job's code; set_coordinator_share:
//       the job channel, from the per-job block) and neither replaces the other.
// Share 0 pauses every thread at its next op; raising it resumes them.
// close() stops all threads and drains in-flight work: the safe point for
// page migration and suspend.
//
// Guaranteed side: BusyTracker (ops in flight, last activity) publishes
// through a GuaranteedStateSink.
// Every role: IterationTracker, the job's one measurement of iteration times
// (last, EWMA, p99 over a recent window), which the job channel reports to
// the coordinator.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <vector>

namespace cotenant {

// Nanoseconds of one monotonic clock, or a duration in nanoseconds.
using Nanoseconds = std::int64_t;

class Clock {
 public:
  virtual ~Clock() = default;
  virtual Nanoseconds now_ns() const = 0;
};

// CLOCK_MONOTONIC: the same time base in every process of a host, so a
// timestamp one job publishes in shared memory means the same to another.
class MonotonicClock final : public Clock {
 public:
  Nanoseconds now_ns() const override;
  static MonotonicClock& instance();
};

// Completion markers for launched work. On a GPU each marker is a CUDA event
// recorded on the stream the op launched on; in tests, a fake.
// Callers serialize calls (the gate and trackers call it under their lock).
class InFlightWork {
 public:
  virtual ~InFlightWork() = default;
  // Records a marker that completes when the work launched so far (by the
  // calling thread, on its current stream) has completed.
  virtual void record_marker() = 0;
  // Retires completed markers and returns how many are still pending.
  virtual std::size_t poll_in_flight() = 0;
};

// What the guaranteed job on the same GPU publishes, as the opportunistic
// side reads it. Reads are atomic loads: cheap, any thread.
class PeerState {
 public:
  virtual ~PeerState() = default;
  // True while the guaranteed job has work on the GPU (or launched within its
  // grace period). False when there is no live guaranteed job.
  virtual bool guaranteed_busy() const = 0;
};

// A PeerState with no peer: never busy.
class NoPeer final : public PeerState {
 public:
  bool guaranteed_busy() const override { return false; }
};

// Busy time within a sliding window, from busy intervals [begin, end).
// Invariant: intervals are disjoint and ordered; at most one is open;
// closed_sum_ is the total length of the closed ones kept.
class DutyCycleWindow {
 public:
  explicit DutyCycleWindow(Nanoseconds window_ns);
  void begin_busy(Nanoseconds at);  // no-op while an interval is open
  void end_busy(Nanoseconds at);    // no-op while none is open
  bool busy() const { return open_; }
  // Busy nanoseconds within [now - window, now], the open interval up to now.
  Nanoseconds busy_ns(Nanoseconds now);
  Nanoseconds window_ns() const { return window_ns_; }
  void set_window_ns(Nanoseconds window_ns);

 private:
  void prune(Nanoseconds now);
  Nanoseconds window_ns_;
  std::deque<std::pair<Nanoseconds, Nanoseconds>> closed_;
  Nanoseconds closed_sum_ = 0;  // the sum of closed_'s interval lengths
  bool open_ = false;
  Nanoseconds open_since_ = 0;
};

struct LaunchGateOptions {
  // false: only close()/reopen() stop ops (guaranteed and default roles,
  // where the gate is just the safe point); no markers, no share, no peer.
  bool admission_control = true;
  // k: admitted ops whose completion markers are pending, plus ops admitted
  // and still launching. Small: 1 to 4.
  std::size_t max_in_flight = 2;
  // The window over which the share is a duty cycle. Shorter is smoother;
  // it must stay well above one op's GPU time.
  Nanoseconds share_window_ns = 50'000'000;  // 50 ms
  // Real time between re-checks while a thread waits (peer state, markers
  // and time change without notifying the gate).
  std::chrono::microseconds poll_interval{20};
  double initial_share = 1.0;
};

// Why an op is waiting, for statistics and tests.
enum class GateWait : std::uint8_t { kNone, kClosed, kInFlightBound, kPaused, kGuaranteedBusy, kShareSpent };
const char* to_string(GateWait reason);

// The gate's statistics, each field listed once: X(type, name, initial).
// Every dictionary of gate statistics (cotenant._core's LaunchGate.stats(),
// cotenant.gate.stats()) is generated from this list, so the names agree.
#define COTENANT_LAUNCH_GATE_STATS_FIELDS(X)                                                 \
  X(std::uint64_t, admitted_ops, 0)                                                          \
  /* ops that had to wait, by the first reason they waited for */                           \
  X(std::uint64_t, waits_closed, 0)                                                          \
  X(std::uint64_t, waits_in_flight_bound, 0)                                                 \
  X(std::uint64_t, waits_paused, 0)                                                          \
  X(std::uint64_t, waits_guaranteed_busy, 0)                                                 \
  X(std::uint64_t, waits_share_spent, 0)                                                     \
  X(Nanoseconds, waited_ns, 0)         /* total time ops waited (gate clock) */             \
  X(Nanoseconds, busy_ns_in_window, 0) /* this process's GPU-busy time in the window */     \
  X(std::size_t, in_flight, 0)         /* pending markers + ops still launching */          \
  X(std::size_t, launching, 0)         /* threads between admit() and launched() */         \
  X(std::size_t, waiting, 0)           /* threads blocked in admit() */                     \
  X(double, share, 1.0)                /* in force: min(user_share, coordinator_share) */   \
  X(double, user_share, 1.0)           /* set_share(): the job's own */                     \
  X(double, coordinator_share, 1.0)    /* set_coordinator_share(): the coordinator's */     \
  X(bool, closed, false)

struct LaunchGateStats {
#define COTENANT_DECLARE_FIELD(type, name, initial) type name = initial;
  COTENANT_LAUNCH_GATE_STATS_FIELDS(COTENANT_DECLARE_FIELD)
#undef COTENANT_DECLARE_FIELD
};

// Calls visit(name, value) for each field of `stats`, in list order.
template <typename Visit>
void for_each_field(const LaunchGateStats& stats, Visit&& visit) {
#define COTENANT_VISIT(type, name, initial) visit(#name, stats.name);
  COTENANT_LAUNCH_GATE_STATS_FIELDS(COTENANT_VISIT)
#undef COTENANT_VISIT
}

// Thread-safe: admit()/launched() from any number of threads at once;
// set_share(), close(), reopen(), stats() from any thread.
class LaunchGate {
 public:
  LaunchGate(Clock& clock, InFlightWork& work, PeerState& peer, LaunchGateOptions options = {});
  ~LaunchGate();
  LaunchGate(const LaunchGate&) = delete;
  LaunchGate& operator=(const LaunchGate&) = delete;

  // Blocks the calling thread until its op may launch. Every admit() must be
  // followed by launched() (or abandoned()) on the same thread once the op's
  // work is enqueued.
  void admit();
  // Admits without waiting if the op may launch now; false otherwise.
  bool try_admit();
  // The admitted op's work is enqueued: records its completion marker.
  void launched();
  // The admitted op launched nothing (it failed before its kernels).
  void abandoned();

  // The job's own share in [0, 1] (clamped); 0 pauses at the next op.
  // Wakes waiters.
  void set_share(double share);
  double share() const;  // the job's own, as set
  // The coordinator's share in [0, 1] (the job channel applies it).
  void set_coordinator_share(double share);
  double coordinator_share() const;
  double effective_share() const;  // min of the two: what admission uses
  void set_max_in_flight(std::size_t k);  // at least 1
  std::size_t max_in_flight() const;

  // Stops every thread at its next admit() and returns once no thread is
  // between admit() and launched() and every marker has completed. Must not
  // be called between admit() and launched() on the same thread. Nests: each
  // close() needs one reopen().
  void close();
  void reopen();
  bool is_closed() const;

  // Polls markers and updates the busy accounting without admitting (for a
  // background thread, so idle time is not charged as busy while no op runs).
  void refresh();
  // Wakes waiting threads to re-check now (e.g. after the peer changed).
  void notify();

  LaunchGateStats stats();
  const LaunchGateOptions& options() const { return options_; }

 private:
  GateWait wait_reason_locked(Nanoseconds now);
  void poll_locked(Nanoseconds now);
  void admit_locked(Nanoseconds now);
  double effective_share_locked() const;

  Clock& clock_;
  InFlightWork& work_;
  PeerState& peer_;
  LaunchGateOptions options_;

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  // Invariants (under mutex_): in_flight_markers_ is the last poll's count;
  // launching_ counts threads between admit() and launched()/abandoned();
  // window_ is busy while launching_ + in_flight_markers_ > 0.
  std::size_t in_flight_markers_ = 0;
  std::size_t launching_ = 0;
  std::size_t waiting_ = 0;
  int close_depth_ = 0;
  double share_;
  double coordinator_share_ = 1.0;
  DutyCycleWindow window_;
  LaunchGateStats counters_;
};

// RAII admission: admit() on construction, launched() on destruction.
class GateAdmission {
 public:
  explicit GateAdmission(LaunchGate& gate) : gate_(gate) { gate_.admit(); }
  ~GateAdmission() { gate_.launched(); }
  GateAdmission(const GateAdmission&) = delete;
  GateAdmission& operator=(const GateAdmission&) = delete;

 private:
  LaunchGate& gate_;
};

// ---- guaranteed side ----------------------------------------------------------

struct IterationStats {
  std::uint64_t iterations = 0;  // completed iterations
  Nanoseconds last_ns = 0;       // the most recent iteration's time
  Nanoseconds ewma_ns = 0;       // exponentially weighted mean (alpha = 1/8)
  Nanoseconds total_ns = 0;      // every iteration's time, summed: a window's mean is
                                 // (total_ns - total_ns then) / (iterations - iterations then)
  Nanoseconds p99_ns = 0;        // 99th percentile over the last kIterationWindow
};

// Where the guaranteed job's busy tracker publishes (the per-GPU segment's
// guaranteed slot in real use, a fake in tests). Called under the tracker's
// lock; must be cheap (atomic stores).
class GuaranteedStateSink {
 public:
  virtual ~GuaranteedStateSink() = default;
  virtual void publish_activity(bool busy, std::uint32_t ops_in_flight, Nanoseconds last_activity_ns) = 0;
};

struct BusyTrackerOptions {
  // At most one completion marker per interval: a marker per op would cost
  // the guaranteed job a CUDA event record per op.
  Nanoseconds min_marker_interval_ns = 50'000;  // 50 us
  // Launches after the last marker have no marker of their own; the job
  // counts as busy for this long after the last of them.
  Nanoseconds unmarked_grace_ns = 2'000'000;  // 2 ms
};

// The guaranteed job's busy state: cheap on the launch path (one clock read
// and, at most once per min_marker_interval_ns, a marker), accurate at
// refresh() (a background thread, every ~100 us).
class BusyTracker {
 public:
  BusyTracker(Clock& clock, InFlightWork& work, GuaranteedStateSink& sink,
              BusyTrackerOptions options = {});
  // After an op's work is enqueued, on the launching thread.
  void on_op_launched();
  // Forces a marker now (iteration boundaries), so the tail is tracked.
  void mark();
  // Polls markers, publishes, and returns whether the job is busy.
  bool refresh();
  std::size_t markers_recorded() const { return markers_recorded_.load(std::memory_order_relaxed); }

 private:
  void record_marker_locked(Nanoseconds now);
  Clock& clock_;
  InFlightWork& work_;
  GuaranteedStateSink& sink_;
  BusyTrackerOptions options_;
  std::mutex mutex_;
  std::atomic<Nanoseconds> last_activity_ns_{0};
  std::atomic<Nanoseconds> last_marker_ns_{INT64_MIN / 2};
  std::atomic<bool> unmarked_launches_{false};
  std::atomic<std::size_t> markers_recorded_{0};
  std::size_t pending_markers_ = 0;
};

// Iteration boundaries (optimizer.step(), `with cotenant.iteration():`) to
// iteration times: the job's one measurement, for every role. The job
// channel reports stats() to the coordinator; gate statistics show them.
class IterationTracker {
 public:
  static constexpr std::size_t kIterationWindow = 128;
  explicit IterationTracker(Clock& clock);
  // Marks the end of one iteration and the start of the next. The first call
  // only starts timing.
  void boundary();
  // One iteration that took `took` (a simulated job that knows its times).
  void record(Nanoseconds took);
  // Starts timing an iteration without ending one: for loops with gaps
  // between iterations (`with cotenant.iteration():` around each request),
  // so a gap is not counted as iteration time.
  void begin();
  IterationStats stats() const;

 private:
  void record_locked(Nanoseconds took);
  Clock& clock_;
  mutable std::mutex mutex_;
  Nanoseconds last_boundary_ns_ = -1;
  IterationStats stats_;
  std::vector<Nanoseconds> recent_;  // ring of the last kIterationWindow times
  std::size_t next_ = 0;
};

}  // namespace cotenant
