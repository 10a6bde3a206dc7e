// cotenant._C functions for the allocator: installation, caps, statistics,
// spill/restore, safe points, and the coordinator's job channel.
// The Python API (python/cotenant/api.py) is the public face of these.
#include <c10/cuda/CUDACachingAllocator.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "../cuda/cuda_backend.h"
#include "../cuda/cuda_driver.h"
#include "cotenant/caching_allocator.h"
#include "cotenant/errors.h"
#include "cotenant/stats.h"
#include "cuda_allocator.h"
#include "gate_hooks.h"
#include "op_interceptor.h"
#include "registry.h"

#include "cotenant/job_channel.h"
#include "torch_job_process.h"

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

cuda::CudaBackend& device_backend(int device) {
  return *installed_allocator().on(static_cast<c10::DeviceIndex>(device)).backend;
}

// Counts op entries and exits, for tests of the interception point.
std::atomic<std::int64_t> counted_op_entries{0};
std::atomic<std::int64_t> counted_op_exits{0};
int counting_hook_id = -1;
int counting_exit_hook_id = -1;
void count_op_exit(void*) { counted_op_exits.fetch_add(1, std::memory_order_relaxed); }

// This thread is between Triton's launch enter and exit hooks.
thread_local bool triton_launch_open = false;
// Entries still to fail after being counted, for tests of a hook that throws.
std::atomic<std::int64_t> failing_op_entries{0};
void count_op_entry(const OpEntry&, void*) {
  counted_op_entries.fetch_add(1, std::memory_order_relaxed);
  if (failing_op_entries.load(std::memory_order_relaxed) > 0 &&
      failing_op_entries.fetch_sub(1, std::memory_order_relaxed) > 0) {
    throw std::runtime_error("cotenant test hook: this op entry fails on purpose");
  }
}

std::mutex channel_mutex;
std::unique_ptr<TorchJobProcess> job_process;  // outlives job_channel
std::unique_ptr<JobChannel> job_channel;

