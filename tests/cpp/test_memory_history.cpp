#include <catch2/catch.hpp>

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "cotenant/errors.h"
#include "cotenant/memory_history.h"
#include "test_helpers.h"

using namespace cotenant;
using namespace cotenant::testing;

namespace {

// A context as the torch adapter's would be: here, a labelled object.
HistoryContext label(const std::string& text) { return std::make_shared<std::string>(text); }
std::string label_of(const HistoryContext& context) {
  return context ? *static_cast<const std::string*>(context.get()) : std::string("<none>");
}

// A recorder that hands out "ctx1", "ctx2", ... so tests can tell gathers apart.
struct CountingRecorder {
  std::shared_ptr<int> calls = std::make_shared<int>(0);
  HistoryContext operator()() const { return label("ctx" + std::to_string(++*calls)); }
};

HistorySettings recording(ContextLevel level, std::size_t max_entries = 1000) {
  HistorySettings settings;
  settings.enabled = true;
  settings.context = level;
  settings.max_entries = max_entries;
  settings.recorder = CountingRecorder{};
  return settings;
}

std::vector<HistoryAction> actions_of(const std::vector<HistoryEntry>& entries) {
  std::vector<HistoryAction> out;
  for (const HistoryEntry& e : entries) out.push_back(e.action);
  return out;
}

// What the torch adapter does around an allocation and a free.
DevicePtr allocate_with_context(MemoryHistory& history, CachingAllocator& allocator, std::size_t bytes,
                                StreamId stream = 0) {
  const HistoryContext context = history.gather(ContextLevel::kState);
  MemoryHistory::ContextScope scope(context);
  return allocator.allocate(bytes, stream);
}
void free_with_context(MemoryHistory& history, CachingAllocator& allocator, DevicePtr address) {
  const HistoryContext context = history.gather(ContextLevel::kAll);
  MemoryHistory::ContextScope scope(context);
  allocator.free(address);
}

}  // namespace

TEST_CASE("history_records_page_maps_then_alloc_then_free_with_sizes_and_stream", "[history]") {
  SimulatedBackend device(device_config(64 * kMiB));
  CachingAllocator allocator(device);
  MemoryHistory history;
  history.configure(recording(ContextLevel::kAlloc));
  allocator.set_event_sink(&history);
  const DevicePtr a = allocate_with_context(history, allocator, 3 * kMiB, 7);
  free_with_context(history, allocator, a);
  const auto entries = history.entries();
  using A = HistoryAction;
  REQUIRE(actions_of(entries) == std::vector<A>{A::kSegmentMap, A::kSegmentMap, A::kAlloc, A::kFreeRequested,
                                                A::kFreeCompleted});
  CHECK(entries[0].address == a);
  CHECK(entries[0].size == 2 * kMiB);
  CHECK(entries[1].address == a + 2 * kMiB);
  CHECK(entries[0].where == Residency::kDevice);
  CHECK(entries[2].address == a);
  CHECK(entries[2].size == 3 * kMiB);
  CHECK(entries[2].stream == 7);
  CHECK(entries[4].size == 3 * kMiB);
  for (std::size_t i = 1; i < entries.size(); ++i) CHECK(entries[i].time_us >= entries[i - 1].time_us);
  allocator.set_event_sink(nullptr);
}

TEST_CASE("context_levels_decide_which_entries_keep_a_context", "[history]") {
  SimulatedBackend device(device_config(64 * kMiB));
  CachingAllocator allocator(device);
  MemoryHistory history;
  allocator.set_event_sink(&history);

  SECTION("state keeps the context on the live block only") {
    history.configure(recording(ContextLevel::kState));
    const DevicePtr a = allocate_with_context(history, allocator, 4096);
    CHECK(label_of(history.context_of(a)) == "ctx1");
    for (const HistoryEntry& e : history.entries()) CHECK(e.context == nullptr);
    free_with_context(history, allocator, a);
    CHECK(history.context_of(a) == nullptr);  // gone with the block
  }
  SECTION("alloc puts the allocation's context on alloc and free entries") {
    history.configure(recording(ContextLevel::kAlloc));
    const DevicePtr a = allocate_with_context(history, allocator, 4096);
    free_with_context(history, allocator, a);
    const auto entries = history.entries();
    REQUIRE(entries.back().action == HistoryAction::kFreeCompleted);
    CHECK(label_of(entries.back().context) == "ctx1");
    CHECK(label_of(entries[entries.size() - 2].context) == "ctx1");  // free_requested
  }
  SECTION("all gathers a second context at free") {
    history.configure(recording(ContextLevel::kAll));
    const DevicePtr a = allocate_with_context(history, allocator, 4096);
    free_with_context(history, allocator, a);
    const auto entries = history.entries();
    CHECK(label_of(entries[entries.size() - 3].context) == "ctx1");  // alloc
    CHECK(label_of(entries.back().context) == "ctx2");               // free_completed
  }
  allocator.set_event_sink(nullptr);
}

