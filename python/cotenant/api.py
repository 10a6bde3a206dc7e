"""The Python API of cotenant's allocator.

    import cotenant
    cotenant.enable(role="opportunistic")   # before the first CUDA tensor
    cotenant.set_memory_cap("6GiB")         # any time; shrinking never OOMs
    cotenant.memory_stats()                 # device / host / cached bytes and the mode

This module imports torch only inside enable() and the functions that need
it, so `import cotenant` stays cheap for the CLI and the coordinator.

Turning cotenant off: set COTENANT_DISABLE=1 in the environment (enable()
and enable_from_environment() then do nothing), or call disable() to lift
the cap, bring spilled memory back and leave the coordinator.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import warnings
from typing import Any, Dict, Optional, Union

__all__ = [
    "enable",
    "enable_from_environment",
    "disable",
    "is_enabled",
    "set_memory_cap",
    "memory_cap",
    "memory_stats",
    "spill_all",
    "restore_all",
    "Region",
    "region",
    "pause_region",
    "resume_region",
    "regions",
    "parse_memory_cap",
    "NoGpuError",
]

ROLES = (None, "guaranteed", "opportunistic")
CAP_ONLY_WORDS = ("cap_only", "none")  # spellings of role=None where a string is needed (COTENANT_CONF)
JOB_PID_VARIABLE = "COTENANT_JOB_PID"  # set by `cotenant run`: the one process that is the job
_BYTES_LIMIT = 2**64  # sizes and caps are 64-bit byte counts in the allocator

log = logging.getLogger("cotenant")

SizeLike = Union[int, float, str, None]


class NoGpuError(RuntimeError):
    """cotenant was asked to manage CUDA memory on a machine where no GPU is usable."""


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.enabled = False
        self.device: Optional[int] = None
        self.role: Optional[str] = None
        self.registration: Any = None
        self.job_channel = False
        self.optimizer_hook: Any = None
        self.own_host_headroom: Optional[int] = None          # the job's own (enable(), set_host_headroom())
        self.coordinator_host_headroom: Optional[int] = None  # the node's, from the coordinator
        # What the first enable() registered with (name, socket, persistent_memory): a later enable() may
        # repeat them but not change them.
        self.fixed_at_enable: Dict[str, Any] = {}


_state = _State()


# ---- parsing and validation (no torch, no GPU) ------------------------------------------


def disabled_by_environment() -> bool:
    """True when COTENANT_DISABLE (or COTENANT_CONF's disable:1) asks for cotenant to stay off."""
    from cotenant import settings

    return settings.flag("disable")


def is_child_of_a_job(environ=None) -> bool:
    """True in a process that inherited a job's environment from `cotenant run`
    but is not the process it started: DataLoader workers, torch.compile's
    compile workers, any subprocess. Only the job itself registers."""
    marked = (os.environ if environ is None else environ).get(JOB_PID_VARIABLE, "").strip()
    return bool(marked) and marked != str(os.getpid())


def is_multiprocessing_helper(argv) -> bool:
    """True for processes Python's multiprocessing starts (spawned DataLoader
    workers, the resource tracker, the forkserver): they inherit COTENANT_*
    from the job but are not jobs of their own."""
    return any("--multiprocessing-fork" == arg or "from multiprocessing" in arg for arg in argv)


def parse_memory_cap(size: SizeLike, device_total_bytes: Optional[int] = None) -> Optional[int]:
    """Reads a memory cap and returns it in bytes (None: no cap).

    Accepts what cotenant._core.Cap reads, the one parser for caps: a positive
    number of bytes (int), a size string ("6GiB", "512MiB", "4096"), a
    fraction of the device's memory (a float in (0, 1], or "0.5", "50%"; needs
    `device_total_bytes`), or None / "none". Raises ValueError (the message
    names the input and the accepted forms) or TypeError otherwise.
    """
    cap = to_cap(size)
    if cap.is_fraction and device_total_bytes is None:
        raise ValueError(f"the memory cap {cap} is a fraction of the device, and the device's size is not known "
                         f"here; call cotenant.enable() first, or give the cap in bytes (e.g. \"6GiB\")")
    return cap.resolve(device_total_bytes or 0)


def to_cap(size: Any):
    """A cotenant._core.Cap from any accepted spelling (see parse_memory_cap)."""
    from cotenant import _core

    if isinstance(size, bool):
        raise TypeError(f"a memory cap cannot be {size!r}; pass bytes (e.g. 6442450944), a size string "
                        f"(e.g. \"6GiB\"), a fraction of the device (e.g. 0.5) or None")
    if size is not None and not isinstance(size, (int, float, str, _core.Cap)):
        raise TypeError(f"a memory cap must be bytes (int), a size string such as \"6GiB\", a fraction such as "
                        f"0.5, or None; got {type(size).__name__}")
    if isinstance(size, int) and size >= _BYTES_LIMIT:
        raise ValueError(f"a memory cap of {size} bytes is more than 2**64-1 bytes; give a size such as \"6GiB\", "
                         f"or None for no cap")
    try:
        return _core.Cap(size)
    except _core.Error as error:
        raise ValueError(str(error)) from None


def _parse_bytes(size: Union[int, str, None], what: str, example: str) -> Optional[int]:
    """Bytes (int) or a size string through the one size parser; None stays None."""
    if size is None:
        return None
    if isinstance(size, int) and not isinstance(size, bool):
        if size < 0:
            raise ValueError(f"{what} cannot be {size} bytes; pass a size such as \"{example}\"")
        if size >= _BYTES_LIMIT:
            raise ValueError(f"{what} cannot be {size} bytes, more than 2**64-1; pass a size such as \"{example}\"")
        return size
    if isinstance(size, str):
        from cotenant import _core  # the one size parser

        try:
            return _core.parse_size(size)
        except _core.Error as error:
            raise ValueError(f"cannot use {size!r} as {what}: {error}") from None
    raise TypeError(f"{what} must be bytes (int) or a size string such as \"{example}\"; "
                    f"got {type(size).__name__}")


def parse_persistent_memory(size: Union[int, str, None]) -> Optional[int]:
    """Reads the memory a job holds for its whole life (parameters, optimizer
    state): bytes (int) or a size string ("10GiB"). The coordinator admits an
    opportunistic job only when this much fits next to the guaranteed jobs."""
    return _parse_bytes(size, "persistent memory", "10GiB")


def parse_host_reserve(size: Union[int, str, None]) -> Optional[int]:
    """Reads a host reserve (see reserve_host_memory): bytes (int) or a size string ("4GiB")."""
    return _parse_bytes(size, "a host reserve", "4GiB")


def parse_host_headroom(size: Union[int, str, None]) -> Optional[int]:
    """Reads a host headroom (see set_host_headroom): bytes (int) or a size string ("4GiB")."""
    return _parse_bytes(size, "a host headroom", "4GiB")


def parse_device(device: Any) -> Optional[int]:
    """Device index from None, an int, "cuda", "cuda:1" or a torch.device."""
    if device is None:
        return None
    if isinstance(device, bool):
        raise TypeError(f"device must be a CUDA device index or \"cuda:N\", got {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device index must be >= 0, got {device}")
        return device
    text = str(device).strip()
    if text.isdigit():
        return int(text)
    kind, _, index = text.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"cotenant manages CUDA devices only; got device {device!r} "
                         f"(pass an index such as 0 or \"cuda:0\")")
    return int(index) if index else None


