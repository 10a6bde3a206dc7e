// cotenant._core: named regions (include/cotenant/region_table.h) on a
// SimulatedBackend, so Python tests drive pause and resume without a GPU.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "cotenant/caching_allocator.h"
#include "cotenant/errors.h"
#include "cotenant/region_table.h"
#include "cotenant/simulated_backend.h"
#include "registry.h"

namespace py = pybind11;

namespace cotenant::bindings {

COTENANT_CORE_BINDINGS(regions) {
  m.def("region_enter", &RegionScope::enter, py::arg("name"),
        "The calling thread's allocations from a RegionTable go to region `name` until region_exit(name).");
  m.def("region_exit", &RegionScope::exit, py::arg("name"));
  m.def("current_region", []() { return RegionScope::current(); },
        "The calling thread's region, or \"\" outside every region.");

  py::class_<RegionTable>(m, "RegionTable", "Named regions of one simulated device, each with its own allocator.")
      .def(py::init([](SimulatedBackend& backend) { return std::make_unique<RegionTable>(backend); }),
           py::keep_alive<1, 2>(), py::arg("backend"))
      .def(
          "allocate",
          [](RegionTable& self, std::size_t size, StreamId stream) {
            CachingAllocator* allocator = nullptr;
            return self.allocate(size, stream, &allocator);
          },
          py::arg("size"), py::arg("stream") = 0, "Allocates in the calling thread's region; returns the address.")
      .def("pause", &RegionTable::pause, py::arg("name"), py::kw_only(), py::arg("keep"))
      .def("resume", &RegionTable::resume, py::arg("name"))
      .def("set_graph_capture", &RegionTable::set_graph_capture, py::arg("capturing"))
      .def("contains", &RegionTable::contains, py::arg("name"))
      .def("state", [](const RegionTable& self, const std::string& name) { return region_state_name(self.state(name)); },
           py::arg("name"))
      .def(
          "allocator",
          [](RegionTable& self, const std::string& name) -> CachingAllocator& {
            self.state(name);  // throws for an unknown name
            for (auto& [region, allocator] : self.allocators()) {
              if (region == name) return *allocator;
            }
            throw Error("no region named '" + name + "'");
          },
          py::arg("name"), py::return_value_policy::reference_internal,
          "The region's own allocator (free, snapshot, stats), owned by the table.");
}

}  // namespace cotenant::bindings