TEST_CASE("record_stream_free_completes_later_with_its_own_entry", "[history]") {
  SimulatedBackend device(device_config(64 * kMiB, /*events_immediate=*/false));
  CachingAllocator allocator(device);
  MemoryHistory history;
  history.configure(recording(ContextLevel::kAlloc));
  allocator.set_event_sink(&history);
  const DevicePtr a = allocate_with_context(history, allocator, 4096, 1);
  allocator.record_stream(a, 2);
  free_with_context(history, allocator, a);
  CHECK(history.entries().back().action == HistoryAction::kFreeRequested);
  CHECK(label_of(history.context_of(a)) == "ctx1");  // still live: waiting on stream 2
  device.complete_stream(2);
  allocate_with_context(history, allocator, 4096, 1);  // processes completed events
  const auto entries = history.entries();
  std::size_t completed = 0;
  for (const HistoryEntry& e : entries) completed += e.action == HistoryAction::kFreeCompleted && e.address == a;
  CHECK(completed == 1);
  allocator.set_event_sink(nullptr);
}

TEST_CASE("ring_keeps_the_newest_max_entries_oldest_first", "[history]") {
  SimulatedBackend device(device_config(64 * kMiB));
  CachingAllocator allocator(device);
  MemoryHistory history;
  history.configure(recording(ContextLevel::kNever, 4));
  allocator.set_event_sink(&history);
  std::vector<DevicePtr> blocks;
  for (int i = 0; i < 6; ++i) blocks.push_back(allocator.allocate(4096 * (i + 1), 0));
  const auto entries = history.entries();
  REQUIRE(entries.size() == 4);
  for (int i = 0; i < 4; ++i) {
    CHECK(entries[i].action == HistoryAction::kAlloc);
    CHECK(entries[i].address == blocks[i + 2]);
  }
  allocator.set_event_sink(nullptr);
}

TEST_CASE("changing_max_entries_keeps_the_newest_entries_in_order", "[history]") {
  SimulatedBackend device(device_config(64 * kMiB));
  CachingAllocator allocator(device);
  MemoryHistory history;
  history.configure(recording(ContextLevel::kNever, 3));
  allocator.set_event_sink(&history);
  std::vector<DevicePtr> blocks;
  for (int i = 0; i < 5; ++i) blocks.push_back(allocator.allocate(4096 * (i + 1), 0));  // ring wrapped
  history.configure(recording(ContextLevel::kNever, 4));                              // grows
  blocks.push_back(allocator.allocate(4096 * 6, 0));
  auto entries = history.entries();
  REQUIRE(entries.size() == 4);
  for (int i = 0; i < 4; ++i) CHECK(entries[i].address == blocks[i + 2]);
  history.configure(recording(ContextLevel::kNever, 2));  // shrinks: the newest two stay
  entries = history.entries();
  REQUIRE(entries.size() == 2);
  CHECK(entries[0].address == blocks[4]);
  CHECK(entries[1].address == blocks[5]);
  allocator.set_event_sink(nullptr);
}

TEST_CASE("skipped_actions_stay_out_of_the_ring_but_listeners_see_them", "[history]") {
  SimulatedBackend device(device_config(64 * kMiB));
  CachingAllocator allocator(device);
  MemoryHistory history;
  HistorySettings settings = recording(ContextLevel::kNever);
  settings.skip_actions = {parse_history_action("free_requested"), parse_history_action("segment_map")};
  history.configure(settings);
  std::vector<HistoryAction> heard;
  history.add_listener([&](const HistoryEntry& e) { heard.push_back(e.action); });
  allocator.set_event_sink(&history);
  allocator.free(allocator.allocate(4096, 0));
  using A = HistoryAction;
  CHECK(actions_of(history.entries()) == std::vector<A>{A::kAlloc, A::kFreeCompleted});
  CHECK(heard == std::vector<A>{A::kSegmentMap, A::kAlloc, A::kFreeRequested, A::kFreeCompleted});
  allocator.set_event_sink(nullptr);
}

