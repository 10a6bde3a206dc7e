// cotenant._core: the launch gate's logic and the per-GPU peer segment, for
// Python: tests drive the gate with a manual clock and manual completion
// markers, and several processes meet in one segment (no GPU needed).
//
//   ManualClock, ManualInFlightWork, ManualPeerState   test doubles in C++
//   LaunchGate                                         the gate (launch_gate.h)
//   GpuPeerSegment, SegmentPeerState                   the segment (shm/gpu_block.h)
//   BusyTracker, IterationTracker                      the guaranteed side
//
// Python never sees offsets: gpu_block_layout() describes the fields for
// tools, and every read and write goes through GpuPeerSegment.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "cotenant/errors.h"
#include "cotenant/launch_gate.h"
#include "cotenant/shm/gpu_block.h"
#include "registry.h"

namespace py = pybind11;

namespace cotenant::bindings {
namespace {

using shm::GpuPeerSegment;
using shm::GpuPeerSegmentOptions;
using shm::SegmentGuaranteedSink;
using shm::SegmentPeerState;

class ManualClock final : public Clock {
 public:
  explicit ManualClock(Nanoseconds start) : now_(start) {}
  Nanoseconds now_ns() const override { return now_.load(); }
  void set(Nanoseconds at) { now_.store(at); }
  void advance(Nanoseconds by) { now_.fetch_add(by); }

 private:
  std::atomic<Nanoseconds> now_;
};

// Markers complete when Python says so.
class ManualInFlightWork final : public InFlightWork {
 public:
  void record_marker() override {
    std::lock_guard<std::mutex> lock(mutex_);
    ++pending_;
    ++recorded_;
  }
  std::size_t poll_in_flight() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return pending_;
  }
  std::size_t complete(std::size_t n) {
    std::lock_guard<std::mutex> lock(mutex_);
    n = std::min(n, pending_);
    pending_ -= n;
    return n;
  }
  std::size_t pending() {
    std::lock_guard<std::mutex> lock(mutex_);
    return pending_;
  }
  std::size_t recorded() {
    std::lock_guard<std::mutex> lock(mutex_);
    return recorded_;
  }

 private:
  std::mutex mutex_;
  std::size_t pending_ = 0, recorded_ = 0;
};

class ManualPeerState final : public PeerState {
 public:
  bool guaranteed_busy() const override { return busy.load(); }
  std::atomic<bool> busy{false};
};

// The gate with the Python objects it reads kept alive for its lifetime.
struct GateHandle {
  py::object clock_owner, work_owner, peer_owner;
  std::unique_ptr<ManualInFlightWork> own_work;
  NoPeer no_peer;
  std::unique_ptr<LaunchGate> gate;
};

py::dict stats_dict(const LaunchGateStats& s) {
  py::dict d;
  for_each_field(s, [&d](const char* name, const auto& value) { d[name] = value; });
  return d;
}

py::dict iterations_dict(const IterationStats& s) {
  py::dict d;
  d["iterations"] = s.iterations;
  d["last_ns"] = s.last_ns;
  d["ewma_ns"] = s.ewma_ns;
  d["p99_ns"] = s.p99_ns;
  return d;
}

py::dict view_dict(const shm::GpuSegmentView& v) {
  py::dict g;
  g["pid"] = v.guaranteed.pid;
  g["live"] = v.guaranteed.live;
  g["busy"] = v.guaranteed.busy;
  g["ops_in_flight"] = v.guaranteed.ops_in_flight;
  g["heartbeat_ns"] = v.guaranteed.heartbeat_ns;
  g["last_activity_ns"] = v.guaranteed.last_activity_ns;
  py::list opportunistic;
  for (const auto& o : v.opportunistic) {
    py::dict d;
    d["slot"] = o.slot;
    d["pid"] = o.pid;
    d["live"] = o.live;
    d["admitted_ops"] = o.admitted_ops;
    d["waiting_ops"] = o.waiting_ops;
    d["heartbeat_ns"] = o.heartbeat_ns;
    d["busy_ns_in_window"] = o.busy_ns_in_window;
    opportunistic.append(d);
  }
  py::dict d;
  d["device"] = v.device;
  d["generation"] = v.generation;
  d["gpu_uuid"] = v.gpu_uuid;
  d["guaranteed"] = g;
  d["opportunistic"] = opportunistic;
  return d;
}

std::uint64_t pid_or_self(std::optional<std::uint64_t> pid) {
  return pid ? *pid : static_cast<std::uint64_t>(::getpid());
}

// Trackers own their sink, which points into a segment kept alive by Python.
struct BusyTrackerHandle {
  std::unique_ptr<SegmentGuaranteedSink> sink;
  std::unique_ptr<BusyTracker> tracker;
};
struct IterationTrackerHandle {
  py::object clock_owner;
  std::unique_ptr<IterationTracker> tracker;
};

}  // namespace