def parse_role(role: Optional[str]) -> Optional[str]:
    if role is not None and not isinstance(role, str):
        raise TypeError(f"role must be None, \"guaranteed\" or \"opportunistic\", got {role!r}")
    if role is not None:
        role = role.strip().lower() or None
        if role in CAP_ONLY_WORDS:
            role = None
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; use \"guaranteed\" (keeps its speed), "
                         f"\"opportunistic\" (uses what is left) or None / \"cap_only\" (no launch gate)")
    return role


# ---- the extension ------------------------------------------------------------------------


def _extension():
    """cotenant._C, after torch (whose libraries it links against)."""
    import torch  # noqa: F401  (loads libc10/libtorch and the CUDA runtime first)

    try:
        from cotenant import _C
    except ImportError as error:
        raise ImportError(
            "cotenant's torch extension (cotenant._C) is not built or not on the path: "
            f"{error}. Build it with COTENANT_BUILD_PYTHON=ON and torch plus the CUDA toolkit "
            "installed.") from error
    return _C


def _require_enabled() -> int:
    if not _state.enabled:
        raise RuntimeError("cotenant is not enabled in this process; call cotenant.enable() "
                           "first (before the first CUDA allocation)")
    assert _state.device is not None
    return _state.device


def _resolve_device(device: Any) -> int:
    index = parse_device(device)
    return _require_enabled() if index is None else index


# ---- enable / disable -----------------------------------------------------------------


