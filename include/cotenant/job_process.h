// JobProcess: what a coordinator's command does in a job, for every role.
//
// The job channel (job_channel.h) reads the coordinator's cap, share and
// commands from the per-job block; job_channel_hooks() turns them into calls
// on a JobProcess. That is the one implementation of each command:
//   cap       the job's cap (the allocator's, less what the job's uncapped
//             allocators hold), then a safe point (pages move at once);
//   share     the launch gate's coordinator share (opportunistic jobs; the
//             gate takes the minimum with the job's own share);
//   spill_all / restore_all   mark every page, then a safe point;
//   suspend   stop every launch of the process, whatever its role, then
//             spill everything; the cap may change meanwhile and nothing
//             comes back until resume;
//   resume    restore (within the cap), then launch again.
// The torch extension gives it the real process (the CUDA allocator, the
// op-entry launch pause, the gate); SimulatedJobProcess gives it the
// simulated allocator, so CPU tests drive the same code.
//
// The safe point: see "The safe point" in caching_allocator.h.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>

#include "cotenant/caching_allocator.h"
#include "cotenant/job_channel.h"
#include "cotenant/launch_gate.h"

namespace cotenant {

class JobProcess {
 public:
  virtual ~JobProcess() = default;
  virtual CachingAllocator& allocator() = 0;
  // The coordinator's cap on the job's device memory, and what the job
  // reports. By default the job is its allocator(); a job with more
  // allocators on its device (graph pools, regions: never capped or moved)
  // overrides both, so that the cap and the report cover all of it.
  virtual void set_job_memory_cap(std::uint64_t cap_word) { allocator().set_memory_cap(cap_word); }
  virtual AllocatorStats job_stats() { return allocator().stats(); }
  // spill_all / restore_all of the job's memory (suspend and resume too):
  // by default its allocator()'s; a job with regions moves them as well.
  virtual void spill_job() { allocator().spill_all(); }
  virtual void restore_job() { allocator().restore_all(); }
  // Moves the allocator's pending pages now, with no kernel in flight.
  // Returns bytes moved; pages that found no room stay pending.
  virtual std::size_t run_safe_point() = 0;
  // Stops every launch of the process until resume_launches(). False when
  // work in flight did not drain in time (nothing changed; retry later).
  virtual bool pause_launches() = 0;
  virtual void resume_launches() = 0;
  virtual bool launches_paused() const = 0;
  // The coordinator's share (a no-op for roles without a gate).
  virtual void set_coordinator_share(double share) = 0;
  // The share in force: min(the job's own, the coordinator's); 1 without a gate.
  virtual double effective_share() const = 0;
  virtual IterationStats iterations() const = 0;
  // Called at every poll of the job channel: pending pages move here when
  // the process's own ops provide no safe point (the simulated job has none;
  // a real job that idles has none until its next op).
  virtual void settle() {}
};

// The job channel's hooks for `process` (which must outlive the channel).
JobChannelHooks job_channel_hooks(JobProcess& process);

// A job on the simulated backend: no kernels, so every safe point succeeds
// at once; the launch pause is a flag tests can read.
class SimulatedJobProcess final : public JobProcess {
 public:
  explicit SimulatedJobProcess(CachingAllocator& allocator, Clock& clock = MonotonicClock::instance());
  CachingAllocator& allocator() override { return allocator_; }
  std::size_t run_safe_point() override { return allocator_.apply_pending_migrations(); }
  bool pause_launches() override;
  void resume_launches() override;
  bool launches_paused() const override { return pause_depth_.load() > 0; }
  void set_coordinator_share(double share) override;
  double effective_share() const override;
  IterationStats iterations() const override { return iterations_.stats(); }
  // No op entries here: every poll is the safe point a real job's next op is.
  void settle() override {
    if (allocator_.has_pending_migrations()) allocator_.apply_pending_migrations();
  }

  // The job's own side, as its code would call it.
  void set_user_share(double share);
  IterationTracker& iteration_tracker() { return iterations_; }
  // pause_launches() fails (in-flight work "does not drain") while this is set.
  void set_pause_fails(bool fails) { pause_fails_ = fails; }

 private:
  CachingAllocator& allocator_;
  IterationTracker iterations_;
  std::atomic<int> pause_depth_{0};
  std::atomic<bool> pause_fails_{false};
  mutable std::mutex share_mutex_;
  double user_share_ = 1.0, coordinator_share_ = 1.0;
};

}  // namespace cotenant
