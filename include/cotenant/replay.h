// Replays an allocation trace through the caching allocator on the simulated
// device, to answer "what happens to my job under a 6 GiB cap?" without a GPU.
//
// A trace is a sequence of operations on allocation ids (the trace's own
// names for its blocks, e.g. the addresses of a PyTorch memory snapshot):
// alloc id size stream / free id / record_stream id stream / cap bytes /
// empty_cache / iteration. Cap and iteration operations are safe points, and
// so is the op after one that left pages waiting to move (a job's next op
// entry): pending page migrations are applied there, as the torch layer
// does when the process is quiet. An iteration op marks the end of one step of the
// job's loop (cotenant.iteration() in a real job); the per-iteration figures
// count from one mark to the next.
//
// The result holds what a user compares between runs: peaks, fragmentation,
// spill traffic and the time the allocator spent per call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cotenant/backend.h"
#include "cotenant/caching_allocator.h"
#include "cotenant/errors.h"
#include "cotenant/simulated_backend.h"

namespace cotenant {

enum class ReplayOpKind : std::uint8_t { kAlloc, kFree, kRecordStream, kCap, kEmptyCache, kIteration };

// One trace operation. Fields a kind does not use are ignored.
struct ReplayOp {
  ReplayOpKind kind = ReplayOpKind::kAlloc;
  std::uint64_t id = 0;      // kAlloc, kFree, kRecordStream: the allocation's id in the trace
  std::uint64_t bytes = 0;   // kAlloc: requested bytes; kCap: the new cap (kNoCap removes it)
  StreamId stream = 0;       // kAlloc: the allocating stream; kRecordStream: the using stream

  static ReplayOp alloc(std::uint64_t id, std::uint64_t bytes, StreamId stream = 0) {
    return {ReplayOpKind::kAlloc, id, bytes, stream};
  }
  static ReplayOp free(std::uint64_t id) { return {ReplayOpKind::kFree, id, 0, 0}; }
  static ReplayOp record_stream(std::uint64_t id, StreamId stream) {
    return {ReplayOpKind::kRecordStream, id, 0, stream};
  }
  static ReplayOp cap(std::uint64_t bytes) { return {ReplayOpKind::kCap, 0, bytes, 0}; }
  static ReplayOp empty_cache() { return {ReplayOpKind::kEmptyCache, 0, 0, 0}; }
  static ReplayOp iteration() { return {ReplayOpKind::kIteration, 0, 0, 0}; }
};

struct ReplayConfig {
  SimulatedDeviceConfig device;
  AllocatorOptions allocator;
  std::uint64_t initial_cap = kNoCap;  // device-resident bound before the first op
};

struct ReplayResult {
  std::uint64_t num_ops = 0;
  std::uint64_t num_allocs = 0;         // successful allocations (0-byte ones included)
  std::uint64_t num_frees = 0;
  std::uint64_t num_ooms = 0;           // allocations that failed on device and host
  std::int64_t peak_allocated_bytes = 0;  // allocated_bytes.all.peak (rounded sizes)
  std::int64_t peak_requested_bytes = 0;  // requested_bytes.all.peak (sizes as asked)
  std::int64_t peak_reserved_bytes = 0;   // reserved_bytes.all.peak (device + host pages)
  std::int64_t peak_device_resident_bytes = 0;
  // peak reserved / peak allocated; 1.0 is perfect packing, 0 for an empty trace.
  double fragmentation = 0.0;
  std::int64_t spilled_bytes = 0;       // cumulative device -> host page moves
  std::int64_t restored_bytes = 0;      // cumulative host -> device page moves
  std::int64_t num_migrations = 0;      // page moves, both directions
  std::int64_t num_spilled_allocations = 0;  // allocations placed on the host at birth
  // Wall time inside CachingAllocator::allocate / free, summed over the
  // calls (steady_clock around each call), and per call.
  std::uint64_t alloc_ns_total = 0;
  std::uint64_t free_ns_total = 0;
  double ns_per_alloc = 0.0;
  double ns_per_free = 0.0;
  // Driver work: pages mapped to back allocations (device or host, each a
  // create + map + set-access on a GPU) and pages unmapped and released.
  // Page moves between device and host are num_migrations, not these.
  std::int64_t num_page_maps = 0;
  std::int64_t num_page_unmaps = 0;
  // num_page_maps / (peak reserved bytes / page size): how often, on
  // average, each page of the peak footprint was mapped. 1.0 is the least.
  double maps_per_peak_page = 0.0;
  // Per iteration (ops up to each iteration mark; ops after the last mark
  // belong to none): page maps, and live bytes on host pages that an
  // allocation or a free touched (bytes of the block on host pages).
  std::vector<std::int64_t> maps_per_iteration;
  std::vector<std::int64_t> host_touched_bytes_per_iteration;
  // Live bytes on host pages (CachingAllocator::host_live_bytes()) after
  // each op, averaged over the iteration's ops: what kernels would reach
  // across the bus, whether or not an allocation or free touches it. On a
  // GPU a capped step's time follows it (docs/allocator.md).
  std::vector<std::int64_t> host_live_bytes_per_iteration;
  // Its floor: live bytes over the cap after each op (0 under it), averaged
  // the same way. No placement keeps less on the host (pages round it up).
  std::vector<std::int64_t> host_live_floor_bytes_per_iteration;
  // Bytes page moves carried (spilled plus restored) in each iteration, and
  // the safe points that moved pages (on a GPU each waits for the device).
  std::vector<std::int64_t> moved_bytes_per_iteration;
  std::vector<std::int64_t> safe_points_per_iteration;
  // Means over the warm iterations: the last half of them (at least one),
  // so a loop's first steps, which build its working set, do not count.
  // -1 when the trace has fewer than 2 iteration marks.
  double steady_maps_per_iteration = -1.0;
  double steady_host_touched_bytes_per_iteration = -1.0;
  double steady_host_live_bytes = -1.0;
  double steady_host_live_floor_bytes = -1.0;
  double steady_moved_bytes_per_iteration = -1.0;
  double steady_safe_points_per_iteration = -1.0;
  std::int64_t num_safe_points = 0;  // safe points that moved pages, the whole replay
  // Where the reserved memory is at the op that first reaches peak
  // reserved (the allocation that maps its last page), in bytes that sum to
  // peak reserved: live blocks, free bytes inside pages that hold a live
  // block (the slack of partly used pages), and mapped pages no live block
  // touches (free pages stranded in holes, or held for a spill). With the
  // allocation that reached the peak and the largest hole (a free block
  // below the segment's last live block) at that moment: a request a little
  // larger than every hole is what maps fresh pages while holes stay mapped.
  std::int64_t at_peak_live_bytes = 0;
  std::int64_t at_peak_partial_page_free_bytes = 0;
  std::int64_t at_peak_free_page_bytes = 0;
  std::int64_t at_peak_request_bytes = 0;
  std::int64_t at_peak_largest_hole_bytes = 0;
  // The least fragmentation whole pages allow: peak allocated rounded up to
  // pages, over peak allocated. No placement goes below it.
  double fragmentation_floor = 0.0;
  AllocatorStats final_stats;           // the allocator's statistics after the last op
};

// A trace that cannot be replayed (free of an id that is not live, alloc of a
// live id, a zero cap). `op_index` is the 0-based position of the offending
// op, so a reader of a trace file can name its line; `reason` is the message
// without the position.
class ReplayError : public Error {
 public:
  ReplayError(std::size_t op_index, const std::string& reason);
  std::size_t op_index() const { return op_index_; }
  const std::string& reason() const { return reason_; }