def enable(role: Optional[str] = None, device: Any = None, *, name: Optional[str] = None,
           socket: Optional[str] = None, memory_cap: SizeLike = None,
           persistent_memory: Union[int, str, None] = None,
           host_reserve: Union[int, str, None] = None,
           host_headroom: Union[int, str, None] = None) -> bool:
    """Makes cotenant the process's CUDA allocator. Call it before the first CUDA tensor.

    role: None (cap only: no launch gate, and a coordinator neither protects
    nor throttles the job), "guaranteed" or "opportunistic".
    device: the CUDA device the job uses (default: COTENANT_DEVICE, else 0).
    name, socket: the job's name and the coordinator's socket when one runs.
    memory_cap: an initial cap (as set_memory_cap takes it), also told to the
    coordinator at registration.
    persistent_memory: the memory the job holds for its whole life (bytes or
    "10GiB"); a coordinator admits an opportunistic job only when it fits, and
    queues or refuses it otherwise (with the reason).
    host_reserve: host memory to pin now and keep (reserve_host_memory()),
    so that the job's first squeeze under a cap pins nothing. When the host
    cannot pin it, the job runs without it and says so (a RuntimeWarning).
    host_headroom: host memory the job never pins into (set_host_headroom());
    default COTENANT_HOST_HEADROOM. With a coordinator the larger of this and
    its [memory] host_headroom holds; 4 GiB when neither is given.

    Called again once cotenant is on (say, in a script that `cotenant run`
    started), it applies memory_cap, host_headroom and host_reserve as
    set_memory_cap() and the others do, and raises RuntimeError for a role,
    device, name, socket or persistent_memory other than the first call's
    (one left out, role included, keeps the first call's).

    Returns True when cotenant is on, False when COTENANT_DISABLE=1 keeps it off.
    Raises NoGpuError without a usable GPU, RuntimeError when PyTorch's own
    allocator already holds CUDA memory (the message says how to fix it), and
    ValueError for a name that cannot name a job (over 63 bytes, or a number).
    When a coordinator's socket is there but registration fails, the job runs
    on its own and says so (a RuntimeWarning and a line on stderr).
    """
    role = parse_role(role)
    to_cap(memory_cap)  # a bad cap fails before CUDA is touched
    persistent_bytes = parse_persistent_memory(persistent_memory)
    reserve_bytes = parse_host_reserve(host_reserve)
    headroom_bytes = parse_host_headroom(host_headroom)
    if name is not None:
        from cotenant.coordinator.protocol import job_name_problem

        problem = job_name_problem(name)
        if problem:
            raise ValueError(f"cotenant.enable(name=...): {problem}")
    from cotenant import settings

    index = parse_device(device)
    if index is None:
        index = parse_device(settings.get("device") or 0)
    if disabled_by_environment():
        return False
    with _state.lock:
        if _state.enabled:
            _enable_again(role, index, memory_cap, headroom_bytes, reserve_bytes,
                          {"name": name, "socket": socket, "persistent_memory": persistent_bytes})
            return True
        _refuse_if_torch_already_allocated()
        settings.warn_ignored_pytorch_options()
        settings.warn_unknown_variables()
        settings.export_for_extension()  # the allocator reads its two options with getenv
        _C = _extension()
        available, reason = _C.gpu_available()
        if not available:
            from cotenant.launch import driver_problem

            problem = driver_problem(index)  # the runtime calls a missing driver "insufficient"
            if problem is not None:
                reason = (f"cotenant found no usable NVIDIA GPU: {problem}. cotenant manages CUDA memory and needs "
                          "a CUDA device with a working driver; run on a GPU machine, or leave cotenant disabled "
                          "(COTENANT_DISABLE=1) on this one.")
            raise NoGpuError(reason)
        _C.install()  # raises _C.Error (a RuntimeError) if CUDA memory already exists
        _state.enabled, _state.device, _state.role = True, index, role
        _state.fixed_at_enable = {"name": name, "socket": socket, "persistent_memory": persistent_bytes}
        _install_optimizer_safe_point()
        _report_the_cap_in_mem_get_info()
        _count_graph_replays_as_ops()
        _count_triton_launches_as_ops()
        cap_bytes = None
        if memory_cap is not None:
            cap_bytes = set_memory_cap(memory_cap, index)
        _state.own_host_headroom = headroom_bytes
        _apply_host_headroom(_C)
        if reserve_bytes:
            _reserve_or_warn(_C, index, reserve_bytes)
        _join_coordinator(_C, role, index, name, socket, cap_bytes, persistent_bytes)
        _activate_gate(role, index)
        atexit.register(_shutdown)
    return True


def _enable_again(role: Optional[str], index: int, memory_cap: SizeLike, headroom_bytes: Optional[int],
                  reserve_bytes: Optional[int], fixed: Dict[str, Any]) -> None:
    """enable() in a process where cotenant is on already (the start-up hook of
    `cotenant run` enabled it, or the script calls enable() twice): the cap,
    host headroom and host reserve it gives are applied as their setters
    would; the role, device, name, socket and persistent memory were fixed
    at the first enable() (the coordinator knows the job by them), so a
    different one is refused before anything changes."""
    # No role given keeps the first call's, as for the name: a script's own
    # enable(memory_cap=...) under `cotenant run --opportunistic` sets a cap.
    if (role is not None and role != _state.role) or index != _state.device:
        raise RuntimeError(
            f"cotenant is already enabled with role={_state.role!r} on cuda:{_state.device}; "
            f"it cannot switch to role={role!r} on cuda:{index} in the same process")
    changed = [f"{key}={value!r} (it is {_state.fixed_at_enable.get(key)!r})" for key, value in fixed.items()
               if value is not None and value != _state.fixed_at_enable.get(key)]
    if changed:
        raise RuntimeError(
            f"cotenant is already enabled in this process; enable() cannot change {', '.join(changed)}: the job "
            "registered with it. Give it to the first enable() (or to `cotenant run`), or leave it out here")
    if memory_cap is not None:
        set_memory_cap(memory_cap, index)
    if headroom_bytes is not None:
        set_host_headroom(headroom_bytes)
    if reserve_bytes:
        reserve_host_memory(reserve_bytes, index)


