// TorchJobProcess: the real job's JobProcess (job_process.h), so that what a
// coordinator's command does is the core's one implementation, here wired to
// the CUDA allocator, the op-entry launch pause and the launch gate.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "cotenant/job_process.h"
#include "cuda_allocator.h"

namespace cotenant::torch_ext {

class TorchJobProcess final : public JobProcess {
 public:
  TorchJobProcess(CotenantCudaAllocator& allocator, DeviceAllocators& device)
      : cuda_(allocator), device_(device) {}
  ~TorchJobProcess() override;
  CachingAllocator& allocator() override { return *device_.main; }
  // The coordinator's cap on the job (DeviceAllocators::coordinator_cap):
  // with the user's, the lower holds, over all of the job's device memory;
  // main's cap follows what the job's other allocators hold (settle()).
  void set_job_memory_cap(std::uint64_t cap_word) override;
  // Every allocator of the job's device, added up (AllocatorStats::add).
  AllocatorStats job_stats() override;
  // spill_all / restore_all (suspend and resume too) move the job's active
  // regions with its main allocator's memory; a region paused meanwhile
  // stays paused. Graph pools stay on the device: their graphs replay them.
  void spill_job() override;
  void restore_job() override;
  // The safe point (caching_allocator.h, "The safe point"), from the job
  // channel's thread, which is never inside an op: main's pages, then the
  // regions'.
  std::size_t run_safe_point() override;
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
  DeviceAllocators& device_;  // its main allocator is the job's allocator()
  std::atomic<bool> paused_{false};
  std::mutex regions_mutex_;
  std::vector<std::string> spilled_regions_;  // what spill_job() marked, for restore_job()
};

}  // namespace cotenant::torch_ext
