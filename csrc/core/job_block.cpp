#include "cotenant/shm/job_block.h"

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <type_traits>

#include "cotenant/errors.h"
#include "cotenant/shm/double_bits.h"
#include "cotenant/shm/mapping_guard.h"

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

// Reads one section; returns false (no throw) when `patience` passed while
// the writer stayed mid-update. A live writer holds the section for
// nanoseconds; only a descheduled or killed one (or a tampering job) takes
// longer. Zero patience: a few tries, no waiting. `limit`, when given, bounds
// the whole wait, however the sequence moves: a hostile writer that keeps it
// odd and moving would otherwise restart the patience forever.
template <typename ReadFields>
bool seqlock_try_read(const JobBlock::Word& sequence, std::chrono::milliseconds patience, ReadFields read_fields,
                      std::optional<std::chrono::milliseconds> limit = std::nullopt) {
  std::chrono::steady_clock::time_point deadline{};
  std::chrono::steady_clock::time_point first_wait{};  // the first yielding try: `limit` counts from here
  std::uint64_t waiting_on = 0;  // the sequence value the patience is counting on
  for (unsigned attempt = 0;; ++attempt) {
    std::uint64_t before = sequence.load(std::memory_order_acquire);
    if ((before & 1) == 0) {
      read_fields();
      std::atomic_thread_fence(std::memory_order_acquire);
      if (sequence.load(kRelaxed) == before) return true;
    }
    if (patience.count() == 0 && attempt >= 16) return false;
    if (attempt < 64) continue;  // a live writer is done within these spins
    // From here each try yields, which on a loaded machine can take a whole
    // scheduling round: the clock is read every time, so the patience holds
    // (counting tries instead let 2 ms of patience last seconds under load).
    // It counts while the sequence stays where it is, a writer stopped mid-
    // update; a writer that moves it on is alive, and the count starts again.
    const auto now = std::chrono::steady_clock::now();
    if (first_wait == std::chrono::steady_clock::time_point{}) first_wait = now;
    if (limit && now - first_wait > *limit) return false;
    if (deadline == std::chrono::steady_clock::time_point{} || before != waiting_on) {
      deadline = now + patience;
      waiting_on = before;
    } else if (now > deadline) {
      return false;
    }
    std::this_thread::yield();
  }
}

template <typename ReadFields>
void seqlock_read(const JobBlock::Word& sequence, const char* section, std::chrono::milliseconds patience,
                  ReadFields read_fields) {
  if (!seqlock_try_read(sequence, patience, read_fields)) {
    throw Error(std::string("the job block's ") + section + " section stayed mid-update for " +
                std::to_string(patience.count()) +
                " ms: its writer stopped while writing; the next write repairs it");
  }
}

// Fields to and from their words.
std::uint64_t to_word(std::uint64_t value) { return value; }
std::uint64_t to_word(std::uint32_t value) { return value; }
std::uint64_t to_word(double value) { return double_to_bits(value); }
template <typename Enum, typename = std::enable_if_t<std::is_enum_v<Enum>>>
std::uint64_t to_word(Enum value) {
  return static_cast<std::uint64_t>(value);
}
template <typename T>
T from_word(std::uint64_t word) {
  if constexpr (std::is_same_v<T, double>) {
    return bits_to_double(word);
  } else {
    return static_cast<T>(word);
  }
}

void store_text(JobBlock::Word* words, std::size_t bytes, const std::string& text) {
  std::string padded(bytes, '\0');
  std::memcpy(padded.data(), text.data(), std::min(text.size(), bytes - 1));
  for (std::size_t word = 0; word < bytes / 8; ++word) {
    std::uint64_t bits;
    std::memcpy(&bits, padded.data() + word * 8, 8);
    words[word].store(bits, kRelaxed);
  }
}

std::string load_text(const JobBlock::Word* words, std::size_t bytes) {
  std::string text(bytes, '\0');
  for (std::size_t word = 0; word < bytes / 8; ++word) {
    std::uint64_t bits = words[word].load(kRelaxed);
    std::memcpy(text.data() + word * 8, &bits, 8);
  }
  text[bytes - 1] = '\0';
  text.resize(std::strlen(text.c_str()));
  return text;
}

}  // namespace