def enable_from_environment() -> bool:
    """Enables cotenant as `cotenant run` asks, through the environment: the
    keys of COTENANT_CONF or their variables (cotenant.settings): enable
    (COTENANT_ENABLE=1), role, cap, device, socket, name, persistent, host_reserve,
    host_headroom.
    disable (COTENANT_DISABLE=1) wins over all. In a child of the job (its
    pid is not COTENANT_JOB_PID) it does nothing. Returns True when cotenant
    was enabled; raises SettingsError (a ValueError) for a setting that
    cannot be read, naming it.
    """
    from cotenant import settings

    settings.check_all()
    if disabled_by_environment() or not settings.flag("enable"):
        return False
    if is_child_of_a_job() or is_multiprocessing_helper(getattr(sys, "orig_argv", sys.argv)):
        return False  # a worker or helper the job started: the job itself is enabled
    return enable(role=settings.get("role"), device=settings.get("device"), name=settings.get("name"),
                  socket=settings.get("socket"), memory_cap=settings.value("cap"),
                  persistent_memory=settings.get("persistent"), host_reserve=settings.get("host_reserve"),
                  host_headroom=settings.get("host_headroom"))


def is_enabled() -> bool:
    return _state.enabled


def disable() -> None:
    """Lifts the memory cap, brings spilled memory back to the device (as far as
    it fits) and leaves the coordinator. The allocator itself stays installed:
    live tensors belong to it. To run without cotenant at all, start the
    process with COTENANT_DISABLE=1."""
    with _state.lock:
        if not _state.enabled:
            return
        _C = _extension()
        _stop_job_channel(_C)
        device = _state.device
        _C.lift_memory_caps(device)  # the coordinator's too: the job has left it
        _C.restore_all(device)
        _C.safe_point()
        if _state.optimizer_hook is not None:
            _state.optimizer_hook.remove()
            _state.optimizer_hook = None


# ---- caps, statistics, spill/restore ------------------------------------------------------


def set_memory_cap(size: SizeLike, device: Any = None) -> Optional[int]:
    """Caps the job's device-resident memory; None removes the cap.

    size: bytes (int), a string such as "6GiB" or "512MiB", or a fraction of
    the device such as 0.5. Lowering the cap below what the job holds moves its
    coldest pages to host memory at once (no OutOfMemoryError); raising it
    brings them back. The cap covers all of the job's device memory: its
    regions and CUDA graph pools are never capped or moved, so the rest of
    its memory gets what they leave (followed at each iteration mark).
    With a coordinator, the lower of this cap and the coordinator's holds.
    Returns the cap in bytes (None for no cap).
    """
    cap = to_cap(size)
    index = _resolve_device(device)
    _C = _extension()
    resolved = cap.resolve(_C.device_total_bytes(index))
    _C.set_memory_cap(index, resolved)
    _C.safe_point()
    return resolved


def memory_cap(device: Any = None) -> Optional[int]:
    """The job's cap in bytes (the lower of set_memory_cap()'s and a
    coordinator's), or None when there is none."""
    index = _resolve_device(device)
    cap = _extension().memory_cap(index)
    return None if cap is None else int(cap)


def summarize_stats(raw: Dict[str, Any]) -> Dict[str, Any]:
    """The device / host / cached split of a raw statistics map (no GPU needed)."""
    allocated = int(raw.get("allocated_bytes.all.current", 0))
    reserved = int(raw.get("reserved_bytes.all.current", 0))
    cap = raw.get("memory_cap")
    no_cap = 2**64 - 1
    return {
        "mode": raw.get("mode"),
        "host_page_kind": raw.get("host_page_kind"),
        "memory_cap": None if cap is None or cap in (no_cap, -1) else int(cap),
        "device_bytes": int(raw.get("device_resident_bytes.current", 0)),
        "host_bytes": int(raw.get("host_resident_bytes.current", 0)),
        "host_live_bytes": int(raw.get("host_live_bytes", 0)),
        "host_pool_bytes": int(raw.get("host_pool_bytes.current", 0)),
        "host_reserve_bytes": int(raw.get("host_reserve_bytes", 0)),
        "host_headroom_bytes": int(raw.get("host_headroom_bytes", 0)),
        "host_headroom_refusals": int(raw.get("num_host_headroom_refusals", 0)),
        "host_available_bytes": None if raw.get("host_available_bytes") is None else int(raw["host_available_bytes"]),
        "cached_bytes": max(reserved - allocated, 0),
        "allocated_bytes": allocated,
        "reserved_bytes": reserved,
        "pending_spill_bytes": int(raw.get("pending_spill_bytes", 0)),
        "pending_restore_bytes": int(raw.get("pending_restore_bytes", 0)),
        "spilled_bytes": int(raw.get("spilled_bytes", 0)),
        "restored_bytes": int(raw.get("restored_bytes", 0)),
        "raw": dict(raw),
    }


