#include "cotenant/launch_gate.h"

#include <time.h>

#include <algorithm>

namespace cotenant {

// ---- clock ------------------------------------------------------------------

Nanoseconds MonotonicClock::now_ns() const {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<Nanoseconds>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

MonotonicClock& MonotonicClock::instance() {
  static MonotonicClock clock;
  return clock;
}

// ---- duty-cycle window --------------------------------------------------------

DutyCycleWindow::DutyCycleWindow(Nanoseconds window_ns) : window_ns_(std::max<Nanoseconds>(window_ns, 1)) {}

void DutyCycleWindow::set_window_ns(Nanoseconds window_ns) { window_ns_ = std::max<Nanoseconds>(window_ns, 1); }

void DutyCycleWindow::begin_busy(Nanoseconds at) {
  if (open_) return;
  open_ = true;
  open_since_ = at;
}

void DutyCycleWindow::end_busy(Nanoseconds at) {
  if (!open_) return;
  open_ = false;
  if (at > open_since_) {
    closed_.emplace_back(open_since_, at);
    closed_sum_ += at - open_since_;
  }
  prune(at);  // bounded memory even when nobody asks for busy_ns()
}

void DutyCycleWindow::prune(Nanoseconds now) {
  const Nanoseconds start = now - window_ns_;
  while (!closed_.empty() && closed_.front().second <= start) {
    closed_sum_ -= closed_.front().second - closed_.front().first;
    closed_.pop_front();
  }
}

// O(1): the intervals are disjoint and ordered, so only the oldest one can
// straddle the window's start.
Nanoseconds DutyCycleWindow::busy_ns(Nanoseconds now) {
  prune(now);
  const Nanoseconds start = now - window_ns_;
  Nanoseconds busy = closed_sum_;
  if (!closed_.empty() && closed_.front().first < start) busy -= start - closed_.front().first;
  if (open_ && now > open_since_) busy += now - std::max(open_since_, start);
  return busy;
}

// ---- the gate -----------------------------------------------------------------

const char* to_string(GateWait reason) {
  switch (reason) {
    case GateWait::kNone: return "none";
    case GateWait::kClosed: return "closed";
    case GateWait::kInFlightBound: return "in_flight_bound";
    case GateWait::kPaused: return "paused";
    case GateWait::kGuaranteedBusy: return "guaranteed_busy";
    case GateWait::kShareSpent: return "share_spent";
  }
  return "unknown";
}

namespace {
double clamp_share(double share) {
  if (!(share >= 0.0)) return 0.0;  // NaN pauses: the safe reading of nonsense
  return std::min(share, 1.0);
}
}  // namespace

LaunchGate::LaunchGate(Clock& clock, InFlightWork& work, PeerState& peer, LaunchGateOptions options)
    : clock_(clock),
      work_(work),
      peer_(peer),
      options_(options),
      share_(clamp_share(options.initial_share)),
      window_(options.share_window_ns) {
  options_.max_in_flight = std::max<std::size_t>(options_.max_in_flight, 1);
}

LaunchGate::~LaunchGate() = default;

double LaunchGate::effective_share_locked() const {
  return std::min(share_, coordinator_share_);
}

void LaunchGate::poll_locked(Nanoseconds now) {
  if (!options_.admission_control) return;
  in_flight_markers_ = work_.poll_in_flight();
  if (in_flight_markers_ + launching_ == 0) window_.end_busy(now);
}

GateWait LaunchGate::wait_reason_locked(Nanoseconds now) {
  if (close_depth_ > 0) return GateWait::kClosed;
  if (!options_.admission_control) return GateWait::kNone;
  if (in_flight_markers_ + launching_ >= options_.max_in_flight) return GateWait::kInFlightBound;
  const double share = effective_share_locked();
  if (share <= 0.0) return GateWait::kPaused;
  if (peer_.guaranteed_busy()) return GateWait::kGuaranteedBusy;
  if (share < 1.0) {
    const auto allowed = static_cast<Nanoseconds>(share * static_cast<double>(window_.window_ns()));
    if (window_.busy_ns(now) >= allowed) return GateWait::kShareSpent;
  }
  return GateWait::kNone;
}

void LaunchGate::admit_locked(Nanoseconds now) {
  ++launching_;
  ++counters_.admitted_ops;
  // The GPU is charged from admission: the op's kernels follow within
  // microseconds, and charging early errs on the guaranteed job's side.
  if (options_.admission_control) window_.begin_busy(now);
}

void LaunchGate::admit() {
  std::unique_lock<std::mutex> lock(mutex_);
  Nanoseconds now = clock_.now_ns();
  poll_locked(now);
  GateWait reason = wait_reason_locked(now);
  if (reason != GateWait::kNone) {
    switch (reason) {
      case GateWait::kClosed: ++counters_.waits_closed; break;
      case GateWait::kInFlightBound: ++counters_.waits_in_flight_bound; break;
      case GateWait::kPaused: ++counters_.waits_paused; break;
      case GateWait::kGuaranteedBusy: ++counters_.waits_guaranteed_busy; break;
      case GateWait::kShareSpent: ++counters_.waits_share_spent; break;
      case GateWait::kNone: break;
    }
    const Nanoseconds waited_from = now;
    ++waiting_;
    do {
      changed_.wait_for(lock, options_.poll_interval);
      now = clock_.now_ns();
      poll_locked(now);
    } while (wait_reason_locked(now) != GateWait::kNone);
    // The wait ends where its reason is seen gone: a clock read before that
    // check can predate time that passed while the reason still held.
    now = clock_.now_ns();
    --waiting_;
    counters_.waited_ns += std::max<Nanoseconds>(now - waited_from, 0);
  }
  admit_locked(now);
}

bool LaunchGate::try_admit() {
  std::lock_guard<std::mutex> lock(mutex_);
  const Nanoseconds now = clock_.now_ns();
  poll_locked(now);
  if (wait_reason_locked(now) != GateWait::kNone) return false;
  admit_locked(now);
  return true;
}

void LaunchGate::launched() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (launching_ > 0) --launching_;
  if (options_.admission_control) {
    work_.record_marker();
    ++in_flight_markers_;
  }
  changed_.notify_all();  // close() may be waiting for launching_ to reach 0
}

void LaunchGate::abandoned() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (launching_ > 0) --launching_;
  poll_locked(clock_.now_ns());
  changed_.notify_all();
}

