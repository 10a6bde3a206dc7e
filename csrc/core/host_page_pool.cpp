#include "cotenant/host_page_pool.h"

#include <fmt/format.h>

#include "cotenant/errors.h"
#include "cotenant/size.h"

namespace cotenant {

HostPagePool::HostPagePool(Backend& backend) : backend_(backend), page_bytes_(backend.granularity()) {}

HostPagePool::~HostPagePool() {
  for (PageHandle page : kept_) {
    try {
      backend_.release_page(page);
    } catch (...) {
      // A destructor must not throw: what the driver refused stays with the process.
    }
  }
}

PageHandle HostPagePool::take_or_pin() {
  {
    std::lock_guard lock(mutex_);
    if (!kept_.empty()) {
      const PageHandle page = kept_.back();
      kept_.pop_back();
      kept_bytes_.decrease(static_cast<std::int64_t>(page_bytes_));
      return page;
    }
    if (!may_pin_locked(page_bytes_)) return {};
  }
  return backend_.create_page(Residency::kHost);
}

bool HostPagePool::may_pin(std::size_t bytes) {
  std::lock_guard lock(mutex_);
  return may_pin_locked(bytes);
}

bool HostPagePool::may_pin_locked(std::size_t bytes) {
  if (headroom_ == 0) return true;
  const std::optional<std::size_t> available = backend_.host_available_bytes();
  if (!available || *available >= headroom_ + bytes) return true;
  ++headroom_refusals_;
  return false;
}

void HostPagePool::set_headroom(std::size_t bytes) {
  std::lock_guard lock(mutex_);
  headroom_ = bytes;
}

std::size_t HostPagePool::headroom() const {
  std::lock_guard lock(mutex_);
  return headroom_;
}

std::int64_t HostPagePool::headroom_refusals() const {
  std::lock_guard lock(mutex_);
  return headroom_refusals_;
}

std::optional<std::size_t> HostPagePool::room() const {
  const std::optional<std::size_t> available = backend_.host_available_bytes();
  if (!available) return std::nullopt;
  const std::size_t keep = headroom();
  return *available > keep ? *available - keep : 0;
}

std::string HostPagePool::headroom_note() const {
  const std::size_t headroom = this->headroom();
  const std::optional<std::size_t> available = backend_.host_available_bytes();
  if (headroom == 0 || !available || *available >= headroom + page_bytes_) return "";
  return fmt::format(
      "the host is at its headroom ({} available, {} kept available: COTENANT_HOST_HEADROOM, or the "
      "coordinator's [memory] host_headroom; pinned memory cannot be swapped, and pinning the rest would "
      "leave the system to its OOM killer)",
      format_size(*available), format_size(headroom));
}

void HostPagePool::give(PageHandle page) {
  {
    std::lock_guard lock(mutex_);
    if (!keepers_.empty() || kept_.size() < reserve_pages_) {
      kept_.push_back(page);
      kept_bytes_.increase(static_cast<std::int64_t>(page_bytes_));
      return;
    }
  }
  backend_.release_page(page);
}

void HostPagePool::set_keeping(const void* owner, bool keeping) {
  std::lock_guard lock(mutex_);
  if (keeping) {
    keepers_.insert(owner);
    return;
  }
  if (keepers_.erase(owner) != 0 && keepers_.empty()) trim_locked();
}

void HostPagePool::trim() {
  std::lock_guard lock(mutex_);
  trim_locked();
}

void HostPagePool::trim_locked() {
  while (kept_.size() > reserve_pages_) {
    const PageHandle page = kept_.back();
    kept_.pop_back();
    kept_bytes_.decrease(static_cast<std::int64_t>(page_bytes_));
    backend_.release_page(page);
  }
}

std::size_t HostPagePool::reserve(std::size_t bytes) {
  if (!backend_.host_pages_mappable()) {
    throw Error(fmt::format(
        "cannot reserve {} of host memory: this device has no host pages to keep (over-cap memory goes to "
        "pinned fallback segments: the driver has no host virtual memory management, or "
        "COTENANT_HOST_PAGES=pinned asked for it). Run without the reserve",
        format_size(bytes)));
  }
  const std::size_t pages = (bytes + page_bytes_ - 1) / page_bytes_;
  std::size_t have = 0;
  {
    std::lock_guard lock(mutex_);
    have = kept_.size();
  }
  // Pinned without the lock (the backend is thread-safe): allocators take
  // and give pages, and statistics are read, while the host pins, which
  // takes about as long as copying.
  std::vector<PageHandle> pinned;
  try {
    while (have + pinned.size() < pages) {
      if (!may_pin(page_bytes_)) {
        std::string why = headroom_note();
        if (why.empty()) why = fmt::format("the host is at its headroom of {}", format_size(headroom()));
        throw Error(fmt::format("cannot reserve {} of host memory after {}: {}. Reserve less, or lower the headroom",
                                format_size(pages * page_bytes_), format_size((have + pinned.size()) * page_bytes_),
                                why));
      }
      const PageHandle page = backend_.create_page(Residency::kHost);
      if (!page) {
        throw Error(fmt::format(
            "cannot reserve {} of host memory: the host refused to pin more after {} (pinned memory is "
            "limited by free RAM and by the locked-memory limit, ulimit -l). Reserve less, or raise the limit",
            format_size(pages * page_bytes_), format_size((have + pinned.size()) * page_bytes_)));
      }
      pinned.push_back(page);
    }
  } catch (...) {
    for (PageHandle page : pinned) backend_.release_page(page);  // the reserve stays as it was
    throw;
  }
  std::lock_guard lock(mutex_);
  for (PageHandle page : pinned) {
    kept_.push_back(page);
    kept_bytes_.increase(static_cast<std::int64_t>(page_bytes_));
  }
  reserve_pages_ = pages;
  if (keepers_.empty()) trim_locked();  // a smaller reserve gives back what it no longer holds
  return pages * page_bytes_;
}

std::size_t HostPagePool::reserve_bytes() const {
  std::lock_guard lock(mutex_);
  return reserve_pages_ * page_bytes_;
}

Stat HostPagePool::kept() const {
  std::lock_guard lock(mutex_);
  return kept_bytes_;
}

void HostPagePool::reset_peak() {
  std::lock_guard lock(mutex_);
  kept_bytes_.reset_peak();
}

void HostPagePool::reset_accumulated() {
  std::lock_guard lock(mutex_);
  kept_bytes_.reset_accumulated();
  headroom_refusals_ = 0;
}

}  // namespace cotenant
