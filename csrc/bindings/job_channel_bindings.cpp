// cotenant._core: the coordinator's data plane for Python.
//
//   JobBlock    the coordinator's handle on one job's shared-memory block:
//               create/open, write cap/share/commands, read the job's report.
//   JobChannel  the job side: the C++ polling thread, wired either to a
//               CachingAllocator (pure C++, no GIL) or to Python callables.
//
// Python never sees offsets: every field goes through job_block.h.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>

#include "cotenant/caching_allocator.h"
#include "cotenant/errors.h"
#include "cotenant/job_channel.h"
#include "cotenant/job_process.h"
#include "cotenant/shm/job_block.h"
#include "cotenant/shm/shm_region.h"
#include "registry.h"

namespace py = pybind11;

namespace cotenant::bindings {
namespace {

using shm::JobBlock;
using shm::JobCommand;
using shm::JobControl;
using shm::JobIdentity;
using shm::JobReport;
using shm::JobRole;
using shm::JobState;
using shm::ShmRegion;

// None <-> no cap, as everywhere in the Python API (Cap's word form inside).
py::object cap_to_python(std::uint64_t cap) {
  return cap == kNoCap ? py::none() : py::object(py::int_(cap));
}
std::uint64_t cap_from_python(const py::object& cap) {
  if (cap.is_none()) return kNoCap;
  if (py::isinstance<py::bool_>(cap) || !py::isinstance<py::int_>(cap)) {
    throw Error("a memory cap in the job block must be an int of bytes or None (resolve fractions and size "
                "strings with cotenant._core.Cap first), not " +
                std::string(py::str(py::type::of(cap).attr("__name__"))));
  }
  auto value = cap.cast<long long>();
  return Cap::of_bytes(value <= 0 ? 0 : static_cast<std::uint64_t>(value)).to_word();
}
double share_from_python(double share) {
  if (!std::isfinite(share) || share < 0.0 || share > 1.0) {
    throw Error("a compute share must be a number from 0 (paused) to 1 (unthrottled), not " +
                std::to_string(share));
  }
  return share;
}

JobCommand command_from_name(const std::string& name) {
  for (auto command : {JobCommand::kSpillAll, JobCommand::kRestoreAll, JobCommand::kSuspend, JobCommand::kResume}) {
    if (name == shm::job_command_name(command)) return command;
  }
  throw Error("'" + name + "' is not a job command: use spill_all, restore_all, suspend or resume");
}

// One field to Python: caps and the host room as int-or-None, enums by name.
py::object field_to_python(const char* name, std::uint64_t value) {
  const std::string_view field(name);
  if (field.find("memory_cap") != std::string_view::npos || field == "host_room_bytes") return cap_to_python(value);
  return py::int_(value);
}
py::object field_to_python(const char*, std::uint32_t value) { return py::int_(value); }
py::object field_to_python(const char*, double value) { return py::float_(value); }
py::object field_to_python(const char*, JobRole value) { return py::str(shm::job_role_name(value)); }
py::object field_to_python(const char*, JobState value) { return py::str(shm::job_state_name(value)); }
py::object field_to_python(const char*, JobCommand value) { return py::str(shm::job_command_name(value)); }

template <typename Record>
py::dict record_dict(const Record& record) {
  py::dict d;
  shm::for_each_field(record, [&d](const char* name, const auto& value) { d[name] = field_to_python(name, value); });
  return d;
}

py::dict identity_dict(const JobIdentity& identity) {
  py::dict d;
  d["job_id"] = identity.job_id;
  d["name"] = identity.name;
  d["role"] = shm::job_role_name(identity.role);
  d["device"] = identity.device;
  d["gpu_uuid"] = identity.gpu_uuid;
  d["pid"] = identity.pid;
  d["pid_start_ticks"] = identity.pid_start_ticks;
  d["uid"] = identity.uid;
  d["created_ns"] = identity.created_ns;
  return d;
}

py::dict control_dict(const JobControl& control) { return record_dict(control); }
py::dict report_dict(const JobReport& report) { return record_dict(report); }

// The coordinator's handle on one block.
class PyJobBlock {
 public:
  PyJobBlock(ShmRegion region, const JobControl& control) : region_(std::move(region)), control_(control) {}

