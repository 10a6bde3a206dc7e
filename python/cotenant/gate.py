"""The launch gate: an opportunistic job computes only in the guaranteed job's idle slots.

    import cotenant
    cotenant.enable(role="opportunistic")   # or "guaranteed"; None: no gate

    with cotenant.gate():                    # hand-launched kernels (Triton, raw CUDA)
        my_triton_kernel[grid](...)

    with cotenant.iteration():               # guaranteed side, loops without optimizer.step()
        model(batch)

    cotenant.gate.set_share(0.5)             # this process's duty-cycle share; 0 pauses

Roles (set by enable(role=...) or `cotenant run --guaranteed/--opportunistic`):

- opportunistic: every ATen op, on every thread, waits at op entry until
  fewer than k of its ops are in flight, the guaranteed job on the same GPU
  is idle, and its share allows it. Its current stream is a lowest-priority
  CUDA stream. CUDA graph replays are gated as one op.
- guaranteed: a cheap tracker publishes whether its GPU work is busy.

Every enabled job measures its iteration times once (optimizer.step(), or
`with cotenant.iteration():`); the coordinator reads them from the job's
report.

The jobs of one GPU find each other through a per-GPU shared-memory segment,
so enable(role=...) in both is enough. A coordinator, when one runs, sends
its share through the job's own block; the gate admits at the minimum of the
job's own share (set_share) and the coordinator's. This module is itself
callable: `cotenant.gate()` is the explicit gate.

Environment (read at activation, as COTENANT_CONF keys or variables; see
cotenant.settings): gate_max_in_flight / COTENANT_GATE_MAX_IN_FLIGHT (k,
default 2), gate_window_ms / COTENANT_GATE_WINDOW_MS (the share's window,
default 50), share / COTENANT_SHARE (the job's own share at start, default 1),
gpu_segment / COTENANT_GPU_SEGMENT (the segment's name, default from the
GPU's UUID), gate_group / COTENANT_GATE_GROUP (a group whose members' jobs
share the segment, for jobs of several users on one GPU).
"""

from __future__ import annotations

import atexit
import sys
import threading
import types
from typing import Any, Dict, Optional

__all__ = ["gate", "iteration", "set_share", "share", "role", "stats", "suspend", "resume",
           "parse_share"]

ROLES = ("guaranteed", "opportunistic")
DEFAULT_MAX_IN_FLIGHT = 2
DEFAULT_WINDOW_MS = 50.0


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.role: Optional[str] = None
        self.device: Optional[int] = None
        self.share = 1.0  # what set_share() asked for, applied at activation too
        self.share_set_by_user = False
        self.optimizer_hook: Any = None
        self.original_replay: Any = None
        self.stream: Any = None


_state = _State()


# ---- parsing (no torch) -------------------------------------------------------------


def parse_share(value: Any) -> float:
    """A share is a number in [0, 1]: the fraction of GPU-busy time the job may use."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"a share must be a number between 0 and 1, not {value!r}")
    try:
        share = float(value)
    except ValueError:
        raise ValueError(f"a share must be a number between 0 and 1, not {value!r}") from None
    if not 0.0 <= share <= 1.0:  # also refuses NaN
        raise ValueError(f"a share must be between 0 (paused) and 1 (no limit), got {share}; "
                         f"use 0.5 for half of the GPU time")
    return share


def activation_settings(environ: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """The gate's settings from the environment: COTENANT_CONF or the
    variables (see the module docstring and cotenant.settings)."""
    from cotenant import settings

    return {
        "max_in_flight": settings.value("gate_max_in_flight", environ, DEFAULT_MAX_IN_FLIGHT),
        "share_window_s": settings.value("gate_window_ms", environ, DEFAULT_WINDOW_MS) / 1000.0,
        "initial_share": settings.value("share", environ),
        "segment_name": settings.get("gpu_segment", environ) or "",
        "group_gid": settings.value("gate_group", environ),
    }


def _extension():
    from cotenant import _C  # noqa: PLC0415 (torch is imported only when a role is active)

    return _C


# ---- activation (called by cotenant.enable) ------------------------------------------


def _activate(role: Optional[str], device: int) -> None:
    """Turns the gate on for this process: `enable(role=...)` calls this after
    installing the allocator. role: "guaranteed", "opportunistic" or None."""
    if role is None:
        return
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; use \"guaranteed\" or \"opportunistic\"")
    settings = activation_settings()
    import torch

    _C = _extension()
    with _state.lock:
        if _state.role is not None:
            if (_state.role, _state.device) != (role, device):
                raise RuntimeError(f"the launch gate is already active as {_state.role} on "
                                   f"cuda:{_state.device}; a process has one role on one GPU")
            return
        if settings["initial_share"] is not None and not _state.share_set_by_user:
            _state.share = settings["initial_share"]
        _C.gate_set_share(_state.share)
        _C.gate_activate(role, device, settings["segment_name"], settings["max_in_flight"],
                         settings["share_window_s"], _gpu_uuid(device), settings["group_gid"])
        _state.role, _state.device = role, device
        # Leave the segment while the interpreter (and CUDA) still run: a
        # guaranteed job that exits must not leave its busy flag behind.
        atexit.register(_deactivate)
        if role == "opportunistic":
            _use_lowest_priority_stream(torch, device)
            _gate_graph_replays(torch)
        # Iteration boundaries from optimizer.step() come from cotenant.enable()'s
        # step hook, for every role (the one measurement).


def _gpu_uuid(device: int) -> str:
    from cotenant.api import gpu_uuid

    return gpu_uuid(device)


def _deactivate() -> None:
    """Turns the gate off (the process leaves the per-GPU segment)."""
    with _state.lock:
        if _state.role is None:
            return
        _C = _extension()
        if _state.optimizer_hook is not None:
            _state.optimizer_hook.remove()
            _state.optimizer_hook = None
        if _state.original_replay is not None:
            import torch

            torch.cuda.CUDAGraph.replay = _state.original_replay
            _state.original_replay = None
        _C.gate_deactivate()
        _state.role = _state.device = None


def _use_lowest_priority_stream(torch, device: int) -> None:
    # CUDA priorities: lower numbers are higher priority; the least priority
    # is the top of the range. Current streams are per thread: this sets the
    # activating thread's (autograd's backward threads follow the forward's
    # streams); other threads that launch work can call use_low_priority_stream().
    with torch.cuda.device(device):
        least, _greatest = torch.cuda.Stream.priority_range()  # (least, greatest), e.g. (0, -5)
        _state.stream = torch.cuda.Stream(device=device, priority=int(least))
    torch.cuda.set_stream(_state.stream)


def use_low_priority_stream() -> None:
    """Makes the opportunistic job's lowest-priority stream current on the calling thread."""
    if _state.stream is not None:
        import torch

        torch.cuda.set_stream(_state.stream)