TEST_CASE("listeners_hear_entries_while_recording_is_off", "[history]") {
  SimulatedBackend device(device_config(64 * kMiB));
  CachingAllocator allocator(device);
  MemoryHistory history;
  std::size_t heard = 0;
  CHECK_FALSE(history.active());
  history.add_listener([&](const HistoryEntry&) { ++heard; });
  CHECK(history.active());
  allocator.set_event_sink(&history);
  allocator.allocate(4096, 0);
  CHECK(heard == 2);  // segment_map, alloc
  CHECK(history.entries().empty());
  allocator.set_event_sink(nullptr);
}

TEST_CASE("unknown_action_names_and_missing_recorders_are_refused_with_the_fix", "[history]") {
  try {
    parse_history_action("allocate");
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("free_requested") != std::string::npos);
  }
  MemoryHistory history;
  HistorySettings settings = recording(ContextLevel::kAlloc);
  settings.recorder = nullptr;
  CHECK_THROWS_AS(history.configure(settings), Error);
  CHECK_FALSE(history.enabled());
}

TEST_CASE("stopping_clears_the_ring_and_block_contexts_and_clear_on_start_drops_old_entries", "[history]") {
  SimulatedBackend device(device_config(64 * kMiB));
  CachingAllocator allocator(device);
  MemoryHistory history;
  history.configure(recording(ContextLevel::kState));
  allocator.set_event_sink(&history);
  const DevicePtr a = allocate_with_context(history, allocator, 4096);
  REQUIRE_FALSE(history.entries().empty());
  history.configure(recording(ContextLevel::kState));  // enabling again keeps the ring
  CHECK_FALSE(history.entries().empty());
  HistorySettings clear = recording(ContextLevel::kState);
  clear.clear = true;
  history.configure(clear);
  CHECK(history.entries().empty());
  CHECK(history.context_of(a) != nullptr);
  history.configure(HistorySettings{});  // off
  CHECK(history.entries().empty());
  CHECK(history.context_of(a) == nullptr);
  CHECK(history.gather(ContextLevel::kState) == nullptr);
  allocator.set_event_sink(nullptr);
}

TEST_CASE("a_spill_is_an_unmap_of_device_memory_then_a_map_of_host_memory_at_the_same_address", "[history]") {
  SimulatedBackend device(device_config(64 * kMiB));
  CachingAllocator allocator(device);
  MemoryHistory history;
  history.configure(recording(ContextLevel::kNever));
  allocator.set_event_sink(&history);
  const DevicePtr a = allocator.allocate(4 * kMiB, 0);
  allocator.set_memory_cap(2 * kMiB);
  allocator.apply_pending_migrations();
  auto entries = history.entries();
  REQUIRE(entries.size() >= 2);
  const HistoryEntry& unmapped = entries[entries.size() - 2];
  const HistoryEntry& mapped = entries.back();
  CHECK(unmapped.action == HistoryAction::kSegmentUnmap);
  CHECK(unmapped.where == Residency::kDevice);
  CHECK(mapped.action == HistoryAction::kSegmentMap);
  CHECK(mapped.where == Residency::kHost);
  CHECK(mapped.address == unmapped.address);
  CHECK(mapped.size == 2 * kMiB);
  CHECK((mapped.address == a || mapped.address == a + 2 * kMiB));

  allocator.set_memory_cap(kNoCap);
  allocator.apply_pending_migrations();
  entries = history.entries();
  CHECK(entries[entries.size() - 2].action == HistoryAction::kSegmentUnmap);
  CHECK(entries[entries.size() - 2].where == Residency::kHost);
  CHECK(entries.back().action == HistoryAction::kSegmentMap);
  CHECK(entries.back().where == Residency::kDevice);
  allocator.set_event_sink(nullptr);
}

TEST_CASE("out_of_memory_is_recorded_with_the_request_and_the_free_device_bytes", "[history]") {
  SimulatedBackend device(device_config(8 * kMiB));
  AllocatorOptions options;
  CachingAllocator allocator(device, options);
  MemoryHistory history;
  history.configure(recording(ContextLevel::kAlloc));
  allocator.set_event_sink(&history);
  const DevicePtr first = allocate_with_context(history, allocator, 6 * kMiB);
  const HistoryContext context = history.gather(ContextLevel::kState);
  {
    MemoryHistory::ContextScope scope(context);
    CHECK_THROWS_AS(allocator.allocate(4 * kMiB, 3), OutOfMemoryError);
  }
  const auto entries = history.entries();
  const HistoryEntry& oom = entries.back();
  CHECK(oom.action == HistoryAction::kOom);
  CHECK(oom.size == 4 * kMiB);
  CHECK(oom.stream == 3);
  CHECK(oom.address == device.device_free_bytes());
  CHECK(label_of(oom.context) == "ctx2");
  // The history before it is intact (the failed attempt mapped a page
  // before the device ran out: that page stays, as cache).
  std::size_t allocs = 0;
  for (const HistoryEntry& e : entries) allocs += e.action == HistoryAction::kAlloc && e.address == first;
  CHECK(allocs == 1);
  CHECK(label_of(history.context_of(first)) == "ctx1");
  allocator.set_event_sink(nullptr);
}