  static std::unique_ptr<PyJobBlock> create(const std::string& name, std::uint64_t job_id,
                                            const std::string& job_name, const std::string& role,
                                            std::uint32_t device, std::uint64_t pid, std::uint64_t uid,
                                            const py::object& memory_cap, double share, const std::string& gpu_uuid,
                                            std::uint64_t pid_start_ticks, std::uint64_t owner_token,
                                            double silence_limit_s) {
    if (job_name.size() >= shm::kJobNameBytes) {
      throw Error("a job name holds at most " + std::to_string(shm::kJobNameBytes - 1) + " bytes; '" + job_name +
                  "' has " + std::to_string(job_name.size()) + " (UTF-8)");
    }
    JobIdentity identity;
    identity.job_id = job_id;
    identity.name = job_name;
    identity.role = shm::parse_job_role(role);
    identity.device = device;
    identity.gpu_uuid = gpu_uuid;
    identity.pid = pid;
    identity.pid_start_ticks = pid_start_ticks;
    identity.uid = uid;
    identity.created_ns = static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
            .count());
    JobControl control;
    control.memory_cap = cap_from_python(memory_cap);
    control.share = share_from_python(share);
    auto block = std::make_unique<PyJobBlock>(ShmRegion::create(name, shm::kJobBlockBytes), control);
    shm::initialize_job_block(block->block(), identity, control, owner_token, silence_limit_ns(silence_limit_s));
    return block;
  }

  // The coordinator's heartbeat, with the silence after which the job runs
  // on its own (0: never).
  void beat(double silence_limit_s) {
    shm::CoordinatorHeartbeat heartbeat;
    heartbeat.heartbeat_ns = shm::monotonic_ns();
    heartbeat.silence_limit_ns = silence_limit_ns(silence_limit_s);
    if (!shm::try_write_coordinator_heartbeat(block(), heartbeat)) throw lost_pages();
  }
  static std::uint64_t silence_limit_ns(double seconds) {
    if (!std::isfinite(seconds) || seconds < 0) {
      throw Error("the silence after which a job runs on its own must be 0 (never) or a positive number of "
                  "seconds, not " + std::to_string(seconds));
    }
    return static_cast<std::uint64_t>(seconds * 1e9);
  }

  // Adopts an existing block. The control values are read once, here
  // (shm::control_to_resume; the caller rewrites cap and share from its own
  // state); from then on this handle owns them.
  static std::unique_ptr<PyJobBlock> open(const std::string& name) {
    ShmRegion region = ShmRegion::open(name, 0);
    auto handle = std::make_unique<PyJobBlock>(std::move(region), JobControl{});
    JobBlock copy;
    handle->copy(copy);  // checks the size before touching the block
    handle->control_ = shm::control_to_resume(copy);
    return handle;
  }

  // Every word of the block, checked, read where its job cannot shrink it
  // away under the reader (job_block.h, try_copy_job_block).
  void copy(JobBlock& copy) {
    if (region_.size() >= shm::kJobBlockBytes && !shm::try_copy_job_block(block(), copy)) throw lost_pages();
    shm::check_job_block(copy, region_.size());  // a short region fails on its size, before any read
  }

  JobBlock& block() {
    if (!region_.valid()) throw Error("the job block '" + name_ + "' was closed");
    return *static_cast<JobBlock*>(region_.data());
  }
  const std::string& name() {
    if (name_.empty()) name_ = region_.name();
    return name_;
  }
  const JobControl& control() const { return control_; }

  // The coordinator's writes: from its own copy, never from what is in the
  // block (which a job could have left mid-update).
  void set_control(const py::object& memory_cap, const py::object& share) {
    JobControl control = control_;
    if (!memory_cap.is(py::ellipsis())) control.memory_cap = cap_from_python(memory_cap);
    if (!share.is(py::ellipsis())) control.share = share_from_python(share.cast<double>());
    write(control);
  }

  std::uint64_t send_command(const std::string& name) {
    JobControl control = control_;
    control.command = command_from_name(name);
    ++control.command_sequence;
    write(control);
    return control.command_sequence;
  }

  void close() {
    name();
    region_ = ShmRegion();
  }
  bool unlink() {
    auto n = name();
    region_ = ShmRegion();
    return ShmRegion::unlink(n);
  }

 private:
  void write(const JobControl& control) {
    if (!shm::try_write_control(block(), control)) throw lost_pages();
    control_ = control;
  }
  Error lost_pages() {
    return Error("the job block '" + name() +
                 "' lost its pages: a process that may write it shrank it (ftruncate), so it can be neither "
                 "read nor written");
  }

  ShmRegion region_;
  JobControl control_;
  std::string name_;
};

// The job side. Owns the C++ channel; stops it with the GIL released so a
// Python hook waiting for the GIL cannot deadlock the stop.
class PyJobChannel {
 public:
  PyJobChannel(const std::string& block_name, std::unique_ptr<SimulatedJobProcess> process, JobChannelHooks hooks,
               std::uint64_t poll_interval_us, bool uses_python_hooks)
      : process_(std::move(process)), uses_python_hooks_(uses_python_hooks) {
    JobChannelOptions options;
    options.poll_interval = std::chrono::microseconds(poll_interval_us);
    channel_ = std::make_unique<JobChannel>(block_name, std::move(hooks), options);
  }
  ~PyJobChannel() { close(); }

