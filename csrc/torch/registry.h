// Each concern binds itself into cotenant._C (the torch extension) from its
// own file:
//
//   COTENANT_TORCH_BINDINGS(allocator) { m.def(...); }
//
// module.cpp runs every registered binder in name order when Python imports
// the module, so no file has to know the list of the others. This mirrors
// csrc/bindings/registry.h (cotenant._core) but is a separate registry: _C
// and _core are separate shared objects.
#pragma once

#include <pybind11/pybind11.h>

#include <functional>
#include <map>
#include <string>

namespace cotenant::torch_ext {

using TorchBinder = std::function<void(pybind11::module_&)>;
std::map<std::string, TorchBinder>& torch_binders();

struct TorchBinderRegistration {
  TorchBinderRegistration(const char* name, TorchBinder binder) {
    torch_binders().emplace(name, std::move(binder));
  }
};

}  // namespace cotenant::torch_ext

#define COTENANT_TORCH_BINDINGS(name)                                             \
  static void cotenant_torch_bind_##name(pybind11::module_& m);                   \
  static ::cotenant::torch_ext::TorchBinderRegistration cotenant_torch_binder_##name( \
      #name, &cotenant_torch_bind_##name);                                        \
  static void cotenant_torch_bind_##name(pybind11::module_& m)