COTENANT_CORE_BINDINGS(launch_gate) {
  m.attr("GPU_BLOCK_MAGIC") = shm::kGpuBlockMagic;
  m.attr("GPU_BLOCK_VERSION") = shm::kGpuBlockVersion;
  m.attr("MAX_OPPORTUNISTIC_JOBS") = shm::kMaxOpportunisticJobs;
  m.attr("GPU_BLOCK_BYTES") = sizeof(shm::GpuBlock);

  m.def("monotonic_ns", [] { return MonotonicClock::instance().now_ns(); },
        "CLOCK_MONOTONIC in nanoseconds: the time base of the per-GPU segment.");
  m.def("gpu_block_layout", [] {
    py::list out;
    for (const auto& f : shm::gpu_block_layout()) out.append(py::make_tuple(f.name, f.offset, f.bytes));
    return out;
  }, "The per-GPU segment's fields as (name, offset, bytes), from the one C++ definition.");

  py::class_<ManualClock>(m, "ManualClock", "A clock that moves only when told (nanoseconds).")
      .def(py::init<Nanoseconds>(), py::arg("start_ns") = 1'000'000'000)
      .def("now_ns", &ManualClock::now_ns)
      .def("set", &ManualClock::set, py::arg("at_ns"))
      .def("advance", &ManualClock::advance, py::arg("by_ns"));

  py::class_<ManualInFlightWork>(m, "ManualInFlightWork",
                                 "Completion markers that complete only when told.")
      .def(py::init<>())
      .def("complete", &ManualInFlightWork::complete, py::arg("n") = SIZE_MAX,
           "Completes the n oldest pending markers (all by default); returns how many.")
      .def_property_readonly("pending", &ManualInFlightWork::pending)
      .def_property_readonly("recorded", &ManualInFlightWork::recorded);

  py::class_<ManualPeerState>(m, "ManualPeerState", "A guaranteed peer whose state Python sets.")
      .def(py::init<>())
      .def_property("busy", [](const ManualPeerState& p) { return p.busy.load(); },
                    [](ManualPeerState& p, bool busy) { p.busy = busy; });

  py::class_<GpuPeerSegment>(m, "GpuPeerSegment",
                             "The per-GPU shared-memory segment where the jobs of one GPU meet.")
      .def_static("open",
                  [](const std::string& name, std::uint32_t device, double stale_after_s, const std::string& gpu_uuid,
                     std::optional<gid_t> group) {
                    GpuPeerSegmentOptions options;
                    options.stale_after_ns = static_cast<Nanoseconds>(stale_after_s * 1e9);
                    options.gpu_uuid = gpu_uuid;
                    options.group = group;
                    return GpuPeerSegment::open(name, device, options);
                  },
                  py::arg("name"), py::arg("device"), py::arg("stale_after_s") = 3.0, py::arg("gpu_uuid") = "",
                  py::arg("group") = py::none(),
                  "Creates or attaches to a segment; group: the gid whose members share it (else only this uid).")
      .def_static("default_name",
                  [](std::uint32_t device, std::optional<std::uint32_t> uid, const std::string& gpu_uuid,
                     std::optional<gid_t> group) {
                    return GpuPeerSegment::default_name(gpu_uuid, device, uid ? *uid : ::getuid(), group);
                  },
                  py::arg("device"), py::arg("uid") = py::none(), py::arg("gpu_uuid") = "", py::arg("group") = py::none(),
                  "The segment's name for a GPU (by UUID when given) and a uid, or a group's shared one.")
      .def_static("remove", &GpuPeerSegment::remove, py::arg("name"))
      .def_property_readonly("name", &GpuPeerSegment::name)
      .def_property_readonly("opening", [](const GpuPeerSegment& s) { return shm::to_string(s.opening()); })
      .def("claim_guaranteed", [](GpuPeerSegment& s, std::optional<std::uint64_t> pid) {
        s.claim_guaranteed(pid_or_self(pid));
      }, py::arg("pid") = py::none())
      .def("claim_opportunistic", [](GpuPeerSegment& s, std::optional<std::uint64_t> pid) {
        return s.claim_opportunistic(pid_or_self(pid));
      }, py::arg("pid") = py::none())
      .def("release_guaranteed", [](GpuPeerSegment& s, std::optional<std::uint64_t> pid) {
        s.release_guaranteed(pid_or_self(pid));
      }, py::arg("pid") = py::none())
      .def("release_opportunistic", [](GpuPeerSegment& s, std::size_t slot, std::optional<std::uint64_t> pid) {
        s.release_opportunistic(slot, pid_or_self(pid));
      }, py::arg("slot"), py::arg("pid") = py::none())
      .def("heartbeat", [](GpuPeerSegment& s, std::optional<std::uint64_t> pid) {
        s.heartbeat(pid_or_self(pid));
      }, py::arg("pid") = py::none())
      .def("reclaim_crashed", &GpuPeerSegment::reclaim_crashed)
      .def("publish_activity",
           [](GpuPeerSegment& s, bool busy, std::uint32_t ops_in_flight, std::optional<Nanoseconds> at) {
             s.publish_activity(busy, ops_in_flight, at ? *at : MonotonicClock::instance().now_ns());
           },
           py::arg("busy"), py::arg("ops_in_flight") = 0, py::arg("last_activity_ns") = py::none())
      .def("guaranteed_busy", &GpuPeerSegment::guaranteed_busy)
      .def("view", [](const GpuPeerSegment& s) { return view_dict(s.view()); },
           "Everything the segment holds, as dicts (held opportunistic slots only).");

  py::class_<SegmentPeerState>(m, "SegmentPeerState",
                               "The gate's view of a segment: is the guaranteed job busy?")
      .def(py::init<const GpuPeerSegment&>(), py::arg("segment"), py::keep_alive<1, 2>());

  py::class_<GateHandle>(m, "LaunchGate", "The launch gate's logic (see launch_gate.h).")
      .def(py::init([](py::object clock, py::object work, py::object peer, bool admission_control,
                       std::size_t max_in_flight, Nanoseconds share_window_ns, double poll_interval_us,
                       double initial_share) {
             auto h = std::make_unique<GateHandle>();
             h->clock_owner = clock;
             h->work_owner = work;
             h->peer_owner = peer;
             Clock& c = clock.is_none() ? static_cast<Clock&>(MonotonicClock::instance())
                                        : static_cast<Clock&>(clock.cast<ManualClock&>());
             InFlightWork* w = nullptr;
             if (work.is_none()) {
               h->own_work = std::make_unique<ManualInFlightWork>();
               w = h->own_work.get();
             } else {
               w = &work.cast<ManualInFlightWork&>();
             }
             PeerState* p = &h->no_peer;
             if (py::isinstance<ManualPeerState>(peer)) p = &peer.cast<ManualPeerState&>();
             else if (py::isinstance<SegmentPeerState>(peer)) p = &peer.cast<SegmentPeerState&>();
             else if (!peer.is_none()) throw Error("peer must be None, a ManualPeerState or a SegmentPeerState");
             LaunchGateOptions options;
             options.admission_control = admission_control;
             options.max_in_flight = max_in_flight;
             options.share_window_ns = share_window_ns;
             options.poll_interval = std::chrono::microseconds(static_cast<std::int64_t>(poll_interval_us));
             options.initial_share = initial_share;
             h->gate = std::make_unique<LaunchGate>(c, *w, *p, options);
             return h;
           }),
           py::arg("clock") = py::none(), py::arg("work") = py::none(), py::arg("peer") = py::none(),
           py::arg("admission_control") = true, py::arg("max_in_flight") = 2,
           py::arg("share_window_ns") = 50'000'000, py::arg("poll_interval_us") = 20.0,
           py::arg("initial_share") = 1.0)
      .def("admit", [](GateHandle& h) { h.gate->admit(); }, py::call_guard<py::gil_scoped_release>(),
           "Blocks (without the GIL) until an op may launch.")
      .def("try_admit", [](GateHandle& h) { return h.gate->try_admit(); })
      .def("launched", [](GateHandle& h) { h.gate->launched(); })
      .def("abandoned", [](GateHandle& h) { h.gate->abandoned(); })
      .def("set_share", [](GateHandle& h, double share) { h.gate->set_share(share); }, py::arg("share"),
           "The job's own share.")
      .def_property_readonly("share", [](GateHandle& h) { return h.gate->share(); })
      .def("set_coordinator_share", [](GateHandle& h, double share) { h.gate->set_coordinator_share(share); },
           py::arg("share"), "The coordinator's share; admission uses min(own, coordinator's).")
      .def_property_readonly("coordinator_share", [](GateHandle& h) { return h.gate->coordinator_share(); })
      .def_property_readonly("effective_share", [](GateHandle& h) { return h.gate->effective_share(); })
      .def("set_max_in_flight", [](GateHandle& h, std::size_t k) { h.gate->set_max_in_flight(k); }, py::arg("k"))
      .def_property_readonly("max_in_flight", [](GateHandle& h) { return h.gate->max_in_flight(); })
      .def("close", [](GateHandle& h) { h.gate->close(); }, py::call_guard<py::gil_scoped_release>(),
           "Stops every thread at its next op and waits (without the GIL) until in-flight work drained.")
      .def("reopen", [](GateHandle& h) { h.gate->reopen(); })
      .def_property_readonly("closed", [](GateHandle& h) { return h.gate->is_closed(); })
      .def("refresh", [](GateHandle& h) { h.gate->refresh(); })
      .def("stats", [](GateHandle& h) { return stats_dict(h.gate->stats()); });

  m.def("report_gate", [](GpuPeerSegment& s, std::size_t slot, GateHandle& h) {
    s.report_gate(slot, h.gate->stats());
  }, py::arg("segment"), py::arg("slot"), py::arg("gate"),
  "Writes the gate's numbers into the segment's opportunistic slot, for tools.");

  m.def("measure_gate_ns_per_op", [](std::size_t ops, std::size_t max_in_flight, double share) {
    // The gate's own cost per admitted op (admit + launched + a poll), with
    // markers that complete at once and an idle peer: what an op pays when
    // it does not have to wait. Timed in C++ (steady_clock around the loop).
    ManualInFlightWork work;
    NoPeer peer;
    LaunchGateOptions options;
    options.max_in_flight = max_in_flight;
    options.initial_share = share;
    LaunchGate gate(MonotonicClock::instance(), work, peer, options);
    py::gil_scoped_release release;
    const auto start = std::chrono::steady_clock::now();
    for (std::size_t i = 0; i < ops; ++i) {
      gate.admit();
      gate.launched();
      work.complete(1);
    }
    const auto took = std::chrono::steady_clock::now() - start;
    return static_cast<double>(std::chrono::duration_cast<std::chrono::nanoseconds>(took).count()) /
           static_cast<double>(ops ? ops : 1);
  }, py::arg("ops") = 1'000'000, py::arg("max_in_flight") = 2, py::arg("share") = 1.0,
  "Nanoseconds the gate's logic costs per admitted op when nothing makes it wait.");

  py::class_<BusyTrackerHandle>(m, "BusyTracker", "The guaranteed job's busy tracker, publishing to a segment.")
      .def(py::init([](GpuPeerSegment& segment, ManualInFlightWork& work, py::object clock,
                       Nanoseconds min_marker_interval_ns, Nanoseconds unmarked_grace_ns) {
             auto h = std::make_unique<BusyTrackerHandle>();
             h->sink = std::make_unique<SegmentGuaranteedSink>(segment);
             Clock& c = clock.is_none() ? static_cast<Clock&>(MonotonicClock::instance())
                                        : static_cast<Clock&>(clock.cast<ManualClock&>());
             BusyTrackerOptions options;
             options.min_marker_interval_ns = min_marker_interval_ns;
             options.unmarked_grace_ns = unmarked_grace_ns;
             h->tracker = std::make_unique<BusyTracker>(c, work, *h->sink, options);
             return h;
           }),
           py::arg("segment"), py::arg("work"), py::arg("clock") = py::none(),
           py::arg("min_marker_interval_ns") = 50'000, py::arg("unmarked_grace_ns") = 2'000'000,
           py::keep_alive<1, 2>(), py::keep_alive<1, 3>(), py::keep_alive<1, 4>())
      .def("on_op_launched", [](BusyTrackerHandle& h) { h.tracker->on_op_launched(); })
      .def("mark", [](BusyTrackerHandle& h) { h.tracker->mark(); })
      .def("refresh", [](BusyTrackerHandle& h) { return h.tracker->refresh(); })
      .def_property_readonly("markers_recorded", [](BusyTrackerHandle& h) { return h.tracker->markers_recorded(); });

  py::class_<IterationTrackerHandle>(m, "IterationTracker",
                                     "A job's iteration times: its one measurement (last, EWMA, p99).")
      .def(py::init([](py::object clock) {
             auto h = std::make_unique<IterationTrackerHandle>();
             h->clock_owner = clock;
             Clock& c = clock.is_none() ? static_cast<Clock&>(MonotonicClock::instance())
                                        : static_cast<Clock&>(clock.cast<ManualClock&>());
             h->tracker = std::make_unique<IterationTracker>(c);
             return h;
           }),
           py::arg("clock") = py::none())
      .def("boundary", [](IterationTrackerHandle& h) { h.tracker->boundary(); })
      .def("begin", [](IterationTrackerHandle& h) { h.tracker->begin(); })
      .def("record", [](IterationTrackerHandle& h, Nanoseconds took) { h.tracker->record(took); }, py::arg("ns"))
      .def("stats", [](IterationTrackerHandle& h) { return iterations_dict(h.tracker->stats()); });
}

}  // namespace cotenant::bindings
