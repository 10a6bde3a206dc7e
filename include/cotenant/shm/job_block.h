// JobBlock: the one definition of the per-job shared-memory block.
//
// The coordinator creates one block per registered job (ShmRegion, named
// "/cotenant-<node key>-job-<id>") and the job's C++ JobChannel thread opens
// it. Python never computes offsets: both sides read and write through the
// functions below (bound into cotenant._core), so this header is the single
// source of the layout.
//
// Three sections, each with exactly one writer:
//   identity  written once by the coordinator before the name is handed out
//             (job id, name, role, device, the pid/uid that registered);
//   control   written by the coordinator: desired cap and share (levels) and
//             one command (an edge: applied once per command_sequence);
//   report    written by the job: what it holds and how fast it runs, which
//             control values it has applied, and a heartbeat.
// Control and report are each guarded by a seqlock: the writer makes the
// sequence odd, writes, makes it even; a reader retries until it sees the
// same even sequence before and after. Every field is a lock-free
// std::atomic<uint64_t> (address-free, so valid across processes), which keeps
// torn reads from being undefined behaviour; doubles travel as their bits.
//
// A reader never returns a torn section: if a writer stays mid-update for
// 250 ms (it was killed while writing), read_control / read_report throw
// cotenant::Error instead, and the next write repairs the sequence.
//
// Versioning: kJobBlockMagic identifies the block, kJobBlockVersion changes
// whenever a field moves. A reader refuses a block of another version.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace cotenant::shm {

inline constexpr std::uint64_t kJobBlockMagic = 0x4b4c424f4a4e4f43ull;  // "CONJOBLK" little-endian
inline constexpr std::uint32_t kJobBlockVersion = 1;
inline constexpr std::size_t kJobNameBytes = 64;          // including the terminating NUL
inline constexpr std::uint64_t kUnlimitedCap = ~std::uint64_t{0};  // same value as cotenant::kNoCap

enum class JobRole : std::uint32_t { kGuaranteed = 0, kOpportunistic = 1 };
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
  std::string name;              // at most kJobNameBytes - 1 bytes; longer names are cut
  JobRole role = JobRole::kOpportunistic;
  std::uint32_t device = 0;      // CUDA device index
  std::uint64_t pid = 0;         // the process that registered (SO_PEERCRED)
  std::uint64_t uid = 0;
  std::uint64_t created_ns = 0;  // CLOCK_REALTIME, nanoseconds
};

struct JobControl {
  std::uint64_t memory_cap = kUnlimitedCap;  // bytes of device-resident memory
  double share = 1.0;                        // compute share in [0, 1]; 0 = paused
  JobCommand command = JobCommand::kNone;
  std::uint64_t command_sequence = 0;        // increments with each new command
};

struct JobReport {
  std::uint64_t pid = 0, uid = 0;
  JobRole role = JobRole::kOpportunistic;
  std::uint32_t device = 0;
  JobState state = JobState::kStarting;
  // Memory, bytes (from the allocator's statistics).
  std::uint64_t device_bytes = 0;    // device-resident mapped bytes
  std::uint64_t host_bytes = 0;      // host-resident mapped bytes (spilled)
  std::uint64_t allocated_bytes = 0; // held by live tensors
  std::uint64_t cached_bytes = 0;    // reserved but not allocated
  std::uint64_t reserved_bytes = 0;  // device + host
  std::uint64_t peak_allocated_bytes = 0;
  std::uint64_t spilled_bytes = 0;   // cumulative, device -> host
  std::uint64_t restored_bytes = 0;  // cumulative, host -> device
  std::uint64_t pending_migration_bytes = 0;
  // Iteration times, microseconds.
  double iteration_last_us = 0, iteration_ewma_us = 0;
  std::uint64_t iteration_count = 0;
  // What has been applied of the control section.
  std::uint64_t applied_memory_cap = kUnlimitedCap;
  double applied_share = 1.0;
  std::uint64_t applied_command_sequence = 0;
  std::uint64_t apply_errors = 0;    // hooks that threw (e.g. a refused cap)
  std::uint64_t heartbeat_ns = 0;    // CLOCK_MONOTONIC, nanoseconds
};

// The raw block. Only the functions below touch its fields.
struct alignas(64) JobBlock {
  using Word = std::atomic<std::uint64_t>;
  static_assert(Word::is_always_lock_free, "cross-process atomics must be lock-free");

  Word magic;
  Word version;       // kJobBlockVersion
  Word block_bytes;   // sizeof(JobBlock) as the creator compiled it
  Word initialized;   // 1 once identity is complete

  struct Identity {
    Word job_id, role, device, pid, uid, created_ns;
    Word name[kJobNameBytes / 8];  // NUL-terminated bytes
  } identity;

  struct alignas(64) Control {
    Word sequence;    // seqlock: odd while being written
    Word memory_cap, share_bits, command, command_sequence;
  } control;

  struct alignas(64) Report {
    Word sequence;    // seqlock: odd while being written
    Word pid, uid, role, device, state;
    Word device_bytes, host_bytes, allocated_bytes, cached_bytes, reserved_bytes;
    Word peak_allocated_bytes, spilled_bytes, restored_bytes, pending_migration_bytes;
    Word iteration_last_us_bits, iteration_ewma_us_bits, iteration_count;
    Word applied_memory_cap, applied_share_bits, applied_command_sequence, apply_errors;
  } report;

  // Outside the report seqlock: the coordinator reads it often and alone.
  alignas(64) Word heartbeat_ns;
};

inline constexpr std::size_t kJobBlockBytes = sizeof(JobBlock);

// Coordinator side: fills a zeroed block (fresh ShmRegion) with the header,
// identity and initial control. Not for a block a job already uses.
void initialize_job_block(JobBlock& block, const JobIdentity& identity, const JobControl& control);
// Throws cotenant::Error with a sentence if the bytes are not a complete
// block of this version.
void check_job_block(const JobBlock& block, std::size_t mapped_bytes);
JobIdentity read_identity(const JobBlock& block);

void write_control(JobBlock& block, const JobControl& control);
JobControl read_control(const JobBlock& block);

void write_report(JobBlock& block, const JobReport& report);  // also stores heartbeat_ns
JobReport read_report(const JobBlock& block);

std::uint64_t read_heartbeat_ns(const JobBlock& block);
void write_heartbeat_ns(JobBlock& block, std::uint64_t ns);

// CLOCK_MONOTONIC in nanoseconds: the heartbeat clock, common to all processes
// of the machine.
std::uint64_t monotonic_ns();

}  // namespace cotenant::shm
