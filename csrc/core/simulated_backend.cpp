#include "cotenant/simulated_backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "cotenant/errors.h"

namespace cotenant {

// A physical page. Its bytes are allocated on first write; an unwritten page
// reads as zeros.
struct SimulatedBackend::Page {
  Residency where;
  std::unique_ptr<std::uint8_t[]> bytes;
  bool mapped = false;
};

// A pinned-host allocation (fallback mode): contiguous bytes, lazily stored.
struct SimulatedBackend::PinnedRange {
  std::size_t size = 0;
  std::unique_ptr<std::uint8_t[]> bytes;
};

namespace {
// Simulated addresses start high and far apart from real pointers, so a test
// that confuses the two fails loudly.
constexpr DevicePtr kFirstAddress = DevicePtr{0x7e0000000000};

// A page's bytes, each `value`, set by one memset (make_unique<T[]> zeroes
// them one at a time in an unoptimised build, the sanitizer tests' build).
std::unique_ptr<std::uint8_t[]> filled_bytes(std::size_t bytes, std::uint8_t value) {
  std::unique_ptr<std::uint8_t[]> out(new std::uint8_t[bytes]);
  std::memset(out.get(), value, bytes);
  return out;
}
}  // namespace

SimulatedBackend::SimulatedBackend(SimulatedDeviceConfig config)
    : config_(config), next_address_(kFirstAddress) {
  if (!is_page_size(config_.granularity)) {
    throw Error(fmt::format("the simulated device's page granularity must be a power of two, not {}", config_.granularity));
  }
}

SimulatedBackend::~SimulatedBackend() = default;

std::size_t SimulatedBackend::device_free_bytes() const {
  std::lock_guard lock(mutex_);
  return config_.device_capacity - device_used_;
}

DevicePtr SimulatedBackend::reserve(std::size_t bytes) {
  std::lock_guard lock(mutex_);
  ++calls_.reserve;
  if (bytes == 0 || bytes % config_.granularity != 0) {
    throw Error(fmt::format("reserve({}) is not a positive multiple of the granularity {}", bytes, config_.granularity));
  }
  const DevicePtr base = next_address_;
  // Leave a one-page hole between ranges so an overrun never lands in a neighbour.
  next_address_ += bytes + config_.granularity;
  reservations_.emplace(base, bytes);
  return base;
}

void SimulatedBackend::release(DevicePtr base, std::size_t bytes) {
  std::lock_guard lock(mutex_);
  ++calls_.release;
  auto it = reservations_.find(base);
  if (it == reservations_.end() || it->second != bytes) {
    throw Error(fmt::format("release(0x{:x}, {}) does not match a reservation", base, bytes));
  }
  for (DevicePtr a = base; a < base + bytes; a += config_.granularity) {
    if (mappings_.count(a)) throw Error(fmt::format("release of a range with page 0x{:x} still mapped", a));
  }
  reservations_.erase(it);
}

PageHandle SimulatedBackend::create_page(Residency where) {
  std::lock_guard lock(mutex_);
  ++calls_.create_page;
  const std::size_t g = config_.granularity;
  if (where == Residency::kDevice) {
    if (failures_to_inject_ > 0 || device_used_ + g > config_.device_capacity) {
      if (failures_to_inject_ > 0) --failures_to_inject_;
      ++calls_.failed_create_page;
      return {};
    }
    device_used_ += g;
  } else {
    if (host_used_ + g > config_.host_capacity) {
      ++calls_.failed_create_page;
      return {};
    }
    host_used_ += g;
  }
  const std::uint64_t id = next_page_id_++;
  auto page = std::make_unique<Page>();
  page->where = where;
  if (config_.fresh_pages_hold_garbage) {
    page->bytes = filled_bytes(g, 0xA5);
  }
  pages_.emplace(id, std::move(page));
  return PageHandle{id, where};
}

SimulatedBackend::Page& SimulatedBackend::page_locked(PageHandle handle, const char* what) {
  auto it = pages_.find(handle.id);
  if (it == pages_.end()) throw Error(fmt::format("{} unknown page {}", what, handle.id));
  return *it->second;
}

SimulatedBackend::Page& SimulatedBackend::mapped_page_locked(DevicePtr address, const char* what) {
  auto it = mappings_.find(address);
  if (it == mappings_.end()) throw Error(fmt::format("{} 0x{:x}, which is not mapped", what, address));
  return *pages_.at(it->second);
}

void SimulatedBackend::release_page(PageHandle handle) {
  std::lock_guard lock(mutex_);
  ++calls_.release_page;
  Page& page = page_locked(handle, "release_page of");
  if (page.mapped) throw Error(fmt::format("release_page of page {} while it is mapped", handle.id));
  (page.where == Residency::kDevice ? device_used_ : host_used_) -= config_.granularity;
  pages_.erase(handle.id);
}

void SimulatedBackend::map(DevicePtr address, PageHandle handle) {
  std::lock_guard lock(mutex_);
  ++calls_.map;
  if (address % config_.granularity != 0) throw Error(fmt::format("map at unaligned address 0x{:x}", address));
  auto range = reservations_.upper_bound(address);
  if (range == reservations_.begin() || (--range, address >= range->first + range->second)) {
    throw Error(fmt::format("map at 0x{:x}, outside every reserved range", address));
  }
  if (mappings_.count(address)) throw Error(fmt::format("map at 0x{:x}, which is already mapped", address));
  Page& page = page_locked(handle, "map of");
  if (page.mapped) throw Error(fmt::format("map of page {}, which is mapped elsewhere", handle.id));
  if (page.where == Residency::kHost && !config_.host_pages_mappable) {
    throw Error("map of a host page on a device without host virtual memory management");
  }
  page.mapped = true;
  mappings_.emplace(address, handle.id);
}

void SimulatedBackend::refuse_synchronization(bool refuse) {
  std::lock_guard<std::mutex> lock(mutex_);
  refuse_synchronization_ = refuse;
}

bool SimulatedBackend::synchronize_for_unmap() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (refuse_synchronization_) {
      ++calls_.refused_synchronization;
      return false;
    }
  }
  synchronize_device();
  return true;
}

