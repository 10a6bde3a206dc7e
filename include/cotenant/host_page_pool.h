// Pinned host pages kept for reuse. Pinning host memory costs more than
// copying it over PCIe, so a host page that a spill, a restore or a region's
// resume gives up serves the next page the host needs instead of going back
// to the driver. One pool per device, shared by every allocator of the
// device (the capped one, the CUDA-graph pools', the named regions'): a host
// reserve pinned once serves a squeeze of the job and a pause of a region
// alike. An allocator made without one gets a pool of its own.
//
// Model:
//  - take_or_pin() hands out a kept page, or pins one through the backend
//    when none is kept (an empty handle when the host cannot, or may not).
//  - give(page) takes back a host page nothing maps: kept while some
//    allocator of the pool keeps host pages (set_keeping: the capped one
//    while a cap is set, AllocatorOptions::keep_host_pages) or while fewer
//    pages than the reserve are kept; released to the driver otherwise.
//    When the last keeper stops, the pages beyond the reserve go back.
//  - reserve(bytes) pins now until that many bytes are kept; the pool keeps
//    at least that many until a lower reserve or its end. trim() gives back
//    the kept pages beyond the reserve whoever keeps (empty_cache).
//  - A host that cannot pin (no host virtual memory management: pinned
//    fallback mode) has no pages to keep: reserve() refuses, naming it.
//  - Headroom: pinned memory is memory the kernel can neither swap nor
//    reclaim, so a job that spills until the host has nothing left takes
//    the node to its OOM killer, which may pick any process. With a headroom
//    set, take_or_pin() (and reserve(), and may_pin() for pinned fallback memory)
//    refuses to pin where the backend's host_available_bytes() would fall
//    below it: the caller sees an exhausted host (a squeeze stops part way,
//    an allocation over the cap fails with OutOfMemoryError). Each refusal
//    counts in headroom_refusals().
//
// Thread-safe: one mutex, which reserve() does not hold while it pins. A
// caller may hold its own lock around take_or_pin(), give() and trim() (allocators
// do): the pool calls nothing but the backend.
#pragma once

#include <cstddef>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "cotenant/backend.h"
#include "cotenant/stats.h"

namespace cotenant {

class HostPagePool {
 public:
  explicit HostPagePool(Backend& backend);
  ~HostPagePool();  // gives every kept page back (what the driver refuses stays with the process)
  HostPagePool(const HostPagePool&) = delete;
  HostPagePool& operator=(const HostPagePool&) = delete;

  Backend& backend() const { return backend_; }

  // A kept page, else one newly pinned through the backend; an empty handle
  // when none is kept and the host cannot, or may not (headroom), pin one.
  PageHandle take_or_pin();
  // Whether `bytes` more pinned host memory stays above the headroom
  // (counts a refusal when not). For memory pinned outside the pool.
  bool may_pin(std::size_t bytes);
  // Host memory kept available: 0 (the default) pins until the host refuses.
  void set_headroom(std::size_t bytes);
  std::size_t headroom() const;
  // Pins refused because of the headroom, since the last reset_accumulated().
  std::int64_t headroom_refusals() const;
  // What the pool may still pin: the backend's host_available_bytes() less
  // the headroom (0 at or below it); nullopt where the backend cannot tell.
  // Reads the host's figures at each call.
  std::optional<std::size_t> room() const;
  // When one more page would take the host below the headroom, the part of
  // a message that says so ("the host is at its headroom (X available, Y
  // kept available: ...)"); else "".
  std::string headroom_note() const;
  // A host page the caller no longer maps: kept while a keeper keeps or
  // below the reserve, else released. Throws the backend's Error when it
  // refuses the release (the page stays with the process, out of the books).
  void give(PageHandle page);
  // Whether `owner` (an allocator) keeps host pages it gives up. The last
  // keeper to stop gives back the kept pages beyond the reserve.
  void set_keeping(const void* owner, bool keeping);
  // Releases kept pages beyond the reserve. The books first: a release the
  // driver refuses leaves that page with the process, and the error goes on.
  void trim();
  // Pins host pages until `bytes` (rounded up to whole pages) are kept and
  // keeps at least that many until a lower reserve or the pool's end. A
  // lower reserve gives back what it no longer holds unless a keeper keeps
  // it. Returns the bytes reserved. Throws Error, the reserve as it was, when the host cannot pin
  // that much (the message names ulimit -l) or pins no host pages at all.
  std::size_t reserve(std::size_t bytes);
  std::size_t reserve_bytes() const;
  // Kept pages, in bytes: current and peak (host_pool_bytes in the statistics).
  Stat kept() const;
  void reset_peak();
  void reset_accumulated();

 private:
  Backend& backend_;
  const std::size_t page_bytes_;
  mutable std::mutex mutex_;
  std::vector<PageHandle> kept_;
  std::size_t reserve_pages_ = 0;
  std::set<const void*> keepers_;
  Stat kept_bytes_;
  std::size_t headroom_ = 0;
  std::int64_t headroom_refusals_ = 0;

  // Whether `bytes` more can be pinned above the headroom; counts a refusal. mutex_ held.
  bool may_pin_locked(std::size_t bytes);

  void trim_locked();
};

}  // namespace cotenant
