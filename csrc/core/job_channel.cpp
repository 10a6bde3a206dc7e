#include "cotenant/job_channel.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "cotenant/errors.h"
#include "cotenant/size.h"

namespace cotenant {

using shm::JobCommand;
using shm::JobState;

namespace {
std::uint64_t non_negative(std::int64_t value) { return value > 0 ? static_cast<std::uint64_t>(value) : 0; }
}  // namespace

JobChannel::JobChannel(const std::string& block_name, JobChannelHooks hooks, JobChannelOptions options)
    : region_(shm::ShmRegion::open(block_name, sizeof(shm::JobBlock))),
      hooks_(std::move(hooks)),
      options_(options),
      owner_pid_(::getpid()) {
  block_ = static_cast<shm::JobBlock*>(region_.data());
  shm::check_job_block(*block_, region_.size());
  identity_ = shm::read_identity(*block_);
  // Resume from what a previous channel of this process applied (none for a
  // fresh block: unlimited cap, share 1), so an unchanged control is not
  // re-applied.
  report_ = shm::read_report(*block_);
  report_.pid = static_cast<std::uint64_t>(::getpid());
  report_.uid = static_cast<std::uint64_t>(::getuid());
  report_.role = identity_.role;
  report_.device = identity_.device;
  report_.state = JobState::kRunning;
  attempted_cap_ = report_.applied_memory_cap;
  attempted_share_ = report_.applied_share;
  std::lock_guard<std::mutex> lock(mutex_);
  publish_locked();
}

JobChannel::~JobChannel() {
  if (in_forked_child()) {
    (void)poller_.release();  // the parent's thread state: see Poller
    return;
  }
  stop();
  std::lock_guard<std::mutex> lock(mutex_);
  report_.state = JobState::kExited;
  report_.heartbeat_ns = shm::monotonic_ns();
  shm::write_report(*block_, report_);
  // The job is done for good: its block's name goes too, where this uid may
  // remove it (the job owns its block under a root coordinator). Without
  // this, a block would stay in /dev/shm until a coordinator next runs on the
  // same socket; a coordinator still mapping it reads "exited" all the same.
  (void)::shm_unlink(region_.name().c_str());
}

bool JobChannel::in_forked_child() const { return ::getpid() != owner_pid_; }

void JobChannel::start() {
  if (in_forked_child() || poller_->thread.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(poller_->wake_mutex);
    poller_->stopping = false;
  }
  poller_->thread = std::thread([this] { run(); });
}

void JobChannel::stop() {
  if (in_forked_child()) return;
  {
    std::lock_guard<std::mutex> lock(poller_->wake_mutex);
    poller_->stopping = true;
  }
  poller_->wake.notify_all();
  if (poller_->thread.joinable()) poller_->thread.join();
}

void JobChannel::run() {
  Poller& poller = *poller_;
  std::unique_lock<std::mutex> wake_lock(poller.wake_mutex);
  while (!poller.stopping) {
    wake_lock.unlock();
    poll_once();
    wake_lock.lock();
    poller.wake.wait_for(wake_lock, options_.poll_interval, [&poller] { return poller.stopping; });
  }
}

bool JobChannel::poll_once() {
  std::lock_guard<std::mutex> lock(mutex_);
  bool applied = false;
  if (!follow_coordinator_locked()) {
    try {
      applied = apply_locked(shm::read_control(*block_));
    } catch (const Error&) {
      // The coordinator died mid-write: keep the last applied values until a
      // restarted coordinator writes again; keep reporting meanwhile.
    }
    if (rejoined_) {
      rejoined_ = false;
      // A suspension the coordinator still holds (none came to lift it)
      // empties the device again; its launches stopped in apply_locked.
      if (suspended_) {
        if (hooks_.spill_all) guarded(hooks_.spill_all);
        report_.state = JobState::kSuspended;
      }
      applied = true;
    }
  }
  publish_locked();
  return applied;
}

void JobChannel::guarded(const std::function<void()>& hook) {
  try {
    hook();
  } catch (...) {
    ++report_.apply_errors;
  }
}

bool JobChannel::coordinator_lost() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return coordinator_lost_;
}

