#include "gate_hooks.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_set>
#include <vector>

#include "cotenant/errors.h"
#include "cotenant/shm/gpu_block.h"
#include "op_interceptor.h"
#include "registry.h"

namespace py = pybind11;

namespace cotenant::torch_ext {
namespace {

// Completion markers as CUDA events (timing disabled: the cheapest kind),
// recorded on the gated device's current stream of the calling thread.
// Events are pooled: creating one per op would cost more than the op's gate.
// Callers serialize (the gate and the tracker call under their locks).
class CudaEventWork final : public InFlightWork {
 public:
  explicit CudaEventWork(int device) : device_(device) {}
  ~CudaEventWork() override {
    // Process exit: the driver may already be gone; destroying is best effort.
    for (cudaEvent_t event : free_) (void)cudaEventDestroy(event);
    for (cudaEvent_t event : pending_) (void)cudaEventDestroy(event);
  }

  void record_marker() override {
    const auto stream = at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_));
    // An event recorded while the stream captures a CUDA graph would become a
    // graph node, and querying it would break the capture: no marker then.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream.stream(), &capture) != cudaSuccess) (void)cudaGetLastError();
    if (capture != cudaStreamCaptureStatusNone) return;
    cudaEvent_t event = take_event();
    if (event == nullptr) return;
    if (cudaEventRecord(event, stream.stream()) != cudaSuccess) {
      (void)cudaGetLastError();  // not sticky; keep the error out of torch's next check
      free_.push_back(event);
      return;
    }
    pending_.push_back(event);
  }

  // Retires the completed prefix. Markers of one thread's stream complete in
  // order; across streams a completed marker behind a pending one is counted
  // until that one completes (errs towards "busy").
  std::size_t poll_in_flight() override {
    if (pending_.empty()) return 0;
    // cudaEventQuery is a "potentially unsafe" call while another thread
    // captures a graph in global mode; relaxed mode lets this thread query
    // without invalidating that capture.
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    (void)cudaThreadExchangeStreamCaptureMode(&mode);
    while (!pending_.empty()) {
      const cudaError_t state = cudaEventQuery(pending_.front());
      if (state == cudaErrorNotReady) break;
      if (state != cudaSuccess) (void)cudaGetLastError();  // a broken event counts as done
      free_.push_back(pending_.front());
      pending_.pop_front();
    }
    (void)cudaThreadExchangeStreamCaptureMode(&mode);  // restores the thread's mode
    return pending_.size();
  }

 private:
  cudaEvent_t take_event() {
    if (!free_.empty()) {
      cudaEvent_t event = free_.back();
      free_.pop_back();
      return event;
    }
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    cudaEvent_t event = nullptr;
    if (cudaEventCreateWithFlags(&event, cudaEventDisableTiming) != cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    return event;
  }

  int device_;
  std::deque<cudaEvent_t> pending_;
  std::vector<cudaEvent_t> free_;
};

// True while the gated device's current stream captures a CUDA graph:
// capture launches nothing, and events recorded during it become graph nodes.
// Without a usable device (CPU-only tests of the hooks) nothing captures.
bool capturing(int device) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  try {
    const auto stream = at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device));
    if (cudaStreamIsCapturing(stream.stream(), &status) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
  } catch (const std::exception&) {
    return false;
  }
  return status != cudaStreamCaptureStatusNone;
}

// Everything the gate holds in this process. Allocated once and never freed:
// hooks on other threads may run until the process exits.
struct ProcessGate {
  GateActivation activation;
  std::optional<shm::GpuPeerSegment> segment;
  std::size_t opportunistic_slot = 0;
  std::unique_ptr<shm::SegmentPeerState> peer;
  std::unique_ptr<shm::SegmentGuaranteedSink> sink;
  std::unique_ptr<CudaEventWork> work;
  std::unique_ptr<LaunchGate> gate;                 // opportunistic
  std::unique_ptr<BusyTracker> busy_tracker;        // guaranteed
  int entry_hook_id = -1;
  int exit_hook_id = -1;
  std::thread pulse;
  std::atomic<bool> stopping{false};
};

