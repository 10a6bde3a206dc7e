#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "cotenant/errors.h"
#include "cotenant/shm/double_bits.h"
#include "cotenant/shm/gpu_block.h"

namespace cotenant::shm {
namespace {

double clamp_share(double share) {
  if (!(share >= 0.0)) return 0.0;
  return share > 1.0 ? 1.0 : share;
}

bool pid_exists(std::uint64_t pid) {
  if (pid == 0 || pid > static_cast<std::uint64_t>(INT32_MAX)) return false;
  if (::kill(static_cast<pid_t>(pid), 0) == 0) return true;
  return errno == EPERM;  // exists, owned by another user
}

// Exclusive flock() on the shared-memory object for the duration of open():
// serialises creators and re-initialisation; released when the fd closes,
// including when its holder dies.
class ObjectLock {
 public:
  explicit ObjectLock(const std::string& name) : name_(name) {
    fd_ = ::shm_open(name.c_str(), O_RDWR | O_CREAT, 0660);
    if (fd_ < 0) {
      int error = errno;
      throw Error("could not open the GPU peer segment '" + name + "': " + std::strerror(error) +
                  (error == EACCES ? " (it belongs to another user; each user has their own segment)" : ""));
    }
    (void)::fchmod(fd_, 0660);
    while (::flock(fd_, LOCK_EX) != 0) {
      if (errno != EINTR) {
        int error = errno;
        ::close(fd_);
        throw Error("could not lock the GPU peer segment '" + name + "': " + std::strerror(error));
      }
    }
  }
  ~ObjectLock() { ::close(fd_); }
  ObjectLock(const ObjectLock&) = delete;
  ObjectLock& operator=(const ObjectLock&) = delete;

  std::size_t size() const {
    struct stat info {};
    if (::fstat(fd_, &info) != 0) throw Error("could not inspect the GPU peer segment '" + name_ + "'");
    return static_cast<std::size_t>(info.st_size);
  }
  void grow_to(std::size_t bytes) const {
    if (::ftruncate(fd_, static_cast<off_t>(bytes)) != 0) {
      int error = errno;
      throw Error("could not size the GPU peer segment '" + name_ + "' to " + std::to_string(bytes) +
                  " bytes: " + std::strerror(error) + " (is /dev/shm full?)");
    }
  }