TEST_CASE("pool_feeds_tag_entries_with_their_pool", "[history]") {
  SimulatedBackend device(device_config(64 * kMiB));
  CachingAllocator main(device), pool(device);
  MemoryHistory history;
  history.configure(recording(ContextLevel::kNever));
  main.set_event_sink(&history.feed({0, 0}));
  pool.set_event_sink(&history.feed({1, 2}));
  main.allocate(4096, 0);
  pool.allocate(4096, 0);
  const auto entries = history.entries();
  CHECK(entries[1].pool == HistoryPoolId{0, 0});
  CHECK(entries[3].pool == HistoryPoolId{1, 2});
  CHECK(&history.feed({1, 2}) == &history.feed({1, 2}));
  main.set_event_sink(nullptr);
  pool.set_event_sink(nullptr);
}

TEST_CASE("without_a_sink_the_allocator_reports_nothing_and_works_as_before", "[history]") {
  SimulatedBackend device(device_config(64 * kMiB));
  CachingAllocator allocator(device);
  MemoryHistory history;
  history.configure(recording(ContextLevel::kAll));
  allocator.set_event_sink(&history);
  allocator.set_event_sink(nullptr);
  allocator.free(allocator.allocate(4096, 0));
  CHECK(history.entries().empty());
}

TEST_CASE("snapshot_runs_split_by_residency_and_parts_never_cut_a_live_block", "[history]") {
  SimulatedBackend device(device_config(64 * kMiB));
  CachingAllocator allocator(device);
  const DevicePtr a = allocator.allocate(3 * kMiB, 0);      // pages 0-1
  const DevicePtr b = allocator.allocate(2 * kMiB, 0);      // pages 1-2
  allocator.set_memory_cap(4 * kMiB);                       // one page must leave the device
  allocator.apply_pending_migrations();
  const SegmentInfo segment = allocator.snapshot().front();
  REQUIRE(segment.host_bytes == 2 * kMiB);
  std::size_t run_bytes = 0;
  for (const auto& run : segment.mapped_runs) run_bytes += run.size;
  CHECK(run_bytes == 6 * kMiB);
  CHECK(segment.mapped_runs.size() >= 2);  // device and host runs

  const auto parts = residency_parts(segment);
  std::size_t part_bytes = 0;
  std::size_t live_blocks = 0;
  for (const SegmentPart& part : parts) {
    part_bytes += part.size;
    DevicePtr at = part.address;
    for (const BlockInfo& block : part.blocks) {
      CHECK(block.address == at);  // the blocks tile the part
      at += block.size;
      if (block.allocated) {
        ++live_blocks;
        CHECK((block.address == a || block.address == b));
        CHECK(block.size == allocator.allocation_size(block.address));  // whole, never cut
      }
    }
    CHECK(at == part.address + part.size);
  }
  CHECK(part_bytes == 6 * kMiB);  // every mapped page, nothing unmapped
  CHECK(live_blocks == 2);
  bool any_host = false;
  for (const SegmentPart& part : parts) any_host = any_host || part.where == Residency::kHost;
  CHECK(any_host);
}

TEST_CASE("a_pinned_fallback_segment_is_one_host_part_and_a_segment_alloc_entry", "[history]") {
  SimulatedBackend device(device_config(64 * kMiB, true, /*host_mappable=*/false));
  CachingAllocator allocator(device);
  MemoryHistory history;
  history.configure(recording(ContextLevel::kNever));
  allocator.set_event_sink(&history);
  allocator.set_memory_cap(2 * kMiB);
  allocator.allocate(2 * kMiB, 0);
  const DevicePtr over = allocator.allocate(2 * kMiB, 0);  // over the cap: pinned host memory
  const auto entries = history.entries();
  CHECK(entries[entries.size() - 2].action == HistoryAction::kSegmentAlloc);
  CHECK(entries[entries.size() - 2].where == Residency::kHost);
  CHECK(entries.back().address == over);
  SegmentInfo pinned;
  for (const SegmentInfo& s : allocator.snapshot()) {
    if (s.pinned_fallback) pinned = s;
  }
  const auto parts = residency_parts(pinned);
  REQUIRE(parts.size() == 1);
  CHECK(parts[0].where == Residency::kHost);
  CHECK(parts[0].address == over);
  allocator.free(over);
  allocator.empty_cache();
  CHECK(history.entries().back().action == HistoryAction::kSegmentFree);
  allocator.set_event_sink(nullptr);
}

