// cotenant._C: the torch extension. Each concern adds its own functions
// through COTENANT_TORCH_BINDINGS (registry.h); this file only runs them.
#include <pybind11/pybind11.h>

#include "registry.h"

namespace cotenant::torch_ext {

std::map<std::string, TorchBinder>& torch_binders() {
  static std::map<std::string, TorchBinder> binders;
  return binders;
}

}  // namespace cotenant::torch_ext

PYBIND11_MODULE(_C, m) {
  m.doc() = "cotenant's torch extension: the CUDA allocator, safe points and launch-gate hooks";
  for (auto& [name, bind] : cotenant::torch_ext::torch_binders()) bind(m);
}