void LaunchGate::set_share(double share) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    share_ = clamp_share(share);
  }
  changed_.notify_all();
}

double LaunchGate::share() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return share_;
}

void LaunchGate::set_coordinator_share(double share) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    coordinator_share_ = clamp_share(share);
  }
  changed_.notify_all();
}

double LaunchGate::coordinator_share() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return coordinator_share_;
}

double LaunchGate::effective_share() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return effective_share_locked();
}

void LaunchGate::set_max_in_flight(std::size_t k) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    options_.max_in_flight = std::max<std::size_t>(k, 1);
  }
  changed_.notify_all();
}

std::size_t LaunchGate::max_in_flight() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return options_.max_in_flight;
}

void LaunchGate::close() {
  std::unique_lock<std::mutex> lock(mutex_);
  ++close_depth_;
  // Quiescent: nobody between admit() and launched(), and every marker done.
  for (;;) {
    if (launching_ == 0) {
      // Markers are only recorded under admission control; otherwise the
      // caller synchronizes the device itself after close().
      in_flight_markers_ = options_.admission_control ? work_.poll_in_flight() : 0;
      if (in_flight_markers_ == 0) break;
    }
    changed_.wait_for(lock, options_.poll_interval);
  }
  if (options_.admission_control) window_.end_busy(clock_.now_ns());
}

void LaunchGate::reopen() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (close_depth_ > 0) --close_depth_;
  }
  changed_.notify_all();
}

bool LaunchGate::is_closed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return close_depth_ > 0;
}

void LaunchGate::refresh() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    poll_locked(clock_.now_ns());
  }
  changed_.notify_all();
}

void LaunchGate::notify() { changed_.notify_all(); }