const char* job_role_name(JobRole role) {
  switch (role) {
    case JobRole::kGuaranteed: return "guaranteed";
    case JobRole::kOpportunistic: return "opportunistic";
    case JobRole::kCapOnly: return "cap_only";
  }
  return "unknown";
}

JobRole parse_job_role(std::string_view text) {
  if (text == "guaranteed") return JobRole::kGuaranteed;
  if (text == "opportunistic") return JobRole::kOpportunistic;
  if (text == "cap_only") return JobRole::kCapOnly;
  throw Error("'" + std::string(text) + "' is not a job role: use 'guaranteed', 'opportunistic' or 'cap_only'");
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

void initialize_job_block(JobBlock& block, const JobIdentity& identity, const JobControl& control,
                          std::uint64_t owner_token, std::uint64_t silence_limit_ns) {
  auto& id = block.identity;
  id.job_id.store(identity.job_id, kRelaxed);
  id.role.store(static_cast<std::uint64_t>(identity.role), kRelaxed);
  id.device.store(identity.device, kRelaxed);
  id.pid.store(identity.pid, kRelaxed);
  id.pid_start_ticks.store(identity.pid_start_ticks, kRelaxed);
  id.uid.store(identity.uid, kRelaxed);
  id.created_ns.store(identity.created_ns, kRelaxed);
  store_text(id.name, kJobNameBytes, identity.name);
  store_text(id.gpu_uuid, kGpuUuidBytes, identity.gpu_uuid);
  write_control(block, control);
  JobReport report;
  report.pid = identity.pid;
  report.uid = identity.uid;
  report.role = identity.role;
  report.device = identity.device;
  write_report(block, report);
  block.heartbeat_ns.store(0, kRelaxed);  // 0 = the job has not attached yet
  block.coordinator_heartbeat_ns.store(monotonic_ns(), kRelaxed);
  block.coordinator_silence_limit_ns.store(silence_limit_ns, kRelaxed);
  block.owner_token.store(owner_token, kRelaxed);
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
  identity.pid_start_ticks = id.pid_start_ticks.load(kRelaxed);
  identity.uid = id.uid.load(kRelaxed);
  identity.created_ns = id.created_ns.load(kRelaxed);
  identity.name = load_text(id.name, kJobNameBytes);
  identity.gpu_uuid = load_text(id.gpu_uuid, kGpuUuidBytes);
  return identity;
}

std::uint64_t read_owner_token(const JobBlock& block) { return block.owner_token.load(kRelaxed); }

void write_control(JobBlock& block, const JobControl& control) {
  auto& c = block.control;
  seqlock_write(c.sequence, [&] {
#define COTENANT_STORE(type, name, initial) c.name.store(to_word(control.name), kRelaxed);
    COTENANT_JOB_CONTROL_FIELDS(COTENANT_STORE)
#undef COTENANT_STORE
  });
}

JobControl read_control(const JobBlock& block, std::chrono::milliseconds patience) {
  const auto& c = block.control;
  JobControl control;
  seqlock_read(c.sequence, "control", patience, [&] {
#define COTENANT_LOAD(type, name, initial) control.name = from_word<type>(c.name.load(kRelaxed));
    COTENANT_JOB_CONTROL_FIELDS(COTENANT_LOAD)
#undef COTENANT_LOAD
  });
  return control;
}

JobControl control_to_resume(const JobBlock& block) {
  const auto& c = block.control;
  JobControl read;
  const bool whole = seqlock_try_read(c.sequence, std::chrono::milliseconds(0), [&] {
#define COTENANT_LOAD(type, name, initial) read.name = from_word<type>(c.name.load(kRelaxed));
    COTENANT_JOB_CONTROL_FIELDS(COTENANT_LOAD)
#undef COTENANT_LOAD
  });
  JobControl control = whole ? read : JobControl{};
  // One word: whole whatever state the job left its report section in.
  control.command_sequence =
      std::max(control.command_sequence, block.report.applied_command_sequence.load(kRelaxed));
  return control;
}

void write_report(JobBlock& block, const JobReport& r) {
  auto& b = block.report;
  seqlock_write(b.sequence, [&] {
#define COTENANT_STORE(type, name, initial) b.name.store(to_word(r.name), kRelaxed);
    COTENANT_JOB_REPORT_FIELDS(COTENANT_STORE)
#undef COTENANT_STORE
  });
  block.heartbeat_ns.store(r.heartbeat_ns, std::memory_order_release);
}

namespace {
bool read_report_fields(const JobBlock& block, std::chrono::milliseconds patience, JobReport& r,
                        std::optional<std::chrono::milliseconds> limit = std::nullopt) {
  const auto& b = block.report;
  const bool ok = seqlock_try_read(b.sequence, patience, [&] {
#define COTENANT_LOAD(type, name, initial) r.name = from_word<type>(b.name.load(kRelaxed));
    COTENANT_JOB_REPORT_FIELDS(COTENANT_LOAD)
#undef COTENANT_LOAD
  }, limit);
  r.heartbeat_ns = block.heartbeat_ns.load(std::memory_order_acquire);
  return ok;
}
}  // namespace

JobReport read_report(const JobBlock& block, std::chrono::milliseconds patience) {
  JobReport r;
  if (!read_report_fields(block, patience, r)) {
    throw Error("the job block's report section stayed mid-update for " + std::to_string(patience.count()) +
                " ms: its writer stopped while writing; the next write repairs it");
  }
  return r;
}

std::optional<JobReport> try_read_report(const JobBlock& block) {
  JobReport r;
  bool complete = false;
  // The job is untrusted: its writer may keep the sequence moving forever, so
  // the patience bounds the whole read, not only a stall.
  const bool mapped = access_guarded(&block, sizeof(JobBlock), [&] {
    complete = read_report_fields(block, kCoordinatorPatience, r, kCoordinatorPatience);
  });
  if (!mapped || !complete) return std::nullopt;
  return r;
}

bool try_copy_job_block(const JobBlock& block, JobBlock& copy) {
  constexpr std::size_t kWords = sizeof(JobBlock) / sizeof(JobBlock::Word);
  const auto* from = reinterpret_cast<const JobBlock::Word*>(&block);
  auto* to = reinterpret_cast<JobBlock::Word*>(&copy);
  return access_guarded(&block, sizeof(JobBlock), [&] {
    for (std::size_t word = 0; word < kWords; ++word) to[word].store(from[word].load(kRelaxed), kRelaxed);
  });
}

bool try_write_control(JobBlock& block, const JobControl& control) {
  return access_guarded(&block, sizeof(JobBlock), [&] { write_control(block, control); });
}

std::uint64_t read_heartbeat_ns(const JobBlock& block) {
  return block.heartbeat_ns.load(std::memory_order_acquire);
}

void write_heartbeat_ns(JobBlock& block, std::uint64_t ns) {
  block.heartbeat_ns.store(ns, std::memory_order_release);
}

bool try_write_coordinator_heartbeat(JobBlock& block, const CoordinatorHeartbeat& heartbeat) {
  return access_guarded(&block, sizeof(JobBlock), [&] {
    block.coordinator_silence_limit_ns.store(heartbeat.silence_limit_ns, kRelaxed);
    block.coordinator_heartbeat_ns.store(heartbeat.heartbeat_ns, std::memory_order_release);
  });
}

CoordinatorHeartbeat read_coordinator_heartbeat(const JobBlock& block) {
  CoordinatorHeartbeat heartbeat;
  heartbeat.heartbeat_ns = block.coordinator_heartbeat_ns.load(std::memory_order_acquire);
  heartbeat.silence_limit_ns = block.coordinator_silence_limit_ns.load(kRelaxed);
  return heartbeat;
}

}  // namespace cotenant::shm
