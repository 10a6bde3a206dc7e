// access_guarded: touching a shared mapping that another process may shrink.
//
// A process that can write a shared-memory object can also ftruncate() it.
// Every page of a MAP_SHARED mapping beyond the object's new end then raises
// SIGBUS in whoever touches it, which kills the process. The coordinator maps
// one block per job, and each job may write its own block (it owns it under a
// root coordinator), so one job could kill the coordinator of every job on
// the node. access_guarded() runs the coordinator's accesses to a block so
// that such a fault ends the access, not the process.
//
// Model: a SIGBUS handler (installed at the first call, and again whenever
// something replaced it, e.g. Python's faulthandler) checks whether the
// faulting thread is inside access_guarded() and the address lies in the
// guarded range; if so it jumps back out of the access, which then returns
// false. Any other SIGBUS goes to the handler that was there before (or the
// default action: the process dies as it would have).
//
// The access is abandoned at the faulting instruction: it may only load and
// store words of the mapping and plain (trivially destructible) locals; it
// must not allocate, take locks or build objects with destructors.
//
// Thread-safe: each thread has its own guard; guards do not nest.
#pragma once

#include <cstddef>
#include <memory>
#include <type_traits>

namespace cotenant::shm {

// Runs access(context). Returns false if it touched a page of
// [base, base + bytes) that the shared-memory object no longer backs.
bool access_guarded(const void* base, std::size_t bytes, void (*access)(void*), void* context);

template <typename Access>
bool access_guarded(const void* base, std::size_t bytes, Access&& access) {
  using Callable = std::remove_reference_t<Access>;
  return access_guarded(
      base, bytes, [](void* context) { (*static_cast<Callable*>(context))(); },
      const_cast<void*>(static_cast<const void*>(std::addressof(access))));
}

}  // namespace cotenant::shm
