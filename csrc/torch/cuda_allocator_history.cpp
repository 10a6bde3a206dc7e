// torch.cuda.memory._record_memory_history() and the snapshot under
// cotenant: each device's MemoryHistory (cotenant/memory_history.h) in
// PyTorch's types. How host-resident memory appears, for memory_viz:
// docs/allocator.md, "Memory history".
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>

#include <cstdint>

#include "cotenant/errors.h"
#include "cuda_allocator.h"

namespace cotenant::torch_ext {
namespace {

// The stream that host-resident memory reports in snapshots and in segment
// trace entries: -1 once in Python. memory_viz draws it as a stream of its
// own, so spilled memory stands apart from the device's.
void* const kHostStream = reinterpret_cast<void*>(~std::uintptr_t{0});

void* stream_pointer(StreamId stream) { return reinterpret_cast<void*>(static_cast<std::uintptr_t>(stream)); }
void* stream_pointer(StreamId stream, Residency where) {
  return where == Residency::kHost ? kHostStream : stream_pointer(stream);
}

bool is_segment_action(HistoryAction action) {
  return action == HistoryAction::kSegmentAlloc || action == HistoryAction::kSegmentFree ||
         action == HistoryAction::kSegmentMap || action == HistoryAction::kSegmentUnmap;
}

c10_alloc::TraceEntry::Action to_torch(HistoryAction action) {
  using T = c10_alloc::TraceEntry;
  switch (action) {
    case HistoryAction::kAlloc: return T::ALLOC;
    case HistoryAction::kFreeRequested: return T::FREE_REQUESTED;
    case HistoryAction::kFreeCompleted: return T::FREE_COMPLETED;
    case HistoryAction::kSegmentAlloc: return T::SEGMENT_ALLOC;
    case HistoryAction::kSegmentFree: return T::SEGMENT_FREE;
    case HistoryAction::kSegmentMap: return T::SEGMENT_MAP;
    case HistoryAction::kSegmentUnmap: return T::SEGMENT_UNMAP;
    case HistoryAction::kSnapshot: return T::SNAPSHOT;
    case HistoryAction::kOom: return T::OOM;
  }
  return T::SNAPSHOT;
}

ContextLevel to_level(c10_alloc::RecordContext when) {
  switch (when) {
    case c10_alloc::RecordContext::NEVER: return ContextLevel::kNever;
    case c10_alloc::RecordContext::STATE: return ContextLevel::kState;
    case c10_alloc::RecordContext::ALLOC: return ContextLevel::kAlloc;
    case c10_alloc::RecordContext::ALL: return ContextLevel::kAll;
  }
  return ContextLevel::kNever;
}

// Contexts come from PyTorch's recorder as GatheredContext and are kept
// opaque (shared_ptr<void> to the same object): casting back is exact.
std::shared_ptr<c10::GatheredContext> to_torch(const HistoryContext& context) {
  return std::static_pointer_cast<c10::GatheredContext>(context);
}

// Segment entries' user metadata is their residency ("cotenant:host"); the
// others carry the job's (setUserMetadata). "N/A" for no compile context, as
// PyTorch's.
c10_alloc::TraceEntry to_torch(const HistoryEntry& e, c10::DeviceIndex device) {
  const bool segment = is_segment_action(e.action);
  std::string user_metadata = segment  ? std::string("cotenant:") + residency_name(e.where)
                              : e.user_metadata ? *e.user_metadata
                                                : std::string();
  c10_alloc::TraceEntry entry(to_torch(e.action), device, e.address, e.size,
                              segment ? stream_pointer(e.stream, e.where) : stream_pointer(e.stream),
                              c10::MempoolId_t{e.pool.first, e.pool.second}, /*time=*/0, to_torch(e.context),
                              e.compile_context ? *e.compile_context : std::string("N/A"), std::move(user_metadata));
  entry.time_.t_ = static_cast<time_t>(e.time_us);  // what snapshots report as time_us
  return entry;
}

// Throws the c10 error PyTorch shows for cotenant's Error.
template <typename Fn>
void with_torch_errors(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    TORCH_CHECK(false, e.what());
  }
}

}  // namespace

