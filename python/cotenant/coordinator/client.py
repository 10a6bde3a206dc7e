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
import pwd
import random
import socket
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set, Union

from cotenant.coordinator import paths, protocol
from cotenant.coordinator.paths import default_socket_path

__all__ = [
    "AdmissionRefused", "CoordinatorClient", "CoordinatorError", "CoordinatorNotRunning", "CoordinatorUnavailable",
    "Registration", "UntrustedCoordinator", "default_socket_path", "history", "register", "set_cap", "set_share",
    "send_command", "status", "trusted_coordinator_uids", "QueueEnded", "cancel", "wait_for_admission",
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


class CoordinatorNotRunning(CoordinatorUnavailable):
    """There is no socket file at the path: no coordinator was started there
    (a job then runs on its own, silently)."""


class UntrustedCoordinator(CoordinatorError):
    """The socket is served by a uid the client does not trust: neither root,
    nor the client's own uid, nor $COTENANT_COORDINATOR_USER."""

    def __init__(self, message: str):
        super().__init__(protocol.UNTRUSTED_COORDINATOR, message)


def trusted_coordinator_uids() -> Set[int]:
    """Who may serve a coordinator this process talks to: root, itself, and
    the service account named by $COTENANT_COORDINATOR_USER (a user name or uid)."""
    uids = {0, os.getuid(), os.geteuid()}
    from cotenant import settings

    configured = settings.get("coordinator_user") or ""
    if configured:
        try:
            uids.add(int(configured) if configured.isdigit() else pwd.getpwnam(configured).pw_uid)
        except KeyError:
            raise CoordinatorError(
                protocol.UNTRUSTED_COORDINATOR,
                f"${paths.COORDINATOR_USER_ENV} names {configured!r}, which is no user on this machine; "
                "set it to the coordinator's user name or uid") from None
    return uids


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "no such user"


# Connecting retries while the coordinator's listen queue is full (EAGAIN) or
# it refuses this uid's extra connections (busy): from 5 ms, doubling, at most
# 250 ms apart, for the client's whole timeout.
_FIRST_BACKOFF_S = 0.005
_MAX_BACKOFF_S = 0.25
# A queued process whose coordinator went away waits this long for it to come back.
_RECONNECT_S = 60.0


class CoordinatorClient:
    """One connection; requests are answered in order. The client checks who
    serves the socket (SO_PEERCRED) before it sends anything."""

    def __init__(self, socket_path: Optional[str] = None, timeout: float = 5.0) -> None:
        self.socket_path = socket_path or default_socket_path()
        self.timeout = timeout
        self._deadline = time.monotonic() + timeout
        self._backoff = _FIRST_BACKOFF_S
        self._connect()
        self._next_id = 1

    def _connect(self) -> None:
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(max(0.05, self._deadline - time.monotonic()))
            try:
                sock.connect(self.socket_path)
                break
            except FileNotFoundError:
                sock.close()
                raise CoordinatorNotRunning(
                    f"no cotenant coordinator at {self.socket_path} (no such socket); start one with "
                    "`cotenant coordinator`, or pass --socket / set COTENANT_SOCKET") from None
            except ConnectionRefusedError:
                sock.close()
                raise CoordinatorUnavailable(
                    f"the coordinator socket {self.socket_path} exists but no coordinator listens on it (it "
                    "died?); start one with `cotenant coordinator`") from None
            except (BlockingIOError, socket.timeout) as error:  # the listen queue is full
                sock.close()
                if isinstance(error, socket.timeout) or not self._wait_before_retry():
                    raise self._timed_out("did not accept the connection") from None
            except PermissionError:
                sock.close()
                raise
            except OSError as error:  # a path no socket can have: too long (108 bytes), under a file, ...
                sock.close()
                raise CoordinatorUnavailable(
                    f"cannot reach a coordinator at {self.socket_path}: {error.strerror or error}; pass --socket / "
                    "set COTENANT_SOCKET to a coordinator's socket (a path of at most 107 bytes)") from None
        self._sock = sock
        self._file = sock.makefile("rb")
        _pid, uid, _gid = protocol.peer_credentials(sock)
        if uid not in trusted_coordinator_uids():
            self.close()
            raise UntrustedCoordinator(
                f"the socket {self.socket_path} is served by uid {uid} ({_user_name(uid)}), not by root, you or "
                f"the coordinator user you trust (${paths.COORDINATOR_USER_ENV}): refusing to talk to it, as "
                f"another user may be impersonating the coordinator. If uid {uid} runs your node's coordinator, "
                f"set {paths.COORDINATOR_USER_ENV}={_user_name(uid)}")

    def _wait_before_retry(self) -> bool:
        """Sleeps the next backoff step; False when the deadline has passed."""
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(self._backoff * random.uniform(0.5, 1.0), remaining))
        self._backoff = min(self._backoff * 2, _MAX_BACKOFF_S)
        return True

    def _timed_out(self, what: str) -> CoordinatorUnavailable:
        return CoordinatorUnavailable(
            f"the coordinator at {self.socket_path} {what} within {self.timeout:g} s: it may be hung or "
            "overloaded; check its log, or restart it")

    def request(self, op: str, **fields: Any) -> Dict[str, Any]:
        # Each request has the whole timeout (a queued process polls one connection for hours).
        self._deadline = time.monotonic() + self.timeout
        message = protocol.request(op, self._next_id, **fields)
        self._next_id += 1
        while True:
            reply = self._exchange(message)
            error = reply.get("error", {}) if not reply.get("ok") else {}
            # "busy" comes unasked, before the request is read: sending it again is safe.
            if error.get("code") == protocol.BUSY and reply.get("id") is None and self._wait_before_retry():
                self.close()
                self._connect()
                continue
            break
        if not reply.get("ok"):
            code, text = error.get("code", "unknown"), error.get("message", "the coordinator refused the request")
            if code == protocol.ADMISSION_REFUSED:
                raise AdmissionRefused(code, text)
            raise CoordinatorError(code, text)
        return reply

    def _exchange(self, message: Dict[str, Any]) -> Dict[str, Any]:
        self._sock.settimeout(max(0.05, self._deadline - time.monotonic()))
        try:
            self._sock.sendall(protocol.encode(message))
        except BrokenPipeError:
            pass  # closed at once (busy): its reply is still there to read
        try:
            line = self._file.readline(protocol.MAX_REPLY_BYTES + 1)
        except socket.timeout:
            raise self._timed_out("did not answer") from None
        except ConnectionResetError:
            line = b""
        if not line:
            raise CoordinatorUnavailable(f"the coordinator at {self.socket_path} closed the connection")
        try:
            reply = json.loads(line)
        except ValueError:
            raise CoordinatorError(protocol.BAD_JSON,
                                   f"the coordinator at {self.socket_path} answered with something that is not "
                                   "JSON; run the job and the coordinator from the same cotenant version") from None
        if not isinstance(reply, dict):
            raise CoordinatorError(protocol.BAD_REQUEST, f"the coordinator at {self.socket_path} sent {reply!r}")
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
    host_headroom_bytes: Optional[int] = None  # the node's host headroom (a coordinator too old to say: None)

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
    from cotenant.api import to_cap  # imports no torch

    cap = to_cap(value)
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
    gpu_uuid: Optional[str] = None,
) -> Optional[Registration]:
    """Registers the calling process as a job. Returns None when no coordinator
    was started on the socket (no socket file: the job then runs on its own).
    Raises ValueError for a name that cannot name a job, AdmissionRefused when
    the coordinator says the job can never fit, CoordinatorUnavailable when a
    coordinator's socket is there but nothing answers, CoordinatorError
    (UntrustedCoordinator among them) otherwise."""
    if role not in protocol.ROLES:
        raise ValueError(f"role must be one of {', '.join(protocol.ROLES)}, not {role!r}")
    fields: Dict[str, Any] = {"role": role, "device": int(device)}
    if name:
        problem = protocol.job_name_problem(name)
        if problem:
            raise ValueError(problem)
        fields["name"] = name
    cap = _cap(memory_cap)
    if cap is not None:
        fields["memory_cap"] = cap
    persistent = _persistent(persistent_bytes)
    if persistent:
        fields["persistent_bytes"] = persistent
    if device_total_bytes:
        fields["device_total_bytes"] = int(device_total_bytes)
    if gpu_uuid:  # the GPU itself, whatever index CUDA_VISIBLE_DEVICES gives it here
        fields["gpu_uuid"] = gpu_uuid
    try:
        client = CoordinatorClient(socket, timeout)
    except CoordinatorNotRunning:
        return None
    with client:
        reply = client.request("register", **fields)
    return Registration(
        job_id=reply["job_id"], name=reply["name"], block_name=reply["block"], memory_cap=reply["memory_cap"],
        share=reply["share"], admitted=reply["admitted"], queue_reason=reply.get("queue_reason", ""),
        socket_path=client.socket_path, host_headroom_bytes=_headroom(reply.get("host_headroom_bytes")),
    )


