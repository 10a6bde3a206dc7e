#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <pwd.h>

#include <algorithm>
#include <cstdio>
#include <cerrno>
#include <cstring>
#include <string>

#include "cotenant/errors.h"
#include "cotenant/shm/gpu_block.h"
#include "cotenant/shm/shm_region.h"

namespace cotenant::shm {
namespace {

bool pid_exists(std::uint64_t pid) {
  if (pid == 0 || pid > static_cast<std::uint64_t>(INT32_MAX)) return false;
  if (::kill(static_cast<pid_t>(pid), 0) == 0) return true;
  return errno == EPERM;  // exists, owned by another user
}

std::string user_name(uid_t uid) {
  if (const passwd* entry = ::getpwuid(uid)) return entry->pw_name;
  return "uid " + std::to_string(uid);
}

// Exclusive flock() on the shared-memory object for the duration of open():
// serialises creators and re-initialisation; released when the fd closes,
// including when its holder dies.
//
// The object is trusted only if it belongs to the caller and not every user may
// write it: a segment another user created first (under the caller's name)
// could be written by them, and would set the caller's share. Such a segment
// is refused with the owner's name, not reinitialised.
class ObjectLock {
 public:
  ObjectLock(const std::string& name, std::optional<gid_t> group) : name_(name), group_(group) {
    const mode_t old_umask = ::umask(0117);  // born 0660: never a moment with a wider mode
    fd_ = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0660);
    const int error = errno;
    ::umask(old_umask);
    if (fd_ < 0) {
      throw Error("could not open the GPU peer segment '" + name + "': " + std::strerror(error) +
                  (error == EACCES ? " (another user created it and may not share it with you; remove /dev/shm" +
                                         name + " as root or its owner, or set COTENANT_GPU_SEGMENT to another name)"
                                   : ""));
    }
    check_owner();
    while (::flock(fd_, LOCK_EX) != 0) {
      if (errno != EINTR) {
        int lock_error = errno;
        ::close(fd_);
        throw Error("could not lock the GPU peer segment '" + name + "': " + std::strerror(lock_error));
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
  // Takes the pages now (shm::reserve_pages): a full /dev/shm is an error
  // here, not a SIGBUS at the first touch.
  void grow_to(std::size_t bytes) const { reserve_pages(fd_, bytes, name_); }

 private:
  void check_owner() {
    struct stat info {};
    if (::fstat(fd_, &info) != 0) {
      int error = errno;
      ::close(fd_);
      throw Error("could not inspect the GPU peer segment '" + name_ + "': " + std::strerror(error));
    }
    const uid_t me = ::geteuid();
    std::string problem;
    const bool group_shared = group_ && info.st_gid == *group_;
    if (info.st_uid == me && group_ && !group_shared) {
      // Ours, from before it was shared (or just created): give it to the group.
      if (::fchown(fd_, static_cast<uid_t>(-1), *group_) != 0 || ::fchmod(fd_, 0660) != 0) {
        problem = "cannot be given to group " + std::to_string(*group_) + " (" + std::strerror(errno) +
                  "; is this user a member?)";
      }
    } else if (info.st_uid != me && !group_shared) {
      problem = "belongs to " + user_name(info.st_uid) + ", not to " + user_name(me) +
                (group_ ? " or to group " + std::to_string(*group_) : std::string());
    } else if (info.st_mode & 0002) {
      char mode[8];
      std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(info.st_mode & 07777));
      problem = std::string("may be written by every user (mode ") + mode + ")";
    }
    if (problem.empty()) return;
    ::close(fd_);
    throw Error("the GPU peer segment '" + name_ + "' " + problem +
                ": whoever can write it sets this job's share, so cotenant does not use it. Remove /dev/shm" + name_ +
                " (as root or its owner) and start the job again, or set COTENANT_GPU_SEGMENT to another name");
  }

  std::string name_;
  std::optional<gid_t> group_;
  int fd_ = -1;
};

std::string stored_uuid(const GpuBlock& block) {
  char uuid[kGpuBlockUuidBytes] = {};
  for (std::size_t word = 0; word < kGpuBlockUuidBytes / 8; ++word) {
    const std::uint64_t bits = block.gpu_uuid[word].load();
    std::memcpy(uuid + word * 8, &bits, 8);
  }
  uuid[kGpuBlockUuidBytes - 1] = '\0';
  return uuid;
}

void clear_guaranteed(GuaranteedSlot& slot) {
  slot.heartbeat_ns.store(0);
  slot.busy.store(0);
  slot.ops_in_flight.store(0);
  slot.last_activity_ns.store(0);
}

void clear_opportunistic(OpportunisticSlot& slot) {
  slot.admitted_ops.store(0);
  slot.waiting_ops.store(0);
  slot.busy_ns_in_window.store(0);
}

// Writes a fresh block. Callers hold the ObjectLock; magic goes last so a
// reader that checks it sees a complete block.
void initialise(GpuBlock& block, std::uint32_t device, const std::string& gpu_uuid) {
  const std::uint64_t generation = block.magic.load() == kGpuBlockMagic ? block.generation.load() + 1 : 1;
  block.magic.store(0);
  block.version.store(kGpuBlockVersion);
  block.block_bytes.store(sizeof(GpuBlock));
  block.device.store(device);
  block.generation.store(generation);
  char uuid[kGpuBlockUuidBytes] = {};
  std::memcpy(uuid, gpu_uuid.data(), std::min(gpu_uuid.size(), kGpuBlockUuidBytes - 1));
  for (std::size_t word = 0; word < kGpuBlockUuidBytes / 8; ++word) {
    std::uint64_t bits;
    std::memcpy(&bits, uuid + word * 8, 8);
    block.gpu_uuid[word].store(bits);
  }
  block.guaranteed.pid.store(0);
  clear_guaranteed(block.guaranteed);
  for (auto& slot : block.opportunistic) {
    slot.pid.store(0);
    slot.heartbeat_ns.store(0);
    clear_opportunistic(slot);
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
  for (std::size_t word = 0; word < kGpuBlockUuidBytes / 8; ++word) {
    add("gpu_uuid[" + std::to_string(word) + "]", &b.gpu_uuid[word], &b);
  }
  const GuaranteedSlot& g = b.guaranteed;
  add("guaranteed.pid", &g.pid, &b);
  add("guaranteed.heartbeat_ns", &g.heartbeat_ns, &b);
  add("guaranteed.busy", &g.busy, &b);
  add("guaranteed.ops_in_flight", &g.ops_in_flight, &b);
  add("guaranteed.last_activity_ns", &g.last_activity_ns, &b);
  for (std::size_t i = 0; i < kMaxOpportunisticJobs; ++i) {
    const OpportunisticSlot& o = b.opportunistic[i];
    const std::string prefix = "opportunistic[" + std::to_string(i) + "].";
    add(prefix + "pid", &o.pid, &b);
    add(prefix + "heartbeat_ns", &o.heartbeat_ns, &b);
    add(prefix + "admitted_ops", &o.admitted_ops, &b);
    add(prefix + "waiting_ops", &o.waiting_ops, &b);
    add(prefix + "busy_ns_in_window", &o.busy_ns_in_window, &b);
  }
  return fields;
}

std::string GpuPeerSegment::default_name(const std::string& gpu_uuid, std::uint32_t device, uid_t uid,
                                         std::optional<gid_t> group) {
  std::string key = gpu_uuid.empty() ? "index" + std::to_string(device) : gpu_uuid;
  for (char& c : key) {
    const bool allowed = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-';
    if (!allowed) c = '_';
  }
  return "/cotenant-gpu-" + key + (group ? "-g" + std::to_string(*group) : "-u" + std::to_string(uid));
}

GpuPeerSegment GpuPeerSegment::open(const std::string& name, std::uint32_t device, GpuPeerSegmentOptions options,
                                    Clock& clock) {
  ShmRegion::validate_name(name);
  ObjectLock lock(name, options.group);
  const std::size_t found_bytes = lock.size();
  if (found_bytes < sizeof(GpuBlock)) lock.grow_to(sizeof(GpuBlock));
  ShmRegion region = ShmRegion::open(name, sizeof(GpuBlock));
  auto& block = *static_cast<GpuBlock*>(region.data());

  SegmentOpening opening = SegmentOpening::kAttached;
  if (found_bytes == 0) {
    initialise(block, device, options.gpu_uuid);
    opening = SegmentOpening::kCreated;
  } else if (block.magic.load(std::memory_order_acquire) != kGpuBlockMagic ||
             block.version.load() != kGpuBlockVersion || block.block_bytes.load() != sizeof(GpuBlock) ||
             (options.gpu_uuid.empty() ? block.device.load() != device : stored_uuid(block) != options.gpu_uuid.substr(0, kGpuBlockUuidBytes - 1))) {
    // Left by another version, a creator that died before finishing (it
    // held the lock, so nobody saw it half-written), or foreign bytes.
    initialise(block, device, options.gpu_uuid);
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
    clear_opportunistic(slot);
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

void GpuPeerSegment::publish_activity(bool busy, std::uint32_t ops_in_flight, Nanoseconds last_activity_ns) {
  GuaranteedSlot& slot = block().guaranteed;
  slot.ops_in_flight.store(ops_in_flight, std::memory_order_relaxed);
  slot.last_activity_ns.store(static_cast<std::uint64_t>(last_activity_ns), std::memory_order_relaxed);
  slot.busy.store(busy ? 1 : 0, std::memory_order_release);
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
  char uuid[kGpuBlockUuidBytes];
  for (std::size_t word = 0; word < kGpuBlockUuidBytes / 8; ++word) {
    std::uint64_t bits = b.gpu_uuid[word].load();
    std::memcpy(uuid + word * 8, &bits, 8);
  }
  uuid[kGpuBlockUuidBytes - 1] = '\0';
  out.gpu_uuid = uuid;
  const GuaranteedSlot& g = b.guaranteed;
  out.guaranteed.pid = g.pid.load();
  out.guaranteed.heartbeat_ns = static_cast<Nanoseconds>(g.heartbeat_ns.load());
  out.guaranteed.live = holder_alive(out.guaranteed.pid, out.guaranteed.heartbeat_ns);
  out.guaranteed.busy = g.busy.load() != 0;
  out.guaranteed.ops_in_flight = g.ops_in_flight.load();
  out.guaranteed.last_activity_ns = static_cast<Nanoseconds>(g.last_activity_ns.load());
  for (std::size_t i = 0; i < kMaxOpportunisticJobs; ++i) {
    const OpportunisticSlot& o = b.opportunistic[i];
    OpportunisticView v;
    v.slot = i;
    v.pid = o.pid.load();
    if (v.pid == 0) continue;
    v.heartbeat_ns = static_cast<Nanoseconds>(o.heartbeat_ns.load());
    v.live = holder_alive(v.pid, v.heartbeat_ns);
    v.admitted_ops = o.admitted_ops.load();
    v.waiting_ops = o.waiting_ops.load();
    v.busy_ns_in_window = static_cast<Nanoseconds>(o.busy_ns_in_window.load());
    out.opportunistic.push_back(v);
  }
  return out;
}

}  // namespace cotenant::shm
