// MemoryHistory: the record of what a device's allocators did, as PyTorch's
// torch.cuda.memory._record_memory_history() keeps it: a bounded ring of
// trace entries (alloc, free_requested, free_completed, segment_map,
// segment_unmap, segment_alloc, segment_free, oom, snapshot), the call-stack
// context of each live block, and listeners that see every entry.
//
// Model (docs/allocator.md, "Memory history"):
//  - It is an AllocatorEventSink: each CachingAllocator of the device sends
//    its events through feed(pool), which tags them with the pool.
//  - Events become entries one to one, except a page move, which becomes two
//    (segment_unmap where the page was, segment_map where it is now): the
//    device memory at that address is released, or regained, and host
//    memory takes, or gives back, its place.
//  - Contexts are opaque (HistoryContext): the caller gathers them (a Python
//    and C++ stack in the torch adapter) with gather() before it calls the
//    allocator, outside any allocator lock, and lends them to the events of
//    that call with a ContextScope. Which entries keep a context follows
//    PyTorch's RecordContext: kState keeps it on live blocks only, kAlloc on
//    alloc entries too (and free entries get the block's), kAll gathers one
//    at free as well.
//  - The ring keeps the newest max_entries entries; actions named in
//    skip_actions are not kept (listeners still see them).
//  - Turning recording off clears the ring and the block contexts; turning
//    it on keeps the ring unless asked to clear it.
//
// Thread safety: every method may be called from any thread. on_event() runs
// under the sending allocator's lock and takes only this object's lock;
// listeners run under both and must not call into the allocators.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cotenant/address_map.h"
#include "cotenant/allocator_events.h"
#include "cotenant/caching_allocator.h"

namespace cotenant {

// PyTorch's TraceEntry actions, by the names its snapshots use.
enum class HistoryAction : std::uint8_t {
  kAlloc,
  kFreeRequested,
  kFreeCompleted,
  kSegmentAlloc,
  kSegmentFree,
  kSegmentMap,
  kSegmentUnmap,
  kSnapshot,
  kOom,
};

// "alloc", "free_requested", ... as in torch.cuda.memory._snapshot().
const char* history_action_name(HistoryAction action);
// The action a name stands for; throws Error naming the valid names.
HistoryAction parse_history_action(std::string_view name);

// How much call-stack context to keep (PyTorch's RecordContext).
enum class ContextLevel : std::uint8_t { kNever, kState, kAlloc, kAll };

// A call-stack capture, opaque here.
using HistoryContext = std::shared_ptr<void>;
// A text entries carry (PyTorch's compile context, user metadata); null: none.
using HistoryLabel = std::shared_ptr<const std::string>;
using HistoryPoolId = std::pair<std::uint64_t, std::uint64_t>;  // {0, 0}: the default pool

struct HistoryEntry {
  HistoryAction action = HistoryAction::kAlloc;
  DevicePtr address = 0;  // kOom: the device's free bytes; kSnapshot: 0
  std::size_t size = 0;   // bytes
  StreamId stream = 0;
  // Segment entries: the memory mapped, unmapped, allocated or freed (a
  // pinned fallback segment is host memory). Block entries: kDevice.
  Residency where = Residency::kDevice;
  HistoryPoolId pool{0, 0};
  HistoryContext context;     // null unless the level keeps one here
  std::int64_t time_us = 0;   // system clock, microseconds since the epoch
  HistoryLabel compile_context;  // the labels set when it was recorded (set_labels)
  HistoryLabel user_metadata;
};

// A mark the job put in the timeline (a record_function's start or end:
// {"name", ...}, {"stage", "START"}), kept beside the entries.
struct HistoryAnnotation {
  std::int64_t time_us = 0;  // as HistoryEntry's
  std::vector<std::pair<std::string, std::string>> metadata;
};

struct HistorySettings {
  bool enabled = false;
  ContextLevel context = ContextLevel::kNever;
  std::size_t max_entries = 1;              // at least 1
  bool clear = false;                       // drop what the ring holds when enabling
  std::vector<HistoryAction> skip_actions;  // not kept in the ring
  // Gathers a context; required unless context is kNever.
  std::function<HistoryContext()> recorder;
};

class MemoryHistory final : public AllocatorEventSink {
 public:
  using Listener = std::function<void(const HistoryEntry&)>;

