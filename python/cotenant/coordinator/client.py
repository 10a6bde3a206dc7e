"""Talking to the coordinator: job registration and administrator calls.

    reg = register("opportunistic", device=0)   # None when no coordinator runs
    if reg is not None:
        channel = reg.open_channel(allocator=...)   # the C++ JobChannel thread

Jobs run on their own when no coordinator is running: register() returns
None instead of raising, so `cotenant.enable()` works the same either way.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

from cotenant.coordinator import protocol
from cotenant.coordinator.paths import default_socket_path

__all__ = [
    "AdmissionRefused", "CoordinatorClient", "CoordinatorError", "CoordinatorUnavailable", "Registration",
    "default_socket_path", "history", "register", "set_cap", "set_share", "send_command", "status",
    "QueueEnded", "cancel", "wait_for_admission",
]


class CoordinatorError(RuntimeError):
    """The coordinator answered with an error; .code is the protocol's error code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class AdmissionRefused(CoordinatorError):
    """The coordinator will never have room for this job on this GPU (the message says why)."""


class CoordinatorUnavailable(ConnectionError):
    """No coordinator answers on the socket."""


class CoordinatorClient:
    """One connection; requests are answered in order."""

    def __init__(self, socket_path: Optional[str] = None, timeout: float = 5.0) -> None:
        self.socket_path = socket_path or default_socket_path()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(self.socket_path)
        except (FileNotFoundError, ConnectionRefusedError) as error:
            self._sock.close()
            raise CoordinatorUnavailable(
                f"no cotenant coordinator at {self.socket_path} ({error.strerror}); start one with "
                "`cotenant coordinator`, or pass --socket / set COTENANT_SOCKET"
            ) from None
        except PermissionError:
            self._sock.close()
            raise
        self._file = self._sock.makefile("rb")
        self._next_id = 1

    def request(self, op: str, **fields: Any) -> Dict[str, Any]:
        message = protocol.request(op, self._next_id, **fields)
        self._next_id += 1
        self._sock.sendall(protocol.encode(message))
        line = self._file.readline(protocol.MAX_REPLY_BYTES + 1)
        if not line:
            raise CoordinatorUnavailable(f"the coordinator at {self.socket_path} closed the connection")
        reply = json.loads(line)
        if not reply.get("ok"):
            error = reply.get("error", {})
            code, text = error.get("code", "unknown"), error.get("message", "the coordinator refused the request")
            if code == protocol.ADMISSION_REFUSED:
                raise AdmissionRefused(code, text)
            raise CoordinatorError(code, text)
        return reply

    def close(self) -> None:
        self._file.close()
        self._sock.close()

    def __enter__(self) -> "CoordinatorClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass(frozen=True)
class Registration:
    """A job's place with the coordinator: the shared-memory block its JobChannel opens."""

    job_id: int
    name: str
    block_name: str
    memory_cap: Optional[int]
    share: float
    admitted: bool
    queue_reason: str
    socket_path: str

    def open_channel(self, **hooks: Any):
        """Starts the C++ JobChannel on this job's block (see cotenant._core.JobChannel)."""
        from cotenant import _core

        channel = _core.JobChannel(self.block_name, **hooks)
        channel.start()
        return channel


def _cap(value: Any) -> Union[int, str, None]:
    """A cap for the wire, checked here by the one parser (cotenant._core.Cap):
    bytes stay an int, a fraction travels as its text and the coordinator
    resolves it on the job's GPU, none is null."""
    from cotenant import _core

    if isinstance(value, bool) or not isinstance(value, (int, float, str, type(None), _core.Cap)):
        raise TypeError(f"a memory cap must be bytes, a size string, a fraction or None; got {type(value).__name__}")
    try:
        cap = _core.Cap(value)
    except _core.Error as error:
        raise ValueError(str(error)) from None
    if cap.is_none:
        return None
    return cap.bytes if cap.bytes is not None else cap.text


def _persistent(value: Union[int, str, None]) -> Optional[int]:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    from cotenant._core import parse_size  # the one parser for sizes

    return parse_size(str(value))


