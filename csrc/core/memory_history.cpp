#include "cotenant/memory_history.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <chrono>

#include "cotenant/errors.h"

namespace cotenant {
namespace {

constexpr std::array<const char*, 9> kActionNames = {
    "alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
    "segment_map", "segment_unmap", "snapshot", "oom",
};

// The context the innermost ContextScope of this thread lends, or null.
thread_local const HistoryContext* lent_context = nullptr;

std::int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

HistoryContext lent() { return lent_context != nullptr ? *lent_context : HistoryContext{}; }

}  // namespace

const char* history_action_name(HistoryAction action) { return kActionNames.at(static_cast<std::size_t>(action)); }

HistoryAction parse_history_action(std::string_view name) {
  for (std::size_t i = 0; i < kActionNames.size(); ++i) {
    if (name == kActionNames[i]) return static_cast<HistoryAction>(i);
  }
  throw Error(fmt::format("'{}' is not a memory history action; skip_actions takes these names: {}", name,
                          fmt::join(kActionNames, ", ")));
}

// ---- context scopes ---------------------------------------------------------------

MemoryHistory::ContextScope::ContextScope(const HistoryContext& context) : previous_(lent_context) {
  if (context) lent_context = &context;
}

MemoryHistory::ContextScope::~ContextScope() { lent_context = previous_; }

// ---- configuration ------------------------------------------------------------------

void MemoryHistory::configure(HistorySettings settings) {
  if (settings.enabled && settings.context != ContextLevel::kNever && !settings.recorder) {
    throw Error("memory history with call-stack context needs a context recorder; pass one, or record "
                "without context");
  }
  std::lock_guard lock(mutex_);
  level_ = settings.enabled ? settings.context : ContextLevel::kNever;
  recorder_ = settings.enabled ? std::move(settings.recorder) : nullptr;
  max_entries_ = std::max<std::size_t>(1, settings.max_entries);
  skipped_.assign(kActionNames.size(), false);
  for (HistoryAction action : settings.skip_actions) skipped_[static_cast<std::size_t>(action)] = true;
  if (!settings.enabled || settings.clear) {
    ring_.clear();
    next_ = 0;
    annotations_.clear();
  } else {
    // Oldest first again, keeping the newest max_entries_ (the size may have changed).
    std::rotate(ring_.begin(), ring_.begin() + static_cast<std::ptrdiff_t>(next_), ring_.end());
    next_ = 0;
    if (ring_.size() > max_entries_) ring_.erase(ring_.begin(), ring_.end() - static_cast<std::ptrdiff_t>(max_entries_));
    while (annotations_.size() > max_entries_) annotations_.pop_front();
  }
  if (!settings.enabled) block_contexts_.clear();
  enabled_.store(settings.enabled, std::memory_order_release);
}

void MemoryHistory::add_listener(Listener listener) {
  std::lock_guard lock(mutex_);
  listeners_.push_back(std::move(listener));
  has_listeners_.store(true, std::memory_order_release);
}

HistoryContext MemoryHistory::gather(ContextLevel level) const {
  if (!enabled()) return {};
  std::function<HistoryContext()> recorder;
  {
    std::lock_guard lock(mutex_);
    if (level_ < level || !recorder_) return {};
    recorder = recorder_;
  }
  return recorder();  // outside the lock: it may take others (Python's)
}

// ---- events -------------------------------------------------------------------------

class MemoryHistory::PoolFeed final : public AllocatorEventSink {
 public:
  PoolFeed(MemoryHistory& history, HistoryPoolId pool) : history_(history), pool_(pool) {}
  void on_event(const AllocatorEvent& event) override { history_.on_pool_event(event, pool_); }

