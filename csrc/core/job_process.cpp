#include "cotenant/job_process.h"

#include <algorithm>

namespace cotenant {

JobChannelHooks job_channel_hooks(JobProcess& process) {
  JobChannelHooks hooks;
  hooks.set_memory_cap = [&process](std::uint64_t cap_word) {
    process.set_job_memory_cap(cap_word);
    process.run_safe_point();
  };
  hooks.set_share = [&process](double share) { process.set_coordinator_share(share); };
  hooks.spill_all = [&process] {
    process.spill_job();
    process.run_safe_point();
  };
  hooks.restore_all = [&process] {
    process.restore_job();
    process.run_safe_point();
  };
  hooks.set_suspended = [&process](bool suspended) {
    if (!suspended) {
      if (process.launches_paused()) process.resume_launches();
      return true;
    }
    return process.launches_paused() || process.pause_launches();
  };
  hooks.settle = [&process] { process.settle(); };
  hooks.stats = [&process] { return process.job_stats(); };
  hooks.iterations = [&process] { return process.iterations(); };
  hooks.effective_share = [&process] { return process.effective_share(); };
  hooks.host_room = [&process] { return process.allocator().host_room(); };
  return hooks;
}

SimulatedJobProcess::SimulatedJobProcess(CachingAllocator& allocator, Clock& clock)
    : allocator_(allocator), iterations_(clock) {}

bool SimulatedJobProcess::pause_launches() {
  if (pause_fails_.load()) return false;
  pause_depth_.fetch_add(1);
  return true;
}

void SimulatedJobProcess::resume_launches() {
  int depth = pause_depth_.load();
  while (depth > 0 && !pause_depth_.compare_exchange_weak(depth, depth - 1)) {
  }
}

void SimulatedJobProcess::set_coordinator_share(double share) {
  std::lock_guard<std::mutex> lock(share_mutex_);
  coordinator_share_ = std::clamp(share, 0.0, 1.0);
}

void SimulatedJobProcess::set_user_share(double share) {
  std::lock_guard<std::mutex> lock(share_mutex_);
  user_share_ = std::clamp(share, 0.0, 1.0);
}

double SimulatedJobProcess::effective_share() const {
  std::lock_guard<std::mutex> lock(share_mutex_);
  return std::min(user_share_, coordinator_share_);
}

}  // namespace cotenant
