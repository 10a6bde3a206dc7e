#include "torch_job_process.h"

#include <algorithm>

#include "gate_hooks.h"
#include "op_interceptor.h"
#include "regions.h"

namespace cotenant::torch_ext {

TorchJobProcess::~TorchJobProcess() {
  // A channel stopped while the job is suspended must not leave the
  // process's launches held with nobody to release them.
  if (paused_.exchange(false)) torch_ext::resume_launches();
}

bool TorchJobProcess::pause_launches() {
  if (paused_.load()) return true;
  if (!torch_ext::pause_launches(kSuspendDrainTimeout)) return false;
  paused_.store(true);
  return true;
}

void TorchJobProcess::resume_launches() {
  if (paused_.exchange(false)) torch_ext::resume_launches();
}

void TorchJobProcess::set_coordinator_share(double share) { set_process_coordinator_share(share); }

double TorchJobProcess::effective_share() const { return process_effective_share(); }

IterationStats TorchJobProcess::iterations() const { return process_iterations(); }

void TorchJobProcess::set_job_memory_cap(std::uint64_t cap_word) {
  cuda_.set_job_cap(device_, CotenantCudaAllocator::CapSource::kCoordinator, cap_word);
  cuda_.follow_job_cap(device_, /*always=*/true);
}

AllocatorStats TorchJobProcess::job_stats() {
  AllocatorStats stats = allocator().stats();
  stats.add(cuda_.stats_besides_main(device_));
  return stats;
}

void TorchJobProcess::spill_job() {
  allocator().spill_all();
  std::vector<std::string> spilled = device_.regions->spill_active();
  std::lock_guard<std::mutex> lock(regions_mutex_);
  // A second spill before a restore adds nothing new to bring back.
  for (std::string& name : spilled) {
    if (std::find(spilled_regions_.begin(), spilled_regions_.end(), name) == spilled_regions_.end()) {
      spilled_regions_.push_back(std::move(name));
    }
  }
}

void TorchJobProcess::restore_job() {
  allocator().restore_all();
  std::lock_guard<std::mutex> lock(regions_mutex_);
  device_.regions->restore_spilled(spilled_regions_);
  spilled_regions_.clear();
}

std::size_t TorchJobProcess::run_safe_point() {
  const std::size_t moved = cuda_.run_safe_point();
  return moved + move_region_pages(device_, kSuspendDrainTimeout);
}

void TorchJobProcess::settle() {
  cuda_.follow_job_cap(device_);  // the others grew or shrank
  if (cuda_.has_pending_migrations()) cuda_.run_safe_point_at_op_entry();
  move_region_pages(device_, kSuspendDrainTimeout);  // a spill or restore an op held off
}

}  // namespace cotenant::torch_ext