def memory_stats(device: Any = None) -> Dict[str, Any]:
    """Device-resident, host-resident and cached bytes, the cap and the mode
    ("remap": pages move both ways keeping their addresses; "pinned_fallback":
    over-cap memory comes from mapped pinned host memory), plus every raw
    counter under "raw" (torch.cuda.memory_stats() names and cotenant's).
    The numbers are the main allocator's, its cap included: what the job's
    cap (memory_cap()) leaves it beside the regions' and CUDA graph pools'
    device memory; "regions" lists the named regions on the device (see
    region()), whose memory is counted apart."""
    index = _resolve_device(device)
    _C = _extension()
    stats = summarize_stats(_C.stats(index))
    stats["regions"] = [row for row in _C.regions() if row["device"] == index]
    return stats


def reserve_host_memory(size: Union[int, str], device: Any = None) -> int:
    """Pins host memory now (rounded up to 2 MiB pages) and keeps it with the
    job for its whole life, so that the first time a cap squeezes the job its
    pages move out at the speed of a copy instead of waiting for the host to
    pin memory (pinning runs at a few GB/s, a copy over PCIe at tens). A
    spill uses the reserve's pages and gives them back to it when the pages
    return, and so does a region's kept pause (pause_region(name, keep=True)):
    the reserve is the device's. empty_cache() and removing the cap keep it.
    0 gives it back.

    What it costs: the reserve is pinned host memory no other process can
    use, and pinning it takes as long as the first squeeze would have.
    Returns the bytes reserved. Raises ValueError for a size it cannot read,
    RuntimeError when the host cannot pin that much (the reserve stays as it
    was) and where host pages are not used (the pinned fallback mode)."""
    bytes_ = parse_host_reserve(size)
    if bytes_ is None:
        raise TypeError("reserve_host_memory() needs a size: bytes (int) or a size string such as \"4GiB\"")
    index = _resolve_device(device)
    return int(_extension().reserve_host_memory(index, bytes_))


def set_host_headroom(size: Union[int, str]) -> int:
    """Keeps `size` of the host's memory available: the job pins no host
    memory (spills, kept pages, a reserve, a region's kept pause) that would
    leave the system less than that (the least of Linux's MemAvailable and
    what the process's memory cgroup leaves below its limit). Pinned memory
    cannot be swapped or reclaimed, so pinning the last of it hands the
    node to the kernel's OOM killer, which may pick any process.

    Past the headroom, a squeeze stops part way (its pages stay on the
    device and the next safe point retries), an allocation that needs host
    memory raises torch.OutOfMemoryError naming the headroom, and
    reserve_host_memory() raises RuntimeError. With a coordinator, the
    headroom in force is the larger of this and the coordinator's
    `[memory] host_headroom`; 4 GiB when neither the job (here,
    enable(host_headroom=...) or COTENANT_HOST_HEADROOM) nor a coordinator
    gives one. 0 pins until the host refuses. Applies to every device.
    Returns the headroom in force, in bytes."""
    bytes_ = parse_host_headroom(size)
    if bytes_ is None:
        raise TypeError("set_host_headroom() needs a size: bytes (int) or a size string such as \"4GiB\"")
    _require_enabled()
    _C = _extension()
    with _state.lock:
        _state.own_host_headroom = bytes_
        return _apply_host_headroom(_C)


def host_headroom() -> int:
    """The host headroom in force, in bytes (see set_host_headroom)."""
    _require_enabled()
    return int(_extension().host_headroom())


def _apply_host_headroom(_C) -> int:
    """Sets the headroom in force: the larger of the job's own and the
    coordinator's where either is given, else the default."""
    from cotenant.coordinator.policy import DEFAULT_HOST_HEADROOM_BYTES

    given = [v for v in (_state.own_host_headroom, _state.coordinator_host_headroom) if v is not None]
    bytes_ = max(given) if given else DEFAULT_HOST_HEADROOM_BYTES
    _C.set_host_headroom(bytes_)
    return bytes_


