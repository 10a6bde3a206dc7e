// Named regions' pages moved at a safe point, for callers outside the
// regions' own pause and resume (regions.cpp): a job's suspend and resume
// (TorchJobProcess) mark every active region's pages with the job's.
#pragma once

#include <chrono>
#include <cstddef>

#include "cuda_allocator.h"

namespace cotenant::torch_ext {

// Moves the pages the device's regions have marked (RegionTable::spill_active,
// restore_spilled) with launches paused and the device synchronized, as a
// pause_region does. Returns the bytes moved; 0 with nothing marked, during
// a graph capture, or when running ops did not drain within `drain_timeout`
// (the marks stay: call it again).
std::size_t move_region_pages(DeviceAllocators& d, std::chrono::microseconds drain_timeout);

}  // namespace cotenant::torch_ext