bool JobChannel::follow_coordinator_locked() {
  const shm::CoordinatorHeartbeat beat = shm::read_coordinator_heartbeat(*block_);
  const std::uint64_t now = shm::monotonic_ns();
  const std::uint64_t silent_ns = now > beat.heartbeat_ns ? now - beat.heartbeat_ns : 0;
  const bool silent = beat.silence_limit_ns != 0 && silent_ns > beat.silence_limit_ns;
  if (silent && !coordinator_lost_) {
    run_on_own_locked(silent_ns);
  } else if (!silent && coordinator_lost_) {
    coordinator_lost_ = false;
    rejoined_ = true;
    reapply_share_ = true;  // the share the job ran at on its own was not the coordinator's
    launches_stopped_ = false;  // so a suspension still in force stops them again
    std::fprintf(stderr, "cotenant: job '%s' hears the coordinator again: its cap, share and commands apply again\n",
                 identity_.name.c_str());
  }
  return coordinator_lost_;
}

void JobChannel::run_on_own_locked(std::uint64_t silent_ns) {
  coordinator_lost_ = true;
  const bool was_suspended = suspended_;
  if (was_suspended) {
    // suspended_ stays: it is the coordinator's word, applied again if it
    // comes back without having lifted it.
    if (hooks_.restore_all) guarded(hooks_.restore_all);
    if (hooks_.set_suspended) guarded([&] { hooks_.set_suspended(false); });
    launches_stopped_ = false;
  }
  if (hooks_.set_share) guarded([&] { hooks_.set_share(1.0); });
  report_.state = JobState::kRunning;
  const std::string cap = attempted_cap_ == kNoCap ? std::string("no cap") : "its cap of " + format_size(attempted_cap_);
  std::fprintf(stderr,
               "cotenant: job '%s' has not heard from the coordinator for %.0f s (stopped, hung or gone), longer "
               "than the %.0f s it allows: the job now runs on its own, %sat full share, under %s (the launch gate "
               "still yields to a guaranteed job). Start the coordinator again on the same socket and it takes "
               "this job back\n",
               identity_.name.c_str(), static_cast<double>(silent_ns) / 1e9,
               static_cast<double>(shm::read_coordinator_heartbeat(*block_).silence_limit_ns) / 1e9,
               was_suspended ? "resumed from its suspension, " : "", cap.c_str());
}

bool JobChannel::apply_locked(const shm::JobControl& control) {
  bool applied = false;
  if (control.memory_cap != attempted_cap_) {
    attempted_cap_ = control.memory_cap;
    if (hooks_.set_memory_cap) guarded([&] { hooks_.set_memory_cap(control.memory_cap); });
    report_.applied_memory_cap = control.memory_cap;
    applied = true;
  }
  const double share = std::isfinite(control.share) ? std::clamp(control.share, 0.0, 1.0) : attempted_share_;
  if (share != attempted_share_ || reapply_share_) {
    reapply_share_ = false;
    attempted_share_ = share;
    // Without a launch stop, suspension is share 0: keep it until resume.
    if (hooks_.set_share && (!suspended_ || hooks_.set_suspended)) guarded([&] { hooks_.set_share(share); });
    report_.applied_share = share;
    applied = true;
  }
  if (control.command_sequence > report_.applied_command_sequence) {
    switch (control.command) {
      case JobCommand::kNone: break;
      case JobCommand::kSpillAll:
        if (hooks_.spill_all) guarded(hooks_.spill_all);
        break;
      case JobCommand::kRestoreAll:
        if (hooks_.restore_all) guarded(hooks_.restore_all);
        break;
      case JobCommand::kSuspend:
        // Launches stop first, so nothing new lands on the device while it
        // empties; a stop that did not take effect is retried below.
        suspended_ = true;
        stop_launches_locked();
        if (hooks_.spill_all) guarded(hooks_.spill_all);
        report_.state = JobState::kSuspended;
        break;
      case JobCommand::kResume:
        if (hooks_.restore_all) guarded(hooks_.restore_all);
        suspended_ = false;
        if (hooks_.set_suspended) {
          guarded([&] { hooks_.set_suspended(false); });
        } else if (hooks_.set_share) {
          guarded([&] { hooks_.set_share(attempted_share_); });
        }
        launches_stopped_ = false;
        report_.state = JobState::kRunning;
        break;
      default:
        ++report_.apply_errors;  // a command from a newer coordinator: acknowledge, do nothing
        break;
    }
    report_.applied_command_sequence = control.command_sequence;
    applied = true;
  }
  if (suspended_ && !launches_stopped_) stop_launches_locked();  // retry a stop that did not take
  return applied;
}