// None or an int of bytes (a Cap resolved by the Python API).
std::uint64_t cap_word(const std::optional<std::uint64_t>& bytes) {
  return bytes ? Cap::of_bytes(*bytes).to_word() : kNoCap;
}

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

  // Calls that may synchronize the device (cache given back) or pin host
  // memory let the GIL go for it, as torch.cuda.synchronize() does: the
  // job's other Python threads run on. The allocator is found first, with
  // the GIL (creating a device's allocators may call into Python).
  m.def("set_memory_cap", [](int device, std::optional<std::uint64_t> bytes) {
    auto& allocator = installed_allocator();
    DeviceAllocators& d = allocator.on(static_cast<c10::DeviceIndex>(device));
    py::gil_scoped_release release;
    allocator.set_job_cap(d, CotenantCudaAllocator::CapSource::kUser, cap_word(bytes));
    allocator.follow_job_cap(d, /*always=*/true);
  }, py::arg("device"), py::arg("bytes"),
     "The user's cap on the job's device memory (all its allocators), bytes, or None to remove it; a "
     "coordinator's lower cap holds over it.");
  m.def("lift_memory_caps", [](int device) {
    auto& allocator = installed_allocator();
    DeviceAllocators& d = allocator.on(static_cast<c10::DeviceIndex>(device));
    py::gil_scoped_release release;
    allocator.set_job_cap(d, CotenantCudaAllocator::CapSource::kUser, kNoCap);
    allocator.set_job_cap(d, CotenantCudaAllocator::CapSource::kCoordinator, kNoCap);
    allocator.follow_job_cap(d, /*always=*/true);
  }, py::arg("device"), "Lifts the user's cap and the coordinator's (disable(), once the job left the coordinator).");
  m.def("memory_cap", [](int device) -> py::object {
    auto& allocator = installed_allocator();
    const std::uint64_t cap = allocator.job_cap(allocator.on(static_cast<c10::DeviceIndex>(device)));
    if (cap == kNoCap) return py::none();
    return py::int_(cap);
  }, py::arg("device"), "The job's cap in bytes (the lower of the user's and the coordinator's), or None.");

  m.def("capped_device_bytes", [](int device) -> py::object {
    // Never creates a device's allocators: a query about a device the job
    // has not used answers None, as a device without a cap does.
    auto& allocator = CotenantCudaAllocator::instance();
    DeviceAllocators* d = allocator.installed() ? allocator.existing(static_cast<c10::DeviceIndex>(device)) : nullptr;
    if (d == nullptr) return py::none();
    const std::uint64_t cap = allocator.job_cap(*d);
    if (cap == kNoCap) return py::none();
    const std::int64_t others = allocator.stats_besides_main(*d).device_resident_bytes.current;
    return py::make_tuple(cap, d->main->stats().device_resident_bytes.current + std::max<std::int64_t>(others, 0));
  }, py::arg("device"), "(the job's cap, the job's device-resident bytes, all its allocators), or None without a cap.");

  m.def("_driver_call_times", [](int device) {
    using Call = cuda::CudaBackend::DriverCall;
    const cuda::CudaBackend& backend = device_backend(device);
    py::dict times;
    for (int i = 0; i < static_cast<int>(Call::kCount); ++i) {
      const auto call = static_cast<Call>(i);
      const cuda::CudaBackend::DriverCallTime time = backend.driver_call_time(call);
      py::dict entry;
      entry["calls"] = time.calls;
      entry["ns"] = time.ns;
      times[cuda::CudaBackend::driver_call_name(call)] = entry;
    }
    return times;
  }, py::arg("device"), "Calls and nanoseconds per kind of driver call since the last reset (benchmarks).");
  m.def("_probe_vmm_costs", [](int device, std::size_t total_bytes, const std::vector<std::size_t>& extents) {
    std::vector<cuda::CudaBackend::VmmProbeRow> rows;
    {
      py::gil_scoped_release release;  // hundreds of driver calls
      rows = device_backend(device).probe_vmm_costs(total_bytes, extents);
    }
    py::list out;
    for (const auto& row : rows) {
      py::dict entry;
      entry["side"] = row.side;
      entry["extent_bytes"] = row.extent_bytes;
      entry["step"] = row.step;
      entry["calls"] = row.calls;
      entry["ns"] = row.ns;
      entry["error"] = row.error.empty() ? py::object(py::none()) : py::object(py::str(row.error));
      out.append(entry);
    }
    return out;
  }, py::arg("device"), py::arg("total_bytes"), py::arg("extents"),
     "What the driver's virtual memory calls cost per extent size (CudaBackend::probe_vmm_costs; benchmarks).");
  m.def("_page_bytes", [](int device) {
    return device_backend(device).granularity();
  }, py::arg("device"), "Bytes per page (the driver's granularity).");
  m.def("_reset_driver_call_times", [](int device) {
    device_backend(device).reset_driver_call_times();
  }, py::arg("device"));

  m.def("_cache_info", [](int device, std::size_t largest) {
    // As cuDNN asks it: through the allocator torch has installed.
    c10::cuda::CUDACachingAllocator::cacheInfo(static_cast<c10::DeviceIndex>(device), &largest);
    return largest;
  }, py::arg("device"), py::arg("largest") = 0,
     "torch's CUDACachingAllocator::cacheInfo: the largest block an allocation on the current stream "
     "could get now (tests).");

  m.def("device_total_bytes", [](int device) {
    return device_backend(device).device_total_bytes();
  }, py::arg("device"));

  m.def("stats", [](int device) {
    auto& d = installed_allocator().on(static_cast<c10::DeviceIndex>(device));
    AllocatorStats s = d.main->stats();
    py::dict out;
    for (const auto& [key, value] : s.as_map()) out[py::str(key)] = value;
    out["mode"] = spill_mode_name(s.mode);
    out["host_page_kind"] = d.backend->host_page_kind();
    out["host_reserve_bytes"] = d.main->host_reserve();
    out["host_headroom_bytes"] = d.host_pages->headroom();
    const std::optional<std::size_t> available = d.backend->host_available_bytes();
    out["host_available_bytes"] = available ? py::object(py::int_(*available)) : py::none();
    return out;
  }, py::arg("device"), "The capped allocator's statistics (torch's key names plus cotenant's).");

  m.def("reserve_host_memory", [](int device, std::uint64_t bytes) {
    CachingAllocator& allocator = main_allocator(device);
    py::gil_scoped_release release;  // pinning takes a while (see set_memory_cap)
    return allocator.reserve_host_memory(bytes);
  }, py::arg("device"), py::arg("bytes"), "Pins host pages now and keeps them (see CachingAllocator). Returns bytes.");
  m.def("set_host_headroom", [](std::uint64_t bytes) { CotenantCudaAllocator::instance().set_host_headroom(bytes); },
        py::arg("bytes"), "Host memory no device's host pool pins into, on every device (HostPagePool).");
  m.def("host_headroom", [] { return CotenantCudaAllocator::instance().host_headroom(); });
  m.def("spill_all", [](int device) {
    CachingAllocator& allocator = main_allocator(device);
    py::gil_scoped_release release;  // gives the device's cache back (see set_memory_cap)
    allocator.spill_all();
  }, py::arg("device"));
  m.def("restore_all", [](int device) {
    CachingAllocator& allocator = main_allocator(device);
    py::gil_scoped_release release;  // see set_memory_cap
    allocator.restore_all();
  }, py::arg("device"));
  m.def("has_pending_migrations", [] { return CotenantCudaAllocator::instance().has_pending_migrations(); });
  m.def("mark_iteration", [] { CotenantCudaAllocator::instance().mark_iteration(); },
        "The end of one step of the job's loop: cache idle since the last mark may be released to grow.");
  m.def("safe_point", [] {
    if (!CotenantCudaAllocator::instance().installed()) return std::size_t{0};
    return CotenantCudaAllocator::instance().run_safe_point();  // lets the GIL go itself while it works
  }, "Moves pending pages now (pauses launches, synchronizes, remaps). Returns bytes moved.");

  m.def("is_device_resident", [](std::uintptr_t address, int device) {
    return main_allocator(device).is_device_resident(static_cast<DevicePtr>(address));
  }, py::arg("address"), py::arg("device"));

  // ---- the interception point, for tests and diagnostics ----
  m.def("ops_in_flight", &ops_in_flight, "Outermost ATen ops running now, all threads.");
  // The GIL stays held here, as it does through an ATen op's entry: a wait
  // there (a pause, the gate, a safe point's moves) lets it go itself, and a
  // launch that need not wait does not hand it to another thread.
  m.def("begin_explicit_op", [] { begin_explicit_op("cotenant::explicit_op"); },
        "Work launched outside ATen (a CUDA graph replay) begins: it counts as one op until end_explicit_op().");
  m.def("end_explicit_op", [] { end_explicit_op(); });
  // Triton's launch hooks (triton.knobs.runtime.launch_enter_hook and
  // launch_exit_hook): each launch through Triton's launcher is one explicit
  // op. Triton skips the exit hook when a launch fails, so an enter hook
  // that finds this thread's previous launch still open ends it first, and
  // triton_launch_exit may be called again to end it (it does nothing then).
  m.def("triton_launch_enter", [](const py::handle& /*metadata*/) {
    if (triton_launch_open) end_explicit_op();
    triton_launch_open = false;
    begin_explicit_op("triton::launch");  // with the GIL, as begin_explicit_op above
    triton_launch_open = true;
  }, py::arg("metadata") = py::none(), "Triton's launch enter hook: the launch begins as one op.");
  m.def("triton_launch_exit", [](const py::handle& /*metadata*/) {
    if (!triton_launch_open) return;
    triton_launch_open = false;
    end_explicit_op();
  }, py::arg("metadata") = py::none(), "Triton's launch exit hook: the launch is enqueued.");
  m.def("_count_op_entries", [](bool on, std::int64_t failing) {
    failing_op_entries.store(failing);
    if (on && counting_hook_id < 0) {
      counted_op_entries.store(0);
      counted_op_exits.store(0);
      counting_exit_hook_id = add_op_exit_hook(&count_op_exit, nullptr);
      counting_hook_id = add_op_entry_hook(&count_op_entry, nullptr);
    } else if (!on && counting_hook_id >= 0) {
      remove_op_entry_hook(counting_hook_id);
      remove_op_exit_hook(counting_exit_hook_id);
      counting_hook_id = counting_exit_hook_id = -1;
    }
  }, py::arg("on"), py::arg("failing") = 0,
     "For tests: counts outermost op entries and exits; the next `failing` entries throw after being counted.");
  m.def("_counted_op_entries", [] { return counted_op_entries.load(); });
  m.def("_counted_op_exits", [] { return counted_op_exits.load(); });
  m.def("_pause_launches", [](double timeout_s) {  // lets the GIL go itself while it waits
    return pause_launches(std::chrono::microseconds(static_cast<std::int64_t>(timeout_s * 1e6)));
  }, py::arg("timeout_s"));
  m.def("_resume_launches", [] { resume_launches(); });
  m.def("_raw_delete", [](std::uintptr_t address) {
    CotenantCudaAllocator::instance().raw_delete(reinterpret_cast<void*>(address));
  }, py::arg("address"), "The allocator's raw_delete, as torch calls it (for tests: it never throws).");

  // ---- the coordinator's job channel ----
  // What each command does is the core's job_channel_hooks() over a
  // TorchJobProcess (job_process.h); nothing of it lives here.
  m.def("start_job_channel", [](const std::string& block_name, int device) {
    auto& allocator = installed_allocator();
    auto& allocators = allocator.on(static_cast<c10::DeviceIndex>(device));
    py::gil_scoped_release release;  // opening the block may wait on the file system
    std::lock_guard<std::mutex> lock(channel_mutex);
    job_channel.reset();
    job_process = std::make_unique<TorchJobProcess>(allocator, allocators);
    job_channel = std::make_unique<JobChannel>(block_name, job_channel_hooks(*job_process));
    job_channel->start();
  }, py::arg("block_name"), py::arg("device"),
     "Starts the C++ thread that applies the coordinator's cap, share and commands and publishes stats.");
  m.def("stop_job_channel", [] {
    py::gil_scoped_release release;  // the channel thread may be waiting for the GIL
    std::lock_guard<std::mutex> lock(channel_mutex);
    job_channel.reset();
    job_process.reset();
  });
}

}  // namespace cotenant::torch_ext
