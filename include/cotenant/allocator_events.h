// AllocatorEvent: what a CachingAllocator did, as it happens, for whoever
// keeps a history of it (MemoryHistory, memory_history.h).
//
// Contract:
//  - The allocator calls its sink (CachingAllocator::set_event_sink) with its
//    own lock held, on the thread that caused the event, in the order the
//    events happen. A sink must be quick and must not call back into the
//    allocator (that deadlocks).
//  - With no sink set, emitting an event is one pointer test.
//  - Sizes are bytes. A page event covers one page (the backend's
//    granularity) at `address`.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cotenant/backend.h"

namespace cotenant {

struct AllocatorEvent {
  enum class Kind : std::uint8_t {
    kAlloc,            // a block handed out; bytes = the bytes requested
    kFreeRequested,    // free() called; bytes = the bytes requested at allocation
    kFreeCompleted,    // the block is reusable (at once, or once its record_stream events completed)
    kPageMapped,       // a page mapped at `address`, on `where`
    kPageUnmapped,     // a page at `address` released from `where` (cache release)
    kPageMoved,        // a page at `address` moved to `where` at a safe point, keeping its address
    kSegmentAllocated, // a pinned fallback segment (host memory) allocated
    kSegmentFreed,     // a pinned fallback segment given back
    kOutOfMemory,      // the allocation of `bytes` failed; device_free_bytes as the backend reports
  };
  Kind kind = Kind::kAlloc;
  DevicePtr address = 0;
  std::size_t bytes = 0;
  StreamId stream = 0;                  // the segment's stream (the request's for kOutOfMemory)
  Residency where = Residency::kDevice; // page events: the residency mapped, released or moved to
  std::size_t device_free_bytes = 0;    // kOutOfMemory only
};

class AllocatorEventSink {
 public:
  virtual ~AllocatorEventSink() = default;
  virtual void on_event(const AllocatorEvent& event) = 0;
};

}  // namespace cotenant
