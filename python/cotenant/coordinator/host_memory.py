"""The node's host memory beside what the jobs pin in it.

Every byte a job spills, and every host page it keeps for the next spill
(its host reserve included), is pinned: the kernel can neither swap it nor
give it to another process. The coordinator squeezes opportunistic jobs
into host memory and holds a squeeze back where it would leave the node less
than its host headroom (policy.bound_squeezes_by_host); `cotenant status`
and the metrics show how much the jobs pin, how much the node still has,
how much is held back, and whether squeezing every opportunistic job off
its GPU would fit.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Mapping, Optional, Tuple

MEMINFO = "/proc/meminfo"
CGROUP_ROOT = "/sys/fs/cgroup"


def read_meminfo(path: str = MEMINFO) -> Optional[Dict[str, int]]:
    """{"total_bytes", "available_bytes"} from /proc/meminfo (MemTotal,
    MemAvailable), or None where it cannot be read."""
    fields: Dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if name in ("MemTotal", "MemAvailable") and parts and parts[0].isdigit():
                    fields[name] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    except OSError:
        return None
    if "MemTotal" not in fields or "MemAvailable" not in fields:
        return None
    return {"total_bytes": fields["MemTotal"], "available_bytes": fields["MemAvailable"]}


def read_cgroup(pid: int, proc: str = "/proc") -> Optional[str]:
    """The cgroups of process `pid` as /proc/<pid>/cgroup names them (one
    line per hierarchy), or None where it cannot be read. Two processes with
    the same text are in the same memory cgroup, and share its limit."""
    try:
        with open(f"{proc}/{int(pid)}/cgroup") as f:
            text = f.read().strip()
    except (OSError, ValueError):
        return None
    return text or None


def cgroup_rooms(pid: int, cgroup_root: str = CGROUP_ROOT, proc: str = "/proc") -> Tuple[Tuple[str, int], ...]:
    """((path, room bytes), ...) for each memory cgroup with a limit on the
    way up from process `pid`'s own to the root of the cgroup filesystem at
    `cgroup_root`, its own first; the room is the limit less the working
    set. Jobs under one of them share its room: the ranks of a Slurm job
    step, each in a task cgroup of its own, share the step's limit. Empty
    where none has a limit, or the filesystem does not show the process's
    cgroup (a coordinator in a container of its own sees only its own; give
    it the node's with [memory] cgroup_root). The same reader as the jobs'
    own host_room_bytes (include/cotenant/host_memory.h)."""
    from cotenant._core import cgroup_memory_rooms

    return tuple((path, int(room)) for path, room in cgroup_memory_rooms(f"{proc}/{int(pid)}/cgroup", cgroup_root))


def host_status(meminfo: Optional[Mapping[str, int]], jobs: Iterable[Mapping[str, Any]],
                headroom_bytes: int = 0) -> Dict[str, Any]:
    """The status's "host" entry from the node's memory and the jobs' status
    dicts: what they pin (spilled bytes, kept host pages), what a squeeze of
    every opportunistic job would pin more (its device bytes), how much the
    policy holds squeezes back to keep `headroom_bytes` available, and a note
    when it holds some back or would have to."""
    jobs = list(jobs)
    pinned = sum(int(j.get("host_bytes", 0) or 0) + int(j.get("host_pool_bytes", 0) or 0) for j in jobs)
    squeezable = sum(int(j.get("device_bytes", 0) or 0) for j in jobs if j.get("role") == "opportunistic")
    held_back = sum(int(j.get("squeeze_held_back_bytes", 0) or 0) for j in jobs)
    out: Dict[str, Any] = {"pinned_by_jobs_bytes": pinned, "squeezable_bytes": squeezable,
                           "total_bytes": None, "available_bytes": None, "headroom_bytes": headroom_bytes,
                           "held_back_bytes": held_back, "note": None}
    from cotenant._core import format_size  # the one formatter

    if held_back:
        out["note"] = (f"squeezes held back by {format_size(held_back)} to keep {format_size(headroom_bytes)} of "
                       "host memory available (the coordinator's [memory] host_headroom): those pages stay on the "
                       "device and guaranteed jobs get less room. Free host memory, or run fewer opportunistic "
                       "jobs on this node")
    if meminfo is not None:
        out.update(total_bytes=meminfo["total_bytes"], available_bytes=meminfo["available_bytes"])
        room = meminfo["available_bytes"] - headroom_bytes
        if out["note"] is None and squeezable > room:
            out["note"] = (f"squeezing every opportunistic job off its GPU would pin {format_size(squeezable)} "
                           f"of host memory, more than the {format_size(max(0, room))} available beyond the "
                           f"{format_size(headroom_bytes)} host headroom: the coordinator would hold such a squeeze "
                           "back, its pages left on the device. Free host memory, or run fewer opportunistic jobs "
                           "on this node")
    return out
