// GpuBlock: the one definition of the per-GPU shared-memory segment through
// which the jobs on one GPU find each other with no coordinator (job <-> job).
// What the coordinator and a job tell each other (caps, shares, commands,
// reports, iteration times) travels in the per-job block instead
// (job_block.h); the coordinator never writes this segment.
//
// One segment per (GPU, user or group), named by the GPU's UUID (see
// GpuPeerSegment::default_name). Every job that calls enable(role=...) on
// that GPU opens it (create-or-attach) and claims a slot:
//   guaranteed     at most one per GPU: publishes whether it is busy (work in
//                  flight, last activity);
//   opportunistic  up to kMaxOpportunisticJobs: registers (so the GPU's
//                  opportunistic jobs are bounded), reads the guaranteed slot
//                  at every gated op, and reports its gate's numbers for tools.
//
// Writers: each slot has one writer, the job that holds it. Slots are claimed
// and reclaimed by compare-and-swap on pid, so two jobs never hold one slot.
// Every field is a lock-free std::atomic<uint64_t> (address-free, valid
// across processes); times are CLOCK_MONOTONIC nanoseconds (one time base
// for every process of a host).
//
// Life cycle: a crashed job (dead pid, or heartbeat older than stale_after)
// is detected and its slot reclaimed by whoever looks next. A segment left by
// an earlier run or another version (wrong magic, version or size) is
// re-initialised under an exclusive flock() on the object, which also
// serialises concurrent creators; the lock dies with its holder. The name is
// never unlinked by jobs: unlinking while a newcomer attaches could split the
// jobs of one GPU across two segments. It is 1 KiB of /dev/shm.
//
// Version 2: no shares, no coordinator fields and no iteration times (they
// moved to the per-job block); the GPU's UUID in the header.
//
// Python never computes offsets: it reads and writes through GpuPeerSegment,
// bound into cotenant._core (gpu_block_layout() describes the fields).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cotenant/launch_gate.h"
#include "cotenant/shm/shm_region.h"

namespace cotenant::shm {

inline constexpr std::uint64_t kGpuBlockMagic = 0x4b425550474e4f43ull;  // "CONGPUBK" little-endian
inline constexpr std::uint32_t kGpuBlockVersion = 2;
inline constexpr std::size_t kGpuBlockUuidBytes = 48;  // "GPU-...", NUL-terminated
inline constexpr std::size_t kMaxOpportunisticJobs = 8;

using Word = std::atomic<std::uint64_t>;
static_assert(Word::is_always_lock_free, "shared-memory fields must be lock-free atomics");

struct GuaranteedSlot {
  Word pid;                  // 0: no guaranteed job on this GPU
  Word heartbeat_ns;         // refreshed by the holder at least every stale_after / 4
  Word busy;                 // 1 while it has work on the GPU (BusyTracker)
  Word ops_in_flight;        // pending completion markers
  Word last_activity_ns;     // its latest op launch
};

struct OpportunisticSlot {
  Word pid;                  // 0: free
  Word heartbeat_ns;
  Word admitted_ops;         // reported by the job, for tools
  Word waiting_ops;          // threads waiting at the gate now
  Word busy_ns_in_window;    // its GPU-busy time in its share window
};

struct GpuBlock {
  Word magic;                // kGpuBlockMagic, stored last at initialisation
  Word version;              // kGpuBlockVersion
  Word block_bytes;          // sizeof(GpuBlock)
  Word device;               // CUDA device index of the creator
  Word generation;           // increments at every (re)initialisation
  Word gpu_uuid[kGpuBlockUuidBytes / 8];  // the GPU's UUID, empty when unknown
  GuaranteedSlot guaranteed;
  OpportunisticSlot opportunistic[kMaxOpportunisticJobs];
};
static_assert(sizeof(GpuBlock) <= 1024, "keep the per-GPU segment small");

// One field of the layout, for tools that inspect a segment.
struct FieldLayout {
  std::string name;  // e.g. "guaranteed.busy", "opportunistic[3].share_bits"
  std::size_t offset;
  std::size_t bytes;
};
std::vector<FieldLayout> gpu_block_layout();

struct GuaranteedView {
  std::uint64_t pid = 0;
  bool live = false;  // pid alive and heartbeat fresh
  bool busy = false;
  std::uint64_t ops_in_flight = 0;
  Nanoseconds heartbeat_ns = 0, last_activity_ns = 0;
};

struct OpportunisticView {
  std::size_t slot = 0;
  std::uint64_t pid = 0;
  bool live = false;
  std::uint64_t admitted_ops = 0, waiting_ops = 0;
  Nanoseconds heartbeat_ns = 0, busy_ns_in_window = 0;
};

struct GpuSegmentView {
  std::uint32_t device = 0;
  std::uint64_t generation = 0;
  std::string gpu_uuid;
  GuaranteedView guaranteed;
  std::vector<OpportunisticView> opportunistic;  // held slots only
};

struct GpuPeerSegmentOptions {
  // A holder whose heartbeat is older than this counts as crashed even if
  // its pid exists (a reused pid, or a hung process).
  Nanoseconds stale_after_ns = 3'000'000'000;  // 3 s
  // The GPU's UUID, stored at creation ("" when unknown). When given, it is
  // what tells a segment of this GPU from another's, not the CUDA index
  // (jobs with different CUDA_VISIBLE_DEVICES see one GPU under two indices).
  std::string gpu_uuid;
  // The group whose members share the segment (jobs of several users on one
  // GPU); none: the segment is the caller's uid's alone.
  std::optional<gid_t> group;
};

// How open() found the segment.
enum class SegmentOpening : std::uint8_t { kCreated, kAttached, kReinitialised };
const char* to_string(SegmentOpening opening);

class GpuPeerSegment {
 public:
  // The segment of one GPU for one trust domain: "/cotenant-gpu-<key>-u<uid>",
  // or "/cotenant-gpu-<key>-g<gid>" where a group's members share it. <key>
  // is the GPU's UUID, or "index<device>" where the UUID is unknown.
  static std::string default_name(const std::string& gpu_uuid, std::uint32_t device, uid_t uid,
                                  std::optional<gid_t> group = std::nullopt);
  // Creates the segment or attaches to it; re-initialises one left by an
  // earlier run or another version (wrong magic, version, size or device).
  // Attaching reclaims the slots of crashed holders. Throws cotenant::Error
  // when the object cannot be opened (another user's, /dev/shm full).
  static GpuPeerSegment open(const std::string& name, std::uint32_t device,
                             GpuPeerSegmentOptions options = {}, Clock& clock = MonotonicClock::instance());
  // Removes the name (tests and `cotenant` admin tools only).
  static bool remove(const std::string& name);

