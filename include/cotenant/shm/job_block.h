// JobBlock: the one definition of the per-job shared-memory block, the
// channel between the coordinator and one job (coordinator <-> job). What
// jobs on one GPU tell each other travels in the per-GPU segment instead
// (gpu_block.h); nothing travels both ways.
//
// The coordinator creates one block per registered job (ShmRegion, named
// "/cotenant-<node key>-job-<id>") and the job's C++ JobChannel thread opens
// it. Python never computes offsets: both sides read and write through the
// functions below (bound into cotenant._core), so this header is the single
// source of the layout, and each record's fields are listed once (the
// COTENANT_JOB_*_FIELDS lists generate the structs, the words, the copies
// and the Python dictionaries).
//
// Three sections, each with exactly one writer:
//   identity  written once by the coordinator before the name is handed out
//             (job id, name, role, device and its UUID, the registering
//             process: pid, its start time, uid);
//   control   written by the coordinator: desired cap and share (levels) and
//             one command (an edge: applied once per command_sequence). The
//             coordinator keeps these values in its own memory and never
//             reads them back, so nothing a job writes here can stop it;
//   report    written by the job: what it holds and how fast it runs (the
//             one iteration measurement: IterationTracker's, nanoseconds),
//             which control values it has applied, and a heartbeat. The
//             coordinator validates every number it reads.
// Two more words sit outside the sections: the job's heartbeat (written with
// each report) and the coordinator's, which the coordinator writes at every
// tick beside how long a job waits on a silent coordinator before it runs on
// its own (JobChannel: a suspended or paused job must not stay so for good).
// Control and report are each guarded by a seqlock: the writer makes the
// sequence odd, writes, makes it even; a reader retries until it sees the
// same even sequence before and after. A writer never trusts the sequence it
// finds (it starts from it rounded up to odd), so a section left mid-update,
// or tampered with, is repaired by the next write. Every field is a lock-free
// std::atomic<uint64_t> (address-free, so valid across processes), which
// keeps torn reads from being undefined behaviour; doubles travel as bits.
//
// A reader never returns a torn section: read_control / read_report wait at
// most `patience` for a writer to finish, then throw cotenant::Error (the
// job's channel: 250 ms; the coordinator uses try_read_report, which gives
// up after 2 ms, so one job cannot hold it up).
//
// owner_token: a random number the coordinator writes into the header and
// keeps in its durable state; on restart it adopts only blocks whose token
// its state names (docs/coordinator.md, "Security model").
//
// Versioning: kJobBlockMagic identifies the block, kJobBlockVersion changes
// whenever a field moves. A reader refuses a block of another version.
// Version 2: one iteration measurement (ns), cap-only role, pid start time,
// GPU UUID, owner token, effective share; coordinator-owned control.
// Version 3: host_pool_bytes (pinned host pages the job holds for spills).
// Version 4: host_room_bytes (what the job may still pin on the host).
// Version 5: the coordinator's heartbeat and the silence after which a job
// runs on its own.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

#include "cotenant/cap.h"

