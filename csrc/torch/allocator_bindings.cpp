// cotenant._C functions for the allocator: installation, caps, statistics,
// spill/restore, safe points, and the coordinator's job channel.
// The Python API (python/cotenant/api.py) is the public face of these.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include "../cuda/cuda_backend.h"
#include "../cuda/cuda_driver.h"
#include "cotenant/caching_allocator.h"
#include "cotenant/errors.h"
#include "cotenant/stats.h"
#include "cuda_allocator.h"
#include "gate_hooks.h"
#include "op_interceptor.h"
#include "registry.h"

#if __has_include("cotenant/job_channel.h")
#include "cotenant/job_channel.h"
#define COTENANT_HAS_JOB_CHANNEL 1
#else
#define COTENANT_HAS_JOB_CHANNEL 0
#endif

namespace py = pybind11;

namespace cotenant::torch_ext {
namespace {

// The safe point at op entry: lock-free check, then the slow path.
void safe_point_at_op_entry(const OpEntry& /*op*/, void* context) {
  auto* allocator = static_cast<CotenantCudaAllocator*>(context);
  if (!allocator->has_pending_migrations()) return;
  try {
    allocator->run_safe_point_at_op_entry();
  } catch (const std::exception&) {
    // A failed move leaves the page where it was and stays pending; the
    // next safe point retries. Hooks must not throw into ATen.
  }
}

std::once_flag safe_point_hook_added;

CotenantCudaAllocator& installed_allocator() {
  auto& allocator = CotenantCudaAllocator::instance();
  if (!allocator.installed()) {
    throw Error("cotenant is not enabled in this process; call cotenant.enable() first.");
  }
  return allocator;
}

CachingAllocator& main_allocator(int device) {
  return *installed_allocator().on(static_cast<c10::DeviceIndex>(device)).main;
}

// Counts op entries, for tests of the interception point.
std::atomic<std::int64_t> counted_op_entries{0};
int counting_hook_id = -1;
void count_op_entry(const OpEntry&, void*) { counted_op_entries.fetch_add(1, std::memory_order_relaxed); }

#if COTENANT_HAS_JOB_CHANNEL
std::mutex channel_mutex;
std::unique_ptr<JobChannel> job_channel;
#endif

}  // namespace

COTENANT_TORCH_BINDINGS(allocator) {
  // The C++ core's errors, as Python sees them from this module.
  // Never destroyed: it must outlive the interpreter's teardown of this module.
  static auto* error_type = new py::exception<Error>(m, "Error", PyExc_RuntimeError);
  // Module-local: cotenant._core translates the same C++ types for its own functions.
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const OutOfMemoryError& e) {
      PyErr_SetString(PyExc_MemoryError, e.what());
    } catch (const Error& e) {
      py::set_error(*error_type, e.what());
    }
  });

  m.def("gpu_available", [] {
    std::string reason;
    bool ok = cuda::gpu_available(&reason);
    return py::make_tuple(ok, reason);
  }, "(True, '') when a CUDA device is usable, else (False, the reason as a sentence).");

  m.def("install", [] {
    auto& allocator = CotenantCudaAllocator::instance();
    allocator.install();
    std::call_once(safe_point_hook_added, [&] { add_op_entry_hook(&safe_point_at_op_entry, &allocator); });
  }, "Makes cotenant the process's CUDA allocator (before the first CUDA allocation).");

  m.def("installed", [] { return CotenantCudaAllocator::instance().installed(); });

  m.def("prepare_device", [](int device) {
    auto& d = installed_allocator().on(static_cast<c10::DeviceIndex>(device));
    return std::string(d.backend->host_page_kind());
  }, py::arg("device"), "Creates the device's allocator now; returns the host page kind.");

  m.def("set_memory_cap", [](int device, std::uint64_t bytes) {
    main_allocator(device).set_memory_cap(bytes);
  }, py::arg("device"), py::arg("bytes"), "kNoCap (2**64-1) removes the cap.");
  m.def("memory_cap", [](int device) { return main_allocator(device).memory_cap(); }, py::arg("device"));
  m.attr("NO_CAP") = py::int_(kNoCap);

  m.def("device_total_bytes", [](int device) {
    return installed_allocator().on(static_cast<c10::DeviceIndex>(device)).backend->device_total_bytes();
  }, py::arg("device"));

  m.def("stats", [](int device) {
    auto& d = installed_allocator().on(static_cast<c10::DeviceIndex>(device));
    AllocatorStats s = d.main->stats();
    py::dict out;
    for (const auto& [key, value] : s.as_map()) out[py::str(key)] = value;
    out["mode"] = spill_mode_name(s.mode);
    out["host_page_kind"] = d.backend->host_page_kind();
    return out;
  }, py::arg("device"), "The capped allocator's statistics (torch's key names plus cotenant's).");

  m.def("spill_all", [](int device) { main_allocator(device).spill_all(); }, py::arg("device"));
  m.def("restore_all", [](int device) { main_allocator(device).restore_all(); }, py::arg("device"));
  m.def("has_pending_migrations", [] { return CotenantCudaAllocator::instance().has_pending_migrations(); });
  m.def("mark_iteration", [] { CotenantCudaAllocator::instance().mark_iteration(); },
        "The end of one step of the job's loop: cache idle since the last mark may be released to grow.");
  m.def("safe_point", [] {
    if (!CotenantCudaAllocator::instance().installed()) return std::size_t{0};
    py::gil_scoped_release release;  // other threads' ops may need the GIL to finish
    return CotenantCudaAllocator::instance().run_safe_point();
  }, "Moves pending pages now (pauses launches, synchronizes, remaps). Returns bytes moved.");

  m.def("is_device_resident", [](std::uintptr_t address, int device) {
    return main_allocator(device).is_device_resident(static_cast<DevicePtr>(address));
  }, py::arg("address"), py::arg("device"));

  // ---- the interception point, for tests and diagnostics ----
  m.def("ops_in_flight", &ops_in_flight, "Outermost ATen ops running now, all threads.");
  m.def("begin_explicit_op", [] {
    py::gil_scoped_release release;  // it may wait for a safe point another thread runs
    begin_explicit_op("cotenant::explicit_op");
  }, "Work launched outside ATen (a CUDA graph replay) begins: it counts as one op until end_explicit_op().");
  m.def("end_explicit_op", [] { end_explicit_op(); });
  m.def("_count_op_entries", [](bool on) {
    if (on && counting_hook_id < 0) {
      counted_op_entries.store(0);
      counting_hook_id = add_op_entry_hook(&count_op_entry, nullptr);
    } else if (!on && counting_hook_id >= 0) {
      remove_op_entry_hook(counting_hook_id);
      counting_hook_id = -1;
    }
  }, py::arg("on"));
  m.def("_counted_op_entries", [] { return counted_op_entries.load(); });
  m.def("_pause_launches", [](double timeout_s) {
    py::gil_scoped_release release;
    return pause_launches(std::chrono::microseconds(static_cast<std::int64_t>(timeout_s * 1e6)));
  }, py::arg("timeout_s"));
  m.def("_resume_launches", [] { resume_launches(); });

  // ---- the coordinator's job channel ----
  m.attr("HAS_JOB_CHANNEL") = py::bool_(COTENANT_HAS_JOB_CHANNEL != 0);