def _gate_graph_replays(torch) -> None:
    """A CUDA graph replay launches all its kernels at once, outside ATen: gate it as one op."""
    original = torch.cuda.CUDAGraph.replay
    _state.original_replay = original
    _C = _extension()

    def replay(self):
        _C.gate_enter()
        try:
            return original(self)
        finally:
            _C.gate_exit()

    replay.__doc__ = original.__doc__
    torch.cuda.CUDAGraph.replay = replay


# ---- the API --------------------------------------------------------------------------


class _GateContext:
    """`with cotenant.gate():` admits the work inside as one op of the opportunistic
    job (kernels the op hook cannot see: Triton launches, raw CUDA, graph replays).
    Outside an opportunistic process it does nothing. Usable as a decorator."""

    def __enter__(self) -> "_GateContext":
        if _state.role == "opportunistic":
            _extension().gate_enter()
        return self

    def __exit__(self, *exc: Any) -> None:
        if _state.role == "opportunistic":
            _extension().gate_exit()

    def __call__(self, function):
        import functools

        @functools.wraps(function)
        def gated(*args, **kwargs):
            with _GateContext():
                return function(*args, **kwargs)

        return gated


class _IterationContext:
    """`with cotenant.iteration():` marks one iteration of a job whose loop has no
    optimizer.step() (inference, custom loops); the time between iterations is
    not counted. The iteration time goes to the coordinator (every role) and
    ends the allocator's step. Without cotenant enabled it does nothing."""

    def __enter__(self) -> "_IterationContext":
        if _enabled():
            _extension().iteration_begin()
        return self

    def __exit__(self, *exc: Any) -> None:
        if _enabled():
            _extension().iteration_boundary()
            _extension().mark_iteration()


def _enabled() -> bool:
    from cotenant import api

    return api.is_enabled()


def gate() -> _GateContext:
    """The explicit gate: `with cotenant.gate(): launch_by_hand(...)`."""
    return _GateContext()


def iteration() -> _IterationContext:
    return _IterationContext()


def set_share(value: Any) -> float:
    """Sets this process's own compute share in [0, 1]: the fraction of GPU-busy
    time it may use over a short window. 0 pauses it at its next op; raising it
    resumes. A coordinator's share, when one runs, caps this one: the gate
    admits at min(this, the coordinator's), and neither replaces the other
    (stats() shows share, user_share and coordinator_share). Any thread."""
    value = parse_share(value)
    _state.share = value
    _state.share_set_by_user = True
    if _state.role is not None:
        _extension().gate_set_share(value)
    return value


def share() -> float:
    """This process's own share, as set (stats()["share"] is the one in force)."""
    if _state.role is not None:
        return float(_extension().gate_share())
    return _state.share


def role() -> Optional[str]:
    return _state.role


def stats() -> Dict[str, Any]:
    """The gate's counters under one set of names (the C++ LaunchGateStats
    list): admitted ops, waits by reason, busy time in the window; share (in
    force), user_share, coordinator_share; the job's iteration times
    (iteration_count, iteration_last_ns, iteration_ewma_ns, iteration_p99_ns,
    iteration_total_ns: all of them summed)."""
    if _state.role is None and not _enabled():
        return {"role": None, "share": _state.share, "user_share": _state.share, "coordinator_share": 1.0}
    return dict(_extension().gate_stats())


def suspend() -> None:
    """Stops every thread of this opportunistic process at its next op that may
    use the GPU (CPU work goes on: docs/launch-gate.md) and returns once its
    in-flight GPU work has drained (the safe point for suspend)."""
    if _state.role == "opportunistic":
        _extension().gate_close()


def resume() -> None:
    if _state.role == "opportunistic":
        _extension().gate_reopen()


class _CallableModule(types.ModuleType):
    """Lets `cotenant.gate()` be the explicit gate while `cotenant.gate` stays this module."""

    def __call__(self) -> _GateContext:
        return _GateContext()


sys.modules[__name__].__class__ = _CallableModule
