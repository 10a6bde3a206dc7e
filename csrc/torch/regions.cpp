// cotenant._C functions for named regions (include/cotenant/region_table.h):
// tagging a thread's allocations, and pausing or resuming a region on every
// device that holds it, each at a safe point (caching_allocator.h, "The safe
// point"): launches paused, the device synchronized, page copies finished
// before launches resume.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "../cuda/cuda_backend.h"
#include "cotenant/all_or_none.h"
#include "cotenant/errors.h"
#include "cotenant/region_table.h"
#include "cuda_allocator.h"
#include "op_interceptor.h"
#include "registry.h"
#include "regions.h"

namespace py = pybind11;

namespace cotenant::torch_ext {
namespace {

// How long a pause or resume waits for other threads' running ops.
constexpr std::chrono::seconds kRegionDrainTimeout{10};

// The devices whose tables hold region `name`. Throws the table's unknown-
// region error when none does.
std::vector<DeviceAllocators*> devices_holding(const std::string& name, const char* what) {
  auto& allocator = CotenantCudaAllocator::instance();
  if (!allocator.installed()) {
    throw Error(std::string("cannot ") + what + " region '" + name +
                "': cotenant is not enabled in this process; call cotenant.enable() first.");
  }
  std::vector<DeviceAllocators*> out;
  DeviceAllocators* first = nullptr;
  for (int dev = 0; dev < C10_COMPILE_TIME_MAX_GPUS; ++dev) {
    DeviceAllocators* d = allocator.existing(static_cast<c10::DeviceIndex>(dev));
    if (d == nullptr) continue;
    if (first == nullptr) first = d;
    if (d->regions->contains(name)) out.push_back(d);
  }
  if (out.empty()) {
    if (first != nullptr) first->regions->state(name);  // throws, listing the regions there are
    throw Error(std::string("cannot ") + what + " region '" + name +
                "': no CUDA memory was allocated in it yet. A region comes into being with its first "
                "allocation inside `with cotenant.region(\"" + name + "\"):`.");
  }
  return out;
}

// Runs `fn` on one device at a safe point. A CUDA graph capture on the
// device refuses (the table's message names the fix).
// With launches paused: the device synchronized, `fn` moving pages, the
// copies finished before any launch may touch them.
template <typename Fn>
std::size_t moving_pages(DeviceAllocators& d, Fn&& fn) {
  d.backend->synchronize_device();
  d.backend->set_quiescent(true);
  std::size_t bytes = 0;
  try {
    bytes = fn();
    d.backend->finish_copies();
  } catch (...) {
    try {
      d.backend->finish_copies();
    } catch (...) {
    }
    d.backend->set_quiescent(false);
    throw;
  }
  d.backend->set_quiescent(false);
  return bytes;
}

template <typename Fn>
std::size_t at_safe_point(DeviceAllocators& d, const std::string& name, const char* what, Fn&& fn) {
  d.regions->set_graph_capture(d.pools->routing());
  // During a capture nothing may synchronize: the table refuses, naming the fix.
  if (d.pools->routing()) return fn();
  LaunchPause pause(kRegionDrainTimeout);
  if (!pause) {
    throw Error(std::string("cannot ") + what + " region '" + name + "': CUDA ops running on other threads "
                "did not finish within 10 s. Call it again when those threads are between ops.");
  }
  return moving_pages(d, fn);
}

std::size_t resume_on(DeviceAllocators& d, const std::string& name) {
  return at_safe_point(d, name, "resume", [&] {
    try {
      return d.regions->resume(name);
    } catch (const OutOfMemoryError&) {
      // The process's own cached pages may be what fills the device.
      d.main->empty_cache();
      d.pools->empty_freeable();
      return d.regions->resume(name);
    }
  });
}

std::size_t pause_on(DeviceAllocators& d, const std::string& name, bool keep) {
  return at_safe_point(d, name, "pause", [&] { return d.regions->pause(name, keep); });
}

// The devices where the region is (`paused`) or is not paused; all of them
// when none is, so that the table refuses with its message (already paused,
// not paused).
std::vector<DeviceAllocators*> where_paused(const std::vector<DeviceAllocators*>& devices, const std::string& name,
                                            bool paused) {
  std::vector<DeviceAllocators*> out;
  for (DeviceAllocators* d : devices) {
    if ((d->regions->state(name) != RegionState::kActive) == paused) out.push_back(d);
  }
  return out.empty() ? devices : out;
}

// On every device that holds the region, or on none: a device that fails
// (host memory refused, the device full, ops that did not drain) leaves the
// devices done before it as they were.
std::size_t pause_region(const std::string& name, bool keep) {
  return all_or_none(
      where_paused(devices_holding(name, "pause"), name, /*paused=*/false),
      [&](DeviceAllocators* d) { return pause_on(*d, name, keep); },
      [&](DeviceAllocators* d) { resume_on(*d, name); });
}

std::size_t resume_region(const std::string& name) {
  const std::vector<DeviceAllocators*> devices = where_paused(devices_holding(name, "resume"), name, /*paused=*/true);
  std::vector<bool> kept;
  for (DeviceAllocators* d : devices) kept.push_back(d->regions->state(name) == RegionState::kPausedKept);
  return all_or_none(
      devices, [&](DeviceAllocators* d) { return resume_on(*d, name); },
      [&](DeviceAllocators* d) {
        const auto at = static_cast<std::size_t>(std::find(devices.begin(), devices.end(), d) - devices.begin());
        pause_on(*d, name, kept[at]);
      });
}

py::list region_list() {
  py::list out;
  auto& allocator = CotenantCudaAllocator::instance();
  for (int dev = 0; dev < C10_COMPILE_TIME_MAX_GPUS; ++dev) {
    DeviceAllocators* d = allocator.existing(static_cast<c10::DeviceIndex>(dev));
    if (d == nullptr) continue;
    for (const RegionInfo& info : d->regions->regions()) {
      py::dict row;
      row["name"] = info.name;
      row["device"] = dev;
      row["state"] = region_state_name(info.state);
      row["allocated_bytes"] = info.allocated_bytes;
      row["device_bytes"] = info.device_bytes;
      row["host_bytes"] = info.host_bytes;
      out.append(row);
    }
  }
  return out;
}

}  // namespace

std::size_t move_region_pages(DeviceAllocators& d, std::chrono::microseconds drain_timeout) {
  if (!d.regions->has_pending_migrations()) return 0;
  if (d.pools->routing()) return 0;  // a capture: nothing may synchronize; the caller retries later
  LaunchPause pause(drain_timeout);
  if (!pause) return 0;
  return moving_pages(d, [&] { return d.regions->apply_pending_migrations(); });
}

COTENANT_TORCH_BINDINGS(regions) {
  m.def("region_enter", &RegionScope::enter, py::arg("name"),
        "This thread's CUDA allocations go to region `name` until region_exit(name).");
  m.def("region_exit", &RegionScope::exit, py::arg("name"));
  m.def("current_region", []() { return RegionScope::current(); },
        "The calling thread's region, or \"\" outside every region.");
  m.def("pause_region", &pause_region, py::arg("name"), py::arg("keep"),
        py::call_guard<py::gil_scoped_release>(),
        "Pauses a region on every device that holds it; returns the bytes moved or released.");
  m.def("resume_region", &resume_region, py::arg("name"), py::call_guard<py::gil_scoped_release>(),
        "Resumes a paused region; returns the bytes moved or mapped.");
  m.def("regions", &region_list, "One dict per region and device: name, device, state and bytes.");
}

}  // namespace cotenant::torch_ext
