// cotenant._core: the allocator core, on the simulated device, for Python.
#include "registry.h"

namespace cotenant::bindings {

std::map<std::string, Binder>& binders() {
  static std::map<std::string, Binder> all;  // function-local: safe from any initializer
  return all;
}

}  // namespace cotenant::bindings

PYBIND11_MODULE(_core, m) {
  m.doc() = "cotenant's allocator core, page table, cap and gate logic (no CUDA, no torch).";
  for (auto& [name, bind] : cotenant::bindings::binders()) bind(m);
}