 private:
  MemoryHistory& history_;
  HistoryPoolId pool_;
};

MemoryHistory::MemoryHistory() = default;
MemoryHistory::~MemoryHistory() = default;

AllocatorEventSink& MemoryHistory::feed(HistoryPoolId pool) {
  if (pool == HistoryPoolId{0, 0}) return *this;
  std::lock_guard lock(mutex_);
  auto& slot = feeds_[pool];
  if (!slot) slot = std::make_unique<PoolFeed>(*this, pool);
  return *slot;
}

void MemoryHistory::on_event(const AllocatorEvent& event) { on_pool_event(event, {0, 0}); }

void MemoryHistory::on_pool_event(const AllocatorEvent& event, HistoryPoolId pool) {
  using Kind = AllocatorEvent::Kind;
  std::lock_guard lock(mutex_);
  if (!enabled() && listeners_.empty()) return;
  HistoryEntry entry = stamped_entry();
  entry.address = event.address;
  entry.size = event.bytes;
  entry.stream = event.stream;
  entry.pool = pool;
  HistoryContext context = lent();
  switch (event.kind) {
    case Kind::kAlloc:
      entry.action = HistoryAction::kAlloc;
      if (context && level_ >= ContextLevel::kState) block_contexts_[event.address] = context;
      break;
    case Kind::kFreeRequested:
    case Kind::kFreeCompleted: {
      entry.action = event.kind == Kind::kFreeRequested ? HistoryAction::kFreeRequested : HistoryAction::kFreeCompleted;
      auto it = block_contexts_.find(event.address);
      if (!context && it != block_contexts_.end()) context = it->second;
      if (event.kind == Kind::kFreeCompleted && it != block_contexts_.end()) block_contexts_.erase(it);
      break;
    }
    case Kind::kPageMapped:
      entry.action = HistoryAction::kSegmentMap;
      entry.where = event.where;
      break;
    case Kind::kPageUnmapped:
      entry.action = HistoryAction::kSegmentUnmap;
      entry.where = event.where;
      break;
    case Kind::kPageMoved: {
      // The page leaves the other residency and is mapped on `where`.
      HistoryEntry left = entry;
      left.action = HistoryAction::kSegmentUnmap;
      left.where = event.where == Residency::kHost ? Residency::kDevice : Residency::kHost;
      left.context = level_ >= ContextLevel::kAlloc ? context : HistoryContext{};
      record(std::move(left));
      entry.action = HistoryAction::kSegmentMap;
      entry.where = event.where;
      break;
    }
    case Kind::kSegmentAllocated:
      entry.action = HistoryAction::kSegmentAlloc;
      entry.where = event.where;
      break;
    case Kind::kSegmentFreed:
      entry.action = HistoryAction::kSegmentFree;
      entry.where = event.where;
      break;
    case Kind::kOutOfMemory:
      entry.action = HistoryAction::kOom;
      entry.address = event.device_free_bytes;
      break;
  }
  if (level_ >= ContextLevel::kAlloc) entry.context = std::move(context);
  record(std::move(entry));
}

void MemoryHistory::record_snapshot() {
  std::lock_guard lock(mutex_);
  if (!enabled() && listeners_.empty()) return;
  HistoryEntry entry = stamped_entry();
  entry.action = HistoryAction::kSnapshot;
  record(std::move(entry));
}

HistoryEntry MemoryHistory::stamped_entry() const {
  HistoryEntry entry;
  entry.time_us = now_us();
  entry.compile_context = compile_context_;
  entry.user_metadata = user_metadata_;
  return entry;
}

void MemoryHistory::set_labels(HistoryLabel compile_context, HistoryLabel user_metadata) {
  std::lock_guard lock(mutex_);
  compile_context_ = std::move(compile_context);
  user_metadata_ = std::move(user_metadata);
}

void MemoryHistory::record_annotation(std::vector<std::pair<std::string, std::string>> metadata) {
  std::lock_guard lock(mutex_);
  if (!enabled()) return;
  if (annotations_.size() >= max_entries_) annotations_.pop_front();
  annotations_.push_back({now_us(), std::move(metadata)});
}

std::vector<HistoryAnnotation> MemoryHistory::annotations() const {
  std::lock_guard lock(mutex_);
  return {annotations_.begin(), annotations_.end()};
}

bool MemoryHistory::keeps_in_trace(HistoryAction action) const {
  return enabled() && !skipped_[static_cast<std::size_t>(action)];
}

void MemoryHistory::record(HistoryEntry entry) {
  for (const Listener& listener : listeners_) listener(entry);
  if (!keeps_in_trace(entry.action)) return;
  if (ring_.size() < max_entries_) {
    ring_.push_back(std::move(entry));
    return;
  }
  ring_[next_] = std::move(entry);
  next_ = (next_ + 1) % max_entries_;
}

std::vector<HistoryEntry> MemoryHistory::entries() const {
  std::lock_guard lock(mutex_);
  std::vector<HistoryEntry> out;
  out.reserve(ring_.size());
  out.insert(out.end(), ring_.begin() + static_cast<std::ptrdiff_t>(next_), ring_.end());
  out.insert(out.end(), ring_.begin(), ring_.begin() + static_cast<std::ptrdiff_t>(next_));
  return out;
}

HistoryContext MemoryHistory::context_of(DevicePtr address) const {
  std::lock_guard lock(mutex_);
  auto it = block_contexts_.find(address);
  return it == block_contexts_.end() ? HistoryContext{} : it->second;
}

// ---- segments as reported ---------------------------------------------------------------

namespace {

bool is_live(const BlockInfo& block) { return block.allocated || block.waiting_on_events; }

// The blocks of `blocks` (in address order) clipped to [start, end).
std::vector<BlockInfo> clip(const std::vector<BlockInfo>& blocks, DevicePtr start, DevicePtr end) {
  std::vector<BlockInfo> out;
  for (const BlockInfo& block : blocks) {
    const DevicePtr block_end = block.address + block.size;
    if (block_end <= start) continue;
    if (block.address >= end) break;
    BlockInfo piece = block;
    piece.address = std::max(block.address, start);
    piece.size = std::min(block_end, end) - piece.address;
    out.push_back(piece);
  }
  return out;
}

}  // namespace

std::vector<SegmentPart> residency_parts(const SegmentInfo& segment) {
  if (segment.pinned_fallback) return {{segment.address, segment.size, Residency::kHost, segment.blocks}};
  std::vector<SegmentPart> parts;
  DevicePtr covered = segment.address;  // everything below is in a part already
  for (const auto& run : segment.mapped_runs) {
    const DevicePtr start = std::max(run.address, covered);
    DevicePtr end = run.address + run.size;
    if (start >= end) continue;  // a widened part took all of it
    // Widen over a live block that crosses the end (live blocks lie on
    // mapped pages, so this stays on mapped pages).
    for (const BlockInfo& block : segment.blocks) {
      if (block.address >= end) break;
      if (block.address + block.size > end && is_live(block)) end = block.address + block.size;
    }
    parts.push_back({start, end - start, run.where, clip(segment.blocks, start, end)});
    covered = end;
  }
  return parts;
}

}  // namespace cotenant