  MemoryHistory();
  ~MemoryHistory() override;
  MemoryHistory(const MemoryHistory&) = delete;
  MemoryHistory& operator=(const MemoryHistory&) = delete;

  // Starts, changes or stops recording. Throws Error (and changes nothing)
  // when a context level is asked for without a recorder.
  void configure(HistorySettings settings);
  bool enabled() const { return enabled_.load(std::memory_order_acquire); }
  // True while events are wanted: recording, or a listener attached. An
  // allocator needs a sink only then.
  bool active() const { return enabled() || has_listeners_.load(std::memory_order_acquire); }
  // Called with every entry from now on, whether or not recording is on.
  void add_listener(Listener listener);

  // A context for an operation at `level` (kState for an allocation, kAll
  // for a free), or null when recording does not keep one there. Runs the
  // recorder: call it outside any allocator lock.
  HistoryContext gather(ContextLevel level) const;

  // Lends `context` to the events this thread causes while the scope lives
  // (a null context lends nothing). Scopes nest.
  class ContextScope {
   public:
    explicit ContextScope(const HistoryContext& context);
    ~ContextScope();
    ContextScope(const ContextScope&) = delete;
    ContextScope& operator=(const ContextScope&) = delete;

   private:
    const HistoryContext* previous_;
  };

  // The sink for one pool's allocator (stable for this object's life).
  AllocatorEventSink& feed(HistoryPoolId pool);
  // The default pool's events.
  void on_event(const AllocatorEvent& event) override;

  // A snapshot entry (PyTorch records one per snapshot taken).
  void record_snapshot();
  // The ring, oldest first.
  std::vector<HistoryEntry> entries() const;

  // Labels every entry recorded from now on carries (null: none).
  void set_labels(HistoryLabel compile_context, HistoryLabel user_metadata);
  // Keeps an annotation, timed now, while recording (the newest max_entries,
  // as entries; nothing otherwise). Cleared with the entries.
  void record_annotation(std::vector<std::pair<std::string, std::string>> metadata);
  // The annotations kept, oldest first.
  std::vector<HistoryAnnotation> annotations() const;
  // The context of the live block at `address` (null if none was kept).
  HistoryContext context_of(DevicePtr address) const;

 private:
  class PoolFeed;
  void on_pool_event(const AllocatorEvent& event, HistoryPoolId pool);
  // Under mutex_: an entry timed now, with the labels in force.
  HistoryEntry stamped_entry() const;
  // Under mutex_: listeners, then the ring unless the action is skipped.
  void record(HistoryEntry entry);
  bool keeps_in_trace(HistoryAction action) const;

  std::atomic<bool> enabled_{false};
  std::atomic<bool> has_listeners_{false};
  mutable std::mutex mutex_;
  ContextLevel level_ = ContextLevel::kNever;
  std::function<HistoryContext()> recorder_;
  std::vector<bool> skipped_;  // by HistoryAction
  std::size_t max_entries_ = 1;
  std::vector<HistoryEntry> ring_;  // up to max_entries_; next_ is the oldest once full
  std::size_t next_ = 0;
  std::deque<HistoryAnnotation> annotations_;  // at most max_entries_
  HistoryLabel compile_context_;
  HistoryLabel user_metadata_;
  AddressMap<DevicePtr, HistoryContext> block_contexts_;  // live blocks (while recording, one insert an allocation)
  std::vector<Listener> listeners_;
  std::map<HistoryPoolId, std::unique_ptr<PoolFeed>> feeds_;
};

// One reported piece of a segment: a run of mapped pages of one residency,
// widened so that no live block is cut (a block that starts on device pages
// and ends on host pages belongs to the piece it starts in), with the
// segment's blocks clipped to it. Unmapped address space is in no piece.
// This is how the torch adapter reports segments in a snapshot.
struct SegmentPart {
  DevicePtr address = 0;
  std::size_t size = 0;
  Residency where = Residency::kDevice;  // of the pages the piece starts with
  std::vector<BlockInfo> blocks;         // tile [address, address + size)
};
std::vector<SegmentPart> residency_parts(const SegmentInfo& segment);

}  // namespace cotenant
