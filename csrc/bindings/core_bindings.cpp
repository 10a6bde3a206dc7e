// cotenant._core: sizes, errors, the simulated device, the caching allocator
// and the trace replay engine, for Python.
//
// Sizes are accepted as an int (bytes) or a string ("6GiB") everywhere, and go
// through cotenant::parse_size, the one parser. A cap of None means no cap.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cotenant/cap.h"
#include "cotenant/caching_allocator.h"
#include "cotenant/errors.h"
#include "cotenant/host_memory.h"
#include "cotenant/replay.h"
#include "cotenant/simulated_backend.h"
#include "cotenant/size.h"
#include "cotenant/stats.h"
#include "registry.h"

namespace py = pybind11;

namespace cotenant::bindings {
namespace {

// Python exception types, created once when the module is imported. They live
// as long as the interpreter (the module holds a reference too).
PyObject* g_error = nullptr;           // cotenant._core.Error(ValueError)
PyObject* g_out_of_memory = nullptr;   // cotenant._core.OutOfMemoryError(MemoryError)
PyObject* g_replay_error = nullptr;    // cotenant._core.ReplayError(Error)

PyObject* new_exception_type(py::module_& m, const char* name, PyObject* base, const char* doc) {
  const std::string qualified = std::string("cotenant._core.") + name;
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, base, nullptr);
  if (type == nullptr) throw py::error_already_set();
  m.attr(name) = py::handle(type);  // the module takes its own reference
  return type;
}

void translate_core_exceptions(std::exception_ptr thrown) {
  try {
    if (thrown) std::rethrow_exception(thrown);
  } catch (const ReplayError& error) {
    py::object instance = py::reinterpret_steal<py::object>(
        PyObject_CallFunction(g_replay_error, "s", error.what()));
    if (!instance) return;  // the constructor's own Python error stays set
    instance.attr("op_index") = py::int_(error.op_index());
    instance.attr("reason") = py::str(error.reason());
    PyErr_SetObject(g_replay_error, instance.ptr());
  } catch (const OutOfMemoryError& error) {
    PyErr_SetString(g_out_of_memory, error.what());
  } catch (const Error& error) {
    PyErr_SetString(g_error, error.what());
  }
}

// An int of bytes or a size string; refuses negatives and other types.
std::uint64_t size_argument(const py::handle& value, const char* what) {
  if (py::isinstance<py::bool_>(value)) {
    throw Error(std::string(what) + " must be a size in bytes (an int or a string like \"6GiB\"), not a bool");
  }
  if (py::isinstance<py::int_>(value)) {
    const py::int_ number = py::reinterpret_borrow<py::int_>(value);
    if (number < py::int_(0)) {
      throw Error(std::string(what) + " cannot be negative (got " + std::string(py::str(value)) + " bytes)");
    }
    return number.cast<std::uint64_t>();
  }
  if (py::isinstance<py::str>(value)) return parse_size(value.cast<std::string>());
  throw Error(std::string(what) + " must be a size in bytes (an int or a string like \"6GiB\"), not " +
              std::string(py::str(py::type::of(value).attr("__name__"))));
}

// Any cap a Python caller may give, through the one parser: None, a Cap, an
// int of bytes, a float fraction of the device in (0, 1], or a string
// ("6GiB", "0.5", "50%", "none").
Cap cap_from_python(const py::handle& value) {
  if (value.is_none()) return Cap::none();
  if (py::isinstance<Cap>(value)) return value.cast<Cap>();
  if (py::isinstance<py::bool_>(value)) {
    throw Error("a memory cap must be a size, a fraction of the device or None, not a bool");
  }
  if (py::isinstance<py::int_>(value)) {
    const py::int_ number = py::reinterpret_borrow<py::int_>(value);
    if (number < py::int_(0)) {
      throw Error("a memory cap cannot be negative (got " + std::string(py::str(value)) +
                  " bytes); give a positive size such as \"6GiB\", or None for no cap");
    }
    return Cap::of_bytes(number.cast<std::uint64_t>());
  }
  if (py::isinstance<py::float_>(value)) return Cap::of_fraction(value.cast<double>());
  if (py::isinstance<py::str>(value)) return Cap::parse(value.cast<std::string>());
  throw Error("a memory cap must be bytes (int), a size string such as \"6GiB\", a fraction of the device such "
              "as 0.5, or None; got " + std::string(py::str(py::type::of(value).attr("__name__"))));
}

// A cap as the allocator takes it (a word), resolved on a device of `total` bytes.
std::uint64_t cap_argument(const py::handle& value, std::uint64_t device_total_bytes = 0) {
  return cap_from_python(value).to_word(device_total_bytes);
}

py::object cap_value(std::uint64_t bytes) {
  if (bytes == kNoCap) return py::none();
  return py::int_(bytes);
}

SimulatedDeviceConfig device_config(const py::object& device_capacity, const py::object& granularity,
                                    const py::object& host_capacity, bool host_pages_mappable,
                                    bool events_complete_immediately, bool fresh_pages_hold_garbage) {
  SimulatedDeviceConfig config;
  config.fresh_pages_hold_garbage = fresh_pages_hold_garbage;
  config.device_capacity = size_argument(device_capacity, "device_capacity");
  config.granularity = size_argument(granularity, "granularity");
  config.host_capacity = size_argument(host_capacity, "host_capacity");
  config.host_pages_mappable = host_pages_mappable;
  config.events_complete_immediately = events_complete_immediately;
  if (!is_page_size(config.granularity)) {
    throw Error("granularity must be a power of two number of bytes, e.g. \"2MiB\" (got " +
                std::to_string(config.granularity) + ")");
  }
  return config;
}

py::dict call_counts(const SimulatedCallCounts& c) {
  py::dict d;
  d["reserve"] = c.reserve; d["release"] = c.release;
  d["create_page"] = c.create_page; d["release_page"] = c.release_page;
  d["map"] = c.map; d["unmap"] = c.unmap; d["copy_into"] = c.copy_into; d["copy_out"] = c.copy_out; d["zero"] = c.zero;
  d["failed_create_page"] = c.failed_create_page;
  d["allocate_pinned_host"] = c.allocate_pinned_host; d["free_pinned_host"] = c.free_pinned_host;
  d["record_event"] = c.record_event; d["synchronize_device"] = c.synchronize_device;
  return d;
}

const char* pool_name(PoolKind pool) { return pool == PoolKind::kSmall ? "small_pool" : "large_pool"; }

py::list snapshot_list(const std::vector<SegmentInfo>& segments) {
  py::list out;
  for (const auto& segment : segments) {
    py::dict s;
    s["address"] = segment.address;
    s["total_size"] = segment.size;
    s["stream"] = segment.stream;
    s["segment_type"] = pool_name(segment.pool);
    s["pinned_fallback"] = segment.pinned_fallback;
    s["device_bytes"] = segment.device_bytes;
    s["host_bytes"] = segment.host_bytes;
    py::list blocks;
    for (const auto& block : segment.blocks) {
      py::dict b;
      b["address"] = block.address;
      b["size"] = block.size;
      b["requested_size"] = block.requested_size;
      b["state"] = block.allocated ? "active_allocated"
                   : block.waiting_on_events ? "active_pending_free" : "inactive";
      blocks.append(b);
    }
    s["blocks"] = blocks;
    out.append(s);
  }
  return out;
}

AllocatorOptions allocator_options(const py::object& round_bytes, const py::object& small_request_max,
                                   const py::object& arena_bytes, bool spill_to_host,
                                   bool spill_without_cap) {
  AllocatorOptions options;
  options.round_bytes = size_argument(round_bytes, "round_bytes");
  options.small_request_max = size_argument(small_request_max, "small_request_max");
  options.arena_bytes = arena_bytes.is_none() ? 0 : size_argument(arena_bytes, "arena_bytes");
  options.spill_to_host = spill_to_host;
  options.spill_without_cap = spill_without_cap;
  return options;
}

// One Python op tuple -> ReplayOp: ("alloc", id, size[, stream]), ("free", id),
// ("record_stream", id, stream), ("cap", size or None), ("empty_cache",).
ReplayOp replay_op(const py::handle& item, std::size_t index) {
  auto bad = [&](const std::string& why) {
    return ReplayError(index, why + "; ops are tuples: (\"alloc\", id, size[, stream]), (\"free\", id), "
                              "(\"record_stream\", id, stream), (\"cap\", size or None), (\"empty_cache\",), "
                              "(\"iteration\",)");
  };
  if (!py::isinstance<py::tuple>(item) && !py::isinstance<py::list>(item)) throw bad("an op is not a tuple");
  const py::sequence op = py::reinterpret_borrow<py::sequence>(item);
  const std::size_t n = op.size();
  if (n == 0 || !py::isinstance<py::str>(op[0])) throw bad("an op must start with its kind as a string");
  const std::string kind = op[0].cast<std::string>();
  auto id_at = [&](std::size_t i) {
    const py::object value = op[i];
    if (!py::isinstance<py::int_>(value) || value.cast<py::int_>() < py::int_(0)) {
      throw bad("an id must be a non-negative int");
    }
    return value.cast<std::uint64_t>();
  };
  if (kind == "alloc" && (n == 3 || n == 4)) {
    return ReplayOp::alloc(id_at(1), size_argument(op[2], "an alloc size"), n == 4 ? id_at(3) : 0);
  }
  if (kind == "free" && n == 2) return ReplayOp::free(id_at(1));
  if (kind == "record_stream" && n == 3) return ReplayOp::record_stream(id_at(1), id_at(2));
  if (kind == "cap" && n == 2) {
    const py::object value = op[1];
    if (value.is_none()) return ReplayOp::cap(kNoCap);
    return ReplayOp::cap(size_argument(value, "a cap"));  // 0 is refused by replay() with the op index
  }
  if (kind == "empty_cache" && n == 1) return ReplayOp::empty_cache();
  if (kind == "iteration" && n == 1) return ReplayOp::iteration();
  throw bad("unknown op (\"" + kind + "\" with " + std::to_string(n - 1) + " arguments)");
}

// A trace's ops (tuples, see cotenant.replay), each converted by replay_op.
std::vector<ReplayOp> replay_ops(const py::iterable& ops) {
  std::vector<ReplayOp> converted;
  if (py::hasattr(ops, "__len__")) converted.reserve(py::len(ops));
  for (const py::handle item : ops) converted.push_back(replay_op(item, converted.size()));
  return converted;
}

py::dict result_dict(const ReplayResult& r) {
  py::dict d;
  d["num_ops"] = r.num_ops;
  d["num_allocs"] = r.num_allocs;
  d["num_frees"] = r.num_frees;
  d["num_ooms"] = r.num_ooms;
  d["peak_allocated_bytes"] = r.peak_allocated_bytes;
  d["peak_requested_bytes"] = r.peak_requested_bytes;
  d["peak_reserved_bytes"] = r.peak_reserved_bytes;
  d["peak_device_resident_bytes"] = r.peak_device_resident_bytes;
  d["fragmentation"] = r.fragmentation;
  d["spilled_bytes"] = r.spilled_bytes;
  d["restored_bytes"] = r.restored_bytes;
  d["num_migrations"] = r.num_migrations;
  d["num_spilled_allocations"] = r.num_spilled_allocations;
  d["alloc_ns_total"] = r.alloc_ns_total;
  d["free_ns_total"] = r.free_ns_total;
  d["ns_per_alloc"] = r.ns_per_alloc;
  d["ns_per_free"] = r.ns_per_free;
  d["num_page_maps"] = r.num_page_maps;
  d["num_page_unmaps"] = r.num_page_unmaps;
  d["maps_per_peak_page"] = r.maps_per_peak_page;
  d["num_iterations"] = r.maps_per_iteration.size();
  d["maps_per_iteration"] = r.maps_per_iteration;
  d["host_touched_bytes_per_iteration"] = r.host_touched_bytes_per_iteration;
  d["host_live_bytes_per_iteration"] = r.host_live_bytes_per_iteration;
  d["host_live_floor_bytes_per_iteration"] = r.host_live_floor_bytes_per_iteration;
  d["moved_bytes_per_iteration"] = r.moved_bytes_per_iteration;
  d["safe_points_per_iteration"] = r.safe_points_per_iteration;
  d["num_safe_points"] = r.num_safe_points;
  auto or_none = [](double value) { return value < 0 ? py::object(py::none()) : py::object(py::float_(value)); };
  d["steady_maps_per_iteration"] = or_none(r.steady_maps_per_iteration);
  d["steady_host_touched_bytes_per_iteration"] = or_none(r.steady_host_touched_bytes_per_iteration);
  d["steady_host_live_bytes"] = or_none(r.steady_host_live_bytes);
  d["steady_host_live_floor_bytes"] = or_none(r.steady_host_live_floor_bytes);
  d["steady_moved_bytes_per_iteration"] = or_none(r.steady_moved_bytes_per_iteration);
  d["steady_safe_points_per_iteration"] = or_none(r.steady_safe_points_per_iteration);
  d["at_peak_live_bytes"] = r.at_peak_live_bytes;
  d["at_peak_partial_page_free_bytes"] = r.at_peak_partial_page_free_bytes;
  d["at_peak_free_page_bytes"] = r.at_peak_free_page_bytes;
  d["at_peak_request_bytes"] = r.at_peak_request_bytes;
  d["at_peak_largest_hole_bytes"] = r.at_peak_largest_hole_bytes;
  d["fragmentation_floor"] = r.fragmentation_floor;
  d["final_stats"] = r.final_stats.as_map();
  return d;
}

}  // namespace
}  // namespace cotenant::bindings