void JobChannel::stop_launches_locked() {
  if (hooks_.set_suspended) {
    guarded([&] { launches_stopped_ = hooks_.set_suspended(true); });
  } else {
    if (hooks_.set_share) guarded([&] { hooks_.set_share(0.0); });
    launches_stopped_ = true;
  }
}

void JobChannel::publish_locked() {
  // A settle that fails is counted; the statistics below still go out: the
  // coordinator sees where the job stands.
  if (hooks_.settle) guarded(hooks_.settle);
  if (hooks_.stats) {
    guarded([&] {
      AllocatorStats stats = hooks_.stats();
      report_.device_bytes = non_negative(stats.device_resident_bytes.current);
      report_.host_bytes = non_negative(stats.host_resident_bytes.current);
      report_.host_pool_bytes = non_negative(stats.host_pool_bytes.current);
      report_.allocated_bytes = non_negative(stats.allocated_bytes.all.current);
      report_.reserved_bytes = non_negative(stats.reserved_bytes.all.current);
      report_.cached_bytes = report_.reserved_bytes > report_.allocated_bytes
                                 ? report_.reserved_bytes - report_.allocated_bytes
                                 : 0;
      report_.peak_allocated_bytes = non_negative(stats.allocated_bytes.all.peak);
      report_.spilled_bytes = non_negative(stats.spilled_bytes);
      report_.restored_bytes = non_negative(stats.restored_bytes);
      report_.pending_migration_bytes = non_negative(stats.pending_spill_bytes + stats.pending_restore_bytes);
      report_.num_migrations = non_negative(stats.num_migrations);
    });
  }
  if (hooks_.host_room) {
    const auto now = std::chrono::steady_clock::now();
    if (host_room_read_ == std::chrono::steady_clock::time_point{} ||
        now - host_room_read_ >= options_.host_room_interval) {
      host_room_read_ = now;
      guarded([&] {
        const std::optional<std::size_t> room = hooks_.host_room();
        report_.host_room_bytes = room ? std::min<std::uint64_t>(*room, kNoCap - 1) : kNoCap;
      });
    }
  }
  if (hooks_.iterations) {
    guarded([&] {
      const IterationStats it = hooks_.iterations();
      report_.iteration_count = it.iterations;
      report_.iteration_last_ns = non_negative(it.last_ns);
      report_.iteration_ewma_ns = non_negative(it.ewma_ns);
      report_.iteration_p99_ns = non_negative(it.p99_ns);
      report_.iteration_total_ns = non_negative(it.total_ns);
    });
  }
  if (suspended_ && !coordinator_lost_) {
    report_.effective_share = 0.0;
  } else if (hooks_.effective_share) {
    guarded([&] { report_.effective_share = hooks_.effective_share(); });
  } else {
    report_.effective_share = report_.applied_share;
  }
  report_.heartbeat_ns = shm::monotonic_ns();
  shm::write_report(*block_, report_);
}

shm::JobControl JobChannel::control() const { return shm::read_control(*block_); }

shm::JobReport JobChannel::report() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return report_;
}

}  // namespace cotenant