std::mutex activation_mutex;
ProcessGate* active = nullptr;                      // guarded by activation_mutex for writes
std::atomic<ProcessGate*> active_for_hooks{nullptr};  // read lock-free by hooks
std::atomic<double> requested_share{1.0};
std::atomic<double> coordinator_share{1.0};

// The process's one iteration measurement, for every role. Never freed.
IterationTracker& iteration_tracker() {
  static auto* tracker = new IterationTracker(MonotonicClock::instance());
  return *tracker;
}

// ATen ops that never put work on the GPU, whatever their inputs: views,
// metadata and uninitialized allocations. An opportunistic job's outermost op
// among them is not gated: it would only wait for a slot it does not use and
// cost an event record and query. Composite ops that may copy (reshape,
// contiguous, flatten) are not here: their copy runs inside them, ungated
// once the outermost op is let through. tests/python/test_torch_over_fake.py
// runs each of these over the fake CUDA runtime, where a kernel launch is a
// violation.
constexpr std::string_view kOpsThatLaunchNoKernel[] = {
    "aten::_reshape_alias", "aten::_unsafe_view", "aten::alias",       "aten::as_strided",
    "aten::chunk",          "aten::detach",       "aten::diagonal",    "aten::empty",
    "aten::empty_like",     "aten::empty_strided", "aten::expand",     "aten::expand_as",
    "aten::movedim",        "aten::narrow",       "aten::new_empty",   "aten::permute",
    "aten::select",         "aten::slice",        "aten::split",       "aten::split_with_sizes",
    "aten::squeeze",        "aten::t",            "aten::transpose",   "aten::unbind",
    "aten::unflatten",      "aten::unsqueeze",    "aten::view",        "aten::view_as",
};

bool launches_no_kernel(const char* op_name) {
  if (op_name == nullptr) return false;
  static const std::unordered_set<std::string_view> ops(std::begin(kOpsThatLaunchNoKernel),
                                                        std::end(kOpsThatLaunchNoKernel));
  return ops.count(std::string_view(op_name)) != 0;
}

// In a child forked after activation (DataLoader workers; activation notes
// CUDA in use, see op_interceptor.h) the gate is off: the child has no pulse
// thread and must not touch CUDA, and its CPU ops must never wait for the
// guaranteed job.

// Per thread: this thread's outermost op was admitted and awaits launched();
// depth of explicit gate_enter().
thread_local bool admitted_op = false;
thread_local int explicit_depth = 0;

// Admits one op or block of hand-launched work, which may have begun with
// the GIL held: it lets the GIL go only when it must wait (letting it go
// costs a switch).
void admit_letting_the_gil_go_to_wait(LaunchGate& gate) {
  if (gate.try_admit()) return;
  GilReleasedForWait without_gil;
  gate.admit();
}

// Hooks must not throw into ATen: a failure to gate lets the op through.
void opportunistic_entry(const OpEntry& op, void* context) {
  auto* state = static_cast<ProcessGate*>(context);
  if (explicit_depth > 0 || admitted_op) return;  // inside admitted work
  if (launches_no_kernel(op.name)) return;        // nothing for the GPU: nothing to wait for or mark
  if (!may_use_cuda(op)) return;                  // CPU work (model set-up, data): never waits for the GPU
  if (in_forked_child()) return;
  try {
    if (capturing(state->activation.device)) return;
    admit_letting_the_gil_go_to_wait(*state->gate);
    admitted_op = true;
  } catch (const std::exception&) {
  }
}

// The exit half, for either role: when a thread's outermost op returns (an
// ATen op, or an explicit one such as a CUDA graph replay or a Triton
// launch), its work is enqueued. The opportunistic role then records the
// admitted op's marker; the guaranteed role notes the GPU busy (at op entry
// only the op's CPU work has started). Through the interceptor's one
// callback (op_interceptor.h), which runs this once per outermost op.
void launched_at_op_exit(void* context) {
  auto* state = static_cast<ProcessGate*>(context);
  try {
    if (state->activation.role == GateRole::kOpportunistic) {
      if (!admitted_op) return;
      admitted_op = false;
      state->gate->launched();
    } else if (state->busy_tracker && !state->stopping.load(std::memory_order_acquire) &&
               !in_forked_child()) {
      state->busy_tracker->on_op_launched();
    }
  } catch (const std::exception&) {
  }
}