def spill_all(device: Any = None) -> int:
    """Moves every live device page to host memory now. Returns bytes moved."""
    index = _resolve_device(device)
    _C = _extension()
    _C.spill_all(index)
    return int(_C.safe_point())


def restore_all(device: Any = None) -> int:
    """Brings host pages back to the device, as far as the cap allows. Returns bytes moved."""
    index = _resolve_device(device)
    _C = _extension()
    _C.restore_all(index)
    return int(_C.safe_point())


# ---- regions ---------------------------------------------------------------------------


def _region_name(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise TypeError(f"a region's name is a non-empty string, e.g. cotenant.region(\"kv_cache\"); "
                        f"got {name!r}")
    return name


class Region:
    """A named region of CUDA memory that is paused and resumed as a whole.

    ``with region:`` tags the CUDA allocations this thread makes inside the
    block (tensors, caches, workspaces) as the region's. The region's memory
    lives in segments of its own, never sharing a page with other tensors, so
    pausing it moves or drops its bytes only. Tensors keep their addresses
    (``data_ptr()``) across pause and resume.

    - ``pause(keep=True)``: the region's pages move to host memory; device
      memory is freed, contents are kept. Tensors stay readable (over PCIe).
    - ``pause(keep=False)``: the pages are released; the addresses stay
      reserved. The tensors must not be used until ``resume()``, which backs
      them with zeroed device memory.
    - While paused, allocating in the region raises RuntimeError (resume
      first); dropping its tensors is fine. Pausing or resuming during a CUDA
      graph capture raises RuntimeError.

    Regions do not nest: entering another region inside one raises
    RuntimeError; entering the same region again is allowed. A region's
    memory is not under the memory cap.
    """

    def __init__(self, name: str) -> None:
        self._name = _region_name(name)

    @property
    def name(self) -> str:
        return self._name

    def __enter__(self) -> "Region":
        _require_enabled()
        _extension().region_enter(self._name)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        _extension().region_exit(self._name)

    def pause(self, *, keep: bool = True) -> int:
        """Pauses the region (see the class); returns the bytes moved or released."""
        return pause_region(self._name, keep=keep)

    def resume(self) -> int:
        """Resumes the paused region; returns the bytes moved back or mapped."""
        return resume_region(self._name)

    @property
    def state(self) -> Optional[str]:
        """"active", "paused (kept)", "paused (discarded)", or None before its first allocation."""
        for row in regions():
            if row["name"] == self._name:
                return row["state"]
        return None

    def __repr__(self) -> str:
        return f"cotenant.Region({self._name!r})"


def region(name: str) -> Region:
    """The region called ``name``: ``with cotenant.region("kv_cache"): ...``
    tags allocations; ``.pause(keep=...)`` and ``.resume()`` act on it."""
    return Region(name)


def pause_region(name: str, *, keep: bool = True) -> int:
    """Pauses region ``name`` on every device that holds it: ``keep=True``
    moves its pages to host memory (contents kept, same addresses),
    ``keep=False`` releases them (addresses kept; zeroed on resume). On
    every device or on none: where one fails, those done before it are
    resumed. Returns the bytes moved or released. RuntimeError for an unknown or already
    paused region, or during a CUDA graph capture."""
    _require_enabled()
    if not isinstance(keep, bool):
        raise TypeError(f"keep is True (move the region's pages to the host) or False (release them); "
                        f"got {keep!r}")
    return int(_extension().pause_region(_region_name(name), keep))


def resume_region(name: str) -> int:
    """Resumes a paused region: kept pages come back to the device, discarded
    ones are backed again with zeroed device memory at the same addresses.
    On every device where it is paused, or on none (see pause_region).
    Returns the bytes moved or mapped."""
    _require_enabled()
    return int(_extension().resume_region(_region_name(name)))


def regions() -> list:
    """One dict per region and device: name, device, state, allocated_bytes,
    device_bytes, host_bytes."""
    if not _state.enabled:
        return []
    return list(_extension().regions())


def safe_point() -> int:
    """Moves pages waiting for a safe point now; returns bytes moved. cotenant
    also does this at every ATen op entry and after every optimizer step."""
    if not _state.enabled:
        return 0
    return int(_extension().safe_point())


# ---- the pieces enable() wires together ---------------------------------------------------


def _refuse_if_torch_already_allocated() -> None:
    """Raises RuntimeError, saying how to fix it, when PyTorch's own allocator
    already holds CUDA memory: the switch must come before the first CUDA
    allocation. Checked through torch's Python API, before cotenant's
    extension touches the CUDA allocator."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    if torch.cuda.memory.get_allocator_backend() == "cotenant":
        return  # cotenant's own allocator, installed earlier in this process
    from cotenant import _core

    for device in range(torch.cuda.device_count()):
        held = torch.cuda.memory_allocated(device)
        if held > 0:
            raise RuntimeError(
                f"cotenant.enable() must run before the first CUDA allocation; PyTorch's own allocator "
                f"already holds {_core.format_size(held)} on cuda:{device}. Call cotenant.enable() at the top of "
                f"the script, before any tensor or model is moved to the GPU, or start the script with "
                f"`cotenant run -- python script.py`.")



def _install_optimizer_safe_point() -> None:
    """A safe point after each optimizer step: the iteration boundary."""
    _C = _extension()

    def after_step(optimizer, args, kwargs):  # noqa: ARG001 (torch's hook signature)
        # One step of the job: the iteration time (the job's one measurement,
        # which the coordinator reads for every role) and the allocator's mark.
        _C.iteration_boundary()
        _C.mark_iteration()
        if _C.has_pending_migrations():
            _C.safe_point()

    from torch.optim.optimizer import register_optimizer_step_post_hook

    _state.optimizer_hook = register_optimizer_step_post_hook(after_step)


def memory_info_under_cap(free: int, total: int, cap: int, device_bytes: int) -> tuple:
    """What torch.cuda.mem_get_info() reports under a cap: (free, total) as a
    job that sizes itself from them should see its device. Total is the cap
    (at most the device), free what the job may still place on the device
    under it (at most what the driver has free). No GPU needed."""
    return max(0, min(free, cap - device_bytes)), min(total, cap)


def _report_the_cap_in_mem_get_info() -> None:
    """torch.cuda.mem_get_info() answers with the device as the job may use
    it: under a cap, (free under the cap, the cap); without one, the driver's
    figures as before. Jobs that size themselves from it (an inference
    server's KV cache, accelerate's device_map="auto") then fit the cap
    instead of filling the device and spilling. The driver's own figures stay
    at torch.cuda.mem_get_info.__wrapped__ and torch.cuda.cudart().cudaMemGetInfo."""
    import functools

    import torch
    import torch.cuda.memory

    original = torch.cuda.memory.mem_get_info
    if getattr(original, "_cotenant_capped", False):
        return
    _C = _extension()

    @functools.wraps(original)
    def mem_get_info(device=None):
        free, total = original(device)
        index = torch.cuda._utils._get_device_index(device, optional=True)  # as torch's own reads it
        if index is None:
            index = torch.cuda.current_device()
        capped = _C.capped_device_bytes(index)
        if capped is None:
            return free, total
        return memory_info_under_cap(free, total, *capped)

    mem_get_info._cotenant_capped = True
    torch.cuda.memory.mem_get_info = mem_get_info
    torch.cuda.mem_get_info = mem_get_info


def _count_graph_replays_as_ops() -> None:
    """A CUDA graph replay launches its kernels outside ATen: it counts as one
    op, so a safe point waits until its kernels are launched (and then
    synchronizes) and a replay waits while pages move."""
    import torch

    original = torch.cuda.CUDAGraph.replay
    if getattr(original, "_cotenant_counted", False):
        return
    _C = _extension()

    def replay(self):
        _C.begin_explicit_op()
        try:
            return original(self)
        finally:
            _C.end_explicit_op()

    replay._cotenant_counted = True
    torch.cuda.CUDAGraph.replay = replay


_TRITON_LAUNCHER = "torch._inductor.runtime.triton_heuristics"


def _count_triton_launches_as_ops() -> None:
    """Triton kernels launch outside ATen: each launch counts as one op, as a
    graph replay does, so a safe point on another thread waits for it and it
    waits while pages move. Two places see them, each patched when it is
    first imported (importing them here would cost every job most of a
    second):
      - Triton's launch hooks (triton.knobs.runtime.launch_enter_hook and
        launch_exit_hook) see every launch through Triton's own launcher:
        hand-written @triton.jit kernels, and torch.compile's kernels that
        Inductor launches through Triton;
      - Inductor's CachingAutotuner.run sees every torch.compile launch,
        also those of Inductor's static launcher, which calls no hook."""
    _after_import(_TRITON_KNOBS, _add_triton_launch_hooks)
    _after_import(_TRITON_LAUNCHER, _patch_triton_launcher)