def _headroom(value: Any) -> Optional[int]:
    """The coordinator's host headroom from a reply: a non-negative int, else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


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
    reconnect_s: float = _RECONNECT_S,
) -> Dict[str, Any]:
    """Queues the calling process and returns once the coordinator admits it:
    {"ticket", "gpus" (GPU indices), "role", ...}. on_queued(state) is called once,
    with the ticket, right after submission. A coordinator that restarts meanwhile
    keeps the ticket: the process reconnects (for up to reconnect_s) and waits on.
    Raises CoordinatorUnavailable without a coordinator (or when it does not come
    back), AdmissionRefused when the job can never fit, QueueEnded when cancelled
    or when a restarted coordinator no longer knows the ticket."""
    fields: Dict[str, Any] = {"gpus": int(gpus)}
    if name:
        problem = protocol.job_name_problem(name)
        if problem:
            raise ValueError(problem)
        fields["name"] = name
    if role:
        fields["role"] = role
    for key, value in (("persistent_bytes", persistent_bytes), ("peak_bytes", peak_bytes)):
        size = _persistent(value)
        if size:
            fields[key] = size
    client = CoordinatorClient(socket)
    try:
        state = client.request("submit", **fields)
        ticket = state["ticket"]
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
            try:
                state = client.request("queue_state", ticket=ticket)
            except CoordinatorUnavailable:
                client.close()
                client = _reconnect(client.socket_path, ticket, reconnect_s)
                try:
                    state = client.request("queue_state", ticket=ticket)
                except CoordinatorError as error:
                    if error.code != protocol.NO_SUCH_JOB:
                        raise
                    raise QueueEnded("lost", f"the coordinator at {client.socket_path} restarted and no longer "
                                     f"knows ticket {ticket} (its state file was lost or unreadable); submit "
                                     "the job again") from None
    finally:
        client.close()


def _reconnect(socket_path: str, ticket: int, within_s: float) -> CoordinatorClient:
    """A new connection to a coordinator that went away while ticket `ticket` waited."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return CoordinatorClient(socket_path)
        except CoordinatorUnavailable:
            if time.monotonic() >= deadline:
                raise CoordinatorUnavailable(
                    f"the coordinator at {socket_path} went away while ticket {ticket} waited in its queue and "
                    f"did not come back within {within_s:g} s; restart it (the ticket is kept in its state "
                    "file) and submit the job again if it is gone") from None
            time.sleep(0.1)
