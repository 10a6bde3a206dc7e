// JobChannel: the job's side of the coordinator's data plane.
//
// A C++ thread in the job polls the job's shared-memory block (job_block.h)
// every poll_interval (2 ms by default) and
//   - applies the coordinator's memory cap and compute share through hooks
//     when they change (levels: the job converges to the latest values),
//   - runs each new one-shot command once (spill all, restore all, suspend,
//     resume) and acknowledges it by sequence number,
//   - publishes the job's memory numbers (from the stats hook), its iteration
//     times (from the iterations hook: the job's one IterationTracker) and a
//     heartbeat.
// What each hook does in a job is defined once, in job_process.h.
// It needs no Python and no GIL, so a command takes effect while the job's
// Python thread is busy.
//
// If the coordinator dies the block stays mapped, the thread keeps the last
// applied cap and share and keeps publishing; a restarted coordinator opens
// the same block and carries on. A coordinator silent for longer than the
// limit it wrote into the block (its heartbeat, every tick; 30 s by default)
// is taken for gone: the job runs on its own, so that a suspended or paused
// job does not wait for good. Its launches resume at share 1 (the launch gate,
// which needs no coordinator, still yields to a guaranteed job), a suspended
// job's pages come back within its cap, the cap stays, and one line on stderr
// says so. When the heartbeat moves again the coordinator's control applies
// again as it stands: its share, and its suspension where one is in force.
//
// Thread safety: every public method may be called from any thread. Hooks run
// on the channel's thread (or on the caller's, in poll_once()), never two at
// a time. A hook that throws is counted in the report's apply_errors and not
// retried for the same value.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include <sys/types.h>

#include "cotenant/launch_gate.h"
#include "cotenant/shm/job_block.h"
#include "cotenant/shm/shm_region.h"
#include "cotenant/stats.h"

namespace cotenant {

struct JobChannelHooks {
  std::function<void(std::uint64_t bytes)> set_memory_cap;  // kUnlimitedCap = no cap
  std::function<void(double share)> set_share;              // in [0, 1]
  std::function<void()> spill_all;
  std::function<void()> restore_all;
  // Stop / restart every launch of the process. Returns whether it took
  // effect; a suspension that did not is retried at every poll. Without
  // it, suspend sets the share to 0.
  std::function<bool(bool suspended)> set_suspended;
  // Called at every poll before the statistics are read (JobProcess::settle:
  // pending pages move where the job's own ops give no safe point). A throw
  // is counted in apply_errors and the report is published all the same.
  std::function<void()> settle;
  // The job's allocator statistics; without it, memory numbers stay 0.
  std::function<AllocatorStats()> stats;
  // The job's iteration times (its IterationTracker); without it, 0.
  std::function<IterationStats()> iterations;
  // The share in force (min of the job's own and the coordinator's).
  std::function<double()> effective_share;
  // What the job may still pin on the host (its allocator's host_room():
  // available memory, its memory cgroup's included, less the headroom);
  // nullopt or no hook: unknown. Read at most every host_room_interval.
  std::function<std::optional<std::size_t>()> host_room;
};

struct JobChannelOptions {
  std::chrono::microseconds poll_interval{2000};
  // How often the report's host_room_bytes is read again (it reads files
  // under /proc and /sys; the coordinator plans once a tick).
  std::chrono::milliseconds host_room_interval{100};
};

class JobChannel {
 public:
  // Opens the block named `block_name` (created by the coordinator), checks
  // its version and marks the job as running. Throws cotenant::Error if the
  // block is missing or of another version.
  JobChannel(const std::string& block_name, JobChannelHooks hooks, JobChannelOptions options = {});
  // Stops the thread and reports the job as exited. In a child forked from
  // the process that opened the channel, it only unmaps the block: the job
  // (the parent) goes on, its block and its report untouched.
  ~JobChannel();
  JobChannel(const JobChannel&) = delete;
  JobChannel& operator=(const JobChannel&) = delete;

  void start();  // starts the polling thread (idempotent)
  void stop();   // stops it (idempotent; nothing in a forked child); the block stays mapped
  bool running() const { return !in_forked_child() && poller_->thread.joinable(); }

  // One round of apply + publish on the caller's thread. Returns true if a
  // cap, share or command was applied in this round.
  bool poll_once();

  // Whether the coordinator is taken for gone (see above) and the job runs on
  // its own.
  bool coordinator_lost() const;

  const shm::JobIdentity& identity() const { return identity_; }
  const std::string& block_name() const { return region_.name(); }
  shm::JobControl control() const;
  shm::JobReport report() const;  // what was last published

 private:
  void run();
  bool apply_locked(const shm::JobControl& control);
  // Runs a hook; one that throws is counted in the report's apply_errors.
  void guarded(const std::function<void()>& hook);
  void stop_launches_locked();
  void publish_locked();
  // Follows the coordinator's heartbeat: true while it is taken for gone.
  bool follow_coordinator_locked();
  void run_on_own_locked(std::uint64_t silent_ns);

  shm::ShmRegion region_;
  shm::JobBlock* block_ = nullptr;
  shm::JobIdentity identity_;
  JobChannelHooks hooks_;
  JobChannelOptions options_;

  mutable std::mutex mutex_;  // guards report_ and the attempted_* values; serializes hooks
  shm::JobReport report_;
  std::uint64_t attempted_cap_;
  double attempted_share_;
  bool suspended_ = false;        // a suspend command is in force
  bool launches_stopped_ = false;  // ... and set_suspended(true) took effect
  bool coordinator_lost_ = false;  // its heartbeat went silent: the job runs on its own
  bool rejoined_ = false;          // it came back this poll: its share and suspension apply again
  bool reapply_share_ = false;     // apply the coordinator's share even if unchanged
  std::chrono::steady_clock::time_point host_room_read_{};  // when host_room last ran

  // The polling thread and what wakes it. A child forked while the thread
  // ran copies this state but not the thread (its condition variable may
  // count a waiter that will never leave): the child leaves it as it is,
  // never joining, waking or destroying it.
  struct Poller {
    std::mutex wake_mutex;
    std::condition_variable wake;
    bool stopping = false;
    std::thread thread;
  };
  bool in_forked_child() const;

  const pid_t owner_pid_;  // the process that opened the channel
  std::unique_ptr<Poller> poller_ = std::make_unique<Poller>();
};

}  // namespace cotenant