void pulse_loop(ProcessGate* state) {
  using namespace std::chrono;
  const bool guaranteed = state->activation.role == GateRole::kGuaranteed;
  // The guaranteed job's busy flag is what opportunistic jobs wait on: fresh
  // every 100 us. The opportunistic side only needs its idle time noticed.
  const auto period = guaranteed ? microseconds(100) : microseconds(500);
  auto last_beat = steady_clock::now() - seconds(1);
  auto last_reclaim = steady_clock::now();
  const std::uint64_t pid = static_cast<std::uint64_t>(::getpid());
  while (!state->stopping.load(std::memory_order_acquire)) {
    try {
      if (guaranteed) {
        state->busy_tracker->refresh();
      } else {
        state->gate->refresh();
      }
      const auto now = steady_clock::now();
      if (now - last_beat >= milliseconds(100)) {
        state->segment->heartbeat(pid);
        if (!guaranteed) state->segment->report_gate(state->opportunistic_slot, state->gate->stats());
        last_beat = now;
      }
      if (now - last_reclaim >= milliseconds(500)) {
        state->segment->reclaim_crashed();  // a crashed guaranteed job must not stall us
        if (!guaranteed) state->gate->notify();
        last_reclaim = now;
      }
    } catch (const std::exception&) {
      // A pulse must never take the process down; the next one retries.
    }
    std::this_thread::sleep_for(period);
  }
}

}  // namespace

GateRole parse_gate_role(const std::string& role) {
  if (role.empty() || role == "none") return GateRole::kNone;
  if (role == "guaranteed") return GateRole::kGuaranteed;
  if (role == "opportunistic") return GateRole::kOpportunistic;
  throw Error("unknown role '" + role + "'; use \"guaranteed\", \"opportunistic\" or none");
}

void activate_gate(const GateActivation& activation) {
  std::lock_guard<std::mutex> lock(activation_mutex);
  if (active != nullptr) {
    if (active->activation.role == activation.role && active->activation.device == activation.device) return;
    throw Error("the launch gate is already active in this process with another role or device; a process has "
                "one role on one GPU");
  }
  if (activation.role == GateRole::kNone) return;
  note_cuda_in_use();

  auto state = std::make_unique<ProcessGate>();
  state->activation = activation;
  const std::string name =
      activation.segment_name.empty()
          ? shm::GpuPeerSegment::default_name(activation.gpu_uuid, static_cast<std::uint32_t>(activation.device),
                                              ::getuid(), activation.group)
          : activation.segment_name;
  shm::GpuPeerSegmentOptions options;
  options.gpu_uuid = activation.gpu_uuid;
  options.group = activation.group;
  state->segment.emplace(shm::GpuPeerSegment::open(name, static_cast<std::uint32_t>(activation.device), options));
  state->work = std::make_unique<CudaEventWork>(activation.device);
  const auto pid = static_cast<std::uint64_t>(::getpid());

  if (activation.role == GateRole::kOpportunistic) {
    state->opportunistic_slot = state->segment->claim_opportunistic(pid);
    state->peer = std::make_unique<shm::SegmentPeerState>(*state->segment);
    LaunchGateOptions gate_options;
    gate_options.max_in_flight = activation.max_in_flight;
    gate_options.share_window_ns = activation.share_window_ns;
    gate_options.initial_share = requested_share.load();
    state->gate = std::make_unique<LaunchGate>(MonotonicClock::instance(), *state->work, *state->peer, gate_options);
    state->gate->set_coordinator_share(coordinator_share.load());
  } else {
    state->segment->claim_guaranteed(pid);
    state->sink = std::make_unique<shm::SegmentGuaranteedSink>(*state->segment);
    state->busy_tracker = std::make_unique<BusyTracker>(MonotonicClock::instance(), *state->work, *state->sink);
  }

  ProcessGate* raw = state.release();  // never freed: see ProcessGate
  active = raw;
  active_for_hooks.store(raw, std::memory_order_release);
  // The exit hook first, so every op the entry hook admits is seen leaving.
  raw->exit_hook_id = add_op_exit_hook(&launched_at_op_exit, raw);
  if (activation.role == GateRole::kOpportunistic) {
    raw->entry_hook_id = add_op_entry_hook(&opportunistic_entry, raw, OpInputs::kNeeded);
  }
  raw->pulse = std::thread(pulse_loop, raw);
}

