// A simulated device for tests, the replay tool and benchmarks on machines
// without a GPU.
//
// It keeps a configurable device capacity and page granularity, hands out
// virtual addresses from a private range, and stores real bytes per page
// (allocated lazily on first write, so replaying a 40 GiB trace costs no
// memory). It reports out-of-memory when the device (or the optional host
// limit) is full, and counts its calls.
//
// Streams and events: work is modelled per stream as "pending until
// completed". An event recorded on a stream completes when the test calls
// complete_stream(stream) or synchronize_device(), or at once when
// `events_complete_immediately` is set (the default, as for idle streams).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>
#include <vector>

#include "cotenant/backend.h"

namespace cotenant {

struct SimulatedDeviceConfig {
  std::size_t device_capacity = std::size_t{16} << 30;  // bytes
  std::size_t granularity = std::size_t{2} << 20;       // bytes per page
  std::size_t host_capacity = std::size_t{1} << 40;     // bytes of host pages + pinned memory
  bool host_pages_mappable = true;  // false simulates a driver without host VMM
  bool events_complete_immediately = true;
  // true: a new page holds a garbage pattern (0xA5 bytes) instead of
  // zeros, as a driver's page may, so a test sees whether zero() ran.
  bool fresh_pages_hold_garbage = false;
};

struct SimulatedCallCounts {
  std::uint64_t reserve = 0, release = 0, create_page = 0, release_page = 0;
  std::uint64_t map = 0, unmap = 0, copy_into = 0, copy_out = 0, zero = 0, failed_create_page = 0;
  std::uint64_t allocate_pinned_host = 0, free_pinned_host = 0;
  std::uint64_t record_event = 0, synchronize_device = 0, refused_synchronization = 0;
  std::uint64_t device_total = 0, host_available = 0;  // size queries: device_total_bytes(), host_available_bytes()
};

class SimulatedBackend final : public Backend {
 public:
  explicit SimulatedBackend(SimulatedDeviceConfig config = {});
  ~SimulatedBackend() override;

  std::size_t granularity() const override { return config_.granularity; }
  std::size_t device_total_bytes() const override;
  std::size_t device_free_bytes() const override;
  bool host_pages_mappable() const override { return config_.host_pages_mappable; }
  // host_capacity less the host pages and pinned memory in use.
  std::optional<std::size_t> host_available_bytes() const override;

  DevicePtr reserve(std::size_t bytes) override;
  void release(DevicePtr base, std::size_t bytes) override;
  PageHandle create_page(Residency where) override;
  void release_page(PageHandle page) override;
  void map(DevicePtr address, PageHandle page) override;
  void unmap(DevicePtr address) override;
  void copy_into(DevicePtr address, PageHandle src) override;
  void copy_out(DevicePtr address, PageHandle dst) override;
  void zero(DevicePtr address, std::size_t bytes) override;
  DevicePtr allocate_pinned_host(std::size_t bytes) override;
  void free_pinned_host(DevicePtr address, std::size_t bytes) override;

  EventHandle create_event() override;
  void destroy_event(EventHandle event) override;
  void record_event(EventHandle event, StreamId stream) override;
  bool query_event(EventHandle event) override;
  void synchronize_event(EventHandle event) override;
  void synchronize_device() override;

  // --- test controls and inspection ---
  // Completes every event recorded so far on `stream`.
  void complete_stream(StreamId stream);
  // Reads/writes bytes at a device address, through the current mapping (or a
  // pinned-host allocation). Throws cotenant::Error for an unmapped address.
  void write(DevicePtr address, const void* data, std::size_t bytes);
  void read(DevicePtr address, void* data, std::size_t bytes) const;
  // Residency of the page mapped at `address`; throws if unmapped.
  Residency residency_at(DevicePtr address) const;
  // Bytes of device / host pages that exist (mapped or not).
  std::size_t device_bytes_in_use() const;
  std::size_t host_bytes_in_use() const;
  // Makes the next `count` create_page(kDevice) calls fail, as if another
  // process had taken the memory.
  void fail_next_device_pages(std::size_t count);
  // While set, synchronize_for_unmap() refuses, as a GPU does while a CUDA
  // graph is being captured.
  void refuse_synchronization(bool refuse);
  bool synchronize_for_unmap() override;
  SimulatedCallCounts calls() const;

 private:
  struct Page;
  struct PinnedRange;
  const Page* page_at_locked(DevicePtr address, std::size_t* offset) const;
  Page* page_at_locked(DevicePtr address, std::size_t* offset);
  void copy_page_locked(Page& to, const Page& from);  // one page's bytes
  // The page of `handle` / mapped at `address`; throws Error beginning with
  // `what` when there is none.
  Page& page_locked(PageHandle handle, const char* what);
  Page& mapped_page_locked(DevicePtr address, const char* what);

  const SimulatedDeviceConfig config_;
  mutable std::mutex mutex_;
  std::uint64_t next_page_id_ = 1;
  std::uint64_t next_event_id_ = 1;
  DevicePtr next_address_;
  std::size_t device_used_ = 0;
  std::size_t host_used_ = 0;
  std::size_t failures_to_inject_ = 0;
  bool refuse_synchronization_ = false;
  std::unordered_map<std::uint64_t, std::unique_ptr<Page>> pages_;
  std::map<DevicePtr, std::size_t> reservations_;  // base -> bytes
  std::unordered_map<DevicePtr, std::uint64_t> mappings_;  // page-aligned address -> page id
  std::map<DevicePtr, std::unique_ptr<PinnedRange>> pinned_;  // base -> range
  struct EventState { bool pending = false; StreamId stream = 0; std::uint64_t ticket = 0; };
  std::unordered_map<std::uint64_t, EventState> events_;
  std::unordered_map<StreamId, std::uint64_t> stream_completed_ticket_;
  std::uint64_t next_ticket_ = 1;
  mutable SimulatedCallCounts calls_;  // mutable: the size queries, const, are counted too
};

}  // namespace cotenant