 private:
  std::size_t op_index_;
  std::string reason_;
};

// Runs `ops` through a fresh CachingAllocator on a fresh SimulatedBackend.
// An allocation that runs out of memory counts in num_ooms and its id is
// remembered as failed, so the trace's later free of it is skipped. Throws
// ReplayError at the first op that makes no sense for the trace so far,
// before that op changes anything.
ReplayResult replay(const std::vector<ReplayOp>& ops, const ReplayConfig& config = {});

// The same, on a backend and allocator the caller owns (to inspect them
// afterwards). The allocator must be empty and use `backend`.
ReplayResult replay(const std::vector<ReplayOp>& ops, CachingAllocator& allocator);

// The wall time of a run of ops back to back, with no per-call clock reads:
// what bench_core times an alloc+free pair by. Per-call timing (replay's
// alloc_ns_total / free_ns_total) reads the clock twice around each call, and
// those reads (20-40 ns each on a server CPU) are a fair share of a call of a
// few hundred; here two reads bracket the whole timed run.
struct OpTiming {
  std::uint64_t ns = 0;       // wall time of ops [first_timed, end)
  std::uint64_t cpu_ns = 0;   // the thread's CPU time over them (not the time another process held its core)
  std::uint64_t allocs = 0;   // allocations among them (0-byte ones included)
  std::uint64_t frees = 0;
  std::uint64_t marks = 0;    // iteration marks among them (mark_iteration is timed too)
  // Over the whole run, warm-up included: what shows the placement is
  // replay()'s.
  std::int64_t num_page_maps = 0;
  std::int64_t peak_reserved_bytes = 0;
};

// Runs `ops` through a fresh CachingAllocator on a fresh SimulatedBackend,
// the first `first_timed` untimed (a warm-up), the rest timed as one. It
// makes the calls replay() makes for each kind of op, and the safe point
// before each op, so the allocator places the same way, and nothing else
// between them (no statistics read, no peak tracked); a trace's ids are
// resolved to slots before the clock starts. Throws ReplayError, before any
// op runs, where replay() would refuse an op (a free or record_stream of an
// id that is not live, an alloc of a live one, a cap of 0 bytes);
// OutOfMemoryError if an allocation fails (a timing needs a trace that
// fits); Error if first_timed is past the end.
OpTiming time_ops(const std::vector<ReplayOp>& ops, std::size_t first_timed, const ReplayConfig& config = {});

const char* replay_op_kind_name(ReplayOpKind kind);

}  // namespace cotenant