void deactivate_gate() {
  std::lock_guard<std::mutex> lock(activation_mutex);
  if (active == nullptr) return;
  ProcessGate* state = active;
  if (state->entry_hook_id >= 0) remove_op_entry_hook(state->entry_hook_id);
  state->stopping.store(true, std::memory_order_release);
  if (state->pulse.joinable()) state->pulse.join();
  const auto pid = static_cast<std::uint64_t>(::getpid());
  if (state->activation.role == GateRole::kOpportunistic) {
    // Ops admitted before the entry hook was removed still leave through the
    // exit hook; keep it (and the state) for them.
    state->gate->set_share(1.0);
    state->segment->release_opportunistic(state->opportunistic_slot, pid);
  } else {
    remove_op_exit_hook(state->exit_hook_id);
    state->segment->release_guaranteed(pid);
  }
  active = nullptr;
  // active_for_hooks stays: a late launched() must find its gate.
}

GateRole active_gate_role() {
  std::lock_guard<std::mutex> lock(activation_mutex);
  return active == nullptr ? GateRole::kNone : active->activation.role;
}

LaunchGate* process_launch_gate() {
  ProcessGate* state = active_for_hooks.load(std::memory_order_acquire);
  return state == nullptr ? nullptr : state->gate.get();
}

void set_process_share(double share) {
  requested_share.store(share);
  if (LaunchGate* gate = process_launch_gate()) gate->set_share(share);
}

double process_share() {
  if (LaunchGate* gate = process_launch_gate()) return gate->share();
  return requested_share.load();
}

void set_process_coordinator_share(double share) {
  coordinator_share.store(share);
  if (LaunchGate* gate = process_launch_gate()) gate->set_coordinator_share(share);
}

double process_effective_share() {
  if (LaunchGate* gate = process_launch_gate()) return gate->effective_share();
  return std::clamp(std::min(requested_share.load(), coordinator_share.load()), 0.0, 1.0);
}

void gate_enter() {
  if (explicit_depth++ > 0 || admitted_op) return;  // inside admitted work already
  if (in_forked_child()) return;
  ProcessGate* state = active_for_hooks.load(std::memory_order_acquire);
  if (state == nullptr || !state->gate || state->stopping.load(std::memory_order_acquire)) return;
  admit_letting_the_gil_go_to_wait(*state->gate);
}

void gate_exit() {
  if (explicit_depth == 0) return;
  if (--explicit_depth > 0 || admitted_op) return;
  if (in_forked_child()) return;
  ProcessGate* state = active_for_hooks.load(std::memory_order_acquire);
  if (state == nullptr || !state->gate) return;
  state->gate->launched();
}

void iteration_boundary() {
  iteration_tracker().boundary();
  ProcessGate* state = active_for_hooks.load(std::memory_order_acquire);
  if (state == nullptr || !state->busy_tracker) return;
  try {
    state->busy_tracker->mark();  // the iteration's tail gets a marker at once
  } catch (const std::exception&) {
    // No marker (no usable device): the unmarked-tail grace covers the tail.
  }
}

void iteration_begin() { iteration_tracker().begin(); }

IterationStats process_iterations() { return iteration_tracker().stats(); }