namespace cotenant::shm {

inline constexpr std::uint64_t kJobBlockMagic = 0x4b4c424f4a4e4f43ull;  // "CONJOBLK" little-endian
inline constexpr std::uint32_t kJobBlockVersion = 6;
inline constexpr std::size_t kJobNameBytes = 64;          // including the terminating NUL
inline constexpr std::size_t kGpuUuidBytes = 48;         // "GPU-xxxxxxxx-...", NUL-terminated
// How long a job waits on a silent coordinator before it runs on its own, by
// default: long enough for a coordinator's restart (well under 1 s) and a
// slow tick, short enough that a suspended job does not wait for good on a
// coordinator that is gone.
inline constexpr std::uint64_t kDefaultCoordinatorSilenceLimitNs = 30'000'000'000ull;

// guaranteed: has the GPU first; opportunistic: runs in its idle slots;
// cap_only: a memory cap and nothing else (no launch gate, no share).
enum class JobRole : std::uint32_t { kGuaranteed = 0, kOpportunistic = 1, kCapOnly = 2 };
const char* job_role_name(JobRole role);
JobRole parse_job_role(std::string_view text);  // throws cotenant::Error

// One-shot commands from the coordinator. Cap and share are levels (the job
// converges to them); commands are edges (run once, acknowledged by sequence).
enum class JobCommand : std::uint32_t {
  kNone = 0,
  kSpillAll = 1,    // move every device page to the host (suspend's memory half)
  kRestoreAll = 2,  // bring host pages back, within the cap
  kSuspend = 3,     // stop launching (share 0) and spill everything
  kResume = 4,      // restore and launch again at the current share
};
const char* job_command_name(JobCommand command);

// The job's lifecycle as it reports it.
enum class JobState : std::uint32_t { kStarting = 0, kRunning = 1, kSuspended = 2, kExited = 3 };
const char* job_state_name(JobState state);

struct JobIdentity {
  std::uint64_t job_id = 0;
  std::string name;              // at most kJobNameBytes - 1 bytes (the coordinator refuses longer ones)
  JobRole role = JobRole::kOpportunistic;
  std::uint32_t device = 0;      // CUDA device index in the job's process
  std::string gpu_uuid;          // the device's UUID ("GPU-..."), empty when unknown
  std::uint64_t pid = 0;         // the process that registered (SO_PEERCRED)
  std::uint64_t pid_start_ticks = 0;  // its start time (/proc/<pid>/stat field 22): tells a reused pid apart
  std::uint64_t uid = 0;
  std::uint64_t created_ns = 0;  // CLOCK_REALTIME, nanoseconds
};

// X(type, name, initial value): the control section's fields, written by the
// coordinator only.
#define COTENANT_JOB_CONTROL_FIELDS(X)                                                  \
  X(std::uint64_t, memory_cap, kNoCap) /* bytes on the device (Cap::to_word()) */        \
  X(double, share, 1.0)               /* compute share in [0, 1]; 0 = paused */          \
  X(JobCommand, command, JobCommand::kNone)                                             \
  X(std::uint64_t, command_sequence, 0) /* increments with each new command */

// The report section's fields, written by the job only.
#define COTENANT_JOB_REPORT_FIELDS(X)                                                   \
  X(std::uint64_t, pid, 0)                                                              \
  X(std::uint64_t, uid, 0)                                                              \
  X(JobRole, role, JobRole::kOpportunistic)                                             \
  X(std::uint32_t, device, 0)                                                           \
  X(JobState, state, JobState::kStarting)                                               \
  /* memory, bytes, from the allocator's statistics */                                  \
  X(std::uint64_t, device_bytes, 0)    /* device-resident mapped bytes */               \
  X(std::uint64_t, host_bytes, 0)      /* host-resident mapped bytes (spilled) */       \
  X(std::uint64_t, host_pool_bytes, 0) /* pinned host pages held for spills, unmapped */ \
  X(std::uint64_t, host_room_bytes, kNoCap) /* it may still pin; kNoCap: unknown */   \
  X(std::uint64_t, allocated_bytes, 0) /* held by live tensors */                       \
  X(std::uint64_t, cached_bytes, 0)    /* reserved but not allocated */                 \
  X(std::uint64_t, reserved_bytes, 0)  /* device + host */                              \
  X(std::uint64_t, peak_allocated_bytes, 0)                                             \
  X(std::uint64_t, spilled_bytes, 0)   /* cumulative, device -> host */                 \
  X(std::uint64_t, restored_bytes, 0)  /* cumulative, host -> device */                 \
  X(std::uint64_t, pending_migration_bytes, 0)                                          \
  X(std::uint64_t, num_migrations, 0)  /* cumulative page moves */                      \
  /* iterations: IterationTracker's figures, the job's one measurement */               \
  X(std::uint64_t, iteration_count, 0)                                                  \
  X(std::uint64_t, iteration_last_ns, 0)                                                \
  X(std::uint64_t, iteration_ewma_ns, 0)                                                \
  X(std::uint64_t, iteration_p99_ns, 0)                                                 \
  X(std::uint64_t, iteration_total_ns, 0) /* summed: a window's mean, not the EWMA's */  \
  /* what has been applied of the control section */                                    \
  X(std::uint64_t, applied_memory_cap, kNoCap)                                          \
  X(double, applied_share, 1.0)        /* the coordinator's share, as applied */        \
  X(double, effective_share, 1.0)      /* min(the coordinator's, the job's own) */      \
  X(std::uint64_t, applied_command_sequence, 0)                                         \
  X(std::uint64_t, apply_errors, 0)    /* hooks that threw (e.g. a refused cap) */

#define COTENANT_DECLARE_FIELD(type, name, initial) type name = initial;
struct JobControl {
  COTENANT_JOB_CONTROL_FIELDS(COTENANT_DECLARE_FIELD)
};

struct JobReport {
  COTENANT_JOB_REPORT_FIELDS(COTENANT_DECLARE_FIELD)
  std::uint64_t heartbeat_ns = 0;  // CLOCK_MONOTONIC; outside the seqlock (see JobBlock)
};
#undef COTENANT_DECLARE_FIELD

// The raw block. Only the functions below touch its fields.
struct alignas(64) JobBlock {
  using Word = std::atomic<std::uint64_t>;
  static_assert(Word::is_always_lock_free, "cross-process atomics must be lock-free");

  Word magic;
  Word version;       // kJobBlockVersion
  Word block_bytes;   // sizeof(JobBlock) as the creator compiled it
  Word initialized;   // 1 once identity is complete
  Word owner_token;   // the creating coordinator's token for this block

  struct Identity {
    Word job_id, role, device, pid, pid_start_ticks, uid, created_ns;
    Word name[kJobNameBytes / 8];          // NUL-terminated bytes
    Word gpu_uuid[kGpuUuidBytes / 8];      // NUL-terminated bytes
  } identity;

#define COTENANT_DECLARE_WORD(type, name, initial) Word name;
  struct alignas(64) Control {
    Word sequence;    // seqlock: odd while being written
    COTENANT_JOB_CONTROL_FIELDS(COTENANT_DECLARE_WORD)
  } control;