_TRITON_KNOBS = "triton.knobs"


def _add_triton_launch_hooks(knobs) -> None:
    runtime = getattr(knobs, "runtime", None)
    enter = getattr(runtime, "launch_enter_hook", None)
    leave = getattr(runtime, "launch_exit_hook", None)
    if not (hasattr(enter, "add") and hasattr(leave, "add")):
        return  # a Triton without hook chains: Inductor's launches are still counted
    _C = _extension()
    enter.add(_C.triton_launch_enter)  # a chain adds a hook once, however often enable() wires it
    leave.add(_C.triton_launch_exit)


def _patch_triton_launcher(module) -> None:
    autotuner = getattr(module, "CachingAutotuner", None)
    original = getattr(autotuner, "run", None)
    if original is None or getattr(original, "_cotenant_counted", False):
        return
    _C = _extension()

    def run(self, *args, **kwargs):
        _C.begin_explicit_op()
        try:
            return original(self, *args, **kwargs)
        finally:
            _C.triton_launch_exit()  # a failed launch skipped Triton's exit hook: end it here
            _C.end_explicit_op()

    run._cotenant_counted = True
    autotuner.run = run


def _after_import(name: str, patch) -> None:
    """Calls patch(module) once `name` is imported: now if it is, else right
    after its import runs."""
    import importlib.abc
    import importlib.util

    if name in sys.modules:
        patch(sys.modules[name])
        return

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                patch(module)

            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, Finder())