  JobChannel& channel() {
    if (!channel_) throw Error("the job channel was closed; open a new one to talk to the coordinator");
    return *channel_;
  }
  void close() {
    if (!channel_) return;
    if (uses_python_hooks_ && PyGILState_Check()) {
      py::gil_scoped_release released;
      channel_->stop();
    } else {
      channel_->stop();
    }
    channel_.reset();  // destroys the hooks (Python objects) with the GIL held
  }
  SimulatedJobProcess& process() {
    if (!process_) throw Error("this job channel has no simulated job process (pass allocator=...)");
    return *process_;
  }

 private:
  std::unique_ptr<SimulatedJobProcess> process_;  // outlives channel_ (declared first)
  std::unique_ptr<JobChannel> channel_;
  bool uses_python_hooks_;
};

// Wraps an optional Python callable as a hook that takes the GIL to run.
template <typename... Args>
std::function<void(Args...)> python_hook(const py::object& callable) {
  if (callable.is_none()) return {};
  auto shared = std::make_shared<py::object>(callable);
  return [shared](Args... args) {
    py::gil_scoped_acquire gil;
    (*shared)(args...);
  };
}

// The suspend hook: a callable returning False means "did not take effect".
std::function<bool(bool)> python_suspend_hook(const py::object& callable) {
  if (callable.is_none()) return {};
  auto shared = std::make_shared<py::object>(callable);
  return [shared](bool suspended) {
    py::gil_scoped_acquire gil;
    py::object result = (*shared)(suspended);
    return result.is_none() || result.cast<bool>();
  };
}

}  // namespace