  GpuPeerSegment(GpuPeerSegment&&) noexcept = default;
  GpuPeerSegment& operator=(GpuPeerSegment&&) noexcept = default;

  const std::string& name() const { return region_.name(); }
  SegmentOpening opening() const { return opening_; }
  GpuBlock& block() const { return *static_cast<GpuBlock*>(region_.data()); }
  const GpuPeerSegmentOptions& options() const { return options_; }

  // Claims the guaranteed slot for `pid`. Reclaims it from a crashed holder;
  // throws cotenant::Error (naming the holder) when a live job holds it.
  void claim_guaranteed(std::uint64_t pid);
  // Claims a free (or crashed holder's) opportunistic slot; returns its
  // index. Throws cotenant::Error when all kMaxOpportunisticJobs are live.
  std::size_t claim_opportunistic(std::uint64_t pid);
  // Gives a slot back (no-op unless `pid` holds it).
  void release_guaranteed(std::uint64_t pid);
  void release_opportunistic(std::size_t slot, std::uint64_t pid);
  // Refreshes the heartbeat of every slot `pid` holds.
  void heartbeat(std::uint64_t pid);
  // Frees the slots of crashed holders; returns how many were freed.
  std::size_t reclaim_crashed();

  // Guaranteed side: publish what the trackers see.
  void publish_activity(bool busy, std::uint32_t ops_in_flight, Nanoseconds last_activity_ns);
  // Opportunistic side: report the gate's numbers for tools.
  void report_gate(std::size_t slot, const LaunchGateStats& stats);

  // Whether the guaranteed job is busy, as a gate reads it: a live (fresh
  // heartbeat) holder that says busy. No system call: this runs per op.
  bool guaranteed_busy() const;
  GpuSegmentView view() const;

  // Whether a holder is alive: its pid exists and its heartbeat is fresh.
  bool holder_alive(std::uint64_t pid, Nanoseconds heartbeat_ns) const;

 private:
  GpuPeerSegment(ShmRegion region, SegmentOpening opening, GpuPeerSegmentOptions options, Clock& clock)
      : region_(std::move(region)), opening_(opening), options_(options), clock_(&clock) {}
  ShmRegion region_;
  SegmentOpening opening_;
  GpuPeerSegmentOptions options_;
  Clock* clock_;
};

// The gate's view of the segment: is the guaranteed job busy?
class SegmentPeerState final : public PeerState {
 public:
  explicit SegmentPeerState(const GpuPeerSegment& segment) : segment_(segment) {}
  bool guaranteed_busy() const override { return segment_.guaranteed_busy(); }

 private:
  const GpuPeerSegment& segment_;
};

// The guaranteed trackers' sink: the segment's guaranteed slot.
class SegmentGuaranteedSink final : public GuaranteedStateSink {
 public:
  explicit SegmentGuaranteedSink(GpuPeerSegment& segment) : segment_(segment) {}
  void publish_activity(bool busy, std::uint32_t ops_in_flight, Nanoseconds last_activity_ns) override {
    segment_.publish_activity(busy, ops_in_flight, last_activity_ns);
  }

 private:
  GpuPeerSegment& segment_;
};

}  // namespace cotenant::shm