def _join_coordinator(_C, role, device, name, socket, cap_bytes, persistent_bytes=None) -> None:
    """Registers with the node's coordinator when one runs, and starts the
    C++ job channel that applies its caps and commands."""
    try:
        from cotenant.coordinator import client
    except ImportError:
        return  # this installation has no coordinator: the job runs on its own
    # Probe first: without a coordinator, enable() creates no CUDA context
    # (the device's size below needs one). No socket file: none was started,
    # and the job runs on its own quietly. Any other failure is said loudly:
    # the user expects this job to be managed.
    try:
        client.CoordinatorClient(socket, 5.0).close()
    except client.CoordinatorNotRunning:
        return
    except Exception as error:
        _warn_unmanaged(error)
        return
    try:
        registration = client.register(role or "cap_only", device, name=name, socket=socket,
                                       memory_cap=cap_bytes, persistent_bytes=persistent_bytes,
                                       device_total_bytes=_C.device_total_bytes(device),
                                       gpu_uuid=gpu_uuid(device) or None)
    except client.AdmissionRefused:
        raise  # the coordinator says this job can never fit: the user must know
    except Exception as error:
        # A broken coordinator must not stop training: the job runs on its own.
        _warn_unmanaged(error)
        return
    if registration is None:
        return  # no coordinator running
    _state.registration = registration
    if registration.host_headroom_bytes is not None:
        _state.coordinator_host_headroom = registration.host_headroom_bytes
        _apply_host_headroom(_C)
    if not registration.admitted:
        warnings.warn(f"cotenant: the coordinator queued this job ({registration.queue_reason}); "
                      f"it runs when the coordinator lets it", RuntimeWarning, stacklevel=3)
    try:
        _C.start_job_channel(registration.block_name, device)
    except Exception as error:
        # Registered, but the block it names is out of this process's reach (a container with a
        # /dev/shm of its own, a block removed meanwhile): no cap or command could arrive, so the
        # job runs on its own, as with a coordinator it cannot join. The coordinator reclaims the
        # block once no channel attaches to it.
        _state.registration = None
        if _state.coordinator_host_headroom is not None:
            _state.coordinator_host_headroom = None
            _apply_host_headroom(_C)
        _warn_unmanaged(error)
        return
    _state.job_channel = True


def gpu_uuid(device: int) -> str:
    """The UUID ("GPU-...") of CUDA device `device` as this process numbers it,
    or "" when torch cannot say. The coordinator and the launch gate's segment
    know GPUs by it: CUDA indices differ between CUDA_VISIBLE_DEVICES."""
    import torch

    try:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
    except Exception:
        return ""
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def _reserve_or_warn(_C, device: int, bytes_: int) -> None:
    try:
        _C.reserve_host_memory(device, bytes_)
    except RuntimeError as error:
        message = (f"cotenant: this job runs WITHOUT its host reserve: {error}. Its first squeeze under a cap "
                   "pins its host pages then")
        warnings.warn(message, RuntimeWarning, stacklevel=4)
        log.warning(message)


def _warn_unmanaged(error: BaseException) -> None:
    message = (f"cotenant: this job runs WITHOUT the coordinator: {error}. No cap or share the coordinator "
               "sets will reach it, and the coordinator does not count its memory")
    warnings.warn(message, RuntimeWarning, stacklevel=4)
    log.warning(message)  # also where warnings are filtered out


def _activate_gate(role, device) -> None:
    if role is None:
        return
    try:
        from cotenant import gate
        activate = gate._activate
    except (ImportError, AttributeError):
        warnings.warn(f"cotenant: role={role!r} was given but this build has no launch gate; "
                      f"the job runs ungated", RuntimeWarning, stacklevel=3)
        return
    activate(role, device)


def _stop_job_channel(_C) -> None:
    if _state.job_channel:
        _C.stop_job_channel()
        _state.job_channel = False


def _shutdown() -> None:
    # The job channel's thread must stop while the interpreter still runs.
    try:
        if _state.job_channel and "cotenant._C" in sys.modules:
            _stop_job_channel(sys.modules["cotenant._C"])
    except Exception:
        pass