COTENANT_CORE_BINDINGS(job_channel) {
  m.attr("JOB_BLOCK_VERSION") = shm::kJobBlockVersion;
  m.attr("JOB_BLOCK_BYTES") = shm::kJobBlockBytes;
  m.def("monotonic_ns", &shm::monotonic_ns, "CLOCK_MONOTONIC in nanoseconds: the heartbeat clock.");
  m.def("shm_exists", [](const std::string& name) { return ShmRegion::exists(name); }, py::arg("name"));
  m.def("shm_unlink", [](const std::string& name) { return ShmRegion::unlink(name); }, py::arg("name"),
        "Removes a shared-memory name; False if it did not exist.");

  py::class_<PyJobBlock>(m, "JobBlock",
                         "The coordinator's handle on one job's shared-memory block (cap, share, commands "
                         "out; the job's report in).")
      .def_static("create", &PyJobBlock::create, py::arg("name"), py::kw_only(), py::arg("job_id"),
                  py::arg("job_name"), py::arg("role"), py::arg("device"), py::arg("pid"), py::arg("uid"),
                  py::arg("memory_cap") = py::none(), py::arg("share") = 1.0, py::arg("gpu_uuid") = "",
                  py::arg("pid_start_ticks") = 0, py::arg("owner_token") = 0,
                  py::arg("silence_limit_s") = static_cast<double>(shm::kDefaultCoordinatorSilenceLimitNs) / 1e9,
                  "Creates the block (refuses an existing name) with its identity and initial control. "
                  "silence_limit_s: how long the job waits on a silent coordinator before it runs on its own "
                  "(0: for good).")
      .def_static("open", &PyJobBlock::open, py::arg("name"),
                  "Opens an existing block; raises Error if it is not a block of this version.")
      .def_property_readonly("name", &PyJobBlock::name)
      .def("identity",
           [](PyJobBlock& self) {
             JobBlock copy;
             self.copy(copy);
             return identity_dict(shm::read_identity(copy));
           })
      .def("control", [](PyJobBlock& self) { return control_dict(self.control()); },
           "The control values this handle wrote (the coordinator's own copy).")
      .def("report", [](PyJobBlock& self) -> py::object {
             std::optional<JobReport> report = shm::try_read_report(self.block());
             if (!report) return py::none();
             return report_dict(*report);
           },
           "The job's report, or None while its writer is mid-update (never waits) or when the block lost its "
           "pages (its job shrank it).")
      .def("owner_token",
           [](PyJobBlock& self) {
             JobBlock copy;
             self.copy(copy);
             return shm::read_owner_token(copy);
           })
      .def("heartbeat_ns",
           [](PyJobBlock& self) {
             JobBlock copy;
             self.copy(copy);
             return shm::read_heartbeat_ns(copy);
           })
      .def("beat", &PyJobBlock::beat, py::arg("silence_limit_s"),
           "The coordinator's heartbeat (every tick), with how long the job may then wait on a silent "
           "coordinator before it runs on its own (0: for good).")
      .def("coordinator_heartbeat",
           [](PyJobBlock& self) {
             JobBlock copy;
             self.copy(copy);
             const shm::CoordinatorHeartbeat beat = shm::read_coordinator_heartbeat(copy);
             py::dict d;
             d["heartbeat_ns"] = beat.heartbeat_ns;
             d["silence_limit_ns"] = beat.silence_limit_ns;
             return d;
           })
      .def("set_control", &PyJobBlock::set_control, py::kw_only(), py::arg("memory_cap") = py::ellipsis(),
           py::arg("share") = py::ellipsis(),
           "Sets the cap (int bytes, None = no cap) and/or the share in [0, 1]; omitted ones stay.")
      .def("send_command", &PyJobBlock::send_command, py::arg("command"),
           "Queues spill_all, restore_all, suspend or resume; returns its sequence number.")
      .def("close", &PyJobBlock::close, "Unmaps the block; the name stays.")
      .def("unlink", &PyJobBlock::unlink, "Unmaps the block and removes its name.");

  py::class_<PyJobChannel>(m, "JobChannel",
                           "The job side of the data plane: a C++ thread that applies the coordinator's cap, "
                           "share and commands and publishes the job's numbers and a heartbeat.")
      .def(py::init([](const std::string& block_name, CachingAllocator* allocator, const py::object& on_cap,
                       const py::object& on_share, const py::object& on_spill_all,
                       const py::object& on_restore_all, const py::object& on_suspend,
                       std::uint64_t poll_interval_us) {
             JobChannelHooks hooks;
             std::unique_ptr<SimulatedJobProcess> process;
             if (allocator != nullptr) {
               process = std::make_unique<SimulatedJobProcess>(*allocator);
               hooks = job_channel_hooks(*process);
             }
             bool python_hooks = false;
             auto take = [&python_hooks](auto& slot, auto hook) {
               if (hook) {
                 slot = std::move(hook);
                 python_hooks = true;
               }
             };
             take(hooks.set_memory_cap, python_hook<std::uint64_t>(on_cap));
             take(hooks.set_share, python_hook<double>(on_share));
             take(hooks.spill_all, python_hook<>(on_spill_all));
             take(hooks.restore_all, python_hook<>(on_restore_all));
             take(hooks.set_suspended, python_suspend_hook(on_suspend));
             return std::make_unique<PyJobChannel>(block_name, std::move(process), std::move(hooks), poll_interval_us,
                                                   python_hooks);
           }),
           // The channel's hooks hold the allocator: keep it alive as long.
           py::keep_alive<1, 3>(), py::arg("block_name"), py::kw_only(), py::arg("allocator") = nullptr,
           py::arg("on_cap") = py::none(), py::arg("on_share") = py::none(), py::arg("on_spill_all") = py::none(),
           py::arg("on_restore_all") = py::none(), py::arg("on_suspend") = py::none(),
           py::arg("poll_interval_us") = 2000,
           "allocator: a CachingAllocator the channel drives through a SimulatedJobProcess (the same command "
           "code a real job runs; migrations apply at once, as on the simulated device). on_*: Python callables "
           "run with the GIL (they override those hooks; on_suspend may return False for 'not yet').")
      .def("start", [](PyJobChannel& self) { self.channel().start(); })
      .def("stop",
           [](PyJobChannel& self) {
             py::gil_scoped_release released;
             self.channel().stop();
           })
      .def("close", &PyJobChannel::close, "Stops the thread and reports the job as exited.")
      .def("poll_once",
           [](PyJobChannel& self) {
             py::gil_scoped_release released;
             return self.channel().poll_once();
           },
           "One apply + publish round on this thread; True if anything was applied.")
      .def("iteration_boundary", [](PyJobChannel& self) { self.process().iteration_tracker().boundary(); },
           "The simulated job ends one iteration (its IterationTracker measures it).")
      .def("record_iteration_ns", [](PyJobChannel& self, std::int64_t ns) { self.process().iteration_tracker().record(ns); },
           py::arg("ns"), "The simulated job ran one iteration that took `ns` nanoseconds.")
      .def("set_user_share", [](PyJobChannel& self, double share) { self.process().set_user_share(share); },
           py::arg("share"), "The simulated job's own share (the coordinator's caps it).")
      .def_property_readonly("launches_paused", [](PyJobChannel& self) { return self.process().launches_paused(); })
      .def_property_readonly("running", [](PyJobChannel& self) { return self.channel().running(); })
      .def_property_readonly("coordinator_lost", [](PyJobChannel& self) { return self.channel().coordinator_lost(); },
                             "Whether the coordinator's heartbeat went silent past its limit: the job runs on its own.")
      .def_property_readonly("block_name", [](PyJobChannel& self) { return self.channel().block_name(); })
      .def("identity", [](PyJobChannel& self) { return identity_dict(self.channel().identity()); })
      .def("control", [](PyJobChannel& self) { return control_dict(self.channel().control()); })
      .def("report", [](PyJobChannel& self) { return report_dict(self.channel().report()); })
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyJobChannel& self, py::args) { self.close(); });
}

}  // namespace cotenant::bindings