def register(
    role: str,
    device: int,
    name: Optional[str] = None,
    socket: Optional[str] = None,
    memory_cap: Union[int, str, None] = None,
    persistent_bytes: Union[int, str, None] = None,
    device_total_bytes: Optional[int] = None,
    timeout: float = 5.0,
) -> Optional[Registration]:
    """Registers the calling process as a job. Returns None when no coordinator
    is running (the job then runs on its own). Raises AdmissionRefused when
    the coordinator says the job can never fit, CoordinatorError otherwise."""
    if role not in protocol.ROLES:
        raise ValueError(f"role must be one of {', '.join(protocol.ROLES)}, not {role!r}")
    fields: Dict[str, Any] = {"role": role, "device": int(device)}
    if name:
        fields["name"] = name[: protocol.MAX_NAME_CHARS]
    cap = _cap(memory_cap)
    if cap is not None:
        fields["memory_cap"] = cap
    persistent = _persistent(persistent_bytes)
    if persistent:
        fields["persistent_bytes"] = persistent
    if device_total_bytes:
        fields["device_total_bytes"] = int(device_total_bytes)
    try:
        client = CoordinatorClient(socket, timeout)
    except CoordinatorUnavailable:
        return None
    with client:
        reply = client.request("register", **fields)
    return Registration(
        job_id=reply["job_id"], name=reply["name"], block_name=reply["block"], memory_cap=reply["memory_cap"],
        share=reply["share"], admitted=reply["admitted"], queue_reason=reply.get("queue_reason", ""),
        socket_path=client.socket_path,
    )


def _call(op: str, socket_path: Optional[str], **fields: Any) -> Dict[str, Any]:
    with CoordinatorClient(socket_path) as client:
        return client.request(op, **fields)


def status(socket: Optional[str] = None) -> Dict[str, Any]:
    """The coordinator's view: {"coordinator": ..., "gpus": [...], "jobs": [...]}."""
    return _call("status", socket)


def history(socket: Optional[str] = None, since: float = 0) -> List[Dict[str, Any]]:
    return _call("history", socket, since=int(since))["records"]


def set_cap(job: Union[str, int], size: Union[int, str, None], socket: Optional[str] = None) -> Dict[str, Any]:
    """Bounds a job's device memory (a size like "6GiB"; None removes the bound)."""
    return _call("set_cap", socket, job=str(job), memory_cap=_cap(size))


def set_share(job: Union[str, int], share: Union[float, str], socket: Optional[str] = None) -> Dict[str, Any]:
    """Pins a job's compute share in [0, 1]; "auto" hands it back to the policy."""
    value: Union[float, str] = share if share == "auto" else float(share)
    return _call("set_share", socket, job=str(job), share=value)


def send_command(job: Union[str, int], command: str, socket: Optional[str] = None) -> Dict[str, Any]:
    """spill_all, restore_all, suspend or resume."""
    return _call("command", socket, job=str(job), command=command)


# --- the job queue -------------------------------------------------------------------


class QueueEnded(CoordinatorError):
    """The queued job left the queue without being admitted (cancelled); the message says how."""


def cancel(job: Union[str, int], socket: Optional[str] = None) -> Dict[str, Any]:
    """Removes a waiting job from the queue (its name or ticket)."""
    return _call("cancel", socket, job=str(job))


def wait_for_admission(
    socket: Optional[str] = None,
    name: Optional[str] = None,
    role: Optional[str] = None,
    gpus: int = 1,
    persistent_bytes: Union[int, str, None] = None,
    peak_bytes: Union[int, str, None] = None,
    poll_s: float = 0.2,
    on_queued=None,
) -> Dict[str, Any]:
    """Queues the calling process and returns once the coordinator admits it:
    {"ticket", "gpus" (GPU indices), "role", ...}. on_queued(state) is called once,
    with the ticket, right after submission. Raises CoordinatorUnavailable without a
    coordinator, AdmissionRefused when the job can never fit, QueueEnded when cancelled."""
    import time

    fields: Dict[str, Any] = {"gpus": int(gpus)}
    if name:
        fields["name"] = name[: protocol.MAX_NAME_CHARS]
    if role:
        fields["role"] = role
    for key, value in (("persistent_bytes", persistent_bytes), ("peak_bytes", peak_bytes)):
        size = _persistent(value)
        if size:
            fields[key] = size
    with CoordinatorClient(socket) as client:
        state = client.request("submit", **fields)
        if on_queued is not None:
            on_queued(state)
        while True:
            if state["state"] == "running":
                return state
            if state["state"] == "refused":
                raise AdmissionRefused(protocol.ADMISSION_REFUSED, state.get("reason", "the job can never fit"))
            if state["state"] in ("cancelled", "finished"):
                raise QueueEnded("cancelled", f"the queued job was {state['state']}: {state.get('reason', '')}")
            time.sleep(poll_s)
            state = client.request("queue_state", ticket=state["ticket"])