#if COTENANT_HAS_JOB_CHANNEL
  m.def("start_job_channel", [](const std::string& block_name, int device) {
    auto& allocator = installed_allocator();
    auto& main = *allocator.on(static_cast<c10::DeviceIndex>(device)).main;
    JobChannelHooks hooks;
    // Cap changes move pages at once from the channel's thread: it is never
    // inside an op, so it can pause the process's launches itself.
    hooks.set_memory_cap = [&main, &allocator](std::uint64_t bytes) {
      main.set_memory_cap(bytes);
      allocator.run_safe_point();
    };
    hooks.spill_all = [&main, &allocator] { main.spill_all(); allocator.run_safe_point(); };
    hooks.restore_all = [&main, &allocator] { main.restore_all(); allocator.run_safe_point(); };
    hooks.stats = [&main] { return main.stats(); };
    // The launch gate's share and suspension (gate_hooks.h): plain C++, no GIL.
    hooks.set_share = [](double share) { set_process_share(share); };
    hooks.set_suspended = [](bool suspended) {
      if (LaunchGate* gate = process_launch_gate()) {
        if (suspended) gate->close();
        else gate->reopen();
      } else {
        set_process_share(suspended ? 0.0 : 1.0);
      }
    };
    py::gil_scoped_release release;  // opening the block may wait on the file system
    std::lock_guard<std::mutex> lock(channel_mutex);
    job_channel.reset();
    job_channel = std::make_unique<JobChannel>(block_name, std::move(hooks));
    job_channel->start();
  }, py::arg("block_name"), py::arg("device"),
     "Starts the C++ thread that applies the coordinator's cap, share and commands and publishes stats.");
  m.def("stop_job_channel", [] {
    py::gil_scoped_release release;  // the channel thread may be waiting for the GIL in set_share
    std::lock_guard<std::mutex> lock(channel_mutex);
    job_channel.reset();
  });
  m.def("record_iteration", [](double microseconds) {
    std::lock_guard<std::mutex> lock(channel_mutex);
    if (job_channel) job_channel->record_iteration(microseconds);
  }, py::arg("microseconds"));
#endif
}

}  // namespace cotenant::torch_ext