namespace {

py::dict gate_stats_dict() {
  py::dict d;
  ProcessGate* state = active_for_hooks.load(std::memory_order_acquire);
  GateRole role = active_gate_role();
  d["role"] = role == GateRole::kGuaranteed ? "guaranteed" : role == GateRole::kOpportunistic ? "opportunistic" : "none";
  // The gate's statistics under their one set of names (launch_gate.h);
  // without a gate, the shares as the process holds them.
  LaunchGateStats stats;
  if (state != nullptr && state->gate) {
    stats = state->gate->stats();
    d["max_in_flight"] = state->gate->max_in_flight();
  } else {
    stats.user_share = std::clamp(requested_share.load(), 0.0, 1.0);
    stats.coordinator_share = std::clamp(coordinator_share.load(), 0.0, 1.0);
    stats.share = process_effective_share();
  }
  for_each_field(stats, [&d](const char* name, const auto& value) { d[name] = value; });
  const IterationStats it = process_iterations();
  d["iteration_count"] = it.iterations;
  d["iteration_last_ns"] = it.last_ns;
  d["iteration_ewma_ns"] = it.ewma_ns;
  d["iteration_p99_ns"] = it.p99_ns;
  d["iteration_total_ns"] = it.total_ns;
  if (state == nullptr) return d;
  d["segment"] = state->segment->name();
  if (state->busy_tracker) d["busy_markers_recorded"] = state->busy_tracker->markers_recorded();
  return d;
}

}  // namespace

COTENANT_TORCH_BINDINGS(launch_gate) {
  m.def("gate_activate",
        [](const std::string& role, int device, const std::string& segment_name, std::size_t max_in_flight,
           double share_window_s, const std::string& gpu_uuid, std::optional<gid_t> group) {
          GateActivation activation;
          activation.role = parse_gate_role(role);
          activation.device = device;
          activation.segment_name = segment_name;
          activation.max_in_flight = max_in_flight;
          activation.share_window_ns = static_cast<Nanoseconds>(share_window_s * 1e9);
          activation.gpu_uuid = gpu_uuid;
          activation.group = group;
          activate_gate(activation);
        },
        py::arg("role"), py::arg("device"), py::arg("segment_name") = "", py::arg("max_in_flight") = 2,
        py::arg("share_window_s") = 0.05, py::arg("gpu_uuid") = "", py::arg("group_gid") = py::none(),
        "Activates the launch gate for this process in the given role on the given GPU.");
  m.def("gate_deactivate", [] {
    py::gil_scoped_release release;
    deactivate_gate();
  });
  m.def("gate_set_share", [](double share) { set_process_share(share); }, py::arg("share"),
        "The job's own share; the coordinator's caps it (admission uses the minimum).");
  m.def("gate_share", [] { return process_share(); }, "The job's own share, as set.");
  m.def("gate_effective_share", [] { return process_effective_share(); });
  m.def("gate_set_max_in_flight", [](std::size_t k) {
    if (LaunchGate* gate = process_launch_gate()) gate->set_max_in_flight(k);
  }, py::arg("k"));
  m.def("gate_enter", [] { gate_enter(); },
        "Admits hand-launched work as one op (a wait lets the GIL go; no wait keeps it).");
  m.def("gate_exit", [] { gate_exit(); }, "The admitted work is enqueued: records its completion marker.");
  m.def("gate_close", [] {
    if (LaunchGate* gate = process_launch_gate()) gate->close();
  }, py::call_guard<py::gil_scoped_release>(),
     "Stops every thread at its next op and waits until in-flight work drained (suspend).");
  m.def("gate_reopen", [] {
    if (LaunchGate* gate = process_launch_gate()) gate->reopen();
  });
  m.def("gate_stats", &gate_stats_dict);
  m.def("ops_that_launch_no_kernel", [] {
    std::vector<std::string> names(std::begin(kOpsThatLaunchNoKernel), std::end(kOpsThatLaunchNoKernel));
    return names;
  }, "The ATen ops an opportunistic job runs without passing the gate: they put no work on the GPU.");
  m.def("iteration_boundary", [] { iteration_boundary(); });
  m.def("iteration_begin", [] { iteration_begin(); });
}

}  // namespace cotenant::torch_ext