void SimulatedBackend::unmap(DevicePtr address) {
  std::lock_guard lock(mutex_);
  ++calls_.unmap;
  auto it = mappings_.find(address);
  if (it == mappings_.end()) throw Error(fmt::format("unmap at 0x{:x}, which is not mapped", address));
  pages_.at(it->second)->mapped = false;
  mappings_.erase(it);
}

void SimulatedBackend::copy_into(DevicePtr address, PageHandle src) {
  std::lock_guard lock(mutex_);
  ++calls_.copy_into;
  Page& to = mapped_page_locked(address, "copy into");
  copy_page_locked(to, page_locked(src, "copy from"));
}

void SimulatedBackend::copy_out(DevicePtr address, PageHandle dst) {
  std::lock_guard lock(mutex_);
  ++calls_.copy_out;
  const Page& from = mapped_page_locked(address, "copy out of");
  Page& to = page_locked(dst, "copy into");
  if (to.mapped) throw Error(fmt::format("copy into page {}, which is mapped", dst.id));
  copy_page_locked(to, from);
}

void SimulatedBackend::copy_page_locked(Page& to, const Page& from) {
  if (!from.bytes) {
    to.bytes.reset();  // an unwritten page reads as zeros; so does its copy
    return;
  }
  if (!to.bytes) to.bytes = filled_bytes(config_.granularity, 0);
  std::memcpy(to.bytes.get(), from.bytes.get(), config_.granularity);
}

DevicePtr SimulatedBackend::allocate_pinned_host(std::size_t bytes) {
  std::lock_guard lock(mutex_);
  ++calls_.allocate_pinned_host;
  if (bytes == 0 || host_used_ + bytes > config_.host_capacity) return 0;
  host_used_ += bytes;
  const DevicePtr base = next_address_;
  const std::size_t span = (bytes + config_.granularity - 1) / config_.granularity * config_.granularity;
  next_address_ += span + config_.granularity;
  auto range = std::make_unique<PinnedRange>();
  range->size = bytes;
  pinned_.emplace(base, std::move(range));
  return base;
}

void SimulatedBackend::free_pinned_host(DevicePtr address, std::size_t bytes) {
  std::lock_guard lock(mutex_);
  ++calls_.free_pinned_host;
  auto it = pinned_.find(address);
  if (it == pinned_.end() || it->second->size != bytes) {
    throw Error(fmt::format("free_pinned_host(0x{:x}, {}) does not match an allocation", address, bytes));
  }
  host_used_ -= bytes;
  pinned_.erase(it);
}

EventHandle SimulatedBackend::create_event() {
  std::lock_guard lock(mutex_);
  const std::uint64_t id = next_event_id_++;
  events_.emplace(id, EventState{});
  return EventHandle{id};
}

void SimulatedBackend::destroy_event(EventHandle event) {
  std::lock_guard lock(mutex_);
  events_.erase(event.id);
}

void SimulatedBackend::record_event(EventHandle event, StreamId stream) {
  std::lock_guard lock(mutex_);
  ++calls_.record_event;
  EventState& state = events_.at(event.id);
  state.stream = stream;
  state.ticket = next_ticket_++;
  state.pending = !config_.events_complete_immediately;
}

bool SimulatedBackend::query_event(EventHandle event) {
  std::lock_guard lock(mutex_);
  const EventState& state = events_.at(event.id);
  if (!state.pending) return true;
  auto done = stream_completed_ticket_.find(state.stream);
  return done != stream_completed_ticket_.end() && done->second >= state.ticket;
}

void SimulatedBackend::synchronize_event(EventHandle event) {
  std::lock_guard lock(mutex_);
  EventState& state = events_.at(event.id);
  if (!state.pending) return;
  // Waiting for an event means the stream's work up to it is done.
  std::uint64_t& done = stream_completed_ticket_[state.stream];
  done = std::max(done, state.ticket);
}

void SimulatedBackend::synchronize_device() {
  std::lock_guard lock(mutex_);
  ++calls_.synchronize_device;
  for (auto& [id, state] : events_) state.pending = false;
  // Tickets issued so far are 1 .. next_ticket_ - 1: all of them are done.
  for (auto& [stream, done] : stream_completed_ticket_) done = next_ticket_ - 1;
}