COTENANT_CORE_BINDINGS(core) {
  using namespace cotenant;
  using namespace cotenant::bindings;

  g_error = new_exception_type(m, "Error", PyExc_ValueError,
                               "cotenant refused an input or a use of its API; the message says what to do.");
  g_out_of_memory = new_exception_type(
      m, "OutOfMemoryError", PyExc_MemoryError,
      "Neither device memory under the cap nor host memory could hold an allocation.");
  g_replay_error = new_exception_type(
      m, "ReplayError", g_error,
      "A trace operation makes no sense for the trace so far; .op_index is its 0-based position.");
  py::register_exception_translator(&translate_core_exceptions);

  py::class_<Cap>(m, "Cap",
                  "A memory cap: bytes, a fraction of the device, or none. Cap(value) reads None, an int of "
                  "bytes, a float fraction in (0, 1], or a string (\"6GiB\", \"0.5\", \"50%\", \"none\"); the "
                  "one parser for caps everywhere (API, CLI, environment, coordinator).")
      .def(py::init([](const py::object& value) { return cap_from_python(value); }), py::arg("value") = py::none())
      .def_property_readonly("is_none", &Cap::is_none)
      .def_property_readonly("is_fraction", &Cap::is_fraction)
      .def_property_readonly("bytes", [](const Cap& cap) -> py::object {
        if (auto bytes = cap.bytes()) return py::int_(*bytes);
        return py::none();
      }, "The cap in bytes for a byte cap; None for a fraction or no cap.")
      .def_property_readonly("fraction", [](const Cap& cap) -> py::object {
        if (cap.is_fraction()) return py::float_(cap.fraction());
        return py::none();
      })
      .def("resolve", [](const Cap& cap, std::uint64_t device_total_bytes) -> py::object {
        if (auto bytes = cap.resolve(device_total_bytes)) return py::int_(*bytes);
        return py::none();
      }, py::arg("device_total_bytes") = 0,
      "Bytes on a device of this size, or None for no cap (a fraction of 1 is no cap). A fraction needs the size.")
      .def_property_readonly("text", &Cap::to_text, "Exact text that Cap() reads back (for the environment).")
      .def("__str__", &Cap::to_string)
      .def("__repr__", [](const Cap& cap) { return "Cap('" + cap.to_text() + "')"; })
      .def("__eq__", [](const Cap& a, const py::object& b) { return py::isinstance<Cap>(b) && a == b.cast<Cap>(); })
      .def("__hash__", [](const Cap& cap) { return std::hash<std::string>()(cap.to_text()); });

  m.def("parse_size", [](const std::string& text) { return parse_size(text); }, py::arg("text"),
        "Bytes in a size like \"6GiB\", \"512MiB\", \"1.5GB\" or \"4096\"; raises Error otherwise.");
  m.def("format_size", [](std::uint64_t bytes) { return format_size(bytes); }, py::arg("bytes"),
        "A size for people: \"6.00 GiB\", \"4096 B\".");
  m.def(
      "cgroup_memory_rooms",
      [](const std::string& proc_cgroup, const std::string& cgroup_root) {
        std::vector<std::pair<std::string, std::size_t>> rooms;
        for (CgroupRoom& cgroup : read_cgroup_memory_rooms(proc_cgroup, cgroup_root, CgroupOf::another_process)) {
          rooms.emplace_back(std::move(cgroup.path), cgroup.room_bytes);
        }
        return rooms;
      },
      py::arg("proc_cgroup"), py::arg("cgroup_root") = "/sys/fs/cgroup",
      "[(path, room bytes)] for each memory cgroup with a limit on the way up from the process whose "
      "/proc/<pid>/cgroup is `proc_cgroup` to the root of the cgroup filesystem at `cgroup_root`, its own first: "
      "processes under one of them share its room (limit less working set). Empty where none has a limit or "
      "the mount does not show the process's cgroup.");

  py::class_<SimulatedBackend>(m, "SimulatedBackend",
                               "A simulated GPU: configurable capacity and page size, real bytes per page.")
      .def(py::init([](const py::object& device_capacity, const py::object& granularity,
                       const py::object& host_capacity, bool host_pages_mappable,
                       bool events_complete_immediately, bool fresh_pages_hold_garbage) {
             return std::make_unique<SimulatedBackend>(device_config(device_capacity, granularity, host_capacity,
                                                                     host_pages_mappable, events_complete_immediately,
                                                                     fresh_pages_hold_garbage));
           }),
           py::kw_only(), py::arg("device_capacity") = py::int_(std::uint64_t{16} << 30),
           py::arg("granularity") = py::int_(std::uint64_t{2} << 20),
           py::arg("host_capacity") = py::int_(std::uint64_t{1} << 40),
           py::arg("host_pages_mappable") = true, py::arg("events_complete_immediately") = true,
           py::arg("fresh_pages_hold_garbage") = false)
      .def_property_readonly("granularity", &SimulatedBackend::granularity)
      .def_property_readonly("device_total_bytes", &SimulatedBackend::device_total_bytes)
      .def_property_readonly("device_free_bytes", &SimulatedBackend::device_free_bytes)
      .def_property_readonly("host_pages_mappable", &SimulatedBackend::host_pages_mappable)
      .def("device_bytes_in_use", &SimulatedBackend::device_bytes_in_use)
      .def("host_bytes_in_use", &SimulatedBackend::host_bytes_in_use)
      .def("write",
           [](SimulatedBackend& self, std::uint64_t address, const py::bytes& data) {
             const std::string bytes = data;
             self.write(address, bytes.data(), bytes.size());
           },
           py::arg("address"), py::arg("data"), "Writes bytes at a device address (through its mapping).")
      .def("read",
           [](const SimulatedBackend& self, std::uint64_t address, std::size_t n) {
             std::string out(n, '\0');
             self.read(address, out.data(), n);
             return py::bytes(out);
           },
           py::arg("address"), py::arg("n"), "Reads n bytes at a device address.")
      .def("complete_stream", &SimulatedBackend::complete_stream, py::arg("stream"),
           "Completes every event recorded so far on the stream.")
      .def("synchronize_device", &SimulatedBackend::synchronize_device)
      .def("residency_at",
           [](const SimulatedBackend& self, std::uint64_t address) {
             return std::string(residency_name(self.residency_at(address)));
           },
           py::arg("address"), "\"device\" or \"host\": where the page mapped at the address lives.")
      .def("fail_next_device_pages", &SimulatedBackend::fail_next_device_pages, py::arg("count"))
      .def("calls", [](const SimulatedBackend& self) { return call_counts(self.calls()); });

  py::class_<CachingAllocator>(m, "CachingAllocator",
                               "The caching allocator with a movable device-memory cap, on a SimulatedBackend.")
      .def(py::init([](SimulatedBackend& backend, const py::object& round_bytes,
                       const py::object& small_request_max, const py::object& arena_bytes,
                       bool spill_to_host, bool spill_without_cap) {
             return std::make_unique<CachingAllocator>(
                 backend, allocator_options(round_bytes, small_request_max, arena_bytes, spill_to_host,
                                            spill_without_cap));
           }),
           // The allocator keeps a reference to the backend: keep it alive as long.
           py::keep_alive<1, 2>(), py::arg("backend"), py::kw_only(),
           py::arg("round_bytes") = py::int_(512), py::arg("small_request_max") = py::int_(1u << 20),
           py::arg("arena_bytes") = py::none(), py::arg("spill_to_host") = true,
           py::arg("spill_without_cap") = false)
      .def("allocate",
           [](CachingAllocator& self, const py::object& size, StreamId stream) {
             return self.allocate(size_argument(size, "an allocation size"), stream);
           },
           py::arg("size"), py::arg("stream") = 0, "Returns the device address (0 for a 0-byte request).")
      .def("free", &CachingAllocator::free, py::arg("address"))
      .def("record_stream", &CachingAllocator::record_stream, py::arg("address"), py::arg("stream"))
      .def("empty_cache", &CachingAllocator::empty_cache)
      .def("allocation_size", &CachingAllocator::allocation_size, py::arg("address"))
      .def("is_device_resident", &CachingAllocator::is_device_resident, py::arg("address"))
      .def("set_memory_cap",
           [](CachingAllocator& self, const py::object& cap) {
             self.set_memory_cap(cap_argument(cap, self.backend().device_total_bytes()));
           },
           py::arg("cap"), "Sets the device-resident bound (anything Cap() reads); None removes it.")
      .def("memory_cap", [](const CachingAllocator& self) { return cap_value(self.memory_cap()); },
           "The cap in bytes, or None when there is none.")
      .def("mark_iteration", &CachingAllocator::mark_iteration,
           "Marks the end of a step, as optimizer.step() and cotenant.iteration() do in a job.")
      .def("spill_all", &CachingAllocator::spill_all)
      .def("restore_all", &CachingAllocator::restore_all)
      .def("has_pending_migrations", &CachingAllocator::has_pending_migrations)
      .def("apply_pending_migrations", &CachingAllocator::apply_pending_migrations,
           py::call_guard<py::gil_scoped_release>(), "Moves marked pages; returns the bytes moved.")
      .def("mode", [](const CachingAllocator& self) { return std::string(spill_mode_name(self.mode())); })
      .def("stats", [](const CachingAllocator& self) { return self.stats().as_map(); },
           "Statistics under torch.cuda.memory_stats() key names, plus cotenant's residency figures.")
      .def("check_invariants", &CachingAllocator::check_invariants,
           "Recomputes the allocator's books from its blocks and pages; raises Error naming a broken invariant.")
      .def("reset_peak_stats", &CachingAllocator::reset_peak_stats)
      .def("reset_accumulated_stats", &CachingAllocator::reset_accumulated_stats)
      .def("snapshot", [](const CachingAllocator& self) { return snapshot_list(self.snapshot()); },
           "Segments and their blocks, in address order.");

  m.def(
      "replay",
      [](const py::iterable& ops, const py::object& device_capacity, const py::object& granularity,
         const py::object& host_capacity, bool host_pages_mappable, const py::object& cap, bool spill_to_host,
         bool spill_without_cap) {
        ReplayConfig config;
        config.device = device_config(device_capacity, granularity, host_capacity, host_pages_mappable, true, false);
        config.allocator.spill_to_host = spill_to_host;
        config.allocator.spill_without_cap = spill_without_cap;
        config.initial_cap = cap_argument(cap, config.device.device_capacity);
        const std::vector<ReplayOp> converted = replay_ops(ops);
        ReplayResult result;
        {
          py::gil_scoped_release released;  // a long trace runs without holding up other threads
          result = replay(converted, config);
        }
        return result_dict(result);
      },
      py::arg("ops"), py::kw_only(), py::arg("device_capacity") = py::int_(std::uint64_t{16} << 30),
      py::arg("granularity") = py::int_(std::uint64_t{2} << 20),
      py::arg("host_capacity") = py::int_(std::uint64_t{1} << 40), py::arg("host_pages_mappable") = true,
      py::arg("cap") = py::none(), py::arg("spill_to_host") = true, py::arg("spill_without_cap") = false,
      "Replays ops (tuples, see cotenant.replay) through a fresh allocator on a simulated device; "
      "returns peaks, fragmentation, spill traffic and ns per alloc/free. Raises ReplayError with "
      ".op_index at an op that makes no sense for the trace so far.");

  m.def(
      "time_ops",
      [](const py::iterable& ops, std::size_t first_timed) {
        const std::vector<ReplayOp> converted = replay_ops(ops);
        OpTiming timing;
        {
          py::gil_scoped_release released;
          timing = time_ops(converted, first_timed);
        }
        py::dict out;
        out["ns"] = timing.ns;
        out["cpu_ns"] = timing.cpu_ns;
        out["allocs"] = timing.allocs;
        out["frees"] = timing.frees;
        out["marks"] = timing.marks;
        out["num_page_maps"] = timing.num_page_maps;
        out["peak_reserved_bytes"] = timing.peak_reserved_bytes;
        return out;
      },
      py::arg("ops"), py::arg("first_timed") = 0,
      "Runs ops (replay's tuples) through a fresh allocator on the simulated 16 GiB device, "
      "back to back, the first first_timed untimed; returns the wall ns and the thread's CPU ns of the "
      "rest, timed as one (no per-call clock reads), with the allocations, frees and iteration marks among them.");
}