LaunchGateStats LaunchGate::stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  const Nanoseconds now = clock_.now_ns();
  poll_locked(now);
  LaunchGateStats out = counters_;
  out.busy_ns_in_window = options_.admission_control ? window_.busy_ns(now) : 0;
  out.in_flight = in_flight_markers_ + launching_;
  out.launching = launching_;
  out.waiting = waiting_;
  out.share = effective_share_locked();
  out.user_share = share_;
  out.coordinator_share = coordinator_share_;
  out.closed = close_depth_ > 0;
  return out;
}

// ---- guaranteed side ------------------------------------------------------------

BusyTracker::BusyTracker(Clock& clock, InFlightWork& work, GuaranteedStateSink& sink,
                         BusyTrackerOptions options)
    : clock_(clock), work_(work), sink_(sink), options_(options) {}

void BusyTracker::record_marker_locked(Nanoseconds now) {
  work_.record_marker();
  ++pending_markers_;
  markers_recorded_.fetch_add(1, std::memory_order_relaxed);
  last_marker_ns_.store(now, std::memory_order_relaxed);
  unmarked_launches_.store(false, std::memory_order_relaxed);
}

void BusyTracker::on_op_launched() {
  const Nanoseconds now = clock_.now_ns();
  last_activity_ns_.store(now, std::memory_order_relaxed);
  // Fast path: a marker was recorded recently; the tail is covered by the
  // grace period (or by the next marker).
  if (now - last_marker_ns_.load(std::memory_order_relaxed) < options_.min_marker_interval_ns) {
    unmarked_launches_.store(true, std::memory_order_relaxed);
    return;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  record_marker_locked(now);
  sink_.publish_activity(true, static_cast<std::uint32_t>(pending_markers_), now);
}

void BusyTracker::mark() {
  const Nanoseconds now = clock_.now_ns();
  std::lock_guard<std::mutex> lock(mutex_);
  last_activity_ns_.store(now, std::memory_order_relaxed);
  record_marker_locked(now);
}

bool BusyTracker::refresh() {
  std::lock_guard<std::mutex> lock(mutex_);
  const Nanoseconds now = clock_.now_ns();
  pending_markers_ = work_.poll_in_flight();
  const Nanoseconds last_activity = last_activity_ns_.load(std::memory_order_relaxed);
  const bool unmarked_tail = unmarked_launches_.load(std::memory_order_relaxed) &&
                             now - last_activity < options_.unmarked_grace_ns;
  const bool busy = pending_markers_ > 0 || unmarked_tail;
  sink_.publish_activity(busy, static_cast<std::uint32_t>(pending_markers_), last_activity);
  return busy;
}

IterationTracker::IterationTracker(Clock& clock) : clock_(clock) { recent_.reserve(kIterationWindow); }

void IterationTracker::boundary() {
  const Nanoseconds now = clock_.now_ns();
  std::lock_guard<std::mutex> lock(mutex_);
  if (last_boundary_ns_ >= 0) record_locked(std::max<Nanoseconds>(now - last_boundary_ns_, 0));
  last_boundary_ns_ = now;
}

void IterationTracker::record(Nanoseconds took) {
  if (took < 0) return;  // a clock glitch, not a measurement
  std::lock_guard<std::mutex> lock(mutex_);
  record_locked(took);
}

void IterationTracker::record_locked(Nanoseconds took) {
  stats_.iterations += 1;
  stats_.last_ns = took;
  stats_.total_ns += took;
  stats_.ewma_ns = stats_.iterations == 1 ? took : stats_.ewma_ns + (took - stats_.ewma_ns) / 8;
  if (recent_.size() < kIterationWindow) {
    recent_.push_back(took);
  } else {
    recent_[next_] = took;
  }
  next_ = (next_ + 1) % kIterationWindow;
  // Nearest-rank p99 over the window: one partial sort per iteration.
  std::vector<Nanoseconds> sorted(recent_);
  const std::size_t rank = (sorted.size() * 99 + 99) / 100 - 1;  // ceil(0.99 n) - 1
  std::nth_element(sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(rank), sorted.end());
  stats_.p99_ns = sorted[rank];
}

void IterationTracker::begin() {
  const Nanoseconds now = clock_.now_ns();
  std::lock_guard<std::mutex> lock(mutex_);
  last_boundary_ns_ = now;
}

IterationStats IterationTracker::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

}  // namespace cotenant