void SimulatedBackend::complete_stream(StreamId stream) {
  std::lock_guard lock(mutex_);
  stream_completed_ticket_[stream] = next_ticket_ - 1;  // every ticket issued so far
}

const SimulatedBackend::Page* SimulatedBackend::page_at_locked(DevicePtr address, std::size_t* offset) const {
  const DevicePtr page_address = address / config_.granularity * config_.granularity;
  auto it = mappings_.find(page_address);
  if (it == mappings_.end()) return nullptr;
  *offset = address - page_address;
  return pages_.at(it->second).get();
}

SimulatedBackend::Page* SimulatedBackend::page_at_locked(DevicePtr address, std::size_t* offset) {
  return const_cast<Page*>(static_cast<const SimulatedBackend*>(this)->page_at_locked(address, offset));
}

void SimulatedBackend::write(DevicePtr address, const void* data, std::size_t bytes) {
  std::lock_guard lock(mutex_);
  auto pinned = pinned_.upper_bound(address);
  if (pinned != pinned_.begin() && (--pinned, address + bytes <= pinned->first + pinned->second->size)) {
    PinnedRange& range = *pinned->second;
    if (!range.bytes) range.bytes = filled_bytes(range.size, 0);
    std::memcpy(range.bytes.get() + (address - pinned->first), data, bytes);
    return;
  }
  const auto* source = static_cast<const std::uint8_t*>(data);
  while (bytes > 0) {
    std::size_t offset = 0;
    Page* page = page_at_locked(address, &offset);
    if (!page) throw Error(fmt::format("write to 0x{:x}, which is not mapped", address));
    if (!page->bytes) page->bytes = filled_bytes(config_.granularity, 0);
    const std::size_t n = std::min(bytes, config_.granularity - offset);
    std::memcpy(page->bytes.get() + offset, source, n);
    source += n;
    address += n;
    bytes -= n;
  }
}

void SimulatedBackend::zero(DevicePtr address, std::size_t bytes) {
  std::lock_guard lock(mutex_);
  ++calls_.zero;
  while (bytes > 0) {
    std::size_t offset = 0;
    Page* page = page_at_locked(address, &offset);
    if (!page) throw Error(fmt::format("zero at 0x{:x}, which is not mapped", address));
    const std::size_t n = std::min(bytes, config_.granularity - offset);
    if (page->bytes) std::memset(page->bytes.get() + offset, 0, n);  // no bytes: reads as zero already
    address += n;
    bytes -= n;
  }
}

void SimulatedBackend::read(DevicePtr address, void* data, std::size_t bytes) const {
  std::lock_guard lock(mutex_);
  auto pinned = pinned_.upper_bound(address);
  if (pinned != pinned_.begin() && (--pinned, address + bytes <= pinned->first + pinned->second->size)) {
    const PinnedRange& range = *pinned->second;
    if (range.bytes) std::memcpy(data, range.bytes.get() + (address - pinned->first), bytes);
    else std::memset(data, 0, bytes);
    return;
  }
  auto* target = static_cast<std::uint8_t*>(data);
  while (bytes > 0) {
    std::size_t offset = 0;
    const Page* page = page_at_locked(address, &offset);
    if (!page) throw Error(fmt::format("read from 0x{:x}, which is not mapped", address));
    const std::size_t n = std::min(bytes, config_.granularity - offset);
    if (page->bytes) std::memcpy(target, page->bytes.get() + offset, n);
    else std::memset(target, 0, n);
    target += n;
    address += n;
    bytes -= n;
  }
}

Residency SimulatedBackend::residency_at(DevicePtr address) const {
  std::lock_guard lock(mutex_);
  auto pinned = pinned_.upper_bound(address);
  if (pinned != pinned_.begin() && (--pinned, address < pinned->first + pinned->second->size)) return Residency::kHost;
  std::size_t offset = 0;
  const Page* page = page_at_locked(address, &offset);
  if (!page) throw Error(fmt::format("residency_at(0x{:x}): not mapped", address));
  return page->where;
}

std::size_t SimulatedBackend::device_bytes_in_use() const {
  std::lock_guard lock(mutex_);
  return device_used_;
}

std::size_t SimulatedBackend::device_total_bytes() const {
  std::lock_guard lock(mutex_);
  ++calls_.device_total;
  return config_.device_capacity;
}

std::optional<std::size_t> SimulatedBackend::host_available_bytes() const {
  std::lock_guard lock(mutex_);
  ++calls_.host_available;
  return config_.host_capacity > host_used_ ? config_.host_capacity - host_used_ : 0;
}

std::size_t SimulatedBackend::host_bytes_in_use() const {
  std::lock_guard lock(mutex_);
  return host_used_;
}

void SimulatedBackend::fail_next_device_pages(std::size_t count) {
  std::lock_guard lock(mutex_);
  failures_to_inject_ = count;
}

SimulatedCallCounts SimulatedBackend::calls() const {
  std::lock_guard lock(mutex_);
  return calls_;
}

}  // namespace cotenant
