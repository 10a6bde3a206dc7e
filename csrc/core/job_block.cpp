#include "cotenant/shm/job_block.h"

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "cotenant/errors.h"
#include "cotenant/shm/double_bits.h"

namespace cotenant::shm {
namespace {

constexpr auto kRelaxed = std::memory_order_relaxed;

// Seqlock, single writer per section. A writer killed mid-update leaves the
// sequence odd: the next writer (a restarted coordinator) first rounds it up
// to even, so the protocol recovers.
template <typename WriteFields>
void seqlock_write(JobBlock::Word& sequence, WriteFields write_fields) {
  std::uint64_t start = sequence.load(kRelaxed);
  if (start & 1) ++start;
  sequence.store(start + 1, kRelaxed);
  std::atomic_thread_fence(std::memory_order_release);
  write_fields();
  sequence.store(start + 2, std::memory_order_release);
}

// How long a reader waits for a writer to finish before deciding it died
// mid-update. A live writer holds the section for nanoseconds; only a
// descheduled or killed one takes longer.
constexpr auto kWriterPatience = std::chrono::milliseconds(250);

template <typename ReadFields>
void seqlock_read(const JobBlock::Word& sequence, const char* section, ReadFields read_fields) {
  std::chrono::steady_clock::time_point deadline{};
  for (unsigned attempt = 0;; ++attempt) {
    std::uint64_t before = sequence.load(std::memory_order_acquire);
    if ((before & 1) == 0) {
      read_fields();
      std::atomic_thread_fence(std::memory_order_acquire);
      if (sequence.load(kRelaxed) == before) return;
    }
    if (attempt >= 64) std::this_thread::yield();
    if ((attempt & 1023) == 1023) {
      auto now = std::chrono::steady_clock::now();
      if (deadline == std::chrono::steady_clock::time_point{}) {
        deadline = now + kWriterPatience;
      } else if (now > deadline) {
        throw Error(std::string("the job block's ") + section +
                    " section stayed mid-update for 250 ms: its writer stopped while writing; "
                    "the next write repairs it");
      }
    }
  }
}

}  // namespace

const char* job_role_name(JobRole role) {
  return role == JobRole::kGuaranteed ? "guaranteed" : "opportunistic";
}

JobRole parse_job_role(std::string_view text) {
  if (text == "guaranteed") return JobRole::kGuaranteed;
  if (text == "opportunistic") return JobRole::kOpportunistic;
  throw Error("'" + std::string(text) + "' is not a job role: use 'guaranteed' or 'opportunistic'");
}

const char* job_command_name(JobCommand command) {
  switch (command) {
    case JobCommand::kNone: return "none";
    case JobCommand::kSpillAll: return "spill_all";
    case JobCommand::kRestoreAll: return "restore_all";
    case JobCommand::kSuspend: return "suspend";
    case JobCommand::kResume: return "resume";
  }
  return "unknown";
}

const char* job_state_name(JobState state) {
  switch (state) {
    case JobState::kStarting: return "starting";
    case JobState::kRunning: return "running";
    case JobState::kSuspended: return "suspended";
    case JobState::kExited: return "exited";
  }
  return "unknown";
}

std::uint64_t monotonic_ns() {
  timespec now{};
  ::clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<std::uint64_t>(now.tv_sec) * 1000000000ull + static_cast<std::uint64_t>(now.tv_nsec);
}

void initialize_job_block(JobBlock& block, const JobIdentity& identity, const JobControl& control) {
  auto& id = block.identity;
  id.job_id.store(identity.job_id, kRelaxed);
  id.role.store(static_cast<std::uint64_t>(identity.role), kRelaxed);
  id.device.store(identity.device, kRelaxed);
  id.pid.store(identity.pid, kRelaxed);
  id.uid.store(identity.uid, kRelaxed);
  id.created_ns.store(identity.created_ns, kRelaxed);
  char name[kJobNameBytes] = {};
  std::memcpy(name, identity.name.data(), std::min(identity.name.size(), kJobNameBytes - 1));
  for (std::size_t word = 0; word < kJobNameBytes / 8; ++word) {
    std::uint64_t bits;
    std::memcpy(&bits, name + word * 8, 8);
    id.name[word].store(bits, kRelaxed);
  }
  write_control(block, control);
  JobReport report;
  report.pid = identity.pid;
  report.uid = identity.uid;
  report.role = identity.role;
  report.device = identity.device;
  report.applied_memory_cap = kUnlimitedCap;
  report.applied_share = 1.0;
  write_report(block, report);
  block.heartbeat_ns.store(0, kRelaxed);  // 0 = the job has not attached yet
  block.block_bytes.store(sizeof(JobBlock), kRelaxed);
  block.version.store(kJobBlockVersion, kRelaxed);
  block.magic.store(kJobBlockMagic, kRelaxed);
  block.initialized.store(1, std::memory_order_release);
}

void check_job_block(const JobBlock& block, std::size_t mapped_bytes) {
  if (mapped_bytes < sizeof(JobBlock)) {
    throw Error("the job block holds " + std::to_string(mapped_bytes) + " bytes, fewer than the " +
                std::to_string(sizeof(JobBlock)) +
                " this cotenant expects: the coordinator and the job run different versions");
  }
  if (block.initialized.load(std::memory_order_acquire) != 1 ||
      block.magic.load(kRelaxed) != kJobBlockMagic) {
    throw Error("the shared memory is not an initialized cotenant job block (wrong magic number)");
  }
  auto version = block.version.load(kRelaxed);
  if (version != kJobBlockVersion) {
    throw Error("the job block has layout version " + std::to_string(version) + ", this cotenant reads " +
                std::to_string(kJobBlockVersion) +
                ": run the coordinator and the jobs from the same cotenant version");
  }
}

JobIdentity read_identity(const JobBlock& block) {
  const auto& id = block.identity;
  JobIdentity identity;
  identity.job_id = id.job_id.load(kRelaxed);
  identity.role = static_cast<JobRole>(id.role.load(kRelaxed));
  identity.device = static_cast<std::uint32_t>(id.device.load(kRelaxed));
  identity.pid = id.pid.load(kRelaxed);
  identity.uid = id.uid.load(kRelaxed);
  identity.created_ns = id.created_ns.load(kRelaxed);
  char name[kJobNameBytes];
  for (std::size_t word = 0; word < kJobNameBytes / 8; ++word) {
    std::uint64_t bits = id.name[word].load(kRelaxed);
    std::memcpy(name + word * 8, &bits, 8);
  }
  name[kJobNameBytes - 1] = '\0';
  identity.name = name;
  return identity;
}

void write_control(JobBlock& block, const JobControl& control) {
  auto& c = block.control;
  seqlock_write(c.sequence, [&] {
    c.memory_cap.store(control.memory_cap, kRelaxed);
    c.share_bits.store(double_to_bits(control.share), kRelaxed);
    c.command.store(static_cast<std::uint64_t>(control.command), kRelaxed);
    c.command_sequence.store(control.command_sequence, kRelaxed);
  });
}

JobControl read_control(const JobBlock& block) {
  const auto& c = block.control;
  JobControl control;
  seqlock_read(c.sequence, "control", [&] {
    control.memory_cap = c.memory_cap.load(kRelaxed);
    control.share = bits_to_double(c.share_bits.load(kRelaxed));
    control.command = static_cast<JobCommand>(c.command.load(kRelaxed));
    control.command_sequence = c.command_sequence.load(kRelaxed);
  });
  return control;
}

void write_report(JobBlock& block, const JobReport& r) {
  auto& b = block.report;
  seqlock_write(b.sequence, [&] {
    b.pid.store(r.pid, kRelaxed);
    b.uid.store(r.uid, kRelaxed);
    b.role.store(static_cast<std::uint64_t>(r.role), kRelaxed);
    b.device.store(r.device, kRelaxed);
    b.state.store(static_cast<std::uint64_t>(r.state), kRelaxed);
    b.device_bytes.store(r.device_bytes, kRelaxed);
    b.host_bytes.store(r.host_bytes, kRelaxed);
    b.allocated_bytes.store(r.allocated_bytes, kRelaxed);
    b.cached_bytes.store(r.cached_bytes, kRelaxed);
    b.reserved_bytes.store(r.reserved_bytes, kRelaxed);
    b.peak_allocated_bytes.store(r.peak_allocated_bytes, kRelaxed);
    b.spilled_bytes.store(r.spilled_bytes, kRelaxed);
    b.restored_bytes.store(r.restored_bytes, kRelaxed);
    b.pending_migration_bytes.store(r.pending_migration_bytes, kRelaxed);
    b.iteration_last_us_bits.store(double_to_bits(r.iteration_last_us), kRelaxed);
    b.iteration_ewma_us_bits.store(double_to_bits(r.iteration_ewma_us), kRelaxed);
    b.iteration_count.store(r.iteration_count, kRelaxed);
    b.applied_memory_cap.store(r.applied_memory_cap, kRelaxed);
    b.applied_share_bits.store(double_to_bits(r.applied_share), kRelaxed);
    b.applied_command_sequence.store(r.applied_command_sequence, kRelaxed);
    b.apply_errors.store(r.apply_errors, kRelaxed);
  });
  block.heartbeat_ns.store(r.heartbeat_ns, std::memory_order_release);
}

JobReport read_report(const JobBlock& block) {
  const auto& b = block.report;
  JobReport r;
  seqlock_read(b.sequence, "report", [&] {
    r.pid = b.pid.load(kRelaxed);
    r.uid = b.uid.load(kRelaxed);
    r.role = static_cast<JobRole>(b.role.load(kRelaxed));
    r.device = static_cast<std::uint32_t>(b.device.load(kRelaxed));
    r.state = static_cast<JobState>(b.state.load(kRelaxed));
    r.device_bytes = b.device_bytes.load(kRelaxed);
    r.host_bytes = b.host_bytes.load(kRelaxed);
    r.allocated_bytes = b.allocated_bytes.load(kRelaxed);
    r.cached_bytes = b.cached_bytes.load(kRelaxed);
    r.reserved_bytes = b.reserved_bytes.load(kRelaxed);
    r.peak_allocated_bytes = b.peak_allocated_bytes.load(kRelaxed);
    r.spilled_bytes = b.spilled_bytes.load(kRelaxed);
    r.restored_bytes = b.restored_bytes.load(kRelaxed);
    r.pending_migration_bytes = b.pending_migration_bytes.load(kRelaxed);
    r.iteration_last_us = bits_to_double(b.iteration_last_us_bits.load(kRelaxed));
    r.iteration_ewma_us = bits_to_double(b.iteration_ewma_us_bits.load(kRelaxed));
    r.iteration_count = b.iteration_count.load(kRelaxed);
    r.applied_memory_cap = b.applied_memory_cap.load(kRelaxed);
    r.applied_share = bits_to_double(b.applied_share_bits.load(kRelaxed));
    r.applied_command_sequence = b.applied_command_sequence.load(kRelaxed);
    r.apply_errors = b.apply_errors.load(kRelaxed);
  });
  r.heartbeat_ns = block.heartbeat_ns.load(std::memory_order_acquire);
  return r;
}

std::uint64_t read_heartbeat_ns(const JobBlock& block) {
  return block.heartbeat_ns.load(std::memory_order_acquire);
}

void write_heartbeat_ns(JobBlock& block, std::uint64_t ns) {
  block.heartbeat_ns.store(ns, std::memory_order_release);
}

}  // namespace cotenant::shm