bool CotenantCudaAllocator::isHistoryEnabled() {
  std::lock_guard<std::mutex> lock(history_mutex_);
  return history_settings_.enabled;
}

void CotenantCudaAllocator::recordHistory(bool enabled, c10_alloc::CreateContextFn context_recorder,
                                          size_t alloc_trace_max_entries, c10_alloc::RecordContext when,
                                          bool clearHistory, const std::vector<std::string>& skip_actions) {
  HistorySettings settings;
  settings.enabled = enabled;
  settings.context = to_level(when);
  settings.max_entries = alloc_trace_max_entries;
  settings.clear = clearHistory;
  with_torch_errors([&] {
    for (const std::string& name : skip_actions) settings.skip_actions.push_back(parse_history_action(name));
  });
  if (context_recorder != nullptr) {
    settings.recorder = [context_recorder]() -> HistoryContext { return context_recorder(); };
  }
  TORCH_CHECK(!enabled || when == c10_alloc::RecordContext::NEVER || context_recorder != nullptr,
              "recording memory history with stack context needs a context recorder; use "
              "torch.cuda.memory._record_memory_history(), which passes one.");
  {
    std::lock_guard<std::mutex> lock(history_mutex_);
    history_settings_ = settings;
    history_settings_.clear = false;  // devices created later start empty anyway
  }
  for_each_device([&](DeviceAllocators& d) {
    with_torch_errors([&] { d.history->configure(settings); });
    attach_history(d, /*configure=*/false);
  });
}

void CotenantCudaAllocator::recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) {
  if (!isHistoryEnabled()) return;  // as PyTorch's: kept only while recording
  with_torch_errors([&] { on(c10::cuda::current_device()).history->record_annotation(md); });
}

void CotenantCudaAllocator::pushCompileContext(std::string& md) {
  {
    std::lock_guard<std::mutex> lock(history_mutex_);
    if (!history_settings_.enabled) return;  // as PyTorch's: only while recording
    compile_contexts_.push_back(md);
  }
  apply_history_labels();
}

void CotenantCudaAllocator::popCompileContext() {
  {
    std::lock_guard<std::mutex> lock(history_mutex_);
    if (compile_contexts_.empty()) return;
    compile_contexts_.pop_back();
  }
  apply_history_labels();
}

void CotenantCudaAllocator::setUserMetadata(const std::string& metadata) {
  {
    std::lock_guard<std::mutex> lock(history_mutex_);
    user_metadata_ = metadata;
  }
  apply_history_labels();
}

std::string CotenantCudaAllocator::getUserMetadata() {
  std::lock_guard<std::mutex> lock(history_mutex_);
  return user_metadata_;
}

void CotenantCudaAllocator::apply_history_labels(DeviceAllocators* only) {
  HistoryLabel compile_context, user_metadata;
  {
    std::lock_guard<std::mutex> lock(history_mutex_);
    if (!compile_contexts_.empty()) compile_context = std::make_shared<const std::string>(compile_contexts_.back());
    if (!user_metadata_.empty()) user_metadata = std::make_shared<const std::string>(user_metadata_);
  }
  if (only != nullptr) {
    only->history->set_labels(compile_context, user_metadata);
    return;
  }
  for_each_device([&](DeviceAllocators& d) { d.history->set_labels(compile_context, user_metadata); });
}

void CotenantCudaAllocator::attachAllocatorTraceTracker(c10_alloc::AllocatorTraceTracker tracker) {
  {
    std::lock_guard<std::mutex> lock(observers_mutex_);
    trace_trackers_.push_back(std::move(tracker));
  }
  for_each_device([&](DeviceAllocators& d) { attach_history(d, false); });
}

