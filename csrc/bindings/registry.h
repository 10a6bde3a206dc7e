// Each concern binds itself into cotenant._core from its own file:
//
//   COTENANT_CORE_BINDINGS(allocator) { m.def(...); }
//
// module.cpp runs every registered binder in name order when Python imports
// the module, so no file has to know the list of the others.
#pragma once

#include <pybind11/pybind11.h>

#include <functional>
#include <map>
#include <string>

namespace cotenant::bindings {

using Binder = std::function<void(pybind11::module_&)>;
std::map<std::string, Binder>& binders();

struct BinderRegistration {
  BinderRegistration(const char* name, Binder binder) { binders().emplace(name, std::move(binder)); }
};

}  // namespace cotenant::bindings

#define COTENANT_CORE_BINDINGS(name)                                               \
  static void cotenant_bind_##name(pybind11::module_& m);                          \
  static ::cotenant::bindings::BinderRegistration cotenant_binder_##name(          \
      #name, &cotenant_bind_##name);                                               \
  static void cotenant_bind_##name(pybind11::module_& m)