  struct alignas(64) Report {
    Word sequence;    // seqlock: odd while being written
    COTENANT_JOB_REPORT_FIELDS(COTENANT_DECLARE_WORD)
  } report;
#undef COTENANT_DECLARE_WORD

  // Outside the report seqlock: the coordinator reads it often and alone.
  alignas(64) Word heartbeat_ns;

  // Written by the coordinator only, outside the control seqlock: the job
  // reads them at every poll. CLOCK_MONOTONIC of the coordinator's last tick,
  // and the silence (ns) after which the job stops waiting for it; 0 = never.
  alignas(64) Word coordinator_heartbeat_ns;
  Word coordinator_silence_limit_ns;
};

inline constexpr std::size_t kJobBlockBytes = sizeof(JobBlock);

// Coordinator side: fills a zeroed block (fresh ShmRegion) with the header,
// identity and initial control. Not for a block a job already uses.
void initialize_job_block(JobBlock& block, const JobIdentity& identity, const JobControl& control,
                          std::uint64_t owner_token = 0,
                          std::uint64_t silence_limit_ns = kDefaultCoordinatorSilenceLimitNs);
// Throws cotenant::Error with a sentence if the bytes are not a complete
// block of this version.
void check_job_block(const JobBlock& block, std::size_t mapped_bytes);
JobIdentity read_identity(const JobBlock& block);
std::uint64_t read_owner_token(const JobBlock& block);

// How long a reader waits for a writer that is mid-update before it decides
// the writer stopped there.
inline constexpr std::chrono::milliseconds kWriterPatience{250};
// The coordinator's patience with one job's report: long enough for a
// descheduled writer on a busy machine, short enough that a job that never
// finishes its write cannot hold up the coordinator's round.
inline constexpr std::chrono::milliseconds kCoordinatorPatience{2};

void write_control(JobBlock& block, const JobControl& control);
JobControl read_control(const JobBlock& block, std::chrono::milliseconds patience = kWriterPatience);
// What a restarted coordinator resumes from: the control section as the block
// holds it (the defaults where it was left mid-update, without waiting), its
// command sequence raised to the last one the job applied, so that the next
// command is new to the job however the section was left.
JobControl control_to_resume(const JobBlock& block);

void write_report(JobBlock& block, const JobReport& report);  // also stores heartbeat_ns
JobReport read_report(const JobBlock& block, std::chrono::milliseconds patience = kWriterPatience);
// The coordinator's read: waits at most kCoordinatorPatience in all, even
// for a job that keeps its sequence odd and moving; nullopt while the job's
// writer is mid-update (or has left the section odd), or when the block lost
// its pages (below).
std::optional<JobReport> try_read_report(const JobBlock& block);

// The coordinator's other accesses. A job may write its block, so it may also
// shrink it (ftruncate); touching a page the object no longer backs raises
// SIGBUS. These run under access_guarded (mapping_guard.h) and return false
// instead of killing the coordinator. try_copy_job_block copies every word
// (identity, owner token and the rest are then read from the copy).
bool try_copy_job_block(const JobBlock& block, JobBlock& copy);
bool try_write_control(JobBlock& block, const JobControl& control);

std::uint64_t read_heartbeat_ns(const JobBlock& block);
void write_heartbeat_ns(JobBlock& block, std::uint64_t ns);

// The coordinator's side of its heartbeat: written at every tick (and at
// creation); the silence limit travels with it, so a restarted coordinator's
// setting replaces its predecessor's. false where the block lost its pages.
struct CoordinatorHeartbeat {
  std::uint64_t heartbeat_ns = 0;      // CLOCK_MONOTONIC
  std::uint64_t silence_limit_ns = 0;  // 0: the job never stops waiting
};
bool try_write_coordinator_heartbeat(JobBlock& block, const CoordinatorHeartbeat& heartbeat);
CoordinatorHeartbeat read_coordinator_heartbeat(const JobBlock& block);

// Calls visit(name, value) for each field, in layout order: the one place
// that turns records into name/value pairs (the Python dictionaries).
// `value` is the field itself (std::uint64_t, std::uint32_t, double, or an enum).
template <typename Visit>
void for_each_field(const JobControl& control, Visit&& visit) {
#define COTENANT_VISIT(type, name, initial) visit(#name, control.name);
  COTENANT_JOB_CONTROL_FIELDS(COTENANT_VISIT)
#undef COTENANT_VISIT
}
template <typename Visit>
void for_each_field(const JobReport& report, Visit&& visit) {
#define COTENANT_VISIT(type, name, initial) visit(#name, report.name);
  COTENANT_JOB_REPORT_FIELDS(COTENANT_VISIT)
#undef COTENANT_VISIT
  visit("heartbeat_ns", report.heartbeat_ns);
}

// CLOCK_MONOTONIC in nanoseconds: the heartbeat clock, common to all processes
// of the machine.
std::uint64_t monotonic_ns();

}  // namespace cotenant::shm