TEST_CASE("threads_recording_at_once_each_get_their_own_contexts", "[history]") {
  SimulatedBackend device(device_config(256 * kMiB));
  CachingAllocator allocator(device);
  MemoryHistory history;
  HistorySettings settings = recording(ContextLevel::kAlloc, 100000);
  settings.recorder = [] { return label("thread"); };
  history.configure(settings);
  allocator.set_event_sink(&history);
  constexpr int kThreads = 4, kRounds = 200;
  std::atomic<int> wrong_block_contexts{0};  // Catch2 assertions are not for worker threads
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kRounds; ++i) {
        const HistoryContext mine = label("t" + std::to_string(t));
        DevicePtr address;
        {
          MemoryHistory::ContextScope scope(mine);
          address = allocator.allocate(4096 * (1 + i % 7), static_cast<StreamId>(t));
        }
        if (label_of(history.context_of(address)) != "t" + std::to_string(t)) ++wrong_block_contexts;
        allocator.free(address);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  CHECK(wrong_block_contexts == 0);
  std::size_t allocs = 0, frees = 0;
  for (const HistoryEntry& e : history.entries()) {
    if (e.action == HistoryAction::kAlloc) {
      ++allocs;
      CHECK(label_of(e.context) == "t" + std::to_string(e.stream));
    }
    frees += e.action == HistoryAction::kFreeCompleted;
  }
  CHECK(allocs == kThreads * kRounds);
  CHECK(frees == kThreads * kRounds);
  allocator.set_event_sink(nullptr);
}

TEST_CASE("entries_carry_the_labels_set_when_they_were_recorded", "[history]") {
  SimulatedBackend device(device_config(64 * kMiB));
  CachingAllocator allocator(device);
  MemoryHistory history;
  history.configure(recording(ContextLevel::kNever));
  allocator.set_event_sink(&history);
  const DevicePtr a = allocator.allocate(4096, 0);  // no labels yet
  history.set_labels(std::make_shared<const std::string>("compiled_fn"), std::make_shared<const std::string>("run 7"));
  const DevicePtr b = allocator.allocate(4096, 0);
  history.set_labels(nullptr, std::make_shared<const std::string>("run 8"));  // the compile context ended
  allocator.free(b);
  history.record_snapshot();
  const auto entries = history.entries();
  REQUIRE(entries.size() >= 5);
  auto text = [](const HistoryLabel& l) { return l ? *l : std::string("<none>"); };
  std::vector<std::string> labels;
  for (const HistoryEntry& e : entries) {
    if (e.action == HistoryAction::kSegmentMap) continue;
    labels.push_back(std::string(history_action_name(e.action)) + " " + text(e.compile_context) + " " +
                     text(e.user_metadata) + (e.address == a ? " a" : ""));
  }
  CHECK(labels == std::vector<std::string>{"alloc <none> <none> a", "alloc compiled_fn run 7",
                                           "free_requested <none> run 8", "free_completed <none> run 8",
                                           "snapshot <none> run 8"});
  allocator.set_event_sink(nullptr);
}

TEST_CASE("annotations_are_kept_while_recording_newest_max_entries_and_cleared_with_the_ring", "[history]") {
  MemoryHistory history;
  history.record_annotation({{"name", "before"}, {"stage", "START"}});  // not recording: not kept
  CHECK(history.annotations().empty());
  history.configure(recording(ContextLevel::kNever, 3));
  for (int i = 0; i < 5; ++i) history.record_annotation({{"name", "step" + std::to_string(i)}, {"stage", "START"}});
  const auto kept = history.annotations();
  REQUIRE(kept.size() == 3);
  CHECK(kept[0].metadata.at(0).second == "step2");
  CHECK(kept[2].metadata.at(0).second == "step4");
  CHECK(kept[2].metadata.at(1) == std::pair<std::string, std::string>{"stage", "START"});
  CHECK(kept[0].time_us > 0);
  CHECK(kept[0].time_us <= kept[2].time_us);
  history.configure(recording(ContextLevel::kNever, 2));  // a smaller ring keeps the newest
  REQUIRE(history.annotations().size() == 2);
  CHECK(history.annotations()[0].metadata.at(0).second == "step3");
  history.configure(HistorySettings{});  // off
  CHECK(history.annotations().empty());
}