void CotenantCudaAllocator::attach_history(DeviceAllocators& d, bool configure) {
  if (configure) {
    HistorySettings settings;
    {
      std::lock_guard<std::mutex> lock(history_mutex_);
      settings = history_settings_;
    }
    if (settings.enabled) with_torch_errors([&] { d.history->configure(settings); });
    apply_history_labels(&d);
  }
  bool add_tracker_listener = false;
  {
    // Decided under observers_mutex_, added outside it: the listener takes
    // observers_mutex_ under the history's lock, never the other way round.
    std::lock_guard<std::mutex> lock(observers_mutex_);
    if (!trace_trackers_.empty() && !d.history_feeds_trace_trackers) {
      d.history_feeds_trace_trackers = true;
      add_tracker_listener = true;
    }
  }
  if (add_tracker_listener) {
    const c10::DeviceIndex device = d.device;
    d.history->add_listener([this, device](const HistoryEntry& e) {
      std::vector<c10_alloc::AllocatorTraceTracker> trackers;
      {
        std::lock_guard<std::mutex> lock(observers_mutex_);
        trackers = trace_trackers_;
      }
      const c10_alloc::TraceEntry entry = to_torch(e, device);
      for (const auto& tracker : trackers) tracker(entry);
    });
  }
  // Recording off and no tracker: no sink, so the allocators pay nothing.
  const bool active = d.history->active();
  d.main->set_event_sink(active ? &d.history->feed({0, 0}) : nullptr);
  for (auto& [id, pool] : d.pools->pools()) pool->set_event_sink(active ? &d.history->feed(id) : nullptr);
  // Regions' allocations are the default pool's, as snapshots report them.
  d.regions->set_event_sink(active ? &d.history->feed({0, 0}) : nullptr);
}

void CotenantCudaAllocator::add_segments_to_snapshot(DeviceAllocators& d, CachingAllocator& allocator,
                                                     c10::MempoolId_t pool, c10_alloc::SnapshotInfo& out) {
  for (const SegmentInfo& s : allocator.snapshot()) {
    for (const SegmentPart& part : residency_parts(s)) {
      c10::CachingDeviceAllocator::SegmentInfo segment;
      segment.device = d.device;
      segment.address = part.address;
      segment.total_size = part.size;
      segment.stream = stream_pointer(s.stream, part.where);
      segment.is_large = s.pool == PoolKind::kLarge;
      // Page-mapped, as PyTorch's expandable segments: pieces come and go
      // with segment_map / segment_unmap entries.
      segment.is_expandable = !s.pinned_fallback;
      segment.owner_private_pool_id = pool;
      for (const BlockInfo& b : part.blocks) {
        c10::CachingDeviceAllocator::BlockInfo block;
        block.size = b.size;
        block.requested_size = b.requested_size;
        block.allocated = b.allocated;
        block.active = b.allocated || b.waiting_on_events;
        if (block.active) {
          block.context_when_allocated = to_torch(d.history->context_of(b.address));
          segment.active_size += b.size;
        }
        if (b.allocated) {
          segment.allocated_size += b.size;
          segment.requested_size += b.requested_size;
        }
        segment.blocks.push_back(std::move(block));
      }
      out.segments.push_back(std::move(segment));
    }
  }
}

void CotenantCudaAllocator::add_history_to_snapshot(DeviceAllocators& d, c10_alloc::SnapshotInfo& out,
                                                    bool include_traces) {
  d.history->record_snapshot();  // as PyTorch's: a trace entry marks when the snapshot was taken
  if (!include_traces) return;
  auto& trace = out.device_traces.at(static_cast<size_t>(d.device));
  for (const HistoryEntry& e : d.history->entries()) trace.push_back(to_torch(e, d.device));
  for (const HistoryAnnotation& a : d.history->annotations()) {
    c10::CachingDeviceAllocator::AnnotationEntry annotation(d.device, /*time=*/0);
    annotation.time_.t_ = static_cast<time_t>(a.time_us);  // what snapshots report as time_us
    for (const auto& [name, value] : a.metadata) annotation.recordUserMetadata(name, value);
    out.external_annotations.push_back(std::move(annotation));
  }
}

}  // namespace cotenant::torch_ext
