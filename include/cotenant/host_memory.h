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

namespace cotenant {

// MemAvailable from a meminfo file (Linux's /proc/meminfo), in bytes; nullopt
// where it cannot be read or has no such line (kernels before 3.14).
std::optional<std::size_t> read_mem_available(const char* path = "/proc/meminfo");

// The room the memory cgroups of the process named by `proc_cgroup` (its
// /proc/<pid>/cgroup) leave it, under the cgroup filesystem at
// `cgroup_root`: the least, over its cgroup and each ancestor with a memory
// limit, of limit - (usage - inactive file pages), 0 at the limit. cgroup v2
// (memory.max, memory.current, memory.stat inactive_file) and v1 (the memory
// controller's memory.limit_in_bytes, memory.usage_in_bytes, memory.stat
// total_inactive_file). nullopt where no cgroup on the way has a limit or
// none can be read (not Linux, no cgroup filesystem mounted).
std::optional<std::size_t> read_cgroup_memory_room(const std::string& proc_cgroup = "/proc/self/cgroup",
                                                   const std::string& cgroup_root = "/sys/fs/cgroup");

// What this process may still take: the lesser of read_mem_available() and
// read_cgroup_memory_room(), whichever are known; nullopt when neither is.
std::optional<std::size_t> read_host_available();

}  // namespace cotenant
