// TorchJobProcess: the real job's JobProcess (job_process.h), so that what a
// coordinator's command does is the core's one implementation, here wired to
// the CUDA allocator, the op-entry launch pause and the launch gate.
#pragma once

#include <atomic>
#include <chrono>

#include "cotenant/job_process.h"
#include "cuda_allocator.h"

namespace cotenant::torch_ext {

class TorchJobProcess final : public JobProcess {
 public:
  TorchJobProcess(CotenantCudaAllocator& allocator, CachingAllocator& main) : cuda_(allocator), main_(main) {}
  ~TorchJobProcess() override;
  CachingAllocator& allocator() override { return main_; }
  // The safe point (caching_allocator.h, "The safe point"), from the job
  // channel's thread, which is never inside an op.
  std::size_t run_safe_point() override { return cuda_.run_safe_point(); }
  // Holds every thread of the process at its next ATen op entry (whatever
  // its role), after in-flight ops finish (kSuspendDrainTimeout).
  bool pause_launches() override;
  void resume_launches() override;
  bool launches_paused() const override { return paused_.load(); }
  void set_coordinator_share(double share) override;
  double effective_share() const override;
  IterationStats iterations() const override;
  // Pages a cap left pending (its safe point found an op in flight and gave
  // up) move at the job's next op entry; a job that idles has none, so each
  // poll of the job channel retries them too, with the op entries' backoff.
  void settle() override;

  static constexpr std::chrono::milliseconds kSuspendDrainTimeout{100};

 private:
  CotenantCudaAllocator& cuda_;
  CachingAllocator& main_;
  std::atomic<bool> paused_{false};
};

}  // namespace cotenant::torch_ext
