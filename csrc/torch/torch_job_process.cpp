#include "torch_job_process.h"

#include <algorithm>

#include "gate_hooks.h"
#include "op_interceptor.h"

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
  std::lock_guard<std::mutex> lock(cap_mutex_);
  job_cap_ = cap_word;
  follow_job_cap(/*always=*/true);
}

bool TorchJobProcess::follow_job_cap(bool always) {
  std::uint64_t want = kNoCap;
  if (job_cap_ != kNoCap) {
    const AllocatorStats others = cuda_.stats_besides_main(device_);
    const auto held = static_cast<std::uint64_t>(std::max<std::int64_t>(others.device_resident_bytes.current, 0));
    want = job_cap_ > held ? job_cap_ - held : 1;  // 0 is no cap word: 1 byte holds no page
  }
  // Unchanged, main's cap is left as it is: the job may have set its own.
  if (!always && want == main_cap_) return false;
  main_.set_memory_cap(want);
  main_cap_ = want;
  return true;
}

AllocatorStats TorchJobProcess::job_stats() {
  AllocatorStats stats = main_.stats();
  stats.add(cuda_.stats_besides_main(device_));
  return stats;
}

void TorchJobProcess::settle() {
  {
    std::lock_guard<std::mutex> lock(cap_mutex_);
    if (job_cap_ != kNoCap) follow_job_cap(/*always=*/false);  // the others grew or shrank
  }
  if (cuda_.has_pending_migrations()) cuda_.run_safe_point_at_op_entry();
}

}  // namespace cotenant::torch_ext
