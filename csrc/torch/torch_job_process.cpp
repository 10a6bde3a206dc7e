#include "torch_job_process.h"

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

void TorchJobProcess::settle() {
  if (cuda_.has_pending_migrations()) cuda_.run_safe_point_at_op_entry();
}

}  // namespace cotenant::torch_ext
