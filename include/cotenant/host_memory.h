// How much host memory this process may still take, as Linux tells it.
//
// MemAvailable (/proc/meminfo) is the node's: in a container with a memory
// limit (a Kubernetes pod, `docker run --memory`, a systemd slice with
// MemoryMax) the kernel's OOM killer acts at the cgroup's limit long before
// the node runs out, and pinned pages are charged to the cgroup that pins
// them. So what a pin may use is the least of MemAvailable and, for the
// process's memory cgroup and each of its ancestors that has a limit, the
// limit less what the cgroup uses that the kernel cannot simply drop (its
// usage less its inactive file pages, the working set Kubernetes evicts by).
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

namespace cotenant {

// MemAvailable from a meminfo file (Linux's /proc/meminfo), in bytes; nullopt
// where it cannot be read or has no such line (kernels before 3.14).
std::optional<std::size_t> read_mem_available(const char* path = "/proc/meminfo");

// One memory cgroup with a limit, and the room it leaves: limit - (usage -
// inactive file pages), 0 at the limit. `path` names it as /proc/<pid>/cgroup
// does (below the cgroup filesystem's root, "/" for the root itself).
struct CgroupRoom {
  std::string path;
  std::size_t room_bytes = 0;
};

// Whose /proc/<pid>/cgroup is read. A path the cgroup filesystem does not
// show is, for this process, one of a cgroup namespace whose root is the
// mount's (a container sees its own cgroup at the root); for another
// process it is a cgroup the reader cannot see.
enum class CgroupOf { this_process, another_process };

// Every cgroup with a memory limit on the way up from the process's own (the
// one `proc_cgroup`, its /proc/<pid>/cgroup, names) to the root of the cgroup
// filesystem at `cgroup_root`, its own first. Processes under one such cgroup
// share its room: the ranks of one Slurm job step, each in a task cgroup of
// its own, share the step's limit. cgroup v2 (memory.max, memory.current,
// memory.stat inactive_file) and v1 (the memory controller's
// memory.limit_in_bytes, memory.usage_in_bytes, memory.stat
// total_inactive_file; a v1 memory line wins on a hybrid system). Empty where
// none on the way has a limit or none can be read (not Linux, no cgroup
// filesystem mounted, a cgroup of another process the mount does not show).
std::vector<CgroupRoom> read_cgroup_memory_rooms(const std::string& proc_cgroup, const std::string& cgroup_root,
                                                 CgroupOf whose);

// The room the memory cgroups of the process named by `proc_cgroup` (its
// /proc/<pid>/cgroup) leave it, under the cgroup filesystem at
// `cgroup_root`: the least room of read_cgroup_memory_rooms(), this
// process's; nullopt where it finds none.
std::optional<std::size_t> read_cgroup_memory_room(const std::string& proc_cgroup = "/proc/self/cgroup",
                                                   const std::string& cgroup_root = "/sys/fs/cgroup");

// What this process may still take: the lesser of read_mem_available() and
// read_cgroup_memory_room(), whichever are known; nullopt when neither is.
std::optional<std::size_t> read_host_available();

}  // namespace cotenant