 private:
  std::string name_;
  int fd_ = -1;
};

void clear_guaranteed(GuaranteedSlot& slot) {
  slot.heartbeat_ns.store(0);
  slot.busy.store(0);
  slot.ops_in_flight.store(0);
  slot.last_activity_ns.store(0);
  slot.iteration_sequence.store(0);
  slot.iterations.store(0);
  slot.iteration_last_ns.store(0);
  slot.iteration_ewma_ns.store(0);
  slot.iteration_p99_ns.store(0);
}

void clear_opportunistic(OpportunisticSlot& slot, std::uint64_t default_share_bits) {
  slot.share_bits.store(default_share_bits);
  slot.share_from_coordinator.store(0);
  slot.admitted_ops.store(0);
  slot.waiting_ops.store(0);
  slot.busy_ns_in_window.store(0);
}

// Writes a fresh block. Callers hold the ObjectLock; magic goes last so a
// reader that checks it sees a complete block.
void initialise(GpuBlock& block, std::uint32_t device, double default_share) {
  const std::uint64_t generation = block.magic.load() == kGpuBlockMagic ? block.generation.load() + 1 : 1;
  block.magic.store(0);
  block.version.store(kGpuBlockVersion);
  block.block_bytes.store(sizeof(GpuBlock));
  block.device.store(device);
  block.generation.store(generation);
  block.default_share_bits.store(double_to_bits(clamp_share(default_share)));
  block.coordinator_pid.store(0);
  block.guaranteed.pid.store(0);
  clear_guaranteed(block.guaranteed);
  for (auto& slot : block.opportunistic) {
    slot.pid.store(0);
    slot.heartbeat_ns.store(0);
    clear_opportunistic(slot, block.default_share_bits.load());
  }
  block.magic.store(kGpuBlockMagic, std::memory_order_release);
}

}  // namespace

const char* to_string(SegmentOpening opening) {
  switch (opening) {
    case SegmentOpening::kCreated: return "created";
    case SegmentOpening::kAttached: return "attached";
    case SegmentOpening::kReinitialised: return "reinitialised";
  }
  return "unknown";
}

std::vector<FieldLayout> gpu_block_layout() {
  std::vector<FieldLayout> fields;
  auto add = [&](std::string name, const void* field, const void* base) {
    fields.push_back({std::move(name),
                      static_cast<std::size_t>(static_cast<const char*>(field) - static_cast<const char*>(base)),
                      sizeof(Word)});
  };
  // A zeroed block stands in for a real one: only addresses are taken.
  static GpuBlock probe{};
  const GpuBlock& b = probe;
  add("magic", &b.magic, &b);
  add("version", &b.version, &b);
  add("block_bytes", &b.block_bytes, &b);
  add("device", &b.device, &b);
  add("generation", &b.generation, &b);
  add("default_share_bits", &b.default_share_bits, &b);
  add("coordinator_pid", &b.coordinator_pid, &b);
  const GuaranteedSlot& g = b.guaranteed;
  add("guaranteed.pid", &g.pid, &b);
  add("guaranteed.heartbeat_ns", &g.heartbeat_ns, &b);
  add("guaranteed.busy", &g.busy, &b);
  add("guaranteed.ops_in_flight", &g.ops_in_flight, &b);
  add("guaranteed.last_activity_ns", &g.last_activity_ns, &b);
  add("guaranteed.iteration_sequence", &g.iteration_sequence, &b);
  add("guaranteed.iterations", &g.iterations, &b);
  add("guaranteed.iteration_last_ns", &g.iteration_last_ns, &b);
  add("guaranteed.iteration_ewma_ns", &g.iteration_ewma_ns, &b);
  add("guaranteed.iteration_p99_ns", &g.iteration_p99_ns, &b);
  for (std::size_t i = 0; i < kMaxOpportunisticJobs; ++i) {
    const OpportunisticSlot& o = b.opportunistic[i];
    const std::string prefix = "opportunistic[" + std::to_string(i) + "].";
    add(prefix + "pid", &o.pid, &b);
    add(prefix + "heartbeat_ns", &o.heartbeat_ns, &b);
    add(prefix + "share_bits", &o.share_bits, &b);
    add(prefix + "share_from_coordinator", &o.share_from_coordinator, &b);
    add(prefix + "admitted_ops", &o.admitted_ops, &b);
    add(prefix + "waiting_ops", &o.waiting_ops, &b);
    add(prefix + "busy_ns_in_window", &o.busy_ns_in_window, &b);
  }
  return fields;
}

std::string GpuPeerSegment::default_name(std::uint32_t device, uid_t uid) {
  return "/cotenant-gpu" + std::to_string(device) + "-" + std::to_string(uid);
}

GpuPeerSegment GpuPeerSegment::open(const std::string& name, std::uint32_t device, GpuPeerSegmentOptions options,
                                    Clock& clock) {
  ShmRegion::validate_name(name);
  ObjectLock lock(name);
  const std::size_t found_bytes = lock.size();
  if (found_bytes < sizeof(GpuBlock)) lock.grow_to(sizeof(GpuBlock));
  ShmRegion region = ShmRegion::open(name, sizeof(GpuBlock));
  auto& block = *static_cast<GpuBlock*>(region.data());

  SegmentOpening opening = SegmentOpening::kAttached;
  if (found_bytes == 0) {
    initialise(block, device, options.default_share);
    opening = SegmentOpening::kCreated;
  } else if (block.magic.load(std::memory_order_acquire) != kGpuBlockMagic ||
             block.version.load() != kGpuBlockVersion || block.block_bytes.load() != sizeof(GpuBlock) ||
             block.device.load() != device) {
    // Left by another version, a creator that died before finishing (it
    // held the lock, so nobody saw it half-written), or foreign bytes.
    initialise(block, device, options.default_share);
    opening = SegmentOpening::kReinitialised;
  }
  GpuPeerSegment segment(std::move(region), opening, options, clock);
  if (opening == SegmentOpening::kAttached) segment.reclaim_crashed();
  return segment;
}

bool GpuPeerSegment::remove(const std::string& name) { return ShmRegion::unlink(name); }

bool GpuPeerSegment::holder_alive(std::uint64_t pid, Nanoseconds heartbeat_ns) const {
  if (pid == 0) return false;
  if (clock_->now_ns() - heartbeat_ns >= options_.stale_after_ns) return false;
  return pid_exists(pid);
}

void GpuPeerSegment::claim_guaranteed(std::uint64_t pid) {
  GuaranteedSlot& slot = block().guaranteed;
  for (;;) {
    std::uint64_t holder = slot.pid.load();
    if (holder == pid) {
      slot.heartbeat_ns.store(static_cast<std::uint64_t>(clock_->now_ns()));
      return;
    }
    if (holder != 0 && holder_alive(holder, static_cast<Nanoseconds>(slot.heartbeat_ns.load()))) {
      throw Error("GPU " + std::to_string(block().device.load()) + " already has a guaranteed job (pid " +
                  std::to_string(holder) +
                  "); run this job as opportunistic, or on another GPU, or stop that job first");
    }
    // Heartbeat first: a reclaimer that looks between the swap and the
    // heartbeat must not take a fresh claim for a crashed one.
    slot.heartbeat_ns.store(static_cast<std::uint64_t>(clock_->now_ns()));
    if (slot.pid.compare_exchange_strong(holder, pid)) break;
  }
  clear_guaranteed(slot);
  slot.heartbeat_ns.store(static_cast<std::uint64_t>(clock_->now_ns()));
}

std::size_t GpuPeerSegment::claim_opportunistic(std::uint64_t pid) {
  GpuBlock& b = block();
  for (std::size_t i = 0; i < kMaxOpportunisticJobs; ++i) {
    if (b.opportunistic[i].pid.load() == pid) {
      b.opportunistic[i].heartbeat_ns.store(static_cast<std::uint64_t>(clock_->now_ns()));
      return i;
    }
  }
  for (std::size_t i = 0; i < kMaxOpportunisticJobs; ++i) {
    OpportunisticSlot& slot = b.opportunistic[i];
    std::uint64_t holder = slot.pid.load();
    if (holder != 0 && holder_alive(holder, static_cast<Nanoseconds>(slot.heartbeat_ns.load()))) continue;
    slot.heartbeat_ns.store(static_cast<std::uint64_t>(clock_->now_ns()));
    if (!slot.pid.compare_exchange_strong(holder, pid)) continue;
    clear_opportunistic(slot, b.default_share_bits.load());
    slot.heartbeat_ns.store(static_cast<std::uint64_t>(clock_->now_ns()));
    return i;
  }
  throw Error("GPU " + std::to_string(b.device.load()) + " already has " + std::to_string(kMaxOpportunisticJobs) +
              " live opportunistic jobs, the most one GPU takes; run this job on another GPU or later");
}

void GpuPeerSegment::release_guaranteed(std::uint64_t pid) {
  GuaranteedSlot& slot = block().guaranteed;
  if (slot.pid.load() != pid) return;
  slot.busy.store(0);  // never leave opportunistic jobs waiting on a job that left
  std::uint64_t expected = pid;
  slot.pid.compare_exchange_strong(expected, 0);
}

void GpuPeerSegment::release_opportunistic(std::size_t slot_index, std::uint64_t pid) {
  if (slot_index >= kMaxOpportunisticJobs) return;
  std::uint64_t expected = pid;
  block().opportunistic[slot_index].pid.compare_exchange_strong(expected, 0);
}

void GpuPeerSegment::heartbeat(std::uint64_t pid) {
  const auto now = static_cast<std::uint64_t>(clock_->now_ns());
  GpuBlock& b = block();
  if (b.guaranteed.pid.load(std::memory_order_relaxed) == pid) b.guaranteed.heartbeat_ns.store(now);
  for (auto& slot : b.opportunistic) {
    if (slot.pid.load(std::memory_order_relaxed) == pid) slot.heartbeat_ns.store(now);
  }
}

std::size_t GpuPeerSegment::reclaim_crashed() {
  GpuBlock& b = block();
  std::size_t reclaimed = 0;
  std::uint64_t holder = b.guaranteed.pid.load();
  if (holder != 0 && !holder_alive(holder, static_cast<Nanoseconds>(b.guaranteed.heartbeat_ns.load()))) {
    b.guaranteed.busy.store(0);
    if (b.guaranteed.pid.compare_exchange_strong(holder, 0)) ++reclaimed;
  }
  for (auto& slot : b.opportunistic) {
    holder = slot.pid.load();
    if (holder != 0 && !holder_alive(holder, static_cast<Nanoseconds>(slot.heartbeat_ns.load()))) {
      if (slot.pid.compare_exchange_strong(holder, 0)) ++reclaimed;
    }
  }
  return reclaimed;
}

void GpuPeerSegment::set_share(std::size_t slot, double share, bool from_coordinator) {
  if (slot >= kMaxOpportunisticJobs) {
    throw Error("opportunistic slot " + std::to_string(slot) + " does not exist; slots are 0 to " +
                std::to_string(kMaxOpportunisticJobs - 1));
  }
  block().opportunistic[slot].share_bits.store(double_to_bits(clamp_share(share)));
  if (from_coordinator) block().opportunistic[slot].share_from_coordinator.store(1);
}

double GpuPeerSegment::share(std::size_t slot) const {
  if (slot >= kMaxOpportunisticJobs) return 0.0;
  return bits_to_double(block().opportunistic[slot].share_bits.load(std::memory_order_relaxed));
}

void GpuPeerSegment::set_default_share(double share) {
  block().default_share_bits.store(double_to_bits(clamp_share(share)));
}

void GpuPeerSegment::set_coordinator_pid(std::uint64_t pid) { block().coordinator_pid.store(pid); }

void GpuPeerSegment::publish_activity(bool busy, std::uint32_t ops_in_flight, Nanoseconds last_activity_ns) {
  GuaranteedSlot& slot = block().guaranteed;
  slot.ops_in_flight.store(ops_in_flight, std::memory_order_relaxed);
  slot.last_activity_ns.store(static_cast<std::uint64_t>(last_activity_ns), std::memory_order_relaxed);
  slot.busy.store(busy ? 1 : 0, std::memory_order_release);
}

void GpuPeerSegment::publish_iterations(const IterationStats& stats) {
  GuaranteedSlot& slot = block().guaranteed;
  const std::uint64_t sequence = slot.iteration_sequence.load(std::memory_order_relaxed);
  slot.iteration_sequence.store(sequence + 1);  // odd: being written (seq_cst orders the stores)
  slot.iterations.store(stats.iterations);
  slot.iteration_last_ns.store(static_cast<std::uint64_t>(stats.last_ns));
  slot.iteration_ewma_ns.store(static_cast<std::uint64_t>(stats.ewma_ns));
  slot.iteration_p99_ns.store(static_cast<std::uint64_t>(stats.p99_ns));
  slot.iteration_sequence.store(sequence + 2);
}

IterationStats GpuPeerSegment::guaranteed_iterations() const {
  const GuaranteedSlot& slot = block().guaranteed;
  // Bounded: a writer that died mid-write leaves the sequence odd forever;
  // then the figures are returned as they are.
  for (int attempt = 0;; ++attempt) {
    const std::uint64_t before = slot.iteration_sequence.load();
    if (before % 2 == 1 && attempt < 10'000) continue;
    IterationStats stats;
    stats.iterations = slot.iterations.load();
    stats.last_ns = static_cast<Nanoseconds>(slot.iteration_last_ns.load());
    stats.ewma_ns = static_cast<Nanoseconds>(slot.iteration_ewma_ns.load());
    stats.p99_ns = static_cast<Nanoseconds>(slot.iteration_p99_ns.load());
    if (slot.iteration_sequence.load() == before || attempt >= 10'000) return stats;
  }
}

void GpuPeerSegment::report_gate(std::size_t slot_index, const LaunchGateStats& stats) {
  if (slot_index >= kMaxOpportunisticJobs) return;
  OpportunisticSlot& slot = block().opportunistic[slot_index];
  slot.admitted_ops.store(stats.admitted_ops, std::memory_order_relaxed);
  slot.waiting_ops.store(stats.waiting, std::memory_order_relaxed);
  slot.busy_ns_in_window.store(static_cast<std::uint64_t>(stats.busy_ns_in_window), std::memory_order_relaxed);
}

bool GpuPeerSegment::guaranteed_busy() const {
  const GuaranteedSlot& slot = block().guaranteed;
  if (slot.pid.load(std::memory_order_relaxed) == 0) return false;
  if (slot.busy.load(std::memory_order_acquire) == 0) return false;
  // A holder that stopped beating is treated as gone: a crashed guaranteed
  // job must not stall the opportunistic ones for longer than stale_after.
  const auto heartbeat = static_cast<Nanoseconds>(slot.heartbeat_ns.load(std::memory_order_relaxed));
  return clock_->now_ns() - heartbeat < options_.stale_after_ns;
}

GpuSegmentView GpuPeerSegment::view() const {
  const GpuBlock& b = block();
  GpuSegmentView out;
  out.device = static_cast<std::uint32_t>(b.device.load());
  out.generation = b.generation.load();
  out.default_share = bits_to_double(b.default_share_bits.load());
  out.coordinator_pid = b.coordinator_pid.load();
  const GuaranteedSlot& g = b.guaranteed;
  out.guaranteed.pid = g.pid.load();
  out.guaranteed.heartbeat_ns = static_cast<Nanoseconds>(g.heartbeat_ns.load());
  out.guaranteed.live = holder_alive(out.guaranteed.pid, out.guaranteed.heartbeat_ns);
  out.guaranteed.busy = g.busy.load() != 0;
  out.guaranteed.ops_in_flight = g.ops_in_flight.load();
  out.guaranteed.last_activity_ns = static_cast<Nanoseconds>(g.last_activity_ns.load());
  out.guaranteed.iterations = guaranteed_iterations();
  for (std::size_t i = 0; i < kMaxOpportunisticJobs; ++i) {
    const OpportunisticSlot& o = b.opportunistic[i];
    OpportunisticView v;
    v.slot = i;
    v.pid = o.pid.load();
    if (v.pid == 0) continue;
    v.heartbeat_ns = static_cast<Nanoseconds>(o.heartbeat_ns.load());
    v.live = holder_alive(v.pid, v.heartbeat_ns);
    v.share = bits_to_double(o.share_bits.load());
    v.share_from_coordinator = o.share_from_coordinator.load() != 0;
    v.admitted_ops = o.admitted_ops.load();
    v.waiting_ops = o.waiting_ops.load();
    v.busy_ns_in_window = static_cast<Nanoseconds>(o.busy_ns_in_window.load());
    out.opportunistic.push_back(v);
  }
  return out;
}

}  // namespace cotenant::shm
